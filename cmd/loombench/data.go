package main

import (
	"math"

	"github.com/b7ea7098/loom/comm"
)

// Input data are small integers (or ±1, 2 and 1/2 for products), chosen by
// a hash of the rank and the element index, so that sums and products are
// exact in every dtype for moderate rank counts, and a block delivered to
// the wrong place or from the wrong rank is caught.

// sentinel is written to outputs before the checked iteration, so that an
// operation which leaves them untouched is counted wrong.
const sentinel = -77

// mix is a 64-bit hash of (rank, i).
func mix(rank, i int) uint64 {
	x := uint64(rank)*0x9E3779B97F4A7C15 + uint64(i)*0xC2B2AE3D27D4EB4F + 0x165667B19E3779F9
	x ^= x >> 29
	x *= 0xBF58476D1CE4E5B9
	x ^= x >> 32
	return x
}

var (
	prodFloats   = [4]float64{1, -1, 2, 0.5}
	prodSigned   = [4]float64{1, -1, 2, 3}
	prodUnsigned = [4]float64{1, 2, 3, 5}
)

// inputValue is element i of rank's input for dtype dt; prod selects the
// pattern used under the Prod reduction.
func inputValue(dt comm.DType, prod bool, rank, i int) float64 {
	h := mix(rank, i)
	switch {
	case prod && dt.IsFloat():
		return prodFloats[h&3]
	case prod && dt == comm.Uint8:
		return prodUnsigned[h&3]
	case prod:
		return prodSigned[h&3]
	case dt == comm.Uint8:
		return float64(h % 5)
	}
	return float64(h%9) - 4
}

// fill sets every element k of b to f(k), converted to b's dtype.
func fill(b *comm.HostBuffer, f func(k int) float64) {
	switch b.DType() {
	case comm.Float32:
		s := b.Float32s()
		for k := range s {
			s[k] = float32(f(k))
		}
	case comm.Float64:
		s := b.Float64s()
		for k := range s {
			s[k] = f(k)
		}
	case comm.BFloat16:
		s := b.BFloat16s()
		for k := range s {
			s[k] = comm.ToBFloat16(float32(f(k)))
		}
	case comm.Float16:
		s := b.Float16s()
		for k := range s {
			s[k] = comm.ToFloat16(float32(f(k)))
		}
	case comm.Int32:
		s := b.Int32s()
		for k := range s {
			s[k] = int32(f(k))
		}
	case comm.Int64:
		s := b.Int64s()
		for k := range s {
			s[k] = int64(f(k))
		}
	case comm.Uint8:
		s := b.Uint8s()
		for k := range s {
			s[k] = uint8(int64(f(k)))
		}
	}
}

// fillInput fills b with rank's input elements first, first+1, ...
func fillInput(b *comm.HostBuffer, prod bool, rank, first int) {
	dt := b.DType()
	fill(b, func(k int) float64 { return inputValue(dt, prod, rank, first+k) })
}

// fillSentinel fills b with the sentinel value.
func fillSentinel(b *comm.HostBuffer) {
	v := float64(sentinel)
	if b.DType() == comm.Uint8 {
		v = 0xEE
	}
	fill(b, func(int) float64 { return v })
}

// allRanks as the rank of a source means the reduction over every rank.
const allRanks = -1

// source tells where output element e should come from: element k of rank
// j's input, or the reduction over all ranks of element k (j == allRanks).
type source func(e int) (j, k int)

// expectation describes the correct output of one rank.
type expectation struct {
	dt   comm.DType
	red  comm.ReduceOp
	prod bool // inputs use the product pattern
	p    int  // number of ranks
	src  source
}

// countWrong returns how many elements of got differ from what x expects.
// Integers must match exactly; floats within a few units of rounding.
func countWrong(got *comm.HostBuffer, x expectation) int64 {
	switch got.DType() {
	case comm.Int32:
		return wrongInts(got.Int32s(), x)
	case comm.Int64:
		return wrongInts(got.Int64s(), x)
	case comm.Uint8:
		return wrongInts(got.Uint8s(), x)
	case comm.Float32:
		s := got.Float32s()
		return wrongFloats(len(s), func(i int) float64 { return float64(s[i]) }, x)
	case comm.Float64:
		s := got.Float64s()
		return wrongFloats(len(s), func(i int) float64 { return s[i] }, x)
	case comm.BFloat16:
		s := got.BFloat16s()
		return wrongFloats(len(s), func(i int) float64 { return float64(s[i].Float32()) }, x)
	case comm.Float16:
		s := got.Float16s()
		return wrongFloats(len(s), func(i int) float64 { return float64(s[i].Float32()) }, x)
	}
	return int64(got.Len())
}

type integer interface{ ~int32 | ~int64 | ~uint8 }

// wrongInts checks integer outputs, computing the expected values in T with
// Go's wrapping arithmetic, in rank order, as a backend does.
func wrongInts[T integer](got []T, x expectation) int64 {
	in := func(j, k int) T { return T(int64(inputValue(x.dt, x.prod, j, k))) }
	var wrong int64
	for e, g := range got {
		j, k := x.src(e)
		var want T
		if j != allRanks {
			want = in(j, k)
		} else {
			want = in(0, k)
			for r := 1; r < x.p; r++ {
				v := in(r, k)
				switch x.red {
				case comm.Sum, comm.Avg:
					want += v
				case comm.Prod:
					want *= v
				case comm.Min:
					want = min(want, v)
				case comm.Max:
					want = max(want, v)
				}
			}
			if x.red == comm.Avg {
				want /= T(x.p)
			}
		}
		if g != want {
			wrong++
		}
	}
	return wrong
}

// wrongFloats checks n floating-point outputs read through get. The expected
// value is computed in float64, rounded to the dtype, and compared within a
// tolerance of (p+1) units of the dtype's precision.
func wrongFloats(n int, get func(i int) float64, x expectation) int64 {
	eps := epsilon(x.dt)
	var wrong int64
	for e := range n {
		j, k := x.src(e)
		var want float64
		if j != allRanks {
			want = inputValue(x.dt, x.prod, j, k)
		} else {
			want = inputValue(x.dt, x.prod, 0, k)
			for r := 1; r < x.p; r++ {
				v := inputValue(x.dt, x.prod, r, k)
				switch x.red {
				case comm.Sum, comm.Avg:
					want += v
				case comm.Prod:
					want *= v
				case comm.Min:
					want = math.Min(want, v)
				case comm.Max:
					want = math.Max(want, v)
				}
			}
			if x.red == comm.Avg {
				want /= float64(x.p)
			}
		}
		g := get(e)
		want = roundTo(x.dt, want)
		if g == want {
			continue
		}
		if math.IsNaN(g) || math.IsInf(g, 0) || math.IsInf(want, 0) ||
			math.Abs(g-want) > eps*float64(x.p+1)*math.Max(1, math.Abs(want)) {
			wrong++
		}
	}
	return wrong
}

// epsilon is the spacing of dt's values just above 1.
func epsilon(dt comm.DType) float64 {
	switch dt {
	case comm.Float64:
		return 0x1p-52
	case comm.BFloat16:
		return 0x1p-7
	case comm.Float16:
		return 0x1p-10
	}
	return 0x1p-23
}

// roundTo rounds v to the nearest value of the float dtype dt.
func roundTo(dt comm.DType, v float64) float64 {
	switch dt {
	case comm.Float32:
		return float64(float32(v))
	case comm.BFloat16:
		return float64(comm.ToBFloat16(float32(v)).Float32())
	case comm.Float16:
		return float64(comm.ToFloat16(float32(v)).Float32())
	}
	return v
}
