//go:build !linux

package tcp

import "syscall"

// haveTryWrite: the direct write path is available (Linux only; every
// frame goes through the writer elsewhere).
const haveTryWrite = false

func (f *outFrame) tryWrite(syscall.RawConn) bool { return false }
