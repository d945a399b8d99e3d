// Package local is loom's in-process backend: p ranks are goroutines of one
// process and data moves through shared memory, each element copied once,
// straight from the buffer where a peer holds it. It is the default backend
// of every example and test, and the reference the other backends are
// checked against.
//
// Collectives are compiled into per-rank schedules (see schedule.go) by
// the classic algorithms: ring, recursive doubling, Rabenseifner's halving
// and doubling, binary and double binary trees, a two-level hierarchical
// form, and direct reads. The algorithm is chosen per call from a cost
// model measured on the machine, refined by timing the close candidates on
// the first calls of each size class (see Tuning below), or forced per call
// or with LOOM_ALGO.
//
// # Calibration
//
// A world given no cost model (by WithCostModel or comm.Options.CostModel)
// uses MachineModel. The first time in a process, that reads the file
// comm.CostModelFile names, by default loom/costmodel.json in the user
// cache folder ($XDG_CACHE_HOME/loom or ~/.cache/loom on Linux), and uses the
// model in it if it was measured on the same CPU model, CPU count, OS,
// architecture and GOMAXPROCS, by the same Go version and algorithm set.
// Otherwise Calibrate measures, for about a second and with 96
// MiB of buffers: the latency of a handoff between two spinning goroutines,
// and between two that share a core (setting GOMAXPROCS to 1 for about a
// millisecond); one core's copy and float32-sum time per byte from memory,
// with and without streaming stores, and within the cache; and the copy
// bandwidth of all cores together. Each is timed seven times and the
// fastest confirmed sample kept, since other work only adds time. It reads
// the last-level cache size from sysfs. A parameter more than ten times
// off the built-in model's is replaced by the built-in value. The model is
// then written to that file (if it cannot be, or the samples varied so
// much that the machine was evidently busy, the next process measures
// again) and kept for the rest of the process.
//
// The environment variable comm.CostModelEnv (LOOM_COSTMODEL) changes this:
// a path moves the file; comm.CostModelOff ("off", or "none") turns measuring
// off: nothing is measured, read or written and comm.BuiltinCostModel is
// used. WithCostModel(comm.BuiltinCostModel()) does the same for one world.
//
// # Tuning
//
// Where the model prices several algorithms of a call within 50% of each
// other, and the best at 10 µs or more, the first calls of its size class (op, dtype, power of two of the
// count) run each of them, timed from the last rank starting to move data
// to the last departing, each timed call after an untimed one of the same
// algorithm: once, then up to three more times (five under 256 KiB) for
// those within three, then twice the best time (at most MaxTuningCalls
// calls). Later calls keep the fastest by median, or the model's choice
// unless another beat it by over 20%. Every rank takes the same decision
// from shared timings, so the ranks never disagree on an algorithm. By
// default (TuneExact) only calls whose result bits no algorithm can change
// are tuned: copies, integer reductions and float sums and products over
// two ranks. Float reductions over more ranks add in an order that depends
// on the algorithm, so tuning them (TuneAll, LOOM_TUNE=all) can change
// their last bits from one run to the next; TuneOff (LOOM_TUNE=off) tunes
// nothing, and LOOM_ALGO forces algorithms.
package local

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"runtime/debug"
	"sync"
	"sync/atomic"

	"github.com/b7ea7098/loom/comm"
)

// Option configures NewWorld and Run.
type Option func(*config)

type config struct {
	opts          comm.Options
	optsSet       bool
	model         *comm.CostModel
	bind, bindSet bool // Run only
	bound         bool // set by Run when it binds the ranks
	tune          Tuning
	tuneSet       bool
}

// WithOptions sets the communicator options. Without it, comm.OptionsFromEnv
// supplies them.
func WithOptions(o comm.Options) Option {
	return func(c *config) { c.opts, c.optsSet = o, true }
}

// WithCostModel sets the model that drives the automatic algorithm choice,
// in place of comm.Options.CostModel and of MachineModel: nothing is then
// measured, read or written. A nil m restores the default.
func WithCostModel(m *comm.CostModel) Option {
	return func(c *config) { c.model = m }
}

// World is p in-process ranks sharing one failure domain.
type World struct {
	w     *world
	comms []*Comm
}

// NewWorld creates the world communicator of p ranks. Each rank's handle is
// Comm(rank); drive each from its own goroutine.
func NewWorld(p int, opts ...Option) (*World, error) {
	if p < 1 {
		return nil, fmt.Errorf("local: world size %d, want at least 1", p)
	}
	var cfg config
	for _, o := range opts {
		o(&cfg)
	}
	if !cfg.optsSet {
		o, err := comm.OptionsFromEnv()
		if err != nil {
			return nil, fmt.Errorf("local: %w", err)
		}
		cfg.opts = o
	}
	o := cfg.opts.WithDefaults()
	model := o.CostModel
	if cfg.model != nil {
		model = cfg.model
	}
	if model == nil {
		model = MachineModel()
	}
	if !model.Valid() {
		return nil, fmt.Errorf("local: invalid cost model %+v", *model)
	}
	tune, err := cfg.tuning()
	if err != nil {
		return nil, err
	}
	w := &world{
		opts: o, model: model, cores: runtime.GOMAXPROCS(0), bound: cfg.bound, tune: tune, failed: make(chan struct{}),
		left: make([]atomic.Bool, p), leftCh: make(chan struct{}),
	}
	ranks := make([]int, p)
	for i := range ranks {
		ranks[i] = i
	}
	g := newGroup(w, worldName, ranks)
	wd := &World{w: w, comms: make([]*Comm, p)}
	for r := range wd.comms {
		wd.comms[r] = newComm(g, r)
	}
	return wd, nil
}

// Size is the number of ranks.
func (wd *World) Size() int { return len(wd.comms) }

// Comm returns rank's handle on the world communicator.
func (wd *World) Comm(rank int) *Comm { return wd.comms[rank] }

// Leave records that rank has finished for good: calls of other ranks
// that wait for it then fail at once with ErrRankLeft instead of timing
// out. Run calls it when a rank's function returns.
func (wd *World) Leave(rank int) { wd.w.leave(rank) }

// Abort fails every pending and later call on every communicator of the
// world, naming rank as the one that aborted.
func (wd *World) Abort(rank int, cause error) {
	wd.w.abort(&comm.AbortError{Rank: rank, Cause: cause})
}

// worldName is the name of a world's own communicator; splits extend it.
const worldName = "world"

// RankFunc is the body one rank runs.
type RankFunc func(ctx context.Context, c comm.Communicator) error

// Run runs fn on p ranks, each in its own goroutine (bound to CPUs of its
// own with WithCPUBinding) with its handle on a fresh world communicator,
// and returns the ranks' errors joined (each prefixed with its rank). When a rank returns an error or panics, the world
// is aborted and the shared context cancelled, so every other rank's
// pending and later calls fail at once with an error naming it; when a rank
// returns early without error, calls that wait for it fail with
// ErrRankLeft.
func Run(ctx context.Context, p int, fn RankFunc, opts ...Option) error {
	var cfg config
	for _, o := range opts {
		o(&cfg)
	}
	bind, err := cfg.binding(p)
	if err != nil {
		return err
	}
	var shares [][]int
	if bind && p >= 1 {
		if shares, err = cpuShares(p); err != nil {
			return err
		}
	}
	if shares != nil {
		opts = append(opts[:len(opts):len(opts)], func(c *config) { c.bound = true })
	}
	wd, err := NewWorld(p, opts...)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	errs := make([]error, p)
	var wg sync.WaitGroup
	for r := 0; r < p; r++ {
		wg.Add(1)
		go func(r int) {
			defer wg.Done()
			var err error
			if shares != nil {
				var unbind func()
				if unbind, err = bindThread(shares[r]); err == nil {
					defer unbind()
				} else {
					err = fmt.Errorf("binding to CPUs %v: %w", shares[r], err)
				}
			}
			if err == nil {
				err = runRank(ctx, wd.Comm(r), fn)
			}
			if err != nil {
				// Abort before leaving, so peers report the cause, not
				// merely that this rank left.
				errs[r] = fmt.Errorf("rank %d: %w", r, err)
				wd.Abort(r, err)
				cancel()
			}
			wd.Leave(r)
		}(r)
	}
	wg.Wait()
	return errors.Join(errs...)
}

func runRank(ctx context.Context, c *Comm, fn RankFunc) (err error) {
	defer func() {
		if v := recover(); v != nil {
			err = fmt.Errorf("panic: %v\n%s", v, debug.Stack())
		}
	}()
	return fn(ctx, c)
}
