// Command loombench measures loom's collectives the way nccl-tests measures
// NCCL's: for a series of sizes it times each operation, and prints the
// size, count, time, algorithm bandwidth (bytes over time) and bus bandwidth
// (algorithm bandwidth times the operation's factor: AllReduce 2(p-1)/p,
// AllGather, ReduceScatter, AllToAll and AllToAllV (p-1)/p, the others 1),
// against the machine's memory-copy bandwidth as the ceiling. One extra
// checked iteration per size counts wrong elements against a serial
// reference.
//
// Usage:
//
//	loombench [flags]
//
// For example:
//
//	loombench -ranks 4 -op allreduce,allgather -b 8 -e 64M -f 2 -csv out.csv
//
// After the warmup iterations (for auto on the local backend, plus
// local.MaxTuningCalls, which its online tuning may spend timing
// candidates), every rank times each iteration on its own
// (the ranks run in lockstep through the operation); an iteration counts as
// the slowest rank's time, and the table shows the median over iterations
// (the CSV also the minimum). With -compare N, the variants take turns,
// each round timing its -iters calls as one loop (as nccl-tests does), and
// the table shows the median over the N rounds. With one rank per process
// (-backend mpi under mpirun, -backend tcp under loomrun), only the
// process of rank 0 prints the tables and writes -csv, replacing
// the file at once (a temporary file renamed) so that it is complete or
// absent. Exit status is 1 if any element was wrong or any operation
// failed, 2 on bad flags.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"sync"
	"time"

	"github.com/b7ea7098/loom/comm"
)

// config is the parsed command line.
type config struct {
	backend  string
	ops      []benchOp
	ranks    int
	ranksSet bool // -ranks was given
	sizes    []int64
	dtype    comm.DType
	redop    comm.ReduceOp
	algos    []string
	root     int
	iters    int
	warmup   int
	inplace  bool
	check    bool
	csvPath  string
	timeout  time.Duration
	copySize int // bytes of the ceiling measurement
	opNames  string
	algoFlag string
	compare  int // rounds of the comparison mode; 0 for the usual tables
}

// parseFlags parses args (without the program name).
func parseFlags(args []string, stderr io.Writer) (*config, error) {
	fs := flag.NewFlagSet("loombench", flag.ContinueOnError)
	fs.SetOutput(stderr)
	cfg := &config{}
	var minS, maxS, dtype, redop string
	var factor int64
	fs.StringVar(&cfg.backend, "backend", "local", "communication backend: local (in-process ranks); tcp, started by loomrun or torchrun (one rank per process, pure Go); or mpi in a binary built with -tags mpi and started by mpirun (one rank per process)")
	fs.StringVar(&cfg.opNames, "op", "allreduce", "comma list of allreduce, allgather, reducescatter, broadcast, reduce, alltoall, alltoallv, sendrecv")
	fs.IntVar(&cfg.ranks, "ranks", 2, "number of ranks")
	fs.StringVar(&minS, "b", "8", "minimum size in bytes (K, M, G suffixes are powers of 1024)")
	fs.StringVar(&maxS, "e", "64M", "maximum size in bytes")
	fs.Int64Var(&factor, "f", 2, "size multiplication factor")
	fs.StringVar(&dtype, "dtype", "float32", "element type: float32, float64, bfloat16, float16, int32, int64, uint8")
	fs.StringVar(&redop, "redop", "sum", "reduction: sum, avg, prod, min, max")
	fs.StringVar(&cfg.algoFlag, "algo", "auto", "algorithm: auto, an algorithm name, a comma list, or all")
	fs.IntVar(&cfg.root, "root", 0, "root rank of broadcast and reduce")
	fs.IntVar(&cfg.iters, "iters", 20, "timed iterations per size")
	fs.IntVar(&cfg.warmup, "warmup", 5, "untimed warmup iterations per size (auto on the local backend adds the calls its online tuning may take)")
	fs.BoolVar(&cfg.inplace, "inplace", false, "also measure in place (allreduce, allgather, reducescatter, broadcast)")
	fs.BoolVar(&cfg.check, "check", true, "run one extra iteration per size and count wrong elements")
	fs.StringVar(&cfg.csvPath, "csv", "", "also write results as CSV to this file")
	fs.IntVar(&cfg.compare, "compare", 0, "instead of tables, compare auto with every forced algorithm: this many rounds per size, algorithms interleaved, each round timing -iters calls as one loop; medians over the rounds")
	fs.DurationVar(&cfg.timeout, "timeout", 0, "give up after this long, and bound each call by it (0: no overall limit, calls bounded by LOOM_TIMEOUT or 10m)")
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "usage: loombench [flags]\n\nBenchmarks loom's collectives in the manner of nccl-tests.\n\n")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	fs.Visit(func(f *flag.Flag) { cfg.ranksSet = cfg.ranksSet || f.Name == "ranks" })
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected arguments: %s", strings.Join(fs.Args(), " "))
	}
	var err error
	if cfg.ops, err = parseOps(cfg.opNames); err != nil {
		return nil, err
	}
	lo, err := parseSize(minS)
	if err != nil {
		return nil, fmt.Errorf("-b: %w", err)
	}
	hi, err := parseSize(maxS)
	if err != nil {
		return nil, fmt.Errorf("-e: %w", err)
	}
	if cfg.sizes, err = sizeSeries(lo, hi, factor); err != nil {
		return nil, err
	}
	if cfg.dtype, err = comm.ParseDType(dtype); err != nil {
		return nil, err
	}
	if cfg.redop, err = comm.ParseReduceOp(redop); err != nil {
		return nil, err
	}
	for _, a := range strings.Split(cfg.algoFlag, ",") {
		if a = strings.TrimSpace(a); a != "" {
			cfg.algos = append(cfg.algos, a)
		}
	}
	if len(cfg.algos) == 0 {
		cfg.algos = []string{"auto"}
	}
	switch {
	case cfg.ranks < 1:
		return nil, fmt.Errorf("-ranks %d: need at least 1", cfg.ranks)
	case cfg.root < 0 || cfg.root >= cfg.ranks:
		return nil, fmt.Errorf("-root %d: out of range [0,%d)", cfg.root, cfg.ranks)
	case cfg.iters < 1:
		return nil, fmt.Errorf("-iters %d: need at least 1", cfg.iters)
	case cfg.warmup < 0:
		return nil, fmt.Errorf("-warmup %d: must not be negative", cfg.warmup)
	case cfg.timeout < 0:
		return nil, fmt.Errorf("-timeout %v: must not be negative", cfg.timeout)
	case cfg.compare < 0:
		return nil, fmt.Errorf("-compare %d: must not be negative", cfg.compare)
	}
	cfg.copySize = 256 << 20
	return cfg, nil
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// run is the whole command; it returns the exit status.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	cfg, err := parseFlags(args, stderr)
	if errors.Is(err, flag.ErrHelp) {
		return 0
	}
	if err != nil {
		fmt.Fprintf(stderr, "loombench: %v\n", err)
		return 2
	}
	be, err := lookupBackend(cfg.backend)
	if err != nil {
		fmt.Fprintf(stderr, "loombench: %v\n", err)
		return 2
	}
	return bench(ctx, cfg, be, stdout, stderr)
}

// bench runs the measurements cfg asks for on be; it returns the exit
// status. With one rank per process, every process runs it, and only the
// one holding rank 0 prints the tables and writes -csv: the rows are
// built on rank 0, and the other processes have none to write.
func bench(ctx context.Context, cfg *config, be backend, stdout, stderr io.Writer) int {
	writer := true // this process writes -csv
	opts, err := comm.OptionsFromEnv()
	if err != nil {
		fmt.Fprintf(stderr, "loombench: %v\n", err)
		return 2
	}
	if be.finish != nil {
		defer func() {
			if err := be.finish(); err != nil {
				fmt.Fprintf(stderr, "loombench: %v\n", err)
			}
		}()
	}
	if be.world != nil {
		// One rank per process: the job's size is the rank count, and
		// only rank 0 prints.
		size, rank, err := be.world()
		if err != nil {
			fmt.Fprintf(stderr, "loombench: %v\n", err)
			return 2
		}
		if cfg.ranksSet && cfg.ranks != size {
			fmt.Fprintf(stderr, "loombench: -ranks %d, but the job has %d processes\n", cfg.ranks, size)
			return 2
		}
		cfg.ranks = size
		if cfg.root >= size {
			fmt.Fprintf(stderr, "loombench: -root %d: out of range [0,%d)\n", cfg.root, size)
			return 2
		}
		if rank != 0 {
			stdout, writer = io.Discard, false
		}
	}

	fmt.Fprintf(stdout, "# loombench: backend=%s ranks=%d op=%s dtype=%v redop=%v algo=%s iters=%d warmup=%d\n",
		cfg.backend, cfg.ranks, cfg.opNames, cfg.dtype, cfg.redop, cfg.algoFlag, cfg.iters, cfg.warmup)
	ceiling := copyBandwidth(cfg.copySize, 5) / 1e9
	fmt.Fprintf(stdout, "# copy bandwidth (ceiling): %.1f GB/s\n", ceiling)

	if cfg.timeout > 0 {
		opts.Timeout = cfg.timeout
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, cfg.timeout)
		defer cancel()
	}

	if cfg.compare > 0 {
		return compareAll(ctx, cfg, be, opts, stdout)
	}

	var errCount int
	var wrongTotal int64
	fail := func(err error) {
		errCount++
		for _, e := range rootCauses(err) {
			fmt.Fprintf(stdout, "# error: %v\n", e)
		}
	}
	var records [][]string
	var mu sync.Mutex // emit runs on rank 0's goroutine
	blocks := 0
	for _, op := range cfg.ops {
		algos, err := resolveAlgorithms(cfg.algos, op, be)
		if err != nil {
			fail(err)
			continue
		}
		if op.op == comm.OpSend && cfg.ranks < 2 {
			fmt.Fprintf(stdout, "# sendrecv: skipped, it needs at least 2 ranks\n")
			continue
		}
		for _, algo := range algos {
			if ctx.Err() != nil {
				fail(fmt.Errorf("%v: %w", op, context.Cause(ctx)))
				break
			}
			j := newJob(cfg, op, algo)
			if algo == comm.Auto {
				j.warmup += be.tuningCalls
			}
			if len(cfg.ops) > 1 || len(algos) > 1 || blocks > 0 {
				fmt.Fprintf(stdout, "#\n# op=%v algo=%v\n", op, algo)
			}
			blocks++
			fmt.Fprint(stdout, header(j.inplace && op.inPlace()))
			var stats tableStats
			var rows []row
			err := runJob(ctx, be, opts, j, func(r row) {
				mu.Lock()
				defer mu.Unlock()
				fmt.Fprint(stdout, r.format(ceiling))
				stats.add(r)
				rows = append(rows, r)
				records = append(records, r.csvRecords(cfg.backend)...)
			})
			mu.Lock()
			if err != nil {
				fail(err)
			}
			fmt.Fprint(stdout, stats.footer(cfg.check))
			if algo == comm.Auto {
				if s := choices(rows); s != "" {
					fmt.Fprintf(stdout, "# auto chose: %s\n", s)
				}
			}
			wrongTotal += stats.wrong
			mu.Unlock()
		}
	}
	if cfg.csvPath != "" && writer {
		if err := writeCSV(cfg.csvPath, records); err != nil {
			fmt.Fprintf(stderr, "loombench: writing %s: %v\n", cfg.csvPath, err)
			return 1
		}
	}
	if errCount > 0 || wrongTotal > 0 {
		fmt.Fprintf(stderr, "loombench: FAILED: %d failed runs, %d wrong elements (see # error lines)\n", errCount, wrongTotal)
		return 1
	}
	return 0
}

// newJob builds the job measuring op with algo under cfg.
func newJob(cfg *config, op benchOp, algo comm.Algorithm) *job {
	j := &job{
		op: op, algo: algo, dtype: cfg.dtype, redop: cfg.redop, root: cfg.root,
		ranks: cfg.ranks, iters: cfg.iters, warmup: cfg.warmup,
		inplace: cfg.inplace, check: cfg.check,
	}
	for _, s := range cfg.sizes {
		j.shapes = append(j.shapes, shapeOf(op, s, cfg.dtype.Size(), cfg.ranks))
	}
	return j
}
