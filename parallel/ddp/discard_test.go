package ddp

import (
	"context"
	"fmt"
	"testing"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// After a Backward that fails midway (some buckets launched), Discard
// completes the step's collectives without installing anything, and the
// retried step gives the serial gradients.
func TestDiscardAfterFailedBackward(t *testing.T) {
	placementtest.Run(t, []int{2}, []string{"dp"}, func(ctx context.Context, m *mesh.Mesh) error {
		n, err := newMLP(m, false)
		if err != nil {
			return err
		}
		d, err := New(ctx, n.params, WithFirstBucket(8), WithBucketCap(8))
		if err != nil {
			return err
		}
		// A pass whose backward fails between the two layers, after the
		// second layer's hooks have fired and launched buckets.
		xd, y, err := data(m, 0, 12)
		if err != nil {
			return err
		}
		x, _ := n.tape.Constant(xd)
		h, err := autograd.Linear(x, n.params[0], n.params[1])
		if err != nil {
			return err
		}
		fail := autograd.LocalFunc[float64]{
			Name: "fails", In: [][]placement.Placement{h.Spec().Placements()}, GradIn: [][]placement.Placement{h.Spec().Placements()},
			Out: h.Spec().Placements(), GradOut: h.Spec().Placements(),
			Forward: func(in []autograd.Block[float64]) (autograd.Block[float64], error) {
				return autograd.Block[float64]{Shape: in[0].Shape, Data: append([]float64(nil), in[0].Data...)}, nil
			},
			Backward: func(g autograd.Block[float64], in []autograd.Block[float64], out autograd.Block[float64]) ([]autograd.Block[float64], error) {
				return nil, fmt.Errorf("injected backward failure")
			},
		}
		if h, err = fail.Apply(h); err != nil {
			return err
		}
		logits, err := autograd.Linear(h, n.params[2], n.params[3])
		if err != nil {
			return err
		}
		loss, err := autograd.CrossEntropy(logits, y)
		if err != nil {
			return err
		}
		if err := n.tape.Backward(ctx, loss); err == nil {
			return fmt.Errorf("expected the injected failure")
		}
		// Documented recovery: Discard the step, ZeroGrad, retry.
		if err := d.Discard(ctx); err != nil {
			return err
		}
		for _, p := range n.params {
			p.ZeroGrad()
		}
		if err := n.step(ctx, m, 0, 12); err != nil {
			return err
		}
		if err := d.Finish(ctx); err != nil {
			return fmt.Errorf("retried step after a failed backward: %v", err)
		}
		want, err := serialMLPGrads(0, 12)
		if err != nil {
			return err
		}
		return checkReduced(n.params, want, 1e-12)
	})
}
