package checkpoint

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement/placementtest"
	"github.com/b7ea7098/loom/safetensors"
)

// The crash helper: with crashAtEnv set, the test binary saves step 2 into
// crashRootEnv on 3 in-process ranks and SIGKILLs itself just before the
// file operation of that number (1-based, counted over all ranks).
const (
	crashAtEnv    = "CHECKPOINT_TEST_KILL_AT"
	crashRootEnv  = "CHECKPOINT_TEST_ROOT"
	crashAsyncEnv = "CHECKPOINT_TEST_ASYNC" // "1": through a Saver, in the background
)

// step2Tensors are testTensors with other values.
func step2Tensors() map[string]tdef {
	out := map[string]tdef{}
	for n, d := range testTensors {
		d.seed += 100
		out[n] = d
	}
	return out
}

// TestKilledSave kills the saving process (SIGKILL) before each file
// operation of a save in turn (mkdir, create, write, fsync, rename, remove
// of every rank and of the commit and prune), and then loads: Latest is
// always a complete checkpoint (the previous one until the commit rename,
// the new one after it) with its exact values; no other folder loads; and
// the next save succeeds and leaves no remains. It does so for Save and
// for a Saver's background save (killed while it writes in the
// background, after Saver.Save has returned).
func TestKilledSave(t *testing.T) {
	if at := os.Getenv(crashAtEnv); at != "" {
		killedSaver(t, at, os.Getenv(crashRootEnv), os.Getenv(crashAsyncEnv) == "1")
		return
	}
	for _, async := range []bool{false, true} {
		t.Run(map[bool]string{false: "Save", true: "Saver"}[async], func(t *testing.T) { killSaves(t, async) })
	}
}

func killSaves(t *testing.T, async bool) {
	sawOld, sawNew := false, false
	points := 0
	for n := 1; ; n++ {
		root := t.TempDir()
		saveOn(t, root, tp3, testTensors, WithStep(1))
		cmd := exec.Command(os.Args[0], "-test.run=^TestKilledSave$", "-test.count=1")
		cmd.Env = append(os.Environ(), crashAtEnv+"="+strconv.Itoa(n), crashRootEnv+"="+root, crashAsyncEnv+"="+map[bool]string{false: "0", true: "1"}[async])
		out, err := cmd.CombinedOutput()
		var ee *exec.ExitError
		switch {
		case err == nil:
			if !strings.Contains(string(out), "saved without being killed") {
				t.Fatalf("point %d: the helper exited without saying it saved:\n%s", n, out)
			}
			points = n - 1
		case errors.As(err, &ee) && ee.Sys().(syscall.WaitStatus).Signal() == syscall.SIGKILL:
		default:
			t.Fatalf("point %d: the helper failed: %v\n%s", n, err, out)
		}
		if err == nil {
			break
		}
		latest, lerr := Latest(root)
		if lerr != nil {
			t.Fatalf("killed before point %d: Latest: %v", n, lerr)
		}
		var want map[string]tdef
		switch filepath.Base(latest) {
		case stepName(1):
			want, sawOld = testTensors, true
		case stepName(2):
			want, sawNew = step2Tensors(), true
		default:
			t.Fatalf("killed before point %d: Latest is %s", n, latest)
		}
		if err := loadCheck(latest, want); err != nil {
			t.Fatalf("killed before point %d: loading %s: %v", n, latest, err)
		}
		ents, _ := os.ReadDir(root)
		for _, e := range ents {
			p := filepath.Join(root, e.Name())
			if !e.IsDir() || p == latest || filepath.Base(p) == stepName(1) {
				continue
			}
			if err := loadCheck(p, step2Tensors()); err == nil && filepath.Base(p) != stepName(2) {
				t.Fatalf("killed before point %d: the partial checkpoint %s loads", n, p)
			}
		}
		// The lock died with the process; the next save tidies up.
		saveOn(t, root, tp3, testTensors, WithStep(3))
		ents, _ = os.ReadDir(root)
		for _, e := range ents {
			if strings.HasPrefix(e.Name(), stagingPrefix) || strings.HasPrefix(e.Name(), trashPrefix) {
				t.Fatalf("killed before point %d: %s left after the next save", n, e.Name())
			}
		}
	}
	if points < 20 || !sawOld || !sawNew {
		t.Fatalf("%d kill points (old checkpoint latest: %v, new: %v): the save's operations were not all reached", points, sawOld, sawNew)
	}
	t.Logf("killed at each of %d points", points)
}

// loadCheck loads every tensor of defs from path on one rank and compares
// them bit for bit.
func loadCheck(path string, defs map[string]tdef) error {
	return placementtest.Simulate(context.Background(), []int{1}, []string{"x"}, func(ctx context.Context, m *mesh.Mesh) error {
		specs, err := specsOn(m, defs, oneRank.lay)
		if err != nil {
			return err
		}
		st, err := Load(ctx, path, specs)
		if err != nil {
			return err
		}
		for _, n := range slices.Sorted(maps.Keys(defs)) {
			full, err := st.Tensors[n].Full(ctx)
			if err != nil {
				return err
			}
			if err := bitsEqual(full, defs[n].full()); err != nil {
				return fmt.Errorf("%s: %v", n, err)
			}
		}
		return nil
	})
}

// killedSaver is the helper process's body.
func killedSaver(t *testing.T, at, root string, async bool) {
	n, err := strconv.Atoi(at)
	if err != nil || root == "" {
		t.Fatalf("%s=%q %s=%q", crashAtEnv, at, crashRootEnv, root)
	}
	var mu sync.Mutex
	count := 0
	hook := func(event) {
		mu.Lock()
		defer mu.Unlock()
		count++
		if count == n {
			_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
			time.Sleep(time.Minute) // the signal ends the process first
		}
	}
	if !async {
		saveOn(t, root, tp3, step2Tensors(), WithStep(2), WithKeep(1), withHook(hook))
		fmt.Println("saved without being killed")
		return
	}
	simulate(t, tp3.shape, tp3.axes, func(ctx context.Context, m *mesh.Mesh) error {
		specs, err := specsOn(m, step2Tensors(), tp3.lay)
		if err != nil {
			return err
		}
		st, err := stateOn(specs, step2Tensors())
		if err != nil {
			return err
		}
		sv, err := NewSaver(root, WithKeep(1), WithMemoryLimit(16), withHook(hook))
		if err != nil {
			return err
		}
		if _, err := sv.Save(ctx, st, WithStep(2)); err != nil {
			return err
		}
		return sv.Close()
	})
	fmt.Println("saved without being killed")
}

// crashExportEnv names the file the crash helper of TestKilledExport
// exports step2Tensors to.
const crashExportEnv = "CHECKPOINT_TEST_EXPORT"

// TestKilledExport kills an Export (SIGKILL) before each of its file
// operations in turn over an earlier export of other values: the file is
// always the earlier export or the new one, whole, with exact values; and
// the next export succeeds and leaves nothing beside the file.
func TestKilledExport(t *testing.T) {
	if at, path := os.Getenv(crashAtEnv), os.Getenv(crashExportEnv); at != "" && path != "" {
		n, err := strconv.Atoi(at)
		if err != nil {
			t.Fatal(err)
		}
		count := 0
		var mu sync.Mutex
		hook := func(event) {
			mu.Lock()
			defer mu.Unlock()
			if count++; count == n {
				_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
				time.Sleep(time.Minute)
			}
		}
		exportOn(t, path, tp3, step2Tensors(), withHook(hook))
		fmt.Println("exported without being killed")
		return
	}
	sawOld, sawNew := false, false
	points := 0
	for n := 1; ; n++ {
		dir := t.TempDir()
		path := filepath.Join(dir, "model.safetensors")
		exportOn(t, path, tp3, testTensors)
		cmd := exec.Command(os.Args[0], "-test.run=^TestKilledExport$", "-test.count=1")
		cmd.Env = append(os.Environ(), crashAtEnv+"="+strconv.Itoa(n), crashExportEnv+"="+path)
		out, err := cmd.CombinedOutput()
		var ee *exec.ExitError
		switch {
		case err == nil:
			if !strings.Contains(string(out), "exported without being killed") {
				t.Fatalf("point %d: the helper exited without saying it exported:\n%s", n, out)
			}
			points = n - 1
		case errors.As(err, &ee) && ee.Sys().(syscall.WaitStatus).Signal() == syscall.SIGKILL:
		default:
			t.Fatalf("point %d: the helper failed: %v\n%s", n, err, out)
		}
		if err == nil {
			break
		}
		errOld, errNew := fileHolds(path, testTensors), fileHolds(path, step2Tensors())
		switch {
		case errOld == nil:
			sawOld = true
		case errNew == nil:
			sawNew = true
		default:
			t.Fatalf("killed before point %d: %s holds neither export (%v; %v)", n, path, errOld, errNew)
		}
		exportOn(t, path, tp3, testTensors)
		if ents, _ := os.ReadDir(dir); len(ents) != 1 {
			t.Fatalf("killed before point %d: the next export left %v", n, ents)
		}
	}
	if points < 10 || !sawOld || !sawNew {
		t.Fatalf("%d kill points (old file: %v, new: %v): the export's operations were not all reached", points, sawOld, sawNew)
	}
	t.Logf("killed at each of %d points", points)
}

// fileHolds checks that the safetensors file at path holds exactly defs.
func fileHolds(path string, defs map[string]tdef) error {
	f, err := safetensors.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	if len(f.Names()) != len(defs) {
		return fmt.Errorf("%d tensors, want %d", len(f.Names()), len(defs))
	}
	for n, d := range defs {
		x, err := f.Tensor(n)
		if err != nil {
			return err
		}
		var got any
		if d.dtype == comm.Float64 {
			got, err = x.Float64s()
		} else {
			got, err = x.Float32s()
		}
		if err == nil {
			err = bitsEqual(got, d.full())
		}
		if err != nil {
			return fmt.Errorf("%s: %v", n, err)
		}
	}
	return nil
}
