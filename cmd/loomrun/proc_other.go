//go:build !unix

package main

import (
	"fmt"
	"os"
	"os/exec"
	"time"
)

// handle is a rank started directly: without process groups and
// supervisors, loomrun can end only the rank's own process.
type handle struct{ cmd *exec.Cmd }

func isSupervisor() bool { return false }

func superviseMain([]string) int { return 2 }

func setSubreaper() error { return nil }

func endOrphans(time.Duration) int { return 0 }

func startProcess(p *rankProc, s *rankSpec, stdout, stderr *os.File, events chan<- rankEvent) error {
	cmd := &exec.Cmd{Path: s.path, Args: s.args, Env: s.env, Stdout: stdout, Stderr: stderr}
	if err := cmd.Start(); err != nil {
		return err
	}
	p.h = &handle{cmd: cmd}
	go func() {
		events <- rankEvent{rank: p.rank, kind: evStarted, pgid: cmd.Process.Pid}
		err := cmd.Wait()
		p.waitOutput(exitOutputWait)
		if cmd.ProcessState != nil {
			events <- rankEvent{rank: p.rank, kind: evExited, exit: rankExit{code: cmd.ProcessState.ExitCode()}}
		}
		events <- rankEvent{rank: p.rank, kind: evEnded, err: err}
	}()
	return nil
}

func (h *handle) signal(_ int, sig os.Signal) error {
	if sig == os.Kill || sig == termSignal {
		return h.cmd.Process.Kill()
	}
	return h.cmd.Process.Signal(sig)
}

func (h *handle) finish() {}

func (h *handle) kill() {
	// The only failure is a process that has exited meanwhile.
	_ = h.cmd.Process.Kill()
}

var termSignal os.Signal = os.Interrupt

func signalName(n int) string { return fmt.Sprintf("signal %d", n) }

func signalExitCode(os.Signal) int { return 1 }

func sigString(sig os.Signal) string { return sig.String() }

// allowedCPUs: ranks started directly are not pinned here.
func allowedCPUs() ([]int, error) {
	return nil, fmt.Errorf("binding to cores needs Linux's sched_setaffinity")
}
