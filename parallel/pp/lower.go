package pp

import "fmt"

// LowerOption sets an option of Lower.
type LowerOption func(*lowerConfig)

type lowerConfig struct {
	fsdp, reduce bool
}

// WithFSDP makes Lower add an Unshard of each stage one compute action
// before the stage's first (at the top of the list for the rank's first
// stage), so that a runtime which starts the all-gather there and waits
// for it at the stage's first action overlaps it with the action in
// between, and a Reshard just after the stage's last compute action: the
// parameters stay gathered through the step, since re-gathering them for
// every micro-batch's backward would multiply the all-gathers by M
// (reshard-after-forward is off under PP, as torchtitan does).
func WithFSDP() LowerOption { return func(c *lowerConfig) { c.fsdp = true } }

// WithReduceGrad makes Lower add one ReduceGrad of each stage just after
// the stage's last backward (B or W) of the step: gradients accumulate
// over the micro-batches and are reduced across data-parallel ranks once.
func WithReduceGrad() LowerOption { return func(c *lowerConfig) { c.reduce = true } }

// Lower returns a copy of s with the communication inserted in one pass
// over each rank's list: before a forward whose previous stage is on
// another rank, the RecvF of its activations; after a forward whose next
// stage is on another rank, the SendF; likewise before a backward (B or
// I) the RecvB of the gradient from the next stage and after it the
// SendB to the previous one. Stages on the same rank pass by memory,
// without a send. Each receive sits just before the action that needs
// it (a runtime may post it earlier and wait there), and sends are
// asynchronous, so the lowered lists deadlock exactly when the compute
// lists do. Options add FSDP's Unshard and Reshard and the gradient
// reduction. s must be compute-only and valid; the result is validated.
func Lower(s *Schedule, opts ...LowerOption) (*Schedule, error) {
	var cfg lowerConfig
	for _, o := range opts {
		o(&cfg)
	}
	if s == nil {
		return nil, fmt.Errorf("%w: lower: nil schedule", ErrInvalid)
	}
	if s.Lowered() {
		return nil, fmt.Errorf("%w: lower: schedule %q already holds communication or per-stage actions", ErrInvalid, s.Name)
	}
	if err := s.Validate(); err != nil {
		return nil, err
	}
	n := s.Stages()
	out := *s
	out.Actions = make([][]Action, s.Ranks)
	for r, acts := range s.Actions {
		// unshard[p] lists the stages whose Unshard goes before action p:
		// one action ahead of the stage's first.
		unshard := map[int][]int{}
		last, lastGrad := map[int]int{}, map[int]int{}
		for p, a := range acts {
			if _, ok := last[a.Stage]; !ok {
				at := max(p-1, 0)
				unshard[at] = append(unshard[at], a.Stage)
			}
			last[a.Stage] = p
			if a.Kind == B || a.Kind == W {
				lastGrad[a.Stage] = p
			}
		}
		cross := func(st int) bool { return st >= 0 && st < n && s.RankOf(st) != r }
		var l []Action
		for p, a := range acts {
			st, mb := a.Stage, a.MicroBatch
			for _, u := range unshard[p] {
				if cfg.fsdp {
					l = append(l, Action{Stage: u, Kind: Unshard, MicroBatch: NoMicroBatch})
				}
			}
			switch a.Kind {
			case F:
				if cross(st - 1) {
					l = append(l, Comm(st, RecvF, mb))
				}
				l = append(l, a)
				if cross(st + 1) {
					l = append(l, Comm(st, SendF, mb))
				}
			case B, I:
				if cross(st + 1) {
					l = append(l, Comm(st, RecvB, mb))
				}
				l = append(l, a)
				if cross(st - 1) {
					l = append(l, Comm(st, SendB, mb))
				}
			default:
				l = append(l, a)
			}
			if cfg.reduce && lastGrad[st] == p {
				l = append(l, Action{Stage: st, Kind: ReduceGrad, MicroBatch: NoMicroBatch})
			}
			if cfg.fsdp && last[st] == p {
				l = append(l, Action{Stage: st, Kind: Reshard, MicroBatch: NoMicroBatch})
			}
		}
		out.Actions[r] = l
	}
	if err := out.Validate(); err != nil {
		return nil, err
	}
	return &out, nil
}
