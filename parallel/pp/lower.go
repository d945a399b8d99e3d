package pp

import (
	"fmt"

	"github.com/b7ea7098/loom"
)

// LowerOption sets an option of Lower.
type LowerOption func(*lowerConfig)

type lowerConfig struct {
	fsdp, reduce bool
}

// WithFSDP makes Lower add an Unshard of each stage before its first
// compute action and a Reshard after its last (parameters stay gathered
// through the step: reshard-after-forward is off under PP, as torchtitan
// does).
func WithFSDP() LowerOption { return func(c *lowerConfig) { c.fsdp = true } }

// WithReduceGrad makes Lower add one ReduceGrad of each stage after the
// stage's last backward (B or W) of the step.
func WithReduceGrad() LowerOption { return func(c *lowerConfig) { c.reduce = true } }

// Lower returns s with the communication inserted: after each F whose
// next stage is on another rank a SendF, before each F whose previous
// stage is on another rank a RecvF, and likewise SendB after B or I and
// RecvB before them for gradients; stages on the same rank pass by memory,
// without a send. Options add FSDP's Unshard and Reshard and the
// gradient reduction. s must be compute-only; the result is validated.
func Lower(s *Schedule, opts ...LowerOption) (*Schedule, error) {
	return nil, fmt.Errorf("%w: lower: not built yet", loom.ErrUnsupported)
}
