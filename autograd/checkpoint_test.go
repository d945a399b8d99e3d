package autograd

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"testing"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// ckB, ckT, ckD and ckH are the shapes of the checkpoint tests' blocks.
const ckB, ckT, ckD, ckH = 2, 4, 8, 2

// ckParams is one block's parameters.
type ckParams struct {
	ln1w, ln1b, qkvW, qkvB, projW, ln2w, ln2b, fc, proj *Value
}

func ckParam(tape *Tape, m *mesh.Mesh, name string, shape []int, seed uint64) (*Value, error) {
	places := make(pl, len(m.Shape()))
	for i := range places {
		places[i] = R
	}
	spec, err := placement.NewSpec(m, shape, comm.Float32, places)
	if err != nil {
		return nil, err
	}
	full := placementtest.Random(shape, comm.Float32, seed).([]float32)
	for i := range full {
		full[i] *= 0.3
	}
	dt, err := placement.FromFull(spec, full)
	if err != nil {
		return nil, err
	}
	return tape.Param(name, dt)
}

func ckBlockParams(tape *Tape, m *mesh.Mesh, l int) (*ckParams, error) {
	var p ckParams
	for i, s := range []struct {
		dst   **Value
		shape []int
	}{{&p.ln1w, []int{ckD}}, {&p.ln1b, []int{ckD}}, {&p.qkvW, []int{3 * ckD, ckD}}, {&p.qkvB, []int{3 * ckD}}, {&p.projW, []int{ckD, ckD}}, {&p.ln2w, []int{ckD}}, {&p.ln2b, []int{ckD}}, {&p.fc, []int{ckD, 2 * ckD}}, {&p.proj, []int{2 * ckD, ckD}}} {
		v, err := ckParam(tape, m, fmt.Sprintf("h.%d.p%d", l, i), s.shape, uint64(100*l+i+1))
		if err != nil {
			return nil, err
		}
		*s.dst = v
	}
	return &p, nil
}

// ckBlock is a pre-LN transformer block on h [B, T, D] that uses every op
// a selective checkpoint may keep: Linear, MatMul, BatchedMatMul (an
// unfused attention next to the fused one) and CausalAttention.
func ckBlock(p *ckParams, h *Value) (*Value, error) {
	a, err := LayerNorm(h, p.ln1w, p.ln1b, 1e-5)
	if err != nil {
		return nil, err
	}
	qkv, err := Linear(a, p.qkvW, p.qkvB)
	if err != nil {
		return nil, err
	}
	parts, err := SplitLast(qkv, 3)
	if err != nil {
		return nil, err
	}
	var heads [3]*Value
	for i, v := range parts {
		r, err := Reshape(v, ckB, ckT, ckH, ckD/ckH)
		if err != nil {
			return nil, err
		}
		if heads[i], err = Permute(r, 0, 2, 1, 3); err != nil {
			return nil, err
		}
	}
	o, err := CausalAttention(heads[0], heads[1], heads[2])
	if err != nil {
		return nil, err
	}
	kt, err := Transpose(heads[1], -2, -1)
	if err != nil {
		return nil, err
	}
	s, err := BatchedMatMul(heads[0], kt)
	if err != nil {
		return nil, err
	}
	if s, err = CausalSoftmax(s); err != nil {
		return nil, err
	}
	o2, err := BatchedMatMul(s, heads[2])
	if err != nil {
		return nil, err
	}
	if o, err = Add(o, o2); err != nil {
		return nil, err
	}
	if o, err = Permute(o, 0, 2, 1, 3); err != nil {
		return nil, err
	}
	if o, err = Reshape(o, ckB, ckT, ckD); err != nil {
		return nil, err
	}
	if o, err = Linear(o, p.projW, nil); err != nil {
		return nil, err
	}
	if h, err = Add(h, o); err != nil {
		return nil, err
	}
	if a, err = LayerNorm(h, p.ln2w, p.ln2b, 1e-5); err != nil {
		return nil, err
	}
	if a, err = Reshape(a, ckB*ckT, ckD); err != nil {
		return nil, err
	}
	u, err := MatMul(a, p.fc)
	if err != nil {
		return nil, err
	}
	if u, err = GELU(u); err != nil {
		return nil, err
	}
	if u, err = MatMul(u, p.proj); err != nil {
		return nil, err
	}
	if u, err = Reshape(u, ckB, ckT, ckD); err != nil {
		return nil, err
	}
	return Add(h, u)
}

// ckRun is one way of running the blocks.
type ckRun struct {
	name string
	opts []Option
	// wrap runs blocks lo..hi-1 (nil: plainly).
	wrap func(ctx context.Context, h *Value, lo, hi int, body func(context.Context, *Value, int, int) (*Value, error)) (*Value, error)
}

func ckOne(opts ...CheckpointOption) func(ctx context.Context, h *Value, lo, hi int, body func(context.Context, *Value, int, int) (*Value, error)) (*Value, error) {
	return func(ctx context.Context, h *Value, lo, hi int, body func(context.Context, *Value, int, int) (*Value, error)) (*Value, error) {
		for l := lo; l < hi; l++ {
			out, err := Checkpoint(ctx, []*Value{h}, func(ctx context.Context, in []*Value) ([]*Value, error) {
				y, err := body(ctx, in[0], l, l+1)
				return []*Value{y}, err
			}, opts...)
			if err != nil {
				return nil, err
			}
			h = out[0]
		}
		return h, nil
	}
}

// ckStep runs forward and backward of L blocks and a probe loss, with
// hooks counting how often each parameter's gradient is reported ready;
// it returns the loss, the gradients, the hook counts and the tape's peak
// activation bytes.
func ckStep(ctx context.Context, m *mesh.Mesh, run ckRun, layers int) (float32, map[string][]float32, map[string]int, int64, error) {
	tape := NewTape(run.opts...)
	var blocks []*ckParams
	var params []*Value
	for l := range layers {
		p, err := ckBlockParams(tape, m, l)
		if err != nil {
			return 0, nil, nil, 0, err
		}
		blocks = append(blocks, p)
		params = append(params, p.ln1w, p.ln1b, p.qkvW, p.qkvB, p.projW, p.ln2w, p.ln2b, p.fc, p.proj)
	}
	x0, err := ckParam(tape, m, "x", []int{ckB, ckT, ckD}, 7)
	if err != nil {
		return 0, nil, nil, 0, err
	}
	params = append(params, x0)
	hooks := map[string]int{}
	var early []string
	for _, p := range params {
		if err := p.OnGradReady(func(ctx context.Context, v *Value) error {
			hooks[v.Name()]++
			if v.Grad() == nil {
				early = append(early, v.Name())
			}
			return nil
		}); err != nil {
			return 0, nil, nil, 0, err
		}
	}
	grads := map[string][]float32{}
	var loss float32
	for pass := range 2 { // the second pass reuses the arena (and recycles)
		tape.Recycle()
		tape.ResetPeak()
		clear(hooks)
		for _, p := range params {
			p.ZeroGrad()
		}
		h, err := Scale(x0, 1)
		if err != nil {
			return 0, nil, nil, 0, err
		}
		body := func(ctx context.Context, h *Value, lo, hi int) (*Value, error) {
			for l := lo; l < hi; l++ {
				if h, err = ckBlock(blocks[l], h); err != nil {
					return nil, err
				}
			}
			return h, nil
		}
		if run.wrap == nil {
			h, err = body(ctx, h, 0, layers)
		} else {
			h, err = run.wrap(ctx, h, 0, layers, body)
		}
		if err != nil {
			return 0, nil, nil, 0, err
		}
		l, err := probe(ctx, h)
		if err != nil {
			return 0, nil, nil, 0, err
		}
		loss = l.Data().LocalData().([]float32)[0]
		if err := tape.Backward(ctx, l); err != nil {
			return 0, nil, nil, 0, err
		}
		if tape.ActivationBytes() != 0 {
			return 0, nil, nil, 0, fmt.Errorf("pass %d: %d activation bytes after Backward", pass, tape.ActivationBytes())
		}
	}
	for _, p := range params {
		grads[p.Name()] = slices.Clone(p.Grad().LocalData().([]float32))
	}
	if len(early) > 0 {
		return 0, nil, nil, 0, fmt.Errorf("hooks of %v fired before their gradient arrived", early)
	}
	return loss, grads, hooks, tape.PeakActivationBytes(), nil
}

// Checkpointed blocks (full, selective, nested, on recycling tapes) give
// the loss and every gradient of the plain run bit for bit, fire every
// parameter's hook exactly once, and hold fewer activation bytes.
func TestCheckpointExact(t *testing.T) {
	const layers = 4
	nested := func(opts ...CheckpointOption) func(ctx context.Context, h *Value, lo, hi int, body func(context.Context, *Value, int, int) (*Value, error)) (*Value, error) {
		return func(ctx context.Context, h *Value, lo, hi int, body func(context.Context, *Value, int, int) (*Value, error)) (*Value, error) {
			for l := lo; l < hi; l += 2 {
				out, err := Checkpoint(ctx, []*Value{h}, func(ctx context.Context, in []*Value) ([]*Value, error) {
					y, err := ckOne(opts...)(ctx, in[0], l, l+2, body)
					return []*Value{y}, err
				})
				if err != nil {
					return nil, err
				}
				h = out[0]
			}
			return h, nil
		}
	}
	runs := []ckRun{
		{name: "plain"},
		{name: "full", wrap: ckOne()},
		{name: "selective", wrap: ckOne(WithKeepMatrixProducts())},
		{name: "keep attention", wrap: ckOne(WithKeepOps("CausalAttention", "GELU"))},
		{name: "nested", wrap: nested()},
		{name: "nested selective", wrap: nested(WithKeepOps("Linear"))},
		{name: "full recycling", opts: []Option{WithPoisonRecycled()}, wrap: ckOne()},
		{name: "selective recycling", opts: []Option{WithPoisonRecycled()}, wrap: ckOne(WithKeepMatrixProducts())},
		{name: "plain recycling", opts: []Option{WithPoisonRecycled()}},
	}
	simulate(t, []int{1}, func(ctx context.Context, m *mesh.Mesh) error {
		wantLoss, want, _, plainPeak, err := ckStep(ctx, m, runs[0], layers)
		if err != nil {
			return err
		}
		for _, r := range runs {
			loss, got, hooks, peak, err := ckStep(ctx, m, r, layers)
			if err != nil {
				return fmt.Errorf("%s: %w", r.name, err)
			}
			if math.Float32bits(loss) != math.Float32bits(wantLoss) {
				t.Errorf("%s: loss %v, plain %v", r.name, loss, wantLoss)
			}
			for name, w := range want {
				g := got[name]
				for i := range w {
					if math.Float32bits(g[i]) != math.Float32bits(w[i]) {
						t.Errorf("%s: grad %s[%d] = %v, plain %v", r.name, name, i, g[i], w[i])
						break
					}
				}
				if hooks[name] != 1 {
					t.Errorf("%s: the hook of %s fired %d times", r.name, name, hooks[name])
				}
			}
			ratio := float64(peak) / float64(plainPeak)
			t.Logf("%s: peak activation bytes %d (%.3f of plain)", r.name, peak, ratio)
			if r.name == "full" && ratio > 0.5 {
				t.Errorf("full checkpointing: peak %d is %.3f of the plain %d; want <= 0.5", peak, ratio, plainPeak)
			}
			if r.wrap != nil && peak >= plainPeak && !strings.Contains(r.name, "attention") {
				t.Errorf("%s: peak %d not below the plain %d", r.name, peak, plainPeak)
			}
		}
		return nil
	})
}

// Activation bytes on a case small enough to count by hand: x = 2·x0
// [2, 3] (24 bytes), y = GELU(x·w) (two [2, 3] results), loss = Sum(y)
// (4 bytes).
func TestActivationBytesByHand(t *testing.T) {
	simulate(t, []int{1}, func(ctx context.Context, m *mesh.Mesh) error {
		for _, c := range []struct {
			name      string
			ckpt      bool
			opts      []CheckpointOption
			after, pk int64
		}{
			// Scale 24 + MatMul 24 + GELU 24 + Sum 4.
			{name: "plain", after: 76, pk: 76},
			// Scale 24 + checkpoint output 24 (its input x is Scale's
			// block) + Sum 4; the recompute holds MatMul and GELU again
			// next to Scale's 24.
			{name: "full", ckpt: true, after: 52, pk: 72},
			// The kept MatMul result (24) is held from the forward on.
			{name: "keep MatMul", ckpt: true, opts: []CheckpointOption{WithKeepOps("MatMul")}, after: 76, pk: 76},
		} {
			tape := NewTape()
			x0, err := ckParam(tape, m, "x0", []int{2, 3}, 1)
			if err != nil {
				return err
			}
			w, err := ckParam(tape, m, "w", []int{3, 3}, 2)
			if err != nil {
				return err
			}
			x, err := Scale(x0, 2)
			if err != nil {
				return err
			}
			f := func(ctx context.Context, in []*Value) ([]*Value, error) {
				y, err := MatMul(in[0], w)
				if err != nil {
					return nil, err
				}
				y, err = GELU(y)
				return []*Value{y}, err
			}
			var ys []*Value
			if c.ckpt {
				ys, err = Checkpoint(ctx, []*Value{x}, f, c.opts...)
			} else {
				ys, err = f(ctx, []*Value{x})
			}
			if err != nil {
				return err
			}
			loss, err := Sum(ys[0])
			if err != nil {
				return err
			}
			if got := tape.ActivationBytes(); got != c.after {
				t.Errorf("%s: %d activation bytes after forward, want %d", c.name, got, c.after)
			}
			var seen []int64
			if err := w.OnGradReady(func(context.Context, *Value) error {
				seen = append(seen, tape.ActivationBytes())
				return nil
			}); err != nil {
				return err
			}
			if err := tape.Backward(ctx, loss); err != nil {
				return err
			}
			if got := tape.PeakActivationBytes(); got != c.pk {
				t.Errorf("%s: peak %d, want %d", c.name, got, c.pk)
			}
			// w's hook fires once its consumer (MatMul or the checkpoint)
			// is passed: only Scale's 24 bytes are left.
			if !slices.Equal(seen, []int64{24}) {
				t.Errorf("%s: w's hook saw %v activation bytes, want [24]", c.name, seen)
			}
			if tape.ActivationBytes() != 0 {
				t.Errorf("%s: %d bytes after Backward", c.name, tape.ActivationBytes())
			}
			tape.ResetPeak()
			if tape.PeakActivationBytes() != 0 {
				t.Errorf("%s: peak %d after ResetPeak", c.name, tape.PeakActivationBytes())
			}
		}
		return nil
	})
}

// Checkpoint's edge cases: several outputs and a captured value (exact),
// NoGrad (just runs fn), Recomputing, and a function that runs other ops
// when recomputed (an error, not wrong gradients).
func TestCheckpointCases(t *testing.T) {
	simulate(t, []int{1}, func(ctx context.Context, m *mesh.Mesh) error {
		build := func(tape *Tape) (x, w, c *Value, err error) {
			if x, err = ckParam(tape, m, "x", []int{2, 3}, 1); err != nil {
				return
			}
			if w, err = ckParam(tape, m, "w", []int{3, 3}, 2); err != nil {
				return
			}
			c, err = Scale(x, 3) // captured by the region, used after it too
			return
		}
		region := func(tape *Tape, w, c *Value, rec *[]bool) CheckpointFunc {
			return func(ctx context.Context, in []*Value) ([]*Value, error) {
				*rec = append(*rec, tape.Recomputing())
				y, err := MatMul(in[0], w)
				if err != nil {
					return nil, err
				}
				z, err := Mul(y, c)
				if err != nil {
					return nil, err
				}
				g, err := GELU(z)
				return []*Value{g, y}, err
			}
		}
		loss := func(x, c *Value, outs []*Value) (*Value, error) {
			a, err := Add(outs[0], outs[1])
			if err != nil {
				return nil, err
			}
			if a, err = Add(a, c); err != nil {
				return nil, err
			}
			if a, err = Mul(a, x); err != nil {
				return nil, err
			}
			return Sum(a)
		}
		var want [2][]float32
		for _, ckpt := range []bool{false, true} {
			tape := NewTape()
			x, w, c, err := build(tape)
			if err != nil {
				return err
			}
			var rec []bool
			var outs []*Value
			if ckpt {
				outs, err = Checkpoint(ctx, []*Value{x}, region(tape, w, c, &rec))
			} else {
				outs, err = region(tape, w, c, &rec)(ctx, []*Value{x})
			}
			if err != nil {
				return err
			}
			l, err := loss(x, c, outs)
			if err != nil {
				return err
			}
			if err := tape.Backward(ctx, l); err != nil {
				return err
			}
			gx, gw := x.Grad().LocalData().([]float32), w.Grad().LocalData().([]float32)
			if !ckpt {
				want = [2][]float32{slices.Clone(gx), slices.Clone(gw)}
				continue
			}
			if !slices.Equal(rec, []bool{false, true}) {
				t.Errorf("Recomputing in the region's two runs: %v, want [false true]", rec)
			}
			if !slices.Equal(gx, want[0]) || !slices.Equal(gw, want[1]) {
				t.Errorf("two outputs and a captured value: gradients %v %v, plain %v %v", gx, gw, want[0], want[1])
			}
		}

		// Under NoGrad the function just runs.
		tape := NewTape()
		x, w, c, err := build(tape)
		if err != nil {
			return err
		}
		var rec []bool
		if err := tape.NoGrad(func() error {
			outs, err := Checkpoint(ctx, []*Value{x}, region(tape, w, c, &rec))
			if err == nil && (outs[0].RequiresGrad() || tape.Len() != 1) {
				t.Errorf("Checkpoint under NoGrad recorded: %v, %d ops", outs[0].RequiresGrad(), tape.Len())
			}
			return err
		}); err != nil {
			return err
		}

		// A function that runs another op when recomputed.
		for _, keep := range []bool{false, true} {
			tape = NewTape()
			if x, w, c, err = build(tape); err != nil {
				return err
			}
			runs := 0
			var opts []CheckpointOption
			if keep {
				opts = append(opts, WithKeepOps("MatMul"))
			}
			outs, err := Checkpoint(ctx, []*Value{x}, func(ctx context.Context, in []*Value) ([]*Value, error) {
				runs++
				a := in[0]
				if runs == 2 {
					if a, err = Scale(a, 1); err != nil {
						return nil, err
					}
				}
				y, err := MatMul(a, w)
				return []*Value{y}, err
			}, opts...)
			if err != nil {
				return err
			}
			l, err := Sum(outs[0])
			if err != nil {
				return err
			}
			if err := tape.Backward(ctx, l); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "same ops") {
				t.Errorf("keep %v: a region that changes on recompute: Backward gave %v", keep, err)
			}
		}
		if _, err := Checkpoint(ctx, nil, region(tape, w, c, &rec)); !errors.Is(err, ErrInvalid) {
			t.Errorf("no inputs: %v", err)
		}
		if _, err := Checkpoint(ctx, []*Value{x}, nil); !errors.Is(err, ErrInvalid) {
			t.Errorf("nil function: %v", err)
		}
		return nil
	})
}
