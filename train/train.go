// Package train trains models.
//
// Trainer is the training loop for a model of one's own (see
// ExampleTrainer and examples/mlp): it drives the user's parallel.Module,
// loss function (LossFunc) and optimizer over a Dataset (InMemory holds
// features and labels in slices; Blobs draws a synthetic set) whose global
// batches a distributed Sampler gives (each data-parallel rank its rows;
// epochs; seeded shuffling, the same on every rank; State and Restore),
// with a learning-rate Schedule (Constant, WarmupCosine, WarmupLinear),
// gradient accumulation under the reducers' NoSync (DDP, FSDP; SyncGrads
// for other axes), clipping (optim.ClipGradNorm), evaluation every N steps
// (Evaluate, ClassMetrics, ClassifierEval), a progress line (a live bar on
// a terminal) and JSON-lines metrics. Item reads a scalar loss. A
// language model trains on a user's token file (OpenTokens: a text file as
// bytes, nanoGPT's and llm.c's uint16 files) cut into Windows of T+1
// tokens, with a held-out split (Windows.Split) and ValLoss.
//
// Run is the loop that the example programs (examples/transformer and
// examples/moe) share, public so that a program of one's own can copy
// it: Run starts this process's ranks as its
// launch.Job says (in-process ranks on comm/local, or this process's one
// rank under mpirun, loomrun or torchrun),
// builds each rank's Stepper, runs and times the steps, reports rank 0's
// progress, traces the last steps and returns rank 0's results with the
// median throughput. Loop describes the run and checks it before any rank
// starts; Flags are the common command-line flags (-threads, -bind,
// -trace, -trace-steps, -json, -backend, -peak, -device) and Loop.RegisterLoop adds
// -steps and -every; ShapeFlags are the model-shape flags (-model and the
// fields that override its preset). The pieces Run is made of are public
// too: one BLAS whose thread pool the ranks share (LoadBLAS), the Tracer
// with the part of the communication hidden behind compute (Overlap), the
// median-step throughput and the JSON summary (WriteJSON). MFU is the
// model FLOPs utilization the examples print: FlopsPerToken (PaLM's
// formula) over a peak from DevicePeak (a table of GPU datasheet figures
// by device name and Precision), HostPeak (the CPUs' estimate) or -peak
// (Loop.JobPeak).
package train

import (
	"cmp"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/local"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/kernels"
	"github.com/b7ea7098/loom/launch"
	"github.com/b7ea7098/loom/trace"
)

// Flags are the command-line flags common to the example training
// programs.
type Flags struct {
	// Threads is -threads: GEMM threads per rank, 0 for the CPUs shared
	// among the ranks (see Threads).
	Threads int
	// TracePath is -trace: where to write the Chrome trace, empty for no
	// trace.
	TracePath string
	// TraceSteps is -trace-steps: how many of the last steps to trace.
	TraceSteps int
	// JSONPath is -json: where to write the run's summary, empty for none.
	JSONPath string
	// Bind is -bind: bind each rank to CPUs of its own (in-process ranks
	// only).
	Bind bool
	// Backend is -backend: local, mpi, nccl or tcp, empty to decide from
	// launch.BackendEnv and how the program was launched (launch.Detect).
	Backend string
	// Peak is -peak: the peak of one device in TFLOP/s for the MFU line
	// (one GPU, or the CPUs of one host's ranks), 0 for the table or
	// estimate (Loop.JobPeak).
	Peak float64
	// Device is -device: where the ranks compute, cpu (the default), emu
	// or cuda (DeviceCPU, DeviceEmu, DeviceCUDA); Run gives each rank its
	// device (Rank.Device).
	Device string
	// MP is -mp: "" computes in float32; "bf16" is autocast (every
	// rank's tape WithAutocast: GEMMs in bfloat16 with float32
	// accumulation, float32 master weights, reductions and optimizer
	// state), and with FSDP also its bfloat16 gathers (the program's
	// part).
	MP string
	// TF32 is -tf32: let cuBLAS multiply float32 GEMMs in TF32
	// (CUBLAS_COMPUTE_32F_FAST_TF32), like PyTorch's
	// torch.backends.cuda.matmul.allow_tf32; off by default, and
	// without effect off -device cuda.
	TF32 bool
}

// Register defines the flags on fs, storing their values in f.
func (f *Flags) Register(fs *flag.FlagSet) {
	fs.IntVar(&f.Threads, "threads", 0, "GEMM threads per rank (default: the CPUs shared among the ranks)")
	fs.StringVar(&f.TracePath, "trace", "", "write a Chrome trace (Perfetto, chrome://tracing) of every rank to this file")
	fs.IntVar(&f.TraceSteps, "trace-steps", 3, "with -trace, how many of the last steps to trace")
	fs.StringVar(&f.JSONPath, "json", "", "write the run's summary as JSON to this file")
	fs.BoolVar(&f.Bind, "bind", false, "bind each rank to CPUs of its own (needs as many CPUs as ranks; default: "+local.BindEnv+")")
	fs.StringVar(&f.Backend, "backend", "", "how ranks run: local (goroutines of this process), mpi (under mpirun; build with -tags mpi), nccl or tcp (under loomrun or torchrun: one process per GPU, or pure-Go TCP between CPU processes); default: "+launch.BackendEnv+", else how the program was launched (under loomrun or torchrun: nccl where the CUDA driver finds a GPU, tcp elsewhere)")
	fs.StringVar(&f.Device, "device", DeviceCPU, "where the ranks compute: cpu (the host), emu (an emulated device per rank: the device code path on the CPU, the host's results bit for bit) or cuda (each rank's GPU, on the NCCL backend under loomrun or torchrun)")
	fs.StringVar(&f.MP, "mp", "", "mixed precision: bf16 computes the matrix products in bfloat16 with float32 accumulation (autocast; float32 master weights, gradients, reductions and optimizer state), and with -fsdp also gathers parameters in bfloat16")
	fs.BoolVar(&f.TF32, "tf32", false, "let cuBLAS compute float32 matrix products in TF32 on tensor cores (-device cuda; like PyTorch's allow_tf32)")
	fs.Float64Var(&f.Peak, "peak", 0, "peak of one device in TFLOP/s for the MFU line: one GPU, or the CPUs one host's ranks use (default: the GPU's datasheet figure, or the CPUs' estimate)")
}

// Job decides how this process takes part in a job of ranks ranks, from
// -backend and the environment (launch.Detect over os.Getenv), and checks
// that it can start (Job.Check: the backend's libraries load), before
// anything starts.
func (f Flags) Job(ranks int) (*launch.Job, error) {
	job, err := launch.Detect(os.Getenv, f.Backend, ranks)
	if err != nil {
		return nil, err
	}
	if err := job.Check(); err != nil {
		return nil, err
	}
	return job, nil
}

// RunOptions are the local.Run options the flags ask for: CPU binding with
// -bind, else whatever local.BindEnv says.
func (f Flags) RunOptions() []local.Option {
	if f.Bind {
		return []local.Option{local.WithCPUBinding(true)}
	}
	return nil
}

// Threads returns the GEMM threads per rank: override when it is
// positive, otherwise cpus shared among ranks, at least 1.
func Threads(override, ranks, cpus int) int {
	if override > 0 {
		return override
	}
	return max(1, cpus/max(1, ranks))
}

// LoadBLAS loads the BLAS that ranksInProcess ranks of this process
// share, its thread pool sized by Threads(threads, ranksInProcess,
// runtime.NumCPU()) so that ranks × threads ≈ CPUs (an oversubscribed or
// shared pool serialises the ranks' GEMMs), and prints its configuration
// and why it was chosen to out. Unless LOOM_BLAS forces a backend, several
// in-process ranks get loom's GEMM, which scales across them, and one rank
// a CBLAS library such as OpenBLAS when one loads
// (kernels.WithRanksInProcess); a process that is one rank of a
// multi-process job passes 1, and its share of the CPUs as threads.
func LoadBLAS(out io.Writer, threads, ranksInProcess int) (*kernels.BLAS, error) {
	blas, err := kernels.Load(kernels.WithThreads(Threads(threads, ranksInProcess, runtime.NumCPU())), kernels.WithRanksInProcess(ranksInProcess))
	if err != nil {
		return nil, err
	}
	fmt.Fprintf(out, "GEMM: %s, %d thread(s) per rank (%s)\n", blas.Config(), blas.Threads(), blas.Reason())
	return blas, nil
}

// MedianTokensPerS returns tokens over the median of the step times (robust
// to a noisy machine's outliers), or 0 without steps. It sorts stepTimes.
func MedianTokensPerS(tokens float64, stepTimes []time.Duration) float64 {
	if len(stepTimes) == 0 {
		return 0
	}
	slices.Sort(stepTimes)
	return tokens / stepTimes[len(stepTimes)/2].Seconds()
}

// WriteJSON writes v, indented, to path; an empty path writes nothing.
// The file is replaced at once (a temporary file in the same folder,
// renamed), so a reader, or a run that ends meanwhile, sees the old file
// or the whole new one, never part of it. In a job of several processes
// call it on one only (launch.Job.Root, as the examples do), the process
// that holds the results.
func WriteJSON(path string, v any) error {
	if path == "" {
		return nil
	}
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	f, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".tmp*")
	if err != nil {
		return err
	}
	// fail abandons the temporary file: err is the failure, and closing
	// and removing the file are only tidying.
	fail := func(err error) error {
		_ = f.Close()
		_ = os.Remove(f.Name())
		return err
	}
	if _, err := f.Write(append(b, '\n')); err != nil {
		return fail(err)
	}
	if err := f.Chmod(0o644); err != nil { // CreateTemp makes files private
		return fail(err)
	}
	if err := f.Close(); err != nil {
		return fail(err)
	}
	if err := os.Rename(f.Name(), path); err != nil {
		_ = os.Remove(f.Name()) // tidying, as in fail
		return err
	}
	return nil
}

// StepSpan prefixes the name of the trace span of each training step.
const StepSpan = "step "

// Tracer traces the last steps of a run of every rank on one timeline.
// A Tracer made without a path traces nothing, at no cost.
type Tracer struct {
	tl          *trace.Timeline // nil: not tracing
	path        string
	steps, last int
	first       int // the lowest rank on this process's timeline, which resets it
}

// NewTracer returns a Tracer that writes to path the last of steps
// training steps, or one that traces nothing when path is empty. first is
// the lowest world rank this process holds (launch.Job.Rank): 0 for
// in-process ranks, which share the Tracer's timeline; with one rank per
// process each process traces on its own timeline, and Gather merges them.
func NewTracer(path string, steps, last, first int) *Tracer {
	t := &Tracer{path: path, steps: steps, last: last, first: first}
	if path != "" {
		t.tl = trace.NewTimeline()
	}
	return t
}

// Enabled reports whether t traces.
func (t *Tracer) Enabled() bool { return t.tl != nil }

// FirstTraced is the 1-based number of the first traced step.
func (t *Tracer) FirstTraced() int { return max(1, t.steps-t.last+1) }

// Rank returns the tracing of c's rank; call it in the rank's goroutine
// before building anything on c, and use Comm in place of c.
func (t *Tracer) Rank(c comm.Communicator) *RankTracer {
	rank := c.Rank()
	return &RankTracer{t: t, rank: rank, c: trace.Comm(c, t.tl, rank)}
}

// RankTracer is the tracing of one rank: its traced communicator, its tape
// observer and its step spans.
type RankTracer struct {
	t       *Tracer
	rank    int
	c       comm.Communicator
	tracing atomic.Bool
	streams *trace.Streams // nil: no device streams traced
}

// OnDevice traces the rank's device streams too (trace.Streams): each
// traced op's execution on d's compute stream and each collective's on
// the communicator's stream (a device.StreamComm such as NCCL's), as the
// "stream compute" and "stream comm" tracks, read once at the end of each
// traced step (EndStep). It does nothing for the host device or when the
// Tracer traces nothing. Call it once, before the first step; Close
// releases the events.
func (r *RankTracer) OnDevice(d device.Device) {
	if r.t.tl == nil || r.streams != nil {
		return
	}
	r.streams = r.t.tl.Streams(r.rank, d)
}

// Close releases what OnDevice holds.
func (r *RankTracer) Close() error { return r.streams.Close() }

// Comm returns the rank's communicator, traced when the Tracer traces.
func (r *RankTracer) Comm() comm.Communicator { return r.c }

// Observer returns the tape observer that records the rank's ops from the
// first traced step on, or nil when the Tracer traces nothing.
func (r *RankTracer) Observer() autograd.Observer {
	if r.t.tl == nil {
		return nil
	}
	observe := r.t.tl.TapeObserver(r.rank)
	return func(op, phase string, start, end time.Time) {
		if r.tracing.Load() {
			observe(op, phase, start, end)
			r.streams.Op(op, phase, start)
		}
	}
}

// Tape returns opts with the rank's observer added when the Tracer traces.
func (r *RankTracer) Tape(opts ...autograd.Option) []autograd.Option {
	if obs := r.Observer(); obs != nil {
		opts = append(opts, autograd.WithObserver(obs))
	}
	return opts
}

// BeginStep opens the span of step i+1 (i counts from 0); End it when the
// step is done. Before the first traced step every rank must call it: all
// arrive, rank 0 drops what was recorded so far, and all start together,
// so that only the last steps are kept (with one rank per process, every
// rank drops what its own timeline recorded).
func (r *RankTracer) BeginStep(ctx context.Context, i int) (trace.Span, error) {
	if r.t.tl != nil && i+1 == r.t.FirstTraced() {
		if err := comm.Barrier(ctx, r.c); err != nil {
			return trace.Span{}, err
		}
		if r.rank == r.t.first {
			r.t.tl.Reset()
		}
		if err := comm.Barrier(ctx, r.c); err != nil {
			return trace.Span{}, err
		}
		r.tracing.Store(true)
	}
	if r.tracing.Load() {
		if err := r.streams.Begin(); err != nil {
			return trace.Span{}, fmt.Errorf("train: -trace: %w", err)
		}
	}
	return r.t.tl.Begin(r.rank, fmt.Sprintf("%s%d", StepSpan, i+1)), nil
}

// EndStep ends the step span of BeginStep and, on a device (OnDevice),
// reads the step's stream events: the step's one synchronisation of the
// device for tracing.
func (r *RankTracer) EndStep(span trace.Span) error {
	span.End()
	if err := r.streams.End(); err != nil {
		return fmt.Errorf("train: -trace: %w", err)
	}
	return nil
}

// Gather merges, on world rank 0, the timelines of a job whose processes
// each traced on their own (launch.Job.Processes > 1); c is the rank's
// untraced world communicator. It is collective over c and does nothing
// when t traces nothing.
func (t *Tracer) Gather(ctx context.Context, c comm.Communicator) error {
	if t.tl == nil {
		return nil
	}
	return trace.Gather(ctx, c, t.tl, 0)
}

// Write writes the Chrome trace to the Tracer's path, says so on out and
// returns the recorded events, for Overlap. A Tracer that traces nothing
// writes nothing and returns no events.
func (t *Tracer) Write(out io.Writer) ([]trace.Event, error) {
	if t.tl == nil {
		return nil, nil
	}
	if err := t.tl.WriteChromeFile(t.path); err != nil {
		return nil, err
	}
	fmt.Fprintf(out, "trace of the last %d step(s) written to %s (open it at https://ui.perfetto.dev or chrome://tracing)\n", min(t.last, t.steps), t.path)
	return t.tl.Events(), nil
}

// Overlap measures the union of rank's comm events that isComm accepts and
// the part of it during which the rank computed (tape ops and hooks). The
// step spans are left out of the compute: they cover the whole step,
// communication included, and would make everything look hidden. On a
// device the stream lanes (trace.Streams: when the device ran the work)
// replace the host lanes (when it was queued): stream comm events, where
// the rank has any, are its communication, and stream compute events,
// where it has any, its compute; collectives run by the host (not on a
// device stream) keep their comm events.
func Overlap(events []trace.Event, rank int, isComm func(trace.Event) bool) trace.OverlapStats {
	var commIv, compIv, streamComm, streamComp [][2]time.Duration
	onStream := false
	for _, e := range events {
		iv := [2]time.Duration{e.Start, e.End}
		switch {
		case e.Rank != rank:
		case e.Lane == trace.LaneStreamComm:
			onStream = true
			if isComm(e) {
				streamComm = append(streamComm, iv)
			}
		case e.Lane == trace.LaneStreamCompute:
			streamComp = append(streamComp, iv)
		case e.Lane == trace.LaneComm && isComm(e):
			commIv = append(commIv, iv)
		case e.Lane == trace.LaneCompute && !strings.HasPrefix(e.Name, StepSpan):
			compIv = append(compIv, iv)
		}
	}
	if onStream {
		commIv = streamComm
	}
	if len(streamComp) > 0 {
		compIv = streamComp
	}
	c, k := union(commIv), union(compIv)
	var s trace.OverlapStats
	for _, v := range c {
		s.Comm += v[1] - v[0]
	}
	for i, j := 0, 0; i < len(c) && j < len(k); {
		if lo, hi := max(c[i][0], k[j][0]), min(c[i][1], k[j][1]); hi > lo {
			s.Hidden += hi - lo
		}
		if c[i][1] < k[j][1] {
			i++
		} else {
			j++
		}
	}
	return s
}

// union merges intervals into sorted disjoint ones, dropping empty ones.
func union(iv [][2]time.Duration) [][2]time.Duration {
	slices.SortFunc(iv, func(a, b [2]time.Duration) int { return cmp.Compare(a[0], b[0]) })
	var out [][2]time.Duration
	for _, v := range iv {
		if v[1] <= v[0] {
			continue
		}
		if n := len(out); n > 0 && v[0] <= out[n-1][1] {
			out[n-1][1] = max(out[n-1][1], v[1])
			continue
		}
		out = append(out, v)
	}
	return out
}
