package cuda

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"
	"unsafe"

	"github.com/b7ea7098/loom/kernels"
)

// checkMoE runs every MoE kernel on m against package kernels' CPU kernels
// on random data, for both dtypes. It serves the fake driver
// (fake_test.go) and real GPUs (gpu_test.go); big adds shapes too large for
// the fake's CPU emulation.

type moeCase struct {
	name          string
	n, k, e, capa int
	d             int
	drop          float64
}

func moeCases(big bool) []moeCase {
	cs := []moeCase{
		{name: "zero-tokens", n: 0, k: 2, e: 3, d: 4},
		{name: "zero-tokens-capacity", n: 0, k: 2, e: 3, capa: 2, d: 4},
		{name: "d1", n: 9, k: 2, e: 4, d: 1, drop: 0.2},
		{name: "k1-d2", n: 11, k: 1, e: 3, d: 2},
		{name: "k-equals-e-d4", n: 7, k: 4, e: 4, d: 4},
		{name: "odd-d33", n: 13, k: 3, e: 5, d: 33, drop: 0.1},
		{name: "capacity-drop-pad", n: 17, k: 2, e: 4, capa: 6, d: 8, drop: 0.1},
		{name: "one-expert", n: 10, k: 2, e: 1, d: 6},
	}
	if big {
		cs = append(cs,
			moeCase{name: "big", n: 3000, k: 2, e: 16, d: 1024, drop: 0.01},
			moeCase{name: "big-capacity", n: 3000, k: 8, e: 64, capa: 400, d: 257},
			moeCase{name: "many-rows-d1", n: 1 << 18, k: 2, e: 8, d: 1},
		)
	}
	return cs
}

func checkMoE(t *testing.T, c *Context, m *MoE, big bool) {
	t.Run("float32", func(t *testing.T) { checkMoETyped[float32](t, c, m, Float32, big, 2e-6) })
	t.Run("float64", func(t *testing.T) { checkMoETyped[float64](t, c, m, Float64, big, 1e-13) })
}

// dev copies x into a new device buffer that the test frees.
func dev[T Elem](t *testing.T, c *Context, x []T) Buffer {
	t.Helper()
	b, err := c.Alloc(len(x) * int(unsafe.Sizeof(*new(T))))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := c.Free(b); err != nil {
			t.Error(err)
		}
	})
	if err := CopyToDevice(c, b, x); err != nil {
		t.Fatal(err)
	}
	return b
}

// devGarbage allocates n elements filled with NaN, so that an element a
// kernel fails to write shows.
func devGarbage[T kernels.Float](t *testing.T, c *Context, n int) Buffer {
	x := make([]T, n)
	for i := range x {
		x[i] = T(math.NaN())
	}
	return dev(t, c, x)
}

func host[T Elem](t *testing.T, c *Context, b Buffer, n int) []T {
	t.Helper()
	x := make([]T, n)
	if err := CopyFromDevice(c, x, b); err != nil {
		t.Fatal(err)
	}
	return x
}

func randVec[T kernels.Float](rng *rand.Rand, n int) []T {
	x := make([]T, n)
	for i := range x {
		x[i] = T(rng.Float64()*2 - 1)
	}
	return x
}

// sameVec compares got with want: exactly when rel is 0, else within
// rel·(|want| + 1) (the sums differ from the CPU's in their order).
func sameVec[T kernels.Float](t *testing.T, what string, got, want []T, rel float64) {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("%s: %d values, want %d", what, len(got), len(want))
	}
	for i := range want {
		g, w := float64(got[i]), float64(want[i])
		if g == w || rel > 0 && math.Abs(g-w) <= rel*(math.Abs(w)+1) {
			continue
		}
		t.Fatalf("%s[%d] = %v, want %v", what, i, g, w)
	}
}

func checkMoETyped[T kernels.Float](t *testing.T, c *Context, m *MoE, dt DType, big bool, rel float64) {
	rng := rand.New(rand.NewPCG(11, 12))
	for _, tc := range moeCases(big) {
		t.Run(tc.name, func(t *testing.T) {
			ids := make([]int32, tc.n*tc.k)
			for i := range ids {
				if rng.Float64() < tc.drop {
					ids[i] = -1
				} else {
					ids[i] = int32(rng.IntN(tc.e))
				}
			}
			var r kernels.Routing
			if err := kernels.PlanRouting(&r, ids, tc.k, tc.e, tc.capa); err != nil {
				t.Fatal(err)
			}
			dr, err := m.Upload(&r)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() {
				if err := dr.Free(); err != nil {
					t.Error(err)
				}
			})
			n, k, d, rows := tc.n, tc.k, tc.d, r.Rows()
			x, packed := randVec[T](rng, n*d), randVec[T](rng, rows*d)
			gates, dout := randVec[T](rng, n*k), randVec[T](rng, n*d)
			v := randVec[T](rng, n*k*d)
			dx, dpacked, dgates, dv := dev(t, c, x), dev(t, c, packed), dev(t, c, gates), dev(t, c, v)
			ddout := dev(t, c, dout)

			// Permute.
			want := make([]T, rows*d)
			must(t, kernels.Permute(want, x, d, &r))
			out := devGarbage[T](t, c, rows*d)
			must(t, m.Permute(dt, out, dx, d, dr))
			sameVec(t, "Permute", host[T](t, c, out, rows*d), want, 0)

			// PermuteSlots and UnpermuteSlots.
			must(t, kernels.PermuteSlots(want, v, d, &r))
			must(t, m.PermuteSlots(dt, out, dv, d, dr))
			sameVec(t, "PermuteSlots", host[T](t, c, out, rows*d), want, 0)
			wantV := make([]T, n*k*d)
			must(t, kernels.UnpermuteSlots(wantV, packed, d, &r))
			outV := devGarbage[T](t, c, n*k*d)
			must(t, m.UnpermuteSlots(dt, outV, dpacked, d, dr))
			sameVec(t, "UnpermuteSlots", host[T](t, c, outV, n*k*d), wantV, 0)

			// Unpermute, with and without gates.
			wantT := make([]T, n*d)
			outT := devGarbage[T](t, c, n*d)
			for _, g := range []struct {
				host []T
				dev  Buffer
			}{{nil, Buffer{}}, {gates, dgates}} {
				must(t, kernels.Unpermute(wantT, packed, g.host, d, &r))
				must(t, m.Unpermute(dt, outT, dpacked, g.dev, d, dr))
				sameVec(t, fmt.Sprintf("Unpermute(gates %v)", g.host != nil), host[T](t, c, outT, n*d), wantT, rel)
			}

			// UnpermuteBackward: both outputs, then dpacked alone without
			// gates.
			wantDP, wantDG := make([]T, rows*d), make([]T, n*k)
			must(t, kernels.UnpermuteBackward(wantDP, wantDG, dout, packed, gates, d, &r))
			outDP, outDG := devGarbage[T](t, c, rows*d), devGarbage[T](t, c, n*k)
			must(t, m.UnpermuteBackward(dt, outDP, outDG, ddout, dpacked, dgates, d, dr))
			sameVec(t, "UnpermuteBackward dpacked", host[T](t, c, outDP, rows*d), wantDP, 0)
			sameVec(t, "UnpermuteBackward dgates", host[T](t, c, outDG, n*k), wantDG, rel)
			must(t, kernels.UnpermuteBackward(wantDP, nil, dout, nil, nil, d, &r))
			must(t, m.UnpermuteBackward(dt, outDP, Buffer{}, ddout, Buffer{}, Buffer{}, d, dr))
			sameVec(t, "UnpermuteBackward dpacked without gates", host[T](t, c, outDP, rows*d), wantDP, 0)

			// One element past an allocation's start, no pointer allows
			// 16-byte accesses: the element-wise kernels run instead.
			es := dt.Size()
			skew := func(b Buffer) Buffer { return Buffer{Ptr: b.Ptr + DevicePtr(es), Bytes: b.Bytes - es} }
			outS, packedS, doutS := devGarbage[T](t, c, n*d+1), devGarbage[T](t, c, rows*d+1), devGarbage[T](t, c, n*d+1)
			must(t, CopyToDevice(c, skew(packedS), packed))
			must(t, CopyToDevice(c, skew(doutS), dout))
			must(t, kernels.Unpermute(wantT, packed, gates, d, &r))
			must(t, m.Unpermute(dt, skew(outS), skew(packedS), dgates, d, dr))
			sameVec(t, "Unpermute at an odd address", host[T](t, c, skew(outS), n*d), wantT, rel)
			must(t, kernels.UnpermuteBackward(wantDP, wantDG, dout, packed, gates, d, &r))
			must(t, m.UnpermuteBackward(dt, outDP, outDG, skew(doutS), skew(packedS), dgates, d, dr))
			sameVec(t, "UnpermuteBackward dpacked at an odd address", host[T](t, c, outDP, rows*d), wantDP, 0)
			sameVec(t, "UnpermuteBackward dgates at an odd address", host[T](t, c, outDG, n*k), wantDG, rel)

			// Expert-parallel regrouping of the packed rows, seen as
			// received from 2 ranks with e/2 local experts.
			if tc.e%2 == 0 && rows > 0 {
				ranks, local := 2, tc.e/2
				counts := make([]int, ranks*local)
				for i := range counts {
					counts[i] = rows / len(counts)
				}
				counts[len(counts)-1] += rows - rows/len(counts)*len(counts)
				for _, toExpert := range []bool{true, false} {
					if toExpert {
						must(t, kernels.GroupByExpert(want, packed, d, counts, ranks, local))
					} else {
						must(t, kernels.GroupByRank(want, packed, d, counts, ranks, local))
					}
					idx, err := GroupIndex(counts, ranks, local, toExpert)
					must(t, err)
					rm, err := m.UploadRowMap(idx, rows)
					must(t, err)
					must(t, m.Gather(out, dpacked, d*dt.Size(), rm))
					sameVec(t, fmt.Sprintf("Gather(toExpert %v)", toExpert), host[T](t, c, out, rows*d), want, 0)
					must(t, rm.Free())
				}
			}
			must(t, c.Synchronize())
		})
	}
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}
