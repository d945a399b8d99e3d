package kernels

import (
	"fmt"
	"math/rand/v2"
	"testing"
	"time"
)

// The permute benchmarks report GB/s, the bytes a kernel must read and
// write (row data only; the int32 row maps are not counted) over its time,
// and x-copy, that rate over the rate of a plain copy() of the same number
// of bytes timed in the same run (best of a few repetitions). x-copy near 1
// means the kernel moves rows as fast as memmove; the shapes are
// MoE-layer-like: n tokens of width d, top-k routing over e experts.

type permBenchShape struct {
	n, k, e, d int
}

func (s permBenchShape) String() string {
	return fmt.Sprintf("n=%d/k=%d/e=%d/d=%d", s.n, s.k, s.e, s.d)
}

var permBenchShapes = []permBenchShape{
	{n: 1024, k: 2, e: 8, d: 128},   // 1 MiB of tokens: fits in cache
	{n: 16384, k: 2, e: 64, d: 64},  // short rows, many experts
	{n: 4096, k: 2, e: 8, d: 1024},  // 16 MiB of tokens, 32 MiB packed
	{n: 1024, k: 8, e: 64, d: 2048}, // DeepSeek-like top-8, 64 MiB packed
}

// permBenchMoves runs f as the benchmark body, moving bytes bytes per
// call, and after every call (with the timer stopped) one copy() of the
// same bytes between src and dst, so that both see the same machine load;
// it reports the kernel's GB/s, the copy's (copy-GB/s) and their ratio
// (x-copy).
func permBenchMoves(b *testing.B, bytes int, dst, src []float32, f func() error) {
	dst, src = dst[:bytes/8], src[:bytes/8]
	var copyTime time.Duration
	b.SetBytes(int64(bytes))
	for b.Loop() {
		if err := f(); err != nil {
			b.Fatal(err)
		}
		b.StopTimer()
		t0 := time.Now()
		copy(dst, src)
		copyTime += time.Since(t0)
		b.StartTimer()
	}
	gbs := float64(bytes) * float64(b.N) / b.Elapsed().Seconds() / 1e9
	cgbs := float64(bytes) * float64(b.N) / copyTime.Seconds() / 1e9
	b.ReportMetric(gbs, "GB/s")
	b.ReportMetric(cgbs, "copy-GB/s")
	b.ReportMetric(gbs/cgbs, "x-copy")
}

func BenchmarkPermute(b *testing.B) {
	rng := rand.New(rand.NewPCG(1, 2))
	for _, s := range permBenchShapes {
		ids := make([]int32, s.n*s.k)
		for i := range ids {
			ids[i] = int32(rng.IntN(s.e))
		}
		var r Routing
		if err := PlanRouting(&r, ids, s.k, s.e, 0); err != nil {
			b.Fatal(err)
		}
		m, d := r.Rows(), s.d
		x := permRand[float32](rng, s.n*d)
		packed := permRand[float32](rng, m*d)
		gates := permRand[float32](rng, s.n*s.k)
		out := make([]float32, s.n*d)
		dpacked, dgates := make([]float32, m*d), make([]float32, s.n*s.k)
		const f32 = 4
		// Copy buffers for the largest move (UnpermuteBackward: 4·m·d).
		csrc, cdst := permRand[float32](rng, 2*m*d), make([]float32, 2*m*d)
		run := func(name string, bytes int, f func() error) {
			b.Run(s.String()+"/"+name, func(b *testing.B) { permBenchMoves(b, bytes, cdst, csrc, f) })
		}
		b.Run(s.String()+"/PlanRouting", func(b *testing.B) {
			for b.Loop() {
				if err := PlanRouting(&r, ids, s.k, s.e, 0); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(len(ids)), "ns/slot")
		})
		run("Permute", 2*m*d*f32, func() error { return Permute(packed, x, d, &r) })
		run("Unpermute", (m+s.n)*d*f32, func() error { return Unpermute(out, packed, gates, d, &r) })
		segs := make([][]float32, s.e)
		for e := range segs {
			segs[e] = packed[r.Offsets[e]*d : r.Offsets[e+1]*d]
		}
		run("UnpermuteSegments", (m+s.n)*d*f32, func() error { return UnpermuteSegments(out, segs, gates, d, &r) })
		run("UnpermuteBackward", 4*m*d*f32, func() error { return UnpermuteBackward(dpacked, dgates, out, packed, gates, d, &r) })
		// Expert-parallel unpack over 8 ranks with e/8 local experts each:
		// the packed buffer seen as received rank-major chunks.
		ranks, local := 8, s.e/8
		counts := make([]int, ranks*local)
		for i := range counts {
			counts[i] = m / len(counts)
		}
		counts[0] += m - m/len(counts)*len(counts)
		run("GroupByExpert", 2*m*d*f32, func() error { return GroupByExpert(dpacked, packed, d, counts, ranks, local) })
	}
}

// BenchmarkPermuteWorkers measures whether splitting Permute's rows over
// two goroutines pays, which sets permMinBytesPerWorker.
func BenchmarkPermuteWorkers(b *testing.B) {
	rng := rand.New(rand.NewPCG(3, 4))
	for _, s := range []permBenchShape{
		{n: 256, k: 2, e: 8, d: 256},   // 512 KiB moved
		{n: 1024, k: 2, e: 8, d: 256},  // 2 MiB
		{n: 2048, k: 2, e: 8, d: 256},  // 4 MiB
		{n: 4096, k: 2, e: 8, d: 256},  // 8 MiB
		{n: 4096, k: 2, e: 8, d: 1024}, // 32 MiB
	} {
		ids := make([]int32, s.n*s.k)
		for i := range ids {
			ids[i] = int32(rng.IntN(s.e))
		}
		var r Routing
		if err := PlanRouting(&r, ids, s.k, s.e, 0); err != nil {
			b.Fatal(err)
		}
		m, d := r.Rows(), s.d
		x, packed := permRand[float32](rng, s.n*d), make([]float32, m*d)
		bytes := 2 * m * d * 4
		for _, w := range []int{1, 2} {
			b.Run(fmt.Sprintf("%v/workers=%d", s, w), func(b *testing.B) {
				b.SetBytes(int64(bytes))
				for b.Loop() {
					permForRows(Workers(w), m, 2*d*4+permMinBytesPerWorker, func(lo, hi int) {
						gatherRange(packed, x, r.RowSlot, s.k, d, lo, hi)
					})
				}
			})
		}
	}
}
