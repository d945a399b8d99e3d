package kernel

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"
	"unsafe"

	"github.com/b7ea7098/loom/comm"
)

// TestReduceMatchesReference checks every dtype and op on odd lengths
// (vector bodies and scalar tails), with 1 to 5 sources and the
// destination aliasing each source in turn.
func TestReduceMatchesReference(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 11))
	for _, dt := range comm.AllDTypes() {
		for _, op := range comm.AllReduceOps() {
			sizes := []int{0, 1, 7, 8, 33, 2*block + 5}
			if (dt == comm.Float32 || dt == comm.Float64) && op == comm.Sum {
				sizes = append(sizes, StreamBytes/dt.Size()+13) // the streaming path
			}
			for _, n := range sizes {
				for k := 1; k <= 5; k++ {
					if n > 2*block+5 && k > 3 {
						break
					}
					for alias := -1; alias < k; alias++ {
						name := fmt.Sprintf("%v/%v/n=%d/k=%d/alias=%d", dt, op, n, k, alias)
						srcs := make([][]float64, k)
						raw := make([][]byte, k)
						for i := range srcs {
							srcs[i] = make([]float64, n)
							for j := range srcs[i] {
								srcs[i][j] = value(rng, dt, op)
							}
							raw[i] = encode(dt, srcs[i])
						}
						dst := make([]byte, n*dt.Size())
						if alias >= 0 {
							dst = raw[alias]
						}
						reduce := Reduce
						if alias%2 == 0 {
							reduce = ReduceStream
						}
						if err := reduce(dt, op, dst, raw...); err != nil {
							t.Fatalf("%s: %v", name, err)
						}
						got := decode(dt, dst)
						for j := 0; j < n; j++ {
							want := srcs[0][j]
							for i := 1; i < k; i++ {
								want = apply(op, want, srcs[i][j])
							}
							want = round(dt, want)
							if !close(dt, got[j], want, k) {
								t.Fatalf("%s: [%d] = %v, want %v", name, j, got[j], want)
							}
						}
					}
				}
			}
		}
	}
}

func TestScale(t *testing.T) {
	for _, dt := range comm.AllDTypes() {
		in := []float64{6, 12, 18, 100}
		b := encode(dt, in)
		Scale(dt, b, 3)
		got := decode(dt, b)
		for i, v := range in {
			want := v / 3
			if !dt.IsFloat() {
				want = math.Trunc(want)
			}
			if math.Abs(got[i]-want) > 0.5*math.Abs(want)*1e-2+1e-9 && !(dt.IsFloat() && math.Abs(got[i]-want) < 0.2) {
				t.Errorf("%v: %v/3 = %v, want %v", dt, v, got[i], want)
			}
		}
	}
}

func value(rng *rand.Rand, dt comm.DType, op comm.ReduceOp) float64 {
	switch {
	case dt == comm.Uint8:
		return float64(rng.IntN(3))
	case !dt.IsFloat():
		return float64(rng.IntN(21) - 10)
	case op == comm.Prod:
		return 0.5 + rng.Float64()
	}
	return math.Round(rng.Float64()*64-32) / 4 // exact in every float type
}

func apply(op comm.ReduceOp, a, b float64) float64 {
	switch op {
	case comm.Prod:
		return a * b
	case comm.Min:
		return math.Min(a, b)
	case comm.Max:
		return math.Max(a, b)
	}
	return a + b
}

func round(dt comm.DType, v float64) float64 { return decode(dt, encode(dt, []float64{v}))[0] }

// close: exact for integers and for sums of exactly representable values;
// products round at each step, so allow k roundings of the type.
func close(dt comm.DType, got, want float64, k int) bool {
	eps := map[comm.DType]float64{comm.Float32: 0x1p-23, comm.Float64: 0x1p-52, comm.BFloat16: 0x1p-7, comm.Float16: 0x1p-10}[dt]
	return math.Abs(got-want) <= float64(k)*eps*math.Abs(want)
}

func encode(dt comm.DType, xs []float64) []byte {
	b, _ := comm.NewHostBuffer(dt, len(xs))
	for i, x := range xs {
		switch dt {
		case comm.Float32:
			b.Float32s()[i] = float32(x)
		case comm.Float64:
			b.Float64s()[i] = x
		case comm.Int32:
			b.Int32s()[i] = int32(x)
		case comm.Int64:
			b.Int64s()[i] = int64(x)
		case comm.Uint8:
			b.Uint8s()[i] = uint8(x)
		case comm.BFloat16:
			b.BFloat16s()[i] = comm.ToBFloat16(float32(x))
		case comm.Float16:
			b.Float16s()[i] = comm.ToFloat16(float32(x))
		}
	}
	return b.Bytes()
}

func decode(dt comm.DType, raw []byte) []float64 {
	b, err := comm.HostBytes(dt, raw)
	if err != nil {
		panic(err)
	}
	out := make([]float64, b.Len())
	for i := range out {
		switch dt {
		case comm.Float32:
			out[i] = float64(b.Float32s()[i])
		case comm.Float64:
			out[i] = b.Float64s()[i]
		case comm.Int32:
			out[i] = float64(b.Int32s()[i])
		case comm.Int64:
			out[i] = float64(b.Int64s()[i])
		case comm.Uint8:
			out[i] = float64(b.Uint8s()[i])
		case comm.BFloat16:
			out[i] = float64(b.BFloat16s()[i].Float32())
		case comm.Float16:
			out[i] = float64(b.Float16s()[i].Float32())
		}
	}
	return out
}

func BenchmarkReduceFloat32Sum(b *testing.B) {
	const n = 8 << 20
	x, y, z := make([]float32, n), make([]float32, n), make([]float32, n)
	bytes := func(s []float32) []byte { return unsafe.Slice((*byte)(unsafe.Pointer(&s[0])), 4*len(s)) }
	b.SetBytes(4 * n)
	for i := 0; i < b.N; i++ {
		_ = ReduceStream(comm.Float32, comm.Sum, bytes(z), bytes(x), bytes(y))
	}
}

// ReduceInto writes one result to several destinations, which may alias
// the sources, streaming or not.
func TestReduceIntoSeveralDestinations(t *testing.T) {
	for _, dt := range []comm.DType{comm.Float32, comm.Float64, comm.Int32, comm.BFloat16} {
		for _, n := range []int{0, 5, blockBytes/dt.Size() + 3, StreamBytes/dt.Size() + 77} {
			for _, stream := range []bool{false, true} {
				a, b := make([]float64, n), make([]float64, n)
				for i := range a {
					a[i], b[i] = float64(i%50), float64(3-i%7)
				}
				ra, rb := encode(dt, a), encode(dt, b)
				other := make([]byte, len(ra))
				// Destinations: both sources (in place) and a third buffer.
				if err := ReduceInto(dt, comm.Sum, stream, [][]byte{ra, other, rb}, [][]byte{ra, rb}); err != nil {
					t.Fatal(err)
				}
				for name, got := range map[string][]float64{"a": decode(dt, ra), "b": decode(dt, rb), "other": decode(dt, other)} {
					for i := range got {
						if want := a[i] + b[i]; got[i] != want {
							t.Fatalf("%v n=%d stream=%v %s[%d] = %v, want %v", dt, n, stream, name, i, got[i], want)
						}
					}
				}
			}
		}
	}
	if err := ReduceInto(comm.Float32, comm.Sum, false, [][]byte{make([]byte, 8), make([]byte, 4)}, [][]byte{make([]byte, 8)}); err == nil {
		t.Error("destinations of different lengths accepted")
	}
}

// Scale divides uint8 by group sizes beyond 255 without wrapping the divisor.
func TestScaleUint8LargeGroups(t *testing.T) {
	b := []byte{255, 10}
	Scale(comm.Uint8, b, 256)
	if b[0] != 0 || b[1] != 0 {
		t.Fatalf("255/256, 10/256 = %v", b)
	}
	b = []byte{200}
	Scale(comm.Uint8, b, 2)
	if b[0] != 100 {
		t.Fatalf("200/2 = %v", b[0])
	}
}
