//go:build linux

package main

import "syscall"

// setDeathSignal asks Linux to send SIGTERM to the child when the thread that
// started it ends; run locks its goroutine to one thread for the job's
// lifetime, so that is when loomrun ends.
func setDeathSignal(a *syscall.SysProcAttr) { a.Pdeathsig = syscall.SIGTERM }
