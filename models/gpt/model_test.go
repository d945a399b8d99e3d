package gpt_test

import (
	"context"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/models/gpt"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
	"github.com/b7ea7098/loom/reference/tinygpt"
)

// small is a configuration small enough for quick tests.
func small() tinygpt.Config {
	c := tinygpt.Default()
	c.D, c.H, c.L, c.F, c.T, c.B = 16, 2, 2, 32, 8, 4
	c.V = tinygpt.MinVocab
	return c
}

func randomBatch(c tinygpt.Config, seed uint64) tinygpt.Batch {
	rng := rand.New(rand.NewPCG(seed, 1))
	b := tinygpt.Batch{Step: 1, B: c.B, T: c.T, X: make([]int64, c.B*c.T), Y: make([]int64, c.B*c.T)}
	for i := range b.X {
		b.X[i], b.Y[i] = int64(rng.IntN(c.V)), int64(rng.IntN(c.V))
	}
	return b
}

func TestNewRejectsBadInit(t *testing.T) {
	c := small()
	placementtest.Run(t, []int{1}, []string{"dp"}, func(ctx context.Context, m *mesh.Mesh) error {
		for name, mutate := range map[string]func(map[string][]float32){
			"no initial value": func(init map[string][]float32) { delete(init, tinygpt.ParamWPE) },
			"has 3 values":     func(init map[string][]float32) { init[tinygpt.ParamLNFB] = make([]float32, 3) },
			"unknown":          func(init map[string][]float32) { init["h.9.ln1.weight"] = nil },
		} {
			init := gpt.RandomInit(gpt.FromReference(c), 1)
			mutate(init)
			_, err := gpt.New(autograd.NewTape(), m, gpt.FromReference(c), gpt.WithParams(init))
			if err == nil || !strings.Contains(err.Error(), name) {
				t.Errorf("%s: got error %v", name, err)
			}
		}
		return nil
	})
}

func TestForwardNearUniformAtInit(t *testing.T) {
	c := small()
	placementtest.Run(t, []int{1}, []string{"dp"}, func(ctx context.Context, m *mesh.Mesh) error {
		tape := autograd.NewTape()
		md, err := gpt.New(tape, m, gpt.FromReference(c), gpt.WithParams(gpt.RandomInit(gpt.FromReference(c), 7)))
		if err != nil {
			return err
		}
		if len(md.Params()) != 12*c.L+5 || md.Param(tinygpt.ParamLMHead) == nil {
			t.Errorf("model has %d parameters", len(md.Params()))
		}
		// A shorter context than cfg.T is allowed.
		short := c
		short.B, short.T = 2, 5
		b := randomBatch(short, 3)
		x, y, err := md.Inputs(b, nil)
		if err != nil {
			return err
		}
		loss, err := md.Forward(ctx, tape, x, y)
		if err != nil {
			return err
		}
		l, err := gpt.Loss(loss)
		if err != nil {
			return err
		}
		if u := math.Log(float64(c.V)); math.Abs(l-u) > 0.1 {
			t.Errorf("loss at a small init %v, want about ln V = %v", l, u)
		}
		if _, err := md.Forward(ctx, autograd.NewTape(), x, y); err == nil {
			t.Error("Forward on a foreign tape succeeded")
		}
		return tape.Backward(ctx, loss)
	})
}

// Data parallelism: ids sharded on the batch dim over 2 ranks give the same
// global loss and (summed) gradients as one rank with the whole batch.
func TestDataParallelMatchesOneRank(t *testing.T) {
	c := small()
	init := gpt.RandomInit(gpt.FromReference(c), 11)
	b := randomBatch(c, 5)
	want := map[string][]float64{}
	var wantLoss float64
	placementtest.Run(t, []int{1}, []string{"dp"}, func(ctx context.Context, m *mesh.Mesh) error {
		tape := autograd.NewTape()
		md, err := gpt.New(tape, m, gpt.FromReference(c), gpt.WithParams(init))
		if err != nil {
			return err
		}
		x, y, err := md.Inputs(b, nil)
		if err != nil {
			return err
		}
		loss, err := md.Forward(ctx, tape, x, y)
		if err != nil {
			return err
		}
		if wantLoss, err = gpt.Loss(loss); err != nil {
			return err
		}
		if err := tape.Backward(ctx, loss); err != nil {
			return err
		}
		for _, p := range md.Params() {
			want[p.Name()] = f64(p.Grad().LocalData().([]float32))
		}
		return nil
	})
	placementtest.Run(t, []int{2}, []string{"dp"}, func(ctx context.Context, m *mesh.Mesh) error {
		tape := autograd.NewTape()
		md, err := gpt.New(tape, m, gpt.FromReference(c), gpt.WithParams(init))
		if err != nil {
			return err
		}
		x, y, err := md.Inputs(b, []placement.Placement{placement.Shard(0)})
		if err != nil {
			return err
		}
		loss, err := md.Forward(ctx, tape, x, y)
		if err != nil {
			return err
		}
		full, err := loss.Data().Full(ctx)
		if err != nil {
			return err
		}
		var got float64
		switch d := full.(type) {
		case []float32:
			got = float64(d[0])
		}
		if math.Abs(got-wantLoss) > 1e-6*wantLoss {
			t.Errorf("rank %d: data-parallel loss %v, one rank %v", m.Rank(), got, wantLoss)
		}
		if err := tape.Backward(ctx, loss); err != nil {
			return err
		}
		for _, p := range md.Params() {
			g, err := p.Grad().Full(ctx) // the all-reduce DDP would do
			if err != nil {
				return err
			}
			if rel := relL2(f64(g.([]float32)), want[p.Name()]); rel > 1e-5 {
				t.Errorf("rank %d: %s: data-parallel gradient differs by %.3g relative", m.Rank(), p.Name(), rel)
			}
		}
		return nil
	})
}

func f64(x []float32) []float64 {
	out := make([]float64, len(x))
	for i, v := range x {
		out[i] = float64(v)
	}
	return out
}

func relL2(got, want []float64) float64 {
	var d, n float64
	for i := range want {
		d += (got[i] - want[i]) * (got[i] - want[i])
		n += want[i] * want[i]
	}
	if n == 0 {
		return math.Sqrt(d)
	}
	return math.Sqrt(d / n)
}

// TestSeedIsRandomInit: WithSeed draws, through the constructors' shared
// generator, exactly the values RandomInit lists; Tiny is the reference's
// shape.
func TestSeedIsRandomInit(t *testing.T) {
	if n := gpt.Tiny().NumParams(); n != 470528 {
		t.Errorf("Tiny has %d parameters, reference/TINY_GPT.md says 470,528", n)
	}
	c := gpt.FromReference(small())
	placementtest.Run(t, []int{1}, []string{"dp"}, func(ctx context.Context, m *mesh.Mesh) error {
		md, err := gpt.New(autograd.NewTape(), m, c, gpt.WithSeed(5))
		if err != nil {
			return err
		}
		want := gpt.RandomInit(c, 5)
		var order []string
		for _, p := range c.Params() {
			order = append(order, p.Name)
		}
		if got := md.Names(); !slices.Equal(got, order) {
			t.Errorf("parameters %v, want param_order %v", got, order)
		}
		for _, p := range md.Params() {
			if got := p.Data().LocalData().([]float32); !slices.Equal(got, want[p.Name()]) {
				t.Errorf("%s: WithSeed and RandomInit differ", p.Name())
			}
		}
		if md.Config() != c {
			t.Errorf("Config() = %+v, want %+v", md.Config(), c)
		}
		return nil
	})
}
