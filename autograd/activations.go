package autograd

import (
	"unsafe"

	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/placement"
)

// Activation accounting: the bytes a tape holds for backward.

// heldBlock is a local block a node holds for backward: the span of its
// memory (a host block's first element, or a device buffer's device and
// address) and its size in bytes.
type heldBlock struct {
	key   heldKey
	bytes int64
}

// heldKey identifies a held block: p for host memory, dev for a device
// buffer (whose address is not a Go pointer).
type heldKey struct {
	p   unsafe.Pointer
	dev devKey
}

// span is the memory of b.
func (b heldBlock) span() span {
	return span{p: b.key.p, bytes: uintptr(b.bytes), dev: b.key.dev}
}

// activations counts the distinct blocks the recorded nodes hold.
type activations struct {
	refs map[heldKey]*heldRef
	live int64
	peak int64
}

type heldRef struct {
	n     int   // nodes holding the block
	bytes int64 // the largest size a node held it with
}

// heldOf returns the local block of x (a *placement.DTensor on any
// device, a device.Buffer, or a []float32 or []float64 block), or false when it is empty
// or of another kind.
func heldOf(x any) (heldBlock, bool) {
	var s span
	var ok bool
	switch v := x.(type) {
	case *placement.DTensor:
		s, ok = spanOf(v)
	case device.Buffer:
		s, ok = devSpan(v)
	case []float32:
		if len(v) > 0 {
			s, ok = span{p: unsafe.Pointer(unsafe.SliceData(v)), bytes: uintptr(len(v)) * 4}, true
		}
	case []float64:
		if len(v) > 0 {
			s, ok = span{p: unsafe.Pointer(unsafe.SliceData(v)), bytes: uintptr(len(v)) * 8}, true
		}
	}
	return heldBlock{heldKey{s.p, s.dev}, int64(s.bytes)}, ok
}

// hold makes node n hold the blocks of xs (see blockOf; others are
// ignored) until the walk passes it.
func (t *Tape) hold(n *node, xs ...any) {
	a := &t.acct
	for _, x := range xs {
		b, ok := heldOf(x)
		if !ok {
			continue
		}
		dup := false
		for i, h := range n.held {
			if h.key == b.key {
				dup = true
				if b.bytes > h.bytes {
					a.grow(h.key, b.bytes)
					n.held[i].bytes = b.bytes
				}
				break
			}
		}
		if dup {
			continue
		}
		n.held = append(n.held, b)
		if a.refs == nil {
			a.refs = map[heldKey]*heldRef{}
		}
		r := a.refs[b.key]
		if r == nil {
			r = &heldRef{}
			a.refs[b.key] = r
		}
		r.n++
		if b.bytes > r.bytes {
			a.live += b.bytes - r.bytes
			r.bytes = b.bytes
		}
	}
	a.peak = max(a.peak, a.live)
}

// grow raises the counted size of the block k to bytes if larger.
func (a *activations) grow(k heldKey, bytes int64) {
	if r := a.refs[k]; r != nil && bytes > r.bytes {
		a.live += bytes - r.bytes
		r.bytes = bytes
		a.peak = max(a.peak, a.live)
	}
}

// unhold releases what node n holds.
func (t *Tape) unhold(n *node) {
	a := &t.acct
	for _, h := range n.held {
		r := a.refs[h.key]
		if r == nil {
			continue
		}
		if r.n--; r.n == 0 {
			a.live -= r.bytes
			delete(a.refs, h.key)
		}
	}
	n.held = nil
}

// reset forgets every held block (the tape was cleared); the peak stays.
func (a *activations) reset() {
	clear(a.refs)
	a.live = 0
}

// ActivationBytes returns the bytes of activations the tape holds for
// backward now, on this rank: the distinct local blocks (in host or
// device memory) held by the ops recorded since the tape was last cleared and not yet passed by the
// reverse walk of Backward. A recorded op holds its result's block, and
// CausalAttention's fused form also its probabilities ([..., T, T]); a
// checkpoint node (Checkpoint) holds the blocks of its outputs, of its
// inputs that are not leaves, and of the results (and probabilities) its
// options kept. A block is identified by its first element: one held by
// several ops (a Reshape's view, a checkpoint's input that is another op's
// result) counts once, at the largest size any of them holds it with.
// Leaves (parameters, constants), gradients and what ops save beyond that
// (LayerNorm's row statistics, GELU's derivative) do not count, nor do
// values computed without recording (under NoGrad or inside a
// checkpoint's forward). A node counts from its recording until the walk
// passes it (whether or not its backward ran), so during Backward the
// count falls, and rises again while a checkpoint's region is recomputed.
// Clearing the tape (Backward's end, Reset, Recycle) brings it to 0.
func (t *Tape) ActivationBytes() int64 {
	if t == nil {
		return 0
	}
	return t.acct.live
}

// PeakActivationBytes returns the largest ActivationBytes since the tape
// was made or ResetPeak was last called, including the recomputation of
// checkpointed regions during Backward.
func (t *Tape) PeakActivationBytes() int64 {
	if t == nil {
		return 0
	}
	return t.acct.peak
}

// ResetPeak starts a new peak: PeakActivationBytes returns the current
// ActivationBytes until it grows.
func (t *Tape) ResetPeak() {
	if t == nil {
		return
	}
	t.acct.peak = t.acct.live
}
