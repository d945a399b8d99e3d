package kernels

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
)

// The permute kernels are checked against straightforward references that
// build the layout by scanning every expert for its slots, and by adjoint
// (dot-product) tests: for a linear map A and its claimed adjoint Aᵀ,
// ⟨A x, y⟩ = ⟨x, Aᵀ y⟩ on random x and y.

// permCase is one routing to test.
type permCase struct {
	name          string
	n, k, e, capa int
	d             int
	experts       []int32 // nil: random (with dropRate of −1 slots)
	dropRate      float64
}

func permCases() []permCase {
	oneExpert := make([]int32, 7*2)
	for i := range oneExpert {
		oneExpert[i] = 3
	}
	kIsE := make([]int32, 5*4)
	for t := range 5 {
		for j := range 4 {
			kIsE[t*4+j] = int32((t + j) % 4) // every token to every expert, rotated
		}
	}
	noExpert1 := []int32{0, 2, 2, 0, 3, 0, 0, 3, 2, 2} // expert 1 gets nothing
	dup := []int32{1, 1, 0, 1, -1, -1, 2, 2}           // a token may pick one expert twice
	return []permCase{
		{name: "zero-tokens", n: 0, k: 2, e: 3, d: 4},
		{name: "zero-tokens-capacity", n: 0, k: 2, e: 3, capa: 2, d: 4},
		{name: "zero-width", n: 5, k: 2, e: 3, d: 0},
		{name: "expert-without-tokens", n: 5, k: 2, e: 4, d: 3, experts: noExpert1},
		{name: "all-to-one-expert", n: 7, k: 2, e: 5, d: 5, experts: oneExpert},
		{name: "all-to-one-expert-capacity", n: 7, k: 2, e: 5, capa: 4, d: 5, experts: oneExpert},
		{name: "k-equals-e", n: 5, k: 4, e: 4, d: 6, experts: kIsE},
		{name: "k1", n: 9, k: 1, e: 3, d: 7},
		{name: "k1-d1", n: 13, k: 1, e: 5, d: 1},
		{name: "d1", n: 11, k: 2, e: 4, d: 1},
		{name: "duplicate-choice", n: 4, k: 2, e: 3, d: 3, experts: dup},
		{name: "dropped-slots", n: 17, k: 3, e: 6, d: 9, dropRate: 0.3},
		{name: "all-dropped", n: 6, k: 2, e: 3, d: 4, dropRate: 1},
		{name: "capacity-drop-and-pad", n: 23, k: 2, e: 4, capa: 9, d: 3, dropRate: 0.1},
		{name: "capacity-1", n: 10, k: 2, e: 3, capa: 1, d: 5},
		{name: "capacity-large", n: 10, k: 2, e: 3, capa: 40, d: 2},
		{name: "odd", n: 31, k: 3, e: 7, d: 33, dropRate: 0.05},
		{name: "parallel", n: 1500, k: 2, e: 8, d: 256, dropRate: 0.01},
		{name: "parallel-capacity", n: 1500, k: 2, e: 8, capa: 300, d: 256},
	}
}

// permExperts returns the case's expert ids.
func (c permCase) permExperts(rng *rand.Rand) []int32 {
	if c.experts != nil {
		return c.experts
	}
	ids := make([]int32, c.n*c.k)
	for i := range ids {
		if rng.Float64() < c.dropRate {
			ids[i] = -1
		} else {
			ids[i] = int32(rng.IntN(c.e))
		}
	}
	return ids
}

// refLayout is the reference layout: for each expert, its slots in slot
// order, cut at capacity and padded with −1.
func refLayout(experts []int32, e, capa int) (rowSlot []int32, counts, routed []int, dropped, padded, unrouted int) {
	counts, routed = make([]int, e), make([]int, e)
	rowSlot = []int32{}
	for x := range e {
		kept := 0
		for s, id := range experts {
			if int(id) != x {
				continue
			}
			routed[x]++
			if capa > 0 && kept == capa {
				dropped++
				continue
			}
			rowSlot = append(rowSlot, int32(s))
			kept++
		}
		counts[x] = kept
		for capa > 0 && kept < capa {
			rowSlot = append(rowSlot, -1)
			kept++
			padded++
		}
	}
	for _, id := range experts {
		if id < 0 {
			unrouted++
		}
	}
	return
}

func permRand[T Float](rng *rand.Rand, n int) []T {
	x := make([]T, n)
	for i := range x {
		x[i] = T(rng.Float64()*2 - 1)
	}
	return x
}

func permDotAll[T Float](a, b []T) float64 {
	s := 0.0
	for i := range a {
		s += float64(a[i]) * float64(b[i])
	}
	return s
}

// scaleDotOrder is Σ x[i]·y[i] summed in the order scaleDotF32 documents
// for float32 rows on AVX2 (four accumulators of four lanes over the
// first multiple of 8, then the rest in turn), or in turn throughout
// without AVX2.
func scaleDotOrder(x, y []float32) float64 {
	i, s := 0, 0.0
	if haveVec && len(x) >= 8 {
		var acc [4][4]float64
		n := len(x) &^ 7
		for ; i+16 <= n; i += 16 {
			for c := range 4 {
				for l := range 4 {
					acc[c][l] += float64(x[i+4*c+l]) * float64(y[i+4*c+l])
				}
			}
		}
		if i < n {
			for c := range 2 {
				for l := range 4 {
					acc[c][l] += float64(x[i+4*c+l]) * float64(y[i+4*c+l])
				}
			}
			i += 8
		}
		var lane [4]float64
		for l := range 4 {
			lane[l] = (acc[0][l] + acc[1][l]) + (acc[2][l] + acc[3][l])
		}
		s = (lane[0] + lane[2]) + (lane[1] + lane[3])
	}
	for ; i < len(x); i++ {
		s += float64(x[i]) * float64(y[i])
	}
	return s
}

// permNear reports whether a and b agree to rel·(|a|+|b|) + abs.
func permNear(a, b, rel, abs float64) bool {
	return math.Abs(a-b) <= rel*(math.Abs(a)+math.Abs(b))+abs
}

func TestPlanRouting(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	var r Routing // reused across cases, as a caller would
	for _, c := range permCases() {
		t.Run(c.name, func(t *testing.T) {
			ids := c.permExperts(rng)
			if err := PlanRouting(&r, ids, c.k, c.e, c.capa); err != nil {
				t.Fatal(err)
			}
			rowSlot, counts, routed, dropped, padded, unrouted := refLayout(ids, c.e, c.capa)
			if !slices.Equal(r.RowSlot, rowSlot) {
				t.Fatalf("RowSlot = %v, want %v", r.RowSlot, rowSlot)
			}
			if !slices.Equal(r.Counts, counts) || !slices.Equal(r.Routed, routed) {
				t.Fatalf("Counts, Routed = %v, %v, want %v, %v", r.Counts, r.Routed, counts, routed)
			}
			if r.Dropped != dropped || r.Padded != padded || r.Unrouted != unrouted {
				t.Fatalf("Dropped, Padded, Unrouted = %d, %d, %d, want %d, %d, %d", r.Dropped, r.Padded, r.Unrouted, dropped, padded, unrouted)
			}
			if r.Tokens != c.n || r.TopK != c.k || r.Experts != c.e || r.Capacity != c.capa {
				t.Fatalf("sizes %d %d %d %d, want %d %d %d %d", r.Tokens, r.TopK, r.Experts, r.Capacity, c.n, c.k, c.e, c.capa)
			}
			if r.Rows() != len(rowSlot) {
				t.Fatalf("Rows() = %d, want %d", r.Rows(), len(rowSlot))
			}
			if c.capa > 0 && r.Rows() != c.capa*c.e {
				t.Fatalf("static capacity: Rows() = %d, want %d", r.Rows(), c.capa*c.e)
			}
			// Offsets, SlotRow and Source agree with RowSlot.
			for x := range c.e {
				lo, hi := r.Offsets[x], r.Offsets[x+1]
				if c.capa == 0 && hi-lo != counts[x] || c.capa > 0 && hi-lo != c.capa {
					t.Fatalf("expert %d owns rows [%d, %d)", x, lo, hi)
				}
				for p := lo; p < hi; p++ {
					tok, ch, ok := r.Source(p)
					if live := p < lo+counts[x]; ok != live {
						t.Fatalf("row %d: Source ok = %v, want %v", p, ok, live)
					}
					if ok && (int(ids[tok*c.k+ch]) != x || int(r.SlotRow[tok*c.k+ch]) != p) {
						t.Fatalf("row %d: source (%d, %d) has expert %d, slot row %d", p, tok, ch, ids[tok*c.k+ch], r.SlotRow[tok*c.k+ch])
					}
				}
			}
			live := 0
			for s, p := range r.SlotRow {
				if p >= 0 {
					live++
					if int(r.RowSlot[p]) != s {
						t.Fatalf("slot %d -> row %d -> slot %d", s, p, r.RowSlot[p])
					}
				}
			}
			if live+dropped+unrouted != c.n*c.k {
				t.Fatalf("live %d + dropped %d + unrouted %d != %d slots", live, dropped, unrouted, c.n*c.k)
			}
			if _, _, ok := r.Source(-1); ok {
				t.Fatal("Source(-1) ok")
			}
			if _, _, ok := r.Source(r.Rows()); ok {
				t.Fatal("Source(Rows()) ok")
			}
		})
	}
}

func TestPlanRoutingIndexTypes(t *testing.T) {
	ids := []int32{2, 0, -1, 1, 0, 2}
	var want Routing
	if err := PlanRouting(&want, ids, 2, 3, 0); err != nil {
		t.Fatal(err)
	}
	i64 := []int64{2, 0, -1, 1, 0, 2}
	in := []int{2, 0, -1, 1, 0, 2}
	var a, b Routing
	if err := PlanRouting(&a, i64, 2, 3, 0); err != nil {
		t.Fatal(err)
	}
	if err := PlanRouting(&b, in, 2, 3, 0); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(a.RowSlot, want.RowSlot) || !slices.Equal(b.RowSlot, want.RowSlot) {
		t.Fatalf("int64/int layouts %v %v, want %v", a.RowSlot, b.RowSlot, want.RowSlot)
	}
}

func TestPlanRoutingErrors(t *testing.T) {
	var r Routing
	if err := PlanRouting(&r, []int32{0, 1, 2, 0}, 2, 3, 0); err != nil {
		t.Fatal(err)
	}
	before := Routing{RowSlot: slices.Clone(r.RowSlot), SlotRow: slices.Clone(r.SlotRow), Routed: slices.Clone(r.Routed),
		Counts: slices.Clone(r.Counts), Offsets: slices.Clone(r.Offsets), TopK: r.TopK}
	unchanged := func() bool {
		return slices.Equal(r.RowSlot, before.RowSlot) && slices.Equal(r.SlotRow, before.SlotRow) &&
			slices.Equal(r.Routed, before.Routed) && slices.Equal(r.Counts, before.Counts) &&
			slices.Equal(r.Offsets, before.Offsets) && r.TopK == before.TopK
	}
	for _, c := range []struct {
		name          string
		ids           []int32
		k, e, capa    int
		wantSubstring string
	}{
		{"expert-too-large", []int32{0, 3}, 2, 3, 0, "slot 1 (token 0, choice 1) has expert 3"},
		{"expert-below-minus-one", []int32{-2, 0}, 2, 3, 0, "expert -2"},
		{"k0", []int32{0}, 0, 3, 0, "top-k 0"},
		{"e0", []int32{0}, 1, 0, 0, "0 experts"},
		{"ragged", []int32{0, 1, 2}, 2, 3, 0, "not whole tokens"},
		{"negative-capacity", []int32{0, 1}, 2, 3, -1, "negative capacity"},
		{"capacity-overflow", []int32{0, 1}, 2, 3, math.MaxInt32, "exceed the int32 row map"},
	} {
		err := PlanRouting(&r, c.ids, c.k, c.e, c.capa)
		if err == nil || !strings.Contains(err.Error(), c.wantSubstring) {
			t.Errorf("%s: err = %v, want it to mention %q", c.name, err, c.wantSubstring)
		}
		if !unchanged() {
			t.Errorf("%s: Routing changed on error", c.name)
		}
	}
	// Ids of the widest index type at both ends: the range check must not
	// wrap around.
	for _, id := range []int64{math.MaxInt64, math.MinInt64, -2} {
		err := PlanRouting(&r, []int64{0, id}, 2, 3, 0)
		if want := fmt.Sprintf("has expert %d", id); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("id %d: err = %v, want it to mention %q", id, err, want)
		}
		if !unchanged() {
			t.Errorf("id %d: Routing changed on error", id)
		}
	}
	if err := PlanRouting[int32](nil, nil, 1, 1, 0); err == nil {
		t.Error("nil Routing: no error")
	}
}

// refPermute and friends are the reference kernels, written from the
// definitions.
func refPermute[T Float](x []T, d int, rowSlot []int32, k int) []T {
	out := make([]T, len(rowSlot)*d)
	for p, s := range rowSlot {
		if s >= 0 {
			copy(out[p*d:(p+1)*d], x[int(s)/k*d:])
		}
	}
	return out
}

func refUnpermute(packed []float64, gates []float64, d int, r *Routing) []float64 {
	out := make([]float64, r.Tokens*d)
	for p, s := range r.RowSlot {
		if s < 0 {
			continue
		}
		g := 1.0
		if gates != nil {
			g = gates[s]
		}
		t := int(s) / r.TopK
		for i := range d {
			out[t*d+i] += g * packed[p*d+i]
		}
	}
	return out
}

func to64[T Float](x []T) []float64 {
	y := make([]float64, len(x))
	for i, v := range x {
		y[i] = float64(v)
	}
	return y
}

func TestPermuteKernels(t *testing.T) {
	t.Run("float32", func(t *testing.T) { testPermuteKernels[float32](t, 1e-6) })
	t.Run("float64", func(t *testing.T) { testPermuteKernels[float64](t, 1e-14) })
}

func testPermuteKernels[T Float](t *testing.T, rel float64) {
	rng := rand.New(rand.NewPCG(3, 4))
	for _, c := range permCases() {
		t.Run(c.name, func(t *testing.T) {
			var r Routing
			ids := c.permExperts(rng)
			if err := PlanRouting(&r, ids, c.k, c.e, c.capa); err != nil {
				t.Fatal(err)
			}
			n, k, d, m := c.n, c.k, c.d, r.Rows()
			x := permRand[T](rng, n*d)
			gates := permRand[T](rng, n*k)

			// Permute: exact row copies, pad rows zero (out starts dirty).
			out := permRand[T](rng, m*d)
			if err := Permute(out, x, d, &r); err != nil {
				t.Fatal(err)
			}
			if want := refPermute(x, d, r.RowSlot, k); !slices.Equal(out, want) {
				t.Fatalf("Permute = %v, want %v", out, want)
			}

			// Unpermute, weighted and not.
			packed := permRand[T](rng, m*d)
			for _, g := range [][]T{nil, gates} {
				got := permRand[T](rng, n*d)
				if err := Unpermute(got, packed, g, d, &r); err != nil {
					t.Fatal(err)
				}
				var g64 []float64
				if g != nil {
					g64 = to64(g)
				}
				want := refUnpermute(to64(packed), g64, d, &r)
				for i := range want {
					if !permNear(float64(got[i]), want[i], rel, rel) {
						t.Fatalf("Unpermute (gates %v) [%d] = %v, want %v", g != nil, i, got[i], want[i])
					}
				}
			}

			// PermuteSlots / UnpermuteSlots: exact.
			v := permRand[T](rng, n*k*d)
			ps := permRand[T](rng, m*d)
			if err := PermuteSlots(ps, v, d, &r); err != nil {
				t.Fatal(err)
			}
			if want := refPermute(v, d, r.RowSlot, 1); !slices.Equal(ps, want) {
				t.Fatalf("PermuteSlots = %v, want %v", ps, want)
			}
			us := permRand[T](rng, n*k*d)
			if err := UnpermuteSlots(us, packed, d, &r); err != nil {
				t.Fatal(err)
			}
			for s, p := range r.SlotRow {
				row := us[s*d : (s+1)*d]
				if p < 0 {
					if slices.ContainsFunc(row, func(v T) bool { return v != 0 }) {
						t.Fatalf("UnpermuteSlots: dead slot %d = %v", s, row)
					}
				} else if !slices.Equal(row, packed[int(p)*d:(int(p)+1)*d]) {
					t.Fatalf("UnpermuteSlots: slot %d = %v, want row %d", s, row, p)
				}
			}

			// UnpermuteBackward against the definitions.
			dout := permRand[T](rng, n*d)
			dpacked, dgates := permRand[T](rng, m*d), permRand[T](rng, n*k)
			if err := UnpermuteBackward(dpacked, dgates, dout, packed, gates, d, &r); err != nil {
				t.Fatal(err)
			}
			for p, s := range r.RowSlot {
				for i := range d {
					want := T(0)
					if s >= 0 {
						want = gates[s] * dout[int(s)/k*d+i]
					}
					if dpacked[p*d+i] != want {
						t.Fatalf("dpacked[%d,%d] = %v, want %v", p, i, dpacked[p*d+i], want)
					}
				}
			}
			for s, p := range r.SlotRow {
				want := 0.0
				if p >= 0 {
					for i := range d {
						want += float64(packed[int(p)*d+i]) * float64(dout[s/k*d+i])
					}
				}
				if !permNear(float64(dgates[s]), want, rel, rel) {
					t.Fatalf("dgates[%d] = %v, want %v", s, dgates[s], want)
				}
			}
			// Unweighted backward is Permute of dout; nil outputs are skipped.
			if err := UnpermuteBackward(dpacked, nil, dout, nil, nil, d, &r); err != nil {
				t.Fatal(err)
			}
			if want := refPermute(dout, d, r.RowSlot, k); !slices.Equal(dpacked, want) {
				t.Fatal("UnpermuteBackward with nil gates differs from Permute(dout)")
			}
		})
	}
}

// TestPermuteAdjoint checks ⟨A x, y⟩ = ⟨x, Aᵀ y⟩ for every linear map and
// its claimed adjoint, in float64.
func TestPermuteAdjoint(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	for _, c := range permCases() {
		t.Run(c.name, func(t *testing.T) {
			var r Routing
			if err := PlanRouting(&r, c.permExperts(rng), c.k, c.e, c.capa); err != nil {
				t.Fatal(err)
			}
			n, k, d, m := c.n, c.k, c.d, r.Rows()
			adj := func(what string, ax, y, x, aty []float64) {
				t.Helper()
				if l, rr := permDotAll(ax, y), permDotAll(x, aty); !permNear(l, rr, 1e-12, 1e-12) {
					t.Fatalf("%s: <A x, y> = %v, <x, A* y> = %v", what, l, rr)
				}
			}
			x, y := permRand[float64](rng, n*d), permRand[float64](rng, m*d)
			px, uy := make([]float64, m*d), make([]float64, n*d)
			must(t, Permute(px, x, d, &r))
			must(t, Unpermute(uy, y, nil, d, &r))
			adj("Permute / Unpermute", px, y, x, uy)

			// Gate-weighted combine and its packed-side backward.
			gates := permRand[float64](rng, n*k)
			p, z := permRand[float64](rng, m*d), permRand[float64](rng, n*d)
			up, dp := make([]float64, n*d), make([]float64, m*d)
			must(t, Unpermute(up, p, gates, d, &r))
			must(t, UnpermuteBackward(dp, nil, z, nil, gates, d, &r))
			adj("weighted Unpermute / UnpermuteBackward", up, z, p, dp)

			// The combine is linear in the gates: its derivative along δ
			// is ⟨δ, dgates⟩.
			delta := permRand[float64](rng, n*k)
			dg := make([]float64, n*k)
			must(t, UnpermuteBackward(nil, dg, z, p, gates, d, &r))
			ud := make([]float64, n*d)
			must(t, Unpermute(ud, p, delta, d, &r))
			adj("gates / dgates", ud, z, delta, dg)

			v, w := permRand[float64](rng, n*k*d), permRand[float64](rng, m*d)
			pv, uw := make([]float64, m*d), make([]float64, n*k*d)
			must(t, PermuteSlots(pv, v, d, &r))
			must(t, UnpermuteSlots(uw, w, d, &r))
			adj("PermuteSlots / UnpermuteSlots", pv, w, v, uw)
		})
	}
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

func TestPermuteErrors(t *testing.T) {
	var r Routing
	must(t, PlanRouting(&r, []int32{0, 1, 1, -1, 2, 0}, 2, 3, 0)) // 3 tokens, 5 rows
	d := 2
	x, out := make([]float32, 3*d), make([]float32, 5*d)
	sentinel := func(s []float32) []float32 {
		for i := range s {
			s[i] = 7
		}
		return s
	}
	untouched := func(what string, s []float32) {
		t.Helper()
		for _, v := range s {
			if v != 7 {
				t.Fatalf("%s: output changed on error", what)
			}
		}
	}
	errIs := func(what string, err error, sub string) {
		t.Helper()
		if err == nil || !strings.Contains(err.Error(), sub) {
			t.Fatalf("%s: err = %v, want it to mention %q", what, err, sub)
		}
	}
	errIs("short out", Permute(sentinel(out[:8]), x, d, &r), "len(out) = 8")
	untouched("short out", out[:8])
	errIs("short x", Permute(sentinel(out), x[:5], d, &r), "len(x) = 5")
	untouched("short x", out)
	errIs("negative d", Permute(out, x, -1, &r), "negative row width")
	errIs("unplanned", Permute(out, x, d, &Routing{}), "not planned")
	errIs("nil routing", Permute(out, x, d, nil), "nil Routing")
	errIs("gates", Unpermute(sentinel(x), out, make([]float32, 5), d, &r), "len(gates) = 5")
	untouched("gates", x)
	errIs("dgates", UnpermuteBackward(nil, sentinel(make([]float32, 6)), x, nil, nil, d, &r), "len(packed) = 0")
	errIs("slots", PermuteSlots(out, x, d, &r), "len(v) = 6")
	errIs("unslots", UnpermuteSlots(x, out, d, &r), "len(v) = 6")

	// A Routing whose maps were changed by hand is an error, not a panic.
	bad := r
	bad.RowSlot = slices.Clone(r.RowSlot)
	bad.RowSlot[0] = 99
	errIs("corrupt RowSlot", Permute(out, x, d, &bad), "Routing.RowSlot")
	bad = r
	bad.SlotRow = slices.Clone(r.SlotRow)
	bad.SlotRow[1] = -5
	errIs("corrupt SlotRow", Unpermute(x, out, nil, d, &bad), "Routing.SlotRow")
	bad = r
	bad.RowSlot = slices.Clone(r.RowSlot)
	bad.RowSlot[0] = 99
	errIs("corrupt RowSlot, dgates", UnpermuteBackward(nil, make([]float32, 6), x, out, nil, d, &bad), "Routing.RowSlot")
	// Nothing asked for: nothing read, whatever the maps hold.
	if err := UnpermuteBackward(nil, nil, x, nil, make([]float32, 6), d, &bad); err != nil {
		t.Fatalf("UnpermuteBackward with neither output: %v", err)
	}
	if err := UnpermuteBackwardExpert(nil, nil, x, nil, make([]float32, 6), d, &r, 0); err != nil {
		t.Fatalf("UnpermuteBackwardExpert with neither output: %v", err)
	}
}

// refGroup builds the expert-major layout of rank-major chunks by listing
// rows.
func refGroup(src []float64, d int, counts []int, ranks, local int) []float64 {
	type chunk struct{ start, n int }
	chunks := make([]chunk, ranks*local)
	off := 0
	for i, c := range counts {
		chunks[i] = chunk{off, c}
		off += c
	}
	var out []float64
	for l := range local {
		for q := range ranks {
			c := chunks[q*local+l]
			out = append(out, src[c.start*d:(c.start+c.n)*d]...)
		}
	}
	return out
}

func TestGroupChunks(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 8))
	for _, c := range []struct {
		ranks, local, d, maxRows int
	}{
		{0, 0, 3, 0}, {1, 1, 1, 4}, {2, 3, 5, 6}, {4, 2, 1, 9}, {3, 1, 7, 5}, {1, 4, 2, 3}, {5, 3, 0, 4},
		{8, 4, 64, 700}, // large enough to split over goroutines
	} {
		counts := make([]int, c.ranks*c.local)
		total := 0
		for i := range counts {
			if rng.IntN(4) > 0 { // leave some chunks empty
				counts[i] = rng.IntN(c.maxRows + 1)
			}
			total += counts[i]
		}
		src := permRand[float64](rng, total*c.d)
		em := make([]float64, total*c.d)
		must(t, GroupByExpert(em, src, c.d, counts, c.ranks, c.local))
		if want := refGroup(src, c.d, counts, c.ranks, c.local); !slices.Equal(em, want) && total*c.d > 0 {
			t.Fatalf("%+v: GroupByExpert = %v, want %v", c, em, want)
		}
		back := make([]float64, total*c.d)
		must(t, GroupByRank(back, em, c.d, counts, c.ranks, c.local))
		if !slices.Equal(back, src) {
			t.Fatalf("%+v: GroupByRank(GroupByExpert(x)) != x", c)
		}
		// Adjoint: a permutation's adjoint is its inverse.
		y := permRand[float64](rng, total*c.d)
		gy := make([]float64, total*c.d)
		must(t, GroupByRank(gy, y, c.d, counts, c.ranks, c.local))
		if l, r := permDotAll(em, y), permDotAll(src, gy); !permNear(l, r, 1e-12, 1e-12) {
			t.Fatalf("%+v: adjoint %v != %v", c, l, r)
		}
	}
	// float32 on one shape.
	counts := []int{1, 2, 2, 1} // rank 0: rows 0 | 1-2, rank 1: rows 3-4 | 5
	src := permRand[float32](rng, 6*3)
	dst := make([]float32, 6*3)
	must(t, GroupByExpert(dst, src, 3, counts, 2, 2))
	want := slices.Concat(src[0:3], src[9:15], src[3:9], src[15:18])
	if !slices.Equal(dst, want) {
		t.Fatalf("float32 GroupByExpert = %v, want %v", dst, want)
	}
	// Errors.
	if err := GroupByExpert(dst, src, 3, []int{1, 2, 3}, 2, 2); err == nil {
		t.Error("ragged counts: no error")
	}
	if err := GroupByExpert(dst, src, 3, []int{1, 0, -2, 3}, 2, 2); err == nil || !strings.Contains(err.Error(), "negative") {
		t.Errorf("negative count: err = %v", err)
	}
	if err := GroupByRank(dst[:3], src, 3, counts, 2, 2); err == nil {
		t.Error("short dst: no error")
	}
}

func TestExpertBoundsAndRankSplits(t *testing.T) {
	for _, c := range []struct {
		e, ranks int
		want     []int
	}{
		{8, 4, []int{0, 2, 4, 6, 8}},
		{7, 3, []int{0, 3, 6, 7}},
		{3, 5, []int{0, 1, 2, 3, 3, 3}},
		{0, 2, []int{0, 0, 0}},
		{5, 1, []int{0, 5}},
	} {
		b, err := ExpertBounds(c.e, c.ranks)
		if err != nil || !slices.Equal(b, c.want) {
			t.Errorf("ExpertBounds(%d, %d) = %v, %v, want %v", c.e, c.ranks, b, err, c.want)
		}
	}
	if _, err := ExpertBounds(4, 0); err == nil {
		t.Error("ExpertBounds with 0 ranks: no error")
	}

	rng := rand.New(rand.NewPCG(9, 10))
	for _, capa := range []int{0, 3} {
		var r Routing
		c := permCase{n: 20, k: 2, e: 7, dropRate: 0.1}
		ids := c.permExperts(rng)
		must(t, PlanRouting(&r, ids, c.k, c.e, capa))
		bounds, err := ExpertBounds(7, 3)
		must(t, err)
		splits := make([]int, 3)
		must(t, r.RankSplits(splits, bounds))
		sum := 0
		for q, s := range splits {
			want := 0
			for e := bounds[q]; e < bounds[q+1]; e++ {
				want += r.Offsets[e+1] - r.Offsets[e]
			}
			if s != want {
				t.Fatalf("capacity %d: split %d = %d, want %d", capa, q, s, want)
			}
			// Rank q's rows are exactly its experts' rows, contiguously.
			for p := sum; p < sum+s; p++ {
				if tok, ch, ok := r.Source(p); ok {
					if e := int(ids[tok*c.k+ch]); e < bounds[q] || e >= bounds[q+1] {
						t.Fatalf("capacity %d: row %d of rank %d's send buffer holds expert %d", capa, p, q, e)
					}
				}
			}
			sum += s
		}
		if sum != r.Rows() {
			t.Fatalf("splits %v sum to %d, want %d", splits, sum, r.Rows())
		}
		if err := r.RankSplits(splits, []int{0, 3, 2, 7}); err == nil {
			t.Error("descending bounds: no error")
		}
		if err := r.RankSplits(splits, []int{0, 3, 7}); err == nil {
			t.Error("short bounds: no error")
		}
	}
}

// TestPermRowLoopsMatchScalar: the float32 row primitives (vector kernels
// and portable tails) give the bits of the plain scalar arithmetic, at
// every length around the vector width.
func TestPermRowLoopsMatchScalar(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	for _, n := range []int{0, 1, 7, 8, 9, 15, 16, 17, 31, 64, 257} {
		x, o := permRand[float32](rng, n), permRand[float32](rng, n)
		a := float32(rng.NormFloat64())
		same := func(what string, got []float32, want func(i int) float32) {
			t.Helper()
			for i := range n {
				if w := want(i); math.Float32bits(got[i]) != math.Float32bits(w) {
					t.Fatalf("%s, n=%d, [%d]: %v, scalar %v", what, n, i, got[i], w)
				}
			}
		}
		got := slices.Clone(o)
		scaleF32(got, x, a)
		same("scaleF32", got, func(i int) float32 { return a * x[i] })
		got = slices.Clone(o)
		axpyF32(got, x, a)
		same("axpyF32", got, func(i int) float32 { return o[i] + a*x[i] })
	}
}

// TestScaleDotOrder: the vector kernel (where the CPU has it) sums in the
// order scaleDotOrder spells out, and UnpermuteBackward adds a row's last
// len mod 8 products to the vector sum in turn (without AVX2 it sums the
// whole row in turn, which gives the same 1 below). Both are checked where the order shows: in
// float64 for the kernel (values of 60 binades, which round differently in
// almost any other order), and in a gate gradient whose tail cancels the
// vector sum, which only the documented order leaves at 1.
func TestScaleDotOrder(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 8))
	for _, n := range []int{8, 16, 24, 32, 64, 256} {
		if !haveVec {
			break // no vector kernel: the portable loop sums in turn throughout
		}
		x, y := make([]float32, n), make([]float32, n)
		for i := range x {
			x[i] = float32(math.Ldexp(rng.NormFloat64(), rng.IntN(60)-30))
			y[i] = float32(math.Ldexp(rng.NormFloat64(), rng.IntN(60)-30))
		}
		for _, store := range []bool{false, true} {
			o := make([]float32, n)
			var dst *float32
			if store {
				dst = &o[0]
			}
			got := scaleDotF32AVX2(dst, &x[0], &y[0], n, 3, store)
			if want := scaleDotOrder(x, y); math.Float64bits(got) != math.Float64bits(want) {
				t.Fatalf("n=%d store=%v: %v, want %v in the documented order", n, store, got, want)
			}
		}
	}
	// One token, one slot, a row of 10: the vector part sums to 2⁶⁰ and the
	// tail's products are −2⁶⁰ and 1: (2⁶⁰ − 2⁶⁰) + 1 = 1, where adding the
	// tail's own sum (−2⁶⁰ + 1 = −2⁶⁰ in float64) would give 0.
	const d = 10
	dout := []float32{0x1p60, 0, 0, 0, 0, 0, 0, 0, -0x1p60, 1}
	packed := []float32{1, 0, 0, 0, 0, 0, 0, 0, 1, 1}
	var r Routing
	must(t, PlanRouting(&r, []int32{0}, 1, 1, 0))
	dgates := make([]float32, 1)
	must(t, UnpermuteBackward(nil, dgates, dout, packed, nil, d, &r))
	if dgates[0] != 1 {
		t.Fatalf("gate gradient %v, want 1: the tail was not added to the vector sum in turn", dgates[0])
	}
}

// TestFloat32LoopsMatchPortable: the float32 loops of Unpermute and
// UnpermuteBackward give the portable loops' bits (the gate gradient: the
// sum in the order scaleDotF32AVX2 documents), at every row width around
// the vector width, with two pairs and an odd slot (K = 5), dropped slots,
// pad rows, gates and none.
func TestFloat32LoopsMatchPortable(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	const n, k, e, capa = 40, 5, 5, 30
	ids := make([]int32, n*k)
	for i := range ids {
		ids[i] = int32(rng.IntN(e+1)) - 1 // some slots unrouted
	}
	var r Routing
	must(t, PlanRouting(&r, ids, k, e, capa)) // some slots dropped, some rows pad
	for _, d := range []int{1, 7, 8, 9, 15, 16, 17, 31, 64, 257} {
		// Values of 60 binades, whose float64 sums round differently in
		// almost any other order: a lane or accumulator mixed up shows.
		wide := func(m int) []float32 {
			v := make([]float32, m)
			for i := range v {
				v[i] = float32(math.Ldexp(rng.NormFloat64(), rng.IntN(60)-30))
			}
			return v
		}
		packed, dout, gates := wide(r.Rows()*d), wide(n*d), wide(n*k)
		for _, g := range [][]float32{gates, nil} {
			src := packedRows[float32]{flat: packed, d: d}
			want, got := make([]float32, n*d), make([]float32, n*d)
			unpermuteGo(want, src, g, d, &r)
			unpermuteF32(got, src, g, d, &r)
			for i := range want {
				if math.Float32bits(got[i]) != math.Float32bits(want[i]) {
					t.Fatalf("Unpermute d=%d gates=%v: [%d] = %v, portable %v", d, g != nil, i, got[i], want[i])
				}
			}
			// Pad rows are cleared: start from values.
			wantRows, gotRows, gotRowsOnly := wide(r.Rows()*d), wide(r.Rows()*d), wide(r.Rows()*d)
			gotDg := make([]float32, n*k)
			unpermuteBackwardGo(1, wantRows, nil, dout, packed, g, r.RowSlot, k, d)
			unpermuteBackwardF32(1, gotRows, gotDg, dout, packed, g, r.RowSlot, k, d)
			unpermuteBackwardF32(1, gotRowsOnly, nil, dout, packed, g, r.RowSlot, k, d)
			for i := range wantRows {
				if math.Float32bits(gotRows[i]) != math.Float32bits(wantRows[i]) || math.Float32bits(gotRowsOnly[i]) != math.Float32bits(wantRows[i]) {
					t.Fatalf("UnpermuteBackward d=%d gates=%v: row value [%d] = %v (%v without the gate gradient), portable %v", d, g != nil, i, gotRows[i], gotRowsOnly[i], wantRows[i])
				}
			}
			for p, s := range r.RowSlot {
				if s < 0 {
					continue
				}
				t0 := int(s) / k
				want := float32(scaleDotOrder(dout[t0*d:t0*d+d], packed[p*d:p*d+d]))
				if math.Float32bits(gotDg[s]) != math.Float32bits(want) {
					t.Fatalf("UnpermuteBackward d=%d: gate gradient of slot %d = %v, want %v in the kernel's order", d, s, gotDg[s], want)
				}
			}
		}
	}
}
