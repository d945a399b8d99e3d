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

// compareAll is the -compare mode: for each op and size it measures auto
// and every algorithm the backend can force, interleaved in rounds so that
// a noisy machine affects them alike, and prints each median with the
// ratio of auto to the best forced algorithm. It returns the exit code.
func compareAll(ctx context.Context, cfg *config, be backend, opts comm.Options, out io.Writer) int {
	code := 0
	for _, op := range cfg.ops {
		algos, err := resolveAlgorithms([]string{"all"}, op, be)
		if err != nil || op.op == comm.OpSend {
			fmt.Fprintf(out, "# %v: nothing to compare\n", op)
			continue
		}
		fmt.Fprintf(out, "#\n# op=%v ranks=%d rounds=%d iters=%d: median time per call (us); auto chose; auto/best\n", op, cfg.ranks, cfg.compare, cfg.iters)
		var head strings.Builder
		fmt.Fprintf(&head, "# %12s", "size")
		for _, a := range algos {
			fmt.Fprintf(&head, " %10.10s", a)
		}
		fmt.Fprintf(&head, "  %-18s %s\n", "chose", "auto/best")
		fmt.Fprint(out, head.String())
		worst := 0.0
		for _, size := range cfg.sizes {
			sh := shapeOf(op, size, cfg.dtype.Size(), cfg.ranks)
			times, chose, err := compareSize(ctx, cfg, be, opts, op, sh, algos)
			if err != nil {
				fmt.Fprintf(out, "# error: %v size %d B: %v\n", op, sh.bytes, err)
				code = 1
				continue
			}
			best := time.Duration(1<<63 - 1)
			for i, a := range algos {
				if a != comm.Auto {
					best = min(best, times[i])
				}
			}
			ratio := float64(times[0]) / float64(best)
			worst = max(worst, ratio)
			fmt.Fprintf(out, "  %12d", sh.bytes)
			for _, t := range times {
				fmt.Fprintf(out, " %10s", formatTime(t))
			}
			fmt.Fprintf(out, "  %-18s %.2f\n", chose, ratio)
		}
		fmt.Fprintf(out, "# worst auto/best: %.2f\n", worst)
	}
	return code
}

// compareSize measures one size: rounds of (warmup, timed iterations) for
// each algorithm in turn. It returns the median per algorithm over all
// rounds (an iteration's time is the slowest rank's) and what auto chose.
func compareSize(ctx context.Context, cfg *config, be backend, opts comm.Options, op benchOp, sh shape, algos []comm.Algorithm) ([]time.Duration, string, error) {
	n := cfg.compare * cfg.iters
	durs := make([][][]time.Duration, len(algos)) // [algo][rank][iteration]
	for i := range durs {
		durs[i] = make([][]time.Duration, cfg.ranks)
		for r := range durs[i] {
			durs[i][r] = make([]time.Duration, n)
		}
	}
	var chose string
	err := be.run(ctx, cfg.ranks, opts, func(ctx context.Context, c comm.Communicator) error {
		r := c.Rank()
		sendLen, bufLen := bufferLens(op, sh, r)
		send, err := comm.NewHostBuffer(cfg.dtype, sendLen)
		if err != nil {
			return err
		}
		buf, err := comm.NewHostBuffer(cfg.dtype, bufLen)
		if err != nil {
			return err
		}
		l := layoutFor(op, sh, outOfPlace, r, c.Size(), cfg.root, send, buf)
		if op.op.Reduces() {
			l.call.Reduce = cfg.redop
		}
		l.prepare(cfg.redop == comm.Prod, false)
		for round := 0; round < cfg.compare; round++ {
			for i, a := range algos {
				l.call.Algorithm = a
				for range cfg.warmup {
					if err := l.issue(ctx, c); err != nil {
						return fmt.Errorf("%v: %w", a, err)
					}
				}
				for it := 0; it < cfg.iters; it++ {
					t0 := time.Now()
					if err := l.issue(ctx, c); err != nil {
						return fmt.Errorf("%v: %w", a, err)
					}
					durs[i][r][round*cfg.iters+it] = time.Since(t0)
				}
				if a == comm.Auto && r == 0 {
					chose = lastAlgorithm(c.Recorder(), op.op)
				}
			}
		}
		return nil
	})
	if err != nil {
		return nil, "", err
	}
	out := make([]time.Duration, len(algos))
	for i := range algos {
		out[i] = median(slices.Clone(iterationTimes(durs[i])))
	}
	return out, chose, nil
}
