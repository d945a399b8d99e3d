//go:build !(linux && (amd64 || arm64))

package kernels

import (
	"errors"
	"runtime"
)

func openblasCandidates() []string { return []string{"libopenblas"} }
func blisCandidates() []string     { return []string{"libblis"} }
func autoCandidates() []string     { return nil }

// cblasLib is never created on this platform.
type cblasLib struct {
	backend Backend
	path    string
}

func openCBLAS(string) (*cblasLib, error) {
	return nil, errors.New("purego cannot load a BLAS on " + runtime.GOOS + "/" + runtime.GOARCH + "; the pure-Go GEMM serves")
}

func (l *cblasLib) config() string { return "" }
func (l *cblasLib) setThreads(int) {}
func (l *cblasLib) threads() int   { return 0 }
func (l *cblasLib) sgemm(_, _ bool, _, _, _ int, _ float32, _ []float32, _ int, _ []float32, _ int, _ float32, _ []float32, _ int) {
	panic("unreachable")
}
func (l *cblasLib) dgemm(_, _ bool, _, _, _ int, _ float64, _ []float64, _ int, _ []float64, _ int, _ float64, _ []float64, _ int) {
	panic("unreachable")
}
