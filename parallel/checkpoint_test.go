package parallel_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strconv"
	"sync"
	"testing"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/parallel"
	"github.com/b7ea7098/loom/parallel/ddp"
	"github.com/b7ea7098/loom/parallel/internal/ptest"
	"github.com/b7ea7098/loom/parallel/tp"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// ckNet is a small GPT-like float32 stack: blocks "h.<l>" of h += attn(ln1(h));
// h += mlp(ln2(h)), each running through Hooks.Run so that Around wrappers
// apply.
type ckNet struct {
	parallel.Hooks
	h ckBlocks
}

type ckBlocks struct {
	parallel.Hooks
	list []*ckBlk
}

type ckBlk struct {
	parallel.Hooks
	ln1, ln2 *parallel.LayerNorm
	attn     *parallel.Attention
	mlp      *parallel.MLP
}

func (n *ckNet) Children() []parallel.Child { return []parallel.Child{{Name: "h", Module: &n.h}} }

func (bs *ckBlocks) Children() []parallel.Child {
	var out []parallel.Child
	for i, b := range bs.list {
		out = append(out, parallel.Child{Name: strconv.Itoa(i), Module: b})
	}
	return out
}

func (b *ckBlk) Children() []parallel.Child {
	return []parallel.Child{{Name: "ln1", Module: b.ln1}, {Name: "attn", Module: b.attn}, {Name: "ln2", Module: b.ln2}, {Name: "mlp", Module: b.mlp}}
}

func (b *ckBlk) Forward(ctx context.Context, h *autograd.Value) (*autograd.Value, error) {
	return b.Run(ctx, h, func(ctx context.Context, h *autograd.Value) (*autograd.Value, error) {
		for _, sub := range []struct {
			ln *parallel.LayerNorm
			f  func(context.Context, *autograd.Value) (*autograd.Value, error)
		}{{b.ln1, b.attn.Forward}, {b.ln2, b.mlp.Forward}} {
			a, err := sub.ln.Forward(ctx, h)
			if err != nil {
				return nil, err
			}
			o, err := sub.f(ctx, a)
			if err != nil {
				return nil, err
			}
			if h, err = autograd.Add(h, o); err != nil {
				return nil, err
			}
		}
		return h, nil
	})
}

const ckNB, ckNT, ckND, ckNH, ckNF, ckNL = 2, 4, 8, 2, 16, 3

func newCkNet(tape *autograd.Tape, m *mesh.Mesh) (*ckNet, error) {
	n := &ckNet{}
	for l := range ckNL {
		p := "h." + strconv.Itoa(l)
		ln1, err := parallel.NewLayerNorm(tape, m, ckND, parallel.WithName(p+".ln1"))
		if err != nil {
			return nil, err
		}
		attn, err := parallel.NewAttention(tape, m, ckND, ckNH, parallel.WithName(p+".attn"), parallel.WithInit(parallel.Normal(0.3, 1)))
		if err != nil {
			return nil, err
		}
		ln2, err := parallel.NewLayerNorm(tape, m, ckND, parallel.WithName(p+".ln2"))
		if err != nil {
			return nil, err
		}
		mlp, err := parallel.NewMLP(tape, m, ckND, ckNF, parallel.WithName(p+".mlp"), parallel.WithInit(parallel.Normal(0.3, 2)), parallel.WithBiasInit(parallel.Normal(0.1, 3)))
		if err != nil {
			return nil, err
		}
		n.h.list = append(n.h.list, &ckBlk{ln1: ln1, attn: attn, ln2: ln2, mlp: mlp})
	}
	return n, nil
}

func ckPlan(sp bool) tp.Plan {
	var plan tp.Plan
	for _, r := range ptest.BlockPlan(sp) {
		plan = append(plan, tp.Rule{Pattern: "h.*." + r.Pattern, Style: r.Style})
	}
	return plan
}

// ckGrads runs forward and backward of the stack on a dp × tp mesh (the
// plan applied on tp > 1, DDP on dp > 1), with checkpointing as ck says,
// and returns every parameter's gradient's local block on every rank and
// how often each parameter's hook fired.
func ckGrads(t *testing.T, dp, tpn int, sp bool, ck string) (map[string][]float32, map[string]int, int64) {
	t.Helper()
	var mu sync.Mutex
	var peak int64
	grads, fired := map[string][]float32{}, map[string]int{}
	err := placementtest.Simulate(context.Background(), []int{dp, tpn}, []string{"dp", "tp"}, func(ctx context.Context, m *mesh.Mesh) error {
		tape := autograd.NewTape(autograd.WithPoisonRecycled())
		net, err := newCkNet(tape, m)
		if err != nil {
			return err
		}
		var opts []autograd.CheckpointOption
		if ck == "selective" {
			opts = append(opts, autograd.WithKeepMatrixProducts())
		}
		if ck == "full before tp" {
			if err := parallel.Checkpoint(net, []string{"h.*"}); err != nil {
				return err
			}
		}
		if tpn > 1 {
			if err := tp.Parallelize(ctx, net, "tp", ckPlan(sp)); err != nil {
				return err
			}
		}
		switch ck {
		case "full", "selective":
			if err := parallel.Checkpoint(net, []string{"h.*"}, opts...); err != nil {
				return err
			}
		case "attention and mlp":
			if err := parallel.Checkpoint(net, []string{"h.*.attn", "h.*.mlp"}); err != nil {
				return err
			}
		}
		params, err := parallel.Params(net)
		if err != nil {
			return err
		}
		var dd *ddp.DDP
		if dp > 1 {
			if dd, err = ddp.New(ctx, params, ddp.WithFirstBucket(512), ddp.WithBucketCap(2048)); err != nil {
				return err
			}
		}
		for _, p := range params {
			if err := p.OnGradReady(func(context.Context, *autograd.Value) error {
				mu.Lock()
				fired[fmt.Sprint(m.Rank(), p.Name())]++
				mu.Unlock()
				return nil
			}); err != nil {
				return err
			}
		}
		places := ptest.BatchPlaces(m)
		if sp {
			places[1] = placement.Shard(1)
		}
		spec, err := placement.NewSpec(m, []int{ckNB, ckNT, ckND}, comm.Float32, places)
		if err != nil {
			return err
		}
		xd, err := placement.FromFull(spec, placementtest.Random([]int{ckNB, ckNT, ckND}, comm.Float32, 99))
		if err != nil {
			return err
		}
		x, err := tape.Constant(xd)
		if err != nil {
			return err
		}
		h := x
		for _, b := range net.h.list {
			if h, err = b.Forward(ctx, h); err != nil {
				return err
			}
		}
		sq, err := autograd.Mul(h, h)
		if err != nil {
			return err
		}
		l, err := autograd.Sum(sq)
		if err != nil {
			return err
		}
		if err := tape.Backward(ctx, l); err != nil {
			return err
		}
		if dd != nil {
			if err := dd.Finish(ctx); err != nil {
				return err
			}
		}
		mu.Lock()
		defer mu.Unlock()
		if m.Rank() == 0 {
			peak = tape.PeakActivationBytes()
		}
		for _, p := range params {
			g, ok := p.Grad().LocalData().([]float32)
			if !ok {
				return fmt.Errorf("%s: gradient of type %T", p.Name(), p.Grad().LocalData())
			}
			grads[fmt.Sprint(m.Rank(), p.Name())] = append([]float32(nil), g...)
		}
		return nil
	})
	if err != nil {
		t.Fatalf("dp=%d tp=%d sp=%v %s: %v", dp, tpn, sp, ck, err)
	}
	return grads, fired, peak
}

// Checkpointing the blocks (full, selective, sub-modules; before or after
// Parallelize) leaves every gradient bit for bit as it is without, on one
// rank, under DDP (dp=2) and under tensor and sequence parallelism (tp=2),
// and every parameter's gradient-ready hook fires once.
func TestCheckpointMatchesPlain(t *testing.T) {
	for _, c := range []struct {
		dp, tp int
		sp     bool
		cks    []string
	}{
		{1, 1, false, []string{"full", "selective", "attention and mlp"}},
		{2, 1, false, []string{"full", "selective"}},
		{1, 2, false, []string{"full", "selective", "full before tp"}},
		{1, 2, true, []string{"full", "attention and mlp"}},
	} {
		want, _, plainPeak := ckGrads(t, c.dp, c.tp, c.sp, "none")
		for _, ck := range c.cks {
			got, fired, peak := ckGrads(t, c.dp, c.tp, c.sp, ck)
			if peak >= plainPeak {
				t.Errorf("dp=%d tp=%d sp=%v %s: peak activation bytes %d, without checkpointing %d", c.dp, c.tp, c.sp, ck, peak, plainPeak)
			}
			if len(got) != len(want) || len(got) == 0 {
				t.Fatalf("%d gradients, want %d", len(got), len(want))
			}
			for name, w := range want {
				g := got[name]
				for i := range w {
					if math.Float32bits(g[i]) != math.Float32bits(w[i]) {
						t.Errorf("dp=%d tp=%d sp=%v %s: grad %s[%d] = %v, without checkpointing %v", c.dp, c.tp, c.sp, ck, name, i, g[i], w[i])
						break
					}
				}
				if fired[name] != 1 {
					t.Errorf("dp=%d tp=%d sp=%v %s: the hook of %s fired %d times", c.dp, c.tp, c.sp, ck, name, fired[name])
				}
			}
		}
	}
}

func TestCheckpointErrors(t *testing.T) {
	placementtest.Run(t, []int{1}, []string{"dp"}, func(ctx context.Context, m *mesh.Mesh) error {
		tape := autograd.NewTape()
		net, err := newCkNet(tape, m)
		if err != nil {
			return err
		}
		emb, err := parallel.NewEmbedding(tape, m, 5, ckND)
		if err != nil {
			return err
		}
		for _, c := range []struct {
			root     parallel.Module
			patterns []string
		}{
			{net, nil},
			{net, []string{"h.*", "h.*.nothing"}},
			{net, []string{"h.0.attn.qkv"}},
			{emb, []string{""}},
			{nil, []string{"h.*"}},
		} {
			if err := parallel.Checkpoint(c.root, c.patterns); !errors.Is(err, parallel.ErrInvalid) {
				t.Errorf("Checkpoint(%T, %q): got %v, want ErrInvalid", c.root, c.patterns, err)
			}
		}
		return nil
	})
}
