package placement_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/big"
	"slices"
	"strings"
	"testing"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// Shapes whose element or byte count overflows int are rejected by NewSpec
// with ErrInvalid naming the shape, before anything is built on them: a
// wrapped count used to pass silently (an empty local block that
// NewLocal and Redistribute accepted, moving nothing; a negative local
// dim; a plan of 0 bytes; routed rows whose sum wrapped to 0).
func TestSpecRejectsOverflowingShapes(t *testing.T) {
	rows := placement.WithRoutedRows([]int{math.MaxInt64, math.MaxInt64, 1, 1})
	for _, tc := range []struct {
		name   string
		shape  []int
		dtype  comm.DType
		places []placement.Placement
		opts   []placement.SpecOption
		want   string // in the error
	}{
		// Today: NewLocal(spec, []float32{}) and Redistribute return nil.
		{"2^93 elements", []int{1 << 31, 1 << 31, 1 << 31}, comm.Float32, []placement.Placement{S0}, nil, "[2147483648 2147483648 2147483648]"},
		// Today: a local shape of [-2305843009213693951 2].
		{"MaxInt64 x 2", []int{math.MaxInt64, 2}, comm.Float32, []placement.Placement{S0}, nil, "[9223372036854775807 2]"},
		// Today: Plan.Bytes() = 0 (2^64 wraps to 0).
		{"2^64 elements", []int{1 << 32, 1 << 32}, comm.Float32, []placement.Placement{S0}, nil, "[4294967296 4294967296]"},
		// The element count fits, the byte count does not.
		{"MaxInt64 float64", []int{math.MaxInt64}, comm.Float64, []placement.Placement{S0}, nil, "[9223372036854775807]"},
		{"2^61 float32", []int{1 << 30, 1 << 31}, comm.Float32, []placement.Placement{R}, nil, "[1073741824 2147483648]"},
		// A zero dim does not excuse the others: their strides overflow.
		{"2^64 x 0", []int{1 << 32, 1 << 32, 0}, comm.Float64, []placement.Placement{S2}, nil, "[4294967296 4294967296 0]"},
		// Today: accepted, the sum wraps to 0 = the global dim 0.
		{"routed rows wrap", []int{0, 3}, comm.Float32, []placement.Placement{placement.Routed()}, []placement.SpecOption{rows}, "[9223372036854775807 9223372036854775807 1 1]"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			placementtest.Run(t, []int{4}, []string{"x"}, func(ctx context.Context, m *mesh.Mesh) error {
				spec, err := placement.NewSpec(m, tc.shape, tc.dtype, tc.places, tc.opts...)
				if err == nil {
					return fmt.Errorf("NewSpec(%v) = %v (local shape %v), want ErrInvalid", tc.shape, spec, spec.LocalShape())
				}
				if !errors.Is(err, placement.ErrInvalid) || !strings.Contains(err.Error(), tc.want) {
					return fmt.Errorf("NewSpec(%v): %v; want ErrInvalid naming %s", tc.shape, err, tc.want)
				}
				return nil
			})
		})
	}
}

// The largest shapes that fit are ordinary specs: chunking a dim of nearly
// MaxInt64/4 over 3 ranks neither overflows nor loses rows, and every local
// shape is non-negative.
func TestSpecAtTheLimit(t *testing.T) {
	for _, tc := range []struct {
		shape []int
		dtype comm.DType
	}{
		{[]int{math.MaxInt64 / 4}, comm.Float32},
		{[]int{math.MaxInt64 / 8}, comm.Float64},
		{[]int{1 << 30, 1 << 29, 3}, comm.Float32},
	} {
		t.Run(fmt.Sprint(tc.shape, tc.dtype), func(t *testing.T) {
			placementtest.Run(t, []int{3}, []string{"x"}, func(ctx context.Context, m *mesh.Mesh) error {
				spec, err := placement.NewSpec(m, tc.shape, tc.dtype, []placement.Placement{S0})
				if err != nil {
					return err
				}
				return checkBoxes(spec)
			})
		})
	}
}

// A step whose byte count overflows int64 cannot be priced: Plan fails with
// ErrInvalid naming the shape. An all-reduce of 2^60-1 float64 (8 bytes
// short of 2^63) over 4 ranks receives 2·3/4 of them; the product used to
// wrap.
func TestPlanRejectsOverflowingBytes(t *testing.T) {
	shape := []int{math.MaxInt64 / 8}
	placementtest.Run(t, []int{4}, []string{"x"}, func(ctx context.Context, m *mesh.Mesh) error {
		src, err := placement.NewSpec(m, shape, comm.Float64, []placement.Placement{Psum})
		if err != nil {
			return err
		}
		dst, err := src.With([]placement.Placement{R})
		if err != nil {
			return err
		}
		var p placement.Planner
		pl, err := p.Plan(src, dst)
		if err == nil {
			return fmt.Errorf("Plan = %v (%d bytes), want ErrInvalid", pl, pl.Bytes())
		}
		if !errors.Is(err, placement.ErrInvalid) || !strings.Contains(err.Error(), fmt.Sprint(shape)) {
			return fmt.Errorf("Plan: %v; want ErrInvalid naming %v", err, shape)
		}
		return nil
	})
}

// checkBoxes checks spec's layout math on every mesh rank: local shapes are
// non-negative with a product (times the element size) that fits in an
// int, and along every tensor dim the distinct non-empty blocks tile the
// global dim: contiguous, and their sizes sum to it.
func checkBoxes(spec *placement.Spec) error {
	shape := spec.Shape()
	es := big.NewInt(int64(spec.DType().Size()))
	if ls := spec.LocalShape(); !fitsBytes(ls, es) {
		return fmt.Errorf("this rank's local shape %v of %v does not fit", ls, spec)
	}
	type span struct{ off, size int }
	spans := make([][]span, len(shape))
	for r := range spec.Mesh().Size() {
		off, size, err := spec.Box(r)
		if err != nil {
			return err
		}
		if !fitsBytes(size, es) {
			return fmt.Errorf("mesh rank %d: block size %v of %v does not fit", r, size, spec)
		}
		for d := range shape {
			if off[d] < 0 || off[d] > shape[d] || size[d] > shape[d]-off[d] {
				return fmt.Errorf("mesh rank %d: dim %d block [%d, +%d) outside [0, %d) of %v", r, d, off[d], size[d], shape[d], spec)
			}
			if s := (span{off[d], size[d]}); s.size > 0 && !slices.Contains(spans[d], s) {
				spans[d] = append(spans[d], s)
			}
		}
	}
	for d, ss := range spans {
		slices.SortFunc(ss, func(a, b span) int { return a.off - b.off })
		at := 0
		for _, s := range ss {
			if s.off != at {
				return fmt.Errorf("dim %d: blocks %v do not tile [0, %d) of %v", d, ss, shape[d], spec)
			}
			at += s.size
		}
		if at != shape[d] {
			return fmt.Errorf("dim %d: blocks %v sum to %d, the global dim is %d (%v)", d, ss, at, shape[d], spec)
		}
	}
	return nil
}

// fitsBytes reports whether dims are non-negative and their product times
// es fits in an int, by exact arithmetic.
func fitsBytes(dims []int, es *big.Int) bool {
	n := new(big.Int).Set(es)
	for _, d := range dims {
		if d < 0 {
			return false
		}
		if d > 0 {
			n.Mul(n, big.NewInt(int64(d)))
		}
	}
	return n.IsInt64()
}

// FromRoot's scatter pads every block to the largest: 4 blocks of
// ceil((2^61-1)/4) float32 are 2^63 bytes, one past what an int holds,
// though the tensor itself fits. Every rank rejects it before the root's
// verdict is broadcast (the root is not asked for its 2^63-byte slice).
func TestFromRootRejectsOverflowingScatter(t *testing.T) {
	shape := []int{math.MaxInt64 / 4}
	placementtest.Run(t, []int{4}, []string{"x"}, func(ctx context.Context, m *mesh.Mesh) error {
		spec, err := placement.NewSpec(m, shape, comm.Float32, []placement.Placement{S0})
		if err != nil {
			return err
		}
		_, err = placement.FromRoot(ctx, spec, nil, 0)
		if !errors.Is(err, placement.ErrInvalid) || !strings.Contains(err.Error(), "scatter of "+fmt.Sprint(shape)) {
			return fmt.Errorf("FromRoot: %v; want ErrInvalid naming the scatter of %v", err, shape)
		}
		return nil
	})
}
