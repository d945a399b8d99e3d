package main

import (
	"context"
	"fmt"
	"io"
	"slices"
	"strings"
	"time"

	"github.com/b7ea7098/loom/comm"
)

// variant is one (operation, algorithm) pair the comparison mode measures.
type variant struct {
	op   benchOp
	algo comm.Algorithm
}

func (v variant) String() string {
	if v.algo == comm.Auto {
		return v.op.String()
	}
	return v.algo.String()
}

// compareAll is the -compare mode. With one op it measures auto and every
// algorithm the backend can force, and reports auto against the best
// forced one; with several ops it measures each op (auto) and reports bus
// bandwidth relative to the first. Variants are interleaved in rounds at
// every size so that a noisy machine affects them alike. It returns the
// exit code.
func compareAll(ctx context.Context, cfg *config, be backend, opts comm.Options, out io.Writer) int {
	var groups [][]variant
	if len(cfg.ops) > 1 {
		var g []variant
		for _, op := range cfg.ops {
			g = append(g, variant{op, comm.Auto})
		}
		groups = append(groups, g)
	} else {
		op := cfg.ops[0]
		algos, err := resolveAlgorithms([]string{"all"}, op, be)
		if err != nil || op.op == comm.OpSend {
			fmt.Fprintf(out, "# %v: no algorithms to compare\n", op)
			return 1
		}
		var g []variant
		for _, a := range algos {
			g = append(g, variant{op, a})
		}
		groups = append(groups, g)
	}
	code := 0
	for _, vs := range groups {
		byOps := vs[0].op != vs[len(vs)-1].op
		what := "median time per call (us); auto chose; auto/best"
		if byOps {
			what = "median busbw (GB/s); ratio to the first op"
		}
		fmt.Fprintf(out, "#\n# ranks=%d rounds=%d iters=%d: %s\n", cfg.ranks, cfg.compare, cfg.iters, what)
		var head strings.Builder
		fmt.Fprintf(&head, "# %12s", "size")
		for _, v := range vs {
			fmt.Fprintf(&head, " %10.10s", v)
		}
		if byOps {
			head.WriteString("  ratios\n")
		} else {
			fmt.Fprintf(&head, "  %-18s %s\n", "chose", "auto/best")
		}
		fmt.Fprint(out, head.String())
		worst := 1.0
		for _, size := range cfg.sizes {
			shapes := make([]shape, len(vs))
			for i, v := range vs {
				shapes[i] = shapeOf(v.op, size, cfg.dtype.Size(), cfg.ranks)
			}
			times, chose, err := compareSize(ctx, cfg, be, opts, vs, shapes)
			if err != nil {
				fmt.Fprintf(out, "# error: size %d B: %v\n", size, err)
				code = 1
				continue
			}
			fmt.Fprintf(out, "  %12d", shapes[0].bytes)
			if byOps {
				bws := make([]float64, len(vs))
				for i, v := range vs {
					_, bws[i] = bandwidths(v.op, cfg.ranks, shapes[i].bytes, times[i].Seconds())
					fmt.Fprintf(out, " %10.2f", bws[i])
				}
				fmt.Fprint(out, " ")
				for i := 1; i < len(vs); i++ {
					r := bws[i] / bws[0]
					worst = min(worst, r)
					fmt.Fprintf(out, " %.2f", r)
				}
				fmt.Fprintln(out)
				continue
			}
			best := time.Duration(1<<63 - 1)
			for i, v := range vs {
				if v.algo != comm.Auto {
					best = min(best, times[i])
				}
			}
			ratio := float64(times[0]) / float64(best)
			worst = max(worst, ratio)
			for _, t := range times {
				fmt.Fprintf(out, " %10s", formatTime(t))
			}
			fmt.Fprintf(out, "  %-18s %.2f\n", chose, ratio)
		}
		if byOps {
			fmt.Fprintf(out, "# lowest ratio: %.2f\n", worst)
		} else {
			fmt.Fprintf(out, "# worst auto/best: %.2f\n", worst)
		}
	}
	return code
}

// compareSize measures one size: rounds of (warmup, timed iterations) for
// each variant in turn; auto's first warmup is longer by the backend's
// tuningCalls, so that its medians are of the algorithm it settles on, as
// the forced ones' are (its tuning is a cost paid once per size class).
// Each round times its iterations as one loop, as nccl-tests does: a
// round's time per call is the slowest rank's loop time over the
// iterations, which averages out the scheduling delays of single calls
// (large where ranks outnumber cores). It returns the median per variant
// over the rounds and what auto chose for the first variant.
func compareSize(ctx context.Context, cfg *config, be backend, opts comm.Options, vs []variant, shapes []shape) ([]time.Duration, string, error) {
	n := cfg.compare
	durs := make([][][]time.Duration, len(vs)) // [variant][rank][round]
	for i := range durs {
		durs[i] = make([][]time.Duration, cfg.ranks)
		for r := range durs[i] {
			durs[i][r] = make([]time.Duration, n)
		}
	}
	var chose string
	err := be.run(ctx, cfg.ranks, opts, func(ctx context.Context, c comm.Communicator) error {
		r := c.Rank()
		ls := make([]layout, len(vs))
		for i, v := range vs {
			sendLen, bufLen := bufferLens(v.op, shapes[i], r)
			send, err := comm.NewHostBuffer(cfg.dtype, sendLen)
			if err != nil {
				return err
			}
			buf, err := comm.NewHostBuffer(cfg.dtype, bufLen)
			if err != nil {
				return err
			}
			ls[i] = layoutFor(v.op, shapes[i], outOfPlace, r, c.Size(), cfg.root, send, buf)
			ls[i].call.Algorithm = v.algo
			if v.op.op.Reduces() {
				ls[i].call.Reduce = cfg.redop
			}
			ls[i].prepare(cfg.redop == comm.Prod, false)
		}
		for round := 0; round < cfg.compare; round++ {
			for i, v := range vs {
				warmup := cfg.warmup
				if v.algo == comm.Auto && round == 0 {
					warmup += be.tuningCalls
				}
				for range warmup {
					if err := ls[i].issue(ctx, c); err != nil {
						return fmt.Errorf("%v: %w", v, err)
					}
				}
				t0 := time.Now()
				for range cfg.iters {
					if err := ls[i].issue(ctx, c); err != nil {
						return fmt.Errorf("%v: %w", v, err)
					}
				}
				durs[i][r][round] = time.Since(t0) / time.Duration(cfg.iters)
				// Reading the flight recorder copies it under its lock:
				// once, after the last round, so that no timed round waits
				// for it.
				if i == 0 && v.algo == comm.Auto && r == 0 && round == cfg.compare-1 {
					chose = lastAlgorithm(c.Recorder(), v.op.op)
				}
			}
		}
		for i := range vs {
			if err := slowest(ctx, c, durs[i][r]); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return nil, "", err
	}
	out := make([]time.Duration, len(vs))
	for i := range vs {
		out[i] = median(slices.Clone(iterationTimes(durs[i])))
	}
	return out, chose, nil
}
