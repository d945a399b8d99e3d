//go:build !(linux && cgo)

package topology

import (
	"fmt"
	"runtime"
)

// NVMLEnv names the environment variable that overrides the NVML library
// Discover loads (default libnvidia-ml.so.1). Without cgo on Linux it is
// not read: Discover always fails.
const NVMLEnv = "LOOM_NVML"

// Discover fails with ErrUnavailable: NVML is read through go-nvml, which
// needs cgo on Linux; this build is for runtime.GOOS without cgo.
func Discover() (*Topology, error) {
	return nil, fmt.Errorf("%w: this build (%s, without cgo) cannot load NVML", ErrUnavailable, runtime.GOOS)
}
