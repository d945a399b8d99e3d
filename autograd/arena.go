package autograd

import (
	"sync"
	"unsafe"

	"github.com/b7ea7098/loom/placement"
)

// arena recycles the float buffers a tape uses internally: values an op
// saves for its backward (LayerNorm statistics, GELU derivatives,
// attention probabilities) and the gradients backward computes for
// intermediate values. Both are dead once the tape is cleared, so a
// training step that records the same ops again reuses them instead of
// allocating (and the garbage collector clearing) tens of megabytes.
//
// What the arena hands out never reaches a user: op results (Value.Data),
// the loss and every leaf's Grad are allocated fresh, and Backward copies a
// gradient into a leaf rather than keeping the buffer it arrived in. A
// buffer returns to the free lists either when Backward has consumed it and
// no pending gradient shares its memory (release), or when the tape is
// cleared (reset). Free buffers are kept by exact length; lengths not asked
// for since the last reset are dropped at the next one, so changing shapes
// do not pile up memory.
//
// Each tape has its own arena; the mutex makes the rare use from hook
// goroutines safe, though a tape itself is single-goroutine.
type arena struct {
	mu     sync.Mutex
	free32 map[int][][]float32
	free64 map[int][][]float64
	used   map[int]bool // lengths asked for since the last reset
	// out maps the first element's address of every buffer handed out
	// since the last reset to its length and element size.
	out map[unsafe.Pointer]arenaBuf
}

type arenaBuf struct{ n, size int }

// getBuf returns a buffer of n elements from t's arena, with arbitrary
// contents; nil when n is 0.
func getBuf[T float](t *Tape, n int) []T {
	if n == 0 {
		return nil
	}
	a := &t.arena
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.out == nil {
		a.out = map[unsafe.Pointer]arenaBuf{}
		a.free32 = map[int][][]float32{}
		a.free64 = map[int][][]float64{}
		a.used = map[int]bool{}
	}
	a.used[n] = true
	var z T
	var buf []T
	if _, ok := any(z).(float32); ok {
		buf, _ = any(pop(a.free32, n)).([]T)
	} else {
		buf, _ = any(pop(a.free64, n)).([]T)
	}
	if buf == nil {
		buf = make([]T, n)
	}
	a.out[unsafe.Pointer(unsafe.SliceData(buf))] = arenaBuf{n: n, size: int(unsafe.Sizeof(z))}
	return buf
}

// pop takes a free buffer of length n off free, or returns nil.
func pop[T float](free map[int][][]T, n int) []T {
	l := free[n]
	if len(l) == 0 {
		return nil
	}
	free[n] = l[:len(l)-1]
	return l[len(l)-1]
}

// zeroBuf is getBuf with every element 0.
func zeroBuf[T float](t *Tape, n int) []T {
	b := getBuf[T](t, n)
	clear(b)
	return b
}

// putBuf returns a buffer from getBuf to the free lists right away (for
// temporaries whose last use is over). Other slices are ignored.
func putBuf[T float](t *Tape, buf []T) {
	if len(buf) == 0 {
		return
	}
	a := &t.arena
	a.mu.Lock()
	defer a.mu.Unlock()
	a.putLocked(unsafe.Pointer(unsafe.SliceData(buf)))
}

// putLocked moves the outstanding buffer starting at p to its free list;
// p not handed out by the arena is ignored.
func (a *arena) putLocked(p unsafe.Pointer) {
	b, ok := a.out[p]
	if !ok {
		return
	}
	delete(a.out, p)
	switch b.size {
	case 4:
		a.free32[b.n] = append(a.free32[b.n], unsafe.Slice((*float32)(p), b.n))
	case 8:
		a.free64[b.n] = append(a.free64[b.n], unsafe.Slice((*float64)(p), b.n))
	}
}

// reset returns every outstanding buffer to the free lists (the tape has
// been cleared, so nothing uses them) and drops the free buffers of lengths
// not asked for since the previous reset.
func (a *arena) reset() {
	a.mu.Lock()
	defer a.mu.Unlock()
	for p := range a.out {
		a.putLocked(p)
	}
	for n := range a.free32 {
		if !a.used[n] {
			delete(a.free32, n)
		}
	}
	for n := range a.free64 {
		if !a.used[n] {
			delete(a.free64, n)
		}
	}
	clear(a.used)
}

// span is the memory of a tensor's local block: its first element and
// its size in bytes.
type span struct {
	p     unsafe.Pointer
	bytes uintptr
}

func spanOf(dt *placement.DTensor) (span, bool) {
	if dt == nil {
		return span{}, false
	}
	switch d := dt.LocalData().(type) {
	case []float32:
		if len(d) > 0 {
			return span{unsafe.Pointer(unsafe.SliceData(d)), uintptr(len(d)) * 4}, true
		}
	case []float64:
		if len(d) > 0 {
			return span{unsafe.Pointer(unsafe.SliceData(d)), uintptr(len(d)) * 8}, true
		}
	}
	return span{}, false
}

// overlaps reports whether two spans share a byte.
func (s span) overlaps(o span) bool {
	a, b := uintptr(s.p), uintptr(o.p)
	return a < b+o.bytes && b < a+s.bytes
}

// releaseDead returns the buffers of the dead tensors (gradients Backward
// has consumed) to the free lists, except those sharing memory with a live
// one (a pending gradient, which may be the same tensor, a reshaped view or
// a chunk of it).
func (a *arena) releaseDead(dead []*placement.DTensor, live map[*Value]*placement.DTensor) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if len(a.out) == 0 {
		return
	}
	for _, d := range dead {
		s, ok := spanOf(d)
		if !ok {
			continue
		}
		b, ok := a.out[s.p]
		if !ok || uintptr(b.n*b.size) != s.bytes {
			continue // not an arena buffer, or a view of part of one
		}
		shared := false
		for _, l := range live {
			if ls, ok := spanOf(l); ok && ls.overlaps(s) {
				shared = true
				break
			}
		}
		if !shared {
			a.putLocked(s.p)
		}
	}
}

// exclusive reports whether v's pending gradient g may be updated in place:
// g's block is a whole buffer the arena handed out, and no other pending
// gradient shares its memory, nor any of the tensors in busy (the gradient
// the current node consumed and every gradient it returned, which may be
// views of one another and are still to be accumulated).
func (a *arena) exclusive(g *placement.DTensor, v *Value, pending map[*Value]*placement.DTensor, busy []*placement.DTensor) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	s, ok := spanOf(g)
	if !ok {
		return false
	}
	if b, ok := a.out[s.p]; !ok || uintptr(b.n*b.size) != s.bytes {
		return false
	}
	for _, x := range busy {
		if xs, ok := spanOf(x); ok && xs.overlaps(s) {
			return false
		}
	}
	for w, l := range pending {
		if w == v {
			continue
		}
		if ls, ok := spanOf(l); ok && ls.overlaps(s) {
			return false
		}
	}
	return true
}
