//go:build linux || darwin || dragonfly || freebsd || netbsd || openbsd

package safetensors

import (
	"bufio"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
)

// stagingFiles lists the staging files beside path.
func stagingFiles(t *testing.T, path string) []string {
	t.Helper()
	m, err := filepath.Glob(filepath.Join(filepath.Dir(path), "."+filepath.Base(path)+".tmp-*"))
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// TestWriteFileRemovesStaleStagingFiles checks that the staging files of
// earlier writes to the same path that died mid-write are removed by the
// next write, and that nothing else in the folder is touched.
func TestWriteFileRemovesStaleStagingFiles(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "m.safetensors")
	stale := []string{".m.safetensors.tmp-123", ".m.safetensors.tmp-4294967295"}
	keep := []string{
		".m.safetensors.tmp-12a",     // not a name a writer makes
		".m.safetensors.tmp-",        // no random part
		".m.safetensors.tmp-1.tmp-2", // a staging file of the target m.safetensors.tmp-1
		"m.safetensors.tmp-123",      // no leading dot
		".other.safetensors.tmp-123", // another target
		".m.safetensors.tmp-77.keep", // suffix after the digits
		".m.safetensors.tmp-99/",     // a folder (made below)
	}
	for _, n := range append(slices.Clone(stale), keep...) {
		if strings.HasSuffix(n, "/") {
			if err := os.Mkdir(filepath.Join(dir, n), 0o755); err != nil {
				t.Fatal(err)
			}
			continue
		}
		writeRaw(t, filepath.Join(dir, n), []byte("partial"))
	}
	if err := WriteFile(path, checkpoint(), nil); err != nil {
		t.Fatal(err)
	}
	want := []string{"m.safetensors"}
	for _, n := range keep {
		want = append(want, strings.TrimSuffix(n, "/"))
	}
	slices.Sort(want)
	if got := dirEntries(t, dir); !slices.Equal(got, want) {
		t.Errorf("folder holds\n%q\nwant\n%q", got, want)
	}
}

// stagingHelperEnv makes the test binary a writer that stops mid-write
// (see TestWriteFileKeepsLiveWritersStagingFile).
const stagingHelperEnv = "SAFETENSORS_TEST_STUCK_WRITER"

// TestWriteFileKeepsLiveWritersStagingFile runs a second process that
// stops in the middle of writing path: a write by this process must leave
// that writer's staging file alone while it lives, and remove it once the
// writer has been killed with SIGKILL.
func TestWriteFileKeepsLiveWritersStagingFile(t *testing.T) {
	if p := os.Getenv(stagingHelperEnv); p != "" {
		stuckWriter(p)
		return
	}
	dir := t.TempDir()
	path := filepath.Join(dir, "m.safetensors")
	cmd := exec.Command(os.Args[0], "-test.run=^TestWriteFileKeepsLiveWritersStagingFile$")
	cmd.Env = append(os.Environ(), stagingHelperEnv+"="+path)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		// The writer is killed below; this is for early failures.
		cmd.Process.Kill()
		cmd.Wait()
		stdin.Close()
	}()
	line, err := bufio.NewReader(stdout).ReadString('\n')
	if err != nil || line != "writing\n" {
		t.Fatalf("writer said %q, %v", line, err)
	}
	live := stagingFiles(t, path)
	if len(live) != 1 {
		t.Fatalf("staging files while the writer is stuck: %q, want 1", live)
	}
	if err := WriteFile(path, checkpoint(), nil); err != nil {
		t.Fatal(err)
	}
	if got := stagingFiles(t, path); !slices.Equal(got, live) {
		t.Fatalf("staging files after a write beside a live writer: %q, want %q", got, live)
	}
	if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	cmd.Wait()
	if got := stagingFiles(t, path); !slices.Equal(got, live) {
		t.Fatalf("staging files after the kill: %q, want %q", got, live)
	}
	if err := WriteFile(path, checkpoint(), nil); err != nil {
		t.Fatal(err)
	}
	if got := stagingFiles(t, path); len(got) != 0 {
		t.Errorf("staging files of a killed writer left after the next write: %q", got)
	}
	f, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := f.Verify(); err != nil {
		t.Error(err)
	}
}

// stuckWriter starts writing path, says "writing" on stdout and waits for
// stdin to close (it is killed first).
func stuckWriter(path string) {
	err := atomicWrite(path, func(w io.Writer) error {
		if _, err := w.Write([]byte("partial")); err != nil {
			return err
		}
		os.Stdout.WriteString("writing\n")
		_, err := io.Copy(io.Discard, os.Stdin)
		return err
	})
	if err != nil {
		os.Stderr.WriteString(err.Error() + "\n")
	}
	os.Exit(1)
}
