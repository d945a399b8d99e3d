package train

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/b7ea7098/loom"
	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/optim"
	"github.com/b7ea7098/loom/parallel"
	"github.com/b7ea7098/loom/parallel/ddp"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// tnet is a small classifier and its data on one rank's mesh.
type tnet struct {
	tape  *autograd.Tape
	model *parallel.Sequential
	data  *InMemory
	opt   *optim.SGD
}

func newTnet(t testing.TB, m *mesh.Mesh, axes ...string) *tnet {
	tape := autograd.NewTape()
	l0, err := parallel.NewLinear(tape, m, 4, 6, parallel.WithName("0"), parallel.WithInit(parallel.Normal(0.5, 1)))
	if err != nil {
		t.Fatal(err)
	}
	l2, err := parallel.NewLinear(tape, m, 6, 3, parallel.WithName("2"), parallel.WithInit(parallel.Normal(0.5, 2)))
	if err != nil {
		t.Fatal(err)
	}
	model, err := parallel.NewSequential(l0, parallel.NewReLU(), l2)
	if err != nil {
		t.Fatal(err)
	}
	x, y, err := Blobs(64, 4, 3, 9)
	if err != nil {
		t.Fatal(err)
	}
	ps, err := parallel.Params(model)
	if err != nil {
		t.Fatal(err)
	}
	opt, err := optim.NewSGD(ps, 0.1)
	if err != nil {
		t.Fatal(err)
	}
	return &tnet{tape: tape, model: model, data: &InMemory{X: x, Features: 4, Y: y, Tape: tape, Mesh: m, Axes: axes}, opt: opt}
}

func (n *tnet) loss(ctx context.Context, b Classification) (*autograd.Value, error) {
	logits, err := n.model.Forward(ctx, b.X)
	if err != nil {
		return nil, err
	}
	return autograd.CrossEntropy(logits, b.Y)
}

// fit trains n for steps steps of batch rows with opts and returns the
// losses.
func (n *tnet) fit(ctx context.Context, batch, steps int, opts ...Option) ([]float64, error) {
	s, err := n.data.Sampler(batch, WithShuffle(1))
	if err != nil {
		return nil, err
	}
	tr, err := NewTrainer(n.model, n.tape, n.opt, n.loss, opts...)
	if err != nil {
		return nil, err
	}
	h, err := tr.Fit(ctx, n.data, s, steps)
	if err != nil {
		return nil, err
	}
	var out []float64
	for _, r := range h.Steps {
		out = append(out, r.Loss)
	}
	return out, nil
}

// countingReducer records how a Trainer uses a Reducer.
type countingReducer struct{ noSync, finish int }

func (c *countingReducer) Finish(context.Context) error { c.finish++; return nil }
func (c *countingReducer) NoSync(fn func() error) error { c.noSync++; return fn() }

// TestAccumulation: 2 micro-batches of 8 rows per step train exactly as
// batches of 16 (the sampler gives the same rows, and the mean of two
// equal-sized means is the mean), on one rank and under DDP on 2 ranks,
// where the first micro-batch runs under NoSync. Float32 losses agree to
// 1e-6 (only the order of the gradient sums differs), and with SyncGrads
// in place of DDP.
func TestAccumulation(t *testing.T) {
	var want []float64
	placementtest.Run(t, []int{1}, []string{"dp"}, func(ctx context.Context, m *mesh.Mesh) error {
		var err error
		want, err = newTnet(t, m, "dp").fit(ctx, 16, 6)
		return err
	})
	var counts countingReducer
	placementtest.Run(t, []int{1}, []string{"dp"}, func(ctx context.Context, m *mesh.Mesh) error {
		got, err := newTnet(t, m, "dp").fit(ctx, 8, 6, WithAccumulation(2), WithReducer(&counts))
		if err != nil {
			return err
		}
		return closeLosses(got, want, 1e-6)
	})
	if counts.noSync != 6 || counts.finish != 6 {
		t.Errorf("over 6 steps of 2 micro-batches: %d NoSync and %d Finish calls; want 6 and 6", counts.noSync, counts.finish)
	}
	placementtest.Run(t, []int{2}, []string{"dp"}, func(ctx context.Context, m *mesh.Mesh) error {
		n := newTnet(t, m, "dp")
		ps, err := parallel.Params(n.model)
		if err != nil {
			return err
		}
		d, err := ddp.New(ctx, ps)
		if err != nil {
			return err
		}
		got, err := n.fit(ctx, 8, 6, WithAccumulation(2), WithReducer(d))
		if err != nil {
			return err
		}
		return closeLosses(got, want, 1e-6)
	})
	// SyncGrads in place of DDP: the Partial(sum) gradients are summed at
	// Finish, once for both micro-batches.
	placementtest.Run(t, []int{2}, []string{"dp"}, func(ctx context.Context, m *mesh.Mesh) error {
		n := newTnet(t, m, "dp")
		ps, err := parallel.Params(n.model)
		if err != nil {
			return err
		}
		got, err := n.fit(ctx, 8, 6, WithAccumulation(2), WithReducer(SyncGrads(ps)))
		if err != nil {
			return err
		}
		return closeLosses(got, want, 1e-6)
	})
}

func closeLosses(got, want []float64, tol float64) error {
	if len(got) != len(want) {
		return fmt.Errorf("%d losses, want %d", len(got), len(want))
	}
	for i := range got {
		if math.Abs(got[i]-want[i]) > tol {
			return fmt.Errorf("step %d: loss %v, want %v", i+1, got[i], want[i])
		}
	}
	return nil
}

// normOpt is an Optimizer that records the gradients' 2-norm it is given.
type normOpt struct {
	ps    []*autograd.Value
	norms []float64
}

func (o *normOpt) Step() error {
	var s float64
	for _, p := range o.ps {
		if g := p.Grad(); g != nil {
			for _, v := range g.LocalData().([]float32) {
				s += float64(v) * float64(v)
			}
		}
	}
	o.norms = append(o.norms, math.Sqrt(s))
	return nil
}

// TestClipAndSchedule: with WithClip the optimizer sees gradients of norm
// at most the limit while the step reports the norm before clipping, and
// WithSchedule sets the learning rate of each step from the schedule,
// continuing after Resume.
func TestClipAndSchedule(t *testing.T) {
	placementtest.Run(t, []int{1}, []string{"dp"}, func(ctx context.Context, m *mesh.Mesh) error {
		n := newTnet(t, m, "dp")
		ps, err := parallel.Params(n.model)
		if err != nil {
			return err
		}
		opt := &normOpt{ps: ps}
		sched, err := WarmupLinear(1, 0, 2, 10)
		if err != nil {
			return err
		}
		var lr float64
		tr, err := NewTrainer(n.model, n.tape, opt, n.loss, WithClip(0.01), WithSchedule(sched, &lr))
		if err != nil {
			return err
		}
		s, err := n.data.Sampler(16)
		if err != nil {
			return err
		}
		h, err := tr.Fit(ctx, n.data, s, 3)
		if err != nil {
			return err
		}
		if err := tr.Resume(5); err != nil {
			return err
		}
		h2, err := tr.Fit(ctx, n.data, s, 6)
		if err != nil {
			return err
		}
		steps := append(h.Steps, h2.Steps...)
		for i, r := range steps {
			if r.GradNorm <= 0.01 || opt.norms[i] > 0.01*(1+1e-5) {
				return fmt.Errorf("step %d: norm %v before clipping, %v after; want above and at most 0.01", r.Step, r.GradNorm, opt.norms[i])
			}
		}
		for i, want := range map[int]float64{0: 0, 1: 0.5, 2: 1, 3: sched(5)} {
			if steps[i].LR != want {
				return fmt.Errorf("step %d: lr %v, want %v", steps[i].Step, steps[i].LR, want)
			}
		}
		if steps[3].Step != 6 || lr != sched(5) || tr.Steps() != 6 {
			return fmt.Errorf("after Resume(5): step %d, lr field %v", steps[3].Step, lr)
		}
		return nil
	})
}

// TestProgressAndJSON: plain progress lines every N steps and the last,
// the live bar redrawn with \r, evaluation lines, and JSON lines for
// every step and evaluation.
func TestProgressAndJSON(t *testing.T) {
	for _, live := range []bool{false, true} {
		placementtest.Run(t, []int{1}, []string{"dp"}, func(ctx context.Context, m *mesh.Mesh) error {
			n := newTnet(t, m, "dp")
			var out bytes.Buffer
			path := filepath.Join(t.TempDir(), "m.jsonl")
			heldS, err := n.data.Sampler(n.data.Len())
			if err != nil {
				return err
			}
			_, err = n.fit(ctx, 16, 5, WithProgress(&out, 2), WithLive(live), WithJSON(path), WithTokensPerSample(3),
				WithEval(4, ClassifierEval(n.model, n.tape, n.data, heldS)))
			if err != nil {
				return err
			}
			s := out.String()
			var want []string
			if live {
				want = []string{"\r[=========               ] step 2/5  loss ", "\r[========================] step 5/5", "tokens/s  eta ", "\x1b[K\neval at step 4:  accuracy "}
			} else {
				want = []string{"step 2/5  loss ", "\nstep 4/5  loss ", "\neval at step 4:  accuracy ", "\nstep 5/5  loss ", "tokens/s  eta ", "\neval at step 5:"}
				if strings.Contains(s, "\r") || strings.Contains(s, "step 3/5") {
					return fmt.Errorf("plain output has a redraw or step 3:\n%q", s)
				}
			}
			for _, w := range want {
				if !strings.Contains(s, w) {
					return fmt.Errorf("live=%v: output lacks %q:\n%q", live, w, s)
				}
			}
			f, err := os.ReadFile(path)
			if err != nil {
				return err
			}
			var steps, evals int
			sc := bufio.NewScanner(bytes.NewReader(f))
			for sc.Scan() {
				var rec map[string]any
				if err := json.Unmarshal(sc.Bytes(), &rec); err != nil {
					return fmt.Errorf("JSON line %q: %w", sc.Text(), err)
				}
				if _, ok := rec["metrics"]; ok {
					evals++
				} else if _, ok := rec["loss"]; ok {
					steps++
				}
			}
			if steps != 5 || evals != 2 {
				return fmt.Errorf("JSON: %d steps and %d evals, want 5 and 2:\n%s", steps, evals, f)
			}
			return nil
		})
	}
}

func TestItem(t *testing.T) {
	placementtest.Run(t, []int{2}, []string{"dp"}, func(ctx context.Context, m *mesh.Mesh) error {
		n := newTnet(t, m, "dp")
		s, err := n.data.Sampler(16)
		if err != nil {
			return err
		}
		b, err := n.data.Batch(ctx, s.Next())
		if err != nil {
			return err
		}
		loss, err := n.loss(ctx, b) // Partial(sum) on dp
		if err != nil {
			return err
		}
		full, err := loss.Data().Full(ctx)
		if err != nil {
			return err
		}
		v, err := Item(ctx, loss)
		if err != nil {
			return err
		}
		if v != float64(full.([]float32)[0]) || v <= 0 {
			return fmt.Errorf("Item %v, Full %v", v, full)
		}
		if _, err := Item(ctx, b.X); !errors.Is(err, loom.ErrInvalid) {
			return fmt.Errorf("Item of a [16, 4] value: %v", err)
		}
		return nil
	})
}

func TestNewTrainerRejects(t *testing.T) {
	placementtest.Run(t, []int{1}, []string{"dp"}, func(ctx context.Context, m *mesh.Mesh) error {
		n := newTnet(t, m, "dp")
		var lr float64
		for name, opts := range map[string][]Option{
			"accumulation 0": {WithAccumulation(0)},
			"clip 0":         {WithClip(0)},
			"clip NaN":       {WithClip(math.NaN())},
			"progress 0":     {WithProgress(&bytes.Buffer{}, 0)},
			"eval nil":       {WithEval(1, nil)},
			"schedule nil":   {WithSchedule(nil, &lr)},
			"tokens 0":       {WithTokensPerSample(0)},
			"no parameters":  {WithParams(nil)},
		} {
			if _, err := NewTrainer(n.model, n.tape, n.opt, n.loss, opts...); !errors.Is(err, loom.ErrInvalid) {
				return fmt.Errorf("%s: %v; want ErrInvalid", name, err)
			}
		}
		if _, err := NewTrainer[Classification](n.model, n.tape, n.opt, nil); !errors.Is(err, ErrInvalid) {
			return fmt.Errorf("nil loss: %v", err)
		}
		tr, err := NewTrainer(n.model, n.tape, n.opt, n.loss)
		if err != nil {
			return err
		}
		if _, err := tr.Step(ctx, nil, 0); !errors.Is(err, ErrInvalid) {
			return fmt.Errorf("Step without micro-batches: %v", err)
		}
		if err := tr.Resume(-1); !errors.Is(err, ErrInvalid) {
			return fmt.Errorf("Resume(-1): %v", err)
		}
		return nil
	})
}

// TestEvalMode: the evaluation runs with the model in evaluation mode
// (Dropout off) and training resumes in training mode; an evaluation's
// error ends Fit, naming the step.
func TestEvalMode(t *testing.T) {
	placementtest.Run(t, []int{1}, []string{"dp"}, func(ctx context.Context, m *mesh.Mesh) error {
		n := newTnet(t, m, "dp")
		drop, err := parallel.NewDropout(0.5, 1)
		if err != nil {
			return err
		}
		n.model.Layers = append([]parallel.Layer{drop}, n.model.Layers...)
		var modes []bool
		eval := func(context.Context) (Metrics, error) {
			modes = append(modes, drop.Training())
			return Metrics{"x": 1}, nil
		}
		if _, err := n.fit(ctx, 16, 4, WithEval(2, eval)); err != nil {
			return err
		}
		if len(modes) != 2 || modes[0] || modes[1] || !drop.Training() {
			return fmt.Errorf("training mode during the evaluations %v, after %v; want [false false], true", modes, drop.Training())
		}
		boom := errors.New("boom")
		_, err = n.fit(ctx, 16, 4, WithEval(3, func(context.Context) (Metrics, error) { return nil, boom }))
		if !errors.Is(err, boom) || !strings.Contains(err.Error(), "step 3") || !drop.Training() {
			return fmt.Errorf("a failing evaluation: %v (training mode %v)", err, drop.Training())
		}
		return nil
	})
}

// TestInMemoryBatch: on a 2×2 mesh with both axes sharding the rows of an
// uneven batch (7 rows over 4 ranks), the ranks' blocks gather into the
// global batch's rows in order, features and labels alike; a row outside
// the dataset and a Split past the end are errors.
func TestInMemoryBatch(t *testing.T) {
	placementtest.Run(t, []int{2, 2}, []string{"dp", "fsdp"}, func(ctx context.Context, m *mesh.Mesh) error {
		x := make([]float32, 10*3)
		y := make([]int64, 10)
		for i := range y {
			y[i] = int64(i)
			for j := range 3 {
				x[i*3+j] = float32(10*i + j)
			}
		}
		d := &InMemory{X: x, Features: 3, Y: y, Tape: autograd.NewTape(), Mesh: m, Axes: []string{"dp", "fsdp"}}
		global := []int{9, 0, 4, 2, 7, 1, 5}
		b, err := d.Batch(ctx, Sample{Global: global})
		if err != nil {
			return err
		}
		full, err := b.X.Data().Full(ctx)
		if err != nil {
			return err
		}
		fx := full.([]float32)
		for i, r := range global {
			for j := range 3 {
				if fx[i*3+j] != x[r*3+j] {
					return fmt.Errorf("row %d of the batch: %v, want dataset row %d", i, fx[i*3:i*3+3], r)
				}
			}
		}
		// The labels, compared through Accuracy with the global batch's.
		want, err := autograd.IndicesFromFull(m, []int{7}, b.X.Spec().Placements(), []int64{9, 0, 4, 2, 7, 1, 5}, placement.WithOrder(0, "dp", "fsdp"))
		if err != nil {
			return err
		}
		if acc, err := autograd.Accuracy(ctx, b.Y, want); err != nil || acc != 1 {
			return fmt.Errorf("labels: accuracy %v against the global batch's (err %v)", acc, err)
		}
		if _, err := d.Batch(ctx, Sample{Global: []int{10}}); !errors.Is(err, ErrInvalid) {
			return fmt.Errorf("row 10 of 10: %v", err)
		}
		if _, _, err := d.Split(10); !errors.Is(err, ErrInvalid) {
			return fmt.Errorf("Split(10) of 10: %v", err)
		}
		return nil
	})
}
