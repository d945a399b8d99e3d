//go:build linux && (amd64 || arm64)

package cuda

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/b7ea7098/loom"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/device/emu"
	"github.com/b7ea7098/loom/internal/dynlib"
	"github.com/b7ea7098/loom/kernels"
)

// These tests run a whole cuda.Device on one fake library, built here with
// g++: testdata/fakecuda.cpp (the driver and NVRTC) with -DLOOM_FAKE_DEVICE,
// which runs the real kernel sources under testdata/loom_emu.h, linked with
// testdata/fakecublas.cpp, whose GEMMs then run in their stream's order on
// the driver's memory. Every Kernels method is compared with the emulated
// device's (package kernels' CPU code) on small and odd shapes.

// deviceFake is the whole-device fake's test controls.
type deviceFake struct {
	path                                      string
	allocs, ctxRefs, modules, events, streams func() int32
	lastError                                 func() string
	live                                      func(kind string) int64
	log                                       func() string
	logReset                                  func()
}

// buildDeviceFake compiles the whole-device fake; it skips the test when
// there is no g++.
func buildDeviceFake(t *testing.T) *deviceFake {
	t.Helper()
	cxx, err := exec.LookPath("g++")
	if err != nil {
		t.Skip("no g++ to build the fake CUDA device: ", err)
	}
	dir := t.TempDir()
	var inc strings.Builder
	for _, f := range KernelFiles() {
		inc.WriteString(f.Source())
		inc.WriteString("\n")
	}
	if err := os.WriteFile(filepath.Join(dir, "fake_kernels.inc"), []byte(inc.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	td, err := filepath.Abs("testdata")
	if err != nil {
		t.Fatal(err)
	}
	lib := filepath.Join(dir, "libfakedevice.so")
	cmd := exec.Command(cxx, "-std=c++20", "-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-Wno-unused-parameter",
		"-Wno-unused-variable", "-Wno-unused-function", "-DLOOM_FAKE_DEVICE", "-I", dir, "-I", td, "-o", lib,
		filepath.Join(td, "fakecuda.cpp"), filepath.Join(td, "fakecublas.cpp"), "-lpthread")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("building the fake device: %v\n%s", err, out)
	}
	dl, err := dynlib.Open(lib)
	if err != nil {
		t.Fatal(err)
	}
	f := &deviceFake{path: lib}
	if err := dl.Bind([]dynlib.Symbol{
		{Name: "fake_live_allocs", Fn: &f.allocs}, {Name: "fake_ctx_refs", Fn: &f.ctxRefs}, {Name: "fake_modules", Fn: &f.modules},
		{Name: "fake_events", Fn: &f.events}, {Name: "fake_streams", Fn: &f.streams}, {Name: "fake_last_error", Fn: &f.lastError},
		{Name: "fake_live", Fn: &f.live}, {Name: "fake_log", Fn: &f.log}, {Name: "fake_log_reset", Fn: &f.logReset},
	}); err != nil {
		t.Fatal(err)
	}
	return f
}

// open loads the fake as every library and opens device 0 with opts.
func (f *deviceFake) open(t *testing.T, nvrtc string, opts ...DeviceOption) (*Lib, *Device) {
	t.Helper()
	l, err := Load(WithDriver(f.path), WithNVRTC(nvrtc), WithKernelCache(Off))
	if err != nil {
		t.Fatal(err)
	}
	d, err := OpenDevice(l, 0, opts...)
	if err != nil {
		t.Fatal(err)
	}
	return l, d
}

// fakeBLAS are the device options that take cuBLAS from the fake.
func (f *deviceFake) blas() DeviceOption {
	return WithBLASOptions(WithCUBLAS(f.path), WithCUBLASLt(f.path))
}

func TestFakeDevice(t *testing.T) {
	f := buildDeviceFake(t)
	t.Run("kernels", func(t *testing.T) {
		l, d := f.open(t, f.path, f.blas())
		ref, err := emu.New(0)
		if err != nil {
			t.Fatal(err)
		}
		runKernelCases(t, d, ref, smallShapes, f.lastError)
		if err := ref.Close(); err != nil {
			t.Error(err)
		}
		if err := d.Close(); err != nil {
			t.Error(err)
		}
		if err := l.Close(); err != nil {
			t.Error(err)
		}
		f.checkReleased(t)
	})
	t.Run("allocator", func(t *testing.T) { testFakeAllocator(t, f) })
	t.Run("errors", func(t *testing.T) { testFakeDeviceErrors(t, f) })
	t.Run("lost buffer", func(t *testing.T) { testLostBuffer(t, f) })
	t.Run("tf32", func(t *testing.T) { testFakeTF32(t, f) })
	t.Run("targets", func(t *testing.T) { testFakeTargets(t, f) })
}

// testFakeTargets: a CrossEntropy target outside [0, v) is the CPU
// kernel's error (device.ErrInvalid, naming the method and the row) from
// the next Synchronize of the device or its compute stream or CopyToHost,
// once; the device goes on working;
// past targetSlots unread checks the call itself returns them.
func testFakeTargets(t *testing.T, f *deviceFake) {
	l, d := f.open(t, f.path)
	k := d.Kernels()
	const rows, v = 3, 4
	alloc := func(dt comm.DType, init []float64) device.Buffer {
		b, err := d.Alloc(dt, len(init))
		if err != nil {
			t.Fatal(err)
		}
		if err := d.CopyFromHost(b, toHost(dt, len(init), init)); err != nil {
			t.Fatal(err)
		}
		return b
	}
	logits := alloc(comm.Float32, randInit(rand.New(rand.NewPCG(1, 2)), rows*v, 2))
	good, bad := alloc(comm.Int64, []float64{1, 3, 0}), alloc(comm.Int64, []float64{1, 4, -1})
	loss, lse, dx := alloc(comm.Float64, []float64{0}), alloc(comm.Float64, make([]float64, rows)), alloc(comm.Float32, make([]float64, rows*v))
	want := func(what string, err error, op string, count int) {
		t.Helper()
		msg := fmt.Sprintf("cuda:0: %s: invalid argument: the target of row 1 is outside [0, 4)", op)
		if count == 0 {
			if err != nil {
				t.Errorf("%s: %v, want nil", what, err)
			}
			return
		}
		if !errors.Is(err, device.ErrInvalid) || !errors.Is(err, loom.ErrInvalid) || strings.Count(fmt.Sprint(err), msg) != count {
			t.Errorf("%s: %v, want %d× %q matching device.ErrInvalid", what, err, count, msg)
		}
	}
	want("CrossEntropy", k.CrossEntropy(loss, lse, logits, bad, v), "", 0)
	want("Synchronize after a bad CrossEntropy", d.Synchronize(), "CrossEntropy", 1)
	want("Synchronize again", d.Synchronize(), "", 0)
	want("CrossEntropyMean", k.CrossEntropyMean(dx.Slice(0, 1).(device.Buffer), nil, logits, bad, v, 7), "", 0)
	want("the compute stream's Synchronize after a bad CrossEntropyMean", d.Compute().Synchronize(), "CrossEntropyMean", 1)
	want("the compute stream's Synchronize again", d.Compute().Synchronize(), "", 0)
	want("CrossEntropyBackward", k.CrossEntropyBackward(dx, logits, bad, lse, v, 1), "", 0)
	got := make([]float32, rows*v)
	want("CopyToHost after a bad CrossEntropyBackward", d.CopyToHost(comm.Host(got), dx), "CrossEntropyBackward", 1)
	want("good CrossEntropy", k.CrossEntropy(loss, lse, logits, good, v), "", 0)
	l1 := make([]float64, 1)
	want("CopyToHost after a good CrossEntropy", d.CopyToHost(comm.Host(l1), loss), "", 0)
	if math.IsNaN(l1[0]) || l1[0] <= 0 {
		t.Errorf("loss after the bad calls: %v", l1[0])
	}
	for i := range targetSlots {
		want(fmt.Sprintf("bad CrossEntropy %d", i), k.CrossEntropy(loss, nil, logits, bad, v), "", 0)
	}
	want("CrossEntropy past the slots", k.CrossEntropy(loss, nil, logits, bad, v), "CrossEntropy", targetSlots)
	want("Synchronize after the slots", d.Synchronize(), "CrossEntropy", 1)
	// Left unread at Close: freed with the device.
	want("CrossEntropy before Close", k.CrossEntropy(loss, nil, logits, bad, v), "", 0)
	for _, b := range []device.Buffer{logits, good, bad, loss, lse, dx} {
		if err := b.Free(); err != nil {
			t.Fatal(err)
		}
	}
	if err := d.Close(); err != nil {
		t.Error(err)
	}
	if err := l.Close(); err != nil {
		t.Error(err)
	}
	f.checkReleased(t)
}

// testFakeTF32: float32 GEMMs compute in float32 unless the BLAS allows
// TF32, and then in TF32 (CUBLAS_COMPUTE_32F_FAST_TF32, 77); float64 ones
// in float64 (70); all on the compute stream.
func testFakeTF32(t *testing.T, f *deviceFake) {
	for _, c := range []struct {
		tf32      bool
		want, not string
	}{{false, "compute=68", "compute=77"}, {true, "compute=77", "compute=68"}} {
		l, d := f.open(t, f.path, WithBLASOptions(WithCUBLAS(f.path), WithCUBLASLt(f.path), WithTF32(c.tf32)))
		k := d.Kernels()
		var bufs []device.Buffer
		for _, dt := range []comm.DType{comm.Float32, comm.Float64} {
			b, err := d.Alloc(dt, 4)
			if err != nil {
				t.Fatal(err)
			}
			if err := k.Fill(b, 1); err != nil {
				t.Fatal(err)
			}
			bufs = append(bufs, b)
		}
		f.logReset()
		for _, b := range bufs {
			if err := k.Gemm(device.Gemm{M: 2, N: 2, K: 2, A: b, B: b, C: b.Slice(0, 4).(device.Buffer), LDA: 2, LDB: 2, LDC: 2, Alpha: 1}); err != nil {
				t.Fatal(err)
			}
		}
		stream := fmt.Sprintf("stream=%#x", d.compute.Handle())
		var lines []string // the GEMMs (the first GEMM also creates the handle)
		for l := range strings.Lines(f.log()) {
			if strings.HasPrefix(l, "cublasGemmEx ") {
				lines = append(lines, l)
			}
		}
		if len(lines) != 2 || !strings.Contains(lines[0], c.want) || strings.Contains(lines[0], c.not) ||
			!strings.Contains(lines[1], "compute=70") || !strings.Contains(lines[0], stream) || !strings.Contains(lines[1], stream) {
			t.Errorf("TF32 %v: cuBLAS calls\n%s\nwant float32 with %s and float64 with compute=70, on %s", c.tf32, f.log(), c.want, stream)
		}
		// Autocast's GEMM is bfloat16 A and B (14), float32 C (0) and
		// compute (68) whether or not TF32 is allowed.
		f.logReset()
		if err := k.Gemm(device.Gemm{M: 2, N: 2, K: 2, A: bufs[0], B: bufs[0], C: bufs[0], LDA: 2, LDB: 2, LDC: 2, Alpha: 1, Precision: device.GemmBF16}); err != nil {
			t.Fatal(err)
		}
		if lg := f.log(); !strings.Contains(lg, "cublasGemmEx ") || !strings.Contains(lg, "Atype=14 Btype=14 Ctype=0 ") || !strings.Contains(lg, "compute=68") {
			t.Errorf("TF32 %v: a bfloat16 GEMM's cuBLAS calls\n%s\nwant cublasGemmEx with Atype=14 Btype=14 Ctype=0 compute=68", c.tf32, lg)
		}
		for _, b := range bufs {
			if err := b.Free(); err != nil {
				t.Fatal(err)
			}
		}
		if err := d.Close(); err != nil {
			t.Fatal(err)
		}
		if err := l.Close(); err != nil {
			t.Fatal(err)
		}
	}
	f.checkReleased(t)
}

// checkReleased fails unless the fake holds nothing: every allocation,
// stream, event, module, context reference and cuBLAS handle is gone.
func (f *deviceFake) checkReleased(t *testing.T) {
	t.Helper()
	if a, r, m, e, s, h := f.allocs(), f.ctxRefs(), f.modules(), f.events(), f.streams(), f.live("cublas_handle"); a != 0 || r != 0 || m != 0 || e != 0 || s != 0 || h != 0 {
		t.Errorf("leaked: %d allocations, %d context references, %d modules, %d events, %d streams, %d cuBLAS handles", a, r, m, e, s, h)
	}
}

// testFakeAllocator: a loop that allocates the same sizes every step makes
// no driver allocation after its first step; an allocation larger than
// the device fails with an *OOMError that says what was asked and held,
// and a smaller one then succeeds; Close gives everything back.
func testFakeAllocator(t *testing.T, f *deviceFake) {
	b, err := LoadBLAS(WithCUBLAS(f.path), WithCUBLASLt(f.path))
	if err != nil {
		t.Fatal(err)
	}
	l, d := f.open(t, f.path, WithBLAS(b))
	k := d.Kernels()
	var after1 int64
	for step := range 5 {
		var bufs []device.Buffer
		for _, n := range []int{1, 100, 4096, 300000, 3 << 20} {
			b, err := d.Alloc(comm.Float32, n)
			if err != nil {
				t.Fatal(err)
			}
			if err := k.Fill(b, float64(step)); err != nil {
				t.Fatal(err)
			}
			bufs = append(bufs, b)
		}
		// A GEMM (its workspace comes at the first) and an op with
		// scratch memory (LayerNormBackward's partial sums).
		if err := k.Gemm(device.Gemm{M: 10, N: 10, K: 10, A: bufs[1], B: bufs[1], C: bufs[2], LDA: 10, LDB: 10, LDC: 10, Alpha: 1}); err != nil {
			t.Fatal(err)
		}
		mean, err := d.Alloc(comm.Float64, 64)
		if err != nil {
			t.Fatal(err)
		}
		bufs = append(bufs, mean)
		if err := k.Fill(mean, 0.5); err != nil {
			t.Fatal(err)
		}
		if err := k.LayerNormBackward(nil, bufs[0].Slice(0, 1).(device.Buffer), nil, bufs[2], bufs[2], nil, mean, mean, 64); err == nil {
			t.Error("LayerNormBackward with dw of 1 element for rows of 64: no error")
		}
		dw := bufs[3].Slice(0, 64).(device.Buffer)
		if err := k.LayerNormBackward(bufs[2], dw, dw, bufs[2], bufs[2], nil, mean, mean, 64); err != nil {
			t.Fatal(err)
		}
		if step == 0 && !strings.HasPrefix(d.GEMMPath(), "cuBLAS 12.4.5 + cuBLASLt") {
			t.Errorf("GEMMPath() = %q", d.GEMMPath())
		}
		for _, b := range bufs {
			if err := b.Free(); err != nil {
				t.Fatal(err)
			}
		}
		if step == 0 {
			after1 = d.Memory().Stats().DriverAllocs
		}
	}
	if st := d.Memory().Stats(); st.DriverAllocs != after1 || after1 == 0 {
		t.Errorf("driver allocations: %d after the first step, %d after five", after1, st.DriverAllocs)
	}

	// A buffer also used on another stream is reused only after the work
	// queued there by its Free has run (the fake's streams run only when
	// waited for, so that work is still queued here).
	side, err := d.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	used, err := d.Alloc(comm.Float32, 5000)
	if err != nil {
		t.Fatal(err)
	}
	if err := d.RecordStream(used, side); err != nil {
		t.Fatal(err)
	}
	ev, err := d.NewEvent(false)
	if err != nil {
		t.Fatal(err)
	}
	if err := ev.Record(d.Compute()); err != nil {
		t.Fatal(err)
	}
	if err := side.WaitEvent(ev); err != nil { // queued work on side
		t.Fatal(err)
	}
	usedPtr := used.Ptr()
	if err := used.Free(); err != nil {
		t.Fatal(err)
	}
	if st := d.Memory().Stats(); st.Pending == 0 {
		t.Errorf("a free waiting for another stream is not pending: %+v", st)
	}
	again, err := d.Alloc(comm.Float32, 5000)
	if err != nil {
		t.Fatal(err)
	}
	if again.Ptr() == usedPtr {
		t.Error("a block was reused before the other stream's work ran")
	}
	if err := side.Synchronize(); err != nil {
		t.Fatal(err)
	}
	third, err := d.Alloc(comm.Float32, 5000)
	if err != nil {
		t.Fatal(err)
	}
	if third.Ptr() != usedPtr || d.Memory().Stats().Pending != 0 {
		t.Errorf("after the other stream ran, the block was not reused: %#x, want %#x", third.Ptr(), usedPtr)
	}
	for _, b := range []device.Buffer{again, third} {
		if err := b.Free(); err != nil {
			t.Fatal(err)
		}
	}
	if err := ev.Close(); err != nil {
		t.Fatal(err)
	}

	keep, err := d.Alloc(comm.Float32, 1000)
	if err != nil {
		t.Fatal(err)
	}
	_, err = d.Alloc(comm.Float32, 1<<36) // 256 GiB; the fake has 64
	var oom *device.OOMError
	if !errors.As(err, &oom) || !errors.Is(err, device.ErrOutOfMemory) || oom.Device != "cuda:0" || oom.Requested != 1<<38 ||
		!strings.Contains(err.Error(), "out of memory allocating 256.0 GiB") || !oom.Synced {
		t.Fatalf("huge Alloc: %v", err)
	}
	small, err := d.Alloc(comm.Float32, 1000)
	if err != nil {
		t.Fatalf("Alloc after an OOM: %v", err)
	}
	if err := k.Fill(small, 2); err != nil {
		t.Fatal(err)
	}
	host := make([]float32, 1000)
	if err := d.CopyToHost(comm.Host(host), small); err != nil || host[999] != 2 {
		t.Fatalf("after an OOM: %v, %v", host[999], err)
	}
	for _, b := range []device.Buffer{keep, small} {
		if err := b.Free(); err != nil {
			t.Fatal(err)
		}
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	if err := d.Close(); err != nil {
		t.Error("second Close:", err)
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	f.checkReleased(t)
}

// testFakeDeviceErrors: bad input is refused before anything runs, with
// the sentinel it should match, and the device stays usable.
func testFakeDeviceErrors(t *testing.T, f *deviceFake) {
	l, err := Load(WithDriver(f.path), WithNVRTC(f.path), WithKernelCache(Off))
	if err != nil {
		t.Fatal(err)
	}
	t.Setenv("CUDA_VISIBLE_DEVICES", "5")
	_, err = OpenDevice(l, 3)
	if want := "cuda: device 3: invalid argument: 1 device(s) visible (CUDA_VISIBLE_DEVICES=5)"; err == nil || err.Error() != want || !errors.Is(err, loom.ErrInvalid) {
		t.Errorf("OpenDevice(3) = %v, want %q matching loom.ErrInvalid", err, want)
	}
	if _, err := OpenDevice(l, 0, nil); !errors.Is(err, loom.ErrInvalid) {
		t.Errorf("nil option: %v", err)
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}

	// No cuBLAS: GEMMs fail naming the library and its variable; the
	// rest works.
	t.Setenv(CUBLASEnv, "/nonexistent/libcublas.so")
	l, d := f.open(t, f.path)
	k := d.Kernels()
	bufs := map[string]device.Buffer{}
	for _, name := range []string{"a", "b", "c"} {
		b, err := d.Alloc(comm.Float32, 6)
		if err != nil {
			t.Fatal(err)
		}
		if err := d.CopyFromHost(b, comm.Host([]float32{1, 2, 3, 4, 5, 6})); err != nil {
			t.Fatal(err)
		}
		bufs[name] = b
	}
	err = k.Gemm(device.Gemm{M: 2, N: 3, K: 2, A: bufs["a"], B: bufs["b"], C: bufs["c"], LDA: 2, LDB: 3, LDC: 3, Alpha: 1})
	if err == nil || !strings.Contains(err.Error(), "cuBLAS") || !strings.Contains(err.Error(), "LOOM_CUBLAS") ||
		!strings.Contains(err.Error(), "/nonexistent/libcublas.so") {
		t.Errorf("Gemm without cuBLAS: %v", err)
	}
	if err := k.Add(bufs["c"], bufs["a"], bufs["b"]); err != nil {
		t.Fatalf("Add without cuBLAS: %v", err)
	}
	got := make([]float32, 6)
	if err := d.CopyToHost(comm.Host(got), bufs["c"]); err != nil || got[5] != 12 {
		t.Errorf("Add without cuBLAS: %v, %v", got, err)
	}

	// Argument checks.
	ref, err := emu.New(0)
	if err != nil {
		t.Fatal(err)
	}
	other, err := ref.Alloc(comm.Float32, 6)
	if err != nil {
		t.Fatal(err)
	}
	f64s, err := d.Alloc(comm.Float64, 6)
	if err != nil {
		t.Fatal(err)
	}
	short, err := d.Alloc(comm.Float32, 5)
	if err != nil {
		t.Fatal(err)
	}
	freed, err := d.Alloc(comm.Float32, 6)
	if err != nil {
		t.Fatal(err)
	}
	big, err := d.Alloc(comm.Float32, 128)
	if err != nil {
		t.Fatal(err)
	}
	ids, err := d.Alloc(comm.Int64, 2)
	if err != nil {
		t.Fatal(err)
	}
	if err := freed.Free(); err != nil {
		t.Fatal(err)
	}
	a, c := bufs["a"], bufs["c"]
	for _, tc := range []struct {
		name string
		err  error
		is   error
		want string
	}{
		{"other device", k.Add(c, a, other), device.ErrMixed, "inputs on cuda:0 and emu:0 (b)"},
		{"float64 to a float32 kernel", k.Add(f64s, f64s, f64s), loom.ErrUnsupported, "cuda:0: Add: unsupported: float64 dst"},
		{"float64 AdamW", k.AdamW(f64s, f64s, f64s, f64s, [8]float64{}), loom.ErrUnsupported, "AdamW: unsupported: float64 p"},
		{"float64 SGD", k.SGD(f64s, f64s, nil, kernels.SGDStep{LR: 1}), loom.ErrUnsupported, "SGD: unsupported: float64 p"},
		{"SGD without buf", k.SGD(a, a, nil, kernels.SGDStep{LR: 1, Momentum: 0.9}), device.ErrInvalid, "SGD: invalid argument: buf is nil"},
		{"box outside", k.CopyBox(c, []int{2, 3}, []int{1, 1}, a, []int{2, 3}, []int{0, 0}, []int{1, 3}), device.ErrInvalid, "CopyBox: invalid argument"},
		{"box dtypes", k.CopyBox(c, []int{6}, []int{0}, f64s, []int{6}, []int{0}, []int{6}), device.ErrInvalid, "dst is float32, src float64"},
		{"unknown activation", k.Pointwise(device.Pointwise(9), c, a), device.ErrInvalid, "Pointwise: invalid argument: unknown activation Pointwise(9)"},
		{"activation lengths", k.PointwiseBackward(device.SiLU, c, a, short), device.ErrInvalid, "PointwiseBackward: invalid argument: y has 5 elements, want 6"},
		{"permutation", k.PermuteDims(c, a, []int{2, 3}, []int{1, 1}), device.ErrInvalid, "perm [1 1] is not a permutation of 0..1"},
		{"permute 7 dims", k.PermuteDims(big, big, []int{2, 2, 2, 2, 2, 2, 2}, []int{1, 0, 3, 2, 5, 4, 6}), loom.ErrUnsupported,
			"PermuteDims: unsupported: shape [2 2 2 2 2 2 2] permuted by [1 0 3 2 5 4 6] folds into 7 dims; loom_permute_nd_f32 takes 6"},
		{"dropout p", k.DropoutMask(c, []int{0}, []int{6}, []int{6}, 1, 1, 1), device.ErrInvalid, "DropoutMask: invalid argument: probability 1 outside [0, 1)"},
		{"dropout block", k.DropoutMask(c, []int{1}, []int{6}, []int{6}, 0.5, 1, 1), device.ErrInvalid, "block at [1] of size [6] outside [6]"},
		{"dropout 7 dims", k.DropoutMask(big, []int{0, 0, 0, 0, 0, 0, 0}, []int{2, 2, 2, 2, 2, 2, 2}, []int{3, 3, 3, 3, 3, 3, 3}, 0.5, 1, 1),
			loom.ErrUnsupported, "DropoutMask: unsupported: a block [2 2 2 2 2 2 2] of [3 3 3 3 3 3 3] folds into 7 dims"},
		{"argmax rows", k.ArgmaxRows(ids, a, 4), device.ErrInvalid, "ArgmaxRows: invalid argument: 6 values for 2 rows of 4"},
		{"argmax dtype", k.ArgmaxRows(c, a, 3), device.ErrInvalid, "ArgmaxRows: invalid argument: dst is float32, want [int64]"},
		{"narrow outside", k.NarrowDim(c, a, 1, 6, 1, 2, 6), device.ErrInvalid, "CopyBox: invalid argument"},
		{"float16 cast", k.Cast(f64s, short), device.ErrInvalid, "Cast: invalid argument: dst has 6 elements, src 5"},
		{"short buffer", k.Mul(c, a, short), device.ErrInvalid, "Mul: invalid argument: b has 5 elements, want 6"},
		{"freed buffer", k.Mul(c, a, freed), device.ErrInvalid, "Mul: invalid argument: b was freed"},
		{"rows", k.Softmax(c, a, 4, false), device.ErrInvalid, "src has 6 elements, not whole rows of 4"},
		{"gemm extent", k.Gemm(device.Gemm{M: 3, N: 3, K: 2, A: a, B: a, C: c, Alpha: 1}), device.ErrInvalid, "C needs 9 elements"},
		{"copy", d.Copy(short, a), device.ErrInvalid, "destination of 5 elements, source of 6"},
		{"slice free", a.Slice(1, 2).(device.Buffer).Free(), device.ErrInvalid, "a slice does not own its memory"},
		{"double free", freed.Free(), device.ErrInvalid, "freed already"},
		{"bad alloc", func() error { _, err := d.Alloc(comm.Float32, -1); return err }(), device.ErrInvalid, "Alloc"},
	} {
		if !errors.Is(tc.err, tc.is) || !strings.Contains(fmt.Sprint(tc.err), tc.want) {
			t.Errorf("%s: %v, want %v with %q", tc.name, tc.err, tc.is, tc.want)
		}
	}
	if err := other.Free(); err != nil {
		t.Fatal(err)
	}
	if err := ref.Close(); err != nil {
		t.Fatal(err)
	}
	for _, b := range []device.Buffer{bufs["a"], bufs["b"], bufs["c"], f64s, short, big, ids} {
		if err := b.Free(); err != nil {
			t.Fatal(err)
		}
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := d.Alloc(comm.Float32, 1); !errors.Is(err, device.ErrInvalid) {
		t.Errorf("Alloc after Close: %v", err)
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}

	// No NVRTC: kernels fail naming LOOM_NVRTC; copies work.
	l, d = f.open(t, Off)
	b, err := d.Alloc(comm.Float32, 3)
	if err != nil {
		t.Fatal(err)
	}
	if err := d.CopyFromHost(b, comm.Host([]float32{1, 2, 3})); err != nil {
		t.Fatal(err)
	}
	if err := d.Kernels().Add(b, b, b); err == nil || !strings.Contains(err.Error(), "LOOM_NVRTC") {
		t.Errorf("Add without NVRTC: %v", err)
	}
	if err := d.CopyToHost(comm.Host(got[:3]), b); err != nil || got[2] != 3 {
		t.Errorf("copy without NVRTC: %v, %v", got[:3], err)
	}
	if err := b.Free(); err != nil {
		t.Fatal(err)
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	f.checkReleased(t)
}

// testLostBuffer: an owning buffer dropped without Free goes back to the
// allocator once the garbage collector finds it; its slices keep it.
func testLostBuffer(t *testing.T, f *deviceFake) {
	l, d := f.open(t, f.path)
	defer func() {
		if err := d.Close(); err != nil {
			t.Error(err)
		}
		if err := l.Close(); err != nil {
			t.Error(err)
		}
	}()
	b, err := d.Alloc(comm.Float32, 1000)
	if err != nil {
		t.Fatal(err)
	}
	s := b.Slice(10, 20).(device.Buffer)
	b = nil
	for range 3 {
		runtime.GC()
	}
	time.Sleep(10 * time.Millisecond)
	if d.Memory().Stats().Allocated == 0 {
		t.Fatal("a buffer with a live slice was freed")
	}
	if err := d.Kernels().Fill(s, 1); err != nil {
		t.Fatal(err)
	}
	runtime.KeepAlive(s)
	s = nil
	deadline := time.Now().Add(5 * time.Second)
	for d.Memory().Stats().Allocated != 0 {
		if time.Now().After(deadline) {
			t.Fatal("a lost buffer was not freed")
		}
		runtime.GC()
		time.Sleep(time.Millisecond)
	}
}

// shapes are the sizes the kernel cases take.
type shapes struct {
	rows, n []int // row kernels: rows × n
	elems   []int // elementwise lengths
	gemm    [][3]int
	attn    []device.AttnShape
	vocab   []int
}

// smallShapes are small and odd, for the fake.
var smallShapes = shapes{
	rows:  []int{1, 3, 17},
	n:     []int{1, 7, 33, 257},
	elems: []int{0, 1, 7, 1000, 4099},
	gemm:  [][3]int{{1, 1, 1}, {3, 5, 7}, {17, 33, 9}},
	attn:  []device.AttnShape{{Batch: 1, T: 1, DH: 1, DV: 1, Scale: 1}, {Batch: 3, T: 5, DH: 7, DV: 4, Scale: 0.375}, {Batch: 2, T: 33, DH: 16, DV: 16, Scale: 0.25}},
	vocab: []int{1, 7, 300},
}

// tol is how far a result of the device may be from the reference's:
// |got − want| ≤ rtol·|want| + atol; 0, 0 is bit for bit.
type tol struct{ rtol, atol float64 }

// kbuf is one buffer of a kernel case: its dtype and length, its contents
// (nil: NaN garbage, so that an element the kernel skips is seen), and,
// for outputs, the tolerance of the comparison.
type kbuf struct {
	dt   comm.DType
	init []float64
	n    int
	out  bool
	tol  tol
}

// kcase is one call of a Kernels method on buffers made from bufs.
type kcase struct {
	name string
	bufs []kbuf
	call func(k device.Kernels, b []device.Buffer) error
}

// The §5 tolerances of the kernels, with the reasons of emu_kernels_test.go
// (float32 expf/erfcf on the device where the CPU uses float64; sums in
// double in another order; cuBLAS accumulating in another order).
var (
	exact   = tol{0, 0}
	sumTol  = tol{1e-5, 1e-6} // double sums rounded once, and float32 warp partials for LayerNorm's dw, db
	smTol   = tol{2e-6, 1e-6} // softmax: float32 expf of a double argument
	lnTol   = tol{1e-5, 1e-5} // LayerNorm: double statistics in another order
	geluTol = tol{4e-6, 1e-6} // erfcf and expf in float32
	xentTol = tol{1e-6, 1e-7} // double log-sum-exp from float32 expf terms
	attnTol = tol{1e-5, 1e-5} // GEMMs and the softmax kernel
)

func randInit(r *rand.Rand, n int, scale float64) []float64 {
	out := make([]float64, n)
	for i := range out {
		out[i] = (2*r.Float64() - 1) * scale
	}
	return out
}

func outF32(n int, t tol) kbuf { return kbuf{dt: comm.Float32, n: n, out: true, tol: t} }

func inF32(r *rand.Rand, n int, scale float64) kbuf {
	return kbuf{dt: comm.Float32, n: n, init: randInit(r, n, scale)}
}

// kernelCases builds the cases of every Kernels method for sh.
func kernelCases(r *rand.Rand, sh shapes) []kcase {
	var cs []kcase
	for _, n := range sh.elems {
		cs = append(cs,
			kcase{fmt.Sprintf("Add/%d", n), []kbuf{outF32(n, exact), inF32(r, n, 3), inF32(r, n, 3)},
				func(k device.Kernels, b []device.Buffer) error { return k.Add(b[0], b[1], b[2]) }},
			kcase{fmt.Sprintf("Add in place/%d", n), []kbuf{{dt: comm.Float32, n: n, init: randInit(r, n, 3), out: true}, inF32(r, n, 3)},
				func(k device.Kernels, b []device.Buffer) error { return k.Add(b[0], b[0], b[1]) }},
			kcase{fmt.Sprintf("Mul/%d", n), []kbuf{outF32(n, exact), inF32(r, n, 3), inF32(r, n, 3)},
				func(k device.Kernels, b []device.Buffer) error { return k.Mul(b[0], b[1], b[2]) }},
			kcase{fmt.Sprintf("AdamW/%d", n), []kbuf{
				{dt: comm.Float32, n: n, init: randInit(r, n, 1), out: true}, inF32(r, n, 1),
				{dt: comm.Float32, n: n, init: randInit(r, n, 0.1), out: true},
				{dt: comm.Float32, n: n, init: randInit(r, n, 0.01), out: true}},
				func(k device.Kernels, b []device.Buffer) error {
					return k.AdamW(b[0], b[1], b[2], b[3], [8]float64{1 - 3e-5, 0.9, 0.1, 0.95, 0.05, math.Sqrt(1 - 0.95*0.95), -3e-4 / 0.19, 1e-8})
				}},
		)
		cs = append(cs,
			kcase{fmt.Sprintf("Scale/%d", n), []kbuf{outF32(n, exact), inF32(r, n, 3)},
				func(k device.Kernels, b []device.Buffer) error { return k.Scale(b[0], b[1], -0.3) }},
			// Both sum squares in double, in different orders.
			kcase{fmt.Sprintf("SumSquares/%d", n), []kbuf{{dt: comm.Float64, n: 1, out: true, tol: tol{1e-13, 0}}, inF32(r, n, 2)},
				func(k device.Kernels, b []device.Buffer) error { return k.SumSquares(b[0], b[1]) }},
		)
		for _, st := range []kernels.SGDStep{
			{LR: 0.05},
			{LR: 0.05, WeightDecay: 0.01, Momentum: 0.9, First: true},
			{LR: 0.05, WeightDecay: 0.01, Momentum: 0.9, Nesterov: true, Maximize: true},
			{LR: 0.05, Momentum: 0.5, Dampening: 0.25},
		} {
			bufs := []kbuf{{dt: comm.Float32, n: n, init: randInit(r, n, 1), out: true}, inF32(r, n, 1)}
			if st.Momentum != 0 {
				bufs = append(bufs, kbuf{dt: comm.Float32, n: n, init: randInit(r, n, 0.1), out: true})
			}
			cs = append(cs, kcase{fmt.Sprintf("SGD %+v/%d", st, n), bufs, func(k device.Kernels, b []device.Buffer) error {
				var buf device.Buffer
				if len(b) > 2 {
					buf = b[2]
				}
				return k.SGD(b[0], b[1], buf, st)
			}})
		}
		for _, dt := range []comm.DType{comm.Float32, comm.Float64, comm.BFloat16, comm.Float16} {
			cs = append(cs, kcase{fmt.Sprintf("Fill %v/%d", dt, n), []kbuf{{dt: dt, n: n, out: true}},
				func(k device.Kernels, b []device.Buffer) error { return k.Fill(b[0], -1.3e-3) }})
		}
		for _, dt := range []comm.DType{comm.Float64, comm.BFloat16} {
			cs = append(cs,
				kcase{fmt.Sprintf("Cast float32 to %v/%d", dt, n), []kbuf{{dt: dt, n: n, out: true}, inF32(r, n, 100)},
					func(k device.Kernels, b []device.Buffer) error { return k.Cast(b[0], b[1]) }},
				kcase{fmt.Sprintf("Cast %v to float32/%d", dt, n), []kbuf{outF32(n, exact), {dt: dt, n: n, init: randInit(r, n, 100)}},
					func(k device.Kernels, b []device.Buffer) error { return k.Cast(b[0], b[1]) }})
		}
	}
	for _, rows := range sh.rows {
		for _, n := range sh.n {
			m := rows * n
			cs = append(cs,
				kcase{fmt.Sprintf("ColumnSums/%dx%d", rows, n), []kbuf{outF32(n, sumTol), inF32(r, m, 2)},
					func(k device.Kernels, b []device.Buffer) error { return k.ColumnSums(b[0], b[1], n) }},
				kcase{fmt.Sprintf("Softmax/%dx%d", rows, n), []kbuf{outF32(m, smTol), inF32(r, m, 4)},
					func(k device.Kernels, b []device.Buffer) error { return k.Softmax(b[0], b[1], n, false) }},
				kcase{fmt.Sprintf("LogSoftmax/%dx%d", rows, n), []kbuf{outF32(m, tol{1e-6, 1e-6}), inF32(r, m, 4)},
					func(k device.Kernels, b []device.Buffer) error { return k.Softmax(b[0], b[1], n, true) }},
				kcase{fmt.Sprintf("SoftmaxBackward/%dx%d", rows, n), []kbuf{outF32(m, tol{1e-6, 1e-6}), inF32(r, m, 1), inF32(r, m, 1)},
					func(k device.Kernels, b []device.Buffer) error { return k.SoftmaxBackward(b[0], b[1], b[2], n, false) }},
				kcase{fmt.Sprintf("LogSoftmaxBackward/%dx%d", rows, n), []kbuf{outF32(m, tol{1e-6, 1e-6}), inF32(r, m, 1), inF32(r, m, 1)},
					func(k device.Kernels, b []device.Buffer) error { return k.SoftmaxBackward(b[0], b[1], b[2], n, true) }},
				kcase{fmt.Sprintf("LayerNorm/%dx%d", rows, n), []kbuf{outF32(m, lnTol), {dt: comm.Float64, n: rows, out: true, tol: tol{1e-12, 1e-12}},
					{dt: comm.Float64, n: rows, out: true, tol: tol{1e-12, 0}}, inF32(r, m, 3), inF32(r, n, 1.5), inF32(r, n, 0.5)},
					func(k device.Kernels, b []device.Buffer) error {
						return k.LayerNorm(b[0], b[1], b[2], b[3], b[4], b[5], n, 1e-5)
					}},
				kcase{fmt.Sprintf("LayerNorm no affine/%dx%d", rows, n), []kbuf{outF32(m, lnTol), inF32(r, m, 3)},
					func(k device.Kernels, b []device.Buffer) error {
						return k.LayerNorm(b[0], nil, nil, b[1], nil, nil, n, 1e-5)
					}},
				kcase{fmt.Sprintf("BiasGELU/%dx%d", rows, n), []kbuf{outF32(m, geluTol), outF32(m, geluTol), inF32(r, m, 4), inF32(r, n, 1)},
					func(k device.Kernels, b []device.Buffer) error { return k.BiasGELU(b[0], b[1], b[2], b[3], n) }},
				kcase{fmt.Sprintf("BiasGELUBackward/%dx%d", rows, n), []kbuf{outF32(m, exact), outF32(n, sumTol), inF32(r, m, 1), inF32(r, m, 1)},
					func(k device.Kernels, b []device.Buffer) error { return k.BiasGELUBackward(b[0], b[1], b[2], b[3], n) }},
			)
			// The backward from the reference's own forward statistics.
			x, w, dy := randInit(r, m, 3), randInit(r, n, 1.5), randInit(r, m, 1)
			cs = append(cs, kcase{fmt.Sprintf("LayerNormBackward/%dx%d", rows, n), []kbuf{
				outF32(m, lnTol), outF32(n, sumTol), outF32(n, sumTol), {dt: comm.Float32, n: m, init: dy},
				{dt: comm.Float32, n: m, init: x}, {dt: comm.Float32, n: n, init: w}, lnStats(x, rows, n, false), lnStats(x, rows, n, true)},
				func(k device.Kernels, b []device.Buffer) error {
					return k.LayerNormBackward(b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], n)
				}})
		}
	}
	for _, rows := range sh.rows {
		for _, v := range sh.vocab {
			targets := make([]float64, rows)
			for i := range targets {
				targets[i] = float64(r.IntN(v))
			}
			logits := randInit(r, rows*v, 6)
			cs = append(cs,
				kcase{fmt.Sprintf("CrossEntropy/%dx%d", rows, v), []kbuf{{dt: comm.Float64, n: 1, out: true, tol: xentTol},
					{dt: comm.Float64, n: rows, out: true, tol: xentTol}, {dt: comm.Float32, n: rows * v, init: logits}, {dt: comm.Int64, n: rows, init: targets}},
					func(k device.Kernels, b []device.Buffer) error { return k.CrossEntropy(b[0], b[1], b[2], b[3], v) }},
				kcase{fmt.Sprintf("CrossEntropyBackward/%dx%d", rows, v), []kbuf{outF32(rows*v, tol{2e-6, 1e-7}),
					{dt: comm.Float32, n: rows * v, init: logits}, {dt: comm.Int64, n: rows, init: targets}, {dt: comm.Float64, n: rows, init: lse(logits, rows, v)}},
					func(k device.Kernels, b []device.Buffer) error {
						return k.CrossEntropyBackward(b[0], b[1], b[2], b[3], v, 1/float64(rows))
					}},
			)
		}
	}
	for _, tt := range []int{1, 5, 64, 65} {
		for _, blocks := range []int{1, 3} {
			m := blocks * tt * tt
			cs = append(cs,
				kcase{fmt.Sprintf("CausalSoftmax/%dx%d", blocks, tt), []kbuf{outF32(m, tol{2e-6, 1e-7}), inF32(r, m, 8)},
					func(k device.Kernels, b []device.Buffer) error { return k.CausalSoftmax(b[0], b[1], tt, 0.125) }},
				kcase{fmt.Sprintf("CausalSoftmaxBackward/%dx%d", blocks, tt), []kbuf{outF32(m, tol{1e-6, 1e-6}), causalProbs(r, blocks, tt), inF32(r, m, 1)},
					func(k device.Kernels, b []device.Buffer) error {
						return k.CausalSoftmaxBackward(b[0], b[1], b[2], tt, 0.125)
					}},
			)
		}
	}
	for _, g := range sh.gemm {
		m, n, kk := g[0], g[1], g[2]
		// The fake's cuBLAS sums in double and rounds once, the CPU in
		// float32 (and a GPU's cuBLAS in float32 in its own order): the
		// difference grows with K; 1e-6·K absolute for inputs in [−1, 1]
		// is far above it and far below what a wrong index gives.
		gemmTol := tol{1e-5, 1e-6 * float64(kk+1)}
		for _, tr := range [][2]bool{{false, false}, {true, false}, {false, true}, {true, true}} {
			ta, tb := tr[0], tr[1]
			lda, ldb := kk+1, n+2 // leading dimensions past the row
			if ta {
				lda = m + 1
			}
			if tb {
				ldb = kk + 2
			}
			ra, rb := m, kk
			if ta {
				ra = kk
			}
			if tb {
				rb = n
			}
			for _, dt := range []comm.DType{comm.Float32, comm.Float64} {
				cs = append(cs, kcase{fmt.Sprintf("Gemm %v/%dx%dx%d/%v%v", dt, m, n, kk, ta, tb), []kbuf{
					{dt: dt, n: ra * lda, init: randInit(r, ra*lda, 1)}, {dt: dt, n: rb * ldb, init: randInit(r, rb*ldb, 1)},
					{dt: dt, n: m * (n + 3), init: randInit(r, m*(n+3), 1), out: true, tol: gemmTol}},
					func(k device.Kernels, b []device.Buffer) error {
						return k.Gemm(device.Gemm{TransA: ta, TransB: tb, M: m, N: n, K: kk, A: b[0], B: b[1], C: b[2],
							LDA: lda, LDB: ldb, LDC: n + 3, Alpha: 0.75, Beta: -0.5})
					}})
			}
			// Autocast: bfloat16 operands (cast in the GEMM's layout,
			// gaps included), float32 accumulation and C.
			cs = append(cs, kcase{fmt.Sprintf("Gemm bf16/%dx%dx%d/%v%v", m, n, kk, ta, tb), []kbuf{
				inF32(r, ra*lda, 1), inF32(r, rb*ldb, 1), {dt: comm.Float32, n: m * (n + 3), init: randInit(r, m*(n+3), 1), out: true, tol: gemmTol}},
				func(k device.Kernels, b []device.Buffer) error {
					return k.Gemm(device.Gemm{TransA: ta, TransB: tb, M: m, N: n, K: kk, A: b[0], B: b[1], C: b[2],
						LDA: lda, LDB: ldb, LDC: n + 3, Alpha: 0.75, Beta: -0.5, Precision: device.GemmBF16})
				}})
		}
		const batch = 3
		cs = append(cs, kcase{fmt.Sprintf("Gemm batched/%dx%dx%d", m, n, kk), []kbuf{
			inF32(r, batch*m*kk, 1), inF32(r, kk*n, 1), outF32(batch*m*n, gemmTol)},
			func(k device.Kernels, b []device.Buffer) error {
				return k.Gemm(device.Gemm{M: m, N: n, K: kk, A: b[0], B: b[1], C: b[2], LDA: kk, LDB: n, LDC: n, Alpha: 1,
					Batch: batch, StrideA: m * kk, StrideB: 0, StrideC: m * n})
			}})
	}
	for _, c := range []struct{ dshape, doff, sshape, soff, size []int }{
		{nil, nil, nil, nil, nil}, // one element
		{[]int{7}, []int{2}, []int{9}, []int{3}, []int{4}},
		{[]int{5, 6}, []int{1, 2}, []int{4, 7}, []int{0, 3}, []int{3, 4}},
		{[]int{3, 4, 5}, []int{1, 0, 0}, []int{2, 4, 5}, []int{0, 0, 0}, []int{2, 4, 5}}, // whole trailing dims: one run
		{[]int{3, 4, 5}, []int{0, 1, 2}, []int{2, 3, 6}, []int{1, 0, 1}, []int{1, 2, 3}},
		{[]int{4, 4}, []int{0, 0}, []int{4, 4}, []int{0, 0}, []int{0, 4}}, // empty
	} {
		dn, sn := prod(c.dshape), prod(c.sshape)
		for _, dt := range []comm.DType{comm.Float32, comm.Float64, comm.Int64} {
			cs = append(cs, kcase{fmt.Sprintf("CopyBox %v/%v", dt, c), []kbuf{{dt: dt, n: dn, init: randInit(r, dn, 100), out: true},
				{dt: dt, n: sn, init: randInit(r, sn, 100)}},
				func(k device.Kernels, b []device.Buffer) error {
					return k.CopyBox(b[0], c.dshape, c.doff, b[1], c.sshape, c.soff, c.size)
				}})
		}
	}
	for _, c := range []struct {
		shape  []int
		reduce []bool
	}{
		{nil, nil},
		{[]int{7}, []bool{true}},
		{[]int{7}, []bool{false}},
		{[]int{5, 33}, []bool{true, false}}, // a bias gradient
		{[]int{5, 33}, []bool{false, true}},
		{[]int{3, 4, 5, 6}, []bool{false, true, true, false}},
		{[]int{3, 4, 5, 6}, []bool{true, false, true, false}},
		{[]int{2, 3, 4, 5}, []bool{false, true, false, true}},
		{[]int{3, 0, 4}, []bool{true, false, true}},
		{[]int{3, 0, 4}, []bool{false, true, false}},
		{[]int{3, 0, 4}, []bool{true, true, true}},
		{[]int{7, 9}, []bool{true, true}}, // a total
		{[]int{600}, []bool{true}},        // a total over three blocks
	} {
		n, kept := prod(c.shape), 1
		for i, d := range c.shape {
			if !c.reduce[i] {
				kept *= d
			}
		}
		// Summed in float32 on the CPU and in double on the device, at most
		// 60 terms of |x| ≤ 2 here.
		cs = append(cs,
			kcase{fmt.Sprintf("SumDims/%v/%v", c.shape, c.reduce), []kbuf{outF32(kept, tol{1e-5, 1e-4}), inF32(r, n, 2)},
				func(k device.Kernels, b []device.Buffer) error { return k.SumDims(b[0], b[1], c.shape, c.reduce) }},
			kcase{fmt.Sprintf("BroadcastDims/%v/%v", c.shape, c.reduce), []kbuf{outF32(n, exact), inF32(r, kept, 2)},
				func(k device.Kernels, b []device.Buffer) error { return k.BroadcastDims(b[0], b[1], c.shape, c.reduce) }},
		)
	}
	for _, c := range [][3]int{{1, 5, 1}, {3, 7, 4}, {2, 9, 33}} {
		outer, n, inner := c[0], c[1], c[2]
		start, length := 2, n-3
		cs = append(cs,
			kcase{fmt.Sprintf("NarrowDim/%v", c), []kbuf{outF32(outer*length*inner, exact), inF32(r, outer*n*inner, 2)},
				func(k device.Kernels, b []device.Buffer) error {
					return k.NarrowDim(b[0], b[1], outer, n, inner, start, length)
				}},
			kcase{fmt.Sprintf("PadDim/%v", c), []kbuf{outF32(outer*(n+4)*inner, exact), inF32(r, outer*n*inner, 2)},
				func(k device.Kernels, b []device.Buffer) error { return k.PadDim(b[0], b[1], outer, n, inner, 1, n+4) }},
			kcase{fmt.Sprintf("ConcatDim/%v", c), []kbuf{outF32(outer*(n+5)*inner, exact), inF32(r, outer*n*inner, 2), inF32(r, 0, 1), inF32(r, outer*5*inner, 2)},
				func(k device.Kernels, b []device.Buffer) error {
					return k.ConcatDim(b[0], []device.Buffer{b[1], b[2], b[3]}, []int{n, 0, 5}, outer, inner)
				}},
		)
	}
	for _, s := range []struct{ vocab, lo, vl, nids, d int }{{1, 0, 1, 1, 1}, {7, 0, 7, 17, 7}, {300, 3, 100, 33, 33}} {
		ids := make([]float64, s.nids)
		for i := range ids {
			ids[i] = float64(r.IntN(s.vocab))
		}
		cs = append(cs,
			kcase{fmt.Sprintf("Embedding/%+v", s), []kbuf{outF32(s.nids*s.d, exact), inF32(r, s.vl*s.d, 1), {dt: comm.Int64, n: s.nids, init: ids}},
				func(k device.Kernels, b []device.Buffer) error { return k.Embedding(b[0], b[1], b[2], s.lo, s.d) }},
			// float32 atomic adds on the device, float64 on the CPU: 1e-6
			// of the few (≤ 17) repeated rows' magnitudes.
			kcase{fmt.Sprintf("EmbeddingBackward/%+v", s), []kbuf{outF32(s.vl*s.d, tol{1e-6, 1e-6}), {dt: comm.Float64, n: s.vl * s.d},
				inF32(r, s.nids*s.d, 1), {dt: comm.Int64, n: s.nids, init: ids}},
				func(k device.Kernels, b []device.Buffer) error {
					return k.EmbeddingBackward(b[0], b[1], b[2], b[3], s.lo, s.d)
				}},
		)
	}
	for _, rows := range sh.rows {
		for _, n := range sh.n {
			cs = append(cs, kcase{fmt.Sprintf("FillRows/%dx%d", rows, n), []kbuf{outF32(rows*n, exact), inF32(r, n, 2)},
				func(k device.Kernels, b []device.Buffer) error { return k.FillRows(b[0], b[1]) }})
		}
	}
	cs = append(cs, pointwiseCases(r, sh)...)
	for _, s := range sh.attn {
		bt := s.Batch * s.T
		cs = append(cs,
			kcase{fmt.Sprintf("Attention/%+v", s), []kbuf{outF32(bt*s.DV, attnTol), outF32(bt*s.T, attnTol),
				inF32(r, bt*s.DH, 1), inF32(r, bt*s.DH, 1), inF32(r, bt*s.DV, 1)},
				func(k device.Kernels, b []device.Buffer) error { return k.Attention(b[0], b[1], b[2], b[3], b[4], s) }},
			kcase{fmt.Sprintf("AttentionBackward/%+v", s), []kbuf{outF32(bt*s.DH, attnTol), outF32(bt*s.DH, attnTol), outF32(bt*s.DV, attnTol),
				inF32(r, bt*s.DV, 1), causalProbs(r, s.Batch, s.T), inF32(r, bt*s.DH, 1), inF32(r, bt*s.DH, 1), inF32(r, bt*s.DV, 1)},
				func(k device.Kernels, b []device.Buffer) error {
					return k.AttentionBackward(b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], s)
				}},
		)
	}
	return cs
}

// pointwiseCases are the cases of PermuteDims, Pointwise,
// PointwiseBackward, DropoutMask and ArgmaxRows. The activations compute
// in double and round once on both sides; the fake's exp and tanh are
// glibc's (a GPU's are CUDA's) where the reference's are Go's, and may
// differ in the double's last bit, which moves the float32 result by one
// ulp at a near-tie: 2⁻²³ relative. ReLU, the permutation, the dropout
// mask (the same integer hash) and argmax (a selection) are bit-exact.
func pointwiseCases(r *rand.Rand, sh shapes) []kcase {
	const ulp = 0x1p-23
	var cs []kcase
	specials := []float64{0, math.Copysign(0, -1), math.NaN(), math.Inf(1), math.Inf(-1), 100, -100, 1e-30, -1e-30, 20, -20}
	for _, n := range sh.elems {
		x := randInit(r, n, 6)
		copy(x, specials)
		for _, f := range []device.Pointwise{device.ReLU, device.SiLU, device.Tanh, device.Sigmoid} {
			tl := tol{ulp, 0}
			if f == device.ReLU {
				tl = exact
			}
			// Tanh's and Sigmoid's backward take the forward's result.
			saved := kbuf{dt: comm.Float32, n: n, init: x}
			if f == device.Tanh || f == device.Sigmoid {
				saved = inF32(r, n, 1)
			}
			cs = append(cs,
				kcase{fmt.Sprintf("Pointwise %v/%d", f, n), []kbuf{outF32(n, tl), {dt: comm.Float32, n: n, init: x}},
					func(k device.Kernels, b []device.Buffer) error { return k.Pointwise(f, b[0], b[1]) }},
				kcase{fmt.Sprintf("Pointwise %v in place/%d", f, n), []kbuf{{dt: comm.Float32, n: n, init: x, out: true, tol: tl}},
					func(k device.Kernels, b []device.Buffer) error { return k.Pointwise(f, b[0], b[0]) }},
				kcase{fmt.Sprintf("PointwiseBackward %v/%d", f, n), []kbuf{outF32(n, tl), saved, inF32(r, n, 1)},
					func(k device.Kernels, b []device.Buffer) error { return k.PointwiseBackward(f, b[0], b[1], b[2]) }},
			)
		}
	}
	for _, c := range []struct{ shape, perm []int }{
		{nil, nil},
		{[]int{7}, []int{0}},
		{[]int{5, 33}, []int{1, 0}},
		{[]int{2, 3, 4}, []int{2, 0, 1}},
		{[]int{3, 4, 5, 6}, []int{0, 2, 1, 3}},
		{[]int{2, 3, 4, 5, 3, 2}, []int{5, 4, 3, 2, 1, 0}},             // six dims, none merged
		{[]int{2, 1, 3, 1, 2, 3, 2, 2}, []int{7, 0, 5, 2, 4, 6, 1, 3}}, // eight dims: size-1 dims dropped, 2 merged, five left
		{[]int{3, 0, 4}, []int{2, 1, 0}},
		{[]int{1, 1}, []int{1, 0}},
	} {
		n := prod(c.shape)
		cs = append(cs, kcase{fmt.Sprintf("PermuteDims/%v/%v", c.shape, c.perm), []kbuf{outF32(n, exact), inF32(r, n, 2)},
			func(k device.Kernels, b []device.Buffer) error { return k.PermuteDims(b[0], b[1], c.shape, c.perm) }})
	}
	for _, c := range []struct {
		global, offset, box []int
		p                   float64
		seed, step          uint64
	}{
		{nil, nil, nil, 0.5, 1, 0},
		{[]int{1000}, []int{0}, []int{1000}, 0.1, 7, 3},
		{[]int{1000}, []int{333}, []int{334}, 0.5, 7, 3},
		{[]int{17, 33}, []int{4, 0}, []int{5, 33}, 0.9, 1<<63 + 12345, 1<<40 + 1},
		{[]int{6, 7, 65}, []int{2, 3, 32}, []int{3, 4, 33}, 0.25, 99, 2},
		{[]int{6, 7, 65}, []int{2, 3, 32}, []int{0, 4, 33}, 0.25, 99, 2},
		{[]int{2, 3, 2, 5, 3, 7}, []int{1, 1, 0, 2, 1, 3}, []int{1, 2, 2, 3, 2, 4}, 0, 5, 5},
		// Seven dims: size-1 dims dropped, spanned dims merged, three left.
		{[]int{4, 1, 3, 5, 2, 6, 3}, []int{1, 0, 0, 2, 1, 0, 0}, []int{2, 1, 3, 3, 1, 6, 3}, 0.3, 11, 4},
	} {
		n := prod(c.box)
		cs = append(cs, kcase{fmt.Sprintf("DropoutMask/%+v", c), []kbuf{outF32(n, exact)},
			func(k device.Kernels, b []device.Buffer) error {
				return k.DropoutMask(b[0], c.offset, c.box, c.global, c.p, c.seed, c.step)
			}})
	}
	for _, rows := range append([]int{0}, sh.rows...) {
		for _, n := range sh.n {
			x := make([]float64, rows*n)
			for i := range x {
				x[i] = float64(r.IntN(5)) // many ties
			}
			if rows > 2 {
				for j := range n { // a row of −∞
					x[n+j] = math.Inf(-1)
				}
				x[2*n+n-1] = math.NaN() // a NaN last, one in the middle
				x[2*n+n/2] = math.NaN()
			}
			cs = append(cs, kcase{fmt.Sprintf("ArgmaxRows/%dx%d", rows, n), []kbuf{{dt: comm.Int64, n: rows, out: true}, {dt: comm.Float32, n: rows * n, init: x}},
				func(k device.Kernels, b []device.Buffer) error { return k.ArgmaxRows(b[0], b[1], n) }})
		}
	}
	cs = append(cs, dimCases(r, sh)...)
	return append(cs, deviceMoECases(r)...)
}

// deviceMoECases are the cases of the device.MoEKernels methods, on dropless
// and capacity routings with unrouted slots. Gathers are bit-exact; the
// gate-weighted sums add in slot order on both sides (a GPU may fuse the
// multiply-add: 1e-6 relative), the gate gradients in double (1e-6).
func deviceMoECases(r *rand.Rand) []kcase {
	var cs []kcase
	const tokens, topK, experts = 7, 2, 3
	for _, capacity := range []int{0, 2} {
		ex := make([]int32, tokens*topK)
		for i := range ex {
			ex[i] = int32(r.IntN(experts+1)) - 1 // some −1: unrouted
		}
		rt := &kernels.Routing{}
		if err := kernels.PlanRouting(rt, ex, topK, experts, capacity); err != nil {
			panic(err)
		}
		rows, slots := rt.Rows(), tokens*topK
		for _, d := range []int{1, 5, 33} {
			name := fmt.Sprintf("capacity %d, d %d", capacity, d)
			moeTol := tol{1e-6, 1e-7}
			cs = append(cs,
				kcase{"Permute/" + name, []kbuf{outF32(rows*d, exact), inF32(r, tokens*d, 2)},
					func(k device.Kernels, b []device.Buffer) error {
						return k.(device.MoEKernels).Permute(b[0], b[1], d, rt)
					}},
				kcase{"Unpermute/" + name, []kbuf{outF32(tokens*d, moeTol), inF32(r, rows*d, 2), inF32(r, slots, 1)},
					func(k device.Kernels, b []device.Buffer) error {
						return k.(device.MoEKernels).Unpermute(b[0], b[1], b[2], d, rt)
					}},
				kcase{"Unpermute no gates/" + name, []kbuf{outF32(tokens*d, moeTol), inF32(r, rows*d, 2)},
					func(k device.Kernels, b []device.Buffer) error {
						return k.(device.MoEKernels).Unpermute(b[0], b[1], nil, d, rt)
					}},
				kcase{"UnpermuteBackward/" + name, []kbuf{outF32(rows*d, moeTol), outF32(slots, tol{1e-6, 1e-6}), inF32(r, tokens*d, 1),
					inF32(r, rows*d, 2), inF32(r, slots, 1)},
					func(k device.Kernels, b []device.Buffer) error {
						return k.(device.MoEKernels).UnpermuteBackward(b[0], b[1], b[2], b[3], b[4], d, rt)
					}},
				kcase{"UnpermuteBackward dpacked only/" + name, []kbuf{outF32(rows*d, moeTol), inF32(r, tokens*d, 1)},
					func(k device.Kernels, b []device.Buffer) error {
						return k.(device.MoEKernels).UnpermuteBackward(b[0], nil, b[1], nil, nil, d, rt)
					}},
			)
		}
	}
	const ranks, local, d = 2, 3, 5
	counts := make([]int, ranks*local)
	total := 0
	for i := range counts {
		counts[i] = r.IntN(4)
		total += counts[i]
	}
	cs = append(cs,
		kcase{fmt.Sprintf("GroupByExpert/%v", counts), []kbuf{outF32(total*d, exact), inF32(r, total*d, 2)},
			func(k device.Kernels, b []device.Buffer) error {
				return k.(device.MoEKernels).GroupByExpert(b[0], b[1], d, counts, ranks, local)
			}},
		kcase{fmt.Sprintf("GroupByRank/%v", counts), []kbuf{outF32(total*d, exact), inF32(r, total*d, 2)},
			func(k device.Kernels, b []device.Buffer) error {
				return k.(device.MoEKernels).GroupByRank(b[0], b[1], d, counts, ranks, local)
			}},
	)
	return cs
}

// dimCases are the cases of SoftmaxDim, CrossEntropyMean and their
// backwards. The softmax over a middle dim computes in double on both
// sides with the host's exp and log (glibc's in the fake, CUDA's on a GPU,
// Go's for the reference), which may differ in the double's last bit, and
// a GPU may fuse a multiply-add: one float32 rounding apart, 2⁻²² relative
// plus 1e-7 absolute where a log-softmax near 0 cancels. The mean
// cross-entropy has xentTol's reasons (float32 expf terms in double sums).
func dimCases(r *rand.Rand, sh shapes) []kcase {
	var cs []kcase
	dimTol := tol{0x1p-22, 1e-7}
	for _, c := range [][3]int{{1, 5, 1}, {3, 7, 4}, {2, 33, 40}, {1, 300, 1}, {2, 0, 3}, {0, 4, 5}} {
		outer, n, inner := c[0], c[1], c[2]
		m := outer * n * inner
		for _, log := range []bool{false, true} {
			x := randInit(r, m, 6)
			cs = append(cs,
				kcase{fmt.Sprintf("SoftmaxDim log %v/%v", log, c), []kbuf{outF32(m, dimTol), {dt: comm.Float32, n: m, init: x}},
					func(k device.Kernels, b []device.Buffer) error { return k.SoftmaxDim(b[0], b[1], outer, n, inner, log) }},
				kcase{fmt.Sprintf("SoftmaxDim in place log %v/%v", log, c), []kbuf{{dt: comm.Float32, n: m, init: x, out: true, tol: dimTol}},
					func(k device.Kernels, b []device.Buffer) error { return k.SoftmaxDim(b[0], b[0], outer, n, inner, log) }},
				kcase{fmt.Sprintf("SoftmaxDimBackward log %v/%v", log, c), []kbuf{outF32(m, dimTol), inF32(r, m, 1), inF32(r, m, 1)},
					func(k device.Kernels, b []device.Buffer) error {
						return k.SoftmaxDimBackward(b[0], b[1], b[2], outer, n, inner, log)
					}},
			)
		}
	}
	for _, rows := range append([]int{0}, sh.rows...) {
		for _, v := range sh.vocab {
			targets := make([]float64, rows)
			for i := range targets {
				targets[i] = float64(r.IntN(v))
			}
			logits := randInit(r, rows*v, 6)
			for _, count := range []int{rows, 2*rows + 1} {
				cs = append(cs,
					kcase{fmt.Sprintf("CrossEntropyMean/%dx%d/%d", rows, v, count), []kbuf{{dt: comm.Float32, n: 1, out: true, tol: xentTol},
						{dt: comm.Float64, n: rows, out: true, tol: xentTol}, {dt: comm.Float32, n: rows * v, init: logits}, {dt: comm.Int64, n: rows, init: targets}},
						func(k device.Kernels, b []device.Buffer) error {
							return k.CrossEntropyMean(b[0], b[1], b[2], b[3], v, count)
						}},
					kcase{fmt.Sprintf("CrossEntropyMean no lse/%dx%d/%d", rows, v, count), []kbuf{{dt: comm.Float32, n: 1, out: true, tol: xentTol},
						{dt: comm.Float32, n: rows * v, init: logits}, {dt: comm.Int64, n: rows, init: targets}},
						func(k device.Kernels, b []device.Buffer) error {
							return k.CrossEntropyMean(b[0], nil, b[1], b[2], v, count)
						}},
					kcase{fmt.Sprintf("CrossEntropyMeanBackward/%dx%d/%d", rows, v, count), []kbuf{outF32(rows*v, tol{2e-6, 1e-7}),
						{dt: comm.Float32, n: rows * v, init: logits}, {dt: comm.Int64, n: rows, init: targets},
						{dt: comm.Float64, n: rows, init: lse(logits, rows, v)}, {dt: comm.Float32, n: 1, init: []float64{0.7}}},
						func(k device.Kernels, b []device.Buffer) error {
							return k.CrossEntropyMeanBackward(b[0], b[1], b[2], b[3], b[4], v, count)
						}},
				)
			}
		}
	}
	return cs
}

// lnStats are the float64 mean (or rstd) of rows of x, as kernels.LayerNorm
// keeps them.
func lnStats(x []float64, rows, n int, rstd bool) kbuf {
	out := make([]float64, rows)
	for i := range rows {
		xr := make([]float64, n)
		for j := range n {
			xr[j] = float64(float32(x[i*n+j]))
		}
		mu := 0.0
		for _, v := range xr {
			mu += v
		}
		mu /= float64(n)
		q := 0.0
		for _, v := range xr {
			q += (v - mu) * (v - mu)
		}
		out[i] = mu
		if rstd {
			out[i] = 1 / math.Sqrt(q/float64(n)+1e-5)
		}
	}
	return kbuf{dt: comm.Float64, n: rows, init: out}
}

// lse is each row's log-sum-exp of the float32 logits.
func lse(logits []float64, rows, v int) []float64 {
	out := make([]float64, rows)
	for i := range rows {
		mx := math.Inf(-1)
		for j := range v {
			mx = math.Max(mx, float64(float32(logits[i*v+j])))
		}
		s := 0.0
		for j := range v {
			s += math.Exp(float64(float32(logits[i*v+j])) - mx)
		}
		out[i] = mx + math.Log(s)
	}
	return out
}

// causalProbs are blocks of causal softmax rows: zero above the diagonal.
func causalProbs(r *rand.Rand, blocks, t int) kbuf {
	out := make([]float64, blocks*t*t)
	for b := range blocks {
		for i := range t {
			s := 0.0
			for j := 0; j <= i; j++ {
				out[(b*t+i)*t+j] = r.Float64()
				s += out[(b*t+i)*t+j]
			}
			for j := 0; j <= i; j++ {
				out[(b*t+i)*t+j] /= s
			}
		}
	}
	return kbuf{dt: comm.Float32, n: blocks * t * t, init: out}
}

// runKernelCases runs every case on d and on ref and compares the
// outputs. lastError, when not nil, says why the fake's last launch
// failed.
func runKernelCases(t *testing.T, d, ref device.Device, sh shapes, lastError func() string) {
	t.Helper()
	r := rand.New(rand.NewPCG(27, 5))
	for _, c := range kernelCases(r, sh) {
		got, err := runCase(d, c)
		if err != nil {
			if lastError != nil {
				err = fmt.Errorf("%w (fake: %s)", err, lastError())
			}
			t.Fatalf("%s on %s: %v", c.name, d.Name(), err)
		}
		want, err := runCase(ref, c)
		if err != nil {
			t.Fatalf("%s on %s: %v", c.name, ref.Name(), err)
		}
		for i, b := range c.bufs {
			if b.out {
				compareOut(t, fmt.Sprintf("%s: output %d", c.name, i), got[i], want[i], b.tol)
			}
		}
	}
}

// runCase makes c's buffers on d, runs c and returns the contents of its
// buffers as float64s.
func runCase(d device.Device, c kcase) ([][]float64, error) {
	bufs := make([]device.Buffer, len(c.bufs))
	defer func() {
		for _, b := range bufs {
			if b != nil {
				_ = b.Free()
			}
		}
	}()
	for i, kb := range c.bufs {
		b, err := d.Alloc(kb.dt, kb.n)
		if err != nil {
			return nil, err
		}
		bufs[i] = b
		if err := d.CopyFromHost(b, toHost(kb.dt, kb.n, kb.init)); err != nil {
			return nil, err
		}
	}
	if err := c.call(d.Kernels(), bufs); err != nil {
		return nil, err
	}
	if err := d.Synchronize(); err != nil {
		return nil, err
	}
	out := make([][]float64, len(bufs))
	for i, kb := range c.bufs {
		h := toHost(kb.dt, kb.n, nil)
		if err := d.CopyToHost(h, bufs[i]); err != nil {
			return nil, err
		}
		out[i] = fromHost(h)
	}
	return out, nil
}

// toHost makes a host buffer of n elements of dt holding init (NaN, or
// 0x5555 for integers, when nil).
func toHost(dt comm.DType, n int, init []float64) *comm.HostBuffer {
	at := func(i int) float64 {
		if init == nil {
			return math.NaN()
		}
		return init[i]
	}
	switch dt {
	case comm.Float32:
		s := make([]float32, n)
		for i := range s {
			s[i] = float32(at(i))
		}
		return comm.Host(s)
	case comm.Float64:
		s := make([]float64, n)
		for i := range s {
			s[i] = at(i)
		}
		return comm.Host(s)
	case comm.Int64:
		s := make([]int64, n)
		for i := range s {
			s[i] = 0x5555
			if init != nil {
				s[i] = int64(init[i])
			}
		}
		return comm.Host(s)
	case comm.BFloat16:
		s := make([]comm.BFloat16Bits, n)
		for i := range s {
			s[i] = comm.BFloat16Bits(bf16Bits(float32(at(i))))
		}
		return comm.Host(s)
	}
	s := make([]comm.Float16Bits, n)
	for i := range s {
		s[i] = 0x7e00 // NaN
	}
	return comm.Host(s)
}

// bf16Bits rounds f to bfloat16 to nearest even.
func bf16Bits(f float32) uint16 {
	b := math.Float32bits(f)
	if b&0x7fffffff > 0x7f800000 {
		return uint16(b>>16) | 0x40
	}
	return uint16((b + 0x7fff + (b>>16)&1) >> 16)
}

// fromHost reads h as float64s (2-byte types as their bit patterns, so
// that they compare bit for bit).
func fromHost(h *comm.HostBuffer) []float64 {
	var out []float64
	switch h.DType() {
	case comm.Float32:
		for _, v := range h.Float32s() {
			out = append(out, float64(v))
		}
	case comm.Float64:
		out = append(out, h.Float64s()...)
	case comm.Int64:
		for _, v := range h.Int64s() {
			out = append(out, float64(v))
		}
	case comm.BFloat16:
		for _, v := range h.BFloat16s() {
			out = append(out, float64(v))
		}
	case comm.Float16:
		for _, v := range h.Float16s() {
			out = append(out, float64(v))
		}
	}
	return out
}

// compareOut reports the first element outside t, and NaNs that do not
// match.
func compareOut(t *testing.T, what string, got, want []float64, tl tol) {
	t.Helper()
	for i := range want {
		g, w := got[i], want[i]
		if math.IsNaN(g) || math.IsNaN(w) {
			if math.IsNaN(g) != math.IsNaN(w) {
				t.Errorf("%s: [%d] = %v, want %v", what, i, g, w)
				return
			}
			continue
		}
		if math.Abs(g-w) > tl.rtol*math.Abs(w)+tl.atol {
			t.Errorf("%s: [%d] = %v, want %v (|diff| %.3g > %.3g·|want| + %.3g)", what, i, g, w, math.Abs(g-w), tl.rtol, tl.atol)
			return
		}
	}
}
