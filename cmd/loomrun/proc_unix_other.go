//go:build unix && !linux

package main

import (
	"errors"
	"os"
	"syscall"
	"time"
)

// Without Linux's subreaper and waitid, a supervisor does its best: it
// reaps the rank as it exits, signals the rank's group at the end, and does
// not see orphans that left the group (see the command's doc).

func selfExe() (string, error) { return os.Executable() }

func setSubreaper() error { return nil }

func rankSysProcAttr() *syscall.SysProcAttr { return &syscall.SysProcAttr{Setpgid: true} }

// waitRank waits for the rank's process and reaps it.
func waitRank(pid int) (rankExit, bool) {
	for {
		var ws syscall.WaitStatus
		_, err := syscall.Wait4(pid, &ws, 0, nil)
		if errors.Is(err, syscall.EINTR) {
			continue
		}
		if err != nil {
			return rankExit{}, false
		}
		return exitOf(ws), true
	}
}

func subtree(int) ([]proc, bool) { return nil, false }

func endOrphans(time.Duration) int { return 0 }

// Pinning needs Linux's sched_setaffinity.
func allowedCPUs() ([]int, error) {
	return nil, errors.New("binding to cores needs Linux's sched_setaffinity")
}

func pinThread([]int) error {
	return errors.New("binding to cores needs Linux's sched_setaffinity")
}
