//go:build linux && (amd64 || arm64)

package cuda

import (
	"os"
	"testing"

	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/device/emu"
)

// gpuShapes are the GPU check's shapes: odd ones, and the sizes of the
// GPT-2-small rows (D = 768, V = 50304, T up to 256 here, to keep the CPU
// reference quick).
var gpuShapes = shapes{
	rows:  []int{1, 37, 1024},
	n:     []int{7, 768},
	elems: []int{1, 4099, 1 << 20},
	gemm:  [][3]int{{3, 5, 7}, {129, 65, 33}, {256, 768, 768}},
	attn:  []device.AttnShape{{Batch: 3, T: 5, DH: 7, DV: 4, Scale: 0.375}, {Batch: 12, T: 256, DH: 64, DV: 64, Scale: 0.125}},
	vocab: []int{7, 50304},
}

// TestGPUDeviceKernels runs every Kernels method of device 0 against the
// emulated device (package kernels' CPU code) with the tolerances of
// TestFakeDevice. It skips without a GPU (fails under LOOM_CUDA_REQUIRE=1).
func TestGPUDeviceKernels(t *testing.T) {
	d := openGPU(t)
	ref, err := emu.New(0)
	if err != nil {
		t.Fatal(err)
	}
	runKernelCases(t, d, ref, gpuShapes, nil)
	t.Logf("%s (%s): GEMM path %s; allocator %+v", d.Name(), d.Context().Name(), d.GEMMPath(), d.Memory().Stats())
	if err := ref.Close(); err != nil {
		t.Error(err)
	}
}

// openGPU opens device 0 of the machine's CUDA driver for t, closed (then
// the driver library) when t ends; without a usable GPU it skips, or
// fails under LOOM_CUDA_REQUIRE=1.
func openGPU(t *testing.T) *Device {
	t.Helper()
	l, err := Load()
	if err != nil {
		gpuUnusable(t, "no usable CUDA: %v", err)
	}
	t.Cleanup(func() { l.Close() })
	if n, err := l.DeviceCount(); err != nil || n == 0 {
		gpuUnusable(t, "no CUDA device (count %d, %v)", n, err)
	}
	d, err := OpenDevice(l, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := d.Close(); err != nil {
			t.Error(err)
		}
	})
	return d
}

// gpuUnusable skips, or fails under LOOM_CUDA_REQUIRE=1.
func gpuUnusable(t *testing.T, format string, args ...any) {
	t.Helper()
	if os.Getenv(requireEnv) == "1" {
		t.Fatalf(format+" ("+requireEnv+"=1)", args...)
	}
	t.Skipf(format, args...)
}
