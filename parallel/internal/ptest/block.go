package ptest

import (
	"context"
	"fmt"
	"math"
	"sync"
	"testing"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/parallel"
	"github.com/b7ea7098/loom/parallel/tp"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// Block is a pre-LN transformer block built from this package's modules:
// h = x + attn(ln1(x)); y = h + mlp(ln2(h)).
type Block struct {
	parallel.Hooks
	LN1, LN2 *parallel.LayerNorm
	Attn     *parallel.Attention
	MLP      *parallel.MLP
}

// Children names the block's modules as a GPT block does.
func (b *Block) Children() []parallel.Child {
	return []parallel.Child{{Name: "ln1", Module: b.LN1}, {Name: "attn", Module: b.Attn}, {Name: "ln2", Module: b.LN2}, {Name: "mlp", Module: b.MLP}}
}

// Block sizes: batch, sequence, model dim, heads, MLP hidden.
const (
	BlkB, BlkT, BlkD, BlkH, BlkF = 2, 5, 12, 6, 10 // T and F split unevenly over 2 and 3 ranks
)

// NewBlock builds a Block of seeded replicated float64 parameters on m.
func NewBlock(m *mesh.Mesh) (*Block, *autograd.Tape, error) {
	tape := autograd.NewTape()
	seed := uint64(1)
	param := func(name string, shape ...int) *autograd.Value {
		seed++
		dt, err := Replicated(m, shape, seed)
		if err != nil {
			panic(err)
		}
		p, err := tape.Param(name, dt)
		if err != nil {
			panic(err)
		}
		return p
	}
	lin := func(name string, out, in int) *parallel.Linear {
		return &parallel.Linear{Weight: param(name+".weight", out, in), Bias: param(name+".bias", out)}
	}
	ln := func(name string) *parallel.LayerNorm {
		return &parallel.LayerNorm{Weight: param(name+".weight", BlkD), Bias: param(name+".bias", BlkD), Eps: 1e-5}
	}
	qkv := lin("attn.qkv", 3*BlkD, BlkD)
	qkv.Chunks = 3
	b := &Block{
		LN1:  ln("ln1"),
		Attn: &parallel.Attention{QKV: qkv, Proj: lin("attn.proj", BlkD, BlkD), Heads: BlkH},
		LN2:  ln("ln2"),
		MLP:  &parallel.MLP{FC: lin("mlp.fc", BlkF, BlkD), Proj: lin("mlp.proj", BlkD, BlkF)},
	}
	return b, tape, nil
}

// BlockPlan is the Megatron plan of a Block, with sequence parallelism
// on the norms when sp.
func BlockPlan(sp bool) tp.Plan {
	if !sp {
		return tp.Plan{
			{Pattern: "attn.qkv", Style: tp.ColwiseParallel{}},
			{Pattern: "attn.proj", Style: tp.RowwiseParallel{}},
			{Pattern: "mlp.fc", Style: tp.ColwiseParallel{}},
			{Pattern: "mlp.proj", Style: tp.RowwiseParallel{}},
		}
	}
	seq := placement.Shard(1)
	return tp.Plan{
		{Pattern: "ln1", Style: tp.SequenceParallel{}},
		{Pattern: "attn.qkv", Style: tp.ColwiseParallel{}},
		{Pattern: "attn.proj", Style: tp.RowwiseParallel{Output: seq}},
		{Pattern: "ln2", Style: tp.SequenceParallel{}},
		{Pattern: "mlp.fc", Style: tp.ColwiseParallel{}},
		{Pattern: "mlp.proj", Style: tp.RowwiseParallel{Output: seq}},
	}
}

// Loss is Σ y² for the block's output y on input x (Shard(0) on dp; with
// sp, Shard(1) on tp so that the residual stream is sequence-sharded).
func (b *Block) Loss(ctx context.Context, tape *autograd.Tape, m *mesh.Mesh, sp bool) (*autograd.Value, error) {
	places := BatchPlaces(m)
	if sp {
		places[1] = placement.Shard(1)
	}
	spec, err := placement.NewSpec(m, []int{BlkB, BlkT, BlkD}, comm.Float64, places)
	if err != nil {
		return nil, err
	}
	xd, err := placement.FromFull(spec, placementtest.Random([]int{BlkB, BlkT, BlkD}, comm.Float64, 99))
	if err != nil {
		return nil, err
	}
	x, err := tape.Constant(xd)
	if err != nil {
		return nil, err
	}
	a, err := b.LN1.Forward(ctx, x)
	if err != nil {
		return nil, err
	}
	if a, err = b.Attn.Forward(ctx, a); err != nil {
		return nil, err
	}
	h, err := autograd.Add(x, a)
	if err != nil {
		return nil, err
	}
	u, err := b.LN2.Forward(ctx, h)
	if err != nil {
		return nil, err
	}
	if u, err = b.MLP.Forward(ctx, u); err != nil {
		return nil, err
	}
	y, err := autograd.Add(h, u)
	if err != nil {
		return nil, err
	}
	sq, err := autograd.Mul(y, y)
	if err != nil {
		return nil, err
	}
	return autograd.Sum(sq)
}

// GradsOf runs the block on a dp × tp mesh with the plan applied and
// returns the global loss and every parameter's full gradient.
func GradsOf(t *testing.T, dp, tpn int, sp, parallelize bool) (float64, map[string][]float64) {
	t.Helper()
	var (
		mu    sync.Mutex
		loss  float64
		grads = map[string][]float64{}
	)
	err := placementtest.Simulate(context.Background(), []int{dp, tpn}, []string{"dp", "tp"}, func(ctx context.Context, m *mesh.Mesh) error {
		b, tape, err := NewBlock(m)
		if err != nil {
			return err
		}
		if parallelize {
			if err := tp.Parallelize(ctx, b, "tp", BlockPlan(sp)); err != nil {
				return err
			}
		}
		params, err := parallel.Params(b)
		if err != nil {
			return err
		}
		l, err := b.Loss(ctx, tape, m, sp)
		if err != nil {
			return err
		}
		full, err := l.Data().Full(ctx)
		if err != nil {
			return err
		}
		if err := tape.Backward(ctx, l); err != nil {
			return err
		}
		if err := tp.ReduceGrads(ctx, params); err != nil {
			return err
		}
		for _, p := range params {
			// Every gradient must now be laid out like its parameter.
			if !p.Grad().Spec().Equal(p.Spec()) {
				return fmt.Errorf("gradient of %q is %v, parameter %v", p.Name(), p.Grad().Spec(), p.Spec())
			}
			g, err := p.Grad().Full(ctx)
			if err != nil {
				return err
			}
			if m.Rank() == 0 {
				mu.Lock()
				grads[p.Name()] = g.([]float64)
				mu.Unlock()
			}
		}
		if m.Rank() == 0 {
			loss = FullScalar(full)
		}
		return nil
	})
	if err != nil {
		t.Fatalf("dp=%d tp=%d sp=%v: %v", dp, tpn, sp, err)
	}
	return loss, grads
}

// FullScalar returns the one float64 of d, a full tensor, or NaN.
func FullScalar(d any) float64 {
	if v, ok := d.([]float64); ok && len(v) == 1 {
		return v[0]
	}
	return math.NaN()
}
