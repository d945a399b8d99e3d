package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"maps"
	"math"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/launch"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/models/gpt"
	"github.com/b7ea7098/loom/optim"
	"github.com/b7ea7098/loom/parallel"
	"github.com/b7ea7098/loom/parallel/cp"
	"github.com/b7ea7098/loom/parallel/fsdp"
	"github.com/b7ea7098/loom/parallel/pp"
	"github.com/b7ea7098/loom/parallel/tp"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/reference/tinygpt"
	"github.com/b7ea7098/loom/trace"
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

// pipeline fixes o's layout for a pipelined run: the mesh (pp, dp, fsdp,
// tp, cp), the pp axis outermost, each stage's blocks laid out over tp by
// gpt.Plan (with -sp, sequence parallel), its micro-batches' rows sharded
// over dp and, with -cp, their sequence over cp (the stages' attention
// by -cp-method); with -fsdp each stage's blocks are FSDP units over
// fsdp (gpt.Stage.FullyShard), the rows sharded over dp × fsdp. -dp and
// -tp default to 1 here (2 without -pp), and -reshard to false (one
// all-gather per unit and step, as torchtitan does under pipelining).
// What cannot join -pp yet (-cp-method hybrid) is refused, as is a
// micro-batch whose rows dp × fsdp does not divide, before any rank
// starts.
func (o *options) pipeline(fs *flag.FlagSet) error {
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	if !o.pipe.on() {
		if set["schedule"] || set["microbatches"] || set["stages-per-rank"] {
			return errNoPipeline
		}
		return nil
	}
	if o.pipe.pp < 1 {
		return fmt.Errorf("-pp %d; want at least 1", o.pipe.pp)
	}
	if !set["dp"] {
		o.dp = 1
	}
	if !set["tp"] {
		o.tp = 1
	}
	if o.fsdp > 1 && !set["reshard"] {
		o.reshard = "false"
	}
	if o.cpf.cp > 1 && o.cpf.hybrid() {
		return errors.New("-cp-method hybrid does not run inside pipeline stages yet; with -pp take auto, ring, allgather or ulysses")
	}
	if o.cpf.flat(o.fsdp) {
		// A stage's FSDP shards over fsdp (gpt.Stage.FullyShard); the
		// gradients are summed over cp at REDUCE_GRAD.
		if set["cp-flat-fsdp"] {
			return errors.New("-cp-flat-fsdp does not run inside pipeline stages yet; with -pp, -fsdp shards over fsdp alone and the gradients are summed over cp")
		}
		o.cpf.flatFSDP = false
	}
	if o.dp < 1 || o.tp < 1 || o.fsdp < 1 {
		return fmt.Errorf("-dp %d -fsdp %d -tp %d; want at least 1 each", o.dp, o.fsdp, o.tp)
	}
	if o.pipe.microBatches == 0 {
		o.pipe.microBatches = 2 * o.pipe.pp
	}
	if err := o.checkMicroBatches(); err != nil {
		return err
	}
	shape, _ := o.cpf.axes(o.dp, o.fsdp, o.tp)
	o.loop.Ranks, o.loop.Shape = o.pipe.pp*o.dp*o.fsdp*o.tp*max(o.cpf.cp, 1), append([]int{o.pipe.pp}, shape...)
	return nil
}

// build returns the schedule the flags ask for, lowered and validated; a
// schedule of compute actions is lowered with ReduceGrad actions when
// reduce is set (data, tensor or context parallelism inside the stages)
// and with Unshard and Reshard when sharded is (FSDP inside the stages).
func (p pipeOptions) build(reduce, sharded bool) (*pp.Schedule, error) {
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
		var opts []pp.LowerOption
		if reduce {
			opts = append(opts, pp.WithReduceGrad())
		}
		if sharded {
			opts = append(opts, pp.WithFSDP())
		}
		if s, err = pp.Lower(s, opts...); err != nil {
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

// pipeReport is what the ranks of a pipelined run report to runPipeline
// (world rank 0 writes it).
type pipeReport struct {
	mu        sync.Mutex
	bubble    float64 // measured, mean over ranks and steps after the first
	paramDiff float64 // -compare: the largest difference from the one-rank run's final parameters
}

// runPipeline trains (or with -schedule-print only prints) o's pipelined
// run. params is the initial model, by name.
func runPipeline(ctx context.Context, out io.Writer, o options, fx *tinygpt.Fixture, params map[string][]float32) error {
	s, err := o.pipe.build(o.dp*o.fsdp*o.tp*o.cpf.cp > 1, o.fsdp > 1)
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
	split := slices.ContainsFunc(slices.Concat(s.Actions...), func(a pp.Action) bool { return a.Kind == pp.I || a.Kind == pp.W })
	if o.ac != "none" && split {
		// autograd's split backward does not run a checkpointed region.
		return fmt.Errorf("-ac %s recomputes blocks in a full backward; -schedule %s splits the backward (I, W): take gpipe, 1f1b or interleaved with -ac", o.ac, o.pipe.schedule)
	}
	if o.fsdp > 1 && o.reshard != "false" && split {
		// The weight half's saved values live in the gathered buffers.
		return fmt.Errorf("-reshard %s frees each unit's gathered parameters after its forward; -schedule %s splits the backward (I, W), whose weight half needs them: take -reshard false (the default with -pp), or gpipe, 1f1b or interleaved", o.reshard, o.pipe.schedule)
	}
	if o.fsdp > 1 && !slices.ContainsFunc(slices.Concat(s.Actions...), func(a pp.Action) bool { return a.Kind == pp.Unshard }) {
		return fmt.Errorf("-schedule %s: with -fsdp a lowered schedule needs its UNSHARD and RESHARD actions (give it unlowered: compute actions only)", o.pipe.schedule)
	}
	if s.MicroBatches != o.pipe.microBatches {
		// A CSV schedule brings its own M; the dp check was for -microbatches.
		o.pipe.microBatches = s.MicroBatches
		if err := o.checkMicroBatches(); err != nil {
			return fmt.Errorf("-schedule %s: %w", o.pipe.schedule, err)
		}
	}
	job, err := o.loop.Flags.Job(o.loop.Ranks)
	if err != nil {
		return fmt.Errorf("-pp %d: %w", o.pipe.pp, err)
	}
	if o.start, err = prepareResume(&o); err != nil {
		return err
	}
	var ref *result
	var refParams map[string][]float32
	if o.compare {
		if job.Backend != launch.Local || o.persist.Data != "" || o.persist.Dir != "" {
			return fmt.Errorf("-compare trains on in-process ranks only, from the start, without -data or -checkpoint (this is a %s job)", job.Backend)
		}
		oneJob, err := launch.InProcess(1)
		if err != nil {
			return err
		}
		if ref, refParams, err = trainLayout(ctx, io.Discard, oneJob, gpt.WithParams(params), o.oneRank(), nil); err != nil {
			return fmt.Errorf("one-rank run: %w", err)
		}
	}
	if !job.Root() {
		out = io.Discard
	}
	fmt.Fprintf(out, "%s on pp=%d × %s (schedule %s, %d micro-batches, %d stages), %s, %d steps\n", o.describe(), s.Ranks, o.layout(), s.Name, s.MicroBatches, s.Stages(), job, o.loop.Steps)
	resumeLine(out, o)
	rep := &pipeReport{}
	setup := func(ctx context.Context, r train.Rank) (train.Stepper[float64], error) {
		st, err := newPipeRank(ctx, r, o, s, params, out)
		if err != nil {
			return nil, err
		}
		st.report, st.ref = rep, refParams
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
	fmt.Fprintf(out, "bubble: measured %.3f (idle fraction, mean over ranks and steps after the first), schedule's %.3f with unit costs\n", rep.bubble, theory)
	pipeIdle(out, res.Events, s)
	if ref != nil {
		var dl float64
		for i := range res.Steps {
			dl = max(dl, math.Abs(res.Steps[i]-ref.Losses[i]))
		}
		fmt.Fprintf(out, "\n-compare: the same %d steps on one rank\nlargest loss difference %.3g, largest parameter difference %.3g; one rank: %.0f tokens/s (this layout %.2f×)\n",
			o.loop.Steps, dl, rep.paramDiff, ref.TokensPerS, res.TokensPerS/ref.TokensPerS)
	}
	if !job.Root() {
		return nil
	}
	r := &result{DP: o.dp, FSDP: o.fsdp, TP: o.tp, SP: o.sp, AC: o.ac, cpResult: o.cpf.result(), Backend: job.Backend, Device: o.loop.Flags.DeviceKind(), Processes: job.Processes, WorldSize: job.WorldSize,
		Steps: o.loop.Steps, Losses: res.Steps, TokensPerS: res.TokensPerS, Model: o.shape.Model, Params: o.cfg.NumParams()}
	r.FinalLoss = res.Steps[len(res.Steps)-1]
	return train.WriteJSON(o.loop.Flags.JSONPath, ppResult{result: *r, PP: s.Ranks, Schedule: s.Name, Bubble: rep.bubble, BubbleTheory: theory})
}

// pipeIdle prints, from the -trace events (none without -trace), each
// rank's time in the pipeline's compute actions (the runtime's spans "F
// s0 mb1", "I …", "W …", "B …"), in its waits for another stage's tensors
// ("RECV_F …", "RECV_B …") and idle: the traced steps' time outside the
// compute actions; then the mean F, B, I and W and schedule s's bubble
// with those costs.
func pipeIdle(out io.Writer, events []trace.Event, s *pp.Schedule) {
	type sums struct{ step, busy, wait time.Duration }
	by := map[int]*sums{}
	kind, count := map[string]time.Duration{}, map[string]int{}
	for _, e := range events {
		if by[e.Rank] == nil {
			by[e.Rank] = &sums{}
		}
		s, d := by[e.Rank], e.End-e.Start
		switch {
		case e.Lane == trace.LaneCompute && strings.HasPrefix(e.Name, train.StepSpan):
			s.step += d
		case e.Lane == trace.LaneCompute && pipeAction(e.Name):
			s.busy += d
			kind[e.Name[:1]] += d
			count[e.Name[:1]]++
		case e.Lane == trace.LaneWait && strings.HasPrefix(e.Name, "RECV_"):
			s.wait += d
		}
	}
	defer pipeCosts(out, s, kind, count)
	ranks := slices.Sorted(maps.Keys(by))
	for _, r := range ranks {
		s := by[r]
		if s.step == 0 {
			continue
		}
		idle := s.step - s.busy
		fmt.Fprintf(out, "rank %d: F/I/W/B %v, waiting for tensors %v, idle %v (%.0f%% of its traced steps)\n", r,
			s.busy.Round(time.Microsecond), s.wait.Round(time.Microsecond), idle.Round(time.Microsecond), 100*float64(idle)/float64(s.step))
	}
}

// pipeCosts prints the mean duration of each kind of compute action
// (total[k] over count[k] spans) and s's bubble with those costs: what the
// schedule gives on this run's stages, beside the unit costs' figure.
func pipeCosts(out io.Writer, s *pp.Schedule, total map[string]time.Duration, count map[string]int) {
	if len(count) == 0 {
		return
	}
	ms := func(k string) float64 {
		if count[k] == 0 {
			return 0
		}
		return total[k].Seconds() * 1e3 / float64(count[k])
	}
	c := pp.Costs{F: ms("F"), B: ms("B"), I: ms("I"), W: ms("W")}
	switch {
	case count["B"] == 0: // every backward split
		c.B = c.I + c.W
	case count["I"] == 0: // none split
		c.I, c.W = c.B/2, c.B/2
	}
	b, err := s.Bubble(c)
	if err != nil {
		return
	}
	fmt.Fprintf(out, "traced costs (mean over stages): F %.2f ms, B %.2f ms, I %.2f ms, W %.2f ms; the schedule's bubble with them %.3f\n", c.F, c.B, c.I, c.W, b)
}

// pipeAction reports whether name is a compute action's span of the
// pipeline runtime: "F s0 mb1", "I s1 mb0", "W …", "B …".
func pipeAction(name string) bool {
	kind, rest, ok := strings.Cut(name, " s")
	return ok && len(kind) == 1 && strings.Contains("FIWB", kind) && strings.Contains(rest, " mb")
}

// checkMicroBatches checks that the schedule's micro-batches (-microbatches,
// or a CSV schedule's) cut the batch into row counts that -dp × -fsdp
// shares evenly.
func (o options) checkMicroBatches() error {
	rows, err := pp.MicroBatches(o.run.B, o.pipe.microBatches)
	if err != nil {
		return fmt.Errorf("-microbatches %d with a batch of %d: %w", o.pipe.microBatches, o.run.B, err)
	}
	for _, r := range rows {
		if n := o.dp * o.fsdp; (r.Hi-r.Lo)%n != 0 {
			return fmt.Errorf("-microbatches %d cuts the batch of %d into micro-batches of %d rows, which -dp × -fsdp (%d) cannot share evenly; take a -microbatches that divides %d", o.pipe.microBatches, o.run.B, r.Hi-r.Lo, n, o.run.B/n)
		}
	}
	return nil
}

// pipeRank is one rank's pipelined trainer: its stages (laid out over the
// rank's dp × fsdp × tp × cp mesh), the runtime and AdamW over its stages'
// parameters (with -fsdp their shards).
type pipeRank struct {
	rt      *pp.Runtime
	world   comm.Communicator
	params  []*autograd.Value
	reduce  bool // tp.ReduceGrads after each step: a lowered CSV schedule without ReduceGrad actions
	loss    bool // this rank adds its loss to the step's: the last stage's, tp coordinate 0 (a share of it over dp and cp)
	opt     *optim.AdamW
	batches *gpt.BatchSource
	persist *pipePersist // -data and -checkpoint (pp_resume.go)
	cur     tinygpt.Batch
	steps   int
	bubble  float64 // sum over the steps after the first
	report  *pipeReport
	ref     map[string][]float32 // -compare: the one-rank run's final parameters
	fs      map[int]*fsdp.FSDP   // with -fsdp: each stage's
}

func newPipeRank(ctx context.Context, r train.Rank, o options, s *pp.Schedule, init map[string][]float32, out io.Writer) (*pipeRank, error) {
	names := append([]string{"pp"}, o.cpf.names(o.dp, o.fsdp, o.tp)...)
	m, err := mesh.New(r.Comm, o.loop.Shape, names)
	if err != nil {
		return nil, err
	}
	tr, err := pp.NewTransport(ctx, m, "pp")
	if err != nil {
		return nil, err
	}
	sm := tr.Mesh() // (dp, fsdp, tp, cp): the mesh of this rank's stages
	tape := autograd.NewTape(r.Tape...)
	pr := &pipeRank{world: r.Comm, fs: map[int]*fsdp.FSDP{}}
	if pr.batches, pr.persist, err = pipeData(o, m, out); err != nil {
		return nil, err
	}
	rows, err := pp.MicroBatches(o.run.B, s.MicroBatches)
	if err != nil {
		return nil, err
	}
	coord := m.Coord()
	// The micro-batches' rows sharded over dp and fsdp, their sequence
	// over cp (as the Trainer shards it), whole on tp.
	at := []placement.Placement{placement.Shard(0), placement.Shard(0), placement.Replicate()}
	var stageOpts []gpt.StageOption
	if o.cpf.cp > 1 {
		seq := placement.ShardBalanced(1)
		if !o.cpf.balance {
			seq = placement.Shard(1)
		}
		at = append(at, seq)
		method, _ := cp.ParseMethod(o.cpf.method) // checked by parse; not hybrid (pipeline)
		stageOpts = append(stageOpts, gpt.WithStageContextParallel("cp", cp.WithMethod(method)))
	}
	funcs := map[int]pp.StageFunc{}
	byStage := map[int][]*autograd.Value{}
	var stages []*gpt.Stage
	S, L := s.Stages(), o.cfg.Layers
	for _, k := range s.StagesOf(tr.Rank()) {
		st, err := gpt.NewStage(tape, sm, o.cfg, k*L/S, (k+1)*L/S, init, stageOpts...)
		if err != nil {
			return nil, err
		}
		stages = append(stages, st)
		if o.tp > 1 {
			if err := tp.Parallelize(ctx, st, "tp", st.Plan(o.sp)); err != nil {
				return nil, err
			}
		}
		switch o.ac {
		case "full":
			err = parallel.Checkpoint(st, []string{"h.*"})
		case "selective":
			err = parallel.Checkpoint(st, []string{"h.*"}, autograd.WithKeepMatrixProducts())
		}
		if err != nil {
			return nil, err
		}
		byStage[k] = st.Params()
		pr.params = append(pr.params, byStage[k]...)
		if o.fsdp > 1 {
			opts := o.fsdpOptions()
			if o.reshard == "true" { // Stage.FullyShard's default is false
				opts = append(opts, fsdp.WithReshard(true))
			}
			if pr.fs[k], err = st.FullyShard(ctx, "fsdp", opts...); err != nil {
				return nil, err
			}
		}
		pr.loss = pr.loss || (k == S-1 && coord[slices.Index(names, "tp")] == 0)
		funcs[k] = func(ctx context.Context, mb int, h *autograd.Value) (*autograd.Value, error) {
			b, rg := pr.cur, rows[mb]
			shape := []int{rg.Hi - rg.Lo, b.T}
			x, err := autograd.IndicesFromFull(sm, shape, at, b.X[rg.Lo*b.T:rg.Hi*b.T])
			if err != nil {
				return nil, err
			}
			y, err := autograd.IndicesFromFull(sm, shape, at, b.Y[rg.Lo*b.T:rg.Hi*b.T])
			if err != nil {
				return nil, err
			}
			return st.Forward(ctx, h, x, y, rg.Weight)
		}
	}
	// The dp and cp sums of each stage's gradients, and what TP leaves
	// partial, once per step at the stage's ReduceGrad action, after
	// FSDP's one reduce-scatter of the micro-batches' sum.
	opts := []pp.Option{pp.WithGradReduction(func(ctx context.Context, stage int) error {
		if f := pr.fs[stage]; f != nil {
			if err := f.Finish(ctx); err != nil {
				return err
			}
		}
		return tp.ReduceGrads(ctx, byStage[stage])
	})}
	if o.fsdp > 1 {
		opts = append(opts, pp.WithSharding(func(ctx context.Context, stage int) (func(context.Context) error, error) {
			h, err := pr.fs[stage].UnshardAsync(ctx)
			if err != nil {
				return nil, err
			}
			return h.Wait, nil
		}, func(ctx context.Context, stage int) error {
			return pr.fs[stage].Reshard(ctx)
		}))
	}
	if r.Timeline != nil {
		opts = append(opts, pp.WithTimeline(r.Timeline, r.Comm.Rank()))
	}
	pr.reduce = !slices.ContainsFunc(s.Actions[tr.Rank()], func(a pp.Action) bool { return a.Kind == pp.ReduceGrad })
	if pr.rt, err = pp.NewRuntime(s, tape, tr, funcs, opts...); err != nil {
		return nil, err
	}
	run := o.run
	if pr.opt, err = optim.NewAdamW(pr.params, optim.WithLR(run.LR), optim.WithWeightDecay(run.WD), optim.WithBetas(run.Beta1, run.Beta2), optim.WithEps(run.Eps)); err != nil {
		return nil, err
	}
	return pr, pr.persist.load(ctx, &o, stages, pr.opt, pr.batches)
}

// Step implements train.Stepper: one pipelined step, AdamW, and the
// step's loss on every rank.
func (pr *pipeRank) Step(ctx context.Context) (float64, error) {
	var err error
	if pr.cur, err = pr.batches.Next(); err != nil {
		return 0, err
	}
	st, err := pr.rt.Step(ctx)
	if err != nil {
		return 0, err
	}
	if pr.reduce {
		if err := tp.ReduceGrads(ctx, pr.params); err != nil {
			return 0, err
		}
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
	// The loss lives on the last stage's ranks, each dp and cp rank's
	// share of it (tp's ranks hold the same: one of them adds it), and the bubble
	// on every rank: one all-reduce over the world gives both to all.
	v := []float64{0, pr.bubble}
	if pr.loss {
		v[0] = st.Loss
	}
	if err := comm.AllReduce(ctx, pr.world, comm.Host(v), comm.Host(v), comm.Sum); err != nil {
		return 0, err
	}
	if pr.steps > 1 && pr.world.Rank() == 0 {
		pr.report.mu.Lock()
		pr.report.bubble = v[1] / float64(pr.world.Size()*(pr.steps-1))
		pr.report.mu.Unlock()
	}
	return v[0], pr.persist.ck.After(ctx, pr.batches.Steps())
}

// Finish implements train.Finisher: -checkpoint's save after the last step
// (pp_resume.go); with -compare, the largest difference of the rank's
// parameters (whole) from the one-rank run's, the maximum over the ranks
// reported by world rank 0; then FSDP's release.
func (pr *pipeRank) Finish(ctx context.Context) (err error) {
	defer func() {
		for _, f := range pr.fs {
			err = errors.Join(err, f.Close())
		}
	}()
	if err := pr.persist.finish(ctx, pr.batches.Steps()); err != nil {
		return err
	}
	if pr.ref == nil {
		return nil
	}
	var worst float64
	for _, p := range pr.params {
		h, err := p.Data().To(device.Host())
		if err != nil {
			return err
		}
		f, err := h.Full(ctx)
		if err != nil {
			return err
		}
		want := pr.ref[p.Name()]
		for i, v := range f.([]float32) {
			worst = max(worst, math.Abs(float64(v)-float64(want[i])))
		}
	}
	v := []float64{worst}
	if err := comm.AllReduce(ctx, pr.world, comm.Host(v), comm.Host(v), comm.Max); err != nil {
		return err
	}
	if pr.world.Rank() == 0 {
		pr.report.mu.Lock()
		pr.report.paramDiff = v[0]
		pr.report.mu.Unlock()
	}
	return nil
}

// errNoPipeline says a flag needs -pp.
var errNoPipeline = errors.New("-schedule, -microbatches and -stages-per-rank need -pp > 1")
