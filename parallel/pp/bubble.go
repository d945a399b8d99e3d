package pp

import (
	"fmt"

	"github.com/b7ea7098/loom/internal/numcheck"
)

// Costs are the durations Simulate gives each kind of action, in any unit
// of time (compute of one micro-batch on one stage).
type Costs struct {
	// F, B, I and W are the forward, the full backward and its two parts.
	F, B, I, W float64
	// Comm is the time a send takes to reach its receiver (0: free).
	Comm float64
	// Unshard is the time of a stage's FSDP all-gather: it starts at the
	// stage's Unshard action, asynchronously, and the stage's compute
	// actions start no earlier than its end (0: free).
	Unshard float64
	// Stage, when not nil, holds one factor per stage that multiplies
	// the stage's F, B, I and W: unbalanced stages (an embedding on the
	// first, the head and loss on the last).
	Stage []float64
}

// UnitCosts returns F=1, B=2, I=1, W=1 and free communication: the
// balanced-stage costs the bubble formulas assume.
func UnitCosts() Costs { return Costs{F: 1, B: 2, I: 1, W: 1} }

// Simulation is the outcome of running a schedule's lists with Costs.
type Simulation struct {
	// Start[r][i] and End[r][i] are when rank r's i-th action starts and
	// ends.
	Start, End [][]float64
	// Makespan is when the last action ends.
	Makespan float64
	// Busy[r] is rank r's compute time.
	Busy []float64
	// Bubble is the idle fraction: 1 − ΣBusy / (Ranks · Makespan).
	Bubble float64
	// PeakActivations[s] is the largest number of micro-batches whose
	// activations stage s holds at once (from its F until its B, or
	// until its W when the backward is split).
	PeakActivations []int
	// RankPeakActivations[r] is the largest number of (stage,
	// micro-batch) activations rank r holds at once over all its stages:
	// what a rank's memory accounting sees, in units of one stage's
	// activations for one micro-batch.
	RankPeakActivations []int
}

// Simulate checks s as Validate does and runs its per-rank lists in
// order with costs c: an action starts when its rank is free and its
// inputs exist (a forward after the previous stage's forward of the
// micro-batch, a backward after the next stage's backward, in a lowered
// schedule a receive after its send and a stage's compute after its
// Unshard; c.Comm is added where the input crosses ranks, c.Unshard after
// an Unshard). Sends, Unshard, Reshard and ReduceGrad never block;
// communication takes no time of the rank. A negative or non-finite cost
// is ErrInvalid; lists that cannot go on are ErrDeadlock naming each
// stuck rank's action.
func Simulate(s *Schedule, c Costs) (*Simulation, error) {
	for _, v := range []struct {
		name string
		v    float64
	}{{"cost F", c.F}, {"cost B", c.B}, {"cost I", c.I}, {"cost W", c.W}, {"cost Comm", c.Comm}, {"cost Unshard", c.Unshard}} {
		if err := numcheck.NonNegative(ErrInvalid, v.name, v.v); err != nil {
			return nil, err
		}
	}
	g, err := s.check()
	if err != nil {
		return nil, err
	}
	if c.Stage != nil && len(c.Stage) != s.Stages() {
		return nil, fmt.Errorf("%w: costs: %d stage factors for %d stages", ErrInvalid, len(c.Stage), s.Stages())
	}
	for st, f := range c.Stage {
		if err := numcheck.NonNegative(ErrInvalid, fmt.Sprintf("cost factor of stage %d", st), f); err != nil {
			return nil, err
		}
	}
	return g.run(c)
}

// Bubble returns the theoretical bubble fraction of s with costs c (see
// Simulation.Bubble); errors as Simulate.
func (s *Schedule) Bubble(c Costs) (float64, error) {
	sim, err := Simulate(s, c)
	if err != nil {
		return 0, err
	}
	return sim.Bubble, nil
}

// PeakActivations returns, per stage, the largest number of micro-batches
// whose activations the stage holds at once (see
// Simulation.PeakActivations); errors as Validate's checks before its
// simulation.
func (s *Schedule) PeakActivations() ([]int, error) {
	if _, err := s.check(); err != nil {
		return nil, err
	}
	stage, _ := s.peakActivations()
	return stage, nil
}
