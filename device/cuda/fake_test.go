//go:build linux && (amd64 || arm64)

package cuda

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/b7ea7098/loom/internal/dynlib"
)

// These tests load testdata/fakecuda.cpp, built here with g++, as both the
// CUDA driver and NVRTC. The fake runs the real kernel source on the CPU,
// so they cover everything but the GPU itself: dlopen and symbol binding,
// argument packing, launch geometry, size checks, error reporting, release
// of every resource, and the kernels' results against package kernels.

// fakeCounters reads the fake's resource counters.
type fakeCounters struct {
	allocs, ctxRefs, modules, events, streams func() int32
	launches, compiles                        func() int64
	setNVRTCVersion                           func(major, minor int32)
}

// buildFake compiles the fake driver once per test binary run into dir and
// returns its path; it skips the test when there is no C++ compiler.
func buildFake(t *testing.T) (string, *fakeCounters) {
	t.Helper()
	cxx, err := exec.LookPath("g++")
	if err != nil {
		t.Skip("no g++ to build the fake CUDA driver: ", err)
	}
	lib := filepath.Join(t.TempDir(), "libfakecuda.so")
	cmd := exec.Command(cxx, "-std=c++20", "-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-Wno-unused-parameter",
		"-I.", "-o", lib, filepath.Join("testdata", "fakecuda.cpp"), "-lpthread")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("building the fake driver (this compiles permute.cu as C++): %v\n%s", err, out)
	}
	dl, err := dynlib.Open(lib)
	if err != nil {
		t.Fatal(err)
	}
	f := &fakeCounters{}
	if err := dl.Bind([]dynlib.Symbol{
		{Name: "fake_live_allocs", Fn: &f.allocs}, {Name: "fake_ctx_refs", Fn: &f.ctxRefs}, {Name: "fake_modules", Fn: &f.modules},
		{Name: "fake_events", Fn: &f.events}, {Name: "fake_launches", Fn: &f.launches},
		{Name: "fake_streams", Fn: &f.streams}, {Name: "fake_compiles", Fn: &f.compiles},
		{Name: "fake_set_nvrtc_version", Fn: &f.setNVRTCVersion},
	}); err != nil {
		t.Fatal(err)
	}
	return lib, f
}

func TestFakeDriver(t *testing.T) {
	lib, fc := buildFake(t)
	l, err := Load(WithDriver(lib), WithNVRTC(lib), WithKernelCache(Off))
	if err != nil {
		t.Fatal(err)
	}
	if l.DriverPath() != lib || l.NVRTCPath() != lib {
		t.Errorf("paths %q, %q, want %q", l.DriverPath(), l.NVRTCPath(), lib)
	}
	if tr := l.Tried(); len(tr) != 2 || tr[0].Err != nil || tr[1].Err != nil || tr[0].Name != lib {
		t.Errorf("Tried() = %v", tr)
	}
	if v, err := l.DriverVersion(); err != nil || v != 12040 {
		t.Errorf("DriverVersion = %d, %v", v, err)
	}
	if a, b, err := l.NVRTCVersion(); err != nil || a != 12 || b != 4 {
		t.Errorf("NVRTCVersion = %d.%d, %v", a, b, err)
	}
	if a, err := l.SupportedArchs(); err != nil || !slices.Equal(a, []int{75, 80, 90}) {
		t.Errorf("SupportedArchs = %v, %v", a, err)
	}
	if n, err := l.DeviceCount(); err != nil || n != 1 {
		t.Errorf("DeviceCount = %d, %v", n, err)
	}

	// Failed calls name the call and the driver's error.
	_, err = l.Open(1)
	var ce *Error
	if !errors.As(err, &ce) || ce.Call != "cuDeviceGet" || ce.Name != "CUDA_ERROR_INVALID_DEVICE" {
		t.Errorf("Open(1): %v", err)
	}
	c, err := l.Open(0)
	if err != nil {
		t.Fatal(err)
	}
	if maj, min := c.ComputeCapability(); c.Name() != "loom fake GPU" || maj != 9 || min != 0 || c.Multiprocessors() != 4 || c.Ordinal() != 0 {
		t.Errorf("device %q %d.%d, %d SMs", c.Name(), maj, min, c.Multiprocessors())
	}
	_, err = c.Alloc(1 << 40)
	if !errors.As(err, &ce) || ce.Call != "cuMemAlloc_v2" || ce.Code != 2 || ce.Msg != "out of memory" ||
		!strings.Contains(err.Error(), "allocating 1099511627776 bytes: cuMemAlloc_v2 failed with 2 CUDA_ERROR_OUT_OF_MEMORY (out of memory)") {
		t.Errorf("huge Alloc: %v", err)
	}
	if _, err := c.Alloc(-1); err == nil {
		t.Error("negative Alloc: no error")
	}
	if _, err := c.LoadModule([]byte("garbage")); !errors.As(err, &ce) || ce.Call != "cuModuleLoadData" {
		t.Errorf("bad module: %v", err)
	}

	// Compilation errors carry NVRTC's log.
	_, err = l.Compile("#error no\n", "bad.cu", CompileOptions{Arch: 90})
	var cerr *CompileError
	if !errors.As(err, &cerr) || !strings.Contains(cerr.Log, "#error directive") || cerr.Err.Call != "nvrtcCompileProgram" {
		t.Errorf("Compile of bad source: %v", err)
	}
	if _, err := l.Compile("", "x.cu", CompileOptions{}); err == nil {
		t.Error("Compile without an architecture: no error")
	}
	p, err := l.Compile(Source(), "ptx.cu", CompileOptions{Arch: 80, PTX: true})
	if err != nil || !p.PTX || string(p.Image) != "FAKE compute_80\x00" {
		t.Errorf("PTX compile: %+v, %v", p, err)
	}

	m, err := NewMoE(c)
	if err != nil {
		t.Fatal(err)
	}
	if p := m.Program(); p.PTX || p.Options[0] != "--gpu-architecture=sm_90" {
		t.Errorf("NewMoE compiled with %q (PTX %v), want a cubin for sm_90", p.Options, p.PTX)
	}

	// Launch checks its arguments before calling the driver.
	f, err := m.fn(kGatherW4)
	if err != nil {
		t.Fatal(err)
	}
	if f.Name() != kGatherW4 {
		t.Errorf("Function.Name() = %q, want %q", f.Name(), kGatherW4)
	}
	if err := c.Legacy().Launch(f, Dim3{X: 1}, Dim3{X: 32}, 0, 5); err == nil || !strings.Contains(err.Error(), "is an int") {
		t.Errorf("Launch with an int: %v", err)
	}
	if err := c.Legacy().Launch(Function{}, Dim3{X: 1}, Dim3{X: 32}, 0); err == nil {
		t.Error("Launch of the zero Function: no error")
	}
	// The driver's own rejection of a launch is reported with the call.
	if err := c.Legacy().Launch(f, Dim3{X: 1}, Dim3{X: 2048}, 0, Buffer{}, Buffer{}, Buffer{}, int32(1), int64(0), int64(0)); !errors.As(err, &ce) || ce.Call != "cuLaunchKernel" {
		t.Errorf("Launch with 2048 threads: %v", err)
	}

	// Size checks stop kernels from reading or writing outside buffers.
	small, err := c.Alloc(16)
	if err != nil {
		t.Fatal(err)
	}
	checkMoE(t, c, m, false)
	if t.Failed() {
		return
	}

	dr := &DeviceRouting{Tokens: 4, TopK: 2, Rows: 8, ctx: c}
	if err := m.Permute(Float32, small, small, 4, dr); err == nil || !strings.Contains(err.Error(), "out holds 16 bytes") {
		t.Errorf("Permute into a small buffer: %v", err)
	}
	if err := m.Unpermute(DType(7), small, small, Buffer{}, 1, dr); err == nil {
		t.Error("unknown DType: no error")
	}
	if err := m.Permute(Float32, small, small, 1, nil); err == nil {
		t.Error("nil DeviceRouting: no error")
	}
	if _, err := m.UploadRowMap([]int32{0, 5}, 5); err == nil {
		t.Error("row map entry out of range: no error")
	}

	// Timing and device-to-device copies.
	before := fc.launches()
	d, err := c.Legacy().Time(func() error { return c.CopyDtoD(small, small, 16) })
	if err != nil || d != 250*time.Microsecond {
		t.Errorf("Time = %v, %v", d, err)
	}
	if err := c.CopyDtoD(small, small, 17); err == nil {
		t.Error("CopyDtoD past the end: no error")
	}
	if err := c.Zero(small, 16); err != nil {
		t.Error(err)
	}
	if fc.launches() != before {
		t.Error("a copy launched a kernel")
	}
	if err := c.Free(small); err != nil {
		t.Fatal(err)
	}

	// Everything is released.
	if err := m.Close(); err != nil {
		t.Fatal(err)
	}
	if err := m.Close(); err != nil {
		t.Fatal("second Close:", err)
	}
	if _, err := m.fn(kGatherW4); err == nil {
		t.Error("kernel of a closed MoE: no error")
	}
	// checkMoE's buffers are freed by its cleanups, which run after this
	// test body: check the counters then.
	t.Cleanup(func() {
		if err := c.Close(); err != nil {
			t.Error(err)
		}
		if err := c.Close(); err != nil {
			t.Error("second Close:", err)
		}
		if _, err := c.Alloc(4); err == nil {
			t.Error("Alloc on a closed Context: no error")
		}
		if err := l.Close(); err != nil {
			t.Error(err)
		}
		if a, r, mo, e, s := fc.allocs(), fc.ctxRefs(), fc.modules(), fc.events(), fc.streams(); a != 0 || r != 0 || mo != 0 || e != 0 || s != 0 {
			t.Errorf("leaked: %d allocations, %d context references, %d modules, %d events, %d streams", a, r, mo, e, s)
		}
	})
}

// TestFakeForcedByEnv checks that the environment variables choose the
// libraries.
func TestFakeForcedByEnv(t *testing.T) {
	lib, _ := buildFake(t)
	t.Setenv(DriverEnv, lib)
	t.Setenv(NVRTCEnv, lib)
	l, err := Load()
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	if tr := l.Tried(); len(tr) != 2 || tr[0].Name != lib || tr[1].Name != lib {
		t.Errorf("Tried() = %v", tr)
	}
	if _, err := os.Stat(l.DriverPath()); err != nil {
		t.Error(err)
	}
}
