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
	cpus  []int // the CPUs to pin the rank to; nil: not pinned
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

// childEnv returns the environment of the node's local rank: the
// parent's, with torchrun's variables set (replacing any inherited ones).
func childEnv(base []string, cfg *config, local int, port string) []string {
	nnodes := max(cfg.nnodes, 1)
	set := map[string]string{
		"RANK":             strconv.Itoa(cfg.nodeRank*cfg.nproc + local),
		"WORLD_SIZE":       strconv.Itoa(nnodes * cfg.nproc),
		"LOCAL_RANK":       strconv.Itoa(local),
		"LOCAL_WORLD_SIZE": strconv.Itoa(cfg.nproc),
		"GROUP_RANK":       strconv.Itoa(cfg.nodeRank),
		"GROUP_WORLD_SIZE": strconv.Itoa(nnodes),
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

// run starts this node's part of the job described by cfg, copies the
// children's output to stdout and stderr with rank prefixes, forwards the
// signals received on sigs, and returns loomrun's exit status (see the
// command's doc). Ending ctx ends the job like SIGTERM does. With several
// nodes it first joins the others at node 0's server and ends this node's
// ranks when another node fails. run returns only when no process of this
// node's ranks is left (see the command's doc for the mechanism and its
// limits) and, on node 0, when the other nodes are done with the server.
func run(ctx context.Context, cfg *config, stdout, stderr io.Writer, sigs <-chan os.Signal) int {
	outW := &syncWriter{w: stdout}
	errW := &syncWriter{w: stderr}
	nnodes := max(cfg.nnodes, 1)
	prefix := "loomrun: "
	if nnodes > 1 {
		prefix = fmt.Sprintf("loomrun[node %d]: ", cfg.nodeRank)
	}
	logf := func(format string, args ...any) { errW.printf(prefix+format+"\n", args...) }

	path, err := exec.LookPath(cfg.prog)
	if err != nil {
		logf("cannot start the ranks: %v", err)
		return 2
	}
	port := strconv.Itoa(cfg.masterPort)
	if cfg.nodeRank == 0 {
		srvCtx, stopSrv := context.WithCancel(context.Background())
		defer stopSrv()
		srv, err := rendezvous.Listen(srvCtx, net.JoinHostPort(cfg.masterAddr, port))
		if err != nil {
			logf("cannot start the rendezvous server: %v", err)
			return 2
		}
		defer srv.Close() // Server.Close always returns nil
		if _, port, err = net.SplitHostPort(srv.Addr()); err != nil {
			logf("rendezvous server address %q: %v", srv.Addr(), err)
			return 2
		}
	}
	if nnodes == 1 {
		code, _ := runNode(ctx, cfg, path, port, nil, outW, errW, logf, sigs)
		return code
	}

	// Several nodes: meet at node 0's server, run this node's ranks, and
	// on node 0 keep the server up until every node is done with it.
	cl, err := dialCluster(cfg, net.JoinHostPort(cfg.masterAddr, port), logf)
	if err != nil {
		logf("join failed: %v", err)
		return 2
	}
	joined, err := cl.join()
	if err != nil {
		logf("join failed: %v", err)
		if cfg.nodeRank == 0 {
			if _, _, missing := cl.awaitNodes(joined, joinFailureWait, joinFailureWait, nil); len(missing) > 0 {
				logf("%s did not acknowledge the failed join within %v", nodeNames(missing), joinFailureWait)
			}
		}
		cl.finish("join failed: " + err.Error())
		return 2
	}
	cl.startBeats()
	code, outcome := runNode(ctx, cfg, path, port, cl, outW, errW, logf, sigs)
	if cfg.nodeRank == 0 {
		// A node that fails stops its ranks within --grace and the
		// supervisors' sweep; a node whose ranks still run may take as
		// long as the job does.
		afterFailure := cfg.grace + sweepTimeout + drainTimeout + stopSlack
		bound := time.Duration(0)
		if outcome != "" {
			bound = afterFailure
		}
		failures, first, missing := cl.awaitNodes(joined, bound, afterFailure, sigs)
		if len(missing) > 0 {
			logf("%s did not report its end; closing the rendezvous server", nodeNames(missing))
		}
		if first == "" && len(failures) > 0 {
			first = failures[0]
		}
		if code == 0 && first != "" {
			logf("job failed: %s", first)
			code = 1
		}
	}
	cl.finish(outcome)
	return code
}

// bindPlan returns the CPUs of each local rank under --bind core, nil
// (saying why through logf) where ranks cannot each have cores of their
// own.
func bindPlan(cfg *config, logf func(string, ...any)) [][]int {
	if cfg.bind != bindCore {
		return nil
	}
	cpus, err := allowedCPUs()
	if err != nil {
		logf("not binding ranks to cores: %v", err)
		return nil
	}
	plan, why := planCPUs(cpus, cfg.nproc)
	if plan == nil {
		logf("%s", why)
	}
	return plan
}

// runNode runs this node's ranks (see run) and returns loomrun's exit
// status and, when it is not 0, why, for the other nodes. cl is nil for a
// job of one node; with cl set, the first failure on this node is
// published to the other nodes, and a failure published by another node
// ends this node's ranks.
func runNode(ctx context.Context, cfg *config, path, port string, cl *cluster, outW, errW *syncWriter, logf func(string, ...any), sigs <-chan os.Signal) (int, string) {
	base := cfg.nodeRank * cfg.nproc // this node's first rank
	rankName := func(r int) string { return "rank " + strconv.Itoa(r) }
	var remote <-chan string
	publish := func(string) {}
	if cl != nil {
		rankName = func(r int) string { return fmt.Sprintf("rank %d (node %d)", r, cfg.nodeRank) }
		remote = cl.failed
		publish = cl.publish
	}

	// Every watcher sends a handful of events; run's loop receives them
	// all before returning, so no watcher is left blocked.
	events := make(chan rankEvent, cfg.nproc)
	ranks := make([]*rankProc, 0, cfg.nproc)
	env := os.Environ()
	plan := bindPlan(cfg, logf)
	var startErr error
	for local := 0; local < cfg.nproc; local++ {
		s := &rankSpec{
			rank: base + local, path: path, args: append([]string{cfg.prog}, cfg.args...),
			env: childEnv(env, cfg, local, port), grace: cfg.grace,
		}
		if plan != nil {
			s.cpus = plan[local]
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
		publish(fmt.Sprintf("node %d: %v", cfg.nodeRank, startErr))
		stop(termSignal)
	}
	finishIfDone()
	done := ctx.Done()

	for remaining > 0 {
		select {
		case e := <-events:
			p := ranks[e.rank-base]
			switch e.kind {
			case evStarted:
				p.pgid = e.pgid
				if stopping {
					signalGroup(p, stopSig)
				}
			case evFailed:
				p.exited = true
				logf("%s failed to start: %v", rankName(p.rank), e.err)
				if startErr == nil && failure == "" {
					startErr = fmt.Errorf("%s failed to start: %w", rankName(p.rank), e.err)
				}
				if !stopping {
					publish(startErr.Error())
					stop(termSignal)
				}
			case evExited:
				p.exited = true
				desc, failed := e.exit.describe()
				switch {
				case failed && !stopping:
					failure = rankName(p.rank) + " " + desc
					logf("%s; ending the other ranks", failure)
					publish(failure)
					stop(termSignal)
				case failed || stopping:
					logf("%s %s", rankName(p.rank), desc)
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
					desc := fmt.Sprintf("%s was lost: its supervisor ended (%s)", rankName(p.rank), how)
					if !stopping {
						failure = desc
						logf("%s; ending the other ranks", failure)
						publish(failure)
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
				publish(fmt.Sprintf("node %d's loomrun received %s", cfg.nodeRank, sigString(sig)))
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
				publish(fmt.Sprintf("node %d's loomrun was cancelled", cfg.nodeRank))
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
				publish(fmt.Sprintf("node %d timed out after %v", cfg.nodeRank, cfg.timeout))
			}
			logf("job timed out after %v; ending it", cfg.timeout)
			stop(termSignal)
		case reason := <-remote:
			// Another node failed (or this one, already being handled).
			remote = nil
			if finishing || stopping {
				continue
			}
			failure = reason
			logf("%s; ending this node's ranks", reason)
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
		return 2, startErr.Error()
	case failure != "":
		logf("job failed: %s", failure)
		return 1, failure
	case timedOut:
		logf("job failed: timed out after %v", cfg.timeout)
		return 1, fmt.Sprintf("node %d timed out after %v", cfg.nodeRank, cfg.timeout)
	case interrupted != nil:
		logf("job stopped by %s", sigString(interrupted))
		return signalExitCode(interrupted), fmt.Sprintf("node %d was stopped by %s", cfg.nodeRank, sigString(interrupted))
	}
	return 0, ""
}

// rankList formats ranks compactly: "0,2,3".
func rankList(ranks []int) string {
	s := make([]string, len(ranks))
	for i, r := range ranks {
		s[i] = strconv.Itoa(r)
	}
	return strings.Join(s, ",")
}
