package autograd

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"testing"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// TestRelayout: a parameter leaf takes a new layout of its own data in
// place (the handle stays the parameter and gets gradients in the new
// layout), and every case Relayout cannot make sound is refused, leaving
// the leaf as it was.
func TestRelayout(t *testing.T) {
	placementtest.Run(t, []int{2}, []string{"tp"}, func(ctx context.Context, m *mesh.Mesh) error {
		rep := []placement.Placement{placement.Replicate()}
		sh0 := []placement.Placement{placement.Shard(0)}
		spec := func(shape []int, dt comm.DType, pl []placement.Placement) *placement.Spec {
			s, err := placement.NewSpec(m, shape, dt, pl)
			if err != nil {
				t.Fatal(err)
			}
			return s
		}
		full := []float64{1, 2, 3, 4}
		repDT, err := placement.FromFull(spec([]int{4}, comm.Float64, rep), full)
		if err != nil {
			return err
		}
		shardDT, err := placement.FromFull(spec([]int{4}, comm.Float64, sh0), full)
		if err != nil {
			return err
		}
		shardedAs := func(shape []int, dt comm.DType) *placement.DTensor {
			s := spec(shape, dt, sh0)
			n := prod(s.LocalShape())
			var d any = make([]float64, n)
			if dt == comm.Float32 {
				d = make([]float32, n)
			}
			x, err := placement.NewLocal(s, d)
			if err != nil {
				t.Fatal(err)
			}
			return x
		}
		cases := []struct {
			name  string
			setup func(tape *Tape, p *Value) (*Value, *placement.DTensor)
			ok    bool
		}{
			{"shard a replicated parameter", func(_ *Tape, p *Value) (*Value, *placement.DTensor) { return p, shardDT }, true},
			{"new global shape, same elements", func(_ *Tape, p *Value) (*Value, *placement.DTensor) { return p, shardedAs([]int{2, 2}, comm.Float64) }, true},
			{"nil tensor", func(_ *Tape, p *Value) (*Value, *placement.DTensor) { return p, nil }, false},
			{"other element count", func(_ *Tape, p *Value) (*Value, *placement.DTensor) { return p, shardedAs([]int{6}, comm.Float64) }, false},
			{"other dtype", func(_ *Tape, p *Value) (*Value, *placement.DTensor) { return p, shardedAs([]int{4}, comm.Float32) }, false},
			{"constant", func(tape *Tape, _ *Value) (*Value, *placement.DTensor) {
				c, _ := tape.Constant(repDT)
				return c, shardDT
			}, false},
			{"op result", func(_ *Tape, p *Value) (*Value, *placement.DTensor) {
				y, _ := Scale(p, 2)
				return y, shardDT
			}, false},
			{"has a gradient", func(_ *Tape, p *Value) (*Value, *placement.DTensor) {
				_ = p.SetGrad(repDT)
				return p, shardDT
			}, false},
			{"has gradient hooks", func(_ *Tape, p *Value) (*Value, *placement.DTensor) {
				_ = p.OnGradReady(func(context.Context, *Value) error { return nil })
				return p, shardDT
			}, false},
			{"used by a recorded op", func(_ *Tape, p *Value) (*Value, *placement.DTensor) {
				_, _ = Scale(p, 2)
				return p, shardDT
			}, false},
		}
		for _, tc := range cases {
			tape := NewTape()
			p, err := tape.Param("w", repDT)
			if err != nil {
				return err
			}
			v, dt := tc.setup(tape, p)
			before := v.Data()
			err = v.Relayout(dt)
			if !tc.ok {
				if !errors.Is(err, ErrInvalid) || v.Data() != before {
					return fmt.Errorf("%s: Relayout = %v, data changed %v; want ErrInvalid and no change", tc.name, err, v.Data() != before)
				}
				continue
			}
			if err != nil || p.Data() != dt {
				return fmt.Errorf("%s: Relayout: %v", tc.name, err)
			}
			// The handle is the parameter in its new layout: backward
			// gives it a gradient laid out like the new data.
			y, err := Sum(p)
			if err != nil {
				return err
			}
			if err := tape.Backward(ctx, y); err != nil {
				return err
			}
			if g := p.Grad(); g == nil || !slices.Equal(g.Spec().Shape(), dt.Spec().Shape()) {
				return fmt.Errorf("%s: gradient %v after Relayout to %v", tc.name, g, dt.Spec())
			}
		}
		return nil
	})
}
