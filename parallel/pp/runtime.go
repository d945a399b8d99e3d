package pp

import (
	"context"
	"fmt"
	"maps"
	"math"
	"slices"
	"strconv"
	"time"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/trace"
)

// StageFunc records one stage's forward for micro-batch mb on the
// runtime's tape (inside the micro-batch's own autograd.Graph) and returns
// its output. x is the stage's input, a leaf holding the activation the
// previous stage sent (nil on the first stage, which reads its
// micro-batch's data itself). The last stage returns the micro-batch's
// loss, a scalar already weighted so that the micro-batches' losses sum
// to the whole batch's loss (MicroBatches gives the weights); other stages
// return the activation to send on.
type StageFunc func(ctx context.Context, mb int, x *autograd.Value) (*autograd.Value, error)

// Option configures a Runtime.
type Option func(*runtimeConfig)

type runtimeConfig struct {
	tl       *trace.Timeline
	traceRk  int
	reduce   func(ctx context.Context, stage int) error
	unshard  func(ctx context.Context, stage int) (func(context.Context) error, error)
	reshard  func(ctx context.Context, stage int) error
	lowerOpt []LowerOption
}

// WithTimeline records every action as a span of tl on rank traceRank's
// row: compute actions (named like "F s1 mb3") on the compute lane, the
// waits for received tensors on the wait lane.
func WithTimeline(tl *trace.Timeline, traceRank int) Option {
	return func(c *runtimeConfig) { c.tl, c.traceRk = tl, traceRank }
}

// WithGradReduction has the runtime call fn at each ReduceGrad action of a
// stage (once per step, after the stage's last backward): where data
// parallelism reduces the stage's gradients. A schedule given to NewRuntime
// unlowered is then lowered with the ReduceGrad actions.
func WithGradReduction(fn func(ctx context.Context, stage int) error) Option {
	return func(c *runtimeConfig) {
		c.reduce = fn
		if fn != nil {
			c.lowerOpt = append(c.lowerOpt, WithReduceGrad())
		}
	}
}

// WithSharding has the runtime run the Unshard and Reshard actions of
// each stage (FSDP inside the stage): at Unshard it calls unshard, which
// starts the all-gather of the stage's parameters and returns the
// function that waits for it (nil: nothing to wait for); the runtime
// calls that just before the stage's next compute action, so the
// all-gather overlaps the action in between. At Reshard it calls reshard,
// which frees them. With fsdp.FSDP f of the stage: unshard is
// f.UnshardAsync and its Unsharding's Wait, reshard f.Reshard. Both are
// timed on the timeline's comm lane ("UNSHARD s1", "UNSHARD s1 wait",
// "RESHARD s1"). A schedule given to NewRuntime unlowered is then lowered
// with WithFSDP. NewRuntime fails with ErrInvalid when only one of the
// functions is nil.
func WithSharding(unshard func(ctx context.Context, stage int) (wait func(context.Context) error, err error), reshard func(ctx context.Context, stage int) error) Option {
	return func(c *runtimeConfig) {
		c.unshard, c.reshard = unshard, reshard
		if unshard != nil && reshard != nil {
			c.lowerOpt = append(c.lowerOpt, WithFSDP())
		}
	}
}

// Runtime runs a validated, lowered schedule on one rank of the pipeline
// axis, action by action: forwards (each micro-batch in its own
// autograd.Graph on the rank's tape, so several are in flight), full and
// split backwards (autograd's BackwardFrom, BackwardInput and
// BackwardWeight), the sends and receives of activations and gradients
// (Transport: asynchronous sends, receives posted one compute action
// ahead), the per-stage ReduceGrad, and FSDP's Unshard and Reshard.
// Gradients accumulate over the step's micro-batches into the stages'
// parameter leaves; the caller steps the optimizer and zeroes them
// between steps.
type Runtime struct {
	s      *Schedule
	rank   int
	tape   *autograd.Tape
	tr     *Transport
	stages map[int]StageFunc
	cfg    runtimeConfig
	graphs map[int][]*autograd.Graph           // per stage, one per micro-batch, reused across steps
	waits  map[int]func(context.Context) error // per stage, the pending wait of its Unshard
}

// NewRuntime returns the runtime of the rank tr.Rank() of the pp axis for
// schedule s (lowered here if it holds compute actions only; validated
// either way), with stages holding a StageFunc for each stage that rank
// holds (s.StagesOf) and nothing else. Every parameter lives on tape.
// Errors wrap ErrInvalid, naming the stage at fault.
func NewRuntime(s *Schedule, tape *autograd.Tape, tr *Transport, stages map[int]StageFunc, opts ...Option) (*Runtime, error) {
	if s == nil || tape == nil || tr == nil {
		return nil, fmt.Errorf("%w: NewRuntime: nil schedule, tape or transport", ErrInvalid)
	}
	var cfg runtimeConfig
	for _, o := range opts {
		o(&cfg)
	}
	if (cfg.unshard == nil) != (cfg.reshard == nil) {
		return nil, fmt.Errorf("%w: NewRuntime: WithSharding needs both functions, unshard and reshard (one is nil)", ErrInvalid)
	}
	if s.Ranks != tr.c.Size() {
		return nil, fmt.Errorf("%w: NewRuntime: the schedule has %d ranks; the pp axis %d", ErrInvalid, s.Ranks, tr.c.Size())
	}
	if !s.Lowered() {
		var err error
		if s, err = Lower(s, cfg.lowerOpt...); err != nil {
			return nil, err
		}
	}
	if err := s.Validate(); err != nil {
		return nil, err
	}
	rank := tr.Rank()
	mine := s.StagesOf(rank)
	for _, st := range mine {
		if stages[st] == nil {
			return nil, fmt.Errorf("%w: NewRuntime: rank %d holds stage %d but has no StageFunc for it", ErrInvalid, rank, st)
		}
	}
	if len(stages) != len(mine) {
		return nil, fmt.Errorf("%w: NewRuntime: rank %d holds stages %v; %d StageFuncs given", ErrInvalid, rank, mine, len(stages))
	}
	for _, a := range s.Actions[rank] {
		switch {
		case a.Kind == ReduceGrad && cfg.reduce == nil:
			return nil, fmt.Errorf("%w: NewRuntime: rank %d's list has %v but no WithGradReduction function", ErrInvalid, rank, a)
		case (a.Kind == Unshard || a.Kind == Reshard) && (cfg.unshard == nil || cfg.reshard == nil):
			return nil, fmt.Errorf("%w: NewRuntime: rank %d's list has %v but no WithSharding functions", ErrInvalid, rank, a)
		}
	}
	return &Runtime{s: s, rank: rank, tape: tape, tr: tr, stages: stages, cfg: cfg, graphs: map[int][]*autograd.Graph{}}, nil
}

// Schedule returns the lowered schedule the runtime runs.
func (r *Runtime) Schedule() *Schedule { return r.s }

// StepStats is what one Step measured on this rank.
type StepStats struct {
	// Loss is the sum of the last stage's micro-batch losses (their local
	// blocks) on the rank holding the last stage; NaN on other ranks.
	Loss float64
	// Wall is the step's duration; Busy the time in compute actions (F,
	// I, W, B).
	Wall, Busy time.Duration
	// Bubble is the idle fraction 1 − Busy/Wall.
	Bubble float64
	// PeakHeld maps each of the rank's stages to the largest number of
	// micro-batches whose activations it held at once (from F until B, or
	// until W when the backward is split): what Schedule.PeakActivations
	// predicts.
	PeakHeld map[int]int
	// PeakActivationBytes is the tape's peak of activation bytes during
	// the step (autograd.Tape.PeakActivationBytes), all stages of the rank
	// together.
	PeakActivationBytes int64
}

// mbState is one micro-batch on one stage during a step.
type mbState struct {
	graph    *autograd.Graph
	in       *autograd.Value // the input leaf (nil on the first stage)
	out      *autograd.Value
	act      *placement.DTensor // the activation received (RecvF)
	grad     *placement.DTensor // the output's gradient received (RecvB)
	wg       *autograd.WeightGrads
	recvF    *Pending
	recvB    *Pending
	inGradOK bool
}

// tag numbers the message of kind dir (0 activations, 1 gradients) that
// stage from sends for micro-batch mb.
func (r *Runtime) tag(dir, from, mb int) int {
	return (dir*r.s.Stages()+from)*r.s.MicroBatches + mb
}

// Step runs the rank's action list once: one training step's forwards and
// backwards over every micro-batch. Every rank of the pp axis calls it at
// the same time. An error names the rank, the position in its list and
// the action; the tape's scopes are cleared on error.
func (r *Runtime) Step(ctx context.Context) (*StepStats, error) {
	s, acts := r.s, r.s.Actions[r.rank]
	st := map[int][]*mbState{}
	for _, stage := range s.StagesOf(r.rank) {
		st[stage] = make([]*mbState, s.MicroBatches)
		for mb := range st[stage] {
			st[stage][mb] = &mbState{}
		}
		for len(r.graphs[stage]) < s.MicroBatches {
			g, err := r.tape.NewGraph()
			if err != nil {
				return nil, fmt.Errorf("pp: Step: %w", err)
			}
			r.graphs[stage] = append(r.graphs[stage], g)
		}
	}
	stats := &StepStats{Loss: math.NaN(), PeakHeld: map[int]int{}}
	held := map[int]int{}
	r.waits = map[int]func(context.Context) error{}
	r.tape.ResetPeak()
	start := time.Now()
	posted := 0 // actions [0, posted) have had their receives posted
	for i, a := range acts {
		if a.Kind.Compute() || i >= posted {
			// Post the receives up to the next compute action after
			// this one: lazily, one compute action ahead.
			j := max(posted, i)
			for ; j < len(acts); j++ {
				if err := r.post(ctx, acts[j], st); err != nil {
					return nil, r.fail(i, a, err)
				}
				if j > i && acts[j].Kind.Compute() {
					j++
					break
				}
			}
			posted = j
		}
		name := a.Kind.String() + " s" + strconv.Itoa(a.Stage)
		if !a.Kind.PerStage() {
			name += " mb" + strconv.Itoa(a.MicroBatch)
		}
		if a.Kind.Compute() || a.Kind == Reshard {
			// The stage's all-gather, started at its Unshard, must be
			// complete before the stage computes or frees it.
			if err := r.waitUnshard(ctx, a.Stage); err != nil {
				return nil, r.fail(i, a, err)
			}
		}
		t0 := time.Now()
		err := r.run(ctx, a, st, stats, held)
		t1 := time.Now()
		if err != nil {
			return nil, r.fail(i, a, err)
		}
		switch {
		case a.Kind.Compute():
			stats.Busy += t1.Sub(t0)
			r.record(trace.LaneCompute, name, t0, t1)
		case a.Kind == RecvF || a.Kind == RecvB:
			r.record(trace.LaneWait, name, t0, t1)
		default:
			r.record(trace.LaneComm, name, t0, t1)
		}
	}
	if err := r.tr.Flush(ctx); err != nil {
		return nil, fmt.Errorf("pp: Step: rank %d: %w", r.rank, err)
	}
	for _, stage := range slices.Sorted(maps.Keys(r.waits)) { // an Unshard no compute action followed
		if err := r.waitUnshard(ctx, stage); err != nil {
			return nil, fmt.Errorf("pp: Step: rank %d: %w", r.rank, err)
		}
	}
	stats.Wall = time.Since(start)
	if stats.Wall > 0 {
		stats.Bubble = 1 - float64(stats.Busy)/float64(stats.Wall)
	}
	stats.PeakActivationBytes = r.tape.PeakActivationBytes()
	return stats, nil
}

// waitUnshard waits for the all-gather the stage's Unshard started, if
// one is pending, timing it on the comm lane.
func (r *Runtime) waitUnshard(ctx context.Context, stage int) error {
	w := r.waits[stage]
	if w == nil {
		return nil
	}
	delete(r.waits, stage)
	t0 := time.Now()
	err := w(ctx)
	r.record(trace.LaneComm, "UNSHARD s"+strconv.Itoa(stage)+" wait", t0, time.Now())
	if err != nil {
		return fmt.Errorf("stage %d's all-gather: %w", stage, err)
	}
	return nil
}

// record adds a span to the timeline, if any.
func (r *Runtime) record(lane trace.Lane, name string, t0, t1 time.Time) {
	if r.cfg.tl != nil {
		_ = r.cfg.tl.Record(r.cfg.traceRk, lane, name, t0, t1) // a full timeline drops spans, which it counts
	}
}

// fail wraps err with the action at fault and clears what the step left
// recorded.
func (r *Runtime) fail(i int, a Action, err error) error {
	for _, gs := range r.graphs {
		for _, g := range gs {
			_ = g.Do(func() error { r.tape.Reset(); return nil })
		}
	}
	return fmt.Errorf("pp: Step: rank %d, action %d (%v): %w", r.rank, i, a, err)
}

// post posts a's receive if a is one and not yet posted.
func (r *Runtime) post(ctx context.Context, a Action, st map[int][]*mbState) error {
	var err error
	switch a.Kind {
	case RecvF:
		m := st[a.Stage][a.MicroBatch]
		if m.recvF == nil {
			m.recvF, err = r.tr.Post(ctx, r.s.RankOf(a.Peer), r.tag(0, a.Peer, a.MicroBatch))
		}
	case RecvB:
		m := st[a.Stage][a.MicroBatch]
		if m.recvB == nil {
			m.recvB, err = r.tr.Post(ctx, r.s.RankOf(a.Peer), r.tag(1, a.Peer, a.MicroBatch))
		}
	}
	return err
}

// run performs one action.
func (r *Runtime) run(ctx context.Context, a Action, st map[int][]*mbState, stats *StepStats, held map[int]int) error {
	switch a.Kind {
	case ReduceGrad:
		return r.cfg.reduce(ctx, a.Stage)
	case Unshard:
		w, err := r.cfg.unshard(ctx, a.Stage)
		r.waits[a.Stage] = w
		return err
	case Reshard:
		return r.cfg.reshard(ctx, a.Stage)
	}
	m := st[a.Stage][a.MicroBatch]
	last := a.Stage == r.s.Stages()-1
	switch a.Kind {
	case F:
		if a.Stage > 0 && m.act == nil && r.s.RankOf(a.Stage-1) == r.rank {
			// The previous stage is this rank's too: no send, no
			// receive, its output is the input.
			if prev := st[a.Stage-1][a.MicroBatch]; prev.out != nil {
				m.act = prev.out.Data()
			}
		}
		return r.forward(ctx, a, m, last, stats, held)
	case B, I:
		if m.out == nil {
			return fmt.Errorf("%w: backward before the forward", ErrInvalid)
		}
		var grads []*placement.DTensor
		if !last {
			if next := st[a.Stage+1]; m.grad == nil && r.s.RankOf(a.Stage+1) == r.rank && next[a.MicroBatch].inGradOK {
				m.grad = next[a.MicroBatch].in.Grad()
			}
			if m.grad == nil {
				return fmt.Errorf("%w: backward before the output's gradient arrived", ErrInvalid)
			}
			grads = []*placement.DTensor{m.grad}
		}
		outs := []*autograd.Value{m.out}
		err := m.graph.Do(func() error {
			if a.Kind == B {
				return r.tape.BackwardFrom(ctx, outs, grads)
			}
			var ins []*autograd.Value
			if m.in != nil {
				ins = []*autograd.Value{m.in}
			}
			var err error
			m.wg, err = r.tape.BackwardInput(ctx, outs, grads, ins)
			return err
		})
		if err != nil {
			return err
		}
		m.grad, m.inGradOK = nil, true
		if a.Kind == B {
			held[a.Stage]--
		}
		return nil
	case W:
		if m.wg == nil {
			return fmt.Errorf("%w: W before I", ErrInvalid)
		}
		if err := r.tape.BackwardWeight(ctx, m.wg); err != nil {
			return err
		}
		m.wg = nil
		held[a.Stage]--
		return nil
	case SendF:
		if m.out == nil {
			return fmt.Errorf("%w: send before the forward", ErrInvalid)
		}
		return r.tr.Send(ctx, m.out.Data(), r.s.RankOf(a.Peer), r.tag(0, a.Stage, a.MicroBatch))
	case SendB:
		if !m.inGradOK || m.in == nil || m.in.Grad() == nil {
			return fmt.Errorf("%w: send of the input's gradient before the backward made it", ErrInvalid)
		}
		return r.tr.Send(ctx, m.in.Grad(), r.s.RankOf(a.Peer), r.tag(1, a.Stage, a.MicroBatch))
	case RecvF:
		dt, err := r.onDevice(m.recvF.Wait(ctx))
		if err != nil {
			return err
		}
		m.act, m.recvF = dt, nil
		return nil
	case RecvB:
		dt, err := r.onDevice(m.recvB.Wait(ctx))
		if err != nil {
			return err
		}
		m.grad, m.recvB = dt, nil
		return nil
	}
	return fmt.Errorf("%w: action kind %v", ErrInvalid, a.Kind)
}

// forward runs F: the stage's function in the micro-batch's graph, from
// the received activation as a leaf.
func (r *Runtime) forward(ctx context.Context, a Action, m *mbState, last bool, stats *StepStats, held map[int]int) error {
	m.graph = r.graphs[a.Stage][a.MicroBatch]
	if a.Stage > 0 {
		if m.act == nil {
			return fmt.Errorf("%w: forward before the input arrived", ErrInvalid)
		}
		in, err := r.tape.Param("pp.stage"+strconv.Itoa(a.Stage)+".input", m.act)
		if err != nil {
			return err
		}
		m.in, m.act = in, nil
	}
	err := m.graph.Do(func() error {
		out, err := r.stages[a.Stage](ctx, a.MicroBatch, m.in)
		m.out = out
		return err
	})
	if err != nil {
		return err
	}
	if m.out == nil {
		return fmt.Errorf("%w: stage %d returned no output", ErrMismatch, a.Stage)
	}
	if last {
		v, err := scalar(m.out)
		if err != nil {
			return fmt.Errorf("%w: the last stage's output: %w", ErrMismatch, err)
		}
		if math.IsNaN(stats.Loss) {
			stats.Loss = 0
		}
		stats.Loss += v
	}
	held[a.Stage]++
	stats.PeakHeld[a.Stage] = max(stats.PeakHeld[a.Stage], held[a.Stage])
	return nil
}

// onDevice moves a received tensor to the tape's device.
func (r *Runtime) onDevice(dt *placement.DTensor, err error) (*placement.DTensor, error) {
	if err != nil || r.tape.Device().Kind() == device.KindHost {
		return dt, err
	}
	return dt.To(r.tape.Device())
}

// scalar returns a one-value local block (copied to the host from a
// device).
func scalar(v *autograd.Value) (float64, error) {
	dt := v.Data()
	if dt.Device().Kind() != device.KindHost {
		var err error
		if dt, err = dt.To(device.Host()); err != nil {
			return 0, err
		}
	}
	switch d := dt.LocalData().(type) {
	case []float32:
		if len(d) == 1 {
			return float64(d[0]), nil
		}
	case []float64:
		if len(d) == 1 {
			return d[0], nil
		}
	}
	return 0, fmt.Errorf("%v is not a scalar loss", v.Spec())
}

// Range is one micro-batch's rows [Lo, Hi) of a batch and its Weight
// (Hi−Lo)/rows: the factor its mean loss is scaled by so that the
// micro-batches' losses sum to the whole batch's mean.
type Range struct {
	Lo, Hi int
	Weight float64
}

// MicroBatches splits rows into m micro-batches as evenly as possible (the
// first rows%m get one row more) and gives each its weight. Weighting by
// size keeps uneven micro-batches exact: the step's loss and gradients
// are the whole batch's mean, not a mean of means. Errors wrap ErrInvalid
// when m < 1 or m > rows.
func MicroBatches(rows, m int) ([]Range, error) {
	if m < 1 || rows < m {
		return nil, fmt.Errorf("%w: MicroBatches: %d rows into %d micro-batches; want 1 ≤ m ≤ rows", ErrInvalid, rows, m)
	}
	out := make([]Range, m)
	lo := 0
	for i := range out {
		n := rows / m
		if i < rows%m {
			n++
		}
		out[i] = Range{Lo: lo, Hi: lo + n, Weight: float64(n) / float64(rows)}
		lo += n
	}
	return out, nil
}
