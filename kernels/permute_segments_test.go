package kernels

import (
	"bytes"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"testing"
	"unsafe"
)

// The segmented kernels are checked bit for bit against the flat ones they
// claim to equal: PermuteExpert over every expert against Permute,
// UnpermuteBackwardExpert over every expert against UnpermuteBackward, and
// UnpermuteSegments on per-expert copies of a packed buffer against
// Unpermute on the buffer itself.
// Buffers start as NaN, and every separately allocated slice carries NaN
// past its length (within its capacity), so that a row left unwritten, a
// write past a slice's end or a read from the wrong segment shows.

// segCases are permCases plus routings whose empty experts sit at the
// start, in the middle and at the end of the expert range (the segmented
// row lookup skips empty experts with sort.SearchInts over Offsets).
func segCases() []permCase {
	// E = 7: experts 0, 3, 5 and 6 get nothing; token 3 picks expert 4 twice.
	emptyEnds := []int32{1, 2, 4, -1, 2, 1, 4, 4, 1, 2, 2, -1, 4, 1}
	// E = 8: runs of two empty experts at the start, middle and end.
	emptyRuns := []int32{2, 5, 5, 2, -1, 2, 5, 5, 2, 2, 5, -1}
	fill := func(n int, e int32) []int32 {
		ids := make([]int32, n)
		for i := range ids {
			ids[i] = e
		}
		return ids
	}
	onlyMiddle := fill(12, 2)
	onlyMiddle[3], onlyMiddle[8] = -1, -1
	kIsE := make([]int32, 6*3)
	for t := range 6 {
		for j := range 3 {
			kIsE[t*3+j] = int32((2*t + j) % 3)
		}
	}
	return append(permCases(),
		permCase{name: "empty-start-middle-end", n: 7, k: 2, e: 7, d: 5, experts: emptyEnds},
		permCase{name: "empty-start-middle-end-d1", n: 7, k: 2, e: 7, d: 1, experts: emptyEnds},
		permCase{name: "empty-start-middle-end-d0", n: 7, k: 2, e: 7, d: 0, experts: emptyEnds},
		permCase{name: "empty-start-middle-end-k1", n: 14, k: 1, e: 7, d: 3, experts: emptyEnds},
		permCase{name: "empty-start-middle-end-capacity", n: 7, k: 2, e: 7, capa: 3, d: 4, experts: emptyEnds},
		permCase{name: "empty-runs", n: 6, k: 2, e: 8, d: 6, experts: emptyRuns},
		permCase{name: "empty-runs-capacity", n: 6, k: 2, e: 8, capa: 5, d: 2, experts: emptyRuns},
		permCase{name: "only-first-expert", n: 5, k: 2, e: 4, d: 3, experts: fill(10, 0)},
		permCase{name: "only-last-expert", n: 5, k: 2, e: 4, d: 3, experts: fill(10, 3)},
		permCase{name: "only-middle-expert", n: 6, k: 2, e: 5, d: 5, experts: onlyMiddle},
		permCase{name: "only-middle-expert-capacity", n: 6, k: 2, e: 5, capa: 4, d: 5, experts: onlyMiddle},
		permCase{name: "k-equals-e-capacity", n: 6, k: 3, e: 3, capa: 4, d: 4, experts: kIsE},
		permCase{name: "all-unrouted-capacity", n: 4, k: 2, e: 3, capa: 2, d: 3, dropRate: 1},
		permCase{name: "sparse-many-experts", n: 5, k: 2, e: 16, d: 7, dropRate: 0.2},
		permCase{name: "sparse-many-experts-capacity", n: 9, k: 3, e: 16, capa: 1, d: 5, dropRate: 0.2},
	)
}

// segCoverage records which kinds of routing a table test met, so that a
// table that loses its empty-expert cases fails instead of passing quietly.
type segCoverage struct {
	emptyFirst, emptyMiddle, emptyLast, pad, dropped, unrouted, noTokens, d0, d1, k1, kIsE bool
}

func (cv *segCoverage) add(r *Routing, d int) {
	e := r.Experts
	for x := range e {
		if r.Offsets[x] != r.Offsets[x+1] {
			continue
		}
		switch {
		case x == 0:
			cv.emptyFirst = true
		case x == e-1:
			cv.emptyLast = true
		case r.Offsets[x] > 0 && r.Offsets[x] < r.Rows():
			cv.emptyMiddle = true
		}
	}
	cv.pad = cv.pad || r.Padded > 0
	cv.dropped = cv.dropped || r.Dropped > 0
	cv.unrouted = cv.unrouted || r.Unrouted > 0
	cv.noTokens = cv.noTokens || r.Tokens == 0
	cv.d0 = cv.d0 || d == 0
	cv.d1 = cv.d1 || d == 1
	cv.k1 = cv.k1 || r.TopK == 1
	cv.kIsE = cv.kIsE || r.TopK == r.Experts
}

func (cv segCoverage) check(t *testing.T) {
	t.Helper()
	if !(cv.emptyFirst && cv.emptyMiddle && cv.emptyLast && cv.pad && cv.dropped && cv.unrouted &&
		cv.noTokens && cv.d0 && cv.d1 && cv.k1 && cv.kIsE) {
		t.Fatalf("the case table misses a kind of routing: %+v", cv)
	}
}

// segPlan plans case c.
func segPlan(t *testing.T, rng *rand.Rand, c permCase) *Routing {
	t.Helper()
	var r Routing
	must(t, PlanRouting(&r, c.permExperts(rng), c.k, c.e, c.capa))
	return &r
}

// forSegTypes runs f for float32 and float64 on every case of segCases.
func forSegTypes(t *testing.T, f32, f64 func(t *testing.T, rng *rand.Rand, r *Routing, d int)) {
	for _, typ := range []struct {
		name string
		f    func(t *testing.T, rng *rand.Rand, r *Routing, d int)
	}{{"float32", f32}, {"float64", f64}} {
		t.Run(typ.name, func(t *testing.T) {
			rng := rand.New(rand.NewPCG(11, 12))
			var cv segCoverage
			for _, c := range segCases() {
				t.Run(c.name, func(t *testing.T) {
					r := segPlan(t, rng, c)
					cv.add(r, c.d)
					typ.f(t, rng, r, c.d)
				})
			}
			cv.check(t)
		})
	}
}

func segNaN[T Float]() T { return T(math.NaN()) }

func segBits[T Float](v T) uint64 {
	if sizeOf[T]() == 4 {
		return uint64(math.Float32bits(float32(v)))
	}
	return math.Float64bits(float64(v))
}

// segNaNs returns n NaNs.
func segNaNs[T Float](n int) []T {
	s := make([]T, n)
	if n > 0 {
		s[0] = segNaN[T]()
	}
	for f := 1; f < n; f *= 2 { // by copy(): cheap under -race
		copy(s[f:], s[:f])
	}
	return s
}

// segBytes is s's memory.
func segBytes[T Float](s []T) []byte {
	return unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(s))), len(s)*sizeOf[T]())
}

// segAlloc returns a separately allocated slice of n NaNs whose capacity
// holds d+1 more NaNs.
func segAlloc[T Float](n, d int) []T {
	return segNaNs[T](n + d + 1)[:n]
}

// segTailIntact reports whether s's spare capacity still holds only NaN.
func segTailIntact[T Float](s []T) bool {
	for _, v := range s[len(s):cap(s)] {
		if v == v {
			return false
		}
	}
	return true
}

// segDiff returns the first index where got and want differ in their bits,
// or −1.
func segDiff[T Float](got, want []T) int {
	if len(got) != len(want) {
		return min(len(got), len(want))
	}
	if bytes.Equal(segBytes(got), segBytes(want)) {
		return -1
	}
	for i := range got {
		if segBits(got[i]) != segBits(want[i]) {
			return i
		}
	}
	return -1
}

func segEqual[T Float](t *testing.T, what string, got, want []T) {
	t.Helper()
	if i := segDiff(got, want); i >= 0 {
		if i < len(got) && i < len(want) {
			t.Fatalf("%s: [%d] = %v, want %v (len %d)", what, i, got[i], want[i], len(want))
		}
		t.Fatalf("%s: len %d, want %d", what, len(got), len(want))
	}
}

// segPacked returns random packed rows with NaN in every pad row: the
// combine must never read a pad row.
func segPacked[T Float](rng *rand.Rand, r *Routing, d int) []T {
	packed := permRand[T](rng, r.Rows()*d)
	for p, s := range r.RowSlot {
		if s < 0 {
			copy(packed[p*d:p*d+d], segNaNs[T](d))
		}
	}
	return packed
}

// segCopies copies each expert's rows of packed into a slice of its own
// (from segAlloc: NaN past its end), so that no segment can be reached
// from another.
func segCopies[T Float](packed []T, d int, r *Routing) [][]T {
	segs := make([][]T, r.Experts)
	for e := range segs {
		lo, hi := r.Offsets[e]*d, r.Offsets[e+1]*d
		segs[e] = segAlloc[T](hi-lo, d)
		copy(segs[e], packed[lo:hi])
	}
	return segs
}

// segViews cuts packed into per-expert views sharing its storage, the
// zero-copy use.
func segViews[T Float](packed []T, d int, r *Routing) [][]T {
	segs := make([][]T, r.Experts)
	for e := range segs {
		segs[e] = packed[r.Offsets[e]*d : r.Offsets[e+1]*d]
	}
	return segs
}

func segClone[T Float](segs [][]T) [][]T {
	c := make([][]T, len(segs))
	for e, s := range segs {
		c[e] = slices.Clone(s)
	}
	return c
}

// permuteExperts calls PermuteExpert for every expert, in a random order,
// each into a separately allocated out (nil for every other empty expert),
// and returns the outputs concatenated.
func permuteExperts[T Float](t *testing.T, rng *rand.Rand, x []T, d int, r *Routing) []T {
	t.Helper()
	outs := make([][]T, r.Experts)
	for _, e := range rng.Perm(r.Experts) {
		rows := r.Offsets[e+1] - r.Offsets[e]
		if rows == 0 && e%2 == 0 {
			outs[e] = nil
		} else {
			outs[e] = segAlloc[T](rows*d, d)
		}
		if err := PermuteExpert(outs[e], x, d, r, e); err != nil {
			t.Fatalf("PermuteExpert(expert %d): %v", e, err)
		}
		if outs[e] != nil && !segTailIntact(outs[e]) {
			t.Fatalf("PermuteExpert(expert %d) wrote past len(out)", e)
		}
	}
	return slices.Concat(outs...)
}

// checkPermuteExpert: PermuteExpert over every expert is Permute (and the
// reference), pad rows zero.
func checkPermuteExpert[T Float](t *testing.T, rng *rand.Rand, r *Routing, d int) {
	x := permRand[T](rng, r.Tokens*d)
	xc := slices.Clone(x)
	want := segNaNs[T](r.Rows() * d)
	must(t, Permute(want, x, d, r))
	segEqual(t, "Permute against the reference", want, refPermute(x, d, r.RowSlot, r.TopK))
	got := permuteExperts(t, rng, x, d, r)
	segEqual(t, "PermuteExpert against Permute", got, want)
	segEqual(t, "x after PermuteExpert", x, xc)
}

// checkUnpermuteBackwardExpert: UnpermuteBackwardExpert over every expert,
// in a random order, each expert's rows in buffers of their own, is
// UnpermuteBackward bit for bit: dpacked alone, dgates alone and both,
// with and without gates. Pad rows are zero, and the dgates of slots
// without a row are left as they were.
func checkUnpermuteBackwardExpert[T Float](t *testing.T, rng *rand.Rand, r *Routing, d int) {
	packed := segPacked[T](rng, r, d)
	dout := permRand[T](rng, r.Tokens*d)
	gates := permRand[T](rng, r.Tokens*r.TopK)
	if len(gates) > 0 {
		gates[0] = T(math.Copysign(0, -1)) // a gate of −0: signed zeros, bit for bit
		gates[len(gates)-1] = 0
	}
	dc, gc := slices.Clone(dout), slices.Clone(gates)
	for _, g := range [][]T{nil, gates} {
		for _, want := range []struct{ rows, grads bool }{{true, false}, {false, true}, {true, true}} {
			var wantRows, wantGrads []T
			if want.rows {
				wantRows = segNaNs[T](r.Rows() * d)
			}
			if want.grads {
				wantGrads = segNaNs[T](r.Tokens * r.TopK)
			}
			must(t, UnpermuteBackward(wantRows, wantGrads, dout, packed, g, d, r))
			segs := segCopies(packed, d, r)
			before := segClone(segs)
			rows := make([][]T, r.Experts)
			var grads []T
			if want.grads {
				grads = segAlloc[T](r.Tokens*r.TopK, 1)
			}
			for _, e := range rng.Perm(r.Experts) {
				var seg []T
				if want.rows {
					rows[e] = segAlloc[T]((r.Offsets[e+1]-r.Offsets[e])*d, d)
				}
				if want.grads {
					seg = segs[e]
				}
				if err := UnpermuteBackwardExpert(rows[e], grads, dout, seg, g, d, r, e); err != nil {
					t.Fatalf("UnpermuteBackwardExpert(expert %d): %v", e, err)
				}
				if rows[e] != nil && !segTailIntact(rows[e]) {
					t.Fatalf("UnpermuteBackwardExpert(expert %d) wrote past len(dpacked)", e)
				}
			}
			what := fmt.Sprintf("UnpermuteBackwardExpert (gates %v, rows %v, grads %v)", g != nil, want.rows, want.grads)
			if want.rows {
				got := slices.Concat(rows...)
				segEqual(t, what+": dpacked against UnpermuteBackward's", got, wantRows)
				for p, s := range r.RowSlot {
					if s < 0 && slices.ContainsFunc(got[p*d:p*d+d], func(v T) bool { return segBits(v) != 0 }) {
						t.Fatalf("%s: pad row %d = %v, want +0", what, p, got[p*d:p*d+d])
					}
				}
			}
			if want.grads {
				if !segTailIntact(grads) {
					t.Fatalf("%s wrote past len(dgates)", what)
				}
				for s, p := range r.SlotRow {
					if p < 0 {
						if segBits(wantGrads[s]) != 0 {
							t.Fatalf("UnpermuteBackward: dgates[%d] of a slot without a row = %v, want +0", s, wantGrads[s])
						}
						if grads[s] == grads[s] {
							t.Fatalf("%s: dgates[%d] of a slot without a row = %v, want it left alone", what, s, grads[s])
						}
						grads[s] = wantGrads[s]
					}
				}
				segEqual(t, what+": dgates against UnpermuteBackward's", grads, wantGrads)
			}
			for e := range before {
				segEqual(t, what+": segment after the call", segs[e], before[e])
			}
		}
	}
	segEqual(t, "dout after UnpermuteBackwardExpert", dout, dc)
	segEqual(t, "gates after UnpermuteBackwardExpert", gates, gc)
}

// checkUnpermuteSegments: UnpermuteSegments on copied (and on aliased)
// segments is Unpermute on the packed buffer, with and without gates.
func checkUnpermuteSegments[T Float](t *testing.T, rng *rand.Rand, r *Routing, d int) {
	packed := segPacked[T](rng, r, d)
	gates := permRand[T](rng, r.Tokens*r.TopK)
	for _, g := range [][]T{nil, gates} {
		want := segNaNs[T](r.Tokens * d)
		must(t, Unpermute(want, packed, g, d, r))
		if slices.ContainsFunc(want, func(v T) bool { return v != v }) {
			t.Fatalf("Unpermute (gates %v) read a pad row: %v", g != nil, want)
		}
		for _, cut := range []struct {
			name string
			segs [][]T
		}{{"copied", segCopies(packed, d, r)}, {"views", segViews(packed, d, r)}} {
			before := segClone(cut.segs)
			got := segAlloc[T](r.Tokens*d, d)
			must(t, UnpermuteSegments(got, cut.segs, g, d, r))
			segEqual(t, "UnpermuteSegments ("+cut.name+" segments) against Unpermute", got, want)
			if !segTailIntact(got) {
				t.Fatalf("UnpermuteSegments (%s segments) wrote past len(out)", cut.name)
			}
			for e := range before {
				segEqual(t, "segment after UnpermuteSegments", cut.segs[e], before[e])
			}
		}
	}
}

func TestPermuteExpertMatchesPermute(t *testing.T) {
	forSegTypes(t, checkPermuteExpert[float32], checkPermuteExpert[float64])
}

func TestUnpermuteBackwardExpertMatchesUnpermuteBackward(t *testing.T) {
	forSegTypes(t, checkUnpermuteBackwardExpert[float32], checkUnpermuteBackwardExpert[float64])
}

func TestUnpermuteSegmentsMatchesUnpermute(t *testing.T) {
	forSegTypes(t, checkUnpermuteSegments[float32], checkUnpermuteSegments[float64])
}

// segWorkers is the number of goroutines permForRows uses for rows rows of
// rowBytes bytes under the bound w.
func segWorkers(w Workers, rows, rowBytes int) int {
	if rows <= 1 || rowBytes <= 0 {
		return 1
	}
	return min(w.Count(), rows, rows*rowBytes/permMinBytesPerWorker)
}

// TestSegmentKernelsParallel runs every segmented kernel on routings large
// enough that permForRows splits its rows over goroutines (checked), with
// an empty expert, unrouted slots, and static capacities that pad and that
// drop.
func TestSegmentKernelsParallel(t *testing.T) {
	if testing.Short() {
		t.Skip("moves tens of MiB")
	}

	const n, k, e = 4096, 2, 4
	rng := rand.New(rand.NewPCG(13, 14))
	ids := make([]int32, n*k)
	for i := range ids {
		switch {
		case rng.IntN(100) == 0:
			ids[i] = -1
		default:
			ids[i] = []int32{0, 2, 3}[rng.IntN(3)] // expert 1 gets nothing
		}
	}
	for _, capa := range []int{0, 3300, 2200} { // dropless, padded, dropping
		// 4 goroutines even on a small machine, so that ranges have uneven
		// bounds; PlanRouting keeps the bound.
		r := Routing{Workers: 4}
		must(t, PlanRouting(&r, ids, k, e, capa))
		if r.Workers != 4 {
			t.Fatalf("PlanRouting reset Workers to %d", r.Workers)
		}
		if capa == 3300 && (r.Padded == 0 || r.Dropped != 0) || capa == 2200 && r.Dropped == 0 {
			t.Fatalf("capacity %d: %d padded, %d dropped", capa, r.Padded, r.Dropped)
		}
		for _, typ := range []struct {
			name  string
			d     int
			size  int
			check func(t *testing.T, rng *rand.Rand, r *Routing, d int)
		}{
			{"float32", 256, 4, func(t *testing.T, rng *rand.Rand, r *Routing, d int) {
				checkPermuteExpert[float32](t, rng, r, d)
				checkUnpermuteBackwardExpert[float32](t, rng, r, d)
				checkUnpermuteSegments[float32](t, rng, r, d)
			}},
			{"float64", 128, 8, func(t *testing.T, rng *rand.Rand, r *Routing, d int) {
				checkPermuteExpert[float64](t, rng, r, d)
				checkUnpermuteBackwardExpert[float64](t, rng, r, d)
				checkUnpermuteSegments[float64](t, rng, r, d)
			}},
		} {
			t.Run(typ.name+"/capacity-"+strconv.Itoa(capa), func(t *testing.T) {
				d, sz := typ.d, typ.size
				if w := segWorkers(r.Workers, r.Offsets[1]-r.Offsets[0], 2*d*sz); w < 2 {
					t.Fatalf("PermuteExpert(expert 0) would run on %d goroutine(s)", w)
				}
				if w := segWorkers(r.Workers, r.Tokens, (k+1)*d*sz); w < 2 {
					t.Fatalf("UnpermuteSegments would run on %d goroutine(s)", w)
				}
				if w := segWorkers(r.Workers, r.Offsets[1]-r.Offsets[0], 3*d*sz); w < 2 {
					t.Fatalf("UnpermuteBackwardExpert(expert 0) would run on %d goroutine(s)", w)
				}
				typ.check(t, rng, &r, d)
			})
		}
	}
}

// TestSegmentKernelsErrors checks that every bad argument is an error
// naming it, with every output left untouched, and that a Routing changed
// by hand is an error, not a panic.
func TestSegmentKernelsErrors(t *testing.T) {
	var r Routing
	// 3 tokens, K = 2, E = 3: expert 0 owns rows 0-2 (slots 0, 4, 5),
	// expert 1 none, expert 2 rows 3-4 (slots 1, 2); slot 3 is unrouted.
	must(t, PlanRouting(&r, []int32{0, 2, 2, -1, 0, 0}, 2, 3, 0))
	if !slices.Equal(r.Offsets, []int{0, 3, 3, 5}) {
		t.Fatalf("Offsets = %v", r.Offsets)
	}
	const d = 2
	const sentinel = 7
	fill := func(n int) []float32 {
		s := make([]float32, n)
		for i := range s {
			s[i] = sentinel
		}
		return s
	}
	x, gates := permRand[float32](rand.New(rand.NewPCG(15, 16)), 3*d), fill(6)
	segs := func() [][]float32 { return [][]float32{fill(3 * d), fill(0), fill(2 * d)} }
	cutBad := func(mod func(b *Routing)) *Routing {
		b := r
		b.Offsets, b.RowSlot, b.SlotRow = slices.Clone(r.Offsets), slices.Clone(r.RowSlot), slices.Clone(r.SlotRow)
		mod(&b)
		return &b
	}
	unplanned := &Routing{Tokens: 3, TopK: 2, Experts: 3}

	type call struct {
		name string
		// run calls the kernel on fresh sentinel outputs and returns its
		// error and the outputs (and inputs it must not write).
		run  func() ([][]float32, error)
		want string
	}
	pe := func(out, x []float32, d int, r *Routing, e int) func() ([][]float32, error) {
		return func() ([][]float32, error) { return [][]float32{out}, PermuteExpert(out, x, d, r, e) }
	}
	ube := func(dpacked, dgates, dout, packed, gates []float32, d int, r *Routing, e int) func() ([][]float32, error) {
		return func() ([][]float32, error) {
			return [][]float32{dpacked, dgates, packed}, UnpermuteBackwardExpert(dpacked, dgates, dout, packed, gates, d, r, e)
		}
	}
	us := func(out []float32, segs [][]float32, gates []float32, d int, r *Routing) func() ([][]float32, error) {
		return func() ([][]float32, error) {
			return append([][]float32{out}, segs...), UnpermuteSegments(out, segs, gates, d, r)
		}
	}
	calls := []call{
		// PermuteExpert.
		{"PermuteExpert/expert-minus-one", pe(fill(0), x, d, &r, -1), "expert -1 of 3"},
		{"PermuteExpert/expert-E", pe(fill(0), x, d, &r, 3), "expert 3 of 3"},
		{"PermuteExpert/short-out", pe(fill(5), x, d, &r, 0), "len(out) = 5, want 3 rows × 2 = 6"},
		{"PermuteExpert/long-out", pe(fill(8), x, d, &r, 2), "len(out) = 8, want 2 rows × 2 = 4"},
		{"PermuteExpert/out-for-empty-expert", pe(fill(2), x, d, &r, 1), "len(out) = 2, want 0 rows"},
		{"PermuteExpert/short-x", pe(fill(6), x[:5], d, &r, 0), "len(x) = 5, want 3 rows × 2 = 6"},
		{"PermuteExpert/negative-d", pe(fill(6), x, -1, &r, 0), "negative row width -1"},
		{"PermuteExpert/unplanned", pe(fill(6), x, d, unplanned, 0), "not planned"},
		{"PermuteExpert/zero-routing", pe(fill(6), x, d, &Routing{}, 0), "not planned"},
		{"PermuteExpert/nil-routing", pe(fill(6), x, d, nil, 0), "nil Routing"},
		{"PermuteExpert/corrupt-RowSlot-high", pe(fill(6), x, d, cutBad(func(b *Routing) { b.RowSlot[1] = 99 }), 0), "Routing.RowSlot"},
		{"PermuteExpert/corrupt-RowSlot-slots", pe(fill(6), x, d, cutBad(func(b *Routing) { b.RowSlot[2] = 6 }), 0), "Routing.RowSlot"},
		{"PermuteExpert/corrupt-RowSlot-low", pe(fill(4), x, d, cutBad(func(b *Routing) { b.RowSlot[4] = -5 }), 2), "Routing.RowSlot"},
		{"PermuteExpert/corrupt-Offsets-past-rows", pe(fill(6), x, d, cutBad(func(b *Routing) { b.Offsets[1] = 9; b.Offsets[2] = 9 }), 1), "Routing.Offsets"},
		{"PermuteExpert/corrupt-Offsets-descending", pe(fill(0), x, d, cutBad(func(b *Routing) { b.Offsets[1] = 4 }), 1), "Routing.Offsets"},
		{"PermuteExpert/corrupt-Offsets-negative", pe(fill(6), x, d, cutBad(func(b *Routing) { b.Offsets[0] = -1 }), 0), "Routing.Offsets"},

		// UnpermuteSegments.
		{"UnpermuteSegments/too-few-segments", us(fill(6), segs()[:2], nil, d, &r), "2 segments, want one per expert (3)"},
		{"UnpermuteSegments/too-many-segments", us(fill(6), append(segs(), fill(0)), nil, d, &r), "4 segments, want one per expert (3)"},
		{"UnpermuteSegments/nil-segments", us(fill(6), nil, nil, d, &r), "0 segments"},
		{"UnpermuteSegments/short-segment", us(fill(6), [][]float32{fill(6), fill(0), fill(3)}, nil, d, &r), "len(segs[2]) = 3, want 2 rows × 2 = 4"},
		{"UnpermuteSegments/row-in-empty-segment", us(fill(6), [][]float32{fill(6), fill(2), fill(4)}, nil, d, &r), "len(segs[1]) = 2, want 0 rows"},
		{"UnpermuteSegments/swapped-segments", us(fill(6), [][]float32{fill(4), fill(0), fill(6)}, nil, d, &r), "len(segs[0]) = 4"},
		{"UnpermuteSegments/short-out", us(fill(5), segs(), nil, d, &r), "len(out) = 5, want 3 rows × 2 = 6"},
		{"UnpermuteSegments/short-gates", us(fill(6), segs(), gates[:5], d, &r), "len(gates) = 5, want 3 tokens × 2 = 6"},
		{"UnpermuteSegments/negative-d", us(fill(6), segs(), nil, -2, &r), "negative row width -2"},
		{"UnpermuteSegments/unplanned", us(fill(6), segs(), nil, d, unplanned), "not planned"},
		{"UnpermuteSegments/nil-routing", us(fill(6), segs(), nil, d, nil), "nil Routing"},
		{"UnpermuteSegments/corrupt-SlotRow-high", us(fill(6), segs(), nil, d, cutBad(func(b *Routing) { b.SlotRow[1] = 5 })), "Routing.SlotRow"},
		{"UnpermuteSegments/corrupt-SlotRow-low", us(fill(6), segs(), gates, d, cutBad(func(b *Routing) { b.SlotRow[1] = -2 })), "Routing.SlotRow"},
		// Offsets that do not start at 0, with segments that fit them:
		// the row lookup would find no expert for row 0.
		{"UnpermuteSegments/corrupt-Offsets-start", us(fill(6), [][]float32{fill(4), fill(0), fill(4)}, nil, d, cutBad(func(b *Routing) { b.Offsets[0] = 1 })), "Routing.Offsets"},
		{"UnpermuteSegments/corrupt-Offsets-start-d0", us(fill(0), [][]float32{nil, nil, nil}, nil, 0, cutBad(func(b *Routing) { b.Offsets[0] = 1 })), "Routing.Offsets"},
		{"UnpermuteSegments/corrupt-Offsets-descending-d0", us(fill(0), [][]float32{nil, nil, nil}, nil, 0, cutBad(func(b *Routing) { b.Offsets[1] = 4 })), "Routing.Offsets"},

		// UnpermuteBackwardExpert.
		{"UnpermuteBackwardExpert/expert-minus-one", ube(fill(6), fill(6), x, fill(6), nil, d, &r, -1), "expert -1 of 3"},
		{"UnpermuteBackwardExpert/expert-E", ube(fill(4), fill(6), x, fill(4), nil, d, &r, 3), "expert 3 of 3"},
		{"UnpermuteBackwardExpert/short-dpacked", ube(fill(5), nil, x, nil, gates, d, &r, 0), "len(dpacked) = 5, want 3 rows × 2 = 6"},
		{"UnpermuteBackwardExpert/dpacked-for-empty-expert", ube(fill(2), nil, x, nil, nil, d, &r, 1), "len(dpacked) = 2, want 0 rows"},
		{"UnpermuteBackwardExpert/short-dgates", ube(nil, fill(5), x, fill(6), nil, d, &r, 0), "len(dgates) = 5, want 6 rows × 1 = 6"},
		{"UnpermuteBackwardExpert/empty-dgates", ube(nil, []float32{}, x, fill(6), nil, d, &r, 0), "len(dgates) = 0"},
		{"UnpermuteBackwardExpert/long-packed", ube(nil, fill(6), x, fill(8), nil, d, &r, 2), "len(packed) = 8, want 2 rows × 2 = 4"},
		{"UnpermuteBackwardExpert/no-packed", ube(fill(6), fill(6), x, nil, nil, d, &r, 0), "len(packed) = 0, want 3 rows × 2 = 6"},
		{"UnpermuteBackwardExpert/short-dout", ube(fill(6), fill(6), x[:5], fill(6), nil, d, &r, 0), "len(dout) = 5, want 3 rows × 2 = 6"},
		{"UnpermuteBackwardExpert/short-gates", ube(fill(6), nil, x, nil, gates[:5], d, &r, 0), "len(gates) = 5, want 6 rows × 1 = 6"},
		{"UnpermuteBackwardExpert/negative-d", ube(fill(6), fill(6), x, fill(6), nil, -1, &r, 0), "negative row width -1"},
		{"UnpermuteBackwardExpert/unplanned", ube(fill(6), fill(6), x, fill(6), nil, d, unplanned, 0), "not planned"},
		{"UnpermuteBackwardExpert/nil-routing", ube(fill(6), fill(6), x, fill(6), nil, d, nil, 0), "nil Routing"},
		{"UnpermuteBackwardExpert/corrupt-RowSlot", ube(fill(6), fill(6), x, fill(6), nil, d, cutBad(func(b *Routing) { b.RowSlot[0] = 77 }), 0), "Routing.RowSlot"},
		{"UnpermuteBackwardExpert/corrupt-Offsets-past-rows", ube(nil, fill(6), x, fill(14), nil, d, cutBad(func(b *Routing) { b.Offsets[2] = 9 }), 2), "Routing.Offsets"},
	}
	for _, c := range calls {
		t.Run(c.name, func(t *testing.T) {
			var err error
			var bufs [][]float32
			func() {
				defer func() {
					if p := recover(); p != nil {
						t.Fatalf("panic: %v", p)
					}
				}()
				bufs, err = c.run()
			}()
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("err = %v, want it to mention %q", err, c.want)
			}
			for i, b := range bufs {
				for j, v := range b {
					if v != sentinel {
						t.Fatalf("buffer %d changed on error: [%d] = %v", i, j, v)
					}
				}
			}
		})
	}
	// The same Routing still works after the bad calls (they changed
	// nothing in it).
	out := fill(3 * d)
	must(t, PermuteExpert(out, x, d, &r, 0))
	if want := refPermute(x, d, r.RowSlot, 2)[:3*d]; !slices.Equal(out, want) {
		t.Fatalf("PermuteExpert after errors = %v, want %v", out, want)
	}
}
