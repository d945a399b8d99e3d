// Command transformer trains a GPT (models/gpt; by default the tiny GPT of
// reference/TINY_GPT.md) with tensor, data and fully sharded data
// parallelism: dp × fsdp × tp ranks,
// the batch sharded over dp with DDP's overlapped gradient all-reduce (or,
// with -fsdp, over dp × fsdp with the parameters, gradients and optimizer
// state sharded over fsdp: FSDP/ZeRO, HSDP when dp > 1 too), the model
// sharded over tp by gpt.Plan (optionally with sequence parallelism), and
// optionally every block's activations recomputed in backward (-ac). The
// same binary runs its ranks
// as goroutines of one process (exchanging data through shared memory),
// as one MPI process per rank under mpirun (built with -tags mpi), or
// under loomrun or torchrun as one NCCL process per GPU, or on a machine
// without GPUs one process per rank over TCP (package launch):
//
//	go run ./examples/transformer -dp 2 -tp 2
//	go build -tags mpi -o transformer ./examples/transformer && mpirun -np 4 ./transformer -dp 2 -tp 2
//	loomrun -n 4 ./transformer -dp 2 -tp 2
//
// Only world rank 0 prints and writes -json and -trace (the trace merges
// every process's timeline).
//
// The tiny model starts from the reference's initial parameters
// (reference/tiny_gpt.safetensors, embedded in the binary), trains on its
// corpus and prints the loss next to PyTorch's every 20 steps, with
// tokens/s.
//
// The model's shape is -model's preset (gpt.Preset: tiny, the default,
// gpt2-small, gpt2-medium, gpt2-large, gpt2-xl), whose fields -layers,
// -width, -heads, -ff (the MLP's width), -seq, -vocab and -batch (the
// global batch in sequences: 16 for tiny, 8 for the others) override one
// by one. Any shape or batch but the reference's, or an explicit -seed,
// starts from a random init drawn from -seed (default 1) and trains on
// random tokens drawn from it (the same global batches on every layout,
// each data-parallel rank keeping its rows): a throughput run, which the
// first line says, with no PyTorch numbers.
//
// Usage:
//
//	go run ./examples/transformer [-dp 2] [-tp 2] [-sp] [-steps 200] [-every 20]
//	                              [-model tiny|gpt2-small|gpt2-medium|gpt2-large|gpt2-xl]
//	                              [-layers L] [-width D] [-heads H] [-ff F] [-seq T]
//	                              [-vocab V] [-batch B] [-seed 1]
//	                              [-fsdp 1] [-reshard true|false|N] [-zero 1|2|3]
//	                              [-cp 1] [-cp-method auto|ring|allgather|ulysses|hybrid] [-cp-balance=true] [-cp-flat-fsdp=true]
//	                              [-mp bf16] [-ac none|full|selective]
//	                              [-trace trace.json] [-json run.json] [-compare]
//	                              [-backend local|mpi|nccl|tcp] [-peak TFLOP/s]
//	                              [-device cpu|emu|cuda] [-tf32]
//
// -device says where the ranks compute (the second line names it): cpu,
// the host (the default); emu, an emulated device per rank (device/emu:
// the device code path, with the host's CPU kernels, so the host's losses
// bit for bit; in-process or mpi ranks); cuda, the GPUs, which needs
// launch to hand each rank the GPU device it opens for NCCL (under
// loomrun or torchrun). -mp bf16 computes the matrix products in bfloat16
// with float32 accumulation on every device and layout (autocast:
// float32 master weights, gradients, optimizer state, LayerNorm, softmax
// and cross-entropy), and with -fsdp also gathers the parameters in
// bfloat16; -tf32 lets cuBLAS use TF32 for float32 GEMMs (-device cuda).
// After the steps a device run prints "GEMM: …" with what ran the GEMMs
// (cuBLAS's version and path, or the emulated device's host BLAS) and
// the precision, f32, tf32 or bf16.
//
// -cp N shards the sequence of every activation over N more ranks
// (context parallelism, the innermost mesh axis; cp.go): attention runs by
// -cp-method over them, the causal work load balanced unless
// -cp-balance=false; -seq sets a longer sequence (a throughput run).
// With -fsdp too, FSDP shards over the flattened fsdp×cp axes (each rank
// holds 1/(fsdp·cp) of the parameters, as torchtitan's dp_shard_cp) unless
// -cp-flat-fsdp=false; the first line says which.
//
// The model and the layout are checked before any rank starts: the
// shape's values (heads dividing the width, a vocabulary of at least
// 128), tp must divide the heads (4 for tiny: tp is 1, 2 or 4), dp × fsdp
// the batch, -reshard N divides -fsdp, -sp needs tp ≥ 2 and a
// sequence length divisible by tp, and -steps is at least 1 (default 200,
// the reference run's length); a bad one prints one message saying what
// would work.
//
// At the end it prints the MFU: the median tokens/s times the model
// FLOPs per token (train.FlopsPerToken: PaLM's 6·N + 12·L·D·T, N the
// parameters without the embedding tables) over the peak of the job's
// devices: on cuda, the GPU's dense peak in the run's precision from
// train.DevicePeak's table by the GPU's name (an unknown GPU's line says
// to give -peak); on the host and emu, the estimated peak of the CPUs
// each host's ranks use (train.HostPeak); or -peak, one device's peak in
// TFLOP/s.
//
// -trace writes a Chrome trace of every rank's compute, collectives and
// waits (open it at https://ui.perfetto.dev or chrome://tracing); -json
// writes {"model","params","dp","fsdp","tp","sp","ac","cp","cp_method",
// "backend","device","device_name","gemm","processes","world_size",
// "steps","tokens_per_s","final_loss","losses","mem","mfu",
// "flops_per_token","peak_flops","peak_tflops","peak_source"} ("mem": the
// largest rank's bytes of params, grads, optim, activations, comm and
// their peak, also printed at the end, and on a device "device", its
// allocator's statistics (device.Stats); "mfu" a fraction, "peak_flops" all
// devices' FLOP/s); -compare (in-process ranks only)
// also trains on one rank and reports the largest difference.
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
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/launch"
	"github.com/b7ea7098/loom/memory"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/models/gpt"
	"github.com/b7ea7098/loom/parallel/fsdp"
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
		fmt.Fprintln(os.Stderr, "transformer:", err)
		os.Exit(1)
	}
}

type options struct {
	dp, fsdp, tp int
	sp           bool
	ac           string // none, full or selective
	reshard      string // true, false or a group size
	zero         int    // 1, 2 or 3
	compare      bool
	loop         train.Loop
	shape        train.ShapeFlags
	seed         uint64
	cpf          cpFlags        // -cp, -cp-method, -cp-balance (cp.go)
	cfg          gpt.Config     // the model's shape
	run          tinygpt.Config // the batch and the optimizer
	// fixture: the reference's shape, batch and init on its corpus, with
	// PyTorch's losses; otherwise a random init on random tokens.
	fixture bool
	// overridden: a flag changed the preset's shape or batch.
	overridden bool
	persist    train.Persist // -data and -checkpoint (resume.go)
	start      int           // the step -resume goes on from
	pipe       pipeOptions   // -pp and its flags (pp.go)
}

// otherBatch is the global batch of the presets other than tiny (whose
// batch is the reference's): the sequences of one step of a GPT-2-sized
// throughput run on one GPU.
const otherBatch = 8

// result is what -json writes.
type result struct {
	Model  string `json:"model"`
	Params int    `json:"params"`
	DP     int    `json:"dp"`
	FSDP   int    `json:"fsdp"`
	TP     int    `json:"tp"`
	SP     bool   `json:"sp"`
	AC     string `json:"ac"`
	cpResult
	Mem        memory.Report `json:"mem"`
	Backend    string        `json:"backend"`
	Device     string        `json:"device"`
	DeviceName string        `json:"device_name"` // world rank 0's: "cuda:0 (NVIDIA H200)", "emu:0", "host"
	GEMM       string        `json:"gemm"`        // what ran the GEMMs, in which precision
	dev        train.DeviceInfo
	Processes  int       `json:"processes"`
	WorldSize  int       `json:"world_size"`
	Steps      int       `json:"steps"`
	TokensPerS float64   `json:"tokens_per_s"`
	FinalLoss  float64   `json:"final_loss"`
	Losses     []float64 `json:"losses"`
	train.MFU
}

// parse reads the flags, the model's shape (-model and the flags that
// override it) and the run (ref: the reference's batch, corpus and
// optimizer), and checks them and the layout, so that a bad one fails
// once, before any rank starts.
func parse(args []string, errOut io.Writer, ref tinygpt.Config) (options, error) {
	var o options
	fs := flag.NewFlagSet("transformer", flag.ContinueOnError)
	fs.SetOutput(errOut)
	fs.IntVar(&o.dp, "dp", 2, "data-parallel ranks (the batch is sharded over them)")
	fs.IntVar(&o.tp, "tp", 2, "tensor-parallel ranks (the model is sharded over them)")
	fs.BoolVar(&o.sp, "sp", false, "sequence parallelism on the tp axis")
	fs.IntVar(&o.fsdp, "fsdp", 1, "fully sharded data-parallel ranks (parameters, gradients and optimizer state sharded over them; with -dp > 1 it is HSDP)")
	fs.StringVar(&o.reshard, "reshard", "true", "with -fsdp: free gathered parameters after each block's forward (true), keep them (false), or keep them sharded over groups of N ranks (N)")
	fs.IntVar(&o.zero, "zero", 3, "with -fsdp: ZeRO stage: 1 shards optimizer state, 2 also gradients, 3 also parameters")
	fs.StringVar(&o.ac, "ac", "none", "activation checkpointing of every block: none, full (recompute the block in backward) or selective (keep the matrix products)")
	o.loop.RegisterLoop(fs, ref.Steps, 20)
	fs.BoolVar(&o.compare, "compare", false, "also train on one rank and report the largest difference")
	o.shape.Register(fs, "tiny", gpt.Presets())
	o.cpf.register(fs)
	o.persist.Register(fs)
	fs.Uint64Var(&o.seed, "seed", 1, "seed of the random init and the random tokens (setting it trains the tiny model that way too)")
	o.pipe.register(fs)
	if err := fs.Parse(args); err != nil {
		return o, err
	}
	if fs.NArg() > 0 {
		return o, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	if err := o.model(fs, ref); err != nil {
		return o, err
	}
	o.loop.Ranks = o.dp * o.fsdp * o.tp * max(o.cpf.cp, 1)
	o.loop.Shape, _ = o.cpf.axes(o.dp, o.fsdp, o.tp)
	o.loop.Tokens = o.run.B * o.cfg.SeqLen
	if err := o.pipeline(fs); err != nil {
		return o, err
	}
	if o.pipe.on() && o.cpf.cp > 1 {
		return o, fmt.Errorf("-pp trains pipeline stages alone in this example; -cp cannot be combined with it yet")
	}
	l := gpt.Layout{DP: o.dp, FSDP: o.fsdp, TP: o.tp, SP: o.sp, CP: o.cpf.cp, CPPlain: !o.cpf.balance}
	l.CPMethod, l.CPInner = o.cpf.layoutMethod()
	if err := o.cfg.CheckLayout(o.run.B, l); err != nil {
		return o, err
	}
	if err := o.cpf.check(); err != nil {
		return o, err
	}
	if err := o.checkSharding(); err != nil {
		return o, err
	}
	return o, errors.Join(o.loop.Validate(), o.persist.Validate())
}

// model sets o's model and run from -model, the flags that override its
// fields and -seed (set on fs), and ref: the tiny preset with nothing
// changed is the reference run (its init, corpus and PyTorch's losses);
// anything else starts from a random init and trains on random tokens.
// It checks the model and the run.
func (o *options) model(fs *flag.FlagSet, ref tinygpt.Config) error {
	name, err := o.shape.Preset()
	if err != nil {
		return err
	}
	cfg, err := gpt.Preset(name)
	if err != nil {
		return err
	}
	batch := otherBatch
	if name == "tiny" {
		cfg, batch = gpt.FromReference(ref), ref.B
	}
	preset := train.Shape{Layers: cfg.Layers, Width: cfg.Width, Heads: cfg.Heads, FF: cfg.MLPWidth, Seq: cfg.SeqLen, Vocab: cfg.Vocab, Batch: batch}
	sh, err := o.shape.Apply(fs, preset)
	if err != nil {
		return err
	}
	o.overridden = sh != preset
	cfg.Layers, cfg.Width, cfg.Heads, cfg.MLPWidth, cfg.SeqLen, cfg.Vocab = sh.Layers, sh.Width, sh.Heads, sh.FF, sh.Seq, sh.Vocab
	seeded := false
	fs.Visit(func(f *flag.Flag) { seeded = seeded || f.Name == "seed" })
	o.cfg, o.run = cfg, ref
	o.run.B = sh.Batch
	o.fixture = cfg == gpt.FromReference(ref) && sh.Batch == ref.B && !seeded && o.persist.Data == ""
	if err := cfg.Validate(); err != nil {
		return err
	}
	// The trainer's own check of the run with this model (the vocabulary
	// and the corpus's rules), before any rank starts.
	data := o.run
	data.V, data.D, data.H, data.L, data.F, data.T = cfg.Vocab, cfg.Width, cfg.Heads, cfg.Layers, cfg.MLPWidth, cfg.SeqLen
	return data.Validate()
}

// describe is the first line's model: its shape, batch, and where its
// init and data come from.
func (o options) describe() string {
	c := o.cfg
	s := fmt.Sprintf("(V=%d D=%d H=%d L=%d F=%d T=%d, %d parameters, batch %d×%d)", c.Vocab, c.Width, c.Heads, c.Layers, c.MLPWidth, c.SeqLen, c.NumParams(), o.run.B, c.SeqLen)
	if o.fixture {
		return "tiny GPT " + s
	}
	name := o.shape.Model
	if o.overridden {
		name += " changed by flags"
	}
	if o.persist.Data != "" {
		return fmt.Sprintf("GPT -model %s %s from a random init (seed %d) on %s, %g of it held out for validation", name, s, o.seed, o.persist.Data, o.persist.ValFrac)
	}
	return fmt.Sprintf("GPT -model %s %s from a random init on random tokens (seed %d: a throughput run, no reference losses)", name, s, o.seed)
}

// checkSharding checks -ac, -reshard and -zero, which (but for -ac) apply
// to -fsdp > 1.
func (o options) checkSharding() error {
	var errs []error
	if !slices.Contains([]string{"none", "full", "selective"}, o.ac) {
		errs = append(errs, fmt.Errorf("-ac %q; want none, full or selective", o.ac))
	}
	if o.fsdp < 1 {
		errs = append(errs, fmt.Errorf("-fsdp %d; want at least 1", o.fsdp))
	}
	if o.zero < 1 || o.zero > 3 {
		errs = append(errs, fmt.Errorf("-zero %d; want 1, 2 or 3", o.zero))
	}
	if _, err := o.reshardGroup(); err != nil {
		errs = append(errs, err)
	}
	if o.fsdp == 1 && (o.zero != 3 || o.reshard != "true") {
		errs = append(errs, errors.New("-zero and -reshard apply to fully sharded data parallelism: set -fsdp to 2 or more"))
	}
	return errors.Join(errs...)
}

// reshardGroup reads -reshard: 0 to free after forward (true), -1 to keep
// (false), or the group size N that keeps them sharded over N ranks, which
// must divide -fsdp.
func (o options) reshardGroup() (int, error) {
	switch o.reshard {
	case "true":
		return 0, nil
	case "false":
		return -1, nil
	}
	n, err := strconv.Atoi(o.reshard)
	if err != nil || n < 1 {
		return 0, fmt.Errorf("-reshard %q; want true, false or a group size of at least 1", o.reshard)
	}
	if o.fsdp%n != 0 {
		return 0, fmt.Errorf("-reshard %d must divide -fsdp (%d); it can be %s", n, o.fsdp, divisors(o.fsdp))
	}
	return n, nil
}

// layout describes the run's parallelism: "dp=2 × tp=2, sp=false", with
// FSDP's and checkpointing's settings where they are used.
func (o options) layout() string {
	s := fmt.Sprintf("dp=%d × tp=%d", o.dp, o.tp)
	if o.fsdp > 1 {
		s = fmt.Sprintf("dp=%d × fsdp=%d × tp=%d (ZeRO-%d, reshard %s", o.dp, o.fsdp, o.tp, o.zero, o.reshard)
		if o.loop.Flags.MP != "" {
			s += ", " + o.loop.Flags.MP + " gathers"
		}
		s += ")"
	}
	s += o.cpf.layout(o.fsdp) + fmt.Sprintf(", sp=%v", o.sp)
	if o.loop.Flags.MP != "" {
		s += ", -mp " + o.loop.Flags.MP + " (autocast)"
	}
	if o.ac != "none" {
		s += ", -ac " + o.ac
	}
	return s
}

// fsdpOptions are FSDP's options for -reshard, -zero (checked by
// checkSharding) and -mp (train.Loop.Validate).
func (o options) fsdpOptions() []fsdp.Option {
	opts := []fsdp.Option{fsdp.WithZeROStage(o.zero)}
	switch n, _ := o.reshardGroup(); {
	case n < 0:
		opts = append(opts, fsdp.WithReshard(false))
	case n > 0:
		opts = append(opts, fsdp.WithReshardTo(n))
	}
	if o.loop.Flags.MP == "bf16" {
		opts = append(opts, fsdp.WithMixedPrecision(comm.BFloat16))
	}
	return opts
}

// divisors lists n's divisors as "1, 2 or 4".
func divisors(n int) string {
	var ds []string
	for d := 1; d <= n; d++ {
		if n%d == 0 {
			ds = append(ds, strconv.Itoa(d))
		}
	}
	if len(ds) == 1 {
		return ds[0]
	}
	return strings.Join(ds[:len(ds)-1], ", ") + " or " + ds[len(ds)-1]
}

func run(ctx context.Context, args []string, out io.Writer) error {
	fx, err := tinygpt.LoadFixture()
	if err != nil {
		return err
	}
	ref, err := fx.Cfg()
	if err != nil {
		return err
	}
	o, err := parse(args, out, ref)
	if err != nil {
		return err
	}
	if o.pipe.on() {
		params := gpt.RandomInit(o.cfg, o.seed)
		if o.fixture {
			if params, err = fx.Params(tinygpt.PrefixInit); err != nil {
				return err
			}
		} else {
			fx = nil
		}
		return runPipeline(ctx, out, o, fx, params)
	}
	// The initial parameters: the reference's, or drawn from -seed.
	init := gpt.WithSeed(o.seed)
	if o.fixture {
		params, err := fx.Params(tinygpt.PrefixInit)
		if err != nil {
			return err
		}
		init = gpt.WithParams(params)
	} else {
		fx = nil // no PyTorch numbers for this model
	}
	job, err := o.loop.Flags.Job(o.loop.Ranks)
	if err != nil {
		return fmt.Errorf("-dp %d -tp %d: %w", o.dp, o.tp, err)
	}
	if o.start, err = prepareResume(&o); err != nil {
		return err
	}
	if o.compare && (job.Backend != launch.Local || o.persist.Data != "" || o.persist.Dir != "") {
		return fmt.Errorf("-compare trains on in-process ranks only, from the start, without -data or -checkpoint (this is a %s job)", job.Backend)
	}
	if !job.Root() {
		out = io.Discard // world rank 0 reports for the job
	}
	fmt.Fprintf(out, "%s on %s, %s, %d steps\n", o.describe(), o.layout(), job, o.loop.Steps)
	fmt.Fprintln(out, o.loop.Flags.DeviceLine(o.loop.Ranks))
	resumeLine(out, o)

	res, params, err := trainLayout(ctx, out, job, init, o, fx)
	if err != nil {
		return err
	}
	fpt, err := train.FlopsPerToken(o.cfg.MatmulParams(), o.cfg.Layers, o.cfg.Width, o.cfg.SeqLen)
	if err != nil {
		return err
	}
	if res.MFU, err = o.loop.RunMFU(job, res.dev, res.TokensPerS, fpt); err != nil {
		return err
	}
	res.Model, res.Params = o.shape.Model, o.cfg.NumParams()
	summarize(out, o, res, fx)

	if o.compare {
		one := o
		one.dp, one.fsdp, one.tp, one.sp = 1, 1, 1, false
		one.cpf = cpFlags{cp: 1, method: "auto", balance: true}
		one.reshard, one.zero = "true", 3
		one.loop.Ranks, one.loop.Shape = 1, []int{1, 1, 1}
		one.loop.Flags.TracePath = "" // keep the trace of the layout asked for
		fmt.Fprintf(out, "\n-compare: the same %d steps on one rank\n", o.loop.Steps)
		oneJob, err := launch.InProcess(1)
		if err != nil {
			return err
		}
		refRes, refParams, err := trainLayout(ctx, io.Discard, oneJob, init, one, nil)
		if err != nil {
			return fmt.Errorf("one-rank run: %w", err)
		}
		var dl float64
		for i := range res.Losses {
			dl = max(dl, math.Abs(res.Losses[i]-refRes.Losses[i]))
		}
		var dp float64
		for name, w := range refParams {
			for i, v := range params[name] {
				dp = max(dp, math.Abs(float64(v)-float64(w[i])))
			}
		}
		fmt.Fprintf(out, "largest loss difference %.3g, largest parameter difference %.3g; one rank: %.0f tokens/s (this layout %.2f×)\n",
			dl, dp, refRes.TokensPerS, res.TokensPerS/refRes.TokensPerS)
	}
	if !job.Root() {
		return nil
	}
	return train.WriteJSON(o.loop.Flags.JSONPath, res)
}

// rank is one rank's trainer, as train.Run drives it: Step returns the
// step's global loss, Finish gathers the final parameters (rank 0 keeps
// them).
type rank struct {
	tr     *gpt.Trainer
	p      *persisted
	rank0  bool
	params *map[string][]float32
	mem    *memory.Report
}

// Step implements train.Stepper.
func (r *rank) Step(ctx context.Context) (float64, error) {
	_, loss, err := r.tr.Step(ctx)
	if err != nil {
		return loss, err
	}
	return loss, r.p.after(ctx, r.tr, loss)
}

// Finish implements train.Finisher: the last step's memory (the maximum
// over ranks) and the final parameters, kept by rank 0.
func (r *rank) Finish(ctx context.Context) error {
	if err := r.p.finish(ctx, r.tr); err != nil {
		return err
	}
	mem, err := r.tr.Memory(ctx)
	if err != nil {
		return err
	}
	full, err := r.tr.Full(ctx)
	if err == nil && r.rank0 {
		*r.params, *r.mem = full, mem
	}
	return err
}

// trainLayout runs o's steps on a dp × tp mesh, this process's ranks as
// job says, and returns the losses, the throughput and the final
// parameters (on world rank 0's process). Rank 0 prints progress to out, with
// PyTorch's loss where fx has it.
func trainLayout(ctx context.Context, out io.Writer, job *launch.Job, init gpt.Option, o options, fx *tinygpt.Fixture) (*result, map[string][]float32, error) {
	var params map[string][]float32
	var mem memory.Report
	setup := func(ctx context.Context, r train.Rank) (train.Stepper[float64], error) {
		m, err := mesh.New(r.Comm, o.loop.Shape, o.cpf.names(o.dp, o.fsdp, o.tp))
		if err != nil {
			return nil, err
		}
		opts := []gpt.TrainOption{
			gpt.WithRun(o.run), gpt.WithModel(init), gpt.WithTape(r.Tape...), gpt.WithDevice(r.Device),
			gpt.WithDataParallel("dp"), gpt.WithTensorParallel("tp"),
		}
		opts = append(opts, o.cpf.trainOptions(o.fsdp)...)
		dataOpts, p, err := dataOptions(o, m, out)
		if err != nil {
			return nil, err
		}
		switch {
		case dataOpts != nil:
			opts = append(opts, dataOpts...)
		case !o.fixture:
			opts = append(opts, gpt.WithRandomTokens(o.seed))
		}
		if o.sp {
			opts = append(opts, gpt.WithSequenceParallel())
		}
		if o.fsdp > 1 {
			opts = append(opts, gpt.WithFullyShard("fsdp", o.fsdpOptions()...))
		}
		switch o.ac {
		case "full":
			opts = append(opts, gpt.WithCheckpointing())
		case "selective":
			opts = append(opts, gpt.WithCheckpointing(autograd.WithKeepMatrixProducts()))
		}
		tr, err := gpt.NewTrainer(ctx, m, o.cfg, opts...)
		if err != nil {
			return nil, errors.Join(err, p.close())
		}
		if m.Rank() != 0 {
			p.out = io.Discard
		}
		if err := p.load(ctx, &o, tr); err != nil {
			return nil, err
		}
		return &rank{tr: tr, p: p, rank0: m.Rank() == 0, params: &params, mem: &mem}, nil
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
	r, err := train.Run(ctx, out, job, o.loop, setup, progress)
	if err != nil {
		return nil, nil, err
	}
	res := &result{DP: o.dp, FSDP: o.fsdp, TP: o.tp, SP: o.sp, AC: o.ac, cpResult: o.cpf.result(), Mem: mem, Backend: job.Backend, Device: o.loop.Flags.DeviceKind(), Processes: job.Processes, WorldSize: job.WorldSize,
		Steps: o.loop.Steps, Losses: r.Steps, TokensPerS: r.TokensPerS}
	res.FinalLoss = r.Steps[len(r.Steps)-1]
	res.dev, res.DeviceName, res.GEMM = r.Device, r.Device.Describe(), r.Device.GEMM
	overlap(out, r.Events, o)
	return res, params, nil
}

// overlap reports, per rank, how much of the data-parallel communication
// time was hidden behind compute (with -trace): DDP's all-reduce on the dp
// axis, or FSDP's all-gathers and reduce-scatters on the fsdp axis.
func overlap(out io.Writer, events []trace.Event, o options) {
	if events == nil || o.dp*o.fsdp < 2 {
		return
	}
	for rank := range o.loop.Ranks {
		what, axis := "dp all-reduce", 0
		isComm := func(e trace.Event) bool {
			// The gradient buckets; DDP's int32 presence flags, reduced
			// after backward, are not part of the overlap.
			return e.Op == comm.OpAllReduce && e.DType != comm.Int32
		}
		if o.fsdp > 1 {
			what, axis = "fsdp all-gather and reduce-scatter", 1
			isComm = func(e trace.Event) bool { return e.Op == comm.OpAllGather || e.Op == comm.OpReduceScatter }
		}
		group := axisGroup(rank, axis, o.loop.Shape)
		s := train.Overlap(events, rank, func(e trace.Event) bool { return e.Group == group && isComm(e) })
		fmt.Fprintf(out, "rank %d: %s %v, %.0f%% hidden behind compute\n", rank, what, s.Comm.Round(time.Microsecond), 100*s.Fraction())
	}
}

// axisGroup is the trace label of rank's group along mesh axis axis of the
// row-major mesh of shape: the ranks that differ from it only there.
func axisGroup(rank, axis int, shape []int) string {
	stride := 1
	for _, n := range shape[axis+1:] {
		stride *= n
	}
	base := rank - (rank/stride%shape[axis])*stride
	ranks := make([]string, shape[axis])
	for k := range shape[axis] {
		ranks[k] = strconv.Itoa(base + k*stride)
	}
	return "[" + strings.Join(ranks, ",") + "]"
}

// mib formats a byte count in MiB.
func mib(n int64) string { return fmt.Sprintf("%.2f MiB", float64(n)/(1<<20)) }

// summarize prints the final loss, the throughput and MFU, the memory,
// and with fx (the reference run) the distance from PyTorch's curve.
func summarize(out io.Writer, o options, res *result, fx *tinygpt.Fixture) {
	fmt.Fprintf(out, "final loss %.6f, median %.0f tokens/s\n", res.FinalLoss, res.TokensPerS)
	fmt.Fprintln(out, res.MFU)
	m := res.Mem
	fmt.Fprintf(out, "memory per rank (largest rank, last step): params %s, grads %s, optim %s, activations %s, comm %s; peak %s\n",
		mib(m.Params), mib(m.Grads), mib(m.Optim), mib(m.Activations), mib(m.Comm), mib(m.Peak))
	if fx == nil {
		return
	}
	var worst float64
	worstStep := 0
	for _, s := range fx.LossCurveEvery20Steps {
		if s > len(res.Losses) {
			continue
		}
		want, _ := fx.LossAt(s)
		if d := math.Abs(res.Losses[s-1] - want); d >= worst {
			worst, worstStep = d, s
		}
	}
	if worstStep == 0 {
		return
	}
	steps := o.loop.Steps
	if want, ok := fx.LossAt(steps); ok && slices.Contains(fx.LossCurveEvery20Steps, steps) {
		tol := fx.Tolerances.LossCurve(steps, o.run.Steps)
		verdict := "within"
		if !(math.Abs(res.FinalLoss-want) <= tol) {
			verdict = "OUTSIDE"
		}
		fmt.Fprintf(out, "PyTorch's loss at step %d: %.6f; |Δ| %.4f, %s the tolerance %g\n", steps, want, math.Abs(res.FinalLoss-want), verdict, tol)
	}
	fmt.Fprintf(out, "largest |Δ| from PyTorch's curve: %.4f at step %d\n", worst, worstStep)
}
