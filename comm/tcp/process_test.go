package tcp_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/rendezvous"
	"github.com/b7ea7098/loom/comm/tcp"
)

// childEnv, set in a re-executed test binary, makes it one rank of a job
// (store address, rank, size, job id and mode, separated by commas)
// instead of running the tests.
const childEnv = "LOOM_TCP_TEST_CHILD"

func TestMain(m *testing.M) {
	if spec := os.Getenv(childEnv); spec != "" {
		os.Exit(child(spec))
	}
	os.Exit(m.Run())
}

// child runs one rank: rounds of AllReduce, checking each sum, and prints
// "ok" or "error: ..." on stdout. In mode "kill", rank 1 sends itself
// SIGKILL after 3 rounds.
func child(spec string) int {
	f := strings.Split(spec, ",")
	if len(f) != 5 {
		fmt.Println("error: bad spec", spec)
		return 2
	}
	rank, _ := strconv.Atoi(f[1])
	size, _ := strconv.Atoi(f[2])
	ctx := context.Background()
	store, err := rendezvous.Dial(ctx, f[0])
	if err != nil {
		fmt.Println("error:", err)
		return 1
	}
	defer store.Close()
	c, err := tcp.New(ctx, store, rank, size, tcp.WithJobID(f[3]), tcp.WithListen("127.0.0.1:0"), withTimeout(3*time.Second))
	if err != nil {
		fmt.Println("error:", err)
		return 1
	}
	defer c.Close()
	for i := range 50 {
		if f[4] == "kill" && rank == 1 && i == 3 {
			syscall.Kill(os.Getpid(), syscall.SIGKILL)
		}
		x := make([]float64, 100003)
		for j := range x {
			x[j] = float64(rank + 1)
		}
		if err := comm.AllReduce(ctx, c, comm.Host(x), comm.Host(x), comm.Sum); err != nil {
			fmt.Println("error:", err)
			return 0
		}
		if want := float64(size * (size + 1) / 2); x[0] != want || x[len(x)-1] != want {
			fmt.Println("error: round", i, "sum", x[0], "want", want)
			return 1
		}
	}
	if err := comm.Barrier(ctx, c); err != nil {
		fmt.Println("error:", err)
		return 0
	}
	fmt.Println("ok")
	return 0
}

// runProcesses starts size ranks as processes of this test binary and
// returns each one's output.
func runProcesses(t *testing.T, size int, mode string) []string {
	t.Helper()
	srv := store(t)
	job := fmt.Sprintf("proc%d", jobs.Add(1))
	out := make([]string, size)
	var wg sync.WaitGroup
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for r := range size {
		cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), fmt.Sprintf("%s=%s,%d,%d,%s,%s", childEnv, srv.Addr(), r, size, job, mode))
		wg.Go(func() {
			b, err := cmd.Output()
			out[r] = strings.TrimSpace(string(b))
			var ee *exec.ExitError
			if err != nil && !(errors.As(err, &ee) && mode == "kill" && r == 1) {
				out[r] += fmt.Sprintf(" (exit: %v)", err)
			}
		})
	}
	wg.Wait()
	return out
}

// Ranks as separate processes: an all-reduce loop agrees on every sum.
func TestProcesses(t *testing.T) {
	for _, p := range []int{2, 3} {
		for r, o := range runProcesses(t, p, "ok") {
			if o != "ok" {
				t.Errorf("p=%d rank %d: %s", p, r, o)
			}
		}
	}
}

// A rank process killed mid-sequence ends every other process with an
// error naming it, within twice the timeout.
func TestProcessKilled(t *testing.T) {
	start := time.Now()
	out := runProcesses(t, 3, "kill")
	if el := time.Since(start); el > 6*time.Second+2*time.Second {
		t.Errorf("took %v, more than twice the 3s timeout (and start-up)", el)
	}
	for _, r := range []int{0, 2} {
		if !strings.Contains(out[r], "rank 1: connection") {
			t.Errorf("rank %d: %q does not name rank 1's lost connection", r, out[r])
		}
	}
}
