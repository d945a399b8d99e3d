// Command moe trains a small byte-level transformer whose MLPs are
// mixture-of-experts layers with expert parallelism (EP): dp × ep ranks,
// goroutines of one process exchanging data through shared memory, or one
// process per rank under mpirun (built with -tags mpi), loomrun or
// torchrun (package launch; -backend local|mpi|nccl|tcp overrides),
// the batch rows sharded over both axes, every MoE layer's experts
// sharded over ep (each rank owns E/ep of them), and the token copies
// moved to their experts and back: pulled straight from the peers'
// memory, since the ranks share one address space (moe's fused path),
// or with -collectives by one all-to-all-v each way, as across processes
// (where it is the only way).
// Attention, embedding, norm and router weights are replicated; their
// gradients are all-reduced over ep by DDP (overlapping backward) and
// over dp, the experts' over dp. The model is models/moegpt, trained
// with AdamW from a random init drawn from -seed: by default its tiny
// preset (D=64, H=4, L=2, E=8 experts of width 128, top-2, 16 sequences
// of 64 bytes of the tiny GPT's corpus). -model picks another preset
// (moegpt.Preset: gpt2-small, gpt2-medium: GPT-2's attention with 8
// experts of width 4·D, V=50304, T=1024, 8 sequences), and -layers,
// -width, -heads, -ff (each expert's width), -seq, -vocab and -batch
// (the global batch in sequences) override its fields; any shape or batch
// but the tiny preset's trains on random tokens drawn from -seed (the
// same global batches on every layout), a throughput run, which the first
// line says.
//
// Usage:
//
//	go run ./examples/moe [-dp 1] [-ep 4] [-steps 100] [-every 10]
//	                      [-model tiny|gpt2-small|gpt2-medium] [-layers L] [-width D]
//	                      [-heads H] [-ff F] [-seq T] [-vocab V] [-batch B] [-seed 1]
//	                      [-capacity 0] [-diag] [-experts 8] [-topk 2]
//	                      [-trace trace.json] [-json run.json] [-compare]
//	                      [-collectives] [-backend local|mpi|nccl|tcp] [-peak TFLOP/s]
//	                      [-device cpu|emu|cuda] [-mp bf16] [-tf32]
//
// -device says where the ranks compute (the second line names it; -json's
// "device"): cpu, the host (the default); emu, an emulated device per
// rank (device/emu: the device code path, with the host's CPU kernels, so
// the host's losses bit for bit; in-process or mpi ranks); cuda, the GPUs,
// which needs launch to hand each rank the GPU device it opens for NCCL
// (under loomrun or torchrun). -mp bf16 computes the matrix products (the
// experts' included) in bfloat16 with float32 accumulation (autocast);
// -tf32 lets cuBLAS use TF32 for float32 GEMMs (-device cuda). A device
// run prints "GEMM: …" after the steps (-json's "gemm", with
// "device_name").
//
// The final lines give the loss, tokens/s and the MFU: tokens/s times
// the model FLOPs per token (train.FlopsPerToken: PaLM's 6·N + 12·L·D·T,
// N the parameters one token uses, K of the E experts, without the
// embedding tables) over the peak of the job's devices (on cuda the
// GPU's dense peak in the run's precision, train.DevicePeak; on the host
// and emu the estimated peak of the CPUs each host's ranks use; or -peak,
// one device's peak in TFLOP/s); -json has them as "mfu",
// "flops_per_token", "peak_flops", "peak_tflops" and "peak_source".
//
// Every -every steps rank 0 prints the loss (with the load-balancing and
// z-losses), tokens/s, the balance of every layer (largest tokens per
// expert over the mean, and its aux loss), the dropped and padded
// fractions of the token slots, and the MoE time of rank 0 summed over
// the interval and the layers, forward and backward, split into permute
// (the local row moves of dispatch), count exchange, payload exchange
// (the fused passes, or the all-to-all-v's), experts and combine (its
// local row moves; on the fused path permute and combine are part of the
// payload passes).
// -diag adds, for the interval's last step, each layer's send-count
// matrix (rows a rank sends to each rank, within rank 0's ep group),
// its largest row and column, and the tokens per expert; it also puts a
// barrier before the combine and both backward passes and reports the
// time rank 0 waited there as "wait": what imbalance costs, which
// otherwise shows up as payload exchange.
//
// -capacity 0 is dropless routing (the ragged layout, exact counts
// exchanged every layer); a positive value is a capacity factor: every
// expert keeps at most ⌈factor·n·K/E⌉ of a rank's n tokens, and dispatch
// pads every expert's rows to that capacity (the static layout of GShard
// and Megatron's moe_pad_expert_input_to_capacity; -pad=false keeps the
// ragged layout with drops only).
//
// -trace writes a Chrome trace of every rank's compute, collectives and
// waits over the last -trace-steps steps (open it at https://ui.perfetto.dev);
// -json writes the run's summary; -compare also trains on one rank with
// the same init and batches and reports the largest loss and parameter
// differences. Dropless routing picks the same experts on any layout, so
// the runs differ by float32 rounding (about 1e-7 in the loss) until
// rounding flips a near-tie in some token's top-k choice; from then on
// they drift apart, and -compare names the first step whose loss differs
// by more than 1e-5.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"os/signal"
	"strings"
	"time"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/launch"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/models/moegpt"
	"github.com/b7ea7098/loom/moe"
	"github.com/b7ea7098/loom/reference/tinygpt"
	"github.com/b7ea7098/loom/trace"
	"github.com/b7ea7098/loom/train"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	err := run(ctx, os.Args[1:], os.Stdout)
	if errors.Is(err, flag.ErrHelp) { // -h: the usage is printed, nothing failed
		return
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "moe:", err)
		os.Exit(1)
	}
}

type options struct {
	dp, ep      int
	capacity    float64
	pad         bool
	diag        bool
	experts, k  int
	seed        uint64
	compare     bool
	collectives bool
	loop        train.Loop
	run         tinygpt.Config // the batch, corpus and optimizer
	shape       train.ShapeFlags
	// random: random tokens (seed) instead of the tiny GPT's corpus, for
	// a shape or batch other than the tiny preset's.
	random  bool
	persist train.Persist // -data and -checkpoint (resume.go)
	start   int           // the step -resume goes on from
}

// otherBatch is the global batch of the presets other than tiny: the
// sequences of one step of a GPT-2-sized throughput run on one GPU.
const otherBatch = 8

// result is what -json writes.
type result struct {
	Model      string  `json:"model"`
	Params     int     `json:"params"`
	DP         int     `json:"dp"`
	EP         int     `json:"ep"`
	Experts    int     `json:"experts"`
	K          int     `json:"k"`
	Capacity   float64 `json:"capacity_factor"`
	Backend    string  `json:"backend"`
	Device     string  `json:"device"`
	DeviceName string  `json:"device_name"` // world rank 0's: "cuda:0 (NVIDIA H200)", "emu:0", "host"
	GEMM       string  `json:"gemm"`        // what ran the GEMMs, in which precision
	dev        train.DeviceInfo
	Processes  int       `json:"processes"`
	WorldSize  int       `json:"world_size"`
	Steps      int       `json:"steps"`
	TokensPerS float64   `json:"tokens_per_s"`
	FinalLoss  float64   `json:"final_loss"`
	FinalCE    float64   `json:"final_ce"`
	Losses     []float64 `json:"losses"`
	CE         []float64 `json:"ce"`
	Aux        []float64 `json:"aux"`
	// Balance, Dropped and Padded are per step, the worst layer's.
	Balance []float64 `json:"balance"`
	Dropped []float64 `json:"dropped_fraction"`
	Padded  []float64 `json:"padded_fraction"`
	// TimeUS is rank 0's MoE time over the whole run, forward and
	// backward, all layers, in microseconds.
	TimeUS map[string]float64 `json:"moe_time_us"`
	// LossDiff and ParamDiff are -compare's largest differences from the
	// one-rank run.
	LossDiff  *float64 `json:"compare_loss_diff,omitempty"`
	ParamDiff *float64 `json:"compare_param_diff,omitempty"`
	train.MFU
}

// parse reads the flags and checks them and the layout, so that a bad one
// fails once, before any rank starts.
func parse(args []string, errOut io.Writer) (options, moegpt.Config, error) {
	var o options
	fs := flag.NewFlagSet("moe", flag.ContinueOnError)
	fs.SetOutput(errOut)
	fs.IntVar(&o.dp, "dp", 1, "data-parallel ranks (the batch is sharded over dp × ep)")
	fs.IntVar(&o.ep, "ep", 4, "expert-parallel ranks (each owns experts/ep experts)")
	o.loop.RegisterLoop(fs, 100, 10)
	fs.Float64Var(&o.capacity, "capacity", 0, "expert capacity factor (0: dropless)")
	fs.BoolVar(&o.pad, "pad", true, "with -capacity, pad every expert's rows to the capacity (static layout)")
	fs.BoolVar(&o.diag, "diag", false, "also print the send-count matrix and tokens per expert, and time the wait for the slowest rank (a barrier before each later pass)")
	fs.IntVar(&o.experts, "experts", 0, "experts per layer (default 8)")
	fs.IntVar(&o.k, "topk", 0, "experts per token (default 2)")
	fs.Uint64Var(&o.seed, "seed", 1, "seed of the random init")
	fs.BoolVar(&o.compare, "compare", false, "also train on one rank and report the largest differences")
	fs.BoolVar(&o.collectives, "collectives", false, "move the token rows by all-to-all-v (the MPI and NCCL path) instead of straight from the peers' memory")
	o.shape.Register(fs, "tiny", moegpt.Presets())
	o.persist.Register(fs)
	if err := fs.Parse(args); err != nil {
		return o, moegpt.Config{}, err
	}
	if fs.NArg() > 0 {
		return o, moegpt.Config{}, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	switch {
	case o.experts < 0 || o.k < 0:
		return o, moegpt.Config{}, errors.New("-experts and -topk must not be negative")
	case o.capacity < 0 || math.IsNaN(o.capacity) || math.IsInf(o.capacity, 0):
		return o, moegpt.Config{}, errors.New("-capacity must be 0 (dropless) or a positive capacity factor")
	}
	cfg, err := o.model(fs)
	if err != nil {
		return o, moegpt.Config{}, err
	}
	return o, cfg, check(cfg, &o)
}

// model returns the model -model, the flags that override its shape and
// the expert flags ask for (set on fs), and sets o's run: the tiny GPT's,
// with -batch; a shape or batch other than the tiny preset's trains on
// random tokens.
func (o *options) model(fs *flag.FlagSet) (moegpt.Config, error) {
	name, err := o.shape.Preset()
	if err != nil {
		return moegpt.Config{}, err
	}
	cfg, err := moegpt.Preset(name)
	if err != nil {
		return moegpt.Config{}, err
	}
	o.run = tinygpt.Default()
	batch := o.run.B
	if name != "tiny" {
		batch = otherBatch
	}
	sh, err := o.shape.Apply(fs, train.Shape{Layers: cfg.L, Width: cfg.D, Heads: cfg.H, FF: cfg.Hd, Seq: cfg.T, Vocab: cfg.V, Batch: batch})
	if err != nil {
		return moegpt.Config{}, err
	}
	cfg.L, cfg.D, cfg.H, cfg.Hd, cfg.T, cfg.V = sh.Layers, sh.Width, sh.Heads, sh.FF, sh.Seq, sh.Vocab
	o.random = cfg != moegpt.Default() || sh.Batch != o.run.B
	o.run.B = sh.Batch
	return config(o, cfg), nil
}

// check validates cfg, o's run and the layout o asks for and completes
// o's loop.
func check(cfg moegpt.Config, o *options) error {
	o.loop.Ranks = o.dp * o.ep
	o.loop.Shape = []int{o.dp, o.ep}
	o.loop.Tokens = o.run.B * cfg.T
	if err := cfg.Validate(); err != nil {
		return err
	}
	if err := cfg.CheckLayout(o.run.B, o.dp, o.ep); err != nil {
		return err
	}
	return errors.Join(o.loop.Validate(), o.persist.Validate())
}

// config is cfg with the experts, routing and capacity the options ask
// for.
func config(o *options, cfg moegpt.Config) moegpt.Config {
	if o.experts > 0 {
		cfg.E = o.experts
	}
	if o.k > 0 {
		cfg.K = o.k
	}
	cfg.CapacityFactor = o.capacity
	cfg.Pad = o.capacity > 0 && o.pad
	return cfg
}

func run(ctx context.Context, args []string, out io.Writer) error {
	o, cfg, err := parse(args, out)
	if err != nil {
		return err
	}
	return runConfig(ctx, cfg, o, out)
}

// runConfig trains cfg on o's run as o says and reports; tests call it
// with small configurations.
func runConfig(ctx context.Context, cfg moegpt.Config, o options, out io.Writer) error {
	if err := check(cfg, &o); err != nil {
		return err
	}
	routing := "dropless"
	if cfg.CapacityFactor > 0 {
		routing = fmt.Sprintf("capacity factor %g", cfg.CapacityFactor)
		if cfg.Pad {
			routing += ", padded to capacity"
		}
	}
	if err := prepareResume(&o); err != nil {
		return err
	}
	steps := o.loop.Steps
	job, err := o.loop.Flags.Job(o.loop.Ranks)
	if err != nil {
		return fmt.Errorf("-dp %d -ep %d: %w", o.dp, o.ep, err)
	}
	if o.compare && (job.Backend != launch.Local || o.persist.Data != "" || o.persist.Dir != "") {
		return fmt.Errorf("-compare trains on in-process ranks only, from the start, without -data or -checkpoint (this is a %s job)", job.Backend)
	}
	if !job.Root() {
		out = io.Discard // world rank 0 reports for the job
	}
	data := "the tiny GPT's corpus"
	switch {
	case o.persist.Data != "":
		data = fmt.Sprintf("%s (%g held out for validation)", o.persist.Data, o.persist.ValFrac)
	case o.random:
		data = fmt.Sprintf("random tokens (seed %d: a throughput run)", o.seed)
	}
	if o.start > 0 {
		data += fmt.Sprintf(", resumed from step %d", o.start)
	}
	fmt.Fprintf(out, "MoE transformer (V=%d D=%d H=%d L=%d, E=%d experts of width %d, top-%d, %s; %d parameters; batch %d×%d) from a random init (seed %d) on %s, on dp=%d × ep=%d, %s, %d steps\n",
		cfg.V, cfg.D, cfg.H, cfg.L, cfg.E, cfg.Hd, cfg.K, routing, cfg.NumParams(), o.run.B, cfg.T, o.seed, data, o.dp, o.ep, job, steps)
	fmt.Fprintln(out, o.loop.Flags.DeviceLine(o.loop.Ranks))
	init := moegpt.RandomInit(cfg, o.seed)

	res, params, err := trainLayout(ctx, job, cfg, init, o, out)
	if err != nil {
		return err
	}
	fpt, err := train.FlopsPerToken(cfg.ActiveParams(), cfg.L, cfg.D, cfg.T)
	if err != nil {
		return err
	}
	if res.MFU, err = o.loop.RunMFU(job, res.dev, res.TokensPerS, fpt); err != nil {
		return err
	}
	res.Model, res.Params = o.shape.Model, cfg.NumParams()
	fmt.Fprintf(out, "final loss %.6f (cross-entropy %.6f), median %.0f tokens/s\n", res.FinalLoss, res.FinalCE, res.TokensPerS)
	fmt.Fprintln(out, res.MFU)

	if o.compare {
		one := o
		one.dp, one.ep, one.loop.Flags.TracePath = 1, 1, ""
		one.loop.Ranks, one.loop.Shape = 1, []int{1, 1}
		fmt.Fprintf(out, "\n-compare: the same %d steps on one rank\n", steps)
		oneJob, err := launch.InProcess(1)
		if err != nil {
			return err
		}
		ref, refParams, err := trainLayout(ctx, oneJob, cfg, init, one, io.Discard)
		if err != nil {
			return fmt.Errorf("one-rank run: %w", err)
		}
		var dl, dp float64
		apart := 0 // the first step whose losses differ by more than 1e-5
		for i := range res.Losses {
			d := math.Abs(res.Losses[i] - ref.Losses[i])
			dl = max(dl, d)
			if d > 1e-5 && apart == 0 {
				apart = i + 1
			}
		}
		for name, w := range refParams {
			for i, v := range params[name] {
				dp = max(dp, math.Abs(float64(v)-float64(w[i])))
			}
		}
		res.LossDiff, res.ParamDiff = &dl, &dp
		fmt.Fprintf(out, "largest loss difference %.3g, largest parameter difference %.3g; one rank: %.0f tokens/s (this layout %.2f×)\n",
			dl, dp, ref.TokensPerS, res.TokensPerS/ref.TokensPerS)
		if apart > 0 {
			fmt.Fprintf(out, "the losses first differ by more than 1e-5 at step %d (rounding flipped a near-tie in the routing, or the capacity limit dropped other slots)\n", apart)
		}
		if cfg.CapacityFactor > 0 && o.dp*o.ep > 1 {
			fmt.Fprintln(out, "(the capacity limit applies to each rank's tokens, so it drops other slots than on one rank: the runs differ by more than rounding)")
		}
	}
	if !job.Root() {
		return nil
	}
	if err := train.WriteJSON(o.loop.Flags.JSONPath, res); err != nil {
		return fmt.Errorf("-json: %w", err)
	}
	return nil
}

// interval accumulates rank 0's MoE times between two progress lines.
type interval struct {
	steps int
	start time.Time
	t     moe.Timings
}

func (iv *interval) add(r *moegpt.StepResult) {
	iv.steps++
	for _, l := range r.Layers {
		iv.t = iv.t.Add(l.Dispatch.Forward)
		iv.t = iv.t.Add(l.Dispatch.Backward)
	}
}

// rank is one rank's trainer, as train.Run drives it: rank 0 adds every
// step's MoE times to the progress interval, and Finish gathers the final
// parameters (rank 0 keeps them).
type rank struct {
	tr     *moegpt.Trainer
	p      *persisted
	rank0  bool
	iv     *interval
	params *map[string][]float32
}

// Step implements train.Stepper.
func (r *rank) Step(ctx context.Context) (*moegpt.StepResult, error) {
	res, err := r.tr.Step(ctx)
	if err != nil {
		return res, err
	}
	if r.rank0 {
		r.iv.add(res)
	}
	return res, r.p.after(ctx, r.tr)
}

// Finish implements train.Finisher.
func (r *rank) Finish(ctx context.Context) error {
	if err := r.p.finish(ctx, r.tr); err != nil {
		return err
	}
	full, err := r.tr.Full(ctx)
	if err == nil && r.rank0 {
		*r.params = full
	}
	return err
}

// trainLayout runs o's steps on a dp × ep mesh, this process's ranks as
// job says, and returns the results and the final parameters (on world
// rank 0's process). Rank 0 prints progress to out.
func trainLayout(ctx context.Context, job *launch.Job, cfg moegpt.Config, init map[string][]float32, o options, out io.Writer) (*result, map[string][]float32, error) {
	res := &result{DP: o.dp, EP: o.ep, Experts: cfg.E, K: cfg.K, Capacity: cfg.CapacityFactor,
		Backend: job.Backend, Device: o.loop.Flags.DeviceKind(), Processes: job.Processes, WorldSize: job.WorldSize, Steps: o.loop.Steps}
	var params map[string][]float32
	iv := interval{start: time.Now()}
	setup := func(ctx context.Context, r train.Rank) (train.Stepper[*moegpt.StepResult], error) {
		m, err := mesh.New(r.Comm, []int{o.dp, o.ep}, []string{"dp", "ep"})
		if err != nil {
			return nil, err
		}
		model := []moegpt.Option{moegpt.WithDataParallel("dp"), moegpt.WithBLAS(r.BLAS)}
		if o.diag {
			model = append(model, moegpt.WithDiagnostics())
		}
		if o.collectives {
			model = append(model, moegpt.WithCollectives())
		}
		opts := []moegpt.TrainOption{moegpt.WithRun(o.run), moegpt.WithModel(model...), moegpt.WithTape(r.Tape...), moegpt.WithDevice(r.Device)}
		dataOpts, p, err := dataOptions(o, cfg, m, out)
		if err != nil {
			return nil, err
		}
		switch {
		case dataOpts != nil:
			opts = append(opts, dataOpts...)
		case o.random:
			opts = append(opts, moegpt.WithRandomTokens(o.seed))
		}
		tr, err := moegpt.NewTrainer(ctx, m, cfg, init, "ep", opts...)
		if err != nil {
			return nil, errors.Join(err, p.close())
		}
		if m.Rank() != 0 {
			p.out = io.Discard
		}
		if err := p.load(ctx, &o, tr); err != nil {
			return nil, err
		}
		return &rank{tr: tr, p: p, rank0: m.Rank() == 0, iv: &iv, params: &params}, nil
	}
	// Rank 0's MoE times: of the current progress interval and in all.
	var total moe.Timings
	tokens := float64(o.loop.Tokens)
	progress := func(_ int, r *moegpt.StepResult, _ float64) {
		now := time.Now()
		report(out, r, &iv, now.Sub(iv.start), tokens, o.diag)
		total = total.Add(iv.t)
		iv = interval{start: now}
	}
	run, err := train.Run(ctx, out, job, o.loop, setup, progress)
	if err != nil {
		return nil, nil, err
	}
	res.dev, res.DeviceName, res.GEMM = run.Device, run.Device.Describe(), run.Device.GEMM
	for _, r := range run.Steps {
		res.Losses = append(res.Losses, r.Loss)
		res.CE = append(res.CE, r.CE)
		res.Aux = append(res.Aux, r.Aux)
		var bal, drop, pad float64
		for _, l := range r.Layers {
			bal, drop, pad = max(bal, l.Balance()), max(drop, l.DroppedFraction()), max(pad, l.PaddedFraction())
		}
		res.Balance = append(res.Balance, bal)
		res.Dropped = append(res.Dropped, drop)
		res.Padded = append(res.Padded, pad)
	}
	last := run.Steps[len(run.Steps)-1]
	res.FinalLoss, res.FinalCE = last.Loss, last.CE
	res.TokensPerS = run.TokensPerS
	us := func(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) }
	res.TimeUS = map[string]float64{
		"wait": us(total.Wait), "permute": us(total.Permute), "count_exchange": us(total.CountExchange),
		"payload_exchange": us(total.PayloadExchange), "fused": us(total.Fused), "experts": us(total.Experts), "combine": us(total.Combine),
	}
	overlap(out, run.Events, o)
	return res, params, nil
}

// report prints one progress block: the step's losses and balance, the
// interval's throughput and time split, and with diag the step's send
// matrices.
func report(out io.Writer, r *moegpt.StepResult, iv *interval, wall time.Duration, tokens float64, diag bool) {
	fmt.Fprintf(out, "step %4d  loss %.4f (ce %.4f aux %.4f z %.4f)  %6.0f tokens/s\n",
		r.Step, r.Loss, r.CE, r.Aux, r.Z, float64(iv.steps)*tokens/wall.Seconds())
	var bal, drop, pad []string
	for _, l := range r.Layers {
		bal = append(bal, fmt.Sprintf("%.2f (aux %.4f)", l.Balance(), l.Aux))
		drop = append(drop, fmt.Sprintf("%.1f%%", 100*l.DroppedFraction()))
		pad = append(pad, fmt.Sprintf("%.1f%%", 100*l.PaddedFraction()))
	}
	fmt.Fprintf(out, "           balance max/mean per layer %s; dropped %s; padded %s\n",
		strings.Join(bal, ", "), strings.Join(drop, " "), strings.Join(pad, " "))
	t := iv.t
	ms := func(d time.Duration) string { return fmt.Sprintf("%.1fms", float64(d)/float64(time.Millisecond)) }
	wait := ""
	if diag {
		wait = "wait " + ms(t.Wait) + "  "
	}
	// The fused path has no separate permute, exchange and combine: its
	// passes are one figure.
	movement := "permute " + ms(t.Permute) + "  count exchange " + ms(t.CountExchange) + "  payload exchange " + ms(t.PayloadExchange)
	combine := "  combine " + ms(t.Combine)
	if t.Fused > 0 {
		movement, combine = "fused dispatch and combine "+ms(t.Fused), ""
		if t.CountExchange > 0 {
			movement += "  count exchange " + ms(t.CountExchange)
		}
	}
	fmt.Fprintf(out, "           moe time (rank 0, %d step(s), fwd+bwd): %s%s  experts %s%s  = %s of %s\n",
		iv.steps, wait, movement, ms(t.Experts), combine, ms(t.Total()), ms(wall))
	if !diag {
		return
	}
	for i, l := range r.Layers {
		s := l.Dispatch
		if s.SendMatrix == nil {
			fmt.Fprintf(out, "           layer %d: no send matrix (static layout without the count exchange)\n", i)
			continue
		}
		fmt.Fprintf(out, "           layer %d: send matrix (rows rank i sends to rank j, ep group of rank 0) %v; largest row %d, largest column %d; tokens per expert %v\n",
			i, s.SendMatrix, s.MaxSend, s.MaxRecv, s.TokensPerExpert)
	}
}

// overlap reports, per rank (with -trace), how much of the gradient
// all-reduces was hidden behind the tape's compute, and the time of the
// MoE payload passes (all-to-all-v's, or the fused path's shared-memory
// passes, recorded as barriers), which run inside the dispatch and combine
// ops, so nothing hides them.
func overlap(out io.Writer, events []trace.Event, o options) {
	if events == nil || o.dp*o.ep < 2 {
		return
	}
	for rank := range o.dp * o.ep {
		ar := train.Overlap(events, rank, func(e trace.Event) bool { return e.Op == comm.OpAllReduce })
		payload := train.Overlap(events, rank, func(e trace.Event) bool { return e.Op == comm.OpAllToAllV || e.Op == comm.OpBarrier })
		fmt.Fprintf(out, "rank %d: all-reduce %v, %.0f%% hidden behind compute; MoE payload passes %v\n", rank,
			ar.Comm.Round(time.Microsecond), 100*ar.Fraction(), payload.Comm.Round(time.Microsecond))
	}
}
