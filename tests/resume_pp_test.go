package tests

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/checkpoint"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/local"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/models/gpt"
	"github.com/b7ea7098/loom/optim"
	"github.com/b7ea7098/loom/parallel/pp"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/reference/tinygpt"
	"github.com/b7ea7098/loom/train"
)

// Resuming a pipelined run. A pipelined rank saves its stages' parameters
// and AdamW's moments under the model's names (gpt.PipelineParts), so a
// checkpoint loads into a pipeline of another split, or into one rank.
// 20 steps straight are compared with 10 steps, a save, a new model (new
// tape, stages, optimizer and batches) that loads, and 10 more steps:
// bitwise on the same layout, within the pipeline parity tolerance (2e-5,
// TestPipelineParity) when the split changes, AdamW's k-bias steps aside
// (see comparePP).

// ppResume is a layout of the pipelined resume tests: pp ranks running
// schedule with m micro-batches and v stages per rank; pp 0 is one rank
// without a pipeline: a gpt.Trainer, or with tied one whole-model
// gpt.Stage (a Trainer has no tied head).
type ppResume struct {
	pp       int
	schedule string
	m, v     int
	tied     bool // lm_head a copy of wte, gradients summed (pp.SumTied)
}

func (l ppResume) String() string {
	s := "one rank"
	if l.pp > 0 {
		s = fmt.Sprintf("pp=%d %s M=%d", l.pp, l.schedule, l.m)
		if l.v > 0 {
			s += fmt.Sprintf(" V=%d", l.v)
		}
	}
	if l.tied {
		s += " tied"
	}
	return s
}

// ppResumeCfg is ppCfg with the reference's vocabulary (the batches'
// sampler checks it): 8 blocks, so that pp=4 with two stages per rank
// holds one per stage.
var ppResumeCfg = func() gpt.Config { c := ppCfg; c.Vocab = 128; return c }()

// ppResumeInit is the initial model: with tied, lm_head starts as a copy
// of wte.
func ppResumeInit(tied bool) map[string][]float32 {
	init := gpt.RandomInit(ppResumeCfg, 1)
	if tied {
		init[tinygpt.ParamLMHead] = slices.Clone(init[tinygpt.ParamWTE])
	}
	return init
}

// ppResumeRun is the run the tests train: ppResumeCfg on random tokens, a
// batch of 8 rows, the reference run's AdamW.
func ppResumeRun() tinygpt.Config {
	run := tinygpt.Default()
	run.B = 8
	return run
}

// ppResumeTrain trains steps steps on l from the same initial model,
// loading dir first when set and saving into root after the last step
// when set, and returns the losses and the final parameters as bits.
func ppResumeTrain(l ppResume, dir, root string, steps int) (*resumeRun, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	run := ppResumeRun()
	init := ppResumeInit(l.tied)
	out := &resumeRun{Losses: make([]uint64, steps), Params: map[string][]uint32{}}
	var mu sync.Mutex
	keep := func(full map[string][]float32) {
		mu.Lock()
		defer mu.Unlock()
		out.setParams(full)
	}
	// resume loads dir into parts, checks the step and trains; save
	// saves after.
	resume := func(ctx context.Context, parts checkpoint.Parts, steps func() int, step func(i int) error) error {
		if dir != "" {
			s, _, err := checkpoint.LoadJob(ctx, dir, parts)
			if err != nil {
				return err
			}
			if s != steps() {
				return fmt.Errorf("LoadJob's step %d, the batches' %d", s, steps())
			}
		}
		for i := range out.Losses {
			if err := step(i); err != nil {
				return fmt.Errorf("step %d: %w", i+1, err)
			}
		}
		if root == "" {
			return nil
		}
		st, err := checkpoint.JobState(steps(), parts, nil)
		if err != nil {
			return err
		}
		_, err = checkpoint.Save(ctx, root, st, checkpoint.WithStep(steps()))
		return err
	}
	if l.pp == 0 && !l.tied {
		return out, local.Run(ctx, 1, func(ctx context.Context, c comm.Communicator) error {
			m, err := mesh.New(c, []int{1}, []string{"dp"})
			if err != nil {
				return err
			}
			tr, err := gpt.NewTrainer(ctx, m, ppResumeCfg, gpt.WithRun(run), gpt.WithModel(gpt.WithParams(init)), gpt.WithRandomTokens(11))
			if err != nil {
				return err
			}
			err = resume(ctx, tr.Parts(), tr.Steps, func(i int) error {
				_, loss, err := tr.Step(ctx)
				out.Losses[i] = math.Float64bits(loss)
				return err
			})
			if err != nil {
				return err
			}
			full, err := tr.Full(ctx)
			keep(full)
			return err
		})
	}
	var s *pp.Schedule
	ranks := 1
	if l.pp > 0 {
		var err error
		if s, err = pp.Build(l.schedule, l.pp, l.m, l.v); err != nil {
			return nil, err
		}
		ranks = l.pp
	}
	return out, local.Run(ctx, ranks, func(ctx context.Context, c comm.Communicator) error {
		m, err := mesh.New(c, []int{ranks, 1}, []string{"pp", "dp"})
		if err != nil {
			return err
		}
		data, err := gpt.NewBatchSource(ppResumeCfg, gpt.WithRun(run), gpt.WithRandomTokens(11))
		if err != nil {
			return err
		}
		tape := autograd.NewTape()
		var (
			stages []*gpt.Stage
			params []*autograd.Value
			cur    tinygpt.Batch
			tr     *pp.Transport
			sm     = m
		)
		inputs := func(lo, hi int) (x, y *autograd.Indices, err error) {
			T := cur.T
			shape := []int{hi - lo, T}
			r := []placement.Placement{placement.Replicate(), placement.Replicate()}
			if sm != m {
				r = r[:1]
			}
			if x, err = autograd.IndicesFromFull(sm, shape, r, cur.X[lo*T:hi*T]); err != nil {
				return nil, nil, err
			}
			y, err = autograd.IndicesFromFull(sm, shape, r, cur.Y[lo*T:hi*T])
			return x, y, err
		}
		var fwd func(ctx context.Context) (float64, error)
		if s == nil {
			st, err := gpt.NewStage(tape, m, ppResumeCfg, 0, ppResumeCfg.Layers, init)
			if err != nil {
				return err
			}
			stages, params = []*gpt.Stage{st}, st.Params()
			fwd = func(ctx context.Context) (float64, error) {
				x, y, err := inputs(0, cur.B)
				if err != nil {
					return 0, err
				}
				loss, err := st.Forward(ctx, nil, x, y, 1)
				if err != nil {
					return 0, err
				}
				l, _ := gpt.Loss(loss)
				if err := tape.Backward(ctx, loss); err != nil {
					return 0, err
				}
				return l, sumTiedLocal(st)
			}
		} else {
			if tr, err = pp.NewTransport(ctx, m, "pp"); err != nil {
				return err
			}
			sm = tr.Mesh()
			rows, err := pp.MicroBatches(run.B, s.MicroBatches)
			if err != nil {
				return err
			}
			funcs := map[int]pp.StageFunc{}
			S := s.Stages()
			for _, k := range s.StagesOf(tr.Rank()) {
				st, err := gpt.NewStage(tape, sm, ppResumeCfg, k*ppResumeCfg.Layers/S, (k+1)*ppResumeCfg.Layers/S, init)
				if err != nil {
					return err
				}
				stages, params = append(stages, st), append(params, st.Params()...)
				funcs[k] = func(ctx context.Context, mb int, h *autograd.Value) (*autograd.Value, error) {
					rg := rows[mb]
					x, y, err := inputs(rg.Lo, rg.Hi)
					if err != nil {
						return nil, err
					}
					return st.Forward(ctx, h, x, y, rg.Weight)
				}
			}
			rt, err := pp.NewRuntime(s, tape, tr, funcs)
			if err != nil {
				return err
			}
			ppc, err := m.Comm(ctx, "pp")
			if err != nil {
				return err
			}
			fwd = func(ctx context.Context) (float64, error) {
				st, err := rt.Step(ctx)
				if err != nil {
					return 0, err
				}
				if l.tied {
					if err := sumTied(ctx, s, tr, params); err != nil {
						return 0, err
					}
				}
				v := []float64{0}
				if !math.IsNaN(st.Loss) {
					v[0] = st.Loss
				}
				err = comm.AllReduce(ctx, ppc, comm.Host(v), comm.Host(v), comm.Sum)
				return v[0], err
			}
		}
		opt, err := optim.NewAdamW(params, optim.WithLR(run.LR), optim.WithWeightDecay(run.WD), optim.WithBetas(run.Beta1, run.Beta2), optim.WithEps(run.Eps))
		if err != nil {
			return err
		}
		var popts []gpt.PartsOption
		if l.tied {
			popts = append(popts, gpt.WithTiedHead())
		}
		parts, err := gpt.PipelineParts(stages, opt, data, popts...)
		if err != nil {
			return err
		}
		err = resume(ctx, parts, data.Steps, func(i int) error {
			if cur, err = data.Next(); err != nil {
				return err
			}
			loss, err := fwd(ctx)
			if err != nil {
				return err
			}
			if c.Rank() == 0 {
				out.Losses[i] = math.Float64bits(loss)
			}
			if err := opt.Step(); err != nil {
				return err
			}
			for _, p := range params {
				p.ZeroGrad()
			}
			return nil
		})
		if err != nil {
			return err
		}
		full := map[string][]float32{}
		for _, p := range params {
			f, err := p.Data().Full(ctx)
			if err != nil {
				return err
			}
			full[p.Name()] = f.([]float32)
		}
		keep(full)
		return nil
	})
}

// sumTied sums the tied copies' gradients between the first and the last
// stage's ranks (pp.SumTied), the embedding's first.
func sumTied(ctx context.Context, s *pp.Schedule, tr *pp.Transport, params []*autograd.Value) error {
	first, last := s.RankOf(0), s.RankOf(s.Stages()-1)
	for _, p := range params {
		var err error
		switch {
		case p.Name() == tinygpt.ParamWTE && tr.Rank() == first:
			err = pp.SumTied(ctx, tr, p, last)
		case p.Name() == tinygpt.ParamLMHead && tr.Rank() == last:
			err = pp.SumTied(ctx, tr, p, first)
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// sumTiedLocal gives a whole-model stage's tied copies the sum of their
// gradients, the embedding's first, as pp.SumTied does across ranks.
func sumTiedLocal(st *gpt.Stage) error {
	var wte, head *autograd.Value
	for _, p := range st.Params() {
		switch p.Name() {
		case tinygpt.ParamWTE:
			wte = p
		case tinygpt.ParamLMHead:
			head = p
		}
	}
	a, b := wte.Grad().LocalData().([]float32), head.Grad().LocalData().([]float32)
	sum := make([]float32, len(a))
	for i := range a {
		sum[i] = a[i] + b[i]
	}
	g, err := placement.NewLocal(wte.Grad().Spec(), sum)
	if err != nil {
		return err
	}
	return errors.Join(wte.SetGrad(g), head.SetGrad(g))
}

// TestResumePipeline: 20 steps straight equal 10 steps, a save, a new
// model that loads and 10 more steps, bitwise on the same pipeline
// (1F1B, interleaved, a tied head) and within 2e-5 when the split changes
// between save and load: pp=2 → one rank, one rank → pp=2, pp=2 1F1B →
// pp=4 interleaved with two stages per rank (stages of 4 blocks saved,
// stages of 1 loaded), and a tied head from pp=2 to one rank and back.
func TestResumePipeline(t *testing.T) {
	const half = 10
	p2 := ppResume{pp: 2, schedule: "1f1b", m: 4}
	p4i := ppResume{pp: 4, schedule: "interleaved", m: 4, v: 2}
	one := ppResume{}
	p2t, onet := p2, one
	p2t.tied, onet.tied = true, true
	cases := []struct{ save, load ppResume }{
		{p2, p2},
		{p4i, p4i},
		{p2t, p2t},
		{p2, one},
		{one, p2},
		{p2, p4i},
		{p2t, onet},
		{onet, p2t},
	}
	for _, c := range cases {
		t.Run(c.save.String()+"→"+c.load.String(), func(t *testing.T) {
			straight, err := ppResumeTrain(c.save, "", "", 2*half)
			if err != nil {
				t.Fatal(err)
			}
			root := t.TempDir()
			first, err := ppResumeTrain(c.save, "", root, half)
			if err != nil {
				t.Fatal(err)
			}
			dir, err := checkpoint.Latest(root)
			if err != nil {
				t.Fatal(err)
			}
			second, err := ppResumeTrain(c.load, dir, "", half)
			if err != nil {
				t.Fatal(err)
			}
			resumed := &resumeRun{Losses: append(first.Losses, second.Losses...), Params: second.Params}
			comparePP(t, straight, resumed, c.save == c.load)
		})
	}
}

// comparePP compares a resumed run with the straight one: bit for bit
// when exact, else within the pipeline parity tolerance, 2e-5.
func comparePP(t *testing.T, want, got *resumeRun, exact bool) {
	t.Helper()
	const tol = 2e-5
	for i := range want.Losses {
		w, g := math.Float64frombits(want.Losses[i]), math.Float64frombits(got.Losses[i])
		if exact && want.Losses[i] != got.Losses[i] || !(math.Abs(w-g) <= tol) {
			t.Errorf("step %d: loss %.9g resumed, %.9g straight", i+1, g, w)
		}
	}
	if len(got.Params) != len(want.Params) {
		t.Fatalf("%d parameters, want %d", len(got.Params), len(want.Params))
	}
	for n, wb := range want.Params {
		if exact {
			if !slices.Equal(got.Params[n], wb) {
				t.Errorf("%s: not the same bits after resuming", n)
			}
			continue
		}
		g, w := f32frombits(got.Params[n]), f32frombits(wb)
		a := maxAbs(g, w)
		if strings.HasSuffix(n, tinygpt.BlockQKVB) {
			// q and v parts only: the k part's gradient is zero up to
			// rounding (softmax ignores a key bias), which AdamW scales to
			// steps of the learning rate's size (as compareRuns).
			d := len(w) / 3
			a = max(maxAbs(g[:d], w[:d]), maxAbs(g[2*d:], w[2*d:]))
		}
		if !(a <= tol) {
			t.Errorf("%s: max |Δ| %.3g, limit %g", n, a, tol)
		}
	}
}

// A tied head is saved once: a pipeline's checkpoint holds wte and its
// moments, written by the first stage's rank, and no tensor of lm_head;
// an untied pipeline refuses it, naming the head.
func TestResumePipelineTiedSavedOnce(t *testing.T) {
	root := t.TempDir()
	if _, err := ppResumeTrain(ppResume{pp: 2, schedule: "1f1b", m: 4, tied: true}, "", root, 1); err != nil {
		t.Fatal(err)
	}
	dir, err := checkpoint.Latest(root)
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(filepath.Join(dir, "manifest.json"))
	if err != nil {
		t.Fatal(err)
	}
	var doc struct {
		Manifest struct {
			Tensors map[string]struct {
				Chunks []struct{ File string }
			}
		}
	}
	if err := json.Unmarshal(b, &doc); err != nil {
		t.Fatal(err)
	}
	for n := range doc.Manifest.Tensors {
		if strings.Contains(n, tinygpt.ParamLMHead) {
			t.Errorf("the checkpoint holds %s", n)
		}
	}
	for _, n := range []string{"model." + tinygpt.ParamWTE, "optim." + tinygpt.ParamWTE + ".exp_avg", "optim." + tinygpt.ParamWTE + ".exp_avg_sq"} {
		x, ok := doc.Manifest.Tensors[n]
		if !ok || len(x.Chunks) != 1 || x.Chunks[0].File != "rank-00000.safetensors" {
			t.Errorf("%s: %+v, want one chunk in the first stage's rank-00000.safetensors", n, x)
		}
	}
	_, err = ppResumeTrain(ppResume{pp: 2, schedule: "1f1b", m: 4}, dir, "", 1)
	if !errors.Is(err, checkpoint.ErrInvalid) || !strings.Contains(err.Error(), `"model.lm_head.weight"`) {
		t.Errorf("an untied pipeline loading a tied checkpoint: %v, want ErrInvalid naming model.lm_head.weight", err)
	}
}

// cpResumeTrain trains steps steps of a GPT on a token file (gpt.WithWindows)
// with context parallelism over cp ranks (load balanced; cp 1 is one rank
// without it), loading dir first when set and saving into root after the
// last step when set, and returns rank 0's losses and the final parameters.
func cpResumeTrain(text string, cpN int, dir, root string, steps int) (*resumeRun, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	// T = 12: balanced shards of 2·cp chunks for cp = 2 and 3.
	cfg := gpt.Config{Vocab: 128, Width: 24, Heads: 6, Layers: 2, MLPWidth: 48, SeqLen: 12, InitStd: 0.2, LNEps: 1e-5}
	run := tinygpt.Default()
	run.B = 4
	init := gpt.RandomInit(cfg, 7)
	out := &resumeRun{Params: map[string][]uint32{}}
	var mu sync.Mutex
	err := local.Run(ctx, cpN, func(ctx context.Context, c comm.Communicator) error {
		m, err := mesh.New(c, []int{cpN}, []string{"cp"})
		if err != nil {
			return err
		}
		f, err := train.OpenTokens(text, cfg.Vocab)
		if err != nil {
			return err
		}
		defer f.Close()
		w, err := train.NewWindows(f, cfg.SeqLen, m)
		if err != nil {
			return err
		}
		opts := []gpt.TrainOption{gpt.WithRun(run), gpt.WithModel(gpt.WithParams(init)), gpt.WithWindows(w, train.WithShuffle(5))}
		if cpN > 1 {
			opts = append(opts, gpt.WithContextParallel("cp"))
		}
		tr, err := gpt.NewTrainer(ctx, m, cfg, opts...)
		if err != nil {
			return err
		}
		if dir != "" {
			s, _, err := checkpoint.LoadJob(ctx, dir, tr.Parts())
			if err != nil {
				return err
			}
			if s != tr.Steps() {
				return fmt.Errorf("LoadJob's step %d, the trainer's %d", s, tr.Steps())
			}
		}
		var losses []uint64
		for range steps {
			_, l, err := tr.Step(ctx)
			if err != nil {
				return err
			}
			losses = append(losses, math.Float64bits(l))
		}
		if root != "" {
			st, err := checkpoint.JobState(tr.Steps(), tr.Parts(), nil)
			if err != nil {
				return err
			}
			if _, err := checkpoint.Save(ctx, root, st, checkpoint.WithStep(tr.Steps())); err != nil {
				return err
			}
		}
		full, err := tr.Full(ctx)
		if err != nil || c.Rank() != 0 {
			return err
		}
		mu.Lock()
		defer mu.Unlock()
		out.Losses = losses
		out.setParams(full)
		return nil
	})
	return out, err
}

// TestResumeContextParallel: a context-parallel run (cp=2, the sequence
// load balanced) on a token file, shuffled, resumes exactly: 20 steps
// straight equal 10, a save, a new trainer that loads and 10 more, bit
// for bit on cp=2 and within the layout tolerances (compareRuns) on one
// rank and on cp=3, the data's position included (a wrong one trains on
// other windows, off by far more).
func TestResumeContextParallel(t *testing.T) {
	const half = 10
	text := filepath.Join(t.TempDir(), "text.txt")
	var sb strings.Builder
	for i := range 400 {
		fmt.Fprintf(&sb, "line %d: to be or not to be, %d times. ", i, i*i%97)
	}
	if err := os.WriteFile(text, []byte(sb.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	straight, err := cpResumeTrain(text, 2, "", "", 2*half)
	if err != nil {
		t.Fatal(err)
	}
	root := t.TempDir()
	first, err := cpResumeTrain(text, 2, "", root, half)
	if err != nil {
		t.Fatal(err)
	}
	dir, err := checkpoint.Latest(root)
	if err != nil {
		t.Fatal(err)
	}
	for _, cpN := range []int{2, 1, 3} {
		t.Run(fmt.Sprintf("cp=2→cp=%d", cpN), func(t *testing.T) {
			second, err := cpResumeTrain(text, cpN, dir, "", half)
			if err != nil {
				t.Fatal(err)
			}
			resumed := &resumeRun{Losses: append(slices.Clone(first.Losses), second.Losses...), Params: second.Params}
			compareRuns(t, straight, resumed, cpN == 2)
		})
	}
}
