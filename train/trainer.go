package train

import (
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"slices"
	"time"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/internal/numcheck"
	"github.com/b7ea7098/loom/optim"
	"github.com/b7ea7098/loom/parallel"
	"github.com/b7ea7098/loom/placement"
)

// Optimizer is what a Trainer steps after the gradients are complete:
// optim.AdamW and optim.SGD.
type Optimizer interface {
	// Step updates the parameters from their gradients.
	Step() error
}

// LossFunc computes the scalar loss of one batch: the user's model's
// forward and loss function. It is called on every rank with that rank's
// batch, in training mode, and its result is what Backward starts from.
type LossFunc[B any] func(ctx context.Context, b B) (*autograd.Value, error)

// Reducer completes a step's gradients after the last backward:
// ddp.DDP and fsdp.FSDP. A Reducer that also has NoSync(fn
// func() error) error (both have) runs every micro-batch but the last of a
// step inside it, so that accumulation communicates once per step.
type Reducer interface {
	// Finish reduces and installs the step's gradients.
	Finish(ctx context.Context) error
}

// noSyncer is the NoSync half of DDP and FSDP.
type noSyncer interface {
	NoSync(fn func() error) error
}

// Metrics are named evaluation results ("loss", "accuracy").
type Metrics map[string]float64

// EvalFunc evaluates the model, which the Trainer has put in evaluation
// mode (parallel.Eval), and returns its metrics; Evaluate runs one over a
// dataset. It is called on every rank.
type EvalFunc func(ctx context.Context) (Metrics, error)

// StepResult is one optimizer step as a Trainer reports it.
type StepResult struct {
	// Step counts optimizer steps from 1.
	Step int `json:"step"`
	// Loss is the mean of the micro-batches' losses (the global batch's
	// loss, the same on every rank).
	Loss float64 `json:"loss"`
	// LR is the learning rate of the step (0 without a schedule).
	LR float64 `json:"lr"`
	// GradNorm is the gradients' total 2-norm before clipping (0 without
	// WithClip).
	GradNorm float64 `json:"grad_norm,omitempty"`
	// Samples is the rows the step trained on, over all ranks.
	Samples int `json:"samples"`
	// Seconds is the step's wall time.
	Seconds float64 `json:"seconds"`
}

// EvalResult is one evaluation: after which step and its metrics.
type EvalResult struct {
	Step    int     `json:"step"`
	Metrics Metrics `json:"metrics"`
}

// History is what Fit returns: every step and every evaluation, in order.
type History struct {
	Steps []StepResult `json:"steps"`
	Evals []EvalResult `json:"evals,omitempty"`
}

// Option configures NewTrainer.
type Option func(*config)

type config struct {
	params      []*autograd.Value
	sched       Schedule
	lr          *float64
	clip        float64
	accum       int
	reducers    []Reducer
	evalEvery   int
	eval        EvalFunc
	out         io.Writer
	every       int
	live        *bool
	json        string
	tokensPer   int
	errs        []error
	paramsGiven bool
}

// WithParams sets the leaves that hold the gradients and that the
// optimizer updates (default: parallel.Params of the model, which after
// FullyShard are the sharded leaves).
func WithParams(ps []*autograd.Value) Option {
	return func(c *config) { c.params, c.paramsGiven = slices.Clone(ps), true }
}

// WithSchedule sets *lr (the optimizer's learning rate field, such as
// &adamw.LR) to s(step) before every optimizer step, step counted from 0.
func WithSchedule(s Schedule, lr *float64) Option {
	return func(c *config) {
		if s == nil || lr == nil {
			c.errs = append(c.errs, fmt.Errorf("%w: WithSchedule needs a schedule and the learning rate to set", ErrInvalid))
		}
		c.sched, c.lr = s, lr
	}
}

// WithClip clips the gradients' total 2-norm to maxNorm (positive) before
// every optimizer step (optim.ClipGradNorm), as PyTorch's
// clip_grad_norm_.
func WithClip(maxNorm float64) Option {
	return func(c *config) {
		if err := numcheck.Positive(ErrInvalid, "WithClip max norm", maxNorm); err != nil {
			c.errs = append(c.errs, err)
		}
		c.clip = maxNorm
	}
}

// WithAccumulation makes every optimizer step k micro-batches (k ≥ 1,
// default 1): each micro-batch's loss is divided by k, so the gradient is
// that of the mean loss of the k global batches; all but the last run
// under the reducers' NoSync.
func WithAccumulation(k int) Option {
	return func(c *config) {
		if err := numcheck.Count(ErrInvalid, "WithAccumulation micro-batches", k); err != nil {
			c.errs = append(c.errs, err)
		}
		c.accum = k
	}
}

// WithReducer adds a Reducer (DDP, FSDP) whose Finish completes every
// step's gradients, in the order given. A nil r (an interface holding
// nothing: a layout without data parallelism) adds nothing.
func WithReducer(r Reducer) Option {
	return func(c *config) {
		if r != nil {
			c.reducers = append(c.reducers, r)
		}
	}
}

// WithEval runs fn in evaluation mode after every every-th step (every ≥
// 1) and after the last step of Fit.
func WithEval(every int, fn EvalFunc) Option {
	return func(c *config) {
		if err := numcheck.Count(ErrInvalid, "WithEval interval", every); err != nil {
			c.errs = append(c.errs, err)
		}
		if fn == nil {
			c.errs = append(c.errs, fmt.Errorf("%w: nil EvalFunc", ErrInvalid))
		}
		c.evalEvery, c.eval = every, fn
	}
}

// WithProgress writes progress to w after every every-th step (every ≥ 1)
// and the last one: the step, loss, learning rate, samples (or tokens) per
// second and the time left. On a terminal it is one line redrawn with a
// bar; otherwise (a log, a pipe) a plain line per report. Give it on one
// rank only (world rank 0): every rank computes the same values.
func WithProgress(w io.Writer, every int) Option {
	return func(c *config) {
		if err := numcheck.Count(ErrInvalid, "WithProgress interval", every); err != nil {
			c.errs = append(c.errs, err)
		}
		c.out, c.every = w, every
	}
}

// WithLive forces the progress display to the redrawn bar (true) or to
// plain lines (false) instead of deciding by whether the writer is a
// terminal.
func WithLive(on bool) Option { return func(c *config) { c.live = &on } }

// WithJSON writes every step and every evaluation of Fit to the file at
// path as one JSON object per line ({"step":…,"loss":…} and
// {"step":…,"metrics":{…}}): the -json metrics. The first Fit of a
// Trainer that has taken no steps creates (or empties) the file, a later
// one, or one after Resume, appends to it; Fit closes it on return. An
// empty path writes nothing. Give it on one rank only, like WithProgress.
func WithJSON(path string) Option { return func(c *config) { c.json = path } }

// WithTokensPerSample makes progress report tokens per second, n tokens
// per row (n ≥ 1), instead of samples per second.
func WithTokensPerSample(n int) Option {
	return func(c *config) {
		if err := numcheck.Count(ErrInvalid, "WithTokensPerSample", n); err != nil {
			c.errs = append(c.errs, err)
		}
		c.tokensPer = n
	}
}

// Trainer is one rank's training of a model: every rank of the job makes
// its own with the same options and calls Step or Fit in step (the steps
// are collective). It owns the order of a step: zero the gradients, set
// the learning rate, for each micro-batch the loss and Backward, the
// reducers' Finish, clipping and the optimizer's Step.
type Trainer[B any] struct {
	model parallel.Module
	tape  *autograd.Tape
	opt   Optimizer
	loss  LossFunc[B]
	cfg   config
	step  int
	prog  *progress
	json  io.Writer // the -json file while Fit runs
}

// NewTrainer returns a Trainer of model, whose ops record on tape, that
// minimises loss with opt. Errors wrap ErrInvalid: a nil argument, a bad
// option value (every one is reported), or a model without parameters.
func NewTrainer[B any](model parallel.Module, tape *autograd.Tape, opt Optimizer, loss LossFunc[B], opts ...Option) (*Trainer[B], error) {
	const op = "train: NewTrainer"
	c := config{accum: 1}
	for _, o := range opts {
		o(&c)
	}
	if model == nil || tape == nil || opt == nil || loss == nil {
		c.errs = append(c.errs, fmt.Errorf("%w: nil model, tape, optimizer or loss", ErrInvalid))
	}
	if err := errors.Join(c.errs...); err != nil {
		return nil, fmt.Errorf("%s: %w", op, err)
	}
	if !c.paramsGiven {
		ps, err := parallel.Params(model)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", op, err)
		}
		c.params = ps
	}
	if len(c.params) == 0 {
		return nil, fmt.Errorf("%s: %w: no parameters", op, ErrInvalid)
	}
	t := &Trainer[B]{model: model, tape: tape, opt: opt, loss: loss, cfg: c}
	if c.out != nil {
		t.prog = newProgress(c.out, c.live)
	}
	return t, nil
}

// Steps is the number of optimizer steps taken (or resumed from).
func (t *Trainer[B]) Steps() int { return t.step }

// Resume sets the number of steps taken, for a run restored from a
// checkpoint (the schedule continues from there; restore the Sampler
// with its own state). A negative n is an error wrapping ErrInvalid.
func (t *Trainer[B]) Resume(n int) error {
	if err := numcheck.NonNegativeCount(ErrInvalid, "steps", n); err != nil {
		return fmt.Errorf("train: Trainer.Resume: %w", err)
	}
	t.step = n
	return nil
}

// Step runs one optimizer step on micro, its micro-batches (as many as
// WithAccumulation says): every rank calls it with its own batches.
// samples is the rows of the step over all ranks, for the result. Errors
// are the failing part's, wrapped with it; the gradients are then zeroed
// on the next Step.
func (t *Trainer[B]) Step(ctx context.Context, micro []B, samples int) (StepResult, error) {
	const op = "train: Step"
	if len(micro) != t.cfg.accum {
		return StepResult{}, fmt.Errorf("%s: %w: %d micro-batches; the trainer accumulates %d", op, ErrInvalid, len(micro), t.cfg.accum)
	}
	start := time.Now()
	res := StepResult{Step: t.step + 1, Samples: samples}
	for _, p := range t.cfg.params {
		p.ZeroGrad()
	}
	if t.cfg.sched != nil {
		res.LR = t.cfg.sched(t.step)
		*t.cfg.lr = res.LR
	}
	k := len(micro)
	for i, b := range micro {
		run := func() error {
			loss, err := t.loss(ctx, b)
			if err != nil {
				t.tape.Reset()
				return fmt.Errorf("loss: %w", err)
			}
			v, err := Item(ctx, loss)
			if err != nil {
				t.tape.Reset()
				return err
			}
			res.Loss += v / float64(k)
			if k > 1 {
				if loss, err = autograd.Scale(loss, 1/float64(k)); err != nil {
					t.tape.Reset()
					return err
				}
			}
			if err := t.tape.Backward(ctx, loss); err != nil {
				return fmt.Errorf("backward: %w", err)
			}
			return nil
		}
		if i < k-1 {
			run = t.noSync(run)
		}
		if err := run(); err != nil {
			return StepResult{}, fmt.Errorf("%s %d, micro-batch %d: %w", op, res.Step, i, err)
		}
	}
	for _, r := range t.cfg.reducers {
		if err := r.Finish(ctx); err != nil {
			return StepResult{}, fmt.Errorf("%s %d: reducing the gradients: %w", op, res.Step, err)
		}
	}
	if t.cfg.clip > 0 {
		n, err := optim.ClipGradNorm(ctx, t.cfg.params, t.cfg.clip)
		if err != nil {
			return StepResult{}, fmt.Errorf("%s %d: %w", op, res.Step, err)
		}
		res.GradNorm = n
	}
	if err := t.opt.Step(); err != nil {
		return StepResult{}, fmt.Errorf("%s %d: optimizer: %w", op, res.Step, err)
	}
	t.step++
	res.Seconds = time.Since(start).Seconds()
	return res, nil
}

// noSync wraps fn in the NoSync of every reducer that has one.
func (t *Trainer[B]) noSync(fn func() error) func() error {
	for _, r := range t.cfg.reducers {
		if ns, ok := r.(noSyncer); ok {
			inner := fn
			fn = func() error { return ns.NoSync(inner) }
		}
	}
	return fn
}

// Fit trains until Steps() reaches steps, each step taking its
// micro-batches from s (the next WithAccumulation global batches) and
// building them with data; it evaluates (WithEval), reports progress
// (WithProgress, WithJSON) and returns this call's steps and
// evaluations. On return the model is in training mode. A step count
// below Steps() is an error wrapping ErrInvalid, as is a nil data or s.
func (t *Trainer[B]) Fit(ctx context.Context, data Dataset[B], s *Sampler, steps int) (_ *History, err error) {
	const op = "train: Fit"
	if data == nil || s == nil {
		return nil, fmt.Errorf("%s: %w: nil dataset or sampler", op, ErrInvalid)
	}
	if steps < t.step {
		return nil, fmt.Errorf("%s: %w: %d steps, but %d are already done", op, ErrInvalid, steps, t.step)
	}
	if err := parallel.Train(t.model); err != nil {
		return nil, fmt.Errorf("%s: %w", op, err)
	}
	h := &History{}
	first := t.step
	if t.cfg.json != "" {
		flags := os.O_WRONLY | os.O_CREATE | os.O_APPEND
		if first == 0 {
			flags |= os.O_TRUNC
		}
		f, err := os.OpenFile(t.cfg.json, flags, 0o644)
		if err != nil {
			return nil, fmt.Errorf("%s: -json: %w", op, err)
		}
		t.json = f
		defer func() {
			if cerr := f.Close(); cerr != nil && err == nil {
				err = fmt.Errorf("%s: -json: %w", op, cerr)
			}
			t.json = nil
		}()
	}
	if t.prog != nil {
		t.prog.start(first, steps, s.Batch()*t.cfg.accum*max(1, t.cfg.tokensPer), t.cfg.tokensPer > 0)
	}
	for t.step < steps {
		micro := make([]B, t.cfg.accum)
		for i := range micro {
			b, err := data.Batch(ctx, s.Next())
			if err != nil {
				return h, fmt.Errorf("%s: step %d: batch: %w", op, t.step+1, err)
			}
			micro[i] = b
		}
		r, err := t.Step(ctx, micro, s.Batch()*t.cfg.accum)
		if err != nil {
			return h, err
		}
		h.Steps = append(h.Steps, r)
		if err := t.emit(r); err != nil {
			return h, err
		}
		last := t.step == steps
		if t.prog != nil && (t.step%t.cfg.every == 0 || last) {
			t.prog.report(r, t.step)
		}
		if t.cfg.eval != nil && (t.step%t.cfg.evalEvery == 0 || last) {
			m, err := t.Evaluate(ctx)
			if err != nil {
				return h, fmt.Errorf("%s: step %d: %w", op, t.step, err)
			}
			e := EvalResult{Step: t.step, Metrics: m}
			h.Evals = append(h.Evals, e)
			if err := t.emit(e); err != nil {
				return h, err
			}
			if t.prog != nil {
				t.prog.eval(e)
			}
		}
	}
	if t.prog != nil {
		t.prog.done()
	}
	return h, nil
}

// Evaluate runs the WithEval function in evaluation mode and returns the
// model to training mode; without WithEval it returns no metrics.
func (t *Trainer[B]) Evaluate(ctx context.Context) (Metrics, error) {
	if t.cfg.eval == nil {
		return nil, nil
	}
	if err := parallel.Eval(t.model); err != nil {
		return nil, fmt.Errorf("eval: %w", err)
	}
	m, err := t.cfg.eval(ctx)
	t.tape.Reset() // the evaluation's forwards are not trained on
	if terr := parallel.Train(t.model); err == nil && terr != nil {
		err = terr
	}
	if err != nil {
		return nil, fmt.Errorf("eval: %w", err)
	}
	return m, nil
}

// emit writes v as a JSON line with WithJSON.
func (t *Trainer[B]) emit(v any) error {
	if t.json == nil {
		return nil
	}
	if err := writeJSONLine(t.json, v); err != nil {
		return fmt.Errorf("train: -json: %w", err)
	}
	return nil
}

// Evaluate averages fn's metrics over one epoch of s (its next
// BatchesPerEpoch global batches) built by data, resetting the tape after
// each batch (an evaluation records no backward). Every rank calls it; fn
// typically runs the model's forward and returns ClassMetrics or a loss
// read with Item. Nil arguments are errors wrapping ErrInvalid.
func Evaluate[B any](ctx context.Context, tape *autograd.Tape, data Dataset[B], s *Sampler, fn func(ctx context.Context, b B) (Metrics, error)) (Metrics, error) {
	if tape == nil || data == nil || s == nil || fn == nil {
		return nil, fmt.Errorf("%w: Evaluate: nil tape, dataset, sampler or function", ErrInvalid)
	}
	n := s.BatchesPerEpoch()
	sum := Metrics{}
	for range n {
		b, err := data.Batch(ctx, s.Next())
		if err != nil {
			return nil, fmt.Errorf("train: Evaluate: %w", err)
		}
		m, err := fn(ctx, b)
		tape.Reset()
		if err != nil {
			return nil, fmt.Errorf("train: Evaluate: %w", err)
		}
		for k, v := range m {
			sum[k] += v / float64(n)
		}
	}
	return sum, nil
}

// Item returns the value of the scalar v (a loss) as a float64, however
// it is laid out: a Partial loss is reduced, so it is collective over v's
// mesh and every rank calls it. A value with more than one element is an
// error wrapping ErrInvalid.
func Item(ctx context.Context, v *autograd.Value) (float64, error) {
	if v == nil || v.Spec() == nil {
		return 0, fmt.Errorf("%w: Item: nil value", ErrInvalid)
	}
	if n := v.Spec().Shape(); len(n) != 0 && prod(n) != 1 {
		return 0, fmt.Errorf("%w: Item: value of shape %v is not a scalar", ErrInvalid, n)
	}
	full, err := v.Data().Full(ctx)
	if err != nil {
		return 0, fmt.Errorf("train: Item: %w", err)
	}
	switch d := full.(type) {
	case []float32:
		return float64(d[0]), nil
	case []float64:
		return d[0], nil
	default:
		return 0, fmt.Errorf("%w: Item: data of type %T", ErrInvalid, full)
	}
}

func prod(s []int) int {
	n := 1
	for _, v := range s {
		n *= v
	}
	return n
}

// sortedKeys returns m's keys in order, for a stable display.
func sortedKeys(m Metrics) []string { return slices.Sorted(maps.Keys(m)) }

// ClassMetrics returns the cross-entropy loss ("loss") and the accuracy
// ("accuracy") of logits [N, C] against labels y [N], laid out as
// autograd.CrossEntropy needs: the metrics of a classifier's evaluation.
// It is collective over the mesh (every rank gets the same values).
func ClassMetrics(ctx context.Context, logits *autograd.Value, y *autograd.Indices) (Metrics, error) {
	l, err := autograd.CrossEntropy(logits, y)
	if err != nil {
		return nil, fmt.Errorf("train: ClassMetrics: %w", err)
	}
	loss, err := Item(ctx, l)
	if err != nil {
		return nil, fmt.Errorf("train: ClassMetrics: %w", err)
	}
	pred, err := autograd.Argmax(logits)
	if err != nil {
		return nil, fmt.Errorf("train: ClassMetrics: %w", err)
	}
	acc, err := autograd.Accuracy(ctx, pred, y)
	if err != nil {
		return nil, fmt.Errorf("train: ClassMetrics: %w", err)
	}
	return Metrics{"loss": loss, "accuracy": acc}, nil
}

// ClassifierEval returns the EvalFunc of a classifier: Evaluate over s's
// batches of data, each batch's metrics ClassMetrics of model's logits.
func ClassifierEval(model parallel.Layer, tape *autograd.Tape, data Dataset[Classification], s *Sampler) EvalFunc {
	return func(ctx context.Context) (Metrics, error) {
		return Evaluate(ctx, tape, data, s, func(ctx context.Context, b Classification) (Metrics, error) {
			logits, err := model.Forward(ctx, b.X)
			if err != nil {
				return nil, err
			}
			return ClassMetrics(ctx, logits, b.Y)
		})
	}
}

// SyncGrads returns a Reducer that lays every gradient of params out like
// its parameter (placement.GradSpec: Partial axes summed, to Replicate)
// at Finish, one Redistribute per parameter that needs one, after the last
// backward and without overlap: the general reduction for the axes DDP
// and FSDP do not reduce, such as the token-sharding expert-parallel axis
// of a MoE layer's router and of the layers around it. Give it after DDP
// or FSDP (WithReducer, in order). Every rank must hold the same list.
func SyncGrads(params []*autograd.Value) Reducer { return syncGrads(slices.Clone(params)) }

type syncGrads []*autograd.Value

func (s syncGrads) Finish(ctx context.Context) error {
	for _, p := range s {
		g := p.Grad()
		if g == nil {
			continue
		}
		gs, err := placement.GradSpec(g.Spec())
		if err != nil {
			return fmt.Errorf("train: SyncGrads: %q: %w", p.Name(), err)
		}
		if gs.Equal(g.Spec()) {
			continue
		}
		r, err := placement.Redistribute(ctx, g, gs)
		if err != nil {
			return fmt.Errorf("train: SyncGrads: %q: %w", p.Name(), err)
		}
		if err := p.SetGrad(r); err != nil {
			return fmt.Errorf("train: SyncGrads: %q: %w", p.Name(), err)
		}
	}
	return nil
}
