// Command transformer trains the tiny GPT of reference/TINY_GPT.md with tensor and
// data parallelism: dp × tp in-process ranks (goroutines exchanging data
// through shared memory), the batch sharded over dp with DDP's overlapped
// gradient all-reduce, the model sharded over tp by gpt.Plan (optionally
// with sequence parallelism).
//
// It starts from the reference's initial parameters
// (reference/tiny_gpt.safetensors, embedded in the binary) and prints the
// loss next to PyTorch's every 20 steps, with tokens/s.
//
// Usage:
//
//	go run ./examples/transformer [-dp 2] [-tp 2] [-sp] [-steps 200] [-every 20]
//	                              [-trace trace.json] [-json run.json] [-compare]
//
// -trace writes a Chrome trace of every rank's compute, collectives and
// waits (open it at https://ui.perfetto.dev or chrome://tracing); -json
// writes {"dp","tp","sp","steps","tokens_per_s","final_loss","losses"};
// -compare also trains on one rank and reports the largest difference.
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
	"sync"
	"time"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/local"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/models/gpt"
	"github.com/b7ea7098/loom/reference/tinygpt"
	"github.com/b7ea7098/loom/trace"
	"github.com/b7ea7098/loom/train"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if err := run(ctx, os.Args[1:], os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "transformer:", err)
		os.Exit(1)
	}
}

type options struct {
	dp, tp       int
	sp           bool
	steps, every int
	compare      bool
	train.Flags
}

// result is what -json writes.
type result struct {
	DP         int       `json:"dp"`
	TP         int       `json:"tp"`
	SP         bool      `json:"sp"`
	Steps      int       `json:"steps"`
	TokensPerS float64   `json:"tokens_per_s"`
	FinalLoss  float64   `json:"final_loss"`
	Losses     []float64 `json:"losses"`
}

func parse(args []string, errOut io.Writer) (options, error) {
	var o options
	fs := flag.NewFlagSet("transformer", flag.ContinueOnError)
	fs.SetOutput(errOut)
	fs.IntVar(&o.dp, "dp", 2, "data-parallel ranks (the batch is sharded over them)")
	fs.IntVar(&o.tp, "tp", 2, "tensor-parallel ranks (the model is sharded over them)")
	fs.BoolVar(&o.sp, "sp", false, "sequence parallelism on the tp axis")
	fs.IntVar(&o.steps, "steps", 0, "training steps (default: the reference's 200)")
	fs.IntVar(&o.every, "every", 20, "print the loss every this many steps")
	o.Flags.Register(fs)
	fs.BoolVar(&o.compare, "compare", false, "also train on one rank and report the largest difference")
	if err := fs.Parse(args); err != nil {
		return o, err
	}
	if fs.NArg() > 0 {
		return o, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	if o.dp < 1 || o.tp < 1 || o.every < 1 || o.steps < 0 || o.Threads < 0 {
		return o, errors.New("-dp, -tp and -every must be at least 1, -steps and -threads at least 0")
	}
	if o.TraceSteps < 1 {
		return o, errors.New("-trace-steps must be at least 1")
	}
	if o.sp && o.tp < 2 {
		return o, errors.New("-sp needs -tp of at least 2")
	}
	return o, nil
}

func run(ctx context.Context, args []string, out io.Writer) error {
	o, err := parse(args, out)
	if err != nil {
		return err
	}
	cfg, init, fx, err := setup()
	if err != nil {
		return err
	}
	if o.steps == 0 {
		o.steps = cfg.Steps
	}
	fmt.Fprintf(out, "tiny GPT (V=%d D=%d H=%d L=%d F=%d, batch %d×%d) on dp=%d × tp=%d in-process ranks, sp=%v, %d steps\n",
		cfg.V, cfg.D, cfg.H, cfg.L, cfg.F, cfg.B, cfg.T, o.dp, o.tp, o.sp, o.steps)

	res, params, err := trainLayout(ctx, cfg, init, o, fx, out)
	if err != nil {
		return err
	}
	summarize(out, o, res, fx, cfg)

	if o.compare {
		one := o
		one.dp, one.tp, one.sp = 1, 1, false
		one.TracePath = "" // keep the trace of the layout asked for
		fmt.Fprintf(out, "\n-compare: the same %d steps on one rank\n", o.steps)
		ref, refParams, err := trainLayout(ctx, cfg, init, one, nil, io.Discard)
		if err != nil {
			return fmt.Errorf("one-rank run: %w", err)
		}
		var dl float64
		for i := range res.Losses {
			dl = max(dl, math.Abs(res.Losses[i]-ref.Losses[i]))
		}
		var dp float64
		for name, w := range refParams {
			for i, v := range params[name] {
				dp = max(dp, math.Abs(float64(v)-float64(w[i])))
			}
		}
		fmt.Fprintf(out, "largest loss difference %.3g, largest parameter difference %.3g; one rank: %.0f tokens/s (this layout %.2f×)\n",
			dl, dp, ref.TokensPerS, res.TokensPerS/ref.TokensPerS)
	}
	return train.WriteJSON(o.JSONPath, res)
}

// setup loads the reference's configuration and initial parameters.
func setup() (tinygpt.Config, map[string][]float32, *tinygpt.Fixture, error) {
	fx, err := tinygpt.LoadFixture()
	if err != nil {
		return tinygpt.Config{}, nil, nil, err
	}
	cfg, err := fx.Cfg()
	if err != nil {
		return tinygpt.Config{}, nil, nil, err
	}
	init, err := fx.Params(tinygpt.PrefixInit)
	if err != nil {
		return tinygpt.Config{}, nil, nil, err
	}
	return cfg, init, fx, nil
}

// trainLayout runs o.steps steps on a dp × tp mesh and returns the losses, the
// throughput and the final parameters. Rank 0 prints progress to out.
func trainLayout(ctx context.Context, cfg tinygpt.Config, init map[string][]float32, o options, fx *tinygpt.Fixture, out io.Writer) (*result, map[string][]float32, error) {
	res := &result{DP: o.dp, TP: o.tp, SP: o.sp, Steps: o.steps}
	blas, err := train.LoadBLAS(out, o.Threads, o.dp*o.tp)
	if err != nil {
		return nil, nil, err
	}
	var (
		mu     sync.Mutex
		params map[string][]float32
	)
	tokens := float64(cfg.B * cfg.T)
	tracer := train.NewTracer(o.TracePath, o.steps, o.TraceSteps)
	err = local.Run(ctx, o.dp*o.tp, func(ctx context.Context, c comm.Communicator) error {
		rt := tracer.Rank(c)
		m, err := mesh.New(rt.Comm(), []int{o.dp, o.tp}, []string{"dp", "tp"})
		if err != nil {
			return err
		}
		tape := rt.Tape(autograd.WithBLAS(blas))
		tr, err := gpt.NewTrainer(ctx, m, cfg, init, gpt.TrainOptions{DP: "dp", TP: "tp", SP: o.sp, Tape: tape})
		if err != nil {
			return err
		}
		losses := make([]float64, 0, o.steps)
		stepTimes := make([]time.Duration, 0, o.steps)
		start := time.Now()
		last := start
		for i := range o.steps {
			span, err := rt.BeginStep(ctx, i)
			if err != nil {
				return err
			}
			t0 := time.Now()
			step, loss, err := tr.Step(ctx)
			span.End()
			if err != nil {
				return err
			}
			stepTimes = append(stepTimes, time.Since(t0))
			losses = append(losses, loss)
			if m.Rank() == 0 && (step%o.every == 0 || step == o.steps) {
				now := time.Now()
				n := step % o.every
				if n == 0 {
					n = o.every
				}
				line := fmt.Sprintf("step %4d  loss %.6f", step, loss)
				if want, ok := fixtureLoss(fx, step); ok {
					line += fmt.Sprintf("  pytorch %.6f  Δ %+.4f", want, loss-want)
				}
				fmt.Fprintf(out, "%s  %8.0f tokens/s\n", line, float64(n)*tokens/now.Sub(last).Seconds())
				last = now
			}
		}
		elapsed := time.Since(start)
		full, err := tr.Full(ctx)
		if err != nil {
			return err
		}
		if m.Rank() == 0 {
			mu.Lock()
			defer mu.Unlock()
			res.Losses = losses
			res.FinalLoss = losses[len(losses)-1]
			res.TokensPerS = train.MedianTokensPerS(tokens, stepTimes)
			params = full
			fmt.Fprintf(out, "%d steps in %v\n", o.steps, elapsed.Round(time.Millisecond))
		}
		return nil
	}, o.RunOptions()...)
	if err != nil {
		return nil, nil, err
	}
	if err := writeTrace(out, tracer, o); err != nil {
		return nil, nil, err
	}
	return res, params, nil
}

// writeTrace writes the Chrome trace and reports, per rank, how much of the
// data-parallel all-reduce time was hidden behind compute.
func writeTrace(out io.Writer, tracer *train.Tracer, o options) error {
	events, err := tracer.Write(out)
	if err != nil || !tracer.Enabled() || o.dp < 2 {
		return err
	}
	for rank := range o.dp * o.tp {
		group := dpGroup(rank, o.dp, o.tp)
		// The gradient buckets; DDP's int32 presence flags, reduced after
		// backward, are not part of the overlap.
		s := train.Overlap(events, rank, func(e trace.Event) bool {
			return e.Op == comm.OpAllReduce && e.Group == group && e.DType != comm.Int32
		})
		fmt.Fprintf(out, "rank %d: dp all-reduce %v, %.0f%% hidden behind compute\n", rank, s.Comm.Round(time.Microsecond), 100*s.Fraction())
	}
	return nil
}

// dpGroup is the trace label of rank's data-parallel group on the row-major
// dp × tp mesh: the ranks with its tp coordinate.
func dpGroup(rank, dp, tp int) string {
	ranks := make([]string, dp)
	for d := range dp {
		ranks[d] = strconv.Itoa(d*tp + rank%tp)
	}
	return "[" + strings.Join(ranks, ",") + "]"
}

// fixtureLoss is the reference's loss at step, if it has one.
func fixtureLoss(fx *tinygpt.Fixture, step int) (float64, bool) {
	if fx == nil {
		return 0, false
	}
	return fx.LossAt(step)
}

// summarize prints the final loss, its distance from PyTorch's curve and
// the throughput.
func summarize(out io.Writer, o options, res *result, fx *tinygpt.Fixture, cfg tinygpt.Config) {
	fmt.Fprintf(out, "final loss %.6f, median %.0f tokens/s\n", res.FinalLoss, res.TokensPerS)
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
	want, _ := fx.LossAt(o.steps)
	tol := fx.Tolerances.LossCurve(o.steps, cfg.Steps)
	verdict := "within"
	if !(math.Abs(res.FinalLoss-want) <= tol) {
		verdict = "OUTSIDE"
	}
	if slices.Contains(fx.LossCurveEvery20Steps, o.steps) {
		fmt.Fprintf(out, "PyTorch's loss at step %d: %.6f; |Δ| %.4f, %s the tolerance %g\n", o.steps, want, math.Abs(res.FinalLoss-want), verdict, tol)
	}
	fmt.Fprintf(out, "largest |Δ| from PyTorch's curve: %.4f at step %d\n", worst, worstStep)
}
