package dense_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/dense"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
	"gorgonia.org/tensor"
)

// TestDTensorRoundTrip: a gorgonia tensor distributed by ToDTensor holds
// exactly the blocks placement.FromFull cuts from the same values, and
// FromDTensor gives the tensor back.
func TestDTensorRoundTrip(t *testing.T) {
	base := tensor.New(tensor.WithShape(3, 5), tensor.WithBacking([]float64{
		0, 1, 2, 3, 4,
		5, 6, 7, 8, 9,
		10, 11, 12, 13, 14,
	}))
	transposed := base.Clone().(*tensor.Dense)
	if err := transposed.T(); err != nil { // a lazy view: [5 3]
		t.Fatal(err)
	}
	tests := []struct {
		name   string
		d      *tensor.Dense
		dt     comm.DType
		places []placement.Placement
		want   any // the row-major values
	}{
		{"float64 S(0) S(1)", base, comm.Float64, []placement.Placement{placement.Shard(0), placement.Shard(1)}, base.Data()},
		{"float32 P(sum) R", tensor.New(tensor.WithShape(2, 2), tensor.WithBacking([]float32{1, 2, 3, 4})), comm.Float32,
			[]placement.Placement{placement.Partial(comm.Sum), placement.Replicate()}, []float32{1, 2, 3, 4}},
		{"transposed view", transposed, comm.Float64, []placement.Placement{placement.Replicate(), placement.Shard(0)},
			[]float64{0, 5, 10, 1, 6, 11, 2, 7, 12, 3, 8, 13, 4, 9, 14}},
		{"scalar", tensor.New(tensor.FromScalar(2.5)), comm.Float64, []placement.Placement{placement.Partial(comm.Avg), placement.Replicate()}, []float64{2.5}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			shape := []int(tc.d.Shape())
			if tc.d.IsScalar() {
				shape = nil
			}
			placementtest.Run(t, []int{2, 2}, []string{"a", "b"}, func(ctx context.Context, m *mesh.Mesh) error {
				spec, err := placement.NewSpec(m, shape, tc.dt, tc.places)
				if err != nil {
					return err
				}
				dt, err := dense.ToDTensor(spec, tc.d)
				if err != nil {
					return err
				}
				ref, err := placement.FromFull(spec, tc.want)
				if err != nil {
					return err
				}
				if fmt.Sprint(dt.LocalData()) != fmt.Sprint(ref.LocalData()) || !slices.Equal(dt.LocalShape(), ref.LocalShape()) {
					return fmt.Errorf("local block %v %v, want %v %v", dt.LocalShape(), dt.LocalData(), ref.LocalShape(), ref.LocalData())
				}
				back, err := dense.FromDTensor(ctx, dt)
				if err != nil {
					return err
				}
				if back.IsScalar() != tc.d.IsScalar() || (!back.IsScalar() && !slices.Equal([]int(back.Shape()), shape)) {
					return fmt.Errorf("FromDTensor shape %v, want %v", back.Shape(), shape)
				}
				if got, want := fmt.Sprint(back.Data()), fmt.Sprint(tc.want); got != want && !(tc.d.IsScalar() && "["+got+"]" == want) {
					return fmt.Errorf("FromDTensor data %s, want %s", got, want)
				}
				return nil
			})
		})
	}
}

// TestDTensorErrors: what gorgonia cannot hold, or what does not match the
// spec, is an ErrInvalid error, never a panic.
func TestDTensorErrors(t *testing.T) {
	placementtest.Run(t, []int{2}, []string{"x"}, func(ctx context.Context, m *mesh.Mesh) error {
		spec, err := placement.NewSpec(m, []int{2, 3}, comm.Float32, []placement.Placement{placement.Shard(0)})
		if err != nil {
			return err
		}
		empty, err := placement.NewSpec(m, []int{0, 3}, comm.Float32, []placement.Placement{placement.Shard(0)})
		if err != nil {
			return err
		}
		f32 := func(shape ...int) *tensor.Dense {
			n := 1
			for _, s := range shape {
				n *= s
			}
			return tensor.New(tensor.WithShape(shape...), tensor.WithBacking(make([]float32, n)))
		}
		cases := []struct {
			name string
			err  func() error
			want string
		}{
			{"nil spec", func() error { _, err := dense.ToDTensor(nil, f32(2, 3)); return err }, "nil spec"},
			{"nil tensor", func() error { _, err := dense.ToDTensor(spec, nil); return err }, "nil *tensor.Dense"},
			{"empty gorgonia tensor", func() error {
				_, err := dense.ToDTensor(empty, tensor.New(tensor.WithShape(0, 3), tensor.WithBacking([]float32{})))
				return err
			}, "empty shape [0 3]"},
			{"shape", func() error { _, err := dense.ToDTensor(spec, f32(3, 2)); return err }, "shape [3 2], the spec's global shape is [2 3]"},
			{"dtype", func() error {
				_, err := dense.ToDTensor(spec, tensor.New(tensor.WithShape(2, 3), tensor.WithBacking(make([]float64, 6))))
				return err
			}, "float64, the spec says float32"},
			{"nil DTensor", func() error { _, err := dense.FromDTensor(ctx, nil); return err }, "nil DTensor"},
			{"empty DTensor", func() error {
				dt, err := placement.FromFull(empty, []float32{})
				if err != nil {
					return err
				}
				_, err = dense.FromDTensor(ctx, dt)
				return err
			}, "empty, which gorgonia.org/tensor cannot hold; use DTensor.Full"},
		}
		for _, tc := range cases {
			if err := tc.err(); !errors.Is(err, dense.ErrInvalid) || !strings.Contains(err.Error(), tc.want) {
				return fmt.Errorf("%s: error %v, want ErrInvalid containing %q", tc.name, err, tc.want)
			}
		}
		return nil
	})
}
