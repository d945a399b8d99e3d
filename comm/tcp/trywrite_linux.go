package tcp

import (
	"syscall"
	"unsafe"
)

// haveTryWrite: the direct write path is available.
const haveTryWrite = true

// tryWrite writes what is left of f with one non-blocking writev of
// header and payload (no copy into a staging buffer), as far as the
// socket takes it, and reports whether f is now written whole. It never
// blocks; a failed write leaves f to the writer, which meets the error
// again and reports it.
func (f *outFrame) tryWrite(rc syscall.RawConn) bool {
	total := headerBytes + len(f.data)
	rc.Write(func(fd uintptr) bool {
		for {
			var iov [2]syscall.Iovec
			k := 0
			if f.off < headerBytes {
				iov[k].Base = &f.hdr[f.off]
				iov[k].SetLen(headerBytes - f.off)
				k++
				if len(f.data) > 0 {
					iov[k].Base = &f.data[0]
					iov[k].SetLen(len(f.data))
					k++
				}
			} else {
				iov[k].Base = &f.data[f.off-headerBytes]
				iov[k].SetLen(total - f.off)
				k++
			}
			n, _, errno := syscall.Syscall(syscall.SYS_WRITEV, fd, uintptr(unsafe.Pointer(&iov[0])), uintptr(k))
			if errno == syscall.EINTR {
				continue
			}
			if errno == 0 {
				f.off += int(n)
			}
			// Done, or the socket is full (EAGAIN), or an error: never
			// wait for writability here.
			return true
		}
	})
	return f.off == total
}
