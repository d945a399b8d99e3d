package tp_test

import (
	"context"
	"fmt"
	"math"
	"testing"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/parallel/tp"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// seqCE records the loss of [B, T, V] logits laid out by places (targets
// [B, T] by tplaces; vocab: VocabParallelCrossEntropy on "tp", else
// autograd.CrossEntropy) and returns its global value and the logits'
// global gradient.
func seqCE(ctx context.Context, m *mesh.Mesh, shape []int, places, tplaces []placement.Placement, vocab bool) (float64, []float64, error) {
	s, err := placement.NewSpec(m, shape, comm.Float64, places)
	if err != nil {
		return 0, nil, err
	}
	x, err := placement.FromFull(s, placementtest.Random(shape, comm.Float64, 11))
	if err != nil {
		return 0, nil, err
	}
	ix, err := autograd.IndicesFromFull(m, shape[:2], tplaces, vceTargets(shape[0]*shape[1], shape[2]))
	if err != nil {
		return 0, nil, err
	}
	tape := autograd.NewTape()
	v, err := tape.Param("logits", x)
	if err != nil {
		return 0, nil, err
	}
	var loss *autograd.Value
	if vocab {
		loss, err = tp.VocabParallelCrossEntropy(ctx, v, ix, "tp")
	} else {
		loss, err = autograd.CrossEntropy(v, ix)
	}
	if err != nil {
		return 0, nil, err
	}
	l, err := vceFull(ctx, loss.Data())
	if err != nil {
		return 0, nil, err
	}
	if err := tape.Backward(ctx, loss); err != nil {
		return 0, nil, err
	}
	g, err := vceFull(ctx, v.Grad())
	return l[0], g, err
}

// [B, T, V] logits whose sequence dim is sharded over cp (load balanced,
// uneven: T = 7 over 2·2 chunks, or plain) and whose vocab is sharded over
// tp give, by VocabParallelCrossEntropy and by autograd.CrossEntropy (the
// vocab whole), the loss and gradient of one rank's CrossEntropy, the mean
// over all B·T positions, within 1e-12 in float64.
func TestCrossEntropySequenceSharded(t *testing.T) {
	R := placement.Replicate()
	type pl = []placement.Placement
	shape := []int{2, 7, 5}
	for _, seq := range []placement.Placement{placement.ShardBalanced(1), placement.Shard(1)} {
		t.Run(seq.String(), func(t *testing.T) {
			placementtest.Run(t, []int{2, 2}, []string{"cp", "tp"}, func(ctx context.Context, m *mesh.Mesh) error {
				wantL, wantG, err := seqCE(ctx, m, shape, pl{R, R}, pl{R, R}, false)
				if err != nil {
					return err
				}
				for _, c := range []struct {
					name   string
					places pl
					vocab  bool
				}{
					{"vocab parallel", pl{seq, placement.Shard(2)}, true},
					{"CrossEntropy", pl{seq, R}, false},
				} {
					gotL, gotG, err := seqCE(ctx, m, shape, c.places, pl{seq, R}, c.vocab)
					if err != nil {
						return fmt.Errorf("%s: %w", c.name, err)
					}
					if math.Abs(gotL-wantL) > 1e-12 {
						return fmt.Errorf("%s: loss %v, one rank's %v", c.name, gotL, wantL)
					}
					for i := range wantG {
						if math.Abs(gotG[i]-wantG[i]) > 1e-12 {
							return fmt.Errorf("%s: gradient element %d: %v, one rank's %v", c.name, i, gotG[i], wantG[i])
						}
					}
				}
				return nil
			})
		})
	}
}
