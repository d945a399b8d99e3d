package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"strings"
	"sync"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/models/gpt"
	"github.com/b7ea7098/loom/optim"
	"github.com/b7ea7098/loom/parallel/pp"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/reference/tinygpt"
	"github.com/b7ea7098/loom/train"
)

// pipeOptions are the pipeline-parallel flags.
type pipeOptions struct {
	pp            int
	schedule      string // a builder's name or a CSV file
	microBatches  int
	stagesPerRank int
	print         bool
}

// register adds the pipeline flags to fs.
func (p *pipeOptions) register(fs *flag.FlagSet) {
	fs.IntVar(&p.pp, "pp", 1, "pipeline-parallel ranks (the model's blocks are split into stages over them)")
	fs.StringVar(&p.schedule, "schedule", "1f1b", "with -pp: the pipeline schedule: gpipe, 1f1b, interleaved, zb1, zbv, or a CSV file of actions ([stage][F|I|W|B][micro-batch] per rank)")
	fs.IntVar(&p.microBatches, "microbatches", 0, "with -pp: micro-batches per step (0: 2·pp)")
	fs.IntVar(&p.stagesPerRank, "stages-per-rank", 0, "with -pp -schedule interleaved: stages per rank V (0: 2)")
	fs.BoolVar(&p.print, "schedule-print", false, "print the lowered schedule's action table, its theoretical bubble and peak activations, and exit without training")
}

// on reports whether the run is pipelined (or only prints a schedule).
func (p pipeOptions) on() bool { return p.pp > 1 || p.print }

// pipeline fixes o's layout for a pipelined run: pp ranks with one data-
// and tensor-parallel rank each (composition with -dp, -fsdp and -tp is
// the runtime's, not yet this example's: set with -pp they are refused).
func (o *options) pipeline(fs *flag.FlagSet) error {
	if !o.pipe.on() {
		var err error
		fs.Visit(func(f *flag.Flag) {
			if f.Name == "schedule" || f.Name == "microbatches" || f.Name == "stages-per-rank" {
				err = errNoPipeline
			}
		})
		return err
	}
	if o.pipe.pp < 1 {
		return fmt.Errorf("-pp %d; want at least 1", o.pipe.pp)
	}
	var bad []string
	fs.Visit(func(f *flag.Flag) {
		switch f.Name {
		case "dp", "tp", "fsdp", "sp", "compare", "ac":
			if f.Value.String() != "1" && f.Value.String() != "false" && f.Value.String() != "none" {
				bad = append(bad, "-"+f.Name)
			}
		}
	})
	if len(bad) > 0 {
		return fmt.Errorf("-pp trains pipeline stages alone in this example; %s cannot be combined with it yet", strings.Join(bad, ", "))
	}
	o.dp, o.tp, o.fsdp, o.sp = 1, 1, 1, false
	if o.pipe.microBatches == 0 {
		o.pipe.microBatches = 2 * o.pipe.pp
	}
	o.loop.Ranks, o.loop.Shape = o.pipe.pp, []int{o.pipe.pp, 1}
	return nil
}

// build returns the schedule the flags ask for, lowered and validated.
func (p pipeOptions) build() (*pp.Schedule, error) {
	var s *pp.Schedule
	var err error
	switch p.schedule {
	case "gpipe", "1f1b", "interleaved", "zb1", "zbv":
		s, err = pp.Build(p.schedule, p.pp, p.microBatches, p.stagesPerRank)
	default:
		f, ferr := os.Open(p.schedule)
		if ferr != nil {
			return nil, fmt.Errorf("-schedule %q: not a schedule's name, nor a file: %w", p.schedule, ferr)
		}
		defer f.Close()
		s, err = pp.ReadCSV(f, "custom")
	}
	if err != nil {
		return nil, fmt.Errorf("-schedule %s: %w", p.schedule, err)
	}
	if s.Ranks != p.pp {
		return nil, fmt.Errorf("-schedule %s has %d ranks; -pp is %d", p.schedule, s.Ranks, p.pp)
	}
	if !s.Lowered() {
		if s, err = pp.Lower(s); err != nil {
			return nil, fmt.Errorf("-schedule %s: %w", p.schedule, err)
		}
	}
	if err := s.Validate(); err != nil {
		return nil, fmt.Errorf("-schedule %s: %w", p.schedule, err)
	}
	return s, nil
}

// ppResult is what -json writes for a pipelined run: the run's result and
// the pipeline's.
type ppResult struct {
	result
	PP           int     `json:"pp"`
	Schedule     string  `json:"schedule"`
	Bubble       float64 `json:"bubble"`        // measured: idle fraction, mean over ranks and steps after the first
	BubbleTheory float64 `json:"bubble_theory"` // the schedule's with unit costs (F 1, B 2, I 1, W 1)
}

// runPipeline trains (or with -schedule-print only prints) o's pipelined
// run. params is the initial model, by name.
func runPipeline(ctx context.Context, out io.Writer, o options, fx *tinygpt.Fixture, params map[string][]float32) error {
	s, err := o.pipe.build()
	if err != nil {
		return err
	}
	theory, err := s.Bubble(pp.UnitCosts())
	if err != nil {
		return err
	}
	if o.pipe.print {
		peaks, err := s.PeakActivations()
		if err != nil {
			return err
		}
		fmt.Fprintf(out, "schedule %s: pp=%d, %d stages, %d micro-batches\n%s", s.Name, s.Ranks, s.Stages(), s.MicroBatches, s.Table())
		fmt.Fprintf(out, "bubble (unit costs): %.3f; peak micro-batches held per stage: %v\n", theory, peaks)
		return nil
	}
	if o.cfg.Layers < s.Stages() {
		return fmt.Errorf("-pp %d with %d stages needs at least %d blocks; the model has %d", o.pipe.pp, s.Stages(), s.Stages(), o.cfg.Layers)
	}
	if _, err := pp.MicroBatches(o.run.B, s.MicroBatches); err != nil {
		return fmt.Errorf("-microbatches %d with a batch of %d: %w", s.MicroBatches, o.run.B, err)
	}
	job, err := o.loop.Flags.Job(o.loop.Ranks)
	if err != nil {
		return fmt.Errorf("-pp %d: %w", o.pipe.pp, err)
	}
	if o.start, err = prepareResume(&o); err != nil {
		return err
	}
	if !job.Root() {
		out = io.Discard
	}
	fmt.Fprintf(out, "%s on pp=%d (schedule %s, %d micro-batches, %d stages), %s, %d steps\n", o.describe(), s.Ranks, s.Name, s.MicroBatches, s.Stages(), job, o.loop.Steps)
	resumeLine(out, o)
	var mu sync.Mutex
	var bubble float64
	setup := func(ctx context.Context, r train.Rank) (train.Stepper[float64], error) {
		st, err := newPipeRank(ctx, r, o, s, params, out)
		if err != nil {
			return nil, err
		}
		st.report = func(b float64) {
			mu.Lock()
			defer mu.Unlock()
			bubble = b
		}
		return st, nil
	}
	progress := func(step int, loss, tokensPerS float64) {
		step += o.start
		line := fmt.Sprintf("step %4d  loss %.6f", step, loss)
		if fx != nil {
			if want, ok := fx.LossAt(step); ok {
				line += fmt.Sprintf("  pytorch %.6f  Δ %+.4f", want, loss-want)
			}
		}
		fmt.Fprintf(out, "%s  %8.0f tokens/s\n", line, tokensPerS)
	}
	res, err := train.Run(ctx, out, job, o.loop, setup, progress)
	if err != nil {
		return err
	}
	fmt.Fprintf(out, "bubble: measured %.3f (idle fraction, mean over ranks and steps after the first), schedule's %.3f with unit costs\n", bubble, theory)
	if !job.Root() {
		return nil
	}
	r := &result{DP: 1, FSDP: 1, TP: 1, AC: o.ac, Backend: job.Backend, Device: o.loop.Flags.DeviceKind(), Processes: job.Processes, WorldSize: job.WorldSize,
		Steps: o.loop.Steps, Losses: res.Steps, TokensPerS: res.TokensPerS, Model: o.shape.Model, Params: o.cfg.NumParams()}
	r.FinalLoss = res.Steps[len(res.Steps)-1]
	return train.WriteJSON(o.loop.Flags.JSONPath, ppResult{result: *r, PP: s.Ranks, Schedule: s.Name, Bubble: bubble, BubbleTheory: theory})
}

// pipeRank is one rank's pipelined trainer: its stages, the runtime and
// AdamW over its stages' parameters.
type pipeRank struct {
	rt      *pp.Runtime
	c       comm.Communicator // the pp axis's
	params  []*autograd.Value
	opt     *optim.AdamW
	batches *gpt.BatchSource
	persist *pipePersist // -data and -checkpoint (pp_resume.go)
	cur     tinygpt.Batch
	steps   int
	bubble  float64 // sum over the steps after the first
	report  func(bubble float64)
}

func newPipeRank(ctx context.Context, r train.Rank, o options, s *pp.Schedule, init map[string][]float32, out io.Writer) (*pipeRank, error) {
	m, err := mesh.New(r.Comm, []int{s.Ranks, 1}, []string{"pp", "dp"})
	if err != nil {
		return nil, err
	}
	tr, err := pp.NewTransport(ctx, m, "pp")
	if err != nil {
		return nil, err
	}
	c, err := m.Comm(ctx, "pp")
	if err != nil {
		return nil, err
	}
	sm := tr.Mesh()
	tape := autograd.NewTape(r.Tape...)
	pr := &pipeRank{c: c}
	if pr.batches, pr.persist, err = pipeData(o, m, out); err != nil {
		return nil, err
	}
	rows, err := pp.MicroBatches(o.run.B, s.MicroBatches)
	if err != nil {
		return nil, err
	}
	funcs := map[int]pp.StageFunc{}
	var stages []*gpt.Stage
	S, L := s.Stages(), o.cfg.Layers
	for _, k := range s.StagesOf(tr.Rank()) {
		st, err := gpt.NewStage(tape, sm, o.cfg, k*L/S, (k+1)*L/S, init)
		if err != nil {
			return nil, err
		}
		stages = append(stages, st)
		pr.params = append(pr.params, st.Params()...)
		funcs[k] = func(ctx context.Context, mb int, h *autograd.Value) (*autograd.Value, error) {
			b, rg := pr.cur, rows[mb]
			shape := []int{rg.Hi - rg.Lo, b.T}
			rep := []placement.Placement{placement.Replicate()}
			x, err := autograd.IndicesFromFull(sm, shape, rep, b.X[rg.Lo*b.T:rg.Hi*b.T])
			if err != nil {
				return nil, err
			}
			y, err := autograd.IndicesFromFull(sm, shape, rep, b.Y[rg.Lo*b.T:rg.Hi*b.T])
			if err != nil {
				return nil, err
			}
			return st.Forward(ctx, h, x, y, rg.Weight)
		}
	}
	if pr.rt, err = pp.NewRuntime(s, tape, tr, funcs); err != nil {
		return nil, err
	}
	run := o.run
	if pr.opt, err = optim.NewAdamW(pr.params, optim.WithLR(run.LR), optim.WithWeightDecay(run.WD), optim.WithBetas(run.Beta1, run.Beta2), optim.WithEps(run.Eps)); err != nil {
		return nil, err
	}
	return pr, pr.persist.load(ctx, &o, stages, pr.opt, pr.batches)
}

// Step implements train.Stepper: one pipelined step, AdamW, and the
// step's loss (from the last stage's rank) on every rank.
func (pr *pipeRank) Step(ctx context.Context) (float64, error) {
	var err error
	if pr.cur, err = pr.batches.Next(); err != nil {
		return 0, err
	}
	st, err := pr.rt.Step(ctx)
	if err != nil {
		return 0, err
	}
	if err := pr.opt.Step(); err != nil {
		return 0, err
	}
	for _, p := range pr.params {
		p.ZeroGrad()
	}
	if pr.steps++; pr.steps > 1 {
		pr.bubble += st.Bubble
	}
	// The loss lives on the last stage's rank and the bubble on every
	// rank: one all-reduce gives both to all.
	v := []float64{0, pr.bubble}
	if !math.IsNaN(st.Loss) {
		v[0] = st.Loss
	}
	if err := comm.AllReduce(ctx, pr.c, comm.Host(v), comm.Host(v), comm.Sum); err != nil {
		return 0, err
	}
	if pr.steps > 1 && pr.report != nil && pr.c.Rank() == 0 {
		pr.report(v[1] / float64(pr.c.Size()*(pr.steps-1)))
	}
	return v[0], pr.persist.ck.After(ctx, pr.batches.Steps())
}

// errNoPipeline says a flag needs -pp.
var errNoPipeline = errors.New("-schedule, -microbatches and -stages-per-rank need -pp > 1")
