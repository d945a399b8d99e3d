package train

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"runtime"
	"sync"
	"time"

	"github.com/b7ea7098/loom"
	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/device/cuda"
	"github.com/b7ea7098/loom/internal/numcheck"
	"github.com/b7ea7098/loom/kernels"
	"github.com/b7ea7098/loom/launch"
	"github.com/b7ea7098/loom/trace"
)

// ErrInvalid is wrapped by the errors of Loop.Validate and of Flags that
// do not fit (a non-positive -steps); it matches loom.ErrInvalid.
var ErrInvalid = loom.NewSentinel("train: invalid argument", loom.ErrInvalid)

// Loop describes a training run of Run: how many ranks, how
// many steps, how often rank 0 reports, and the tokens of one step (for
// throughput).
type Loop struct {
	// Ranks is the number of ranks the layout needs, at least 1: the
	// job's world size.
	Ranks int
	// Steps is the number of training steps, at least 1.
	Steps int
	// Every is how often (in steps) rank 0 reports progress, at least 1;
	// the last step is always reported.
	Every int
	// Tokens is the number of tokens in one step's global batch.
	Tokens int
	// Shape is the mesh the ranks build on the world, outermost axis
	// first (launch.WithMesh): on NCCL it places the ranks on the GPUs.
	// Optional.
	Shape []int
	// Flags are the common flags (threads, CPU binding, trace).
	Flags Flags
}

// Validate reports every problem of l at once, each wrapping ErrInvalid,
// or nil. Run calls it before starting any rank.
func (l Loop) Validate() error {
	var errs []error
	bad := func(format string, args ...any) {
		errs = append(errs, fmt.Errorf("%w: "+format, append([]any{ErrInvalid}, args...)...))
	}
	if l.Ranks < 1 {
		bad("%d ranks; want at least 1", l.Ranks)
	}
	if l.Steps < 1 {
		bad("-steps %d; want at least 1", l.Steps)
	}
	if l.Every < 1 {
		bad("-every %d; want at least 1", l.Every)
	}
	if l.Flags.Threads < 0 {
		bad("-threads %d; want 0 (the CPUs shared among the ranks) or more", l.Flags.Threads)
	}
	if err := numcheck.NonNegative(ErrInvalid, "-peak", l.Flags.Peak); err != nil {
		errs = append(errs, err)
	}
	if l.Flags.TraceSteps < 1 {
		bad("-trace-steps %d; want at least 1", l.Flags.TraceSteps)
	}
	if err := l.Flags.checkDevice(); err != nil {
		errs = append(errs, err)
	}
	if l.Flags.MP != "" && l.Flags.MP != "bf16" {
		bad("-mp %q; want bf16 (or nothing for float32)", l.Flags.MP)
	}
	return errors.Join(errs...)
}

// RegisterLoop defines -steps and -every on fs with the given defaults,
// storing their values in l, and the common flags (Flags.Register) in
// l.Flags.
func (l *Loop) RegisterLoop(fs *flag.FlagSet, steps, every int) {
	fs.IntVar(&l.Steps, "steps", steps, "training steps (at least 1)")
	fs.IntVar(&l.Every, "every", every, "print progress every this many steps")
	l.Flags.Register(fs)
}

// Rank is what Run gives each rank's setup, on the rank's goroutine.
type Rank struct {
	// Comm is the rank's world communicator, traced with -trace: build the
	// rank's mesh on it.
	Comm comm.Communicator
	// BLAS is the GEMM library this process's ranks share, its threads
	// sized by -threads.
	BLAS *kernels.BLAS
	// Tape are the options for the rank's tape: the BLAS, the device
	// (autograd.WithDevice) when it is not the host and, with -trace, the
	// tracer's observer.
	Tape []autograd.Option
	// Device is where the rank computes (-device): device.Host(), the
	// rank's emulated device, which Run closes after the rank's Finish, or
	// the rank's GPU (a device/cuda device named cuda:N whose context the
	// rank's NCCL communicator uses), which package launch closes.
	Device device.Device
	// Timeline is the -trace timeline (nil without -trace), on which the
	// rank's row is its world rank, Comm.Rank(): for spans of the
	// program's own, such as a pipeline's actions (pp.WithTimeline).
	// What it holds before the first traced step is dropped then.
	Timeline *trace.Timeline
}

// runOptions are the options of Run's job.Run: the in-process ranks'
// options, the mesh (on NCCL it places the ranks on the GPUs), the layout
// log and, for -device cuda, the rank's GPU opened as a device.
func (l Loop) runOptions(out io.Writer) []launch.Option {
	opts := []launch.Option{launch.WithLocal(l.Flags.RunOptions()...), launch.WithMesh(l.Shape...), launch.WithLog(out)}
	if l.Flags.DeviceKind() == DeviceCUDA {
		var dev []cuda.DeviceOption
		if l.Flags.TF32 {
			dev = append(dev, cuda.WithBLASOptions(cuda.WithTF32(true)))
		}
		opts = append(opts, launch.WithDevice(dev...))
	}
	return opts
}

// Stepper is one rank's training state: Step runs one training step (it
// is collective: every rank calls it in step) and returns what rank 0
// reports.
type Stepper[R any] interface {
	Step(ctx context.Context) (R, error)
}

// Finisher is implemented by a Stepper that has collective work after the
// last step (gathering the final parameters); Run calls Finish on every
// rank.
type Finisher interface {
	Finish(ctx context.Context) error
}

// Result is what Run returns: rank 0's results, one per step, its median
// throughput and wall time, and with -trace the recorded events.
type Result[R any] struct {
	// Steps are rank 0's step results, in order.
	Steps []R
	// TokensPerS is Loop.Tokens over the median step time.
	TokensPerS float64
	// Elapsed is rank 0's wall time of the steps.
	Elapsed time.Duration
	// Events are the trace events of every rank (nil without -trace).
	Events []trace.Event
	// Device is the device of this process's lowest rank (world rank
	// 0's where the process holds it) and what ran its GEMMs, after the
	// steps.
	Device DeviceInfo
}

// Run trains on the ranks that job gives this process (launch.Detect):
// it checks l (before any rank starts) and that job has l.Ranks ranks,
// loads the BLAS this process's ranks share (its threads sized for the
// job's ranks on this host), starts the ranks (job.Run; in-process ranks
// with the -bind CPU binding), calls setup on each rank's goroutine to
// build its Stepper, runs l.Steps steps on every rank (timing each step
// and tracing the last -trace-steps of them), calls progress on world
// rank 0 after every l.Every-th step and the last one, with the tokens per
// second since the previous report, and finally calls Finish on every rank
// whose Stepper has one. With one rank per process, -trace's timelines are
// merged on world rank 0 (Tracer.Gather). Only the process holding world
// rank 0 writes to out (nil: nowhere): the GEMM configuration, the run's
// wall time and the trace's location. It returns the results of this
// process's lowest rank (world rank 0's where the process holds it); the
// events are the merged trace, on world rank 0's process only. The first
// rank error ends every rank and is returned.
func Run[R any](ctx context.Context, out io.Writer, job *launch.Job, l Loop, setup func(ctx context.Context, r Rank) (Stepper[R], error), progress func(step int, r R, tokensPerS float64)) (*Result[R], error) {
	if err := l.Validate(); err != nil {
		return nil, err
	}
	if setup == nil {
		return nil, fmt.Errorf("%w: Run: nil setup", ErrInvalid)
	}
	if job == nil {
		return nil, fmt.Errorf("%w: Run: nil job", ErrInvalid)
	}
	if job.WorldSize != l.Ranks {
		return nil, fmt.Errorf("%w: Run: the %s job has %d ranks, the layout needs %d", ErrInvalid, job.Backend, job.WorldSize, l.Ranks)
	}
	if err := job.Check(); err != nil {
		return nil, err
	}
	if err := l.Flags.checkJob(job); err != nil {
		return nil, err
	}
	if out == nil || !job.Root() {
		out = io.Discard
	}
	// The GEMM's threads are this host's share of the CPUs (its ranks may
	// be goroutines here or processes beside this one); its choice of
	// library depends on the ranks inside this process alone.
	threads := Threads(l.Flags.Threads, job.LocalRanks, runtime.NumCPU())
	blas, err := LoadBLAS(out, threads, job.WorldSize/job.Processes)
	if err != nil {
		return nil, fmt.Errorf("train: GEMM library: %w", err)
	}
	tracer := NewTracer(l.Flags.TracePath, l.Steps, l.Flags.TraceSteps, job.Rank)
	res := &Result[R]{}
	var mu sync.Mutex
	err = job.Run(ctx, func(ctx context.Context, c comm.Communicator) (err error) {
		rt := tracer.Rank(c)
		dev, err := l.Flags.OpenDevice(ctx, c.Rank(), blas)
		if err != nil {
			return err
		}
		tape := []autograd.Option{autograd.WithBLAS(blas)}
		if l.Flags.MP == "bf16" {
			tape = append(tape, autograd.WithAutocast())
		}
		if dev.Kind() != device.KindHost {
			tape = append(tape, autograd.WithDevice(dev))
		}
		// A cuda device is launch's: it closes it after the communicator.
		if dev.Kind() == device.KindEmulated {
			defer func() {
				if cerr := dev.Close(); err == nil && cerr != nil {
					err = fmt.Errorf("train: closing %s: %w", dev.Name(), cerr)
				}
			}()
		}
		// Before the device closes: the stream events are the device's.
		rt.OnDevice(dev)
		defer func() {
			if cerr := rt.Close(); err == nil && cerr != nil {
				err = fmt.Errorf("train: -trace: %w", cerr)
			}
		}()
		st, err := setup(ctx, Rank{Comm: rt.Comm(), BLAS: blas, Tape: rt.Tape(tape...), Device: dev, Timeline: tracer.tl})
		if err != nil {
			return err
		}
		rank0 := c.Rank() == 0
		results := make([]R, 0, l.Steps)
		times := make([]time.Duration, 0, l.Steps)
		start := time.Now()
		last, since := start, 0
		for i := range l.Steps {
			span, err := rt.BeginStep(ctx, i)
			if err != nil {
				return err
			}
			t0 := time.Now()
			r, err := st.Step(ctx)
			if eerr := rt.EndStep(span); err == nil {
				err = eerr
			}
			if err != nil {
				return err
			}
			times = append(times, time.Since(t0))
			results = append(results, r)
			since++
			if rank0 && progress != nil && ((i+1)%l.Every == 0 || i+1 == l.Steps) {
				now := time.Now()
				progress(i+1, r, float64(since*l.Tokens)/now.Sub(last).Seconds())
				last, since = now, 0
			}
		}
		elapsed := time.Since(start)
		if f, ok := st.(Finisher); ok {
			if err := f.Finish(ctx); err != nil {
				return err
			}
		}
		if job.Processes > 1 {
			if err := tracer.Gather(ctx, c); err != nil {
				return fmt.Errorf("train: -trace: %w", err)
			}
		}
		if c.Rank() == job.Rank {
			mu.Lock()
			defer mu.Unlock()
			res.Steps, res.Elapsed = results, elapsed
			res.TokensPerS = MedianTokensPerS(float64(l.Tokens), times)
			res.Device = l.Flags.deviceInfo(dev, blas)
		}
		return nil
	}, l.runOptions(out)...)
	if err != nil {
		return nil, err
	}
	fmt.Fprintf(out, "%d steps in %v\n", l.Steps, res.Elapsed.Round(time.Millisecond))
	if res.Device.Kind != DeviceCPU || l.Flags.MP != "" {
		// The host's GEMM line came first (LoadBLAS); cuBLAS loads at
		// the first GEMM, and emu's GEMMs are the host's, emulated.
		fmt.Fprintf(out, "GEMM: %s\n", res.Device.GEMM)
	}
	if !job.Root() {
		return res, nil
	}
	if res.Events, err = tracer.Write(out); err != nil {
		return nil, fmt.Errorf("train: -trace: %w", err)
	}
	return res, nil
}
