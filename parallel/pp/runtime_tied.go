package pp

import (
	"context"
	"fmt"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/placement"
)

// tiedTag is the tag SumTied's messages use: above every tag a Runtime's
// step uses (2·(2·stages·micro-batches) + 1).
const tiedTag = 1 << 28

// SumTied sums the gradient of a parameter that two stages hold each a
// copy of (a tied embedding and LM head, on the first and last stage) with
// its copy's on the rank at position peer of the pp axis, and sets the sum
// as p's gradient on both. The two ranks call it at the same point (after
// the step's backwards, before the optimizer), each with its own copy,
// laid out alike; both compute the same sum (the lower pp rank's
// gradient first), so the copies stay bit for bit equal under the same
// optimizer. Errors wrap ErrInvalid (no gradient, or peer is this
// rank) or ErrMismatch (the copies' gradients differ in spec).
func SumTied(ctx context.Context, tr *Transport, p *autograd.Value, peer int) error {
	if tr == nil || p == nil || p.Grad() == nil {
		return fmt.Errorf("%w: SumTied: nil transport, or a parameter without a gradient", ErrInvalid)
	}
	if peer == tr.Rank() || peer < 0 || peer >= tr.c.Size() {
		return fmt.Errorf("%w: SumTied: peer %d for pp rank %d of %d", ErrInvalid, peer, tr.Rank(), tr.c.Size())
	}
	g := p.Grad()
	if err := tr.Send(ctx, g, peer, tiedTag); err != nil {
		return fmt.Errorf("pp: SumTied %q: %w", p.Name(), err)
	}
	pend, err := tr.Post(ctx, peer, tiedTag)
	if err != nil {
		return fmt.Errorf("pp: SumTied %q: %w", p.Name(), err)
	}
	other, err := pend.Wait(ctx)
	if err != nil {
		return fmt.Errorf("pp: SumTied %q: %w", p.Name(), err)
	}
	if err := tr.Flush(ctx); err != nil {
		return fmt.Errorf("pp: SumTied %q: %w", p.Name(), err)
	}
	if !other.Spec().Equal(g.Spec()) {
		return fmt.Errorf("%w: SumTied %q: pp rank %d's gradient is %v, pp rank %d's %v", ErrMismatch, p.Name(), tr.Rank(), g.Spec(), peer, other.Spec())
	}
	first, second := g, other
	if peer < tr.Rank() {
		first, second = other, g
	}
	sum, err := add(first, second)
	if err != nil {
		return fmt.Errorf("pp: SumTied %q: %w", p.Name(), err)
	}
	return p.SetGrad(sum)
}

// add returns a + b for host blocks of one spec.
func add(a, b *placement.DTensor) (*placement.DTensor, error) {
	switch x := a.LocalData().(type) {
	case []float32:
		y := b.LocalData().([]float32)
		out := make([]float32, len(x))
		for i := range x {
			out[i] = x[i] + y[i]
		}
		return placement.NewLocal(a.Spec(), out)
	case []float64:
		y := b.LocalData().([]float64)
		out := make([]float64, len(x))
		for i := range x {
			out[i] = x[i] + y[i]
		}
		return placement.NewLocal(a.Spec(), out)
	}
	return nil, fmt.Errorf("%w: a gradient of type %T (host float32 or float64 only)", ErrInvalid, a.LocalData())
}
