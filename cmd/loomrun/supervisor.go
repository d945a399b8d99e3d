//go:build unix

package main

import (
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// supervisorEnv, set to "1" in its environment, makes loomrun run as the
// supervisor of one rank (superviseMain) instead of as the launcher. It is
// internal: the supervisor removes it from the rank's environment, so a
// rank that is itself loomrun launches normally.
const supervisorEnv = "LOOMRUN_SUPERVISOR"

// isSupervisor reports whether this process was started as a supervisor.
func isSupervisor() bool { return os.Getenv(supervisorEnv) == "1" }

// The status protocol, supervisor to launcher, one line per event:
//
//	started PID     the rank runs; PID is also its process group
//	failed MSG      the rank could not be started
//	exited CODE     the rank's process exited with status CODE
//	signaled SIG    the rank's process was killed by signal SIG
//	leftover N      N processes of the rank still ran at the end (-1: unknown)
//	note MSG        something to log
//
// Its end of file means the supervisor is exiting.

// parseStatus decodes one status line; a malformed one becomes a note.
func parseStatus(line string) rankEvent {
	word, arg, _ := strings.Cut(line, " ")
	n, err := strconv.Atoi(arg)
	switch {
	case word == "failed":
		return rankEvent{kind: evFailed, err: errors.New(arg)}
	case word == "note":
		return rankEvent{kind: evNote, msg: arg}
	case err != nil:
	case word == "started" && n > 0:
		return rankEvent{kind: evStarted, pgid: n}
	case word == "exited":
		return rankEvent{kind: evExited, exit: rankExit{code: n}}
	case word == "signaled" && n > 0:
		return rankEvent{kind: evExited, exit: rankExit{signal: n}}
	case word == "leftover":
		return rankEvent{kind: evLeftover, n: n}
	}
	return rankEvent{kind: evNote, msg: fmt.Sprintf("malformed status line from the supervisor: %q", line)}
}

// supervisor is the state of superviseMain.
type supervisor struct {
	status *os.File // the status pipe to the launcher
	pid    int      // the rank's process, leader of its own group
}

// send writes one status line. A failure means the launcher is gone and
// nobody is left to tell, so it is dropped; cleanup goes on regardless.
func (s *supervisor) send(word string, arg any) {
	line := strings.ReplaceAll(fmt.Sprint(arg), "\n", " ")
	_, _ = fmt.Fprintf(s.status, "%s %s\n", word, line)
}

// sendExit reports how the rank ended.
func (s *supervisor) sendExit(e rankExit) {
	if e.signal != 0 {
		s.send("signaled", e.signal)
	} else {
		s.send("exited", e.code)
	}
}

// superviseMain runs one rank: args are the grace period, the program's
// path and its argv. See the command's doc for what a supervisor does and
// why. It returns the supervisor's exit status: 0 once it reported the
// rank's end, whatever that was.
func superviseMain(args []string) int {
	// The rank's parent-death signal fires when the thread that started
	// it ends: keep this goroutine, and so that thread, until the end.
	runtime.LockOSThread()
	// The rank must not inherit the protocol pipes: a rank's child holding
	// the status pipe would hide the supervisor's end from the launcher.
	syscall.CloseOnExec(ctrlFD)
	syscall.CloseOnExec(statusFD)
	s := &supervisor{status: os.NewFile(statusFD, "loomrun-status")}
	ctrl := os.NewFile(ctrlFD, "loomrun-control")
	if _, err := unix.FcntlInt(statusFD, unix.F_GETFD, 0); err != nil || len(args) < 3 {
		fmt.Fprintf(os.Stderr, "loomrun: %s is set but this process was not started by loomrun\n", supervisorEnv)
		return 2
	}
	grace, err := time.ParseDuration(args[0])
	if err != nil {
		s.send("failed", fmt.Sprintf("supervisor: grace %q: %v", args[0], err))
		return 2
	}
	env := make([]string, 0, len(os.Environ()))
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, supervisorEnv+"=") && !strings.HasPrefix(kv, cpusEnv+"=") {
			env = append(env, kv)
		}
	}
	// Pinned here, on the locked thread that starts the rank: the rank
	// inherits the mask before it runs anything, all its threads too. A
	// failure costs speed, not correctness, so the rank starts unpinned.
	if list := os.Getenv(cpusEnv); list != "" {
		cpus, err := parseCPUs(list)
		if err == nil {
			err = pinThread(cpus)
		}
		if err != nil {
			s.send("note", fmt.Sprintf("rank not bound to CPUs %s: %v", list, err))
		}
	}
	if err := setSubreaper(); err != nil {
		s.send("note", fmt.Sprintf("cannot become a child subreaper (%v): orphans of the rank that leave its process group may outlive the job", err))
	}
	// Caught, not ignored: the rank must start with the default handlers
	// (an ignored signal would stay ignored across exec).
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT, syscall.SIGHUP)

	pid, err := syscall.ForkExec(args[1], args[2:], &syscall.ProcAttr{
		Env: env, Files: []uintptr{0, 1, 2}, Sys: rankSysProcAttr(),
	})
	if err != nil {
		s.send("failed", err)
		return 0 // reported: the launcher expects no more
	}
	s.pid = pid
	s.send("started", pid)
	// The rank alone holds its output pipes from now on, so the launcher
	// sees their end when the rank's processes are gone.
	if err := quietStdio(); err != nil {
		s.send("note", fmt.Sprintf("supervisor: cannot release the output pipes: %v", err))
	}

	exits := make(chan rankExit, 1)
	go func() {
		if e, ok := waitRank(pid); ok {
			exits <- e
		}
	}()
	end := make(chan struct{})
	go func() {
		// Ends at end of file (the launcher finished or died) or on an
		// error, which means the same.
		_, _ = io.Copy(io.Discard, ctrl)
		close(end)
	}()
	reported := false
wait:
	for {
		select {
		case e := <-exits:
			s.sendExit(e)
			reported = true
		case <-end:
			break wait
		case <-sigs:
			break wait
		}
	}
	e, reaped := s.endGroup(grace)
	if !reported {
		select {
		case e := <-exits:
			s.sendExit(e)
		default:
			if reaped {
				s.sendExit(e)
			}
		}
	}
	return 0
}

// endGroup ends what is left of the rank: SIGTERM to its process group and
// to the supervisor's other children (orphans that left the group), SIGKILL
// after grace, until nothing is left or sweepTimeout passes. It reaps every
// child, and returns the rank's exit if it reaped the rank.
func (s *supervisor) endGroup(grace time.Duration) (rankExit, bool) {
	var (
		exit   rankExit
		reaped bool
	)
	// reap reaps every exited child and reports whether none is left. As
	// a subreaper, no child means no descendant at all.
	reap := func() bool {
		for {
			var ws syscall.WaitStatus
			pid, err := syscall.Wait4(-1, &ws, syscall.WNOHANG, nil)
			switch {
			case errors.Is(err, syscall.EINTR):
			case err != nil: // ECHILD
				return true
			case pid == 0:
				return false
			case pid == s.pid:
				exit, reaped = exitOf(ws), true
			}
		}
	}
	drained := func() bool {
		return reap() && errors.Is(syscall.Kill(-s.pid, 0), syscall.ESRCH)
	}
	if drained() {
		return exit, reaped
	}
	// Between a drained that failed and a signal the group cannot be
	// reused: its members are our descendants and only we reap them.
	killAll := func() {
		left, _ := subtree(s.pid)
		// ESRCH: the group emptied meanwhile; the others likewise.
		_ = syscall.Kill(-s.pid, syscall.SIGKILL)
		for _, p := range left {
			if p.pgid != s.pid {
				_ = syscall.Kill(p.pid, syscall.SIGKILL)
			}
		}
	}
	left, known := subtree(s.pid)
	if !known {
		s.send("leftover", -1)
	} else if len(left) > 0 {
		s.send("leftover", len(left))
	}
	// SIGTERM to the group once, and to each process outside it as it
	// appears: one that left the group becomes our child only when its
	// parent, ended by the first SIGTERM, dies.
	_ = syscall.Kill(-s.pid, syscall.SIGTERM) // ESRCH: emptied meanwhile
	termed := map[int]bool{}
	for deadline := time.Now().Add(grace); ; {
		for _, p := range left {
			if p.pgid != s.pid && !termed[p.pid] {
				termed[p.pid] = true
				_ = syscall.Kill(p.pid, syscall.SIGTERM) // ESRCH: gone meanwhile
			}
		}
		time.Sleep(pollInterval)
		if drained() {
			return exit, reaped
		}
		if time.Now().After(deadline) {
			break
		}
		left, _ = subtree(s.pid)
	}
	for deadline := time.Now().Add(sweepTimeout); ; {
		killAll()
		time.Sleep(pollInterval)
		if drained() {
			return exit, reaped
		}
		if time.Now().After(deadline) {
			left, _ := subtree(s.pid)
			s.send("note", fmt.Sprintf("%d process(es) still there %v after SIGKILL", len(left), sweepTimeout))
			return exit, reaped
		}
	}
}

// quietStdio points this process's stdout and stderr at /dev/null.
func quietStdio() error {
	null, err := os.OpenFile(os.DevNull, os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	defer null.Close()
	for _, fd := range []int{1, 2} {
		if err := unix.Dup2(int(null.Fd()), fd); err != nil {
			return fmt.Errorf("dup2 %s onto %d: %w", os.DevNull, fd, err)
		}
	}
	return nil
}

// proc is one process found by subtree.
type proc struct {
	pid, pgid int
}
