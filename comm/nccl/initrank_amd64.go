//go:build linux && amd64

package nccl

import (
	"errors"
	"fmt"
	"syscall"
	"unsafe"

	"github.com/ebitengine/purego"
)

// On x86-64 System V a 128-byte struct argument is passed in memory: the
// caller copies it to the bottom of its outgoing argument area, and the
// other arguments take the integer registers as if it were absent. purego
// cannot build such a frame (it places at most nine words on the stack),
// so ncclCommInitRankConfig is called through a small stub:
//
//	stub(fn, comm, nranks, id *ncclUniqueId, rank, config)
//
// which reserves 128 bytes of stack, copies *id there, moves comm, nranks,
// rank and config into rdi, esi, edx and rcx, and calls fn. The stub lives
// in a page of its own, mapped read+execute once per Library.
func stubCode() []byte {
	code := []byte{
		0xf3, 0x0f, 0x1e, 0xfa, // endbr64 (a no-op without CET)
		0x55,             // push rbp
		0x48, 0x89, 0xe5, // mov rbp, rsp
		0x48, 0x81, 0xec, 0x80, 0x00, 0x00, 0x00, // sub rsp, 128 (stays 16-byte aligned)
		0x48, 0x89, 0xf8, // mov rax, rdi          ; fn
		0x49, 0x89, 0xca, // mov r10, rcx          ; id
	}
	for off := 0; off < UniqueIDBytes; off += 8 {
		if off == 0 {
			code = append(code, 0x4d, 0x8b, 0x1a)       // mov r11, [r10]
			code = append(code, 0x4c, 0x89, 0x1c, 0x24) // mov [rsp], r11
			continue
		}
		code = append(code, 0x4d, 0x8b, 0x5a, byte(off))       // mov r11, [r10+off]
		code = append(code, 0x4c, 0x89, 0x5c, 0x24, byte(off)) // mov [rsp+off], r11
	}
	return append(code,
		0x48, 0x89, 0xf7, // mov rdi, rsi          ; comm
		0x89, 0xd6, // mov esi, edx                ; nranks
		0x44, 0x89, 0xc2, // mov edx, r8d          ; rank
		0x4c, 0x89, 0xc9, // mov rcx, r9           ; config
		0xff, 0xd0, // call rax
		0xc9, // leave
		0xc3, // ret
	)
}

// initRankFor returns how to call ncclCommInitRankConfig: through the
// stub, or through ncclCommInitRankScalable when via is "scalable" or the
// stub cannot be mapped (a system that forbids executable mappings).
func initRankFor(f *ncclFns, via string) (initRankFunc, string, error) {
	if via == "scalable" {
		fn, err := scalableInit(f)
		return fn, "scalable", err
	}
	fn, err := stubInit(f.commInitRankConfigAddr)
	if err != nil {
		if sfn, serr := scalableInit(f); serr == nil {
			return sfn, "scalable", nil
		}
		return nil, "", err
	}
	return fn, "thunk", nil
}

func stubInit(target uintptr) (initRankFunc, error) {
	code := stubCode()
	page := syscall.Getpagesize()
	mem, err := syscall.Mmap(-1, 0, page, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_PRIVATE|syscall.MAP_ANON)
	if err != nil {
		return nil, fmt.Errorf("mapping the ncclCommInitRankConfig stub: %w", err)
	}
	copy(mem, code)
	if err := syscall.Mprotect(mem, syscall.PROT_READ|syscall.PROT_EXEC); err != nil {
		return nil, errors.Join(fmt.Errorf("making the ncclCommInitRankConfig stub executable: %w", err), syscall.Munmap(mem))
	}
	var stub func(fn uintptr, comm *uintptr, nranks int32, id *UniqueID, rank int32, cfg unsafe.Pointer) int32
	purego.RegisterFunc(&stub, uintptr(unsafe.Pointer(&mem[0])))
	return func(comm *uintptr, nranks int32, id *UniqueID, rank int32, cfg unsafe.Pointer) int32 {
		idCopy := *id
		return stub(target, comm, nranks, &idCopy, rank, cfg)
	}, nil
}
