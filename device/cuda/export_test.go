//go:build linux && (amd64 || arm64)

package cuda

import "testing"

// OpenFakeDevice builds the whole-device fake (driver, NVRTC and cuBLAS in
// one g++-built library) and returns a function that opens device 0 on it,
// for the external tests of package cuda_test: those may import packages
// that import cuda (models/gpt through train), which a test inside package
// cuda may not. It skips the test without g++.
func OpenFakeDevice(t *testing.T) func(t *testing.T) (*Lib, *Device) {
	f := buildDeviceFake(t)
	return func(t *testing.T) (*Lib, *Device) { return f.open(t, f.path, f.blas()) }
}
