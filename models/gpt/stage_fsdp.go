package gpt

import (
	"context"
	"fmt"

	"github.com/b7ea7098/loom/parallel/fsdp"
)

// FullyShard shards the stage over the mesh axis axis of its mesh (FSDP
// inside a pipeline stage): each block an FSDP unit, and the stage itself
// the root unit of the parameters no block holds (the embeddings, the
// final LayerNorm and lm_head), when it has any. Call it after
// tp.Parallelize, when the stage is also tensor parallel. The batch rows
// are to be sharded on axis too.
//
// It sets what pipelining needs, as torchtitan does for PyTorch's FSDP2:
// WithReshard(false) (reshard-after-forward off: one all-gather per unit
// and step, which opts may override), SetRequiresGradientSync(false) (the
// micro-batches' gradients add up unsharded) and
// SetReshardAfterBackward(false). A pipeline runtime then drives the
// returned FSDP f at the schedule's actions (pp.WithSharding and
// pp.WithGradReduction):
//
//	UNSHARD      h, err := f.UnshardAsync(ctx); wait: h.Wait
//	RESHARD      f.Reshard(ctx)
//	REDUCE_GRAD  f.Finish(ctx) (then tp.ReduceGrads on the stage's parameters)
//
// The stage's parameters, collected (Params) before or after, are the
// sharded leaves the optimizer steps. With WithReshard(true) in opts the
// blocks are gathered again for every micro-batch's forward and backward;
// a split backward (ZB-H1, ZB-V) then keeps each block gathered from its
// input half to its weight half, and fails with ErrInvalid where that
// holds more than two at once (the pooled buffers of resharded units).
// Errors are fsdp.FullyShard's.
func (s *Stage) FullyShard(ctx context.Context, axis string, opts ...fsdp.Option) (*fsdp.FSDP, error) {
	var units []string // one unit per block; a stage of no blocks has the root alone
	if len(s.Blocks) > 0 {
		units = []string{"h.*"}
	}
	all := append([]fsdp.Option{fsdp.WithShardAxis(axis), fsdp.WithReshard(false)}, opts...)
	f, err := fsdp.FullyShard(ctx, s, units, all...)
	if err != nil {
		return nil, fmt.Errorf("gpt: Stage.FullyShard: %w", err)
	}
	f.SetRequiresGradientSync(false)
	f.SetReshardAfterBackward(false)
	return f, nil
}
