package pp

import (
	"fmt"

	"github.com/b7ea7098/loom"
)

// Interleaved1F1B returns Megatron's interleaved 1F1B schedule: each rank
// holds stagesPerRank stages placed in a loop (rank r holds r, r+Ranks,
// …), and runs forwards and backwards of groups of Ranks micro-batches
// chunk by chunk, which shrinks the bubble by the factor stagesPerRank.
// It needs microBatches a multiple of ranks (PyTorch's rule) and
// stagesPerRank ≥ 2 (with one stage per rank it is OneFOneB).
func Interleaved1F1B(ranks, microBatches, stagesPerRank int) (*Schedule, error) {
	return nil, fmt.Errorf("%w: interleaved: not built yet", loom.ErrUnsupported)
}

// ZBH1 returns the zero-bubble schedule ZB-H1 (Qi et al., "Zero Bubble
// Pipeline Parallelism"): 1F1B with each backward split into I (for the
// input, which the previous stage waits for) and W (for the weights),
// and the W delayed to fill the cool-down bubble, at 1F1B's peak
// activation memory. It needs microBatches ≥ ranks.
func ZBH1(ranks, microBatches int) (*Schedule, error) {
	return nil, fmt.Errorf("%w: zb1: not built yet", loom.ErrUnsupported)
}

// ZBV returns the V-shaped zero-bubble schedule (ZB-V): two stages per
// rank placed in a V (rank r holds r and 2·Ranks−1−r), backwards split
// into I and W. It needs microBatches ≥ 2·ranks... (the minimum is stated
// in the error).
func ZBV(ranks, microBatches int) (*Schedule, error) {
	return nil, fmt.Errorf("%w: zbv: not built yet", loom.ErrUnsupported)
}
