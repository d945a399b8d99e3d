package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/b7ea7098/loom/comm/rendezvous"
)

const (
	// exitOutputWait is how long the report of a rank's exit waits for the
	// rank's output to reach end of file, so that its last lines come
	// before the report. A child that still holds the output only delays
	// the report by this much.
	exitOutputWait = 100 * time.Millisecond
	// drainTimeout is how long loomrun keeps reading a rank's output once
	// every process of the rank has been ended: only a process that left
	// the rank's group and escaped its supervisor can still hold it.
	drainTimeout = 250 * time.Millisecond
	// sweepTimeout bounds the SIGKILL phase of a supervisor's cleanup (a
	// process in uninterruptible sleep does not die at once).
	sweepTimeout = 5 * time.Second
	// pollInterval is how often a cleanup checks for remaining processes.
	pollInterval = 10 * time.Millisecond
)

// rankExit is how a rank's main process ended.
type rankExit struct {
	code   int // exit status; meaningful when signal is 0
	signal int // number of the signal that killed the process; 0 if it exited
}

// describe says how the process ended and whether that is a failure.
func (e rankExit) describe() (string, bool) {
	if e.signal != 0 {
		return "was killed by signal " + signalName(e.signal), true
	}
	return fmt.Sprintf("exited with status %d", e.code), e.code != 0
}

// eventKind says what a rankEvent reports.
type eventKind int

const (
	evStarted  eventKind = iota // the rank's process runs, in process group pgid
	evFailed                    // the rank's process could not be started (err)
	evExited                    // the rank's process ended (exit)
	evLeftover                  // n processes of the rank still ran at the end (n < 0: unknown)
	evNote                      // a message from the rank's supervisor (msg)
	evEnded                     // nothing of the rank is left; err: how its supervisor ended
)

// rankEvent is what the goroutine watching a rank tells run's loop.
type rankEvent struct {
	rank int
	kind eventKind
	pgid int
	exit rankExit
	n    int
	msg  string
	err  error
}

// rankSpec is what starting one rank needs.
type rankSpec struct {
	rank  int
	path  string   // the program, resolved by exec.LookPath
	args  []string // its argv; args[0] is the name the user gave
	env   []string
	grace time.Duration
}

// rankProc is one rank as the launcher sees it.
type rankProc struct {
	rank        int
	h           *handle // the platform's part (proc_unix.go, proc_other.go)
	out, errOut *copier
	pgid        int  // the rank's process group; 0 until started
	exited      bool // its main process ended, failed to start, or was lost
	finished    bool // its supervisor was told that the job is over
	ended       bool // nothing of it is left (evEnded)
}

// waitOutput waits at most d for both of the rank's outputs to reach end
// of file.
func (p *rankProc) waitOutput(d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	for _, c := range []*copier{p.out, p.errOut} {
		select {
		case <-c.done:
		case <-t.C:
			return
		}
	}
}

// copier copies one output pipe of a rank into its lineWriter until end of
// file, or until the deadline that stop sets.
type copier struct {
	r    *os.File
	done chan struct{}
	err  error // the copy's error; read only after done is closed
}

func startCopier(r *os.File, w *lineWriter) *copier {
	c := &copier{r: r, done: make(chan struct{})}
	go func() {
		defer close(c.done)
		_, c.err = io.Copy(w, r)
		w.Flush()
		// Only the read end of a pipe: closing it cannot lose data.
		_ = r.Close()
	}()
	return c
}

// stopAt makes the copy end at deadline if the pipe is still open then.
func (c *copier) stopAt(deadline time.Time) {
	// Fails only where pipes have no deadlines (Windows) or when the copy
	// already ended and closed the pipe; wait's timer covers both.
	_ = c.r.SetReadDeadline(deadline)
}

// wait waits for the copy to end, at most until a little after deadline,
// and reports whether some process still held the pipe open at deadline.
func (c *copier) wait(deadline time.Time) bool {
	t := time.NewTimer(time.Until(deadline) + 100*time.Millisecond)
	defer t.Stop()
	select {
	case <-c.done:
		return errors.Is(c.err, os.ErrDeadlineExceeded)
	case <-t.C:
		return true // abandoned: the read ends with the pipe's last holder
	}
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

// launchRank creates the rank's output pipes and their copiers, and starts
// the rank.
func launchRank(s *rankSpec, outW, errW *syncWriter, events chan<- rankEvent) (*rankProc, error) {
	p := &rankProc{rank: s.rank}
	outR, outPipe, err := os.Pipe()
	if err != nil {
		return nil, fmt.Errorf("rank %d: stdout pipe: %w", s.rank, err)
	}
	errR, errPipe, err := os.Pipe()
	if err != nil {
		outR.Close()
		outPipe.Close()
		return nil, fmt.Errorf("rank %d: stderr pipe: %w", s.rank, err)
	}
	p.out = startCopier(outR, newLineWriter(outW, s.rank))
	p.errOut = startCopier(errR, newLineWriter(errW, s.rank))
	err = startProcess(p, s, outPipe, errPipe, events)
	// The child has its own copies of the write ends: closing ours lets
	// the copiers see end of file once the rank's processes are gone.
	outPipe.Close()
	errPipe.Close()
	if err != nil {
		return nil, fmt.Errorf("rank %d failed to start: %w", s.rank, err)
	}
	return p, nil
}

// run starts the job described by cfg, copies the children's output to
// stdout and stderr with rank prefixes, forwards the signals received on
// sigs, and returns loomrun's exit status (see the command's doc). Ending ctx
// ends the job like SIGTERM does. run returns only when no process of the
// job is left (see the command's doc for the mechanism and its limits).
func run(ctx context.Context, cfg *config, stdout, stderr io.Writer, sigs <-chan os.Signal) int {
	outW := &syncWriter{w: stdout}
	errW := &syncWriter{w: stderr}
	logf := func(format string, args ...any) { errW.printf("loomrun: "+format+"\n", args...) }

	path, err := exec.LookPath(cfg.prog)
	if err != nil {
		logf("cannot start the ranks: %v", err)
		return 2
	}
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

	// Every watcher sends a handful of events; run's loop receives them
	// all before returning, so no watcher is left blocked.
	events := make(chan rankEvent, cfg.nproc)
	ranks := make([]*rankProc, 0, cfg.nproc)
	base := os.Environ()
	var startErr error
	for rank := 0; rank < cfg.nproc; rank++ {
		s := &rankSpec{
			rank: rank, path: path, args: append([]string{cfg.prog}, cfg.args...),
			env: childEnv(base, cfg, rank, port), grace: cfg.grace,
		}
		p, err := launchRank(s, outW, errW, events)
		if err != nil {
			startErr = err
			break
		}
		ranks = append(ranks, p)
	}

	var (
		stopping    bool
		stopSig     os.Signal // the last signal sent to every group
		killTimer   <-chan time.Time
		jobTimer    <-chan time.Time
		endTimer    <-chan time.Time // bounds the supervisors' cleanup
		finishing   bool             // every rank exited: the job is being cleaned up
		failure     string           // how the first failed rank ended
		interrupted os.Signal        // the first signal forwarded
		timedOut    bool
		remaining   = len(ranks) // ranks not ended
	)
	if cfg.timeout > 0 {
		t := time.NewTimer(cfg.timeout)
		defer t.Stop()
		jobTimer = t.C
	}
	runningRanks := func() []int {
		var r []int
		for _, p := range ranks {
			if !p.exited {
				r = append(r, p.rank)
			}
		}
		return r
	}
	// signalGroup signals the rank's whole process group, also when its
	// leader has exited: leftover children are in it. A group is signalled
	// only while its supervisor keeps it from being reused (see handle).
	signalGroup := func(p *rankProc, sig os.Signal) {
		if p.pgid == 0 || p.finished || p.ended {
			return
		}
		// The only failure is a group that is already empty (ESRCH).
		_ = p.h.signal(p.pgid, sig)
	}
	signalAll := func(sig os.Signal) {
		for _, p := range ranks {
			signalGroup(p, sig)
		}
	}
	// stop sends sig to every rank's group and starts the grace period.
	stop := func(sig os.Signal) {
		if rs := runningRanks(); len(rs) > 0 {
			logf("sending %s to rank(s) %s; SIGKILL after %v", sigString(sig), rankList(rs), cfg.grace)
		}
		stopSig = sig
		signalAll(sig)
		if !stopping {
			stopping = true
			killTimer = time.After(cfg.grace)
		}
	}
	// finishIfDone tells every supervisor that the job is over once every
	// rank has exited: each ends what is left of its rank (SIGTERM, SIGKILL
	// after --grace) and exits.
	finishIfDone := func() {
		if finishing || len(runningRanks()) > 0 {
			return
		}
		finishing = true
		killTimer = nil
		for _, p := range ranks {
			if !p.ended {
				p.finished = true
				p.h.finish()
			}
		}
		endTimer = time.After(cfg.grace + sweepTimeout + 2*time.Second)
	}
	if startErr != nil {
		logf("%v", startErr)
		stop(termSignal)
	}
	finishIfDone()
	done := ctx.Done()

	for remaining > 0 {
		select {
		case e := <-events:
			p := ranks[e.rank]
			switch e.kind {
			case evStarted:
				p.pgid = e.pgid
				if stopping {
					signalGroup(p, stopSig)
				}
			case evFailed:
				p.exited = true
				logf("rank %d failed to start: %v", p.rank, e.err)
				if startErr == nil && failure == "" {
					startErr = fmt.Errorf("rank %d failed to start: %w", p.rank, e.err)
				}
				if !stopping {
					stop(termSignal)
				}
			case evExited:
				p.exited = true
				desc, failed := e.exit.describe()
				switch {
				case failed && !stopping:
					failure = fmt.Sprintf("rank %d %s", p.rank, desc)
					logf("%s; ending the other ranks", failure)
					stop(termSignal)
				case failed || stopping:
					logf("rank %d %s", p.rank, desc)
				}
			case evLeftover:
				if e.n < 0 {
					logf("rank %d left processes running; ending them", p.rank)
				} else {
					logf("rank %d left %d process(es) running; ending them", p.rank, e.n)
				}
			case evNote:
				logf("rank %d: %s", p.rank, e.msg)
			case evEnded:
				p.ended = true
				remaining--
				if p.finished {
					break
				}
				// The supervisor died before the job ended (someone killed
				// it): what is left of the rank's group has nobody to clean
				// it up but us, and is likely still there, keeping the
				// group's id from being reused.
				if p.pgid != 0 {
					_ = p.h.signal(p.pgid, os.Kill) // ESRCH: already empty
				}
				switch {
				case !p.exited:
					p.exited = true
					how := "exit status 0"
					if e.err != nil {
						how = e.err.Error()
					}
					desc := fmt.Sprintf("rank %d was lost: its supervisor ended (%s)", p.rank, how)
					if !stopping {
						failure = desc
						logf("%s; ending the other ranks", failure)
						stop(termSignal)
					} else {
						logf("%s", desc)
					}
				case e.err != nil:
					logf("rank %d: its supervisor ended early (%v)", p.rank, e.err)
				}
			}
			finishIfDone()
		case sig := <-sigs:
			if finishing {
				logf("received %s; the job is already ending", sigString(sig))
				continue
			}
			if interrupted == nil && failure == "" && !timedOut {
				interrupted = sig
			}
			logf("received %s; forwarding it", sigString(sig))
			stop(sig)
		case <-done:
			done = nil
			if finishing {
				continue
			}
			if interrupted == nil && failure == "" && !timedOut {
				interrupted = termSignal
			}
			logf("cancelled; ending the job")
			stop(termSignal)
		case <-jobTimer:
			jobTimer = nil
			if finishing {
				continue
			}
			if failure == "" && interrupted == nil {
				timedOut = true
			}
			logf("job timed out after %v; ending it", cfg.timeout)
			stop(termSignal)
		case <-killTimer:
			killTimer = nil
			if rs := runningRanks(); len(rs) > 0 {
				logf("rank(s) %s still running %v after being told to stop; sending SIGKILL", rankList(rs), cfg.grace)
			}
			stopSig = os.Kill
			signalAll(os.Kill)
		case <-endTimer:
			endTimer = nil
			for _, p := range ranks {
				if !p.ended {
					logf("rank %d: its supervisor did not finish its cleanup; killing it", p.rank)
					p.h.kill()
				}
			}
		}
	}

	// Every rank's processes are gone; only a process that escaped its
	// supervisor can still hold an output pipe: read for drainTimeout more.
	deadline := time.Now().Add(drainTimeout)
	for _, p := range ranks {
		p.out.stopAt(deadline)
		p.errOut.stopAt(deadline)
	}
	for _, p := range ranks {
		if held := p.out.wait(deadline); p.errOut.wait(deadline) || held {
			logf("rank %d: its output was still open %v after its processes ended; stopped reading it", p.rank, drainTimeout)
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
