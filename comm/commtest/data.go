package commtest

import (
	"fmt"
	"math"
	"math/rand/v2"
	"sync"

	"github.com/b7ea7098/loom/comm"
)

// ValueKind selects the range of values Fill generates.
type ValueKind int

const (
	// Mixed values have both signs and use the type's precision: floats in
	// [-1, 1) on a grid that the type represents exactly, int32 in
	// [-2^20, 2^20), int64 in [-2^40, 2^40), and uint8 over its whole range
	// [0, 255], so that uint8 sums wrap.
	Mixed ValueKind = iota
	// NearOne values have magnitudes close to one and a random sign, so that
	// a product over many ranks neither overflows nor underflows: floats in
	// ±[0.5, 1.5), int32 in ±[1, 4], int64 in ±[1, 64], uint8 in [1, 3]
	// (uint8 products wrap modulo 256).
	NearOne
)

// String returns "mixed" or "near_one".
func (k ValueKind) String() string {
	switch k {
	case Mixed:
		return "mixed"
	case NearOne:
		return "near_one"
	}
	return fmt.Sprintf("valuekind(%d)", int(k))
}

// Fill returns a new buffer of n elements of type dt holding pseudo-random
// values of the given kind. The values depend only on the arguments (they
// come from a PCG stream seeded with seed, rank and kind), so every process
// of a multi-process run generates the same data for a rank, and a rank can
// regenerate any peer's input to compute an expected result. Every value is
// exactly representable in dt. Fill panics if dt is invalid or n negative.
func Fill(dt comm.DType, n int, seed uint64, rank int, kind ValueKind) *comm.HostBuffer {
	b, err := comm.NewHostBuffer(dt, n)
	if err != nil {
		panic(fmt.Sprintf("commtest: Fill: %v", err))
	}
	fillInto(b, seed, rank, kind)
	return b
}

// fillInto writes Fill's values into b.
func fillInto(b *comm.HostBuffer, seed uint64, rank int, kind ValueKind) {
	// Mix the kind into the stream so that Mixed and NearOne data differ.
	rng := rand.New(rand.NewPCG(seed^(uint64(kind)+1)*0x9e3779b97f4a7c15, uint64(rank)))
	switch b.DType() {
	case comm.Float64:
		x := b.Float64s()
		for i := range x {
			x[i] = floatValue(rng, 53, kind)
		}
	case comm.Float32:
		x := b.Float32s()
		for i := range x {
			x[i] = float32(floatValue(rng, 24, kind))
		}
	case comm.BFloat16:
		x := b.BFloat16s()
		for i := range x {
			// The value has at most 8 significant bits, so the low half
			// of its float32 encoding is zero: truncation is exact.
			x[i] = comm.BFloat16Bits(math.Float32bits(float32(floatValue(rng, 8, kind))) >> 16)
		}
	case comm.Float16:
		x := b.Float16s()
		for i := range x {
			x[i] = encodeF16(floatValue(rng, 11, kind))
		}
	case comm.Int32:
		x := b.Int32s()
		for i := range x {
			x[i] = int32(intValue(rng, kind, 1<<20, 4))
		}
	case comm.Int64:
		x := b.Int64s()
		for i := range x {
			x[i] = intValue(rng, kind, 1<<40, 64)
		}
	case comm.Uint8:
		x := b.Uint8s()
		for i := range x {
			if kind == NearOne {
				x[i] = uint8(1 + rng.IntN(3))
			} else {
				x[i] = uint8(rng.Uint64() >> 56)
			}
		}
	}
}

// floatValue draws a value with at most bits significant bits, so that a
// type with that many significand bits holds it exactly.
func floatValue(rng *rand.Rand, bits int, kind ValueKind) float64 {
	if kind == NearOne {
		// 1 + j·2^-(bits-1) for j in [-2^(bits-2), 2^(bits-2)): a magnitude
		// in [0.5, 1.5) on the grid of the binade [1, 2), which [0.5, 1)
		// also represents exactly.
		j := int64(rng.Uint64()>>(64-(bits-1))) - 1<<(bits-2)
		m := 1 + float64(j)*pow2(-(bits-1))
		if rng.Uint64()&1 == 1 {
			m = -m
		}
		return m
	}
	// k·2^-bits for k in [-2^bits, 2^bits): uniform in [-1, 1).
	k := int64(rng.Uint64()>>(64-(bits+1))) - 1<<bits
	return float64(k) * pow2(-bits)
}

// pow2 returns 2^e for -1022 <= e <= 1023, faster than math.Ldexp.
func pow2(e int) float64 { return math.Float64frombits(uint64(e+1023) << 52) }

// intValue draws from [-span, span) for Mixed and from ±[1, small] for
// NearOne.
func intValue(rng *rand.Rand, kind ValueKind, span, small int64) int64 {
	if kind == NearOne {
		v := 1 + rng.Int64N(small)
		if rng.Uint64()&1 == 1 {
			v = -v
		}
		return v
	}
	return rng.Int64N(2*span) - span
}

// encodeF16 encodes v, which must be zero or a normal binary16 value with at
// most 11 significant bits, exactly: it re-biases the exponent of v's
// float32 encoding and drops the 13 low mantissa bits, which are zero.
func encodeF16(v float64) comm.Float16Bits {
	b := math.Float32bits(float32(v))
	sign := uint16(b>>16) & 0x8000
	if b&0x7fffffff == 0 {
		return comm.Float16Bits(sign)
	}
	exp := uint16((b>>23)&0xff - 127 + 15)
	return comm.Float16Bits(sign | exp<<10 | uint16(b>>13)&0x3ff)
}

// decodeBF16 widens a bfloat16 bit pattern.
func decodeBF16(h uint16) float64 {
	return float64(math.Float32frombits(uint32(h) << 16))
}

// f16Table holds every binary16 value widened, built on first use.
var f16Table = sync.OnceValue(func() *[1 << 16]float64 {
	var t [1 << 16]float64
	for h := range t {
		t[h] = widenF16(uint16(h))
	}
	return &t
})

// widenF16 decodes an IEEE binary16 bit pattern field by field.
func widenF16(h uint16) float64 {
	exp := int(h>>10) & 0x1f
	mant := float64(h & 0x3ff)
	var v float64
	switch exp {
	case 0x1f:
		if mant != 0 {
			v = math.NaN()
		} else {
			v = math.Inf(1)
		}
	case 0:
		v = math.Ldexp(mant, -24)
	default:
		v = math.Ldexp(1024+mant, exp-25)
	}
	if h&0x8000 != 0 {
		v = -v
	}
	return v
}

// ToFloat64 returns the elements of b widened to float64. Every dtype
// converts exactly except int64 values beyond ±2^53, which round.
func ToFloat64(b *comm.HostBuffer) []float64 {
	out := make([]float64, b.Len())
	decodeFloats(b, 0, out)
	return out
}

// decodeFloats widens elements [lo, lo+len(out)) of b into out.
func decodeFloats(b *comm.HostBuffer, lo int, out []float64) {
	hi := lo + len(out)
	switch b.DType() {
	case comm.Float64:
		copy(out, b.Float64s()[lo:hi])
	case comm.Float32:
		for i, v := range b.Float32s()[lo:hi] {
			out[i] = float64(v)
		}
	case comm.BFloat16:
		for i, v := range b.BFloat16s()[lo:hi] {
			out[i] = decodeBF16(uint16(v))
		}
	case comm.Float16:
		t := f16Table()
		for i, v := range b.Float16s()[lo:hi] {
			out[i] = t[v]
		}
	case comm.Int32:
		for i, v := range b.Int32s()[lo:hi] {
			out[i] = float64(v)
		}
	case comm.Int64:
		for i, v := range b.Int64s()[lo:hi] {
			out[i] = float64(v)
		}
	case comm.Uint8:
		for i, v := range b.Uint8s()[lo:hi] {
			out[i] = float64(v)
		}
	}
}

// decodeInts widens elements [lo, lo+len(out)) of an integer buffer.
func decodeInts(b *comm.HostBuffer, lo int, out []int64) {
	hi := lo + len(out)
	switch b.DType() {
	case comm.Int32:
		for i, v := range b.Int32s()[lo:hi] {
			out[i] = int64(v)
		}
	case comm.Int64:
		copy(out, b.Int64s()[lo:hi])
	case comm.Uint8:
		for i, v := range b.Uint8s()[lo:hi] {
			out[i] = int64(v)
		}
	}
}

// element formats element i of b for error messages.
func element(b *comm.HostBuffer, i int) string {
	if b.DType().IsFloat() {
		var v [1]float64
		decodeFloats(b, i, v[:])
		return fmt.Sprint(v[0])
	}
	var v [1]int64
	decodeInts(b, i, v[:])
	return fmt.Sprint(v[0])
}

// clone copies b into fresh memory.
func clone(b *comm.HostBuffer) *comm.HostBuffer {
	c := newBuffer(b.DType(), b.Len())
	copy(c.Bytes(), b.Bytes())
	return c
}

// garbageByte fills output buffers before a call, so that elements the
// backend fails to write show up as mismatches.
const garbageByte = 0xa5

// garbage returns n elements of dt filled with garbageByte.
func garbage(dt comm.DType, n int) *comm.HostBuffer {
	b := newBuffer(dt, n)
	bs := b.Bytes()
	if len(bs) > 0 {
		bs[0] = garbageByte
		for done := 1; done < len(bs); done *= 2 {
			copy(bs[done:], bs[:done])
		}
	}
	return b
}

func newBuffer(dt comm.DType, n int) *comm.HostBuffer {
	b, err := comm.NewHostBuffer(dt, n)
	if err != nil {
		panic(fmt.Sprintf("commtest: %v", err))
	}
	return b
}
