package tests

import (
	"context"
	"fmt"
	"sync"
	"testing"

	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/models/gpt"
	"github.com/b7ea7098/loom/parallel/cp"
	"github.com/b7ea7098/loom/placement/placementtest"
	"github.com/b7ea7098/loom/reference/tinygpt"
)

// flatRun is what runFlat measured: the losses, the final parameters, the
// largest number of parameter elements a rank holds, and the memory
// report of the last step (each kind's maximum over the ranks).
type flatRun struct {
	losses []float64
	params map[string][]float32
	elems  int
	optim  int64
	mem    int64 // Report.Params
}

// runFlat trains steps steps of the tiny GPT on an fsdp × cp × cpu mesh
// with FSDP over the flattened (fsdp, cp, cpu) axes (gpt.WithShardOverCP;
// cpu > 1 is Hybrid's inner axis) when fsdp·cp > 1, else on one rank.
func runFlat(t *testing.T, cfg tinygpt.Config, init map[string][]float32, fsdp, ncp, cpu int, method cp.Method, steps int) flatRun {
	t.Helper()
	var (
		mu  sync.Mutex
		out flatRun
	)
	err := placementtest.Simulate(context.Background(), []int{fsdp, ncp, max(cpu, 1)}, []string{"fsdp", "cp", "cpu"}, func(ctx context.Context, m *mesh.Mesh) error {
		opts := []gpt.TrainOption{gpt.WithRun(cfg), gpt.WithModel(gpt.WithParams(init))}
		if fsdp*ncp > 1 {
			opts = append(opts, gpt.WithFullyShard("fsdp"), gpt.WithContextParallel("cp", cp.WithMethod(method)), gpt.WithShardOverCP())
			if cpu > 1 {
				opts = append(opts, gpt.WithUlyssesAxis("cpu"))
			}
		}
		tr, err := gpt.NewTrainer(ctx, m, gpt.FromReference(cfg), opts...)
		if err != nil {
			return err
		}
		var ls []float64
		for range steps {
			_, loss, err := tr.Step(ctx)
			if err != nil {
				return err
			}
			ls = append(ls, loss)
		}
		elems := 0
		for _, p := range tr.Model.Params() {
			n := 1
			for _, d := range p.Spec().LocalShape() {
				n *= d
			}
			elems += n
		}
		rep, err := tr.Memory(ctx)
		if err != nil {
			return err
		}
		full, err := tr.Full(ctx)
		if err != nil {
			return err
		}
		mu.Lock()
		defer mu.Unlock()
		out.elems = max(out.elems, elems)
		if m.Rank() == 0 {
			out.losses, out.params, out.optim, out.mem = ls, full, rep.Optim, rep.Params
		}
		return nil
	})
	if err != nil {
		t.Fatalf("fsdp=%d × cp=%d: %v", fsdp, ncp, err)
	}
	return out
}

// FSDP over the flattened (fsdp, cp) axes, as torchtitan shards over
// dp_shard×cp, trains the tiny GPT as one rank does: 20 steps of
// fsdp=2 × cp=2 (ring), and of fsdp=1 × cp=2 (FSDP over cp alone,
// all-gather attention), give the one-rank losses and parameters within
// the layout tolerances of TestContextParallelMatchesOneRank, and so does
// Hybrid with its inner axis flattened in (fsdp=2 × cp=2 × ulysses=2). The one
// reduce-scatter over the flattened group sums the context-parallel
// partials: a cp sum dropped or done again on top is off by far more.
// Each rank holds 1/(fsdp·cp·ulysses) of the parameters (the largest rank's local
// elements, and AdamW's state in the memory accounting, within the
// chunks' rounding of 2%).
func TestContextParallelFlatFSDP(t *testing.T) {
	const steps = 20
	cfg := tinygpt.Default()
	// AdamW with ε far above |gradient| is SGD at rate LR/ε: a gradient
	// off by a factor (a cp sum done twice) moves the parameters by that
	// factor, which a scale-invariant AdamW would hide.
	cfg.LR, cfg.Eps = 1, 1
	init := gpt.RandomInit(gpt.FromReference(cfg), 3)
	one := runFlat(t, cfg, init, 1, 1, 1, cp.Ring, steps)
	t.Logf("one rank: loss %.4f at step 1, %.4f at step %d", one.losses[0], one.losses[steps-1], steps)
	cases := []struct {
		fsdp, cp, cpu int
		method        cp.Method
	}{{2, 2, 1, cp.Ring}, {1, 2, 1, cp.AllGather}, {2, 2, 2, cp.Hybrid}}
	if testing.Short() {
		cases = cases[:1]
	}
	for _, c := range cases {
		t.Run(fmt.Sprintf("fsdp%d×cp%d×%d/%v", c.fsdp, c.cp, c.cpu, c.method), func(t *testing.T) {
			got := runFlat(t, cfg, init, c.fsdp, c.cp, c.cpu, c.method, steps)
			checkLayoutParity(t, cfg, one.losses, got.losses, one.params, got.params, steps)
			n := float64(c.fsdp * c.cp * c.cpu)
			for _, q := range []struct {
				what      string
				got, full float64
			}{
				{"parameter elements", float64(got.elems), float64(one.elems)},
				{"AdamW state bytes", float64(got.optim), float64(one.optim)},
			} {
				if r := q.got * n / q.full; r < 1 || r > 1.02 {
					t.Errorf("%s per rank: %.0f of one rank's %.0f: %.3f/%v, want 1/%v", q.what, q.got, q.full, r, n, n)
				}
			}
			t.Logf("per rank: %d of %d parameter elements; AdamW state %d of %d bytes; parameters at the peak (with the gathered units) %d of %d bytes",
				got.elems, one.elems, got.optim, one.optim, got.mem, one.mem)
		})
	}
}
