package moe

import "github.com/b7ea7098/loom/kernels"

// Workspace holds the buffers that token rows pass through inside dispatch
// and combine, so that they are reused from call to call instead of
// allocated: the packed rows before the payload all-to-all-v, the received
// rows before they are regrouped by expert, and the same buffers of the
// combine and of both backward passes. Without one, every call allocates
// megabytes that the garbage collector zeroes and the kernel maps afresh,
// which costs as much as moving the rows themselves.
//
// Only intermediate buffers come from a Workspace, and each is dead when
// the call that took it returns: results, gradients and the rows a combine
// keeps for its backward are always freshly allocated. One Workspace can
// therefore serve every dispatch and combine of a rank (all layers, all
// steps), as long as no two of them run at once; it is not safe for
// concurrent use. It keeps the largest buffers it has handed out until it
// is dropped. The zero value is ready to use; a Layer makes its own. The
// fused path (ranks sharing memory, see Dispatch) has no intermediate
// buffers and takes nothing from it. A Workspace holds host memory only:
// on a device the intermediate rows are the tape's device scratch
// (autograd.ScratchBuffer), which the device's caching allocator reuses
// from step to step.
type Workspace struct {
	f32 [2][]float32
	f64 [2][]float64
	// splitMin overrides splitMinBytes for the dispatches that use this
	// workspace (0: no override; negative: never split). Only tests set
	// it (export_test.go), to compare the two payload paths.
	splitMin int
}

// splitThreshold is the split threshold of dispatches using ws.
func (ws *Workspace) splitThreshold() int {
	if ws == nil || ws.splitMin == 0 {
		return splitMinBytes
	}
	return ws.splitMin
}

// wsBuf returns slot of ws as a buffer of n elements with arbitrary
// contents, growing it when needed, or a fresh buffer when ws is nil.
func wsBuf[T kernels.Float](ws *Workspace, slot, n int) []T {
	if ws == nil {
		return make([]T, n)
	}
	var z T
	switch any(z).(type) {
	case float32:
		if b, ok := any(grow(&ws.f32[slot], n)).([]T); ok {
			return b
		}
	case float64:
		if b, ok := any(grow(&ws.f64[slot], n)).([]T); ok {
			return b
		}
	}
	return make([]T, n)
}

// grow returns (*buf)[:n], reallocating *buf when it is too short; the
// result is never nil, like make's.
func grow[T kernels.Float](buf *[]T, n int) []T {
	if *buf == nil || cap(*buf) < n {
		*buf = make([]T, n)
	}
	return (*buf)[:n]
}
