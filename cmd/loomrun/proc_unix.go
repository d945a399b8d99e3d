//go:build unix

package main

import (
	"fmt"
	"os"
	"os/exec"
	"syscall"
)

// setProcAttr puts the child in its own process group, so signals reach its
// whole tree, and (on Linux) asks for SIGTERM when loomrun dies.
func setProcAttr(cmd *exec.Cmd) {
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	setDeathSignal(cmd.SysProcAttr)
}

// signalChild sends sig to the child's process group, falling back to the
// process alone.
func signalChild(p *os.Process, sig os.Signal) error {
	s, ok := sig.(syscall.Signal)
	if !ok {
		return p.Signal(sig)
	}
	if err := syscall.Kill(-p.Pid, s); err != nil {
		return p.Signal(sig)
	}
	return nil
}

var termSignal os.Signal = syscall.SIGTERM

// signalName names a signal like "SIGKILL (9)".
func signalName(s syscall.Signal) string {
	names := map[syscall.Signal]string{
		syscall.SIGHUP: "SIGHUP", syscall.SIGINT: "SIGINT", syscall.SIGQUIT: "SIGQUIT",
		syscall.SIGILL: "SIGILL", syscall.SIGTRAP: "SIGTRAP", syscall.SIGABRT: "SIGABRT",
		syscall.SIGBUS: "SIGBUS", syscall.SIGFPE: "SIGFPE", syscall.SIGKILL: "SIGKILL",
		syscall.SIGUSR1: "SIGUSR1", syscall.SIGSEGV: "SIGSEGV", syscall.SIGUSR2: "SIGUSR2",
		syscall.SIGPIPE: "SIGPIPE", syscall.SIGALRM: "SIGALRM", syscall.SIGTERM: "SIGTERM",
	}
	if n, ok := names[s]; ok {
		return fmt.Sprintf("%s (%d)", n, int(s))
	}
	return fmt.Sprintf("signal %d (%v)", int(s), s)
}

// describeExit says how a process ended and whether that is a failure.
func describeExit(ps *os.ProcessState) (string, bool) {
	if ws, ok := ps.Sys().(syscall.WaitStatus); ok {
		switch {
		case ws.Signaled():
			return "was killed by signal " + signalName(ws.Signal()), true
		case ws.Exited():
			return fmt.Sprintf("exited with status %d", ws.ExitStatus()), ws.ExitStatus() != 0
		}
	}
	return fmt.Sprintf("ended: %v", ps), !ps.Success()
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
		return signalName(s)
	}
	return sig.String()
}
