//go:build linux && arm64

package nccl

import (
	"unsafe"

	"github.com/ebitengine/purego"
)

// On AArch64 (AAPCS64 B.4) a composite argument larger than 16 bytes is
// copied by the caller to memory and replaced by a pointer to the copy, so
// ncclCommInitRankConfig's by-value ncclUniqueId is passed as a pointer to
// a fresh copy, which the callee may modify.
func initRankFor(f *ncclFns, via string) (initRankFunc, string, error) {
	if via == "scalable" {
		fn, err := scalableInit(f)
		return fn, "scalable", err
	}
	var call func(comm *uintptr, nranks int32, id *UniqueID, rank int32, cfg unsafe.Pointer) int32
	purego.RegisterFunc(&call, f.commInitRankConfigAddr)
	return func(comm *uintptr, nranks int32, id *UniqueID, rank int32, cfg unsafe.Pointer) int32 {
		idCopy := *id
		return call(comm, nranks, &idCopy, rank, cfg)
	}, "pointer", nil
}
