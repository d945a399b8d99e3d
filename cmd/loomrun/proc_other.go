//go:build !unix

package main

import (
	"fmt"
	"os"
	"os/exec"
)

func setProcAttr(*exec.Cmd) {}

func signalChild(p *os.Process, sig os.Signal) error {
	if sig == os.Kill || sig == termSignal {
		return p.Kill()
	}
	return p.Signal(sig)
}

var termSignal os.Signal = os.Interrupt

func describeExit(ps *os.ProcessState) (string, bool) {
	return fmt.Sprintf("exited with status %d", ps.ExitCode()), !ps.Success()
}

func signalExitCode(os.Signal) int { return 1 }

func sigString(sig os.Signal) string { return sig.String() }
