package optim_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"testing"

	"github.com/b7ea7098/loom"
	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/optim"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// clipParam is one parameter of a clipping test: its global shape, its
// gradient's placements (nil: no gradient) and its shard orders.
type clipParam struct {
	shape []int
	grad  []placement.Placement
	opts  []placement.SpecOption
}

// clipGrads makes one parameter per entry, replicated, with a gradient
// laid out as given (values scale·Random), and returns the parameters
// and the full gradients (nil where there is none), widened to float64.
func clipGrads(m *mesh.Mesh, dt comm.DType, ps []clipParam, scale float64) ([]*autograd.Value, [][]float64, error) {
	tape := autograd.NewTape()
	var vals []*autograd.Value
	var fulls [][]float64
	for i, c := range ps {
		rep := make([]placement.Placement, m.NDim())
		for a := range rep {
			rep[a] = placement.Replicate()
		}
		s, err := placement.NewSpec(m, c.shape, dt, rep)
		if err != nil {
			return nil, nil, err
		}
		d, err := placement.FromFull(s, placementtest.Random(c.shape, dt, uint64(i+1)))
		if err != nil {
			return nil, nil, err
		}
		v, err := tape.Param(fmt.Sprint("p", i), d)
		if err != nil {
			return nil, nil, err
		}
		vals = append(vals, v)
		if c.grad == nil {
			fulls = append(fulls, nil)
			continue
		}
		gs, err := placement.NewSpec(m, c.shape, dt, c.grad, c.opts...)
		if err != nil {
			return nil, nil, err
		}
		full := scaled(placementtest.Random(c.shape, dt, uint64(100+i)), scale)
		g, err := placement.FromFull(gs, full)
		if err != nil {
			return nil, nil, err
		}
		if err := v.SetGrad(g); err != nil {
			return nil, nil, err
		}
		fulls = append(fulls, asF64(full))
	}
	return vals, fulls, nil
}

// scaled returns c·d in d's dtype ([]float32 or []float64), in place.
func scaled(d any, c float64) any {
	switch v := d.(type) {
	case []float32:
		for i := range v {
			v[i] *= float32(c)
		}
	case []float64:
		for i := range v {
			v[i] *= c
		}
	}
	return d
}

// serialNorm is the p-norm of all the full gradients together.
func serialNorm(fulls [][]float64, p float64) float64 {
	s := 0.0
	for _, f := range fulls {
		for _, x := range f {
			if math.IsInf(p, 1) {
				s = max(s, math.Abs(x))
			} else {
				s += math.Pow(math.Abs(x), p)
			}
		}
	}
	if math.IsInf(p, 1) {
		return s
	}
	return math.Pow(s, 1/p)
}

// TestClipGradNormMatchesSerial checks the returned norm and the clipped
// gradients against the serial computation on full gradients, for 2-d
// meshes with replicated, tensor-parallel (Shard(0), Shard(1)), FSDP and
// nested shardings (uneven and empty shards included), several norm types,
// both dtypes, and a maxNorm that clips and one that does not.
func TestClipGradNormMatchesSerial(t *testing.T) {
	R, S0, S1 := placement.Replicate(), placement.Shard(0), placement.Shard(1)
	type pl = []placement.Placement
	params := []clipParam{
		{shape: []int{3, 4}, grad: pl{R, R}},
		{shape: []int{5, 2}, grad: pl{R, S0}},  // colwise on tp: uneven
		{shape: []int{2, 5}, grad: pl{R, S1}},  // rowwise on tp
		{shape: []int{2, 2}, grad: pl{R, S0}},  // 1 + 1 + 0 on tp=3: empty shard
		{shape: []int{7}, grad: pl{S0, R}},     // FSDP on dp
		{shape: []int{6, 3}, grad: pl{S0, S1}}, // dp and tp
		{shape: []int{9}, grad: pl{S0, S0}, opts: []placement.SpecOption{placement.WithOrder(0, "tp", "dp")}},
		{shape: []int{4}},                     // no gradient
		{shape: []int{3, 3}, grad: pl{S1, R}}, // another tensor in the {dp} group
	}
	for _, mshape := range [][]int{{2, 2}, {1, 3}, {3, 1}, {2, 3}} {
		for _, p := range []float64{2, math.Inf(1), 1, 3} {
			for _, dt := range []comm.DType{comm.Float64, comm.Float32} {
				for _, clip := range []bool{true, false} {
					tol := 1e-12
					if dt == comm.Float32 {
						tol = 2e-6
					}
					name := fmt.Sprintf("%v/p=%v/%v/clip=%v", mshape, p, dt, clip)
					t.Run(name, func(t *testing.T) {
						placementtest.Run(t, mshape, []string{"dp", "tp"}, func(ctx context.Context, m *mesh.Mesh) error {
							vals, fulls, err := clipGrads(m, dt, params, 3)
							if err != nil {
								return err
							}
							want := serialNorm(fulls, p)
							maxNorm := 10 * want
							if clip {
								maxNorm = want / 4
							}
							got, err := optim.ClipGradNorm(ctx, vals, maxNorm, optim.WithNormType(p), optim.WithAllowFrozen())
							if err != nil {
								return err
							}
							if math.Abs(got-want) > 1e-12*want {
								return fmt.Errorf("norm %v, want %v", got, want)
							}
							coef := min(1, maxNorm/(want+1e-6))
							for i, v := range vals {
								if fulls[i] == nil {
									if v.Grad() != nil {
										return fmt.Errorf("%s: a gradient appeared", v.Name())
									}
									continue
								}
								if gp, wp := fmt.Sprint(v.Grad().Spec().Placements()), fmt.Sprint(params[i].grad); gp != wp {
									return fmt.Errorf("%s: gradient layout changed to %s from %s", v.Name(), gp, wp)
								}
								w := make([]float64, len(fulls[i]))
								for k, x := range fulls[i] {
									w[k] = x * coef
								}
								gf, err := v.Grad().Full(ctx)
								if err != nil {
									return err
								}
								if err := placementtest.Compare(gf, w, tol); err != nil {
									return fmt.Errorf("%s: %w", v.Name(), err)
								}
							}
							return nil
						})
					})
				}
			}
		}
	}
}

// TestClipGradNormOneAllReducePerAxisSet counts the collectives: gradients
// sharded over {tp}, {dp} and {dp, tp} cost one all-reduce on each of
// those communicators, whatever the number of gradients in each group,
// and replicated gradients cost none.
func TestClipGradNormOneAllReducePerAxisSet(t *testing.T) {
	R, S0, S1 := placement.Replicate(), placement.Shard(0), placement.Shard(1)
	type pl = []placement.Placement
	for _, c := range []struct {
		name   string
		params []clipParam
		want   [3]uint64 // new ops on the tp, dp and (dp, tp) communicators
	}{
		{"replicated", []clipParam{{shape: []int{3}, grad: pl{R, R}}, {shape: []int{2, 2}, grad: pl{R, R}}}, [3]uint64{0, 0, 0}},
		{"tp only", []clipParam{{shape: []int{4, 2}, grad: pl{R, S0}}, {shape: []int{2, 4}, grad: pl{R, S1}}, {shape: []int{3}, grad: pl{R, R}}}, [3]uint64{1, 0, 0}},
		{"all", []clipParam{
			{shape: []int{4, 2}, grad: pl{R, S0}}, {shape: []int{2, 4}, grad: pl{R, S1}},
			{shape: []int{5}, grad: pl{S0, R}}, {shape: []int{4, 4}, grad: pl{S1, R}},
			{shape: []int{4, 4}, grad: pl{S0, S1}}, {shape: []int{6}, grad: pl{S0, S0}},
		}, [3]uint64{1, 1, 1}},
	} {
		t.Run(c.name, func(t *testing.T) {
			placementtest.Run(t, []int{2, 2}, []string{"dp", "tp"}, func(ctx context.Context, m *mesh.Mesh) error {
				vals, fulls, err := clipGrads(m, comm.Float64, c.params, 1)
				if err != nil {
					return err
				}
				var comms []comm.Communicator
				for _, axes := range [][]string{{"tp"}, {"dp"}, {"dp", "tp"}} {
					cm, err := m.Group(ctx, axes...)
					if err != nil {
						return err
					}
					comms = append(comms, cm)
				}
				before := make([]uint64, len(comms))
				for i, cm := range comms {
					before[i] = cm.Recorder().Snapshot().Total
				}
				got, err := optim.ClipGradNorm(ctx, vals, 1e9)
				if err != nil {
					return err
				}
				for i, cm := range comms {
					if n := cm.Recorder().Snapshot().Total - before[i]; n != c.want[i] {
						return fmt.Errorf("communicator %d: %d collectives, want %d", i, n, c.want[i])
					}
				}
				if want := serialNorm(fulls, 2); math.Abs(got-want) > 1e-12*want {
					return fmt.Errorf("norm %v, want %v", got, want)
				}
				return nil
			})
		})
	}
}

// TestClipGradNormRejects: a Partial gradient, bad arguments and (with
// WithErrorIfNonfinite) a non-finite norm are errors that leave every gradient
// as it was; without the option an infinite norm is returned and scales.
func TestClipGradNormRejects(t *testing.T) {
	R, S0 := placement.Replicate(), placement.Shard(0)
	type pl = []placement.Placement
	placementtest.Run(t, []int{2, 2}, []string{"dp", "tp"}, func(ctx context.Context, m *mesh.Mesh) error {
		vals, _, err := clipGrads(m, comm.Float64, []clipParam{{shape: []int{4}, grad: pl{R, S0}}, {shape: []int{3}, grad: pl{placement.Partial(comm.Sum), R}}}, 1)
		if err != nil {
			return err
		}
		before := vals[0].Grad()
		_, err = optim.ClipGradNorm(ctx, vals, 1e-3)
		if !errors.Is(err, optim.ErrInvalid) || !strings.Contains(err.Error(), `the gradient of "p1": it is P(sum) on mesh axis "dp", so no rank's block determines its norm: reduce it`) {
			t.Errorf("Partial gradient: %v", err)
		}
		if vals[0].Grad() != before {
			t.Error("a refused clip replaced a gradient")
		}
		for _, c := range []struct {
			max  float64
			opts []optim.ClipOption
			text string
		}{
			{-1, nil, "maxNorm -1: must be positive"},
			{math.NaN(), nil, "maxNorm NaN: must be positive"},
			{1, []optim.ClipOption{optim.WithNormType(0)}, "NormType 0: must be positive"},
			{1, []optim.ClipOption{optim.WithNormType(math.Inf(-1))}, "NormType -Inf: must be positive"},
			{1, []optim.ClipOption{optim.WithMomentum(0.9)}, "option WithMomentum does not apply"},
		} {
			if _, err := optim.ClipGradNorm(ctx, vals[:1], c.max, c.opts...); !errors.Is(err, optim.ErrInvalid) || !strings.Contains(err.Error(), c.text) {
				t.Errorf("maxNorm %v %d options: %v, want %q", c.max, len(c.opts), err, c.text)
			}
		}
		if _, err := optim.ClipGradNorm(ctx, []*autograd.Value{nil}, 1); !errors.Is(err, loom.ErrInvalid) || !strings.Contains(err.Error(), "parameter 0 is nil") {
			t.Errorf("nil parameter: %v", err)
		}
		if n, err := optim.ClipGradNorm(ctx, nil, 1); n != 0 || err != nil {
			t.Errorf("no parameters: %v, %v", n, err)
		}

		// A gradient on another mesh layout.
		sub, err := m.Sub("tp")
		if err != nil {
			return err
		}
		other, _, err := clipGrads(sub, comm.Float64, []clipParam{{shape: []int{2}, grad: pl{R}}}, 1)
		if err != nil {
			return err
		}
		if _, err := optim.ClipGradNorm(ctx, []*autograd.Value{vals[0], other[0]}, 1); err == nil || !strings.Contains(err.Error(), "every gradient must be on one mesh layout") {
			t.Errorf("two meshes: %v", err)
		}

		// Non-finite norms.
		inf, _, err := clipGrads(m, comm.Float64, []clipParam{{shape: []int{4}, grad: pl{R, S0}}}, math.Inf(1))
		if err != nil {
			return err
		}
		g := inf[0].Grad()
		if n, err := optim.ClipGradNorm(ctx, inf, 1, optim.WithErrorIfNonfinite()); !math.IsInf(n, 1) || !errors.Is(err, optim.ErrNonfinite) || errors.Is(err, optim.ErrInvalid) {
			t.Errorf("ErrorIfNonfinite: %v, %v", n, err)
		}
		if inf[0].Grad() != g {
			t.Error("ErrorIfNonfinite replaced a gradient")
		}
		if n, err := optim.ClipGradNorm(ctx, inf, 1); !math.IsInf(n, 1) || err != nil {
			t.Errorf("infinite norm without ErrorIfNonfinite: %v, %v", n, err)
		}
		if inf[0].Grad() == g {
			t.Error("an infinite norm did not scale the gradients (PyTorch multiplies by 0)")
		}
		return nil
	})
}
