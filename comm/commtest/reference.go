package commtest

import (
	"bytes"
	"fmt"
	"math"
	"strings"

	"github.com/b7ea7098/loom/comm"
)

// reduction is the serial reference result of reducing p ranks' inputs
// element-wise over a range of elements. It is computed from the inputs
// alone, in float64 for floating-point types and in wrapping int64
// arithmetic for integer types, and shares no code with any backend.
type reduction struct {
	dt comm.DType
	op comm.ReduceOp
	p  int
	// Floating-point types: the result and each element's tolerance,
	// computed once here rather than in every check against it.
	f, tol []float64
	// Integer types: the exact result.
	i []int64
}

// reduceRange computes the reference for elements [lo, hi) of the inputs
// input(0..p-1).
func reduceRange(dt comm.DType, op comm.ReduceOp, p int, input func(r int) *comm.HostBuffer, lo, hi int) *reduction {
	n := hi - lo
	red := &reduction{dt: dt, op: op, p: p}
	if dt.IsFloat() {
		acc, mag, x := make([]float64, n), make([]float64, n), make([]float64, n)
		for r := range p {
			decodeFloats(input(r), lo, x)
			if r == 0 {
				copy(acc, x)
				for i, v := range x {
					mag[i] = math.Abs(v)
				}
				continue
			}
			for i, v := range x {
				switch op {
				case comm.Sum, comm.Avg:
					acc[i] += v
					mag[i] += math.Abs(v)
				case comm.Prod:
					acc[i] *= v
				case comm.Min:
					acc[i] = math.Min(acc[i], v)
				case comm.Max:
					acc[i] = math.Max(acc[i], v)
				}
			}
		}
		for i := range acc {
			switch op {
			case comm.Avg:
				acc[i] /= float64(p)
				mag[i] /= float64(p)
			case comm.Prod:
				mag[i] = math.Abs(acc[i])
			case comm.Min, comm.Max:
				mag[i] = 0 // exact
			}
		}
		for i, m := range mag {
			mag[i] = red.tolerance(m)
		}
		red.f, red.tol = acc, mag
		return red
	}
	acc, x := make([]int64, n), make([]int64, n)
	for r := range p {
		decodeInts(input(r), lo, x)
		if r == 0 {
			copy(acc, x)
			continue
		}
		for i, v := range x {
			switch op {
			case comm.Sum, comm.Avg:
				acc[i] += v // wraps modulo 2^64, hence modulo 2^width
			case comm.Prod:
				acc[i] *= v
			case comm.Min:
				acc[i] = min(acc[i], v)
			case comm.Max:
				acc[i] = max(acc[i], v)
			}
		}
	}
	for i, v := range acc {
		// Sums and products wrap in the element type; Avg divides the
		// wrapped sum, truncating toward zero as Go's / does.
		v = wrap(dt, v)
		if op == comm.Avg {
			v /= int64(p)
		}
		acc[i] = v
	}
	red.i = acc
	return red
}

// wrap reduces v modulo 2^width of dt and reinterprets it as dt does.
func wrap(dt comm.DType, v int64) int64 {
	switch dt {
	case comm.Int32:
		return int64(int32(v))
	case comm.Uint8:
		return int64(uint8(v))
	}
	return v
}

// unitRoundoff is half the distance from 1 to the next value of dt.
func unitRoundoff(dt comm.DType) float64 {
	switch dt {
	case comm.Float64:
		return 0x1p-53
	case comm.Float32:
		return 0x1p-24
	case comm.BFloat16:
		return 0x1p-8
	case comm.Float16:
		return 0x1p-11
	}
	return 0
}

// tolerance bounds |got - want| for one element whose error scale is mag.
//
// A reduction over p ranks performs p-1 combining steps in some order that
// depends on the algorithm, and a backend may round to the element type
// after every step (16-bit floats are combined in float32 and rounded once
// per step). Each rounding of a partial sum errs by at most u·|partial| <=
// u·Σ|x_r|, and Avg's final division by at most u·|result|, so a sum or
// average is within p·u·Σ|x_r| (Σ|x_r|/p for Avg) of the exact value,
// whatever the order. A product's relative error is at most about (p-1)·u.
// The float64 reference itself errs by the same bound when dt is float64
// (the inputs of narrower types are sums and products on a coarse grid that
// float64 holds exactly, or nearly so), hence the factor 2. With
// u = 2^-24, 2^-8 and 2^-11 this is p·1.2e-7 for float32, p·2^-7 for
// bfloat16 and p·2^-10 for float16, relative to the magnitudes of the
// combined terms. Min and max select one input and must be exact (mag 0).
func (red *reduction) tolerance(mag float64) float64 {
	return 2 * float64(red.p) * unitRoundoff(red.dt) * mag
}

// maxSamples bounds the mismatches quoted in one error.
const maxSamples = 5

// checker accumulates the mismatches of one rank's output.
type checker struct {
	what    string // "rank 2: allgather in-place"
	bad     int
	samples []string
}

func newChecker(format string, args ...any) *checker {
	return &checker{what: fmt.Sprintf(format, args...)}
}

func (c *checker) miss(format string, args ...any) {
	c.bad++
	if len(c.samples) < maxSamples {
		c.samples = append(c.samples, fmt.Sprintf(format, args...))
	}
}

// copied checks that got[off:off+n] equals want[wlo:wlo+n] bit for bit: the
// result of a data-movement op. from names where the data came from.
func (c *checker) copied(got *comm.HostBuffer, off int, want *comm.HostBuffer, wlo, n int, from string) {
	s := got.DType().Size()
	g := got.Bytes()[off*s : (off+n)*s]
	w := want.Bytes()[wlo*s : (wlo+n)*s]
	if bytes.Equal(g, w) {
		return
	}
	for i := range n {
		if !bytes.Equal(g[i*s:(i+1)*s], w[i*s:(i+1)*s]) {
			c.miss("[%d] want %s got %s (%s element %d)", off+i, element(want, wlo+i), element(got, off+i), from, wlo+i)
		}
	}
}

// untouched checks that got[off:off+n] still holds garbage: memory the
// backend must not write.
func (c *checker) untouched(got *comm.HostBuffer, off, n int) {
	s := got.DType().Size()
	for i, b := range got.Bytes()[off*s : (off+n)*s] {
		if b != garbageByte {
			c.miss("[%d] was written but lies outside the received data", off+i/s)
			return
		}
	}
}

// reduced checks got[off:off+n] against want's elements [wlo, wlo+n).
func (c *checker) reduced(got *comm.HostBuffer, off int, want *reduction, wlo, n int) {
	// Decode a block at a time into memory that stays in L1, rather than
	// all n elements into a fresh slice: at the large size that slice
	// cost more than the comparison.
	const block = 512
	if want.f != nil {
		var g [block]float64
		for lo := 0; lo < n; lo += block {
			m := min(block, n-lo)
			decodeFloats(got, off+lo, g[:m])
			w, tol := want.f[wlo+lo:wlo+lo+m], want.tol[wlo+lo:wlo+lo+m]
			for i, v := range g[:m] {
				if d := math.Abs(v - w[i]); !(d <= tol[i]) {
					c.miss("[%d] want %v got %v (|diff| %.3g > tolerance %.3g)", off+lo+i, w[i], v, d, tol[i])
				}
			}
		}
		return
	}
	var g [block]int64
	for lo := 0; lo < n; lo += block {
		m := min(block, n-lo)
		decodeInts(got, off+lo, g[:m])
		for i, v := range g[:m] {
			if w := want.i[wlo+lo+i]; v != w {
				c.miss("[%d] want %d got %d", off+lo+i, w, v)
			}
		}
	}
}

// err returns nil, or one error with the first few mismatches.
func (c *checker) err(total int) error {
	if c.bad == 0 {
		return nil
	}
	return fmt.Errorf("%s: %d of %d elements wrong: %s", c.what, c.bad, total, strings.Join(c.samples, "; "))
}
