//go:build linux || darwin || dragonfly || freebsd || netbsd || openbsd

package safetensors

import (
	"os"
	"syscall"
)

// canLock reports whether lockFile works here.
const canLock = true

// lockFile takes an exclusive flock on f, waiting for it when wait is set
// and failing at once otherwise. The lock lasts until f is closed or its
// process dies.
func lockFile(f *os.File, wait bool) error {
	how := syscall.LOCK_EX
	if !wait {
		how |= syscall.LOCK_NB
	}
	rc, err := f.SyscallConn()
	if err != nil {
		return err
	}
	var lockErr error
	if err := rc.Control(func(fd uintptr) {
		for {
			lockErr = syscall.Flock(int(fd), how)
			if lockErr != syscall.EINTR {
				return
			}
		}
	}); err != nil {
		return err
	}
	return lockErr
}
