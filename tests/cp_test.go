package tests

import (
	"context"
	"fmt"
	"math"
	"strings"
	"sync"
	"testing"

	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/models/gpt"
	"github.com/b7ea7098/loom/parallel/cp"
	"github.com/b7ea7098/loom/placement/placementtest"
	"github.com/b7ea7098/loom/reference/tinygpt"
)

// cpLayout is a context-parallel layout of the tiny GPT: the sizes of the
// dp, fsdp, tp and cp mesh axes, the attention method, and whether the
// sequence is sharded in plain blocks rather than load balanced.
type cpLayout struct {
	dp, fsdp, tp, cp int
	method           cp.Method
	plain            bool
	ulysses          int // Hybrid: the inner (Ulysses) axis's size
}

func (l cpLayout) String() string {
	s := fmt.Sprintf("cp=%d,%v", l.cp, l.method)
	for _, a := range []struct {
		name string
		n    int
	}{{"dp", l.dp}, {"fsdp", l.fsdp}, {"tp", l.tp}} {
		if a.n > 1 {
			s += fmt.Sprintf(",%s=%d", a.name, a.n)
		}
	}
	if l.plain {
		s += ",plain"
	}
	if l.ulysses > 1 {
		s += fmt.Sprintf(",ulysses=%d", l.ulysses)
	}
	return s
}

// runCP trains steps steps of the tiny GPT on l's dp × fsdp × tp × cp mesh
// of in-process ranks and returns the losses and the final parameters.
func runCP(t *testing.T, cfg tinygpt.Config, init map[string][]float32, l cpLayout, steps int) ([]float64, map[string][]float32) {
	t.Helper()
	var (
		mu     sync.Mutex
		losses []float64
		params map[string][]float32
	)
	shape := []int{max(l.dp, 1), max(l.fsdp, 1), max(l.tp, 1), max(l.cp, 1), max(l.ulysses, 1)}
	err := placementtest.Simulate(context.Background(), shape, []string{"dp", "fsdp", "tp", "cp", "cpu"}, func(ctx context.Context, m *mesh.Mesh) error {
		opts := []gpt.TrainOption{gpt.WithRun(cfg), gpt.WithModel(gpt.WithParams(init)),
			gpt.WithDataParallel("dp"), gpt.WithTensorParallel("tp"),
			gpt.WithContextParallel("cp", cp.WithMethod(l.method))}
		if l.fsdp > 1 {
			opts = append(opts, gpt.WithFullyShard("fsdp"))
		}
		if l.plain {
			opts = append(opts, gpt.WithPlainSequenceShards())
		}
		if l.ulysses > 1 {
			opts = append(opts, gpt.WithUlyssesAxis("cpu"))
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
		full, err := tr.Full(ctx)
		if err != nil {
			return err
		}
		if m.Rank() == 0 {
			mu.Lock()
			losses, params = ls, full
			mu.Unlock()
		}
		return nil
	})
	if err != nil {
		t.Fatalf("%v: %v", l, err)
	}
	return losses, params
}

// Context parallelism trains the tiny GPT as one rank does: 20 steps of
// every attention method on cp=2 (load balanced, and plain for the ring),
// Hybrid on cp=2 × ulysses=2, and cp=2 with tp=2, dp=2 and fsdp=2, give the one-rank losses and
// parameters within TestParallelLayoutsMatchOneRank's tolerances (the
// layouts differ only in float32 summation order: attention merged by
// log-sum-exp over blocks, gradients summed over cp). A wrong position,
// target, mask or a missing gradient sum is off by far more.
func TestContextParallelMatchesOneRank(t *testing.T) {
	const steps = 20
	cfg := tinygpt.Default()
	init := gpt.RandomInit(gpt.FromReference(cfg), 3)
	want, wantParams := runCP(t, cfg, init, cpLayout{}, steps)
	cases := []cpLayout{
		{cp: 2, method: cp.Ring},
		{cp: 2, method: cp.AllGather},
		{cp: 2, method: cp.Ulysses},
		{cp: 2, method: cp.Ring, plain: true},
		{cp: 2, tp: 2, method: cp.Ring},
		{cp: 2, dp: 2, method: cp.Ring},
		{cp: 2, ulysses: 2, method: cp.Hybrid},
		{cp: 2, fsdp: 2, method: cp.Ring},
	}
	if testing.Short() {
		cases = cases[:1]
	}
	for _, c := range cases {
		t.Run(c.String(), func(t *testing.T) {
			got, params := runCP(t, cfg, init, c, steps)
			checkLayoutParity(t, cfg, want, got, wantParams, params, steps)
		})
	}
}

// checkLayoutParity holds losses and parameters to the layout tolerances
// of TestParallelLayoutsMatchOneRank (see its comment).
func checkLayoutParity(t *testing.T, cfg tinygpt.Config, want, got []float64, wantParams, params map[string][]float32, steps int) {
	t.Helper()
	var worst float64
	for i := range want {
		d := math.Abs(got[i] - want[i])
		worst = max(worst, d)
		if !(d <= 1e-4) {
			t.Errorf("step %d: loss %.7f, one rank %.7f (|Δ| %.2g > 1e-4)", i+1, got[i], want[i], d)
		}
	}
	var worstAbs, worstRel float64
	for name, w := range wantParams {
		g, ok := params[name]
		if !ok || len(g) != len(w) {
			t.Errorf("parameter %q: %d values, want %d", name, len(g), len(w))
			continue
		}
		a := maxAbs(g, w)
		var r float64
		if strings.HasSuffix(name, tinygpt.BlockQKVB) {
			d := cfg.D // q and v parts only; the k part is rounding noise
			r = max(relL2(g[:d], w[:d]), relL2(g[2*d:], w[2*d:]))
		} else {
			r = relL2(g, w)
		}
		worstAbs, worstRel = max(worstAbs, a), max(worstRel, r)
		if !(a <= 2e-3 && r <= 1e-3) {
			t.Errorf("parameter %q after %d steps: max |Δ| %.2g (limit 2e-3), relative L2 %.2g (limit 1e-3)", name, steps, a, r)
		}
	}
	t.Logf("largest loss difference %.2g; parameters: max |Δ| %.2g, relative L2 %.2g", worst, worstAbs, worstRel)
}
