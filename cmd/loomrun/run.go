package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/b7ea7098/loom/comm/rendezvous"
)

// child is one launched process.
type child struct {
	rank    int
	cmd     *exec.Cmd
	out     *lineWriter
	errOut  *lineWriter
	running bool
}

// exitInfo is what a child's Wait reported.
type exitInfo struct {
	rank  int
	state *os.ProcessState
	err   error
}

// childEnv returns the environment of rank: the parent's, with torchrun's
// variables set (replacing any inherited ones).
func childEnv(base []string, cfg *config, rank int, port string) []string {
	set := map[string]string{
		"RANK":             strconv.Itoa(rank),
		"WORLD_SIZE":       strconv.Itoa(cfg.nproc),
		"LOCAL_RANK":       strconv.Itoa(rank),
		"LOCAL_WORLD_SIZE": strconv.Itoa(cfg.nproc),
		"MASTER_ADDR":      cfg.masterAddr,
		"MASTER_PORT":      port,
	}
	env := make([]string, 0, len(base)+len(set))
	for _, kv := range base {
		k, _, _ := strings.Cut(kv, "=")
		if _, ok := set[k]; !ok {
			env = append(env, kv)
		}
	}
	keys := make([]string, 0, len(set))
	for k := range set {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		env = append(env, k+"="+set[k])
	}
	return env
}

// run starts the job described by cfg, copies the children's output to
// stdout and stderr with rank prefixes, forwards the signals received on
// sigs, and returns loomrun's exit status (see the command's doc). Ending ctx
// ends the job like SIGTERM does.
func run(ctx context.Context, cfg *config, stdout, stderr io.Writer, sigs <-chan os.Signal) int {
	// The children's death signal fires when the starting thread ends:
	// keep this goroutine, and so that thread, for the whole job.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()

	outW := &syncWriter{w: stdout}
	errW := &syncWriter{w: stderr}
	logf := func(format string, args ...any) { errW.printf("loomrun: "+format+"\n", args...) }

	srvCtx, stopSrv := context.WithCancel(context.Background())
	defer stopSrv()
	srv, err := rendezvous.Listen(srvCtx, net.JoinHostPort(cfg.masterAddr, strconv.Itoa(cfg.masterPort)))
	if err != nil {
		logf("cannot start the rendezvous server: %v", err)
		return 2
	}
	defer srv.Close() // Server.Close always returns nil
	_, port, err := net.SplitHostPort(srv.Addr())
	if err != nil {
		logf("rendezvous server address %q: %v", srv.Addr(), err)
		return 2
	}

	results := make(chan exitInfo, cfg.nproc)
	children := make([]*child, 0, cfg.nproc)
	base := os.Environ()
	waitDelay := max(cfg.grace, time.Second)
	startErr := error(nil)
	for rank := 0; rank < cfg.nproc; rank++ {
		c := &child{rank: rank, out: newLineWriter(outW, rank), errOut: newLineWriter(errW, rank)}
		c.cmd = exec.Command(cfg.prog, cfg.args...)
		c.cmd.Env = childEnv(base, cfg, rank, port)
		c.cmd.Stdout = c.out
		c.cmd.Stderr = c.errOut
		c.cmd.WaitDelay = waitDelay
		setProcAttr(c.cmd)
		if err := c.cmd.Start(); err != nil {
			startErr = fmt.Errorf("rank %d failed to start: %w", rank, err)
			break
		}
		c.running = true
		children = append(children, c)
		go func() {
			err := c.cmd.Wait()
			c.out.Flush()
			c.errOut.Flush()
			results <- exitInfo{rank: c.rank, state: c.cmd.ProcessState, err: err}
		}()
	}

	remaining := len(children)
	stopping := false
	var killTimer <-chan time.Time
	var jobTimer <-chan time.Time
	if cfg.timeout > 0 {
		t := time.NewTimer(cfg.timeout)
		defer t.Stop()
		jobTimer = t.C
	}
	var (
		failure     string    // how the first failed rank ended
		interrupted os.Signal // the first signal forwarded
		timedOut    bool
	)
	runningRanks := func() []int {
		var r []int
		for _, c := range children {
			if c.running {
				r = append(r, c.rank)
			}
		}
		return r
	}
	signalAll := func(sig os.Signal) {
		for _, c := range children {
			if c.running {
				// The one failure is a child that exited since the
				// check; the wait loop reports its exit.
				_ = signalChild(c.cmd.Process, sig)
			}
		}
	}
	// stop sends sig to every running child and starts the grace period.
	stop := func(sig os.Signal) {
		if rs := runningRanks(); len(rs) > 0 {
			logf("sending %s to rank(s) %s; SIGKILL after %v", sigString(sig), rankList(rs), cfg.grace)
		}
		signalAll(sig)
		if !stopping {
			stopping = true
			killTimer = time.After(cfg.grace)
		}
	}
	if startErr != nil {
		logf("%v", startErr)
		stop(termSignal)
	}
	done := ctx.Done()

	for remaining > 0 {
		select {
		case r := <-results:
			remaining--
			children[r.rank].running = false
			desc, failed := "", false
			if r.state != nil {
				desc, failed = describeExit(r.state)
			} else {
				desc, failed = fmt.Sprintf("ended: %v", r.err), true
			}
			if !failed && errors.Is(r.err, exec.ErrWaitDelay) {
				logf("rank %d exited with status 0 but its output was still open %v later (a leftover child process?)", r.rank, waitDelay)
			}
			switch {
			case failed && !stopping:
				failure = fmt.Sprintf("rank %d %s", r.rank, desc)
				logf("%s; ending the other ranks", failure)
				stop(termSignal)
			case failed:
				logf("rank %d %s", r.rank, desc)
			case stopping:
				logf("rank %d %s", r.rank, desc)
			}
		case sig := <-sigs:
			if interrupted == nil && failure == "" && !timedOut {
				interrupted = sig
			}
			logf("received %s; forwarding it", sigString(sig))
			stop(sig)
		case <-done:
			done = nil
			if interrupted == nil && failure == "" && !timedOut {
				interrupted = termSignal
			}
			logf("cancelled; ending the job")
			stop(termSignal)
		case <-jobTimer:
			jobTimer = nil
			if failure == "" && interrupted == nil {
				timedOut = true
			}
			logf("job timed out after %v; ending it", cfg.timeout)
			stop(termSignal)
		case <-killTimer:
			killTimer = nil
			if rs := runningRanks(); len(rs) > 0 {
				logf("rank(s) %s still running %v after being told to stop; sending SIGKILL", rankList(rs), cfg.grace)
				signalAll(os.Kill)
			}
		}
	}

	switch {
	case startErr != nil:
		logf("job failed: %v", startErr)
		return 2
	case failure != "":
		logf("job failed: %s", failure)
		return 1
	case timedOut:
		logf("job failed: timed out after %v", cfg.timeout)
		return 1
	case interrupted != nil:
		logf("job stopped by %s", sigString(interrupted))
		return signalExitCode(interrupted)
	}
	return 0
}

// rankList formats ranks compactly: "0,2,3".
func rankList(ranks []int) string {
	s := make([]string, len(ranks))
	for i, r := range ranks {
		s[i] = strconv.Itoa(r)
	}
	return strings.Join(s, ",")
}
