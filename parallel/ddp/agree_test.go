package ddp

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/b7ea7098/loom"
	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/local"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/parallel/internal/blocks"
	"github.com/b7ea7098/loom/parallel/internal/ptest"
	"github.com/b7ea7098/loom/placement"
)

// agreeParam is one parameter of the agreement tests: name, shape, dtype.
type agreeParam struct {
	name  string
	shape []int
	dtype comm.DType
}

var (
	agreeW = agreeParam{"w", []int{2, 3}, comm.Float64}
	agreeB = agreeParam{"b", []int{2}, comm.Float64}
)

// agreeStep builds, on one rank of a dp mesh, the parameters list describes
// (every element 0.5), a DDP over them, and runs one step of loss =
// sum(x·wᵀ + b) with the 6 global rows x[k] = [k, k+1, k+2] sharded on dp;
// it returns New's error, or the reduced gradients by name (the correct
// ones are w: [15 21 27 15 21 27], b: [6 6]) and the step's error.
func agreeStep(ctx context.Context, m *mesh.Mesh, list []agreeParam, opts ...Option) (newErr error, grads map[string]any, stepErr error) {
	tape := autograd.NewTape()
	byName := map[string]*autograd.Value{}
	var params []*autograd.Value
	for _, a := range list {
		spec, err := placement.NewSpec(m, a.shape, a.dtype, []placement.Placement{placement.Replicate()})
		if err != nil {
			return nil, nil, err
		}
		n := blocks.Prod(a.shape)
		var full any = make([]float64, n)
		if a.dtype == comm.Float32 {
			full = make([]float32, n)
		}
		switch f := full.(type) {
		case []float64:
			for i := range f {
				f[i] = 0.5
			}
		case []float32:
			for i := range f {
				f[i] = 0.5
			}
		}
		dt, err := placement.FromFull(spec, full)
		if err != nil {
			return nil, nil, err
		}
		p, err := tape.Param(a.name, dt)
		if err != nil {
			return nil, nil, err
		}
		params = append(params, p)
		byName[a.name] = p
	}
	d, err := New(ctx, params, opts...)
	if err != nil {
		return err, nil, nil
	}
	x := make([]float64, 6*3)
	for k := range 6 {
		x[3*k], x[3*k+1], x[3*k+2] = float64(k), float64(k+1), float64(k+2)
	}
	xs, err := placement.NewSpec(m, []int{6, 3}, comm.Float64, []placement.Placement{placement.Shard(0)})
	if err != nil {
		return nil, nil, err
	}
	xd, err := placement.FromFull(xs, x)
	if err != nil {
		return nil, nil, err
	}
	xv, err := tape.Constant(xd)
	if err != nil {
		return nil, nil, err
	}
	y, err := autograd.Linear(xv, byName["w"], byName["b"])
	if err != nil {
		return nil, nil, err
	}
	loss, err := autograd.Sum(y)
	if err != nil {
		return nil, nil, err
	}
	if err := tape.Backward(ctx, loss); err != nil {
		return nil, nil, err
	}
	if err := d.Finish(ctx); err != nil {
		return nil, nil, err
	}
	grads = map[string]any{}
	for _, p := range params {
		if g := p.Grad(); g != nil {
			grads[p.Name()] = g.LocalData()
		}
	}
	return nil, grads, nil
}

// TestNewRejectsDisagreeingParameters is the regression test of issue 19,
// item 1: a rank that lists the same parameters in another order used to
// have its gradients silently mixed (at dp=3, rank 0 got w's gradient
// [19 19 25 19 16 20] instead of [15 21 27 15 21 27], and Backward and
// Finish returned nil). Now New fails on every rank, naming the first
// difference; lists that differ in shape or dtype, and options that differ,
// fail the same way instead of only when the collectives' counts differ.
func TestNewRejectsDisagreeingParameters(t *testing.T) {
	w, b := agreeW, agreeB
	others := map[int]string{2: "rank 0 has", 3: "ranks 0, 2 have", 4: "ranks 0, 2, 3 have"}
	for _, tc := range []struct {
		name string
		odd  []agreeParam // rank 1's list; the others pass {w, b}
		opts []Option     // rank 1's options; the others pass none
		want string       // the error after "ddp: New: ranks disagree on ", with %s for the others
	}{
		{name: "order", odd: []agreeParam{b, w},
			want: `the parameter list: rank 1 has "b [2] float64" at position 0 where %s "w [2 3] float64"`},
		{name: "shape", odd: []agreeParam{{"w", []int{3, 2}, comm.Float64}, b},
			want: `the parameter list: rank 1 has "w [3 2] float64" at position 0 where %s "w [2 3] float64"`},
		{name: "dtype", odd: []agreeParam{w, {"b", []int{2}, comm.Float32}},
			want: `the parameter list: rank 1 has "b [2] float32" at position 1 where %s "b [2] float64"`},
		{name: "missing", odd: []agreeParam{w},
			want: `the parameter list: rank 1 has nothing at position 1 where %s "b [2] float64" (1 entry against 2)`},
		{name: "Average", odd: []agreeParam{w, b}, opts: []Option{WithAverage()},
			want: `the DDP options: rank 1 has "WithAverage true" at position 2 where %s "WithAverage false"`},
		{name: "bucket cap", odd: []agreeParam{w, b}, opts: []Option{WithBucketCap(64)},
			want: `the DDP options: rank 1 has "bucket cap 64 B" at position 1 where %s "bucket cap 26214400 B"`},
	} {
		for _, dp := range []int{2, 3, 4} {
			t.Run(fmt.Sprintf("%s/dp=%d", tc.name, dp), func(t *testing.T) {
				newErrs := make([]error, dp)
				grads := make([]map[string]any, dp)
				stepErrs := make([]error, dp)
				err := local.Run(context.Background(), dp, func(ctx context.Context, c comm.Communicator) error {
					m, err := mesh.New(c, []int{dp}, []string{"dp"})
					if err != nil {
						return err
					}
					list, opts := []agreeParam{w, b}, []Option(nil)
					if c.Rank() == 1 {
						list, opts = tc.odd, tc.opts
					}
					r := c.Rank()
					newErrs[r], grads[r], stepErrs[r] = agreeStep(ctx, m, list, opts...)
					return nil
				}, local.WithCostModel(comm.BuiltinCostModel()))
				if err != nil {
					t.Fatal(err)
				}
				want := "ddp: New: ranks disagree on " + fmt.Sprintf(tc.want, others[dp])
				for r, err := range newErrs {
					switch {
					case err == nil:
						t.Errorf("rank %d: New accepted the lists; then the step gave gradients %v, error %v", r, grads[r], stepErrs[r])
					case err.Error() != want:
						t.Errorf("rank %d: New:\n got %v\nwant %s", r, err, want)
					case !errors.Is(err, loom.ErrMismatch) || !errors.Is(err, comm.ErrMismatch):
						t.Errorf("rank %d: %v does not match loom.ErrMismatch", r, err)
					}
				}
			})
		}
	}
}

// TestNewAgreeingParameters: the same lists on every rank pass the check
// and give the right gradients, and on a 2-D mesh a difference inside one
// dp group fails that group only, with ranks counted along dp.
func TestNewAgreeingParameters(t *testing.T) {
	for _, dp := range []int{1, 2, 3, 4} {
		grads := make([]map[string]any, dp)
		err := local.Run(context.Background(), dp, func(ctx context.Context, c comm.Communicator) error {
			m, err := mesh.New(c, []int{dp}, []string{"dp"})
			if err != nil {
				return err
			}
			newErr, g, stepErr := agreeStep(ctx, m, []agreeParam{agreeW, agreeB})
			grads[c.Rank()] = g
			return errors.Join(newErr, stepErr)
		}, local.WithCostModel(comm.BuiltinCostModel()))
		if err != nil {
			t.Fatalf("dp=%d: %v", dp, err)
		}
		want := "map[b:[6 6] w:[15 21 27 15 21 27]]"
		for r, g := range grads {
			if got := fmt.Sprint(g); got != want {
				t.Errorf("dp=%d: rank %d: gradients %s, want %s", dp, r, got, want)
			}
		}
	}

	// Mesh (tp=2, dp=2): world rank 3 is dp rank 1 of the group {1, 3}.
	errs := make([]error, 4)
	err := local.Run(context.Background(), 4, func(ctx context.Context, c comm.Communicator) error {
		m, err := mesh.New(c, []int{2, 2}, []string{"dp", "tp"})
		if err != nil {
			return err
		}
		list := []agreeParam{agreeW, agreeB}
		if c.Rank() == 3 {
			list = []agreeParam{agreeB, agreeW}
		}
		tape := autograd.NewTape()
		var params []*autograd.Value
		for _, a := range list {
			dt, err := ptest.Replicated(m, a.shape, 1)
			if err != nil {
				return err
			}
			p, err := tape.Param(a.name, dt)
			if err != nil {
				return err
			}
			params = append(params, p)
		}
		_, errs[c.Rank()] = New(ctx, params)
		return nil
	}, local.WithCostModel(comm.BuiltinCostModel()))
	if err != nil {
		t.Fatal(err)
	}
	want := `ddp: New: ranks disagree on the parameter list (ranks along axis "dp"): rank 1 has "b [2] float64" at position 0 where rank 0 has "w [2 3] float64"`
	for r, err := range errs {
		if r%2 == 0 && err != nil {
			t.Errorf("world rank %d (dp group {0, 2}, which agrees): %v", r, err)
		}
		if r%2 == 1 && (err == nil || err.Error() != want) {
			t.Errorf("world rank %d: New:\n got %v\nwant %s", r, err, want)
		}
	}
}
