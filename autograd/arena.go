package autograd

import (
	"context"
	"math"
	"sync"
	"unsafe"

	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/kernels"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
)

// arena recycles the float buffers a tape uses internally: values an op
// saves for its backward (LayerNorm statistics, GELU derivatives,
// attention probabilities) and the gradients backward computes for
// intermediate values (scratch). Both are dead once the tape is cleared,
// so a training step that records the same ops again reuses them instead
// of allocating (and the garbage collector clearing) tens of megabytes.
//
// With WithRecycling the arena also holds op results, whose lifetime the
// caller ends with Tape.Recycle rather than the tape's clearing: they go
// back to the free lists there and nowhere else. Without it, op results
// (Value.Data), the loss and every leaf's Grad are allocated fresh, and in
// both modes Backward copies a gradient into a leaf rather than keeping
// the buffer it arrived in. A scratch buffer returns to the free lists
// either when Backward has consumed it and no pending gradient shares its
// memory (release), or when the tape is cleared (reset). Free buffers are
// kept by exact length; lengths not asked for since the last reset are
// dropped at the next one, so changing shapes do not pile up memory.
//
// Each tape has its own arena; the mutex makes the rare use from hook
// goroutines safe, though a tape itself is single-goroutine.
type arena struct {
	mu     sync.Mutex
	free32 map[int][][]float32
	free64 map[int][][]float64
	used   map[int]bool // lengths asked for since the last reset
	// out maps the first element's address of every buffer handed out
	// and not yet returned to its length, element size and kind.
	out  map[unsafe.Pointer]arenaBuf
	made int // buffers allocated (not reused) since the arena was made
	// poison makes recycle fill the op results it takes back with NaN, so
	// that a read of a recycled value shows (WithPoisonRecycled).
	poison bool
	// tracks lists, per checkpoint being recomputed (innermost last), the
	// buffers handed out since it started, to take them back when its
	// backward is over (track, untrack).
	tracks [][]unsafe.Pointer
	// devOut, devTracks and devEmpty are the same for buffers of devices
	// other than the host (devices.go): they are not kept on free lists
	// here but freed (device.Buffer.Free), which hands them to the
	// device's caching allocator, where out here says they go back to a
	// free list. devEmpty holds the empty ones, which have no address.
	devOut    map[devKey]devBuf
	devTracks [][]devKey
	devEmpty  []devBuf
}

type arenaBuf struct {
	n, size int
	result  bool // an op result: returned by recycle only
}

// alloc says where a local helper puts the block it returns: scratch in
// the tape's arena (a saved value or an intermediate gradient, dead when
// the tape is cleared), or an op's result (fresh memory, or arena memory
// that lives until Recycle on a tape made WithRecycling). The zero alloc
// is fresh memory.
type alloc struct {
	t      *Tape
	result bool
}

// scratch is where saved values and intermediate gradients go: t's arena
// (fresh memory for a nil t).
func (t *Tape) scratch() alloc { return alloc{t: t} }

// result is where op results go.
func (t *Tape) result() alloc { return alloc{t: t, result: true} }

// fresh reports whether block returns freshly allocated (zeroed) memory.
func (a alloc) fresh() bool { return a.t == nil || a.result && !a.t.recycling }

// block returns n elements as a says: zeroed when a.fresh(), with
// arbitrary contents otherwise.
func block[T float](a alloc, n int) []T {
	if a.fresh() {
		return make([]T, n)
	}
	return take[T](a.t.arena, n, a.result)
}

// resultBlock is block(t.result(), n), for op results.
func resultBlock[T float](t *Tape, n int) []T { return block[T](t.result(), n) }

// getBuf returns a scratch buffer of n elements from t's arena, with
// arbitrary contents; nil when n is 0.
func getBuf[T float](t *Tape, n int) []T { return take[T](t.arena, n, false) }

// take returns a buffer of n elements from a, with arbitrary contents,
// marked as an op result or as scratch; nil when n is 0.
func take[T float](a *arena, n int, result bool) []T {
	if n == 0 {
		return nil
	}
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
		a.made++
	}
	p := unsafe.Pointer(unsafe.SliceData(buf))
	a.out[p] = arenaBuf{n: n, size: int(unsafe.Sizeof(z)), result: result}
	if k := len(a.tracks); k > 0 {
		a.tracks[k-1] = append(a.tracks[k-1], p)
	}
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

// putBuf returns a scratch buffer from getBuf to the free lists right away
// (for temporaries whose last use is over). Other slices are ignored.
func putBuf[T float](t *Tape, buf []T) {
	if len(buf) == 0 {
		return
	}
	a := t.arena
	a.mu.Lock()
	defer a.mu.Unlock()
	if p := unsafe.Pointer(unsafe.SliceData(buf)); !a.out[p].result {
		a.putLocked(p)
	}
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

// reset returns every outstanding scratch buffer to the free lists (the
// tape has been cleared, so nothing uses them) and drops the free buffers
// of lengths not asked for since the previous reset, unless nothing at all
// was. Op results stay out until recycle.
func (a *arena) reset() {
	a.mu.Lock()
	defer a.mu.Unlock()
	for p, b := range a.out {
		if !b.result {
			a.putLocked(p)
		}
	}
	a.devFreeLocked(false)
	if len(a.used) == 0 {
		// Nothing was asked for since the last reset (a Recycle right
		// after Backward): no pass ran, so no length has gone out of use.
		return
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

// recycle returns every outstanding op result to the free lists (poisoned
// with NaN first when a.poison is set).
func (a *arena) recycle() {
	a.mu.Lock()
	defer a.mu.Unlock()
	for p, b := range a.out {
		if !b.result {
			continue
		}
		if a.poison {
			switch b.size {
			case 4:
				kernels.Fill(unsafe.Slice((*float32)(p), b.n), float32(math.NaN()))
			case 8:
				kernels.Fill(unsafe.Slice((*float64)(p), b.n), math.NaN())
			}
		}
		a.putLocked(p)
	}
	a.devFreeLocked(true)
}

// track starts recording the buffers handed out, for untrack.
func (a *arena) track() {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.tracks = append(a.tracks, nil)
	a.devTracks = append(a.devTracks, nil)
}

// untrack ends the innermost track and takes back every buffer handed
// out since it began and still out (scratch and op results alike, the
// results poisoned when a.poison is set), except those sharing memory
// with keep, which the enclosing track (if any) inherits.
func (a *arena) untrack(keep []*placement.DTensor) {
	a.mu.Lock()
	defer a.mu.Unlock()
	k := len(a.tracks)
	if k == 0 {
		return
	}
	list := a.tracks[k-1]
	a.tracks = a.tracks[:k-1]
	a.devUntrackLocked(keep)
	for _, p := range list {
		b, ok := a.out[p]
		if !ok {
			continue
		}
		s := span{p: p, bytes: uintptr(b.n * b.size)}
		if overlapsAny(s, keep) {
			if k > 1 {
				a.tracks[k-2] = append(a.tracks[k-2], p)
			}
			continue
		}
		a.giveLocked(p, b)
	}
}

// giveBack takes back the buffer whose block is exactly s's, if it is
// out, and reports whether it did.
func (a *arena) giveBack(s span) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	if s.dev.d != nil {
		return a.devGiveLocked(s, false)
	}
	b, ok := a.out[s.p]
	if !ok || uintptr(b.n*b.size) != s.bytes {
		return false
	}
	a.giveLocked(s.p, b)
	return true
}

// giveLocked returns the outstanding buffer b at p to the free lists,
// poisoning an op result first when a.poison is set.
func (a *arena) giveLocked(p unsafe.Pointer, b arenaBuf) {
	if b.result && a.poison {
		switch b.size {
		case 4:
			kernels.Fill(unsafe.Slice((*float32)(p), b.n), float32(math.NaN()))
		case 8:
			kernels.Fill(unsafe.Slice((*float64)(p), b.n), math.NaN())
		}
	}
	a.putLocked(p)
}

// span is the memory of a tensor's local block: its first element and
// its size in bytes.
type span struct {
	p     unsafe.Pointer
	bytes uintptr
	// dev is the block's device and address when it is a device buffer
	// (p is nil then): device addresses are not Go pointers.
	dev devKey
}

func spanOf(dt *placement.DTensor) (span, bool) {
	if dt == nil {
		return span{}, false
	}
	switch d := dt.LocalData().(type) {
	case []float32:
		if len(d) > 0 {
			return span{p: unsafe.Pointer(unsafe.SliceData(d)), bytes: uintptr(len(d)) * 4}, true
		}
	case []float64:
		if len(d) > 0 {
			return span{p: unsafe.Pointer(unsafe.SliceData(d)), bytes: uintptr(len(d)) * 8}, true
		}
	case device.Buffer:
		return devSpan(d)
	}
	return span{}, false
}

// overlaps reports whether two spans share a byte.
func (s span) overlaps(o span) bool {
	if s.dev.d != nil || o.dev.d != nil {
		return s.dev.d == o.dev.d && s.dev.p < o.dev.p+o.bytes && o.dev.p < s.dev.p+s.bytes
	}
	a, b := uintptr(s.p), uintptr(o.p)
	return a < b+o.bytes && b < a+s.bytes
}

// releaseDead returns the buffers of the dead tensors (gradients Backward
// has consumed) to the free lists, except those sharing memory with a live
// one (a pending gradient, which may be the same tensor, a reshaped view or
// a chunk of it).
func (a *arena) releaseDead(dead, live []*placement.DTensor) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if len(a.out) == 0 && len(a.devOut) == 0 {
		return
	}
	for _, d := range dead {
		s, ok := spanOf(d)
		if !ok {
			continue
		}
		if s.dev.d != nil {
			if !overlapsAny(s, live) {
				a.devGiveLocked(s, true)
			}
			continue
		}
		b, ok := a.out[s.p]
		if !ok || b.result || uintptr(b.n*b.size) != s.bytes {
			continue // not scratch, or a view of part of it
		}
		if !overlapsAny(s, live) {
			a.putLocked(s.p)
		}
	}
}

// overlapsAny reports whether s shares a byte with the block of one of ts.
func overlapsAny(s span, ts []*placement.DTensor) bool {
	for _, l := range ts {
		if ls, ok := spanOf(l); ok && ls.overlaps(s) {
			return true
		}
	}
	return false
}

// exclusive reports whether a pending gradient g may be updated in place:
// g's block is a whole scratch buffer the arena handed out, and none of
// others shares its memory (the other pending gradients, and the gradient
// the current node consumed and every gradient it returned, which may be
// views of one another and are still to be accumulated).
func (a *arena) exclusive(g *placement.DTensor, others []*placement.DTensor) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	s, ok := spanOf(g)
	if !ok {
		return false
	}
	if s.dev.d != nil {
		if b, ok := a.devOut[s.dev]; !ok || b.result || devBytes(b.b) != s.bytes {
			return false
		}
		return !overlapsAny(s, others)
	}
	if b, ok := a.out[s.p]; !ok || b.result || uintptr(b.n*b.size) != s.bytes {
		return false
	}
	return !overlapsAny(s, others)
}

// planBuffers lets placement's executor take its buffers from t's arena:
// the redistributed tensor's data as res says, temporaries as scratch that
// give returns to the free lists once Execute is over.
type planBuffers struct {
	t       *Tape
	res     alloc
	temps32 [][]float32
	temps64 [][]float64
}

var _ placement.Allocator = (*planBuffers)(nil)

func (t *Tape) planBuffers(res alloc) *planBuffers { return &planBuffers{t: t, res: res} }

// Float32 implements placement.Allocator.
func (b *planBuffers) Float32(n int, result bool) []float32 {
	return planBlock(b, &b.temps32, n, result)
}

// Float64 implements placement.Allocator.
func (b *planBuffers) Float64(n int, result bool) []float64 {
	return planBlock(b, &b.temps64, n, result)
}

// planBlock is a result block as b.res says, or scratch kept in temps.
func planBlock[T float](b *planBuffers, temps *[][]T, n int, result bool) []T {
	if result {
		return block[T](b.res, n)
	}
	buf := block[T](b.t.scratch(), n)
	*temps = append(*temps, buf)
	return buf
}

// give returns the temporaries to the free lists.
func (b *planBuffers) give() {
	if b.t == nil {
		return
	}
	for _, buf := range b.temps32 {
		putBuf(b.t, buf)
	}
	for _, buf := range b.temps64 {
		putBuf(b.t, buf)
	}
}

// execute runs pl on dt as t.planner.Execute does, with the result in
// res's memory and temporaries from the arena.
func (t *Tape) execute(ctx context.Context, pl *placement.Plan, dt *placement.DTensor, dst *mesh.Mesh, res alloc) (*placement.DTensor, error) {
	b := t.planBuffers(res)
	defer b.give()
	out, err := t.planner.Execute(ctx, pl, dt, dst, placement.WithAllocator(b))
	if err != nil || res.fresh() {
		return out, err
	}
	// On a device Execute allocates the result itself (the Allocator is
	// for host slices): the arena takes it as res says, unless it is the
	// input's memory (a plan that moves nothing).
	if ob := bufOf(out); ob != nil {
		os, ok := devSpan(ob)
		if is, iok := spanOf(dt); ok && !(iok && is.overlaps(os)) {
			t.arena.devTake(ob, res.result)
		}
	}
	return out, nil
}
