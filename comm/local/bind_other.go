//go:build !linux

package local

import (
	"fmt"
	"runtime"
)

func usableCPUs() ([]int, error) {
	return nil, fmt.Errorf("thread affinity is not supported on %s", runtime.GOOS)
}

func bindThread([]int) (func(), error) {
	return nil, fmt.Errorf("thread affinity is not supported on %s", runtime.GOOS)
}
