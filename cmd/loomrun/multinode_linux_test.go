//go:build linux

package main

import (
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/b7ea7098/loom/comm/rendezvous"
)

// These tests run two loomruns on this machine as the two nodes of one
// job, over loopback. Their ranks are the test binary in "multinode" mode
// (multinodeChild); its argv carries a marker by which checkNoneLeft finds
// whatever outlived the job.

// rankRecord is what each rank of a multinode job stores under
// "test/rank/<RANK>": its environment, and which loomrun started it.
type rankRecord struct {
	rank, local, world, localWorld, node, launcher, pid int
}

const rankRecordFormat = "rank=%d local=%d world=%d localworld=%d node=%d launcher=%d pid=%d"

// multinodeChild stores the rank's record, and on rank 0 checks every
// rank's against the layout of the job (launcher: the node whose loomrun
// started the rank, from its argv, not its environment) and stores "ok"
// or what is wrong under "test/verified". Every rank then waits for the
// verdict and fails if it is not "ok"; with hold it sleeps until killed.
func multinodeChild(rank int, launcher string, hold bool, worldArg string, maxLife time.Duration) int {
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	c, err := rendezvous.DialEnv(ctx, rendezvous.WithTimeout(15*time.Second))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer c.Close()
	env := func(k string) int {
		n, err := strconv.Atoi(os.Getenv(k))
		if err != nil {
			return -1
		}
		return n
	}
	l, _ := strconv.Atoi(launcher)
	rec := fmt.Sprintf(rankRecordFormat, env("RANK"), env("LOCAL_RANK"), env("WORLD_SIZE"), env("LOCAL_WORLD_SIZE"), env("GROUP_RANK"), l, os.Getpid())
	if err := c.Set(ctx, "test/rank/"+strconv.Itoa(rank), []byte(rec)); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	if rank == 0 {
		verdict := "ok"
		if err := verifyRanks(ctx, c, worldArg); err != nil {
			verdict = err.Error()
		}
		if err := c.Set(ctx, "test/verified", []byte(verdict)); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
	}
	v, err := c.Get(ctx, "test/verified")
	if err != nil || string(v) != "ok" {
		fmt.Fprintf(os.Stderr, "verification: %s %v\n", v, err)
		return 1
	}
	fmt.Println("verified")
	if hold {
		time.Sleep(maxLife)
	}
	return 0
}

// verifyRanks checks the records of ranks 0..world-1: two processes per
// node, ranks numbered node by node.
func verifyRanks(ctx context.Context, c *rendezvous.Client, worldArg string) error {
	world, err := strconv.Atoi(worldArg)
	if err != nil {
		return fmt.Errorf("world size %q: %v", worldArg, err)
	}
	const perNode = 2
	for r := 0; r < world; r++ {
		v, err := c.Get(ctx, "test/rank/"+strconv.Itoa(r))
		if err != nil {
			return err
		}
		var got rankRecord
		if _, err := fmt.Sscanf(string(v), rankRecordFormat, &got.rank, &got.local, &got.world, &got.localWorld, &got.node, &got.launcher, &got.pid); err != nil {
			return fmt.Errorf("rank %d's record %q: %v", r, v, err)
		}
		want := rankRecord{rank: r, local: r % perNode, world: world, localWorld: perNode, node: r / perNode, launcher: r / perNode, pid: got.pid}
		if got != want {
			return fmt.Errorf("rank %d: got %+v, want %+v", r, got, want)
		}
	}
	return nil
}

// argMarker returns an argument that no other process carries, and
// registers the cleanup that kills whatever still carries it.
func argMarker(t *testing.T) string {
	t.Helper()
	m := fmt.Sprintf("loomrun-test-%d-%d", os.Getpid(), time.Now().UnixNano())
	t.Cleanup(func() {
		for _, pid := range marked(m) {
			syscall.Kill(pid, syscall.SIGKILL)
		}
	})
	return m
}

// freePort returns a loopback port that was free a moment ago.
func freePort(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

// startNode runs loomrun as a real process with flags, the test binary in
// multinode mode as every rank, and registers its cleanup.
func startNode(t *testing.T, flags []string, progArgs ...string) *launcher {
	t.Helper()
	args := append(append([]string{"--grace", "1s", "--timeout", "20s"}, flags...), "--", os.Args[0], childArg, "multinode")
	cmd := exec.Command(os.Args[0], append(args, progArgs...)...)
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
		t.Logf("loomrun %q's output:\n%s", flags, l.out.String())
	})
	return l
}

// nodeFlags are the flags of node of a two-node job at port.
func nodeFlags(port, node, nproc int, extra ...string) []string {
	return append([]string{"--nnodes", "2", "--node-rank", strconv.Itoa(node), "-n", strconv.Itoa(nproc),
		"--master-addr", "127.0.0.1", "--master-port", strconv.Itoa(port)}, extra...)
}

// waitExit waits at most d for l to exit and returns its exit status.
func waitExit(t *testing.T, l *launcher, d time.Duration) int {
	t.Helper()
	select {
	case <-l.waited:
		return l.cmd.ProcessState.ExitCode()
	case <-time.After(d):
		t.Fatalf("loomrun %q still running after %v", l.cmd.Args[1:], d)
		return -1
	}
}

func TestTwoNodesStartOneJob(t *testing.T) {
	port := freePort(t)
	m := argMarker(t)
	nodes := []*launcher{
		startNode(t, nodeFlags(port, 0, 2), "0", "exit", "4", m),
		startNode(t, nodeFlags(port, 1, 2), "1", "exit", "4", m),
	}
	for i, l := range nodes {
		if code := waitExit(t, l, 15*time.Second); code != 0 {
			t.Errorf("node %d: exit %d, want 0", i, code)
		}
	}
	for r := 0; r < 4; r++ {
		if want := fmt.Sprintf("[rank %d] verified\n", r); !strings.Contains(nodes[r/2].out.String(), want) {
			t.Errorf("node %d's output lacks %q", r/2, want)
		}
	}
	checkNoneLeft(t, m)
}

func TestKilledRankOnOneNodeEndsAll(t *testing.T) {
	port := freePort(t)
	m := argMarker(t)
	nodes := []*launcher{
		startNode(t, nodeFlags(port, 0, 2), "0", "hold", "4", m),
		startNode(t, nodeFlags(port, 1, 2), "1", "hold", "4", m),
	}
	// The test's own client of node 0's store: the verdict, and rank 3's pid.
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	c, err := rendezvous.Dial(ctx, net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if v, err := c.Get(ctx, "test/verified"); err != nil || string(v) != "ok" {
		t.Fatalf("verification: %q, %v", v, err)
	}
	v, err := c.Get(ctx, "test/rank/3")
	if err != nil {
		t.Fatal(err)
	}
	var rec rankRecord
	if _, err := fmt.Sscanf(string(v), rankRecordFormat, &rec.rank, &rec.local, &rec.world, &rec.localWorld, &rec.node, &rec.launcher, &rec.pid); err != nil {
		t.Fatalf("rank 3's record %q: %v", v, err)
	}
	// The marker is in the argv of the two loomruns, the four ranks and
	// their supervisors.
	if got := waitMarked(m, 10, 5*time.Second); got != 10 {
		t.Fatalf("%d loomruns, ranks and supervisors running, want 10", got)
	}
	killed := time.Now()
	if err := syscall.Kill(rec.pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	// Node 1 ends rank 2 at once; node 0 learns of the failure from the
	// store and ends ranks 0 and 1, then waits for node 1's report.
	const bound = 5 * time.Second
	for i, l := range nodes {
		if code := waitExit(t, l, bound); code != 1 {
			t.Errorf("node %d: exit %d, want 1", i, code)
		}
		if want := fmt.Sprintf("loomrun[node %d]: job failed: rank 3 (node 1) was killed by signal SIGKILL (9)", i); !strings.Contains(l.out.String(), want) {
			t.Errorf("node %d's output lacks %q", i, want)
		}
	}
	t.Logf("both nodes ended %v after the kill", time.Since(killed))
	if !strings.Contains(nodes[0].out.String(), "loomrun[node 0]: rank 3 (node 1) was killed by signal SIGKILL (9); ending this node's ranks") {
		t.Errorf("node 0 does not say why it ends its ranks")
	}
	checkNoneLeft(t, m)
}

func TestJoinFailures(t *testing.T) {
	tests := []struct {
		name  string
		node1 func(port int) []string // nil: node 1 never starts
		want  string                  // in the output of every node started
	}{{
		name:  "nproc-per-node differs",
		node1: func(port int) []string { return nodeFlags(port, 1, 3) },
		want:  "join failed: node 0 has --nproc-per-node 2, node 1 (host ",
	}, {
		name: "nnodes differs",
		node1: func(port int) []string {
			return []string{"--nnodes", "3", "--node-rank", "1", "-n", "2", "--master-port", strconv.Itoa(port), "--join-timeout", "10s"}
		},
		want: "join failed: node 0 has --nnodes 2, node 1 (host ",
	}, {
		name: "node 1 missing",
		want: "join failed: node 1 did not join within --join-timeout 1s",
	}}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			port := freePort(t)
			m := argMarker(t)
			start := time.Now()
			nodes := []*launcher{startNode(t, nodeFlags(port, 0, 2, "--join-timeout", "1s"), "0", "exit", "4", m)}
			if tc.node1 != nil {
				nodes = append(nodes, startNode(t, tc.node1(port), "1", "exit", "4", m))
			}
			for i, l := range nodes {
				if code := waitExit(t, l, 10*time.Second); code != 2 {
					t.Errorf("node %d: exit %d, want 2", i, code)
				}
				if !strings.Contains(l.out.String(), tc.want) {
					t.Errorf("node %d's output lacks %q", i, tc.want)
				}
				if strings.Contains(l.out.String(), "[rank ") {
					t.Errorf("node %d started ranks", i)
				}
			}
			t.Logf("ended after %v", time.Since(start))
			checkNoneLeft(t, m)
		})
	}
}

// TestKilledNodeEndsAll SIGKILLs node 1's loomrun: its supervisors end its
// ranks, and node 0, no longer hearing node 1's heartbeat, ends its own
// after --node-timeout.
func TestKilledNodeEndsAll(t *testing.T) {
	port := freePort(t)
	m := argMarker(t)
	node0 := startNode(t, nodeFlags(port, 0, 2, "--node-timeout", "1s"), "0", "hold", "4", m)
	node1 := startNode(t, nodeFlags(port, 1, 2), "1", "hold", "4", m)
	if got := waitMarked(m, 10, 10*time.Second); got != 10 {
		t.Fatalf("%d loomruns, ranks and supervisors running, want 10", got)
	}
	killed := time.Now()
	if err := node1.cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	// --node-timeout 1s, then SIGTERM ends node 0's ranks at once.
	if code := waitExit(t, node0, 5*time.Second); code != 1 {
		t.Errorf("node 0: exit %d, want 1", code)
	}
	t.Logf("node 0 ended %v after node 1's loomrun was killed", time.Since(killed))
	for _, want := range []string{
		"loomrun[node 0]: job failed: node 1's loomrun stopped responding (no heartbeat for 1s)",
		"loomrun[node 0]: node 1 did not report its end; closing the rendezvous server",
	} {
		if !strings.Contains(node0.out.String(), want) {
			t.Errorf("node 0's output lacks %q", want)
		}
	}
	checkNoneLeft(t, m)
}

// blackhole is a TCP proxy to target that, once frozen, forwards nothing
// more in either direction and keeps every connection open: to the nodes
// behind it, a partition that no error reveals (a link taken down).
type blackhole struct {
	ln     net.Listener
	frozen atomic.Bool
}

// newBlackhole starts a proxy on a loopback port to target; the test's
// cleanup closes its listener (the connections end with the test binary).
func newBlackhole(t *testing.T, target string) *blackhole {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	b := &blackhole{ln: ln}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go b.serve(c, target)
		}
	}()
	return b
}

func (b *blackhole) port() int { return b.ln.Addr().(*net.TCPAddr).Port }

// serve connects c to target and copies both ways until frozen; from then
// on what arrives is read and dropped, and nothing is closed.
func (b *blackhole) serve(c net.Conn, target string) {
	if b.frozen.Load() {
		go io.Copy(io.Discard, c)
		return
	}
	s, err := net.Dial("tcp", target)
	if err != nil {
		c.Close()
		return
	}
	pump := func(dst, src net.Conn) {
		buf := make([]byte, 32<<10)
		for {
			n, err := src.Read(buf)
			if err != nil {
				return
			}
			if b.frozen.Load() {
				continue
			}
			if _, err := dst.Write(buf[:n]); err != nil {
				return
			}
		}
	}
	go pump(s, c)
	go pump(c, s)
}

// TestPartitionedNodesEndAll reaches node 0's store from node 1 (loomrun
// and ranks) through a proxy, which then stops forwarding without closing
// anything. Node 0 misses node 1's heartbeat; node 1, whose requests to
// the store go unanswered, concludes that node 0 is lost. Each ends its
// ranks within 2× --node-timeout, naming the other node.
func TestPartitionedNodesEndAll(t *testing.T) {
	const nodeTimeout = 2 * time.Second
	port := freePort(t)
	proxy := newBlackhole(t, net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
	m := argMarker(t)
	nt := []string{"--node-timeout", nodeTimeout.String()}
	nodes := []*launcher{
		startNode(t, nodeFlags(port, 0, 2, nt...), "0", "hold", "4", m),
		startNode(t, nodeFlags(proxy.port(), 1, 2, nt...), "1", "hold", "4", m),
	}
	if got := waitMarked(m, 10, 10*time.Second); got != 10 {
		t.Fatalf("%d loomruns, ranks and supervisors running, want 10", got)
	}
	started := time.Now()
	for !strings.Contains(nodes[1].out.String(), "[rank 3] verified") {
		if time.Since(started) > 10*time.Second {
			t.Fatal("rank 3 did not verify the job")
		}
		time.Sleep(10 * time.Millisecond)
	}
	cut := time.Now()
	proxy.frozen.Store(true)
	wants := []string{
		"loomrun[node 0]: job failed: node 1's loomrun stopped responding (no heartbeat for 2s)",
		"loomrun[node 1]: job failed: node 0's loomrun stopped responding (its rendezvous server at 127.0.0.1:",
	}
	for i, l := range nodes {
		if code := waitExit(t, l, 2*nodeTimeout-time.Since(cut)); code != 1 {
			t.Errorf("node %d: exit %d, want 1", i, code)
		}
		t.Logf("node %d ended %v after the partition", i, time.Since(cut))
		if !strings.Contains(l.out.String(), wants[i]) {
			t.Errorf("node %d's output lacks %q", i, wants[i])
		}
	}
	checkNoneLeft(t, m)
}
