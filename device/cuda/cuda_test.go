package cuda

import (
	"errors"
	"math/rand/v2"
	"regexp"
	"slices"
	"strings"
	"testing"
	"unsafe"

	"github.com/b7ea7098/loom/kernels"
)

// Tests of the parts that need no GPU: argument packing, library discovery
// and its reporting, architecture choice, launch geometry, row maps and the
// kernel source. fake_test.go runs the whole driver path against a fake
// driver built from testdata/fakecuda.cpp; gpu_test.go runs on a real GPU.

func TestPackArgs(t *testing.T) {
	args := []any{int32(-2), uint32(7), int64(-3), uint64(1 << 40), float32(1.5), float64(-0.25),
		DevicePtr(0xdead0000), Buffer{Ptr: 0xbeef00, Bytes: 64}}
	k, err := packArgs(args)
	if err != nil {
		t.Fatal(err)
	}
	if len(k.vals) != len(args) || len(k.ptrs) != len(args) {
		t.Fatalf("%d slots, %d pointers for %d args", len(k.vals), len(k.ptrs), len(args))
	}
	for i := range args {
		if k.ptrs[i] != unsafe.Pointer(&k.vals[i]) {
			t.Fatalf("pointer %d does not point at its slot", i)
		}
	}
	// Read each slot back the way cuLaunchKernel does: as many bytes as
	// the kernel parameter has, from the slot's address.
	if v := *(*int32)(k.ptrs[0]); v != -2 {
		t.Errorf("int32 slot = %d", v)
	}
	if v := *(*uint32)(k.ptrs[1]); v != 7 {
		t.Errorf("uint32 slot = %d", v)
	}
	if v := *(*int64)(k.ptrs[2]); v != -3 {
		t.Errorf("int64 slot = %d", v)
	}
	if v := *(*uint64)(k.ptrs[3]); v != 1<<40 {
		t.Errorf("uint64 slot = %d", v)
	}
	if v := *(*float32)(k.ptrs[4]); v != 1.5 {
		t.Errorf("float32 slot = %v", v)
	}
	if v := *(*float64)(k.ptrs[5]); v != -0.25 {
		t.Errorf("float64 slot = %v", v)
	}
	if v := *(*uint64)(k.ptrs[6]); v != 0xdead0000 {
		t.Errorf("DevicePtr slot = %#x", v)
	}
	if v := *(*uint64)(k.ptrs[7]); v != 0xbeef00 {
		t.Errorf("Buffer slot = %#x", v)
	}
	// A 4-byte argument leaves the rest of its slot zero.
	if *(*int32)(unsafe.Add(k.ptrs[0], 4)) != 0 {
		t.Errorf("int32 slot = %#x, want its other half zero", k.vals[0])
	}

	for _, c := range []struct {
		arg  any
		want string
	}{
		{3, "argument 1 is an int (3): pass int32"},
		{"x", "argument 1 has unsupported type string"},
		{&k.vals[0], "unsupported type *uint64"},
		{[]float32{1}, "unsupported type []float32"},
	} {
		if _, err := packArgs([]any{int32(0), c.arg}); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("packArgs(%T): err = %v, want %q", c.arg, err, c.want)
		}
	}
	if _, err := packArgs(make([]any, maxKernelArgs+1)); err == nil {
		t.Error("too many arguments: no error")
	}
	if k, err := packArgs(nil); err != nil || len(k.vals) != 0 {
		t.Errorf("no arguments: %v, %v", k, err)
	}
}

func TestNVRTCCandidates(t *testing.T) {
	env := map[string]string{"CUDA_HOME": "/opt/cuda"}
	files := map[string][]string{
		"/opt/cuda/lib64/libnvrtc.so.*":               {"/opt/cuda/lib64/libnvrtc.so.12", "/opt/cuda/lib64/libnvrtc.so.12.4.99"},
		"/usr/local/cuda-*/lib64/libnvrtc.so.*":       {"/usr/local/cuda-11.8/lib64/libnvrtc.so.11.8.89", "/usr/local/cuda-12.4/lib64/libnvrtc.so.12.4.127"},
		"/usr/local/cuda/targets/*/lib/libnvrtc.so.*": {"/usr/local/cuda/targets/x86_64-linux/lib/libnvrtc.so.12.4.127"},
	}
	got := nvrtcCandidates(func(k string) string { return env[k] },
		func(p string) ([]string, error) { return files[p], nil })
	want := []string{
		"libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so.11.2", "libnvrtc.so",
		"/usr/local/cuda-12.4/lib64/libnvrtc.so.12.4.127",
		"/usr/local/cuda/targets/x86_64-linux/lib/libnvrtc.so.12.4.127",
		"/opt/cuda/lib64/libnvrtc.so.12.4.99",
		"/opt/cuda/lib64/libnvrtc.so.12",
		"/usr/local/cuda-11.8/lib64/libnvrtc.so.11.8.89",
	}
	if !slices.Equal(got, want) {
		t.Errorf("candidates:\n got %q\nwant %q", got, want)
	}
	if d := DriverCandidates(); d[0] != "libcuda.so.1" {
		t.Errorf("DriverCandidates()[0] = %q, want libcuda.so.1", d[0])
	}
}

// TestLoadReporting checks what Load reports about the libraries it tried,
// whatever this machine has.
func TestLoadReporting(t *testing.T) {
	t.Setenv(DriverEnv, "")
	t.Setenv(NVRTCEnv, "")
	l, err := Load()
	if err == nil {
		defer l.Close()
		tried := l.Tried()
		if len(tried) == 0 || tried[len(tried)-1].Err != nil {
			t.Fatalf("Load succeeded but Tried = %v", tried)
		}
		if l.DriverPath() == "" || l.NVRTCPath() == "" {
			t.Errorf("paths %q, %q", l.DriverPath(), l.NVRTCPath())
		}
		t.Logf("loaded %s and %s after %v", l.DriverPath(), l.NVRTCPath(), tried)
	} else {
		var le *LoadError
		var ce *Error
		switch {
		case errors.As(err, &le):
			if le.Forced || len(le.Tried) == 0 {
				t.Fatalf("LoadError %+v", le)
			}
			for _, a := range le.Tried {
				if a.Library == le.Library && a.Err == nil {
					t.Fatalf("attempt %v has no reason", a)
				}
			}
			if le.Library == "driver" && !strings.Contains(err.Error(), "libcuda.so.1 (") {
				t.Errorf("error %q does not name libcuda.so.1", err)
			}
			t.Logf("no CUDA here, as reported: %v", err)
		case errors.As(err, &ce):
			t.Logf("driver loaded, cuInit failed: %v", err)
		default:
			t.Fatalf("Load error of type %T: %v", err, err)
		}
	}

	// A forced library that does not exist is an error naming it, from an
	// option or from the environment.
	bogus := t.TempDir() + "/libcuda-missing.so.1"
	_, err = Load(WithDriver(bogus), WithNVRTC(Off))
	var le *LoadError
	if !errors.As(err, &le) || !le.Forced || le.Library != "driver" || len(le.Tried) != 1 || le.Tried[0].Name != bogus {
		t.Fatalf("forced driver: err = %v", err)
	}
	if !strings.Contains(err.Error(), "(forced)") || !strings.Contains(err.Error(), bogus) {
		t.Errorf("forced driver error %q", err)
	}
	t.Setenv(NVRTCEnv, bogus+".nvrtc")
	_, err = Load(WithDriver(Off))
	if !errors.As(err, &le) || le.Library != "nvrtc" || !strings.Contains(err.Error(), bogus+".nvrtc") {
		t.Fatalf("NVRTC from the environment: err = %v", err)
	}
	// An option overrides the environment.
	t.Setenv(DriverEnv, bogus)
	l, err = Load(WithDriver(Off), WithNVRTC(Off))
	if err != nil {
		t.Fatalf("both off: %v", err)
	}
	if _, err := l.DeviceCount(); err == nil || !strings.Contains(err.Error(), "driver was not loaded") {
		t.Errorf("DeviceCount without a driver: %v", err)
	}
	if _, err := l.Compile("", "x", CompileOptions{Arch: 90}); err == nil || !strings.Contains(err.Error(), "NVRTC was not loaded") {
		t.Errorf("Compile without NVRTC: %v", err)
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	if err := l.Close(); err != nil {
		t.Fatal("second Close:", err)
	}
	if _, err := l.Open(0); err == nil || !strings.Contains(err.Error(), "closed") {
		t.Errorf("Open after Close: %v", err)
	}
}

func TestErrorMessages(t *testing.T) {
	e := &Error{Call: "cuMemAlloc_v2", Code: 2, Name: "CUDA_ERROR_OUT_OF_MEMORY", Msg: "out of memory", Context: "allocating 8 bytes"}
	if got, want := e.Error(), "cuda: allocating 8 bytes: cuMemAlloc_v2 failed with 2 CUDA_ERROR_OUT_OF_MEMORY (out of memory)"; got != want {
		t.Errorf("Error() = %q, want %q", got, want)
	}
	ce := &CompileError{Err: &Error{Call: "nvrtcCompileProgram", Code: 6, Name: nvrtcResultName(6)}, Log: "x.cu(3): error\n", Options: []string{"-arch"}}
	if !strings.Contains(ce.Error(), "NVRTC_ERROR_COMPILATION") || !strings.Contains(ce.Error(), "x.cu(3): error") {
		t.Errorf("CompileError = %q", ce.Error())
	}
	var target *Error
	if !errors.As(ce, &target) || target.Code != 6 {
		t.Error("CompileError does not unwrap to its *Error")
	}
	le := &LoadError{Library: "nvrtc", Tried: []Attempt{
		{Library: "driver", Name: "libcuda.so.1"},
		{Library: "nvrtc", Name: "libnvrtc.so.13", Err: errors.New("not found")},
		{Library: "nvrtc", Name: "libnvrtc.so.12", Err: errors.New("missing symbols nvrtcGetPTX")},
	}}
	if got, want := le.Error(), "cuda: no NVRTC library could be loaded; tried libnvrtc.so.13 (not found); libnvrtc.so.12 (missing symbols nvrtcGetPTX); set LOOM_NVRTC to the path of another copy"; got != want {
		t.Errorf("LoadError = %q, want %q", got, want)
	}
	if s := le.Tried[0].String(); s != "driver libcuda.so.1: ok" {
		t.Errorf("Attempt.String() = %q", s)
	}
	if nvrtcResultName(99) != "" || nvrtcResultName(0) != "NVRTC_SUCCESS" {
		t.Error("nvrtcResultName")
	}
}

func TestChooseArch(t *testing.T) {
	for _, c := range []struct {
		cc        int
		supported []int
		arch      int
		ptx       bool
		fails     bool
	}{
		{90, []int{75, 80, 86, 89, 90}, 90, false, false},
		{89, []int{75, 80, 86, 90}, 86, false, false},     // sm_86 cubin runs on 8.9
		{100, []int{75, 80, 86, 89, 90}, 90, true, false}, // newer than NVRTC: PTX
		{120, []int{75, 80, 90, 100}, 100, true, false},
		{90, nil, 90, false, false},
		{70, []int{75, 80}, 0, false, true},
		{0, nil, 0, false, true},
	} {
		arch, ptx, err := ChooseArch(c.cc, c.supported)
		if (err != nil) != c.fails || arch != c.arch || ptx != c.ptx {
			t.Errorf("ChooseArch(%d, %v) = %d, %v, %v; want %d, %v, fails %v", c.cc, c.supported, arch, ptx, err, c.arch, c.ptx, c.fails)
		}
	}
	if got := CompileFlags(CompileOptions{Arch: 90, Extra: []string{"-lineinfo"}}); !slices.Equal(got, []string{"--gpu-architecture=sm_90", "-std=c++17", "-lineinfo"}) {
		t.Errorf("CompileFlags = %q", got)
	}
	if got := CompileFlags(CompileOptions{Arch: 80, PTX: true}); got[0] != "--gpu-architecture=compute_80" {
		t.Errorf("CompileFlags PTX = %q", got)
	}
}

func TestLaunchGeometry(t *testing.T) {
	for _, c := range []struct {
		rows, words int
		grid, block Dim3
	}{
		{1, 1, Dim3{X: 1}, Dim3{X: 1, Y: 256}},
		{100, 1, Dim3{X: 1}, Dim3{X: 1, Y: 256}},
		{100, 16, Dim3{X: 7}, Dim3{X: 16, Y: 16}},
		{100, 33, Dim3{X: 25}, Dim3{X: 64, Y: 4}},
		{100, 256, Dim3{X: 100}, Dim3{X: 256, Y: 1}},
		{10, 5000, Dim3{X: 10}, Dim3{X: 256, Y: 1}},
		{1 << 30, 1024, Dim3{X: 65535}, Dim3{X: 256, Y: 1}},
		{0, 0, Dim3{X: 1}, Dim3{X: 1, Y: 256}},
	} {
		g, b := rowLaunch(c.rows, c.words)
		if g != c.grid || b != c.block {
			t.Errorf("rowLaunch(%d, %d) = %v, %v, want %v, %v", c.rows, c.words, g, b, c.grid, c.block)
		}
		if b.X*max(b.Y, 1) != 256 {
			t.Errorf("rowLaunch(%d, %d): %d threads", c.rows, c.words, b.X*b.Y)
		}
	}
	for _, c := range []struct{ slots, grid int }{
		{0, 1}, {1, 1}, {8, 1}, {9, 2}, {1 << 20, 65535},
	} {
		g, b := warpLaunch(c.slots)
		if int(g.X) != c.grid || b != (Dim3{X: 256}) {
			t.Errorf("warpLaunch(%d) = %v, %v, want %d blocks of 256", c.slots, g, b, c.grid)
		}
	}
	for _, c := range []struct {
		rowBytes int
		ptrs     []DevicePtr
		want     int
	}{
		{4096, []DevicePtr{0x1000, 0x2000}, 16},
		{4 * 6, []DevicePtr{0x1000, 0x2000}, 8},
		{4 * 33, []DevicePtr{0x1000, 0x2000}, 4},
		{4096, []DevicePtr{0x1004, 0x2000}, 4},
		{3, []DevicePtr{0x1000}, 1},
	} {
		if got := wordSize(c.rowBytes, c.ptrs...); got != c.want {
			t.Errorf("wordSize(%d, %v) = %d, want %d", c.rowBytes, c.ptrs, got, c.want)
		}
	}
	if (Dim3{}).norm() != (Dim3{1, 1, 1}) {
		t.Error("Dim3 zero components do not count as 1")
	}
}

// TestGroupIndex checks the device regrouping map against package
// kernels' GroupByExpert and GroupByRank, applied as a host gather.
func TestGroupIndex(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for _, c := range []struct{ ranks, local int }{{0, 0}, {1, 1}, {2, 3}, {4, 2}, {3, 1}} {
		counts := make([]int, c.ranks*c.local)
		total := 0
		for i := range counts {
			counts[i] = rng.IntN(4)
			total += counts[i]
		}
		const d = 3
		src := make([]float64, total*d)
		for i := range src {
			src[i] = rng.Float64()
		}
		for _, toExpert := range []bool{true, false} {
			idx, err := GroupIndex(counts, c.ranks, c.local, toExpert)
			if err != nil {
				t.Fatal(err)
			}
			got := make([]float64, total*d)
			for i, s := range idx {
				copy(got[i*d:(i+1)*d], src[int(s)*d:])
			}
			want := make([]float64, total*d)
			if toExpert {
				err = kernels.GroupByExpert(want, src, d, counts, c.ranks, c.local)
			} else {
				err = kernels.GroupByRank(want, src, d, counts, c.ranks, c.local)
			}
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(got, want) {
				t.Errorf("%+v toExpert=%v: gather by GroupIndex differs from package kernels", c, toExpert)
			}
		}
	}
	if _, err := GroupIndex([]int{1, -1}, 1, 2, true); err == nil {
		t.Error("negative count: no error")
	}
	if _, err := GroupIndex([]int{1}, 1, 2, true); err == nil {
		t.Error("ragged counts: no error")
	}
}

// TestSource checks the kernel source without compiling it: every kernel
// that NewMoE looks up is defined extern "C", and the source needs no
// header. fake_test.go compiles it with g++ and runs it.
func TestSource(t *testing.T) {
	src := Source()
	if strings.Contains(src, "#include") {
		t.Error("the kernel source includes a header; NVRTC has none without a toolkit")
	}
	defined := map[string]bool{}
	for _, m := range regexp.MustCompile(`extern "C" __global__ void (\w+)\(`).FindAllStringSubmatch(src, -1) {
		defined[m[1]] = true
	}
	for _, n := range KernelNames() {
		if !defined[n] {
			t.Errorf("kernel %s is not defined in Source()", n)
		}
		delete(defined, n)
	}
	if len(defined) > 0 {
		t.Errorf("kernels defined but never looked up: %v", defined)
	}
	if strings.Count(src, "{") != strings.Count(src, "}") || strings.Count(src, "(") != strings.Count(src, ")") {
		t.Error("unbalanced braces or parentheses")
	}
	if !strings.Contains(src, `extern "C" __global__`) {
		t.Error(`no extern "C" __global__ kernel`)
	}
}

func TestDType(t *testing.T) {
	if Float32.Size() != 4 || Float64.Size() != 8 || DType(0).Size() != 0 {
		t.Error("DType.Size")
	}
	if Float32.String() != "float32" || DType(9).String() != "DType(9)" {
		t.Error("DType.String")
	}
}

// TestNVRTCNotFound: a Lib whose automatic search found no NVRTC fails
// where NVRTC is needed, with the *LoadError naming the library and its
// variable.
func TestNVRTCNotFound(t *testing.T) {
	l := &Lib{rtcErr: &LoadError{Library: "nvrtc", Tried: []Attempt{{Library: "nvrtc", Name: "libnvrtc.so.13", Err: errors.New("not found")}}}}
	_, err := l.Compile("", "x.cu", CompileOptions{Arch: 90})
	var le *LoadError
	if !errors.As(err, &le) || err.Error() != "cuda: Compile: cuda: no NVRTC library could be loaded; tried libnvrtc.so.13 (not found); set LOOM_NVRTC to the path of another copy" {
		t.Errorf("Compile without NVRTC: %v", err)
	}
	if _, _, err := l.NVRTCVersion(); !errors.As(err, &le) {
		t.Errorf("NVRTCVersion without NVRTC: %v", err)
	}
}
