package ddp

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/memory"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/optim"
	"github.com/b7ea7098/loom/parallel/internal/ptest"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

func TestPlanBuckets(t *testing.T) {
	f64 := func(n int) []comm.DType { return slices.Repeat([]comm.DType{comm.Float64}, n) }
	for _, tc := range []struct {
		name       string
		elems      []int
		dtypes     []comm.DType
		first, cap int64
		want       [][]int
	}{
		{
			// Reverse order; the first bucket closes at 200 bytes (25
			// elements); p1 (2400 bytes) exceeds the cap and is alone.
			name: "reverse, small first, cap, large alone", elems: []int{10, 300, 20, 20, 5}, dtypes: f64(5),
			first: 200, cap: 400, want: [][]int{{4, 3}, {2}, {1}, {0}},
		},
		{
			// Buckets fill up to the cap without exceeding it.
			name: "fill to cap", elems: []int{10, 10, 10, 10, 10, 10}, dtypes: f64(6),
			first: 80, cap: 240, want: [][]int{{5}, {4, 3, 2}, {1, 0}},
		},
		{
			name: "one bucket", elems: []int{1, 2, 3}, dtypes: f64(3),
			first: 1 << 20, cap: 1 << 20, want: [][]int{{2, 1, 0}},
		},
		{
			// A dtype change ends a bucket.
			name: "dtype change", elems: []int{4, 4, 4, 4},
			dtypes: []comm.DType{comm.Float64, comm.Float32, comm.Float32, comm.Float64},
			first:  1 << 20, cap: 1 << 20, want: [][]int{{3}, {2, 1}, {0}},
		},
	} {
		if got := planBuckets(tc.elems, tc.dtypes, tc.first, tc.cap); !slices.EqualFunc(got, tc.want, slices.Equal) {
			t.Errorf("%s: buckets %v, want %v", tc.name, got, tc.want)
		}
	}
	if got := ScaledBucketCap(8); got != DefaultBucketCap {
		t.Errorf("ScaledBucketCap(8) = %d, want %d", got, DefaultBucketCap)
	}
	if got := ScaledBucketCap(64); got != 64<<20 {
		t.Errorf("ScaledBucketCap(64) = %d, want %d", got, 64<<20)
	}
}

// TestBucketsFromNew checks the buckets New derives from a parameter list,
// identical on every rank.
func TestBucketsFromNew(t *testing.T) {
	placementtest.Run(t, []int{3}, []string{"dp"}, func(ctx context.Context, m *mesh.Mesh) error {
		tape := autograd.NewTape()
		var params []*autograd.Value
		for i, n := range []int{10, 300, 20, 20, 5} {
			dt, err := ptest.Replicated(m, []int{n}, uint64(i))
			if err != nil {
				return err
			}
			p, err := tape.Param(fmt.Sprintf("p%d", i), dt)
			if err != nil {
				return err
			}
			params = append(params, p)
		}
		d, err := New(ctx, params, WithFirstBucket(200), WithBucketCap(400))
		if err != nil {
			return err
		}
		want := []BucketInfo{
			{Params: []int{4, 3}, Names: []string{"p4", "p3"}, Elems: 25, Bytes: 200, DType: comm.Float64},
			{Params: []int{2}, Names: []string{"p2"}, Elems: 20, Bytes: 160, DType: comm.Float64},
			{Params: []int{1}, Names: []string{"p1"}, Elems: 300, Bytes: 2400, DType: comm.Float64},
			{Params: []int{0}, Names: []string{"p0"}, Elems: 10, Bytes: 80, DType: comm.Float64},
		}
		got := d.Buckets()
		if fmt.Sprint(got) != fmt.Sprint(want) {
			return fmt.Errorf("buckets %v, want %v", got, want)
		}
		// The buckets' 355 float64s are communication buffers, or the
		// gradients themselves when the gradients are views of them.
		if b := d.Bytes(); b != (memory.Use{Comm: 2840}) {
			return fmt.Errorf("Bytes %+v, want Comm 2840", b)
		}
		v, err := New(ctx, params, WithFirstBucket(200), WithBucketCap(400), WithGradientAsBucketView())
		if err != nil {
			return err
		}
		if b := v.Bytes(); b != (memory.Use{Grads: 2840}) {
			return fmt.Errorf("Bytes with bucket views %+v, want Grads 2840", b)
		}
		return nil
	})
}

func TestNewRejects(t *testing.T) {
	placementtest.Run(t, []int{2}, []string{"dp"}, func(ctx context.Context, m *mesh.Mesh) error {
		n, err := newMLP(m, false)
		if err != nil {
			return err
		}
		for name, tc := range map[string]struct {
			params []*autograd.Value
			opts   []Option
		}{
			"no parameters": {nil, nil},
			"listed twice":  {[]*autograd.Value{n.params[0], n.params[0]}, nil},
			"no axis":       {n.params, []Option{WithAxis("tp")}},
			"WithBucketCap bytes 0: must be at least 1":    {n.params, []Option{WithBucketCap(0)}},
			"WithFirstBucket bytes -1: must be at least 1": {n.params, []Option{WithFirstBucket(-1)}},
		} {
			if _, err := New(ctx, tc.params, tc.opts...); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), name) {
				return fmt.Errorf("%s: error %v", name, err)
			}
		}
		// A parameter sharded on dp belongs to FSDP.
		spec, err := placement.NewSpec(m, []int{4}, comm.Float64, []placement.Placement{placement.Shard(0)})
		if err != nil {
			return err
		}
		dt, err := placement.NewLocal(spec, make([]float64, 2))
		if err != nil {
			return err
		}
		p, err := n.tape.Param("sharded", dt)
		if err != nil {
			return err
		}
		if _, err := New(ctx, []*autograd.Value{p}); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "Replicate") {
			return fmt.Errorf("sharded parameter: error %v", err)
		}
		return nil
	})
}

// TestMatchesSerial: DDP's reduced gradients equal the serial full-batch
// gradients on 2 and 3 ranks (uneven shards on 3) and on a 2-D mesh, with
// several buckets.
func TestMatchesSerial(t *testing.T) {
	for _, tc := range []struct {
		shape []int
		names []string
		rows  int
	}{
		{[]int{1}, []string{"dp"}, 12},
		{[]int{2}, []string{"dp"}, 12},
		{[]int{3}, []string{"dp"}, 10},
		{[]int{2, 2}, []string{"dp", "tp"}, 12},
		{[]int{2, 3}, []string{"tp", "dp"}, 11},
	} {
		for _, views := range []bool{false, true} {
			t.Run(fmt.Sprint(tc.names, tc.shape, " views=", views), func(t *testing.T) {
				want, err := serialMLPGrads(0, tc.rows)
				if err != nil {
					t.Fatal(err)
				}
				placementtest.Run(t, tc.shape, tc.names, func(ctx context.Context, m *mesh.Mesh) error {
					// Bucket views with a recycling tape: from the second
					// step on, Backward writes the gradients straight into
					// the buckets.
					var tapeOpts []autograd.Option
					opts := []Option{WithFirstBucket(8 * mlpOut), WithBucketCap(8 * mlpOut * mlpHid)}
					if views {
						tapeOpts = append(tapeOpts, autograd.WithPoisonRecycled())
						opts = append(opts, WithGradientAsBucketView())
					}
					n, err := newMLP(m, false, tapeOpts...)
					if err != nil {
						return err
					}
					d, err := New(ctx, n.params, opts...)
					if err != nil {
						return err
					}
					if len(d.Buckets()) < 3 {
						return fmt.Errorf("want several buckets, got %v", d.Buckets())
					}
					first := make([]*float64, len(n.params))
					for step := range 3 { // the state resets between steps
						n.tape.Recycle()
						if err := n.step(ctx, m, 0, tc.rows); err != nil {
							return err
						}
						if err := d.Finish(ctx); err != nil {
							return err
						}
						if err := checkReduced(n.params, want, 1e-12); err != nil {
							return fmt.Errorf("step %d: %w", step, err)
						}
						for i, p := range n.params {
							at := &p.Grad().LocalData().([]float64)[0]
							if step == 0 {
								first[i] = at
							} else if same := at == first[i]; same != views {
								return fmt.Errorf("step %d: %s: gradient in the first step's memory: %v, want %v", step, p.Name(), same, views)
							}
							p.ZeroGrad()
						}
					}
					return nil
				})
			})
		}
	}
}

// TestAverageAndScale: WithAverage and SetScale scale each rank's contribution.
func TestAverageAndScale(t *testing.T) {
	want, err := serialMLPGrads(0, 12)
	if err != nil {
		t.Fatal(err)
	}
	for name, tc := range map[string]struct {
		opts  []Option
		scale float64
		mul   float64
	}{
		"average":      {[]Option{WithAverage()}, 1, 0.5},
		"scale":        {nil, 0.25, 0.25},
		"average 0.25": {[]Option{WithAverage()}, 4, 2},
	} {
		scaled := map[string][]float64{}
		for k, v := range want {
			for _, x := range v {
				scaled[k] = append(scaled[k], x*tc.mul)
			}
		}
		t.Run(name, func(t *testing.T) {
			placementtest.Run(t, []int{2}, []string{"dp"}, func(ctx context.Context, m *mesh.Mesh) error {
				n, err := newMLP(m, false)
				if err != nil {
					return err
				}
				d, err := New(ctx, n.params, tc.opts...)
				if err != nil {
					return err
				}
				if err := d.SetScale(tc.scale); err != nil {
					return err
				}
				if err := n.step(ctx, m, 0, 12); err != nil {
					return err
				}
				if err := d.Finish(ctx); err != nil {
					return err
				}
				return checkReduced(n.params, scaled, 1e-12)
			})
		})
	}
}

// TestSetScaleRejects: a scale that is NaN or ±Inf would make every
// gradient NaN or infinite; SetScale refuses it with ErrInvalid and keeps
// the scale it had. Zero (a rank with no tokens) is accepted.
func TestSetScaleRejects(t *testing.T) {
	placementtest.Run(t, []int{2}, []string{"dp"}, func(ctx context.Context, m *mesh.Mesh) error {
		n, err := newMLP(m, false)
		if err != nil {
			return err
		}
		d, err := New(ctx, n.params)
		if err != nil {
			return err
		}
		for _, s := range []float64{math.NaN(), math.Inf(1), math.Inf(-1)} {
			if err := d.SetScale(s); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "SetScale") || strings.Contains(err.Error(), "ddp: parallel:") {
				return fmt.Errorf("SetScale(%v): %v, want ErrInvalid", s, err)
			}
		}
		if d.scale != 1 {
			return fmt.Errorf("scale %v after refused values, want 1", d.scale)
		}
		if err := d.SetScale(0); err != nil {
			return fmt.Errorf("SetScale(0): %v", err)
		}
		return nil
	})
}

// TestNoSyncAccumulation: two micro-batches, the first under NoSync, give
// the gradient of the whole batch (each micro-batch's loss is its mean, so
// the sum is scaled by 1/2), with one all-reduce per bucket.
func TestNoSyncAccumulation(t *testing.T) {
	want, err := serialMLPGrads(0, 12)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		dp    int
		views bool
	}{{2, false}, {3, false}, {2, true}, {3, true}} {
		dp := tc.dp
		placementtest.Run(t, []int{dp}, []string{"dp"}, func(ctx context.Context, m *mesh.Mesh) error {
			// With bucket views on a recycling tape, the second step
			// accumulates into gradients that live in the buckets.
			var tapeOpts []autograd.Option
			opts := []Option{WithFirstBucket(8), WithBucketCap(8)}
			if tc.views {
				tapeOpts = append(tapeOpts, autograd.WithPoisonRecycled())
				opts = append(opts, WithGradientAsBucketView())
			}
			n, err := newMLP(m, false, tapeOpts...)
			if err != nil {
				return err
			}
			d, err := New(ctx, n.params, opts...)
			if err != nil {
				return err
			}
			if tc.views { // a first synchronised step puts the gradients in the buckets
				if err := n.step(ctx, m, 0, 12); err != nil {
					return err
				}
				if err := d.Finish(ctx); err != nil {
					return err
				}
				if err := checkReduced(n.params, want, 1e-12); err != nil {
					return fmt.Errorf("first step: %w", err)
				}
				for _, p := range n.params {
					p.ZeroGrad()
				}
				n.tape.Recycle()
			}
			before := countAllReduce(d.Comm())
			if err := d.NoSync(func() error { return n.step(ctx, m, 0, 6) }); err != nil {
				return err
			}
			if got := countAllReduce(d.Comm()); got != before {
				return fmt.Errorf("NoSync issued %d all-reduces", got-before)
			}
			for _, p := range n.params {
				if pl := p.Grad().Spec().Placements()[0]; !pl.IsPartial() {
					return fmt.Errorf("%s: accumulated gradient is %v, want Partial(sum)", p.Name(), pl)
				}
			}
			if err := d.SetScale(0.5); err != nil {
				return err
			}
			if err := n.step(ctx, m, 6, 12); err != nil {
				return err
			}
			if err := d.Finish(ctx); err != nil {
				return err
			}
			// One per bucket, and one small one for the gradient-presence flags.
			if got := countAllReduce(d.Comm()) - before; got != len(d.Buckets())+1 {
				return fmt.Errorf("%d all-reduces for %d buckets", got, len(d.Buckets()))
			}
			return checkReduced(n.params, want, 1e-12)
		})
	}
}

// TestUnusedParameter: a parameter the loss does not use neither hangs
// nor fails; it keeps no gradient (so the optimizer leaves it alone, as in
// serial training) and is reported. It sits in the first bucket (last in
// the list), so nothing launches before Finish.
func TestUnusedParameter(t *testing.T) {
	want, err := serialMLPGrads(0, 12)
	if err != nil {
		t.Fatal(err)
	}
	for _, dp := range []int{2, 3} {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		err := placementtest.Simulate(ctx, []int{dp}, []string{"dp"}, func(ctx context.Context, m *mesh.Mesh) error {
			n, err := newMLP(m, true)
			if err != nil {
				return err
			}
			var reported []string
			d, err := New(ctx, n.params, WithFirstBucket(64), WithReportUnused(func(names []string) { reported = names }))
			if err != nil {
				return err
			}
			if err := n.step(ctx, m, 0, 12); err != nil {
				return err
			}
			if err := d.Finish(ctx); err != nil {
				return err
			}
			if !slices.Equal(reported, []string{"unused"}) || !slices.Equal(d.Unused(), reported) {
				return fmt.Errorf("reported %v, Unused %v; want [unused]", reported, d.Unused())
			}
			if err := checkReduced(n.params, want, 1e-12); err != nil {
				return err
			}
			// By default the optimizer refuses a step that would leave a
			// parameter silently untrained, naming it; with WithAllowFrozen it
			// accepts the reduced gradients and, like serial training,
			// leaves the unused parameter alone.
			strict, err := optim.NewAdamW(n.params)
			if err != nil {
				return err
			}
			if err := strict.Step(); !errors.Is(err, optim.ErrInvalid) || !strings.Contains(err.Error(), `"unused" has no gradient`) {
				return fmt.Errorf("a step without the unused parameter's gradient: %v, want ErrInvalid naming it", err)
			}
			opt, err := optim.NewAdamW(n.params, optim.WithLR(1e-3), optim.WithWeightDecay(0.1), optim.WithBetas(0.9, 0.999), optim.WithEps(1e-8), optim.WithAllowFrozen())
			if err != nil {
				return err
			}
			unused := n.params[len(n.params)-1]
			before := slices.Clone(unused.Data().LocalData().([]float64))
			if err := opt.Step(); err != nil {
				return err
			}
			if !slices.Equal(before, unused.Data().LocalData().([]float64)) || opt.StepCount(len(n.params)-1) != 0 {
				return fmt.Errorf("the optimizer changed the unused parameter")
			}
			return nil
		})
		cancel()
		if err != nil {
			t.Fatalf("dp=%d: %v", dp, err)
		}
	}
}

// TestOptimizerRefusesUnreduced is the reason DDP exists: AdamW refuses
// the Partial(sum) gradients backward leaves.
func TestOptimizerRefusesUnreduced(t *testing.T) {
	placementtest.Run(t, []int{2}, []string{"dp"}, func(ctx context.Context, m *mesh.Mesh) error {
		n, err := newMLP(m, false)
		if err != nil {
			return err
		}
		if err := n.step(ctx, m, 0, 12); err != nil {
			return err
		}
		opt, err := optim.NewAdamW(n.params, optim.WithLR(1e-3), optim.WithWeightDecay(0.1), optim.WithBetas(0.9, 0.999), optim.WithEps(1e-8))
		if err != nil {
			return err
		}
		if err := opt.Step(); err == nil {
			return errors.New("AdamW accepted Partial gradients")
		}
		return nil
	})
}

func countAllReduce(c comm.Communicator) int {
	n := 0
	for _, e := range c.Recorder().Entries() {
		if e.Op == comm.OpAllReduce.String() {
			n++
		}
	}
	return n
}

// TestLaunchDuringBackward: with one bucket per parameter, the buckets of
// the second layer are all-reduced (issued, per the dp communicator's
// flight recorder) before the hooks of the first layer fire.
func TestLaunchDuringBackward(t *testing.T) {
	placementtest.Run(t, []int{2}, []string{"dp"}, func(ctx context.Context, m *mesh.Mesh) error {
		n, err := newMLP(m, false)
		if err != nil {
			return err
		}
		issued := -1
		// Registered before New, so it runs before DDP's hook on w1,
		// which is the last gradient backward finalises.
		if err := n.params[0].OnGradReady(func(context.Context, *autograd.Value) error { return nil }); err != nil {
			return err
		}
		d, err := New(ctx, n.params, WithFirstBucket(8), WithBucketCap(8))
		if err != nil {
			return err
		}
		var events []string
		d.trace = func(e string) { events = append(events, e) }
		before := countAllReduce(d.Comm())
		if err := n.params[0].OnGradReady(func(context.Context, *autograd.Value) error {
			issued = countAllReduce(d.Comm()) - before
			return nil
		}); err != nil {
			return err
		}
		if err := n.step(ctx, m, 0, 12); err != nil {
			return err
		}
		// Hooks of w1 run in registration order: the empty one, DDP's
		// (w1's bucket waits for b1's), then the counter.
		if issued != 2 {
			return fmt.Errorf("%d all-reduces issued when w1's gradient was ready, want 2 (b2 and w2); events %v", issued, events)
		}
		// Buckets launch in bucket order: w2's (1) waits for b2's (0).
		wantEvents := []string{"ready w2", "ready b2", "launch 0", "launch 1", "ready w1", "ready b1", "launch 2", "launch 3"}
		if !slices.Equal(events, wantEvents) {
			return fmt.Errorf("events %v, want %v", events, wantEvents)
		}
		if got := countAllReduce(d.Comm()) - before; got != 4 {
			return fmt.Errorf("%d all-reduces after backward, want 4", got)
		}
		return d.Finish(ctx)
	})
}

// TestMisuse: a second synced backward before Finish, and Finish inside
// NoSync, are errors; the ranks still complete the step without hanging.
func TestMisuse(t *testing.T) {
	placementtest.Run(t, []int{2}, []string{"dp"}, func(ctx context.Context, m *mesh.Mesh) error {
		n, err := newMLP(m, false)
		if err != nil {
			return err
		}
		d, err := New(ctx, n.params, WithFirstBucket(8), WithBucketCap(8))
		if err != nil {
			return err
		}
		if err := d.NoSync(func() error { return d.Finish(ctx) }); !errors.Is(err, ErrInvalid) {
			return fmt.Errorf("Finish inside NoSync: %v", err)
		}
		for range 2 {
			if err := n.step(ctx, m, 0, 12); err != nil {
				return err
			}
		}
		if err := d.Finish(ctx); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "twice") {
			return fmt.Errorf("two synced backwards: %v", err)
		}
		// The next step works again.
		for _, p := range n.params {
			p.ZeroGrad()
		}
		if err := n.step(ctx, m, 0, 12); err != nil {
			return err
		}
		return d.Finish(ctx)
	})
}
