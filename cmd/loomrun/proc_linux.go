//go:build linux

package main

import (
	"errors"
	"os"
	"strconv"
	"strings"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// selfExe is the path that re-executes this program as a supervisor:
// /proc/self/exe names the running binary even if its file was replaced or
// removed since loomrun started.
func selfExe() (string, error) { return "/proc/self/exe", nil }

// setSubreaper makes this process a child subreaper: orphaned descendants
// are reparented to it instead of to init, so it can end and reap them.
func setSubreaper() error {
	if err := unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0); err != nil {
		return os.NewSyscallError("prctl(PR_SET_CHILD_SUBREAPER)", err)
	}
	return nil
}

// rankSysProcAttr puts the rank in its own process group and has the
// kernel kill it if its supervisor dies (the supervisor's only thread that
// starts processes is locked, see superviseMain).
func rankSysProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
}

// si_code values of SIGCHLD (<asm-generic/siginfo.h>); x/sys has no names
// for them.
const (
	cldExited = 1
	cldKilled = 2
	cldDumped = 3
)

// waitRank waits for the rank's process to end and returns how, without
// reaping it: the zombie keeps the rank's pid, and so its process-group id,
// from being reused until the supervisor's cleanup, so that signalling the
// group can only reach the rank's own processes.
func waitRank(pid int) (rankExit, bool) {
	for {
		var info unix.Siginfo
		err := unix.Waitid(unix.P_PID, pid, &info, unix.WEXITED|unix.WNOWAIT, nil)
		if errors.Is(err, syscall.EINTR) {
			continue
		}
		if err != nil {
			return rankExit{}, false // reaped by the cleanup meanwhile
		}
		// x/sys's Siginfo hides the union: si_status follows si_pid and
		// si_uid (two 32-bit words) at the union's start, which is at 16
		// bytes on 64-bit targets and 12 on 32-bit ones (the union holds
		// pointers).
		unionOff := 3*4 + (unsafe.Sizeof(uintptr(0))/8)*4
		status := int(*(*int32)(unsafe.Add(unsafe.Pointer(&info), unionOff+8)))
		switch info.Code {
		case cldKilled, cldDumped:
			return rankExit{signal: status}, true
		case cldExited:
			return rankExit{code: status}, true
		}
		return rankExit{code: -1}, true
	}
}

// scanProcs calls f for every live (not zombie) process in /proc.
func scanProcs(f func(pid, ppid, pgid int)) {
	dir, err := os.ReadDir("/proc")
	if err != nil {
		return
	}
	for _, d := range dir {
		pid, err := strconv.Atoi(d.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile("/proc/" + d.Name() + "/stat")
		if err != nil {
			continue // gone meanwhile
		}
		// "pid (comm) state ppid pgrp ...": comm may hold anything,
		// up to the last ')'.
		s := string(b)
		i := strings.LastIndexByte(s, ')')
		if i < 0 {
			continue
		}
		fields := strings.Fields(s[i+1:])
		if len(fields) < 3 || fields[0] == "Z" || fields[0] == "X" {
			continue
		}
		ppid, err1 := strconv.Atoi(fields[1])
		pgid, err2 := strconv.Atoi(fields[2])
		if err1 == nil && err2 == nil {
			f(pid, ppid, pgid)
		}
	}
}

// subtree lists the live processes that are this process's children or
// members of group pgid. With the subreaper set, every orphan of the rank
// is a child, also one that left the group.
func subtree(pgid int) ([]proc, bool) {
	self := os.Getpid()
	var ps []proc
	scanProcs(func(pid, ppid, g int) {
		if pid != self && (ppid == self || g == pgid) {
			ps = append(ps, proc{pid: pid, pgid: g})
		}
	})
	return ps, true
}

// endOrphans SIGKILLs and reaps the children of this process, a subreaper
// whose own children (the supervisors) have all been waited for: what is
// left was reparented to it after a supervisor died. It gives up after
// timeout and returns how many processes it ended.
func endOrphans(timeout time.Duration) int {
	self := os.Getpid()
	ended := map[int]bool{}
	for deadline := time.Now().Add(timeout); ; {
		for {
			pid, err := syscall.Wait4(-1, nil, syscall.WNOHANG, nil)
			if errors.Is(err, syscall.EINTR) {
				continue
			}
			if err != nil { // ECHILD: nothing left
				return len(ended)
			}
			if pid == 0 {
				break
			}
		}
		if time.Now().After(deadline) {
			return len(ended)
		}
		scanProcs(func(pid, ppid, _ int) {
			if ppid == self {
				ended[pid] = true
				// ESRCH: it died meanwhile.
				_ = syscall.Kill(pid, syscall.SIGKILL)
			}
		})
		time.Sleep(pollInterval)
	}
}

// allowedCPUs lists, in increasing order, the CPUs this process may run on.
func allowedCPUs() ([]int, error) {
	var set unix.CPUSet
	if err := unix.SchedGetaffinity(0, &set); err != nil {
		return nil, os.NewSyscallError("sched_getaffinity", err)
	}
	var cpus []int
	for c := range 8 * int(unsafe.Sizeof(set)) {
		if set.IsSet(c) {
			cpus = append(cpus, c)
		}
	}
	return cpus, nil
}

// pinThread restricts the calling OS thread to cpus; the caller holds the
// thread locked, and the processes it starts inherit the mask.
func pinThread(cpus []int) error {
	var set unix.CPUSet
	for _, c := range cpus {
		set.Set(c)
	}
	if err := unix.SchedSetaffinity(0, &set); err != nil {
		return os.NewSyscallError("sched_setaffinity", err)
	}
	return nil
}
