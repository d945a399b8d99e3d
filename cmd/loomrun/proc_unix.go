//go:build unix

package main

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"syscall"
)

// handle is the launcher's part of a supervised rank: the supervisor
// process and the write end of its control pipe. While the control pipe is
// open the supervisor keeps the rank's process group from being reused
// (see supervisor.go), so the launcher may signal the group even after its
// leader has exited.
type handle struct {
	sup  *exec.Cmd
	ctrl *os.File
}

// The supervisor's extra file descriptors, in the order of ExtraFiles.
const (
	ctrlFD   = 3 // read end of the control pipe: end of file means the job is over
	statusFD = 4 // write end of the status pipe: one line per event
)

// startProcess starts the supervisor of rank s, which starts the rank's
// program with stdout and stderr, and a goroutine that turns the
// supervisor's reports into events.
func startProcess(p *rankProc, s *rankSpec, stdout, stderr *os.File, events chan<- rankEvent) error {
	exe, err := selfExe()
	if err != nil {
		return fmt.Errorf("cannot find loomrun's executable to supervise the rank: %w", err)
	}
	ctrlR, ctrlW, err := os.Pipe()
	if err != nil {
		return fmt.Errorf("control pipe: %w", err)
	}
	statusR, statusW, err := os.Pipe()
	if err != nil {
		ctrlR.Close()
		ctrlW.Close()
		return fmt.Errorf("status pipe: %w", err)
	}
	env := append(s.env[:len(s.env):len(s.env)], supervisorEnv+"=1")
	if s.cpus != nil {
		env = append(env, cpusEnv+"="+formatCPUs(s.cpus))
	}
	cmd := &exec.Cmd{
		Path: exe,
		Args: append([]string{fmt.Sprintf("loomrun-supervisor[rank %d]", s.rank), s.grace.String(), s.path}, s.args...),
		Env:  env,
		// Stdin nil: /dev/null, which the rank inherits.
		Stdout:     stdout,
		Stderr:     stderr,
		ExtraFiles: []*os.File{ctrlR, statusW},
		// Its own group: signals meant for the rank's group, or the
		// terminal's ^C, do not reach the supervisor.
		SysProcAttr: &syscall.SysProcAttr{Setpgid: true},
	}
	err = cmd.Start()
	// The supervisor has its own copies; keeping ours would hide its end.
	ctrlR.Close()
	statusW.Close()
	if err != nil {
		ctrlW.Close()
		statusR.Close()
		return err
	}
	p.h = &handle{sup: cmd, ctrl: ctrlW}
	go watch(p, statusR, cmd, events)
	return nil
}

// watch reads the supervisor's status lines until it exits, then waits for
// it and sends evEnded.
func watch(p *rankProc, status *os.File, sup *exec.Cmd, events chan<- rankEvent) {
	sc := bufio.NewScanner(status)
	for sc.Scan() {
		e := parseStatus(sc.Text())
		e.rank = p.rank
		if e.kind == evExited {
			p.waitOutput(exitOutputWait)
		}
		events <- e
	}
	// Only the read end of a pipe: closing it cannot lose data.
	_ = status.Close()
	err := sup.Wait()
	events <- rankEvent{rank: p.rank, kind: evEnded, err: err}
}

// signal sends sig to the process group pgid.
func (h *handle) signal(pgid int, sig os.Signal) error {
	s, ok := sig.(syscall.Signal)
	if !ok {
		return fmt.Errorf("signal %v: not a unix signal", sig)
	}
	return syscall.Kill(-pgid, s)
}

// finish tells the supervisor that the job is over: it ends whatever is
// left of its rank and exits.
func (h *handle) finish() {
	// Closing the write end of a pipe only signals end of file.
	_ = h.ctrl.Close()
}

// kill ends the supervisor at once, when it failed to finish in time.
func (h *handle) kill() {
	// The only failure is a supervisor that has exited meanwhile.
	_ = h.sup.Process.Kill()
}

var termSignal os.Signal = syscall.SIGTERM

// signalName names a signal like "SIGKILL (9)".
func signalName(n int) string {
	names := map[syscall.Signal]string{
		syscall.SIGHUP: "SIGHUP", syscall.SIGINT: "SIGINT", syscall.SIGQUIT: "SIGQUIT",
		syscall.SIGILL: "SIGILL", syscall.SIGTRAP: "SIGTRAP", syscall.SIGABRT: "SIGABRT",
		syscall.SIGBUS: "SIGBUS", syscall.SIGFPE: "SIGFPE", syscall.SIGKILL: "SIGKILL",
		syscall.SIGUSR1: "SIGUSR1", syscall.SIGSEGV: "SIGSEGV", syscall.SIGUSR2: "SIGUSR2",
		syscall.SIGPIPE: "SIGPIPE", syscall.SIGALRM: "SIGALRM", syscall.SIGTERM: "SIGTERM",
	}
	s := syscall.Signal(n)
	if name, ok := names[s]; ok {
		return fmt.Sprintf("%s (%d)", name, n)
	}
	return fmt.Sprintf("signal %d (%v)", n, s)
}

// exitOf converts a wait status.
func exitOf(ws syscall.WaitStatus) rankExit {
	if ws.Signaled() {
		return rankExit{signal: int(ws.Signal())}
	}
	return rankExit{code: ws.ExitStatus()}
}

// signalExitCode is the shell's exit status for death by sig: 128+n.
func signalExitCode(sig os.Signal) int {
	if s, ok := sig.(syscall.Signal); ok {
		return 128 + int(s)
	}
	return 1
}

// sigString names a signal for messages.
func sigString(sig os.Signal) string {
	if s, ok := sig.(syscall.Signal); ok {
		return signalName(int(s))
	}
	return sig.String()
}
