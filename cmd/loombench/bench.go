package main

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/b7ea7098/loom/comm"
)

// job is one table: one operation with one algorithm over every size.
type job struct {
	op      benchOp
	algo    comm.Algorithm
	dtype   comm.DType
	redop   comm.ReduceOp
	root    int
	ranks   int
	iters   int
	warmup  int
	inplace bool // also measure in place (where op has that form)
	check   bool
	shapes  []shape
}

// variants lists the variants j measures at every size.
func (j *job) variants() []string {
	if j.inplace && j.op.inPlace() {
		return []string{outOfPlace, inPlace}
	}
	return []string{outOfPlace}
}

// prod reports whether inputs use the product pattern.
func (j *job) prod() bool { return j.op.op.Reduces() && j.redop == comm.Prod }

// cellData is what the ranks record for one (size, variant): every rank's
// time per timed iteration, and its count of wrong elements. Each rank
// writes only its own entries.
type cellData struct {
	durs  [][]time.Duration // [rank][iteration]
	wrong []int64           // [rank]
}

// sizeData holds the cells of one size and the algorithm auto chose.
type sizeData struct {
	cells  []cellData // per variant
	chosen string
}

func newSizeData(j *job) *sizeData {
	sd := &sizeData{cells: make([]cellData, len(j.variants()))}
	for v := range sd.cells {
		sd.cells[v].durs = make([][]time.Duration, j.ranks)
		for r := range sd.cells[v].durs {
			sd.cells[v].durs[r] = make([]time.Duration, j.iters)
		}
		sd.cells[v].wrong = make([]int64, j.ranks)
	}
	return sd
}

// runJob benchmarks j on the backend with communicator options opts, calling emit (from rank 0's goroutine)
// with each size's row as soon as every rank has finished it. The error
// names the operation and size that failed.
func runJob(ctx context.Context, be backend, opts comm.Options, j *job, emit func(row)) error {
	data := make([]*sizeData, len(j.shapes))
	for i := range data {
		data[i] = newSizeData(j)
	}
	return be.run(ctx, j.ranks, opts, func(ctx context.Context, c comm.Communicator) error {
		for i, sh := range j.shapes {
			if err := j.runSize(ctx, c, sh, data[i]); err != nil {
				err = fmt.Errorf("%v size %d B: %w", j.op, sh.bytes, err)
				c.Abort(err)
				return err
			}
			// Rank 0 gets the slowest rank's time per iteration and the
			// total of wrong elements, whether the ranks share memory or
			// not.
			if err := data[i].collect(ctx, c); err != nil {
				return fmt.Errorf("%v size %d B: %w", j.op, sh.bytes, err)
			}
			if c.Rank() == 0 {
				emit(j.row(sh, data[i]))
			}
		}
		return nil
	})
}

// collect reduces every cell over the ranks: afterwards this rank's
// durations are the slowest rank's per iteration, and rank 0's wrong count
// is the total (the others' are 0), so that the row rank 0 builds is the
// same whether the other ranks' entries are in this process or not.
func (sd *sizeData) collect(ctx context.Context, c comm.Communicator) error {
	r := c.Rank()
	for v := range sd.cells {
		cd := &sd.cells[v]
		if err := slowest(ctx, c, cd.durs[r]); err != nil {
			return err
		}
		w := []int64{cd.wrong[r]}
		if err := comm.AllReduce(ctx, c, comm.Host(w), comm.Host(w), comm.Sum); err != nil {
			return err
		}
		cd.wrong[r] = 0
		if r == 0 {
			cd.wrong[r] = w[0]
		}
	}
	return nil
}

// slowest replaces each of d's times by the largest over the ranks.
func slowest(ctx context.Context, c comm.Communicator, d []time.Duration) error {
	ns := make([]int64, len(d))
	for i, t := range d {
		ns[i] = int64(t)
	}
	if err := comm.AllReduce(ctx, c, comm.Host(ns), comm.Host(ns), comm.Max); err != nil {
		return err
	}
	for i, v := range ns {
		d[i] = time.Duration(v)
	}
	return nil
}

// runSize measures one size on rank c.Rank(): warmup iterations, timed
// iterations, then one checked iteration, for every variant. There is no
// barrier between iterations: the ranks run in lockstep through the
// operation itself, as in nccl-tests, and each rank times every iteration
// on its own.
func (j *job) runSize(ctx context.Context, c comm.Communicator, sh shape, sd *sizeData) error {
	r, p := c.Rank(), c.Size()
	sendLen, bufLen := bufferLens(j.op, sh, r)
	send, err := comm.NewHostBuffer(j.dtype, sendLen)
	if err != nil {
		return err
	}
	buf, err := comm.NewHostBuffer(j.dtype, bufLen)
	if err != nil {
		return err
	}
	for v, variant := range j.variants() {
		l := layoutFor(j.op, sh, variant, r, p, j.root, send, buf)
		l.call.Algorithm = j.algo
		if j.op.op.Reduces() {
			l.call.Reduce = j.redop
		}
		l.prepare(j.prod(), false)
		for range j.warmup {
			if err := l.issue(ctx, c); err != nil {
				return fmt.Errorf("%s warmup: %w", variant, err)
			}
		}
		cell := &sd.cells[v]
		for it := range j.iters {
			t0 := time.Now()
			err := l.issue(ctx, c)
			cell.durs[r][it] = time.Since(t0)
			if err != nil {
				return fmt.Errorf("%s: %w", variant, err)
			}
		}
		if r == 0 && j.algo == comm.Auto {
			sd.chosen = lastAlgorithm(c.Recorder(), j.op.op)
		}
		if !j.check {
			continue
		}
		l.prepare(j.prod(), true)
		if err := l.issue(ctx, c); err != nil {
			return fmt.Errorf("%s check: %w", variant, err)
		}
		if l.out != nil {
			cell.wrong[r] = countWrong(l.out, expectation{
				dt: j.dtype, red: j.redop, prod: j.prod(), p: p, src: l.src,
			})
		}
	}
	return nil
}

// lastAlgorithm returns the algorithm the flight recorder shows for the
// latest op, or "" if it does not say.
func lastAlgorithm(rec *comm.Recorder, op comm.Op) string {
	if rec == nil {
		return ""
	}
	es := rec.Entries()
	for i := len(es) - 1; i >= 0; i-- {
		if es[i].Op == op.String() {
			return es[i].Algorithm
		}
	}
	return ""
}

// row turns the recorded data of one size into a table row.
func (j *job) row(sh shape, sd *sizeData) row {
	rw := row{job: j, shape: sh, chosen: sd.chosen}
	for v, variant := range j.variants() {
		cd := &sd.cells[v]
		it := iterationTimes(cd.durs)
		med, lo := median(it), slices.Min(it)
		algbw, busbw := bandwidths(j.op, j.ranks, sh.bytes, med.Seconds())
		var wrong int64
		for _, w := range cd.wrong {
			wrong += w
		}
		rw.cells = append(rw.cells, cell{
			variant: variant, median: med, min: lo,
			algbw: algbw, busbw: busbw, wrong: wrong, checked: j.check,
		})
	}
	return rw
}

// iterationTimes returns, per iteration, the largest time over ranks.
func iterationTimes(durs [][]time.Duration) []time.Duration {
	out := make([]time.Duration, len(durs[0]))
	for _, d := range durs {
		for i, t := range d {
			out[i] = max(out[i], t)
		}
	}
	return out
}

// median returns the median of ds (the mean of the middle two for an even
// count); ds is not modified.
func median(ds []time.Duration) time.Duration {
	s := slices.Clone(ds)
	slices.Sort(s)
	n := len(s)
	if n == 0 {
		return 0
	}
	if n%2 == 1 {
		return s[n/2]
	}
	return (s[n/2-1] + s[n/2]) / 2
}

// rootCauses returns the errors in err (a join of per-rank errors) that are
// not merely other ranks reporting the abort, or err itself if there are
// none such.
func rootCauses(err error) []error {
	var all []error
	if j, ok := err.(interface{ Unwrap() []error }); ok {
		all = j.Unwrap()
	} else {
		all = []error{err}
	}
	var out []error
	for _, e := range all {
		if !errors.Is(e, comm.ErrAborted) {
			out = append(out, e)
		}
	}
	if len(out) == 0 {
		return all
	}
	return out
}
