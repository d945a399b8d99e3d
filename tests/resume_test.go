package tests

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/b7ea7098/loom/checkpoint"
	"github.com/b7ea7098/loom/device/emu"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/models/gpt"
	"github.com/b7ea7098/loom/models/moegpt"
	"github.com/b7ea7098/loom/parallel/fsdp"
	"github.com/b7ea7098/loom/placement/placementtest"
	"github.com/b7ea7098/loom/reference/tinygpt"
)

// Resuming from a checkpoint. A run of 20 steps is compared with one of
// 10 steps that saves (checkpoint.JobState of the trainer's Parts), and a
// new process (this test binary, re-executed with TestResumeChild) that
// loads the checkpoint (checkpoint.LoadJob) on a layout of its own and
// trains 10 more steps: on the same layout the losses and the final
// parameters are the same bits; on another they are within the layout
// tests' tolerances (TestParallelLayoutsMatchOneRank: loss 1e-4,
// parameters 2e-3 max-abs and 1e-3 relative L2), since only float32
// summation orders differ.

// resumeEnv carries a child's job to TestResumeChild.
const resumeEnv = "LOOM_RESUME_CHILD"

// resumeLayout is a job's layout: a GPT on dp × fsdp × tp (ZeRO stage
// zero with fsdp > 1), or with ep > 0 the MoE GPT on ep ranks.
type resumeLayout struct {
	DP, FSDP, TP, Zero, EP int
	SP                     bool // sequence parallelism on the tp axis
	Emu                    bool // on an emulated device per rank
}

func (l resumeLayout) String() string {
	s := fmt.Sprintf("dp=%d×tp=%d", l.DP, l.TP)
	switch {
	case l.EP > 0:
		s = fmt.Sprintf("moe ep=%d", l.EP)
	case l.FSDP > 1:
		s = fmt.Sprintf("dp=%d×fsdp=%d×tp=%d ZeRO-%d", l.DP, l.FSDP, l.TP, l.Zero)
	}
	if l.SP {
		s += " sp"
	}
	if l.Emu {
		s += " emu"
	}
	return s
}

// device opens rank's emulated device when l asks for one (nil
// otherwise); close it after the trainer.
func (l resumeLayout) device(rank int) (*emu.Device, error) {
	if !l.Emu {
		return nil, nil
	}
	return emu.New(rank)
}

// resumeChild is what the parent asks a child process to do.
type resumeChild struct {
	Layout resumeLayout
	Dir    string // the checkpoint to load
	Steps  int
	Out    string // where to write the resumeRun as JSON
}

// resumeRun is a run's losses and final parameters, as float bits.
type resumeRun struct {
	Losses []uint64
	Params map[string][]uint32
}

// setParams records full (the final parameters by name) as float bits.
func (r *resumeRun) setParams(full map[string][]float32) {
	for n, v := range full {
		bits := make([]uint32, len(v))
		for i, x := range v {
			bits[i] = math.Float32bits(x)
		}
		r.Params[n] = bits
	}
}

// resumeGPT is the GPT the resume tests train: 6 heads, so that tp may be
// 2 or 3; a batch of 12, which dp × fsdp of 1, 2, 3, 4 or 6 divides.
func resumeGPT() (gpt.Config, tinygpt.Config) {
	run := tinygpt.Default()
	run.B = 12
	cfg := gpt.Config{Vocab: 128, Width: 24, Heads: 6, Layers: 2, MLPWidth: 48, SeqLen: 8, InitStd: 0.2, LNEps: 1e-5}
	return cfg, run
}

// resumeMoE is the MoE GPT the resume tests train: 4 experts, so that ep
// may be 2 or 4.
func resumeMoE() (moegpt.Config, tinygpt.Config) {
	run := tinygpt.Default()
	run.B = 8
	cfg := moegpt.Default()
	cfg.V, cfg.D, cfg.H, cfg.L, cfg.T, cfg.E, cfg.K, cfg.Hd = 128, 16, 2, 2, 8, 4, 2, 16
	return cfg, run
}

// resumeTrainer is one rank's trainer of either model.
type resumeTrainer interface {
	step(ctx context.Context) (float64, error)
	Parts() checkpoint.Parts
	Steps() int
	Full(ctx context.Context) (map[string][]float32, error)
}

type resGPT struct{ *gpt.Trainer }

func (g resGPT) step(ctx context.Context) (float64, error) {
	_, l, err := g.Step(ctx)
	return l, err
}

type resMoE struct{ *moegpt.Trainer }

func (g resMoE) step(ctx context.Context) (float64, error) {
	r, err := g.Step(ctx)
	if err != nil {
		return 0, err
	}
	return r.Loss, nil
}

// inLayout runs fn on every rank of l's mesh (in-process ranks) with a
// new trainer from the same random init.
func inLayout(l resumeLayout, fn func(ctx context.Context, rank int, tr resumeTrainer) error) error {
	return inLayoutWidth(l, 0, fn)
}

// inLayoutWidth is inLayout with the GPT's width changed (0: unchanged).
func inLayoutWidth(l resumeLayout, width int, fn func(ctx context.Context, rank int, tr resumeTrainer) error) error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	if l.EP > 0 {
		cfg, run := resumeMoE()
		init := moegpt.RandomInit(cfg, 7)
		return placementtest.Simulate(ctx, []int{l.EP}, []string{"ep"}, func(ctx context.Context, m *mesh.Mesh) error {
			opts := []moegpt.TrainOption{moegpt.WithRun(run), moegpt.WithRandomTokens(11)}
			d, err := l.device(m.Rank())
			if err != nil {
				return err
			}
			if d != nil {
				defer d.Close()
				opts = append(opts, moegpt.WithDevice(d))
			}
			tr, err := moegpt.NewTrainer(ctx, m, cfg, init, "ep", opts...)
			if err != nil {
				return err
			}
			return fn(ctx, m.Rank(), resMoE{tr})
		})
	}
	cfg, run := resumeGPT()
	if width > 0 {
		cfg.Width = width
	}
	init := gpt.RandomInit(cfg, 7)
	return placementtest.Simulate(ctx, []int{l.DP, l.FSDP, l.TP}, []string{"dp", "fsdp", "tp"}, func(ctx context.Context, m *mesh.Mesh) error {
		opts := []gpt.TrainOption{gpt.WithRun(run), gpt.WithModel(gpt.WithParams(init)), gpt.WithRandomTokens(11),
			gpt.WithDataParallel("dp"), gpt.WithTensorParallel("tp")}
		if l.FSDP > 1 {
			opts = append(opts, gpt.WithFullyShard("fsdp", fsdp.WithZeROStage(l.Zero)))
		}
		if l.SP {
			opts = append(opts, gpt.WithSequenceParallel())
		}
		d, err := l.device(m.Rank())
		if err != nil {
			return err
		}
		if d != nil {
			defer d.Close()
			opts = append(opts, gpt.WithDevice(d))
		}
		tr, err := gpt.NewTrainer(ctx, m, cfg, opts...)
		if err != nil {
			return err
		}
		return fn(ctx, m.Rank(), resGPT{tr})
	})
}

// train runs steps steps on l, saving a checkpoint into root after the
// last when root is set (and resuming from dir first when dir is set),
// and returns rank 0's losses and the final parameters.
func resumeTrain(l resumeLayout, dir, root string, steps int) (*resumeRun, error) {
	var (
		mu  sync.Mutex
		out = &resumeRun{Params: map[string][]uint32{}}
	)
	err := inLayout(l, func(ctx context.Context, rank int, tr resumeTrainer) error {
		if dir != "" {
			step, _, err := checkpoint.LoadJob(ctx, dir, tr.Parts())
			if err != nil {
				return err
			}
			if step != tr.Steps() {
				return fmt.Errorf("LoadJob's step %d, the trainer's %d", step, tr.Steps())
			}
		}
		var losses []uint64
		for range steps {
			l, err := tr.step(ctx)
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
		if err != nil || rank != 0 {
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

// TestResumeChild is the child process of the resume tests: it does
// nothing unless LOOM_RESUME_CHILD holds a job.
func TestResumeChild(t *testing.T) {
	job := os.Getenv(resumeEnv)
	if job == "" {
		return
	}
	var c resumeChild
	if err := json.Unmarshal([]byte(job), &c); err != nil {
		t.Fatal(err)
	}
	got, err := resumeTrain(c.Layout, c.Dir, "", c.Steps)
	if err != nil {
		t.Fatal(err)
	}
	b, err := json.Marshal(got)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(c.Out, b, 0o644); err != nil {
		t.Fatal(err)
	}
}

// inChild runs resumeTrain(l, dir, "", steps) in a new process of this
// test binary and returns its result.
func inChild(t *testing.T, l resumeLayout, dir string, steps int) (*resumeRun, error) {
	t.Helper()
	out := filepath.Join(t.TempDir(), "child.json")
	job, err := json.Marshal(resumeChild{Layout: l, Dir: dir, Steps: steps, Out: out})
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^TestResumeChild$", "-test.count=1")
	cmd.Env = append(os.Environ(), resumeEnv+"="+string(job))
	if b, err := cmd.CombinedOutput(); err != nil {
		return nil, fmt.Errorf("child process: %w\n%s", err, b)
	}
	b, err := os.ReadFile(out)
	if err != nil {
		return nil, err
	}
	var r resumeRun
	return &r, json.Unmarshal(b, &r)
}

// TestResumeExact: 20 steps straight equal 10 steps, a save, and 10
// steps in a new process that loads the checkpoint, bit for bit on the
// same layout (losses and final parameters) and within the layout
// tolerances when the layout changes.
func TestResumeExact(t *testing.T) {
	const half = 10
	cases := []struct {
		save, load resumeLayout
	}{
		{resumeLayout{DP: 1, FSDP: 1, TP: 1}, resumeLayout{DP: 1, FSDP: 1, TP: 1}},
		{resumeLayout{DP: 2, FSDP: 1, TP: 2}, resumeLayout{DP: 2, FSDP: 1, TP: 2}},
		{resumeLayout{DP: 1, FSDP: 2, TP: 1, Zero: 3}, resumeLayout{DP: 1, FSDP: 2, TP: 1, Zero: 3}},
		{resumeLayout{EP: 2}, resumeLayout{EP: 2}},
		{resumeLayout{DP: 2, FSDP: 1, TP: 2}, resumeLayout{DP: 1, FSDP: 1, TP: 1}},
		{resumeLayout{DP: 1, FSDP: 1, TP: 1}, resumeLayout{DP: 1, FSDP: 3, TP: 1, Zero: 3}},
		{resumeLayout{DP: 1, FSDP: 1, TP: 2}, resumeLayout{DP: 1, FSDP: 1, TP: 3}},
		{resumeLayout{DP: 1, FSDP: 2, TP: 1, Zero: 1}, resumeLayout{DP: 1, FSDP: 2, TP: 1, Zero: 3}},
		{resumeLayout{EP: 2}, resumeLayout{EP: 4}},
		// The fused attention projection changes form ([3D, …] and [3, D, …]).
		{resumeLayout{DP: 1, FSDP: 3, TP: 1, Zero: 3}, resumeLayout{DP: 2, FSDP: 1, TP: 2}},
		// Sequence parallelism.
		{resumeLayout{DP: 1, FSDP: 1, TP: 2, SP: true}, resumeLayout{DP: 3, FSDP: 1, TP: 2}},
		// HSDP.
		{resumeLayout{DP: 2, FSDP: 2, TP: 1, Zero: 3}, resumeLayout{DP: 1, FSDP: 1, TP: 2}},
		// From the host to emulated devices.
		{resumeLayout{DP: 2, FSDP: 1, TP: 2}, resumeLayout{DP: 2, FSDP: 1, TP: 2, Emu: true}},
		{resumeLayout{DP: 1, FSDP: 1, TP: 2}, resumeLayout{DP: 1, FSDP: 2, TP: 1, Zero: 3, Emu: true}},
		{resumeLayout{EP: 2}, resumeLayout{EP: 4, Emu: true}},
		// From emulated devices to the host.
		{resumeLayout{DP: 1, FSDP: 2, TP: 1, Zero: 2, Emu: true}, resumeLayout{DP: 1, FSDP: 1, TP: 1}},
	}
	for _, c := range cases {
		t.Run(c.save.String()+"→"+c.load.String(), func(t *testing.T) {
			straight, err := resumeTrain(c.save, "", "", 2*half)
			if err != nil {
				t.Fatal(err)
			}
			root := t.TempDir()
			first, err := resumeTrain(c.save, "", root, half)
			if err != nil {
				t.Fatal(err)
			}
			dir, err := checkpoint.Latest(root)
			if err != nil {
				t.Fatal(err)
			}
			second, err := inChild(t, c.load, dir, half)
			if err != nil {
				t.Fatal(err)
			}
			resumed := &resumeRun{Losses: append(first.Losses, second.Losses...), Params: second.Params}
			same := c.save
			same.Emu = c.load.Emu // the emulated device computes the host's bits
			compareRuns(t, straight, resumed, same == c.load)
		})
	}
}

// compareRuns compares a resumed run with the straight one: bit for bit
// when exact, else within the layout tolerances.
func compareRuns(t *testing.T, want, got *resumeRun, exact bool) {
	t.Helper()
	if len(got.Losses) != len(want.Losses) {
		t.Fatalf("%d losses, want %d", len(got.Losses), len(want.Losses))
	}
	for i := range want.Losses {
		w, g := math.Float64frombits(want.Losses[i]), math.Float64frombits(got.Losses[i])
		if exact && want.Losses[i] != got.Losses[i] || !(math.Abs(w-g) <= 1e-4) {
			t.Errorf("step %d: loss %.9g resumed, %.9g straight", i+1, g, w)
		}
	}
	if names, wantNames := slices.Sorted(maps.Keys(got.Params)), slices.Sorted(maps.Keys(want.Params)); !slices.Equal(names, wantNames) {
		t.Fatalf("parameters %v, want %v", names, wantNames)
	}
	for n, wb := range want.Params {
		g, w := f32frombits(got.Params[n]), f32frombits(wb)
		if exact {
			if !slices.Equal(got.Params[n], wb) {
				t.Errorf("%s: not the same bits after resuming", n)
			}
			continue
		}
		a := maxAbs(g, w)
		r := relL2(g, w)
		if strings.HasSuffix(n, tinygpt.BlockQKVB) {
			// q and v parts only; the k part is rounding noise (see
			// TestParallelLayoutsMatchOneRank).
			d := len(w) / 3
			r = max(relL2(g[:d], w[:d]), relL2(g[2*d:], w[2*d:]))
		}
		if !(a <= 2e-3 && r <= 1e-3) {
			t.Errorf("%s: max |Δ| %.3g (limit 2e-3), relative L2 %.3g (limit 1e-3)", n, a, r)
		}
	}
}

// f32frombits converts float32 bits back.
func f32frombits(bits []uint32) []float32 {
	out := make([]float32, len(bits))
	for i, b := range bits {
		out[i] = math.Float32frombits(b)
	}
	return out
}

// Loading a checkpoint of another job is refused with a clear error
// before anything is written into the trainer: another model (the MoE
// GPT's tensors), other shapes (a wider GPT), a job without the data's
// position (a missing entry).
func TestResumeRefuses(t *testing.T) {
	root := t.TempDir()
	if _, err := resumeTrain(resumeLayout{DP: 1, FSDP: 1, TP: 2}, "", root, 2); err != nil {
		t.Fatal(err)
	}
	dir, err := checkpoint.Latest(root)
	if err != nil {
		t.Fatal(err)
	}
	partial := t.TempDir()
	err = inLayout(resumeLayout{DP: 1, FSDP: 1, TP: 1}, func(ctx context.Context, rank int, tr resumeTrainer) error {
		parts := tr.Parts()
		delete(parts, "data")
		st, err := checkpoint.JobState(0, parts, nil)
		if err != nil {
			return err
		}
		_, err = checkpoint.Save(ctx, partial, st)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	partialDir, err := checkpoint.Latest(partial)
	if err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name   string
		layout resumeLayout
		dir    string
		width  int
		naming string
	}{
		{"the MoE GPT from a GPT's checkpoint", resumeLayout{EP: 2}, dir, 0, `tensor "model.`},
		{"a wider GPT", resumeLayout{DP: 1, FSDP: 1, TP: 1}, dir, 48, "shape"},
		{"a job without the data's position", resumeLayout{DP: 1, FSDP: 1, TP: 1}, partialDir, 0, `"data.step"`},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			err := inLayoutWidth(c.layout, c.width, func(ctx context.Context, rank int, tr resumeTrainer) error {
				before, err := tr.Full(ctx)
				if err != nil {
					return err
				}
				_, _, lerr := checkpoint.LoadJob(ctx, c.dir, tr.Parts())
				if !errors.Is(lerr, checkpoint.ErrInvalid) || !strings.Contains(lerr.Error(), c.naming) {
					return fmt.Errorf("LoadJob: %v, want ErrInvalid naming %s", lerr, c.naming)
				}
				after, err := tr.Full(ctx)
				if err != nil {
					return err
				}
				for n, v := range before {
					if !slices.Equal(v, after[n]) {
						return fmt.Errorf("the refused load changed %s", n)
					}
				}
				return nil
			})
			if err != nil {
				t.Fatal(err)
			}
		})
	}
}

// A sharded job's state is saved as its shards, never gathered: after
// ZeRO-3 on fsdp=3 every parameter and both its AdamW moments are chunks
// written by the ranks that hold them (read from the manifest, which is
// JSON any reader parses): no chunk is the whole of a tensor that has
// more than one row, and every rank's file holds some of each.
func TestResumeSavesShards(t *testing.T) {
	root := t.TempDir()
	if _, err := resumeTrain(resumeLayout{DP: 1, FSDP: 3, TP: 1, Zero: 3}, "", root, 1); err != nil {
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
				Shape  []int
				Chunks []struct {
					Size []int
					File string
				}
			}
		}
	}
	if err := json.Unmarshal(b, &doc); err != nil {
		t.Fatal(err)
	}
	n := 0
	for name, x := range doc.Manifest.Tensors {
		if x.Shape[0] < 3 {
			continue // too few rows to shard over 3 ranks
		}
		n++
		files := map[string]bool{}
		for _, c := range x.Chunks {
			files[c.File] = true
			if slices.Equal(c.Size, x.Shape) {
				t.Errorf("%s: a chunk holds the whole tensor %v", name, x.Shape)
			}
		}
		if len(files) != 3 {
			t.Errorf("%s: chunks in %d files, want one per rank (3)", name, len(files))
		}
	}
	if n < 3*10 {
		t.Errorf("%d sharded tensors checked; want the parameters and both moments of each", n)
	}
}
