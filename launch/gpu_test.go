//go:build linux && (amd64 || arm64)

package launch

import (
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/b7ea7098/loom/device/cuda"
)

// fakeDriver builds a CUDA driver stub whose cuInit returns initRC and
// whose cuDeviceGetCount reports n devices.
func fakeDriver(t *testing.T, gcc, name, initRC, n string) string {
	t.Helper()
	dir := t.TempDir()
	src := filepath.Join(dir, name+".c")
	code := "int cuInit(unsigned f) { return " + initRC + "; }\nint cuDeviceGetCount(int *n) { *n = " + n + "; return 0; }\n"
	if err := os.WriteFile(src, []byte(code), 0o644); err != nil {
		t.Fatal(err)
	}
	lib := filepath.Join(dir, "lib"+name+".so")
	if out, err := exec.Command(gcc, "-shared", "-fPIC", "-o", lib, src).CombinedOutput(); err != nil {
		t.Fatalf("building %s: %v\n%s", name, err, out)
	}
	return lib
}

// TestHasGPU: the automatic choice between NCCL and TCP sees a GPU only
// where the driver loads, initialises and counts at least one device.
func TestHasGPU(t *testing.T) {
	gcc, err := exec.LookPath("gcc")
	if err != nil {
		t.Skip("no gcc to build the fake CUDA drivers")
	}
	tests := []struct {
		name, driver string
		want         bool
	}{
		{name: "two devices", driver: fakeDriver(t, gcc, "two", "0", "2"), want: true},
		{name: "no device (CUDA_ERROR_NO_DEVICE)", driver: fakeDriver(t, gcc, "nodev", "100", "0")},
		{name: "zero devices", driver: fakeDriver(t, gcc, "zero", "0", "0")},
		{name: "no driver library", driver: filepath.Join(t.TempDir(), "libcuda-missing.so")},
		{name: "driver off", driver: "off"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := hasGPU(env(cuda.DriverEnv, tt.driver)); got != tt.want {
				t.Errorf("hasGPU with %s=%s = %v, want %v", cuda.DriverEnv, tt.driver, got, tt.want)
			}
			job, err := Detect(env(cuda.DriverEnv, tt.driver, "RANK", "0", "WORLD_SIZE", "1", "LOCAL_RANK", "0", "MASTER_ADDR", "127.0.0.1", "MASTER_PORT", "1"), "", 1)
			if err != nil {
				t.Fatal(err)
			}
			if want := map[bool]string{true: NCCL, false: TCP}[tt.want]; job.Backend != want {
				t.Errorf("Detect under loomrun chose %s, want %s", job.Backend, want)
			}
		})
	}
}
