//go:build linux && !arm

package checkpoint

import (
	"os"
	"syscall"
)

// startWriteback asks the kernel to start writing f's bytes [off, off+n)
// to the disk now, without waiting for them (sync_file_range with
// SYNC_FILE_RANGE_WRITE): the disk then works while the rest of the file
// is still being copied into the page cache, and the fsync that makes
// the file durable waits only for the tail. It is a hint: durability is
// the fsync's, so an error here is ignored by the caller.
func startWriteback(f *os.File, off, n int64) error {
	rc, err := f.SyscallConn()
	if err != nil {
		return err
	}
	var werr error
	if err := rc.Control(func(fd uintptr) {
		werr = syscall.SyncFileRange(int(fd), off, n, 0x2 /* SYNC_FILE_RANGE_WRITE */)
	}); err != nil {
		return err
	}
	return werr
}
