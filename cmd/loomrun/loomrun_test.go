package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/b7ea7098/loom/comm/rendezvous"
)

// The test binary doubles as the child program, as the ranks' supervisor
// (run re-executes its own binary) and, for the end-to-end tests, as
// loomrun itself: TestMain dispatches on supervisorEnv, childArg or
// launcherEnv before running any test.
const (
	childArg    = "-loomrun-test-child"
	launcherEnv = "LOOMRUN_TEST_LAUNCHER"
)

func TestMain(m *testing.M) {
	if isSupervisor() {
		os.Exit(superviseMain(os.Args[1:]))
	}
	if len(os.Args) > 2 && os.Args[1] == childArg {
		os.Exit(childMain(os.Args[2], os.Args[3:]))
	}
	if os.Getenv(launcherEnv) == "1" {
		os.Exit(realMain(os.Args[1:]))
	}
	// Children built with -race would otherwise sleep 1 s at exit.
	if os.Getenv("GORACE") == "" {
		os.Setenv("GORACE", "atexit_sleep_ms=0")
	}
	os.Exit(m.Run())
}

// childMain is the child program: mode picks the behaviour. Every mode is
// bounded in time (at most 20 s) so a lost child cannot live on.
func childMain(mode string, args []string) int {
	rank, _ := strconv.Atoi(os.Getenv("RANK"))
	arg := func(i int) string {
		if i < len(args) {
			return args[i]
		}
		return ""
	}
	ready := func() {
		// Tell the test this rank runs (and has set up its handlers).
		if dir := arg(0); dir != "" {
			os.WriteFile(filepath.Join(dir, fmt.Sprintf("rank-%d.pid", rank)), []byte(strconv.Itoa(os.Getpid())), 0o644)
		}
	}
	const maxLife = 20 * time.Second
	// allReady waits (bounded) until every rank is ready, so a failing rank
	// fails only once the others have set up their signal handling.
	allReady := func() {
		ws, _ := strconv.Atoi(os.Getenv("WORLD_SIZE"))
		deadline := time.Now().Add(10 * time.Second)
		for r := 0; r < ws && time.Now().Before(deadline); {
			if _, err := os.Stat(filepath.Join(arg(0), fmt.Sprintf("rank-%d.pid", r))); err == nil {
				r++
				continue
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	switch mode {
	case "affinity":
		// The CPUs this rank may run on, and whether loomrun's internal
		// variable leaked into its environment.
		cpus, err := allowedCPUs()
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		fmt.Printf("cpus=%s leaked=%t\n", formatCPUs(cpus), os.Getenv(cpusEnv) != "")
		return 0
	case "env":
		for _, k := range []string{"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"} {
			fmt.Printf("%s=%s\n", k, os.Getenv(k))
		}
		fmt.Fprintf(os.Stderr, "to stderr %d\n", rank)
		fmt.Print("no newline at the end")
		return 0
	case "interleave":
		// Lines written in small pieces: loomrun must still emit them whole.
		for i := 0; i < 100; i++ {
			line := fmt.Sprintf("r%d-l%03d-%s\n", rank, i, strings.Repeat(strconv.Itoa(rank), 40))
			for len(line) > 0 {
				n := min(7, len(line))
				os.Stdout.Write([]byte(line[:n]))
				line = line[n:]
			}
		}
		return 0
	case "fail": // args: dir, failing rank, exit code
		ready()
		bad, _ := strconv.Atoi(arg(1))
		code, _ := strconv.Atoi(arg(2))
		if rank == bad {
			allReady()
			time.Sleep(50 * time.Millisecond)
			fmt.Fprintf(os.Stderr, "rank %d failing with %d\n", rank, code)
			return code
		}
		time.Sleep(maxLife)
		return 0
	case "ignoreterm": // args: dir, failing rank
		signal.Ignore(syscall.SIGTERM)
		ready()
		bad, _ := strconv.Atoi(arg(1))
		if rank == bad {
			allReady()
			time.Sleep(50 * time.Millisecond)
			return 1
		}
		time.Sleep(maxLife)
		return 0
	case "sleep": // args: dir
		ready()
		time.Sleep(maxLife)
		return 0
	case "signal": // args: dir; reports the signal it gets and exits 0
		ch := make(chan os.Signal, 1)
		signal.Notify(ch, syscall.SIGINT, syscall.SIGTERM)
		ready()
		select {
		case s := <-ch:
			fmt.Printf("got %v\n", s)
			return 0
		case <-time.After(maxLife):
			return 5
		}
	case "rendezvous":
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		c, err := rendezvous.DialEnv(ctx, rendezvous.WithTimeout(10*time.Second))
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		defer c.Close()
		if rank == 0 {
			if err := c.Set(ctx, "uid", []byte("secret-42")); err != nil {
				fmt.Fprintln(os.Stderr, err)
				return 1
			}
		}
		v, err := c.Get(ctx, "uid")
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		ws, _ := strconv.Atoi(os.Getenv("WORLD_SIZE"))
		if err := c.Barrier(ctx, "start", ws); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		fmt.Printf("uid=%s\n", v)
		return 0
	case "multinode": // args: the launcher's node rank, "hold" or "exit", the world size wanted, a marker
		return multinodeChild(rank, arg(0), arg(1) == "hold", arg(2), maxLife)
	}
	fmt.Fprintf(os.Stderr, "unknown child mode %q\n", mode)
	return 99
}

// lockedBuffer is a bytes.Buffer safe for concurrent use.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

type result struct {
	code           int
	stdout, stderr string
	elapsed        time.Duration
}

// launch runs the launcher in this process with the test binary as the
// child program.
func launch(t *testing.T, cfg config, sigs <-chan os.Signal, mode string, args ...string) result {
	t.Helper()
	cfg.prog = os.Args[0]
	cfg.args = append([]string{childArg, mode}, args...)
	if cfg.masterAddr == "" {
		cfg.masterAddr = "127.0.0.1"
	}
	if cfg.grace == 0 {
		cfg.grace = 2 * time.Second
	}
	if cfg.timeout == 0 {
		cfg.timeout = 15 * time.Second // a safety net; no test should reach it
	}
	var out, errb lockedBuffer
	start := time.Now()
	code := run(context.Background(), &cfg, &out, &errb, sigs)
	r := result{code: code, stdout: out.String(), stderr: errb.String(), elapsed: time.Since(start)}
	t.Logf("exit %d after %v\nstdout:\n%s\nstderr:\n%s", r.code, r.elapsed, r.stdout, r.stderr)
	return r
}

// waitReady waits until every rank wrote its pid file and returns the pids.
func waitReady(t *testing.T, dir string, n int) []int {
	t.Helper()
	pids := make([]int, n)
	deadline := time.Now().Add(10 * time.Second)
	for r := 0; r < n; r++ {
		for {
			b, err := os.ReadFile(filepath.Join(dir, fmt.Sprintf("rank-%d.pid", r)))
			if err == nil && len(b) > 0 {
				pids[r], _ = strconv.Atoi(string(b))
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("rank %d not ready after 10s", r)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	return pids
}

func TestParseArgs(t *testing.T) {
	cfg, err := parseArgs([]string{"--nproc-per-node", "4", "--master-port", "1234", "--timeout", "3s", "--grace", "1s", "--", "prog", "-x", "y"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.nproc != 4 || cfg.masterPort != 1234 || cfg.masterAddr != "127.0.0.1" || cfg.timeout != 3*time.Second ||
		cfg.grace != time.Second || cfg.prog != "prog" || strings.Join(cfg.args, " ") != "-x y" {
		t.Errorf("parsed %+v", cfg)
	}
	if cfg, err := parseArgs([]string{"-n", "2", "prog"}, io.Discard); err != nil || cfg.nproc != 2 || cfg.prog != "prog" || cfg.nnodes != 1 || cfg.nodeRank != 0 {
		t.Errorf("-n 2 prog: %+v, %v", cfg, err)
	}
	cfg, err = parseArgs([]string{"--nnodes", "3", "--node-rank", "2", "--master-port", "29500", "--join-timeout", "7s", "--node-timeout", "2s", "p"}, io.Discard)
	if err != nil || cfg.nnodes != 3 || cfg.nodeRank != 2 || cfg.joinTimeout != 7*time.Second || cfg.nodeTimeout != 2*time.Second {
		t.Errorf("several nodes: %+v, %v", cfg, err)
	}
	for _, bad := range [][]string{
		{}, {"-n", "0", "p"}, {"--master-port", "70000", "p"}, {"--grace", "-1s", "p"}, {"--bogus", "p"}, {"-n", "x", "p"},
		{"--nnodes", "0", "p"},
		{"--nnodes", "2", "p"}, // no --master-port for the other nodes
		{"--nnodes", "2", "--node-rank", "2", "--master-port", "1", "p"},
		{"--node-rank", "-1", "p"},
		{"--join-timeout", "0s", "p"},
		{"--node-timeout", "-1s", "p"},
	} {
		if _, err := parseArgs(bad, io.Discard); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
}

func TestPrefixWriter(t *testing.T) {
	var out bytes.Buffer
	w := newLineWriter(&syncWriter{w: &out}, 3)
	w.Write([]byte("a"))
	w.Write([]byte("b\nc\n\nd"))
	w.Flush()
	long := strings.Repeat("x", maxLine+10)
	w.Write([]byte(long + "\n"))
	want := "[rank 3] ab\n[rank 3] c\n[rank 3] \n[rank 3] d\n[rank 3] " + long[:maxLine] + "\n[rank 3] " + long[maxLine:] + "\n"
	if out.String() != want {
		t.Errorf("got %q...", out.String()[:min(80, out.Len())])
	}
}

func TestEnvironmentAndPrefix(t *testing.T) {
	r := launch(t, config{nproc: 3}, nil, "env")
	if r.code != 0 {
		t.Fatalf("exit %d", r.code)
	}
	port := regexp.MustCompile(`\[rank 0\] MASTER_PORT=(\d+)\n`).FindStringSubmatch(r.stdout)
	if port == nil || port[1] == "0" {
		t.Fatalf("no picked MASTER_PORT in output")
	}
	for rank := 0; rank < 3; rank++ {
		p := fmt.Sprintf("[rank %d] ", rank)
		for _, line := range []string{
			fmt.Sprintf("RANK=%d", rank), "WORLD_SIZE=3", fmt.Sprintf("LOCAL_RANK=%d", rank),
			"LOCAL_WORLD_SIZE=3", "MASTER_ADDR=127.0.0.1", "MASTER_PORT=" + port[1], "no newline at the end",
		} {
			if !strings.Contains(r.stdout, p+line+"\n") {
				t.Errorf("stdout lacks %q", p+line)
			}
		}
		if !strings.Contains(r.stderr, fmt.Sprintf("[rank %d] to stderr %d\n", rank, rank)) {
			t.Errorf("stderr lacks rank %d's line", rank)
		}
	}
}

func TestLinesNeverInterleave(t *testing.T) {
	const n = 4
	r := launch(t, config{nproc: n}, nil, "interleave")
	if r.code != 0 {
		t.Fatalf("exit %d", r.code)
	}
	re := regexp.MustCompile(`^\[rank (\d)\] r(\d)-l(\d{3})-(\d+)$`)
	lines := strings.Split(strings.TrimSuffix(r.stdout, "\n"), "\n")
	if len(lines) != n*100 {
		t.Fatalf("%d lines, want %d", len(lines), n*100)
	}
	next := make([]int, n)
	for _, l := range lines {
		m := re.FindStringSubmatch(l)
		if m == nil || m[1] != m[2] || m[4] != strings.Repeat(m[1], 40) {
			t.Fatalf("mixed or malformed line %q", l)
		}
		rank, _ := strconv.Atoi(m[1])
		i, _ := strconv.Atoi(m[3])
		if i != next[rank] {
			t.Fatalf("rank %d: line %d after %d", rank, i, next[rank]-1)
		}
		next[rank]++
	}
}

func TestRendezvousForChildren(t *testing.T) {
	r := launch(t, config{nproc: 4}, nil, "rendezvous")
	if r.code != 0 {
		t.Fatalf("exit %d", r.code)
	}
	for rank := 0; rank < 4; rank++ {
		if !strings.Contains(r.stdout, fmt.Sprintf("[rank %d] uid=secret-42\n", rank)) {
			t.Errorf("rank %d did not get the uid", rank)
		}
	}
}

func TestFailingRankEndsOthers(t *testing.T) {
	dir := t.TempDir()
	r := launch(t, config{nproc: 4, grace: 2 * time.Second}, nil, "fail", dir, "2", "3")
	if r.code != 1 {
		t.Errorf("exit %d, want 1", r.code)
	}
	// The others die of SIGTERM right away, well within the grace period.
	if r.elapsed > 5*time.Second {
		t.Errorf("took %v", r.elapsed)
	}
	for _, want := range []string{
		"loomrun: rank 2 exited with status 3; ending the other ranks",
		"loomrun: job failed: rank 2 exited with status 3",
		"[rank 2] rank 2 failing with 3",
		"rank 0 was killed by signal SIGTERM",
	} {
		if !strings.Contains(r.stderr, want) {
			t.Errorf("stderr lacks %q", want)
		}
	}
}

func TestGraceThenKill(t *testing.T) {
	dir := t.TempDir()
	r := launch(t, config{nproc: 3, grace: 300 * time.Millisecond}, nil, "ignoreterm", dir, "0")
	if r.code != 1 {
		t.Errorf("exit %d, want 1", r.code)
	}
	if r.elapsed > 5*time.Second {
		t.Errorf("took %v, want about 100ms + grace 300ms", r.elapsed)
	}
	for _, want := range []string{
		"job failed: rank 0 exited with status 1",
		"still running 300ms after being told to stop; sending SIGKILL",
		"rank 1 was killed by signal SIGKILL (9)",
		"rank 2 was killed by signal SIGKILL (9)",
	} {
		if !strings.Contains(r.stderr, want) {
			t.Errorf("stderr lacks %q", want)
		}
	}
}

func TestKilledRank(t *testing.T) {
	if runtime.GOOS == "windows" {
		t.Skip("needs unix signals")
	}
	dir := t.TempDir()
	done := make(chan result, 1)
	go func() { done <- launch(t, config{nproc: 3, grace: time.Second}, nil, "sleep", dir) }()
	pids := waitReady(t, dir, 3)
	if err := syscall.Kill(pids[1], syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	var r result
	select {
	case r = <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("loomrun did not end after a rank was killed")
	}
	if r.code != 1 {
		t.Errorf("exit %d, want 1", r.code)
	}
	if !strings.Contains(r.stderr, "job failed: rank 1 was killed by signal SIGKILL (9)") {
		t.Errorf("stderr does not name rank 1 and SIGKILL")
	}
	for _, rank := range []int{0, 2} {
		if !strings.Contains(r.stderr, fmt.Sprintf("rank %d was killed by signal SIGTERM", rank)) {
			t.Errorf("rank %d not ended by SIGTERM", rank)
		}
	}
}

func TestSignalForwarding(t *testing.T) {
	dir := t.TempDir()
	sigs := make(chan os.Signal, 1)
	done := make(chan result, 1)
	go func() { done <- launch(t, config{nproc: 3}, sigs, "signal", dir) }()
	waitReady(t, dir, 3)
	sigs <- syscall.SIGTERM
	var r result
	select {
	case r = <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("loomrun did not end after SIGTERM")
	}
	if r.code != 128+15 {
		t.Errorf("exit %d, want 143", r.code)
	}
	for rank := 0; rank < 3; rank++ {
		if !strings.Contains(r.stdout, fmt.Sprintf("[rank %d] got terminated\n", rank)) {
			t.Errorf("rank %d did not get SIGTERM", rank)
		}
	}
	if !strings.Contains(r.stderr, "received SIGTERM (15); forwarding it") {
		t.Errorf("stderr does not report the forwarded signal")
	}
}

// TestEndToEndSIGINT runs loomrun as a real process and interrupts it.
func TestEndToEndSIGINT(t *testing.T) {
	if runtime.GOOS == "windows" {
		t.Skip("needs unix signals")
	}
	dir := t.TempDir()
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, os.Args[0], "-n", "2", "--grace", "2s", "--", os.Args[0], childArg, "signal", dir)
	cmd.Env = append(os.Environ(), launcherEnv+"=1")
	var out, errb lockedBuffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	waitReady(t, dir, 2)
	cmd.Process.Signal(syscall.SIGINT)
	err := cmd.Wait()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != 130 {
		t.Errorf("loomrun ended with %v, want exit status 130", err)
	}
	for rank := 0; rank < 2; rank++ {
		if !strings.Contains(out.String(), fmt.Sprintf("[rank %d] got interrupt\n", rank)) {
			t.Errorf("rank %d did not get SIGINT; stdout:\n%s\nstderr:\n%s", rank, out.String(), errb.String())
		}
	}
}

func TestJobTimeout(t *testing.T) {
	dir := t.TempDir()
	r := launch(t, config{nproc: 2, timeout: 300 * time.Millisecond}, nil, "sleep", dir)
	if r.code != 1 || !strings.Contains(r.stderr, "job failed: timed out after 300ms") {
		t.Errorf("exit %d", r.code)
	}
}

func TestStartFailure(t *testing.T) {
	dir := t.TempDir()
	// Executable but not a program: found by the launcher, refused by
	// execve in the supervisor.
	garbage := filepath.Join(dir, "garbage")
	if err := os.WriteFile(garbage, []byte{0, 1, 2, 3}, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		prog string
		want []string
	}{
		{filepath.Join(dir, "missing"), []string{"loomrun: cannot start the ranks: ", "no such file or directory"}},
		{garbage, []string{"failed to start: exec format error", "loomrun: job failed: rank "}},
	} {
		cfg := &config{nproc: 2, masterAddr: "127.0.0.1", grace: time.Second, prog: tc.prog}
		var errb lockedBuffer
		code := run(context.Background(), cfg, io.Discard, &errb, nil)
		t.Logf("%s: exit %d, stderr:\n%s", tc.prog, code, errb.String())
		if code != 2 {
			t.Errorf("%s: exit %d, want 2", tc.prog, code)
		}
		for _, w := range tc.want {
			if !strings.Contains(errb.String(), w) {
				t.Errorf("%s: stderr %q lacks %q", tc.prog, errb.String(), w)
			}
		}
	}
}

func TestChildEnvReplacesInherited(t *testing.T) {
	env := childEnv([]string{"PATH=/bin", "RANK=9", "MASTER_PORT=1"}, &config{nproc: 2, masterAddr: "h"}, 1, "555")
	got := strings.Join(env, " ")
	want := "PATH=/bin GROUP_RANK=0 GROUP_WORLD_SIZE=1 LOCAL_RANK=1 LOCAL_WORLD_SIZE=2 MASTER_ADDR=h MASTER_PORT=555 RANK=1 WORLD_SIZE=2"
	if got != want {
		t.Errorf("env %q, want %q", got, want)
	}
}
