package autograd

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// full returns dt's global values.
func full(ctx context.Context, dt *placement.DTensor) ([]float64, error) { return fullData(ctx, dt) }

// TestAccumulation: leaves keep gradients across Backward calls until
// ZeroGrad, and hooks fire once per pass.
func TestAccumulation(t *testing.T) {
	simulate(t, []int{2}, func(ctx context.Context, m *mesh.Mesh) error {
		tp := NewTape()
		wd, err := random(m, []int{3, 2}, pl{S0}, 1)
		if err != nil {
			return err
		}
		xd, err := random(m, []int{3, 2}, pl{S0}, 2)
		if err != nil {
			return err
		}
		w, err := tp.Param("w", wd)
		if err != nil {
			return err
		}
		x, err := tp.Constant(xd)
		if err != nil {
			return err
		}
		fired := 0
		if err := w.OnGradReady(func(_ context.Context, v *Value) error {
			fired++
			// Inside a hook: no recording, no nested Backward.
			if s, err := Sum(v); err != nil || s.RequiresGrad() {
				t.Errorf("op in a hook: %v, recorded: %v", err, s.RequiresGrad())
			}
			if err := tp.Backward(ctx, v); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "from a gradient hook") {
				t.Errorf("Backward in a hook: %v", err)
			}
			return nil
		}); err != nil {
			return err
		}
		step := func() error {
			p, err := Mul(w, x)
			if err != nil {
				return err
			}
			l, err := Sum(p) // P(sum): x is sharded
			if err != nil {
				return err
			}
			return tp.Backward(ctx, l)
		}
		want, err := full(ctx, xd)
		if err != nil {
			return err
		}
		for pass := 1; pass <= 2; pass++ {
			if err := step(); err != nil {
				return err
			}
			if tp.Len() != 0 {
				t.Errorf("tape holds %d ops after Backward", tp.Len())
			}
			got, err := full(ctx, w.Grad())
			if err != nil {
				return err
			}
			for i := range want {
				if d := got[i] - float64(pass)*want[i]; d > 1e-12 || d < -1e-12 {
					t.Errorf("pass %d: grad[%d] = %v, want %v", pass, i, got[i], float64(pass)*want[i])
				}
			}
			if fired != pass {
				t.Errorf("pass %d: hook fired %d times", pass, fired)
			}
		}
		if x.Grad() != nil {
			t.Errorf("a constant got a gradient")
		}
		w.ZeroGrad()
		if w.Grad() != nil {
			t.Errorf("ZeroGrad left a gradient")
		}
		if err := step(); err != nil {
			return err
		}
		got, err := full(ctx, w.Grad())
		if err != nil {
			return err
		}
		if !slices.Equal(got, want) {
			t.Errorf("after ZeroGrad: %v, want %v", got, want)
		}
		return nil
	})
}

// mixedLoss: x (replicated) is used by a MatMul with a column-sharded w,
// whose backward gives x a Partial(sum) gradient, and by a Mul, whose
// backward gives it a Replicate one.
func mixedLoss(ctx context.Context) LossFunc {
	return func(tp *Tape, ps []*Value) (*Value, error) {
		x, w, c := ps[0], ps[1], ps[2]
		y, err := MatMul(x, w)
		if err != nil {
			return nil, err
		}
		l1, err := probe(ctx, y)
		if err != nil {
			return nil, err
		}
		z, err := Mul(x, c)
		if err != nil {
			return nil, err
		}
		l2, err := Sum(z)
		if err != nil {
			return nil, err
		}
		return Add(l1, l2)
	}
}

// TestAccumulateMixedPlacements: gradients of one value in Replicate and
// Partial(sum) are combined locally (R -> P(sum) needs no communication).
func TestAccumulateMixedPlacements(t *testing.T) {
	simulate(t, []int{2}, func(ctx context.Context, m *mesh.Mesh) error {
		x, err := random(m, []int{2, 3}, pl{R}, 1)
		if err != nil {
			return err
		}
		w, err := random(m, []int{3, 4}, pl{S1}, 2)
		if err != nil {
			return err
		}
		c, err := random(m, []int{2, 3}, pl{R}, 3)
		if err != nil {
			return err
		}
		f := mixedLoss(ctx)
		if err := CheckGrad(ctx, f, x, w, c); err != nil {
			return err
		}
		tp := NewTape()
		ps, err := wrapParams(tp, []*placement.DTensor{x, w, c})
		if err != nil {
			return err
		}
		l, err := f(tp, ps)
		if err != nil {
			return err
		}
		if err := tp.Backward(ctx, l); err != nil {
			return err
		}
		if got := fmt.Sprint(ps[0].Grad().Spec().Placements()); got != "[P(sum)]" {
			t.Errorf("x's gradient is %s, want [P(sum)]", got)
		}
		return nil
	})
}

// TestNoHiddenCommunication: gradients that could only be combined by a
// collective are an error naming both placements.
func TestNoHiddenCommunication(t *testing.T) {
	simulate(t, []int{2, 2}, func(ctx context.Context, m *mesh.Mesh) error {
		tp := NewTape()
		xd, err := random(m, []int{2, 3}, pl{R, R}, 1)
		if err != nil {
			return err
		}
		w1d, err := random(m, []int{3, 4}, pl{S1, R}, 2)
		if err != nil {
			return err
		}
		w2d, err := random(m, []int{3, 4}, pl{R, S1}, 3)
		if err != nil {
			return err
		}
		x, _ := tp.Param("x", xd)
		w1, _ := tp.Constant(w1d)
		w2, _ := tp.Constant(w2d)
		y1, err := MatMul(x, w1) // dx: [P(sum) R]
		if err != nil {
			return err
		}
		y2, err := MatMul(x, w2) // dx: [R P(sum)]
		if err != nil {
			return err
		}
		l1, err := probe(ctx, y1)
		if err != nil {
			return err
		}
		l2, err := probe(ctx, y2)
		if err != nil {
			return err
		}
		l, err := Add(l1, l2)
		if err != nil {
			return err
		}
		err = tp.Backward(ctx, l)
		if !errors.Is(err, ErrGradPlacement) || !strings.Contains(err.Error(), `gradients of "x" arrive as [R P(sum)] and [P(sum) R]`) || !strings.Contains(err.Error(), "allreduce") {
			t.Errorf("rank %d: got %v, want ErrGradPlacement naming [R P(sum)] and [P(sum) R]", m.Rank(), err)
		}
		if tp.Len() != 0 {
			t.Errorf("the tape was not cleared after a failed Backward")
		}
		return nil
	})
}

// TestNoGrad: a no-grad scope records nothing and its results do not
// require grad; recording resumes after it.
func TestNoGrad(t *testing.T) {
	simulate(t, []int{2}, func(ctx context.Context, m *mesh.Mesh) error {
		tp := NewTape()
		wd, err := random(m, []int{4}, pl{S0}, 1)
		if err != nil {
			return err
		}
		w, _ := tp.Param("w", wd)
		var inside *Value
		err = tp.NoGrad(func() error {
			y, err := Mul(w, w)
			if err != nil {
				return err
			}
			rs, err := allR(y.Spec())
			if err != nil {
				return err
			}
			if y, err = Redistribute(ctx, y, rs); err != nil {
				return err
			}
			// Nested scopes and Partial(max) destinations are fine here.
			return tp.NoGrad(func() error {
				ms, err := y.Spec().With(pl{Pmax})
				if err != nil {
					return err
				}
				if _, err := Redistribute(ctx, y, ms); err != nil {
					return err
				}
				inside, err = Sum(y)
				return err
			})
		})
		if err != nil {
			return err
		}
		if tp.Len() != 0 || inside.RequiresGrad() {
			t.Errorf("NoGrad recorded %d ops; result requires grad: %v", tp.Len(), inside.RequiresGrad())
		}
		if err := tp.Backward(ctx, inside); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "does not require grad") {
			t.Errorf("Backward on a no-grad value: %v", err)
		}
		y, err := Sum(w)
		if err != nil {
			return err
		}
		if tp.Len() != 1 || !y.RequiresGrad() {
			t.Errorf("recording did not resume after NoGrad")
		}
		if err := tp.NoGrad(nil); !errors.Is(err, ErrInvalid) {
			t.Errorf("NoGrad(nil): %v", err)
		}
		return nil
	})
}

// TestHooks: each leaf's hook fires exactly once per Backward, right after
// the backward of the earliest op that uses it and before the backward of
// any op recorded before that one, in a fixed order.
func TestHooks(t *testing.T) {
	simulate(t, []int{2}, func(ctx context.Context, m *mesh.Mesh) error {
		var events []string
		tp := NewTape()
		tp.trace = func(e string) { events = append(events, e) }
		mk := func(name string, shape []int, p pl, seed uint64) (*Value, error) {
			d, err := random(m, shape, p, seed)
			if err != nil {
				return nil, err
			}
			return tp.Param(name, d)
		}
		x, err := mk("x", []int{4, 3}, pl{S0}, 1)
		if err != nil {
			return err
		}
		w1, _ := mk("w1", []int{3, 3}, pl{R}, 2)
		w2, _ := mk("w2", []int{3, 2}, pl{R}, 3)
		unused, _ := mk("unused", []int{2}, pl{R}, 4)
		for _, v := range []*Value{x, w1, w2, unused} {
			if err := v.OnGradReady(func(_ context.Context, v *Value) error { events = append(events, "hook "+v.Name()); return nil }); err != nil {
				return err
			}
		}
		// A second hook on w1 runs after the first.
		if err := w1.OnGradReady(func(_ context.Context, v *Value) error {
			if v.Grad() == nil {
				t.Errorf("hook saw no gradient")
			}
			events = append(events, "hook2 w1")
			return nil
		}); err != nil {
			return err
		}
		forward := func() (*Value, error) {
			h, err := MatMul(x, w1) // op 0: x and w1 (their earliest use)
			if err != nil {
				return nil, err
			}
			h2, err := Scale(h, 0.5) // op 1
			if err != nil {
				return nil, err
			}
			z, err := MatMul(x, w1) // op 2: x and w1 again
			if err != nil {
				return nil, err
			}
			zs, err := Sum(z) // op 3
			if err != nil {
				return nil, err
			}
			y, err := MatMul(h2, w2) // op 4: w2's only use
			if err != nil {
				return nil, err
			}
			ys, err := Sum(y) // op 5
			if err != nil {
				return nil, err
			}
			return Add(ys, zs) // op 6
		}
		// The reverse walk: ops 6, 5, 4 (w2 final: its hooks fire before
		// the backward of ops 3..0), 3, 2, 1, 0 (x and w1 final, in the
		// order they appear among op 0's inputs).
		want := []string{
			"backward Add", "backward Sum", "backward MatMul", "ready w2", "hook w2",
			"backward Sum", "backward MatMul", "backward Scale", "backward MatMul",
			"ready x", "hook x", "ready w1", "hook w1", "hook2 w1",
		}
		for pass := range 2 {
			events = nil
			l, err := forward()
			if err != nil {
				return err
			}
			if err := tp.Backward(ctx, l); err != nil {
				return err
			}
			if !slices.Equal(events, want) {
				t.Errorf("pass %d events:\n got %q\nwant %q", pass, events, want)
			}
		}
		if unused.Grad() != nil {
			t.Errorf("unused leaf got a gradient")
		}
		if err := unused.OnGradReady(nil); !errors.Is(err, ErrInvalid) {
			t.Errorf("nil hook: %v", err)
		}
		c, _ := tp.Constant(unused.Data())
		if err := c.OnGradReady(func(context.Context, *Value) error { return nil }); !errors.Is(err, ErrInvalid) {
			t.Errorf("hook on a constant: %v", err)
		}
		return nil
	})
}

// TestBackwardErrors: bad losses and stale or foreign values are errors,
// never panics.
func TestBackwardErrors(t *testing.T) {
	simulate(t, []int{2}, func(ctx context.Context, m *mesh.Mesh) error {
		tp := NewTape()
		wd, err := random(m, []int{4, 2}, pl{S0}, 1)
		if err != nil {
			return err
		}
		w, _ := tp.Param("w", wd)
		check := func(name string, err error, want error, text string) {
			if !errors.Is(err, want) || !strings.Contains(err.Error(), text) {
				t.Errorf("%s: got %v, want %v containing %q", name, err, want, text)
			}
		}
		check("nil loss", tp.Backward(ctx, nil), ErrInvalid, "nil loss")
		s, err := Sum(w, 1) // [4], S(0)
		if err != nil {
			return err
		}
		check("non-scalar", tp.Backward(ctx, s), ErrInvalid, "global shape [4]")
		// A [1] loss that is sharded.
		one, err := placement.NewSpec(m, []int{1}, comm.Float64, pl{S0})
		if err != nil {
			return err
		}
		od, err := placement.FromFull(one, placementtest.Random([]int{1}, comm.Float64, 1))
		if err != nil {
			return err
		}
		op, _ := tp.Param("one", od)
		check("sharded loss", tp.Backward(ctx, op), ErrInvalid, `is S(0) on mesh axis "x"`)
		avg, err := random(m, nil, pl{Pavg}, 3)
		if err != nil {
			return err
		}
		ap, _ := tp.Param("avg", avg)
		check("avg loss", tp.Backward(ctx, ap), ErrInvalid, "P(avg)")
		other := NewTape()
		ow, _ := other.Param("ow", wd)
		check("foreign loss", tp.Backward(ctx, ow), ErrInvalid, "another tape")
		_, err = Add(w, ow)
		check("mixed tapes", err, ErrInvalid, "different tapes")
		_, err = Mul(nil, w)
		check("nil input", err, ErrInvalid, "input 0 is nil")
		_, err = Redistribute(ctx, w, nil)
		check("nil spec", err, ErrInvalid, "nil spec")
		mx, err := w.Spec().With(pl{Pmax})
		if err != nil {
			return err
		}
		_, err = Redistribute(ctx, w, mx)
		check("to P(max)", err, ErrRule, "no gradient layout")
		_, err = MatMul(w, w)
		check("matmul rule", err, ErrInvalid, "inner dims")

		// A scalar leaf loss: its gradient is the seed.
		sc, err := random(m, nil, pl{Psum}, 4)
		if err != nil {
			return err
		}
		sp, _ := tp.Param("scalar", sc)
		fired := 0
		if err := sp.OnGradReady(func(context.Context, *Value) error { fired++; return nil }); err != nil {
			return err
		}
		if err := tp.Backward(ctx, sp); err != nil {
			return err
		}
		if g, err := full(ctx, sp.Grad()); err != nil || len(g) != 1 || g[0] != 1 || fired != 1 {
			t.Errorf("leaf loss: grad %v (%v), hook fired %d", g, err, fired)
		}

		// Backward clears the tape: the loss and intermediates are stale.
		if s, err = Sum(w, 1); err != nil {
			return err
		}
		l, err := Sum(s)
		if err != nil {
			return err
		}
		if err := tp.Backward(ctx, l); err != nil {
			return err
		}
		check("second backward", tp.Backward(ctx, l), ErrInvalid, "Backward has already run")
		_, err = Scale(s, 2)
		check("stale input", err, ErrInvalid, "recorded before the tape was last cleared")
		// Reset does the same.
		s2, err := Scale(w, 2)
		if err != nil {
			return err
		}
		tp.Reset()
		_, err = Sum(s2)
		check("after Reset", err, ErrInvalid, "recompute it")
		// Leaves stay usable.
		if _, err := Sum(w); err != nil {
			t.Errorf("leaf after Reset: %v", err)
		}
		return nil
	})
}

// TestNilSafety: the API returns errors or zero values for nil receivers
// and arguments instead of panicking.
func TestNilSafety(t *testing.T) {
	var tp *Tape
	var v *Value
	if _, err := tp.Param("p", nil); !errors.Is(err, ErrInvalid) {
		t.Errorf("nil tape Param: %v", err)
	}
	if _, err := tp.Constant(nil); !errors.Is(err, ErrInvalid) {
		t.Errorf("nil tape Constant: %v", err)
	}
	if err := tp.Backward(context.Background(), nil); !errors.Is(err, ErrInvalid) {
		t.Errorf("nil tape Backward: %v", err)
	}
	if err := tp.NoGrad(func() error { return nil }); !errors.Is(err, ErrInvalid) {
		t.Errorf("nil tape NoGrad: %v", err)
	}
	tp.Reset()
	if tp.Len() != 0 || tp.Planner() != nil {
		t.Errorf("nil tape Len/Planner")
	}
	if v.Data() != nil || v.Spec() != nil || v.Grad() != nil || v.Name() != "" || v.RequiresGrad() || v.IsLeaf() {
		t.Errorf("nil value accessors")
	}
	v.ZeroGrad()
	if err := v.OnGradReady(func(context.Context, *Value) error { return nil }); !errors.Is(err, ErrInvalid) {
		t.Errorf("nil value hook: %v", err)
	}
	if (&Value{}).Spec() != nil {
		t.Errorf("zero value Spec")
	}
	for name, f := range map[string]func() error{
		"Add":    func() error { _, err := Add(v, v); return err },
		"Mul":    func() error { _, err := Mul(v, &Value{}); return err },
		"Scale":  func() error { _, err := Scale(v, 1); return err },
		"Sum":    func() error { _, err := Sum(v); return err },
		"MatMul": func() error { _, err := MatMul(v, v); return err },
		"Redistribute": func() error {
			_, err := Redistribute(context.Background(), v, nil)
			return err
		},
		"CheckGrad": func() error { return CheckGrad(context.Background(), nil) },
	} {
		if err := f(); !errors.Is(err, ErrInvalid) {
			t.Errorf("%s with nil input: %v", name, err)
		}
	}
}

// TestHookContextAndError: a hook gets Backward's context, and its error
// stops Backward (the earlier op's leaf never fires) with the leaf named.
func TestHookContextAndError(t *testing.T) {
	type key struct{}
	simulate(t, []int{1}, func(ctx context.Context, m *mesh.Mesh) error {
		tp := NewTape()
		mk := func(name string, seed uint64) (*Value, error) {
			d, err := random(m, []int{2, 2}, pl{R}, seed)
			if err != nil {
				return nil, err
			}
			return tp.Param(name, d)
		}
		w1, err := mk("w1", 1)
		if err != nil {
			return err
		}
		w2, err := mk("w2", 2)
		if err != nil {
			return err
		}
		boom := errors.New("boom")
		var seen any
		if err := w2.OnGradReady(func(ctx context.Context, _ *Value) error {
			seen = ctx.Value(key{})
			return boom
		}); err != nil {
			return err
		}
		fired1 := false
		if err := w1.OnGradReady(func(context.Context, *Value) error { fired1 = true; return nil }); err != nil {
			return err
		}
		h, err := MatMul(w1, w1) // op 0: w1's earliest use
		if err != nil {
			return err
		}
		h, err = MatMul(h, w2) // op 1: w2 is final after it
		if err != nil {
			return err
		}
		l, err := Sum(h)
		if err != nil {
			return err
		}
		err = tp.Backward(context.WithValue(ctx, key{}, "caller"), l)
		if !errors.Is(err, boom) || !strings.Contains(err.Error(), `"w2"`) {
			t.Errorf("Backward with a failing hook: %v; want boom naming w2", err)
		}
		if seen != "caller" {
			t.Errorf("the hook saw context value %v, want the caller's", seen)
		}
		if fired1 {
			t.Error("w1's hook fired after w2's hook failed")
		}
		if tp.Len() != 0 {
			t.Errorf("the tape holds %d ops after a failed Backward", tp.Len())
		}
		return nil
	})
}

// TestGradBytes: a leaf holds its gradient's bytes; after ZeroGrad it
// holds none on a plain tape and keeps them, for the next gradient, on a
// recycling one.
func TestGradBytes(t *testing.T) {
	placementtest.Run(t, []int{1}, []string{"x"}, func(ctx context.Context, m *mesh.Mesh) error {
		for _, c := range []struct {
			name      string
			opts      []Option
			afterZero int64
		}{{"plain", nil, 0}, {"recycling", []Option{WithRecycling()}, 3 * 8}} {
			tape := NewTape(c.opts...)
			spec, err := placement.NewSpec(m, []int{3}, comm.Float64, []placement.Placement{placement.Replicate()})
			if err != nil {
				return err
			}
			dt, err := placement.FromFull(spec, []float64{1, 2, 3})
			if err != nil {
				return err
			}
			p, err := tape.Param("p", dt)
			if err != nil {
				return err
			}
			if p.GradBytes() != 0 {
				return fmt.Errorf("%s: %d bytes before backward", c.name, p.GradBytes())
			}
			loss, err := Sum(p)
			if err != nil {
				return err
			}
			if err := tape.Backward(ctx, loss); err != nil {
				return err
			}
			if got := p.GradBytes(); got != 24 {
				return fmt.Errorf("%s: %d bytes after backward, want 24", c.name, got)
			}
			p.ZeroGrad()
			if got := p.GradBytes(); got != c.afterZero {
				return fmt.Errorf("%s: %d bytes after ZeroGrad, want %d", c.name, got, c.afterZero)
			}
			p.ReleaseGrad()
			if got := p.GradBytes(); got != 0 || p.Grad() != nil {
				return fmt.Errorf("%s: %d bytes after ReleaseGrad, want 0", c.name, got)
			}
		}
		if (*Value)(nil).GradBytes() != 0 {
			return errors.New("nil value holds bytes")
		}
		return nil
	})
}

// TestReleaseGradHandsOnMemory: ReleaseGrad returns the block Backward
// allocated for a leaf, and another leaf given it with KeepGradBuffer
// writes its next gradient there (the right values, no allocation); a
// gradient given by SetGrad is not handed on, and a block of another
// length is not used.
func TestReleaseGradHandsOnMemory(t *testing.T) {
	placementtest.Run(t, []int{1}, []string{"x"}, func(ctx context.Context, m *mesh.Mesh) error {
		tape := NewTape()
		param := func(name string, vals ...float64) (*Value, error) {
			spec, err := placement.NewSpec(m, []int{len(vals)}, comm.Float64, []placement.Placement{placement.Replicate()})
			if err != nil {
				return nil, err
			}
			dt, err := placement.FromFull(spec, vals)
			if err != nil {
				return nil, err
			}
			return tape.Param(name, dt)
		}
		backward := func(v *Value, scale float64) error {
			y, err := Scale(v, scale)
			if err != nil {
				return err
			}
			l, err := Sum(y)
			if err != nil {
				return err
			}
			return tape.Backward(ctx, l)
		}
		a, err := param("a", 1, 2, 3)
		if err != nil {
			return err
		}
		b, err := param("b", 4, 5, 6)
		if err != nil {
			return err
		}
		short, err := param("short", 7, 8)
		if err != nil {
			return err
		}
		if err := backward(a, 2); err != nil {
			return err
		}
		block, ok := a.ReleaseGrad().([]float64)
		if !ok || len(block) != 3 || a.Grad() != nil || a.GradBytes() != 0 {
			return fmt.Errorf("ReleaseGrad returned %v; a holds %d bytes", block, a.GradBytes())
		}
		b.KeepGradBuffer(block)
		short.KeepGradBuffer(slices.Clone(block))
		if err := backward(b, 3); err != nil {
			return err
		}
		got := b.Grad().LocalData().([]float64)
		if &got[0] != &block[0] || !slices.Equal(got, []float64{3, 3, 3}) {
			return fmt.Errorf("b's gradient %v is not in the handed-on block", got)
		}
		if err := backward(short, 1); err != nil {
			return err
		}
		if g := short.Grad().LocalData().([]float64); !slices.Equal(g, []float64{1, 1}) {
			return fmt.Errorf("short's gradient %v, want [1 1]", g)
		}
		given, err := placement.FromFull(b.Grad().Spec(), []float64{9, 9, 9})
		if err != nil {
			return err
		}
		b.ZeroGrad()
		if err := b.SetGrad(given); err != nil {
			return err
		}
		if blk := b.ReleaseGrad(); blk != nil {
			return fmt.Errorf("ReleaseGrad handed on SetGrad's gradient %v", blk)
		}
		return nil
	})
}

// TestObserversCompose: every WithObserver given sees every span, in the
// order given; a nil one is ignored.
func TestObserversCompose(t *testing.T) {
	placementtest.Run(t, []int{1}, []string{"x"}, func(ctx context.Context, m *mesh.Mesh) error {
		var seen []string
		obs := func(name string) Observer {
			return func(op, phase string, _, _ time.Time) { seen = append(seen, name+":"+op+":"+phase) }
		}
		tape := NewTape(WithObserver(obs("a")), WithObserver(nil), WithObserver(obs("b")))
		spec, err := placement.NewSpec(m, []int{2}, comm.Float32, []placement.Placement{placement.Replicate()})
		if err != nil {
			return err
		}
		dt, err := placement.FromFull(spec, []float32{1, 2})
		if err != nil {
			return err
		}
		p, err := tape.Param("p", dt)
		if err != nil {
			return err
		}
		loss, err := Sum(p)
		if err != nil {
			return err
		}
		if err := tape.Backward(ctx, loss); err != nil {
			return err
		}
		want := []string{"a:Sum:forward", "b:Sum:forward", "a:Sum:backward", "b:Sum:backward"}
		if !slices.Equal(seen, want) {
			return fmt.Errorf("observers saw %q, want %q", seen, want)
		}
		return nil
	})
}
