package autograd

import (
	"fmt"
	"slices"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/kernels"
	"github.com/b7ea7098/loom/placement"
)

// Helpers shared by the ops' local kernels, which work on row-major local
// blocks and accumulate reductions in float64. Float32 blocks take the
// fused kernels of package kernels where one exists (as32 and from32 let
// generic code pick them); the tape's BLAS and worker bound size them.
// rec (Tape.records) says whether an op is recorded, so that values for
// its backward are saved only then, in the tape's arena.

// float is the element type of local blocks.
type float interface{ float32 | float64 }

func prod(s []int) int {
	n := 1
	for _, v := range s {
		n *= v
	}
	return n
}

// filled returns a tensor laid out by spec whose local block is v
// everywhere.
func filled(spec *placement.Spec, v float64) (*placement.DTensor, error) {
	n := prod(spec.LocalShape())
	if spec.DType() == comm.Float32 {
		d := make([]float32, n)
		kernels.Fill(d, float32(v))
		return placement.NewLocal(spec, d)
	}
	d := make([]float64, n)
	kernels.Fill(d, v)
	return placement.NewLocal(spec, d)
}

// clone copies a tensor's local block.
func clone(dt *placement.DTensor) (*placement.DTensor, error) {
	switch d := dt.LocalData().(type) {
	case []float32:
		return placement.NewLocal(dt.Spec(), slices.Clone(d))
	case []float64:
		return placement.NewLocal(dt.Spec(), slices.Clone(d))
	case device.Buffer:
		return devClone(d, dt.Spec())
	}
	return nil, fmt.Errorf("autograd: local data of type %T", dt.LocalData())
}

// addInPlace adds y's local block into x's (same length and dtype).
func addInPlace(x, y *placement.DTensor) error {
	switch xd := x.LocalData().(type) {
	case []float32:
		if yd, ok := y.LocalData().([]float32); ok && len(yd) == len(xd) {
			addInto(xd, xd, yd)
			return nil
		}
	case []float64:
		if yd, ok := y.LocalData().([]float64); ok && len(yd) == len(xd) {
			addInto(xd, xd, yd)
			return nil
		}
	case device.Buffer:
		k, err := devKernels("Backward", xd.Owner(), xd.DType())
		if err != nil {
			return err
		}
		if yd := bufOf(y); yd != nil && yd.Len() == xd.Len() {
			return devWrap("Backward", k.Add(xd, xd, yd))
		}
	}
	return fmt.Errorf("autograd: internal: local blocks %v and %v do not match", x.LocalShape(), y.LocalShape())
}

// dataOf returns dt's local block as a []T. A block on a device is an
// error wrapping ErrUnsupported: the ops that take one have a device
// branch before they get here, and the others run on the host only.
func dataOf[T float](dt *placement.DTensor) ([]T, error) {
	d, ok := dt.LocalData().([]T)
	if !ok {
		if b := bufOf(dt); b != nil {
			return nil, fmt.Errorf("autograd: %w: a tensor on %s where the op takes host data; copy it there with autograd.To", ErrUnsupported, b.Device())
		}
		var z T
		return nil, fmt.Errorf("autograd: internal: local data of type %T, want []%T", dt.LocalData(), z)
	}
	return d, nil
}

// isF32 reports whether spec holds float32.
func isF32(s *placement.Spec) bool { return s.DType() == comm.Float32 }

// splitDim returns the sizes before, at and after dim d of shape.
func splitDim(shape []int, d int) (outer, n, inner int) {
	return prod(shape[:d]), shape[d], prod(shape[d+1:])
}

// as32 reports whether T is float32 and converts x.
func as32[T float](x []T) ([]float32, bool) {
	v, ok := any(x).([]float32)
	return v, ok
}

// from32 converts back a []float32 known to be a []T.
func from32[T float](x []float32) []T {
	v, _ := any(x).([]T)
	return v
}

// records reports whether an op on inputs will be recorded (its backward
// may run), so that it needs to save values for it.
func (t *Tape) records(inputs ...*Value) bool {
	return t.recording() && slices.ContainsFunc(inputs, (*Value).RequiresGrad)
}

// blasOrDefault returns the tape's BLAS, loading kernels.Default on first
// use.
func (t *Tape) blasOrDefault() (*kernels.BLAS, error) {
	if t.blas == nil {
		b, err := kernels.Default()
		if err != nil {
			return nil, fmt.Errorf("autograd: MatMul: %w", err)
		}
		t.blas = b
	}
	return t.blas, nil
}

// BLAS is the GEMM of the tape's host kernels (WithBLAS, else
// kernels.Default), for custom ops that run their own GEMMs; nil when no
// BLAS loads (the kernels then take loom's GEMM).
func (t *Tape) BLAS() *kernels.BLAS {
	if t == nil {
		return nil
	}
	b, err := t.blasOrDefault()
	if err != nil {
		return nil
	}
	return b
}

// Workers is the goroutine budget of the tape's kernels: as many as its
// BLAS has threads, so that a rank sized to its share of the cores keeps to
// it outside GEMM too (GOMAXPROCS if no BLAS loads). Custom ops pass it to
// the kernels they call.
func (t *Tape) Workers() kernels.Workers {
	if t == nil {
		return 0
	}
	b, err := t.blasOrDefault()
	if err != nil {
		return 0
	}
	return kernels.Workers(b.Threads())
}
