//go:build !(linux && (amd64 || arm64))

package cuda

import (
	"errors"
	"runtime"
)

// errPlatform is the reason no library loads on this platform.
func errPlatform() error {
	return errors.New("loading CUDA libraries is implemented on linux/amd64 and linux/arm64 only, not " +
		runtime.GOOS + "/" + runtime.GOARCH)
}

func openDriver(string) (*driverFns, string, error) { return nil, "", errPlatform() }

func openNVRTC(string) (*nvrtcFns, uintptr, string, error) { return nil, 0, "", errPlatform() }

func closeLib(uintptr) error { return nil }
