package cuda

import (
	"fmt"
	"math/rand/v2"
	"os"
	"testing"
	"time"

	"github.com/b7ea7098/loom/kernels"
)

// GPU tests. They skip, saying why, where no CUDA driver, NVRTC or device
// is found; with LOOM_CUDA_REQUIRE=1 (as scripts/gpu_check.sh sets) they
// fail instead. TestGPUBandwidth also needs LOOM_CUDA_BENCH=1.

// requireEnv makes the GPU tests fail rather than skip when no GPU is
// usable.
const requireEnv = "LOOM_CUDA_REQUIRE"

// gpu opens device 0 and compiles the kernels, or skips (fails under
// LOOM_CUDA_REQUIRE=1). Everything is released when the test ends.
func gpu(t *testing.T) (*Context, *MoE) {
	t.Helper()
	unusable := func(format string, args ...any) {
		t.Helper()
		msg := fmt.Sprintf(format, args...)
		if os.Getenv(requireEnv) == "1" {
			t.Fatalf("%s (%s=1)", msg, requireEnv)
		}
		t.Skip(msg)
	}
	l, err := Load()
	if err != nil {
		unusable("no usable CUDA: %v", err)
	}
	t.Cleanup(func() { _ = l.Close() })
	n, err := l.DeviceCount()
	if err != nil || n == 0 {
		unusable("no CUDA device (count %d, %v)", n, err)
	}
	c, err := l.Open(0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := c.Close(); err != nil {
			t.Error(err)
		}
	})
	m, err := NewMoE(c)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := m.Close(); err != nil {
			t.Error(err)
		}
	})
	maj, min := c.ComputeCapability()
	dv, _ := l.DriverVersion()
	rma, rmi, _ := l.NVRTCVersion()
	t.Logf("device 0: %s, sm_%d%d, %d SMs; driver %d (%s); NVRTC %d.%d (%s); compiled with %q (PTX %v)",
		c.Name(), maj, min, c.Multiprocessors(), dv, l.DriverPath(), rma, rmi, l.NVRTCPath(), m.Program().Options, m.Program().PTX)
	if log := m.Program().Log; log != "" {
		t.Logf("NVRTC log:\n%s", log)
	}
	return c, m
}

// TestGPUPermuteMatchesCPU checks every kernel on the GPU against package
// kernels on random data, including shapes with millions of elements.
func TestGPUPermuteMatchesCPU(t *testing.T) {
	c, m := gpu(t)
	checkMoE(t, c, m, true)
}

// TestGPUBandwidth times each kernel with CUDA events and reports GB/s
// (bytes the kernel must read and write over its device time) next to a
// cuMemcpyDtoD of the same bytes, and their ratio. It checks the
// kernels' last output against the CPU.
func TestGPUBandwidth(t *testing.T) {
	if os.Getenv("LOOM_CUDA_BENCH") != "1" {
		t.Skip("set LOOM_CUDA_BENCH=1 to measure GPU bandwidth")
	}
	c, m := gpu(t)
	const reps = 20
	rng := rand.New(rand.NewPCG(1, 2))
	// timeIt returns the mean device time of reps calls of f, after one
	// warm-up call.
	timeIt := func(f func() error) time.Duration {
		t.Helper()
		must(t, f())
		d, err := c.Legacy().Time(func() error {
			for range reps {
				if err := f(); err != nil {
					return err
				}
			}
			return nil
		})
		must(t, err)
		return d / reps
	}
	for _, s := range []struct{ n, k, e, d int }{
		{4096, 2, 8, 1024},
		{16384, 2, 64, 4096},
		{4096, 8, 64, 7168},
		{65536, 2, 64, 64},
	} {
		ids := make([]int32, s.n*s.k)
		for i := range ids {
			ids[i] = int32(rng.IntN(s.e))
		}
		var r kernels.Routing
		must(t, kernels.PlanRouting(&r, ids, s.k, s.e, 0))
		dr, err := m.Upload(&r)
		must(t, err)
		rows, d := r.Rows(), s.d
		x := randVec[float32](rng, s.n*d)
		dx, dgates := dev(t, c, x), dev(t, c, randVec[float32](rng, s.n*s.k))
		packed, dpacked := devGarbage[float32](t, c, rows*d), devGarbage[float32](t, c, rows*d)
		out, dg := devGarbage[float32](t, c, s.n*d), devGarbage[float32](t, c, s.n*s.k)
		// Copy buffers for the largest move (UnpermuteBackward, 4·rows·d).
		scratchA, scratchB := devGarbage[float32](t, c, 2*rows*d), devGarbage[float32](t, c, 2*rows*d)
		ranks, local := 8, s.e/8
		counts := make([]int, ranks*local)
		for i := range counts {
			counts[i] = rows / len(counts)
		}
		counts[0] += rows - rows/len(counts)*len(counts)
		idx, err := GroupIndex(counts, ranks, local, true)
		must(t, err)
		rm, err := m.UploadRowMap(idx, rows)
		must(t, err)

		const f32 = 4
		report := func(name string, bytes int, f func() error) {
			kt := timeIt(f)
			ct := timeIt(func() error { return c.CopyDtoD(scratchB, scratchA, bytes/2) })
			kgb := float64(bytes) / kt.Seconds() / 1e9
			cgb := float64(bytes) / ct.Seconds() / 1e9
			t.Logf("n=%d k=%d e=%d d=%d %-18s %8.3f ms %8.1f GB/s   DtoD %8.3f ms %8.1f GB/s   ratio %.2f",
				s.n, s.k, s.e, s.d, name, kt.Seconds()*1e3, kgb, ct.Seconds()*1e3, cgb, kgb/cgb)
		}
		report("Permute", 2*rows*d*f32, func() error { return m.Permute(Float32, packed, dx, d, dr) })
		report("Unpermute", (rows+s.n)*d*f32, func() error { return m.Unpermute(Float32, out, packed, dgates, d, dr) })
		report("UnpermuteBackward", 4*rows*d*f32, func() error {
			return m.UnpermuteBackward(Float32, dpacked, dg, out, packed, dgates, d, dr)
		})
		report("Gather(regroup)", 2*rows*d*f32, func() error { return m.Gather(dpacked, packed, d*f32, rm) })

		// The timed kernels computed the right thing.
		want := make([]float32, rows*d)
		must(t, kernels.Permute(want, x, d, &r))
		sameVec(t, "Permute after timing", host[float32](t, c, packed, rows*d), want, 0)
		must(t, rm.Free())
		must(t, dr.Free())
	}
}

// TestGPUStreamsAndCache checks on a real GPU what the fake models: work
// ordered across two non-blocking streams by an event, timing events,
// MemInfo, and a kernel compiled into a fresh on-disk cache read back by
// a second Lib.
func TestGPUStreamsAndCache(t *testing.T) {
	c, _ := gpu(t)
	a, err := c.NewStream()
	must(t, err)
	defer func() { must(t, a.Close()) }()
	b, err := c.NewStream()
	must(t, err)
	defer func() { must(t, b.Close()) }()
	e, err := c.NewEvent(true)
	must(t, err)
	defer func() { must(t, e.Close()) }()
	start, err := c.NewEvent(true)
	must(t, err)
	defer func() { must(t, start.Close()) }()
	const n = 64 << 20 // words: long enough that an unordered copy would see it half done
	src := devGarbage[float32](t, c, n)
	dst := devGarbage[float32](t, c, n)
	must(t, start.Record(a))
	must(t, a.Memset32(src, 0x3f800000, n)) // 1.0f
	must(t, e.Record(a))
	must(t, b.WaitEvent(e))
	must(t, b.Copy(dst, src, 4*n))
	must(t, b.Synchronize())
	got := make([]float32, n)
	must(t, CopyFromDeviceAsync(b, got, dst))
	for i, v := range got {
		if v != 1 {
			t.Fatalf("dst[%d] = %v after b waited for a's fill", i, v)
		}
	}
	d, err := e.Since(start)
	must(t, err)
	free, total, err := c.MemInfo()
	must(t, err)
	if d <= 0 || free <= 0 || total != c.TotalMemory() {
		t.Errorf("fill took %v; MemInfo %d free of %d (TotalMemory %d)", d, free, total, c.TotalMemory())
	}
	t.Logf("a %d MiB fill took %v; %d of %d MiB free", 4*n>>20, d, free>>20, total>>20)

	dir := t.TempDir()
	for i, want := range []bool{false, true} {
		l, err := Load(WithKernelCache(dir))
		must(t, err)
		p, err := l.Compile(Source(), "loom_permute.cu", CompileOptions{Arch: 80})
		must(t, err)
		must(t, l.Close())
		if p.Cached != want || p.CacheErr != nil {
			t.Errorf("compile %d: Cached %v, CacheErr %v; want Cached %v", i, p.Cached, p.CacheErr, want)
		}
	}
}
