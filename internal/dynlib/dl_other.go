//go:build !(linux && (amd64 || arm64))

package dynlib

import (
	"errors"
	"runtime"
)

// Supported reports whether this platform can load libraries.
const Supported = false

// unsupportedError rejects every library on this platform.
type unsupportedError struct{}

func (unsupportedError) Error() string {
	return "loading libraries at run time is implemented on linux/amd64 and linux/arm64 only, not " +
		runtime.GOOS + "/" + runtime.GOARCH
}

// Is makes the error match errors.ErrUnsupported.
func (unsupportedError) Is(target error) bool { return target == errors.ErrUnsupported }

func dlopen(string) (uintptr, error) { return 0, unsupportedError{} }

func dlsym(uintptr, string) (uintptr, bool) { return 0, false }

func dlclose(uintptr) error { return unsupportedError{} }

func registerFunc(any, uintptr) { panic(unsupportedError{}) }

func mappedFile(uintptr) string { return "" }
