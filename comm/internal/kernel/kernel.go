// Package kernel holds the element-wise loops that backends run on host
// memory: reductions of several sources into one destination, for every
// comm.DType and comm.ReduceOp, and the final division of Avg.
package kernel

import (
	"fmt"
	"sync"
	"unsafe"

	"github.com/b7ea7098/loom/comm"
)

// block is the number of elements processed per pass, so that a partial
// result stays in L1 while every source is folded into it.
const block = 2048

type number interface {
	~float32 | ~float64 | ~int32 | ~int64 | ~uint8
}

// Reduce sets dst[i] = srcs[0][i] op srcs[1][i] op ... for every element.
// Avg reduces as Sum; the caller divides once at the end with Scale. 16-bit
// floats are widened to float32, reduced, and rounded once. dst may alias
// any source exactly. Every slice holds len(dst) bytes. The result is left
// in the cache, for a reader that comes soon.
func Reduce(dt comm.DType, op comm.ReduceOp, dst []byte, srcs ...[]byte) error {
	return reduce(dt, op, false, dst, srcs)
}

// ReduceStream is Reduce for results that will not stay in the cache
// anyway: float sums of at least StreamBytes store with instructions that
// bypass the cache, saving the read-for-ownership of every line.
func ReduceStream(dt comm.DType, op comm.ReduceOp, dst []byte, srcs ...[]byte) error {
	return reduce(dt, op, len(dst) >= StreamBytes, dst, srcs)
}

// ReduceInto reduces srcs once and writes the result to every destination
// (all of the same length), block by block through a small buffer, so each
// source is read once and destinations may alias sources. With stream,
// destinations of at least StreamBytes are written bypassing the cache.
func ReduceInto(dt comm.DType, op comm.ReduceOp, stream bool, dsts, srcs [][]byte) error {
	if len(dsts) == 0 {
		return nil
	}
	stream = stream && len(dsts[0]) >= StreamBytes
	if len(dsts) == 1 {
		return reduce(dt, op, stream, dsts[0], srcs)
	}
	for _, d := range dsts {
		if len(d) != len(dsts[0]) {
			return fmt.Errorf("kernel: reduce destinations of %d and %d bytes", len(d), len(dsts[0]))
		}
	}
	st := stagingPool.Get().(*staging)
	defer stagingPool.Put(st)
	tmp := &st.block
	view := append(st.view[:0], srcs...)
	defer func() { clear(view); st.view = view[:0] }()
	n := len(dsts[0])
	step := blockBytes / dt.Size() * dt.Size()
	for lo := 0; lo < n; lo += step {
		hi := min(lo+step, n)
		for i, s := range srcs {
			view[i] = s[lo:hi]
		}
		t := tmp[:hi-lo]
		if err := reduce(dt, op, false, t, view); err != nil {
			return err
		}
		for _, d := range dsts {
			if stream {
				copyStream(d[lo:hi], t)
			} else {
				copy(d[lo:hi], t)
			}
		}
	}
	return nil
}

// blockBytes is ReduceInto's staging block: it stays in L1 between the
// reduction and the copies out.
const blockBytes = 16 << 10

// staging is ReduceInto's reusable block and source views.
type staging struct {
	block [blockBytes]byte
	view  [][]byte
}

var stagingPool = sync.Pool{New: func() any { return new(staging) }}

// reduce is Reduce, with streaming stores for float sums when stream is set.
func reduce(dt comm.DType, op comm.ReduceOp, stream bool, dst []byte, srcs [][]byte) error {
	if len(srcs) == 0 {
		return fmt.Errorf("kernel: reduce with no sources")
	}
	for _, s := range srcs {
		if len(s) != len(dst) {
			return fmt.Errorf("kernel: reduce source has %d bytes, destination %d", len(s), len(dst))
		}
	}
	if len(dst) == 0 {
		return nil
	}
	// The passes below write dst before reading later sources, so a source
	// that is dst must come first. Every op is commutative.
	for k := 1; k < len(srcs); k++ {
		if sameStart(dst, srcs[k]) {
			srcs[0], srcs[k] = srcs[k], srcs[0]
			break
		}
	}
	if len(srcs) == 1 {
		if !sameStart(dst, srcs[0]) {
			copy(dst, srcs[0])
		}
		return nil
	}
	sum := op == comm.Sum || op == comm.Avg
	switch dt {
	case comm.Float32:
		if sum {
			reduceWith(dst, srcs, stream, addF32, addF32Stream)
		} else {
			reduceNum[float32](op, dst, srcs)
		}
	case comm.Float64:
		if sum {
			reduceWith(dst, srcs, stream, addF64, addF64Stream)
		} else {
			reduceNum[float64](op, dst, srcs)
		}
	case comm.Int32:
		reduceNum[int32](op, dst, srcs)
	case comm.Int64:
		reduceNum[int64](op, dst, srcs)
	case comm.Uint8:
		reduceNum[uint8](op, dst, srcs)
	case comm.BFloat16:
		reduceHalf(op, dst, srcs, bf16ToF32, f32ToBF16)
	case comm.Float16:
		reduceHalf(op, dst, srcs, f16ToF32, f32ToF16)
	default:
		return fmt.Errorf("kernel: unsupported dtype %v", dt)
	}
	return nil
}

// Scale divides every element by n: the last step of Avg.
func Scale(dt comm.DType, buf []byte, n int) {
	if len(buf) == 0 || n == 1 {
		return
	}
	switch dt {
	case comm.Float32:
		x := as[float32](buf)
		for i := range x {
			x[i] /= float32(n)
		}
	case comm.Float64:
		x := as[float64](buf)
		for i := range x {
			x[i] /= float64(n)
		}
	case comm.Int32:
		x := as[int32](buf)
		for i := range x {
			x[i] /= int32(n)
		}
	case comm.Int64:
		x := as[int64](buf)
		for i := range x {
			x[i] /= int64(n)
		}
	case comm.Uint8:
		for i := range buf {
			buf[i] = uint8(int(buf[i]) / n) // n may exceed 255
		}
	case comm.BFloat16:
		x := as[uint16](buf)
		for i := range x {
			x[i] = f32ToBF16(bf16ToF32(x[i]) / float32(n))
		}
	case comm.Float16:
		x := as[uint16](buf)
		for i := range x {
			x[i] = f32ToF16(f16ToF32(x[i]) / float32(n))
		}
	}
}

func sameStart(a, b []byte) bool {
	return len(a) > 0 && len(b) > 0 && unsafe.SliceData(a) == unsafe.SliceData(b)
}

func as[T any](b []byte) []T {
	var z T
	return unsafe.Slice((*T)(unsafe.Pointer(unsafe.SliceData(b))), len(b)/int(unsafe.Sizeof(z)))
}

// reduceNum folds the sources block by block, so the partial result stays
// in L1 while every source passes through it.
func reduceNum[T number](op comm.ReduceOp, dstBytes []byte, srcs [][]byte) {
	dst := as[T](dstBytes)
	for lo := 0; lo < len(dst); lo += block {
		hi := min(lo+block, len(dst))
		d := dst[lo:hi]
		combine(op, d, as[T](srcs[0])[lo:hi], as[T](srcs[1])[lo:hi])
		for _, s := range srcs[2:] {
			combine(op, d, d, as[T](s)[lo:hi])
		}
	}
}

// StreamBytes is the result size from which ReduceStream bypasses the
// cache: smaller results are written cheaply enough through it.
const StreamBytes = 1 << 20

// reduceWith is reduceNum with a specialised d = a + b, and a streaming
// form for the last pass over large results.
func reduceWith[T number](dstBytes []byte, srcs [][]byte, stream bool, add, addStream func(d, a, b []T)) {
	dst := as[T](dstBytes)
	last := add
	if stream {
		last = addStream
	}
	if len(srcs) == 2 {
		last(dst, as[T](srcs[0]), as[T](srcs[1]))
		return
	}
	for lo := 0; lo < len(dst); lo += block {
		hi := min(lo+block, len(dst))
		d := dst[lo:hi]
		add(d, as[T](srcs[0])[lo:hi], as[T](srcs[1])[lo:hi])
		for _, s := range srcs[2 : len(srcs)-1] {
			add(d, d, as[T](s)[lo:hi])
		}
		last(d, d, as[T](srcs[len(srcs)-1])[lo:hi])
	}
}

// combine sets d = a op b element-wise.
func combine[T number](op comm.ReduceOp, d, a, b []T) {
	n := len(d)
	a, b = a[:n], b[:n]
	switch op {
	case comm.Sum, comm.Avg:
		i := 0
		for ; i+4 <= n; i += 4 {
			d0, a0, b0 := d[i:i+4:i+4], a[i:i+4:i+4], b[i:i+4:i+4]
			d0[0], d0[1], d0[2], d0[3] = a0[0]+b0[0], a0[1]+b0[1], a0[2]+b0[2], a0[3]+b0[3]
		}
		for ; i < n; i++ {
			d[i] = a[i] + b[i]
		}
	case comm.Prod:
		for i := range d {
			d[i] = a[i] * b[i]
		}
	case comm.Min:
		for i := range d {
			d[i] = minNaN(a[i], b[i])
		}
	case comm.Max:
		for i := range d {
			d[i] = maxNaN(a[i], b[i])
		}
	}
}

// minNaN and maxNaN propagate NaN, as NCCL and PyTorch do.
func minNaN[T number](x, y T) T {
	if x != x {
		return x
	}
	if y != y || y < x {
		return y
	}
	return x
}

func maxNaN[T number](x, y T) T {
	if x != x {
		return x
	}
	if y != y || y > x {
		return y
	}
	return x
}

func reduceHalf(op comm.ReduceOp, dstBytes []byte, srcs [][]byte, widen func(uint16) float32, narrow func(float32) uint16) {
	dst := as[uint16](dstBytes)
	var acc, tmp [block]float32
	for lo := 0; lo < len(dst); lo += block {
		hi := min(lo+block, len(dst))
		a, t := acc[:hi-lo], tmp[:hi-lo]
		for i, v := range as[uint16](srcs[0])[lo:hi] {
			a[i] = widen(v)
		}
		for _, s := range srcs[1:] {
			for i, v := range as[uint16](s)[lo:hi] {
				t[i] = widen(v)
			}
			combine(op, a, a, t)
		}
		d := dst[lo:hi]
		for i, v := range a {
			d[i] = narrow(v)
		}
	}
}

func bf16ToF32(h uint16) float32 { return comm.BFloat16Bits(h).Float32() }
func f32ToBF16(f float32) uint16 { return uint16(comm.ToBFloat16(f)) }
func f16ToF32(h uint16) float32  { return comm.Float16Bits(h).Float32() }
func f32ToF16(f float32) uint16  { return uint16(comm.ToFloat16(f)) }
