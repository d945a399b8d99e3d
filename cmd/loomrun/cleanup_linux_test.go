//go:build linux

package main

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// These tests check that no process of a job outlives it. Their ranks are
// shell scripts whose children run `sleep` with an argument unique to the
// test (newMarker), by which the test finds them in /proc; every test
// SIGKILLs what still carries its marker when it ends, pass or fail.

// newMarker returns a sleep duration (about 300 s) that no other process
// uses, and registers the cleanup that kills whatever still carries it.
func newMarker(t *testing.T) string {
	t.Helper()
	m := fmt.Sprintf("300.%d%09d", os.Getpid(), time.Now().Nanosecond())
	t.Cleanup(func() {
		for _, pid := range marked(m) {
			syscall.Kill(pid, syscall.SIGKILL)
		}
	})
	return m
}

// marked returns the live processes with arg in their argv (a zombie's
// argv is empty); for a marker (a "300.…" argument), the sleeps that run
// with it, not the scripts and supervisors that pass it on.
func marked(arg string) []int {
	dir, _ := os.ReadDir("/proc")
	var pids []int
	for _, d := range dir {
		pid, err := strconv.Atoi(d.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile("/proc/" + d.Name() + "/cmdline")
		if err != nil {
			continue
		}
		argv := strings.Split(string(b), "\x00")
		if strings.HasPrefix(arg, "300.") {
			if len(argv) >= 2 && filepath.Base(argv[0]) == "sleep" && argv[1] == arg {
				pids = append(pids, pid)
			}
		} else if slices.Contains(argv, arg) {
			pids = append(pids, pid)
		}
	}
	return pids
}

// waitMarked waits at most d until the processes carrying arg number
// count (exactly), and returns the last count seen.
func waitMarked(arg string, count int, d time.Duration) int {
	deadline := time.Now().Add(d)
	for {
		n := len(marked(arg))
		if n == count || time.Now().After(deadline) {
			return n
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// writeScript writes a rank script into dir and returns its path; its
// arguments in the launch are the marker and dir.
func writeScript(t *testing.T, dir, body string) string {
	t.Helper()
	path := filepath.Join(dir, "rank.sh")
	if err := os.WriteFile(path, []byte("M=$1 DIR=$2\n"+body), 0o755); err != nil {
		t.Fatal(err)
	}
	return path
}

// launchScript runs the launcher in this process with /bin/sh script as
// every rank; ending ctx ends the job.
func launchScript(ctx context.Context, t *testing.T, cfg config, script string, args ...string) result {
	t.Helper()
	cfg.prog = "/bin/sh"
	cfg.args = append([]string{script}, args...)
	cfg.masterAddr = "127.0.0.1"
	if cfg.timeout == 0 {
		cfg.timeout = 15 * time.Second // a safety net; no test should reach it
	}
	var out, errb lockedBuffer
	start := time.Now()
	code := run(ctx, &cfg, &out, &errb, nil)
	r := result{code: code, stdout: out.String(), stderr: errb.String(), elapsed: time.Since(start)}
	t.Logf("exit %d after %v\nstdout:\n%s\nstderr:\n%s", r.code, r.elapsed, r.stdout, r.stderr)
	return r
}

// checkNoneLeft fails the test if a process carrying any of args is alive.
func checkNoneLeft(t *testing.T, args ...string) {
	t.Helper()
	for _, a := range args {
		if pids := marked(a); len(pids) > 0 {
			t.Errorf("%d process(es) with %q in their argv outlived the job: %v", len(pids), a, pids)
		}
	}
}

func TestNoProcessOutlivesTheJob(t *testing.T) {
	tests := []struct {
		name   string
		nproc  int
		grace  time.Duration
		script string
		code   int
		bound  time.Duration // on the job's duration
		stderr []string
		stdout []string
	}{{
		// The case: the failing rank's children, one of them
		// orphaned by a double fork, stay in its process group after it
		// exits; the launcher used to signal only ranks still running.
		name:  "failed rank's children",
		nproc: 3, grace: 2 * time.Second, code: 1, bound: 5 * time.Second,
		script: `if [ "$RANK" = 1 ]; then
	sleep $M &
	( sleep $M & )
	exit 3
fi
sleep $M & wait
`,
		stderr: []string{"loomrun: job failed: rank 1 exited with status 3"},
	}, {
		// A rank that succeeds early leaves a child: it runs until the
		// job ends, then goes with it.
		name:  "early successful rank's child",
		nproc: 2, grace: 2 * time.Second, code: 0, bound: 5 * time.Second,
		script: `if [ "$RANK" = 0 ]; then
	sleep $M &
	exit 0
fi
sleep 0.3
`,
		stderr: []string{"loomrun: rank 0 left 1 process(es) running; ending them"},
	}, {
		// The child holds the rank's stdout: the launcher used to wait
		// --grace (here 5 s, the default) for the pipe to close.
		name:  "child holding stdout",
		nproc: 2, grace: 5 * time.Second, code: 0, bound: 2 * time.Second,
		script: `sleep $M &
echo "hello $RANK"
`,
		stdout: []string{"[rank 0] hello 0\n", "[rank 1] hello 1\n"},
	}}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			m := newMarker(t)
			script := writeScript(t, dir, tc.script)
			r := launchScript(context.Background(), t, config{nproc: tc.nproc, grace: tc.grace}, script, m, dir)
			if r.code != tc.code {
				t.Errorf("exit %d, want %d", r.code, tc.code)
			}
			if r.elapsed > tc.bound {
				t.Errorf("the job took %v, want < %v", r.elapsed, tc.bound)
			}
			for _, w := range tc.stderr {
				if !strings.Contains(r.stderr, w) {
					t.Errorf("stderr lacks %q", w)
				}
			}
			for _, w := range tc.stdout {
				if !strings.Contains(r.stdout, w) {
					t.Errorf("stdout lacks %q", w)
				}
			}
			// run returns only once the job's processes are reaped: no
			// waiting here.
			checkNoneLeft(t, m, script)
		})
	}
}

// launcher is loomrun run as a real process by startLauncher.
type launcher struct {
	cmd    *exec.Cmd
	out    lockedBuffer  // its stdout and stderr
	waited chan struct{} // closed once it has exited and been reaped
}

// startLauncher runs loomrun as a real process (the test binary in
// launcher mode) with /bin/sh script as every rank, and registers its
// cleanup.
func startLauncher(t *testing.T, nproc int, grace time.Duration, script string, args ...string) *launcher {
	t.Helper()
	cmd := exec.Command(os.Args[0], append([]string{"-n", strconv.Itoa(nproc), "--grace", grace.String(),
		"--timeout", "20s", "--", "/bin/sh", script}, args...)...)
	cmd.Env = append(os.Environ(), launcherEnv+"=1")
	l := &launcher{cmd: cmd, waited: make(chan struct{})}
	cmd.Stdout, cmd.Stderr = &l.out, &l.out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { cmd.Wait(); close(l.waited) }()
	t.Cleanup(func() {
		cmd.Process.Kill()
		<-l.waited
		t.Logf("loomrun's output:\n%s", l.out.String())
	})
	return l
}

// TestLauncherSIGKILLed kills loomrun itself mid-job: every rank's
// supervisor sees its control pipe close and ends the rank's processes,
// also a child that left the group with setsid (it is reparented to the
// supervisor, a subreaper).
func TestLauncherSIGKILLed(t *testing.T) {
	dir := t.TempDir()
	m := newMarker(t)
	perRank := 2
	escape := ""
	if _, err := exec.LookPath("setsid"); err == nil {
		escape = "setsid sleep $M &\n"
		perRank++
	}
	script := writeScript(t, dir, "sleep $M &\n( sleep $M & )\n"+escape+"wait\n")
	const n = 2
	l := startLauncher(t, n, time.Second, script, m, dir)
	if got := waitMarked(m, n*perRank, 10*time.Second); got != n*perRank {
		t.Fatalf("%d marked sleeps running, want %d", got, n*perRank)
	}
	if err := l.cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	// SIGTERM ends every process here at once; --grace is 1 s.
	const bound = 3 * time.Second
	if got := waitMarked(m, 0, bound); got != 0 {
		t.Errorf("%d of the ranks' children still alive %v after loomrun was SIGKILLed", got, bound)
	}
	if got := waitMarked(script, 0, bound); got != 0 {
		t.Errorf("%d ranks or supervisors still alive %v after loomrun was SIGKILLed (it is reaped already)", got, bound)
	}
}

// supervisorOf reads the pid that rank's script wrote: its parent's, which
// must not be the launcher's.
func supervisorOf(t *testing.T, dir string, rank, launcher int) int {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		b, err := os.ReadFile(filepath.Join(dir, fmt.Sprintf("sup-%d", rank)))
		if pid, perr := strconv.Atoi(strings.TrimSpace(string(b))); err == nil && perr == nil && pid > 0 {
			if pid == launcher {
				t.Fatalf("rank %d is the launcher's own child: no supervisor", rank)
			}
			return pid
		}
		if time.Now().After(deadline) {
			t.Fatalf("rank %d did not write its supervisor's pid", rank)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestSupervisorSIGKILLed kills one rank's supervisor: the kernel kills
// the rank (its parent-death signal), and the launcher reports the rank as
// lost, SIGKILLs what is left of its group and ends the job.
func TestSupervisorSIGKILLed(t *testing.T) {
	dir := t.TempDir()
	m := newMarker(t)
	script := writeScript(t, dir, `echo $PPID > "$DIR/sup-$RANK.tmp" && mv "$DIR/sup-$RANK.tmp" "$DIR/sup-$RANK"
sleep $M & wait
`)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan result, 1)
	finished := make(chan struct{})
	go func() {
		defer close(finished)
		done <- launchScript(ctx, t, config{nproc: 2, grace: 2 * time.Second}, script, m, dir)
	}()
	// On a failure below, end the job before the test ends.
	t.Cleanup(func() {
		cancel()
		<-finished
	})
	sup := supervisorOf(t, dir, 1, os.Getpid())
	if got := waitMarked(m, 2, 10*time.Second); got != 2 {
		t.Fatalf("%d marked sleeps running, want 2", got)
	}
	if err := syscall.Kill(sup, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	var r result
	select {
	case r = <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("loomrun did not end after a supervisor was killed")
	}
	if r.code != 1 {
		t.Errorf("exit %d, want 1", r.code)
	}
	if want := "job failed: rank 1 was lost: its supervisor ended (signal: killed)"; !strings.Contains(r.stderr, want) {
		t.Errorf("stderr lacks %q", want)
	}
	// Rank 1's child was reparented to init, which reaps it after our
	// SIGKILL: allow it a moment.
	if got := waitMarked(m, 0, 2*time.Second); got != 0 {
		t.Errorf("%d of the ranks' children outlived the job", got)
	}
	checkNoneLeft(t, script)
}

// TestOrphansOfDeadSupervisor: a child that left its rank's group
// (setsid) and whose supervisor was killed is reparented to loomrun, a
// subreaper, which kills it before exiting.
func TestOrphansOfDeadSupervisor(t *testing.T) {
	if _, err := exec.LookPath("setsid"); err != nil {
		t.Skip("needs setsid(1)")
	}
	dir := t.TempDir()
	m := newMarker(t)
	script := writeScript(t, dir, `echo $PPID > "$DIR/sup-$RANK.tmp" && mv "$DIR/sup-$RANK.tmp" "$DIR/sup-$RANK"
setsid sleep $M & wait
`)
	l := startLauncher(t, 2, time.Second, script, m, dir)
	sup := supervisorOf(t, dir, 0, l.cmd.Process.Pid)
	if got := waitMarked(m, 2, 10*time.Second); got != 2 {
		t.Fatalf("%d marked sleeps running, want 2", got)
	}
	if err := syscall.Kill(sup, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	select {
	case <-l.waited:
	case <-time.After(10 * time.Second):
		t.Fatal("loomrun did not end after a supervisor was killed")
	}
	// The orphan is killed and reaped before loomrun exits.
	checkNoneLeft(t, m)
	if want := "loomrun: killed 1 orphaned process(es) of the job"; !strings.Contains(l.out.String(), want) {
		t.Errorf("output lacks %q", want)
	}
}
