package fsdp

import (
	"context"
	"errors"
	"fmt"

	"github.com/b7ea7098/loom"
	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/parallel/internal/blocks"
	"github.com/b7ea7098/loom/placement"
)

// gradReady is the gradient hook of an unsharded parameter. When all of a
// unit's parameters are final, ZeRO-3 releases its gathered parameters and
// (outside NoSync) its reduce-scatter becomes ready; ready units launch in
// rsOrder. As in DDP, only a launch error (which every rank sees) stops
// Backward; a rank-local problem is kept for Finish.
func (f *FSDP) gradReady(ctx context.Context, u *fsdpUnit, p *fsdpParam) error {
	f.backward = true
	if p.fired {
		return nil
	}
	p.fired = true
	u.fired++
	if u.fired < len(u.params) {
		return nil
	}
	if u.swapped {
		if err := f.swap(u, false); err != nil {
			return err
		}
	}
	if f.reshardsAfterBackward(u) {
		f.release(u)
	}
	if f.noGradSync {
		// Every backward of the step (several micro-batches, interleaved
		// with forwards) ends here alike; Finish reduces their sum.
		u.fired = 0
		for _, q := range u.params {
			q.fired = false
		}
		return nil
	}
	if f.noSync > 0 {
		return nil
	}
	u.rsReady = true
	return f.launchReady(ctx)
}

// fail keeps the first error of the step.
func (f *FSDP) fail(err error) {
	if f.err == nil {
		f.err = err
	}
}

// launchReady launches, in rsOrder, every ready unit whose predecessors
// are launched.
func (f *FSDP) launchReady(ctx context.Context) error {
	for f.next < len(f.rsOrder) && f.units[f.rsOrder[f.next]].rsReady {
		u := f.units[f.rsOrder[f.next]]
		if err := f.launch(ctx, u, f.next%2); err != nil {
			return err
		}
		f.next++
	}
	return nil
}

// factor is the scale of every rank's contribution.
func (f *FSDP) factor() float64 {
	switch {
	case f.cfg.divideSet:
		return 1 / f.cfg.divide
	case f.cfg.avg:
		return 1 / float64(f.p*f.repN)
	}
	return 1
}

// launch copies u's unsharded gradients (scaled; zeros where there are
// none) into reduce-scatter staging, laid out as rank chunks like the
// all-gather's, drops them, and starts the reduce-scatter (ZeRO-1: the
// all-reduce) on the reduce-scatter communicator.
func (f *FSDP) launch(ctx context.Context, u *fsdpUnit, at int) error {
	if !f.compared {
		// The pass's first reduction: the ranks compare what they ran.
		f.compared = true
		if err := f.compare(ctx, u); err != nil {
			f.fail(err)
			return err
		}
	}
	blk := u.L + tagElems
	n := f.p * blk
	st, err := f.stageFor(ctx, &f.rstage, at, u.dtype, n, f.finishRS)
	if err != nil {
		return err
	}
	if f.dev != nil {
		return f.launchDevice(ctx, u, st, at, n)
	}
	buf := st.buf.SliceHost(0, n)
	for r := range f.p { // the padding of short chunks
		clearRange(buf, r*blk+u.chunk[r], r*blk+u.L)
	}
	for _, p := range u.params {
		if !f.fillGrad(u, p, buf, nil, blk) {
			for r := range f.p { // no gradient: zeros
				lo := r*blk + p.chunkOff[r]
				clearRange(buf, lo, lo+p.outer*p.rows[r]*p.inner)
			}
		}
		// Its memory goes to the next unit's backward (gradPool): only
		// the sharded 1/p of the gradients stays with the parameters.
		f.gradPool.put(p.unsharded.ReleaseGrad())
	}
	a := float64(u.index + 1)
	for r := range f.p {
		switch u.dtype {
		case comm.Float32:
			s := buf.Float32s()
			s[r*blk+u.L], s[r*blk+u.L+1] = float32(a), float32(a*a)
		default:
			s := buf.Float64s()
			s[r*blk+u.L], s[r*blk+u.L+1] = a, a*a
		}
	}
	var w comm.Work
	ctx = comm.WithLabel(ctx, "fsdp "+f.reduceOp()+" "+u.path)
	if f.cfg.stage == 1 {
		w, err = comm.AllReduceAsync(ctx, f.rs, buf, buf, comm.Sum)
		f.traffic.AllReduce += int64(2*(f.p-1)) * int64(len(buf.Bytes())) / int64(f.p)
	} else {
		recv := buf.SliceHost(f.rank*blk, (f.rank+1)*blk)
		w, err = comm.ReduceScatterAsync(ctx, f.rs, buf, recv, comm.Sum)
		f.traffic.ReduceScatter += int64(f.p-1) * int64(len(recv.Bytes()))
	}
	if err != nil {
		err = fmt.Errorf("fsdp: FSDP %s of unit %q: %w", f.reduceOp(), u.path, err)
		f.fail(err)
		return err
	}
	u.rsWork, u.rsAt = w, at
	st.owner = u
	return nil
}

// reduceOp names the shard-axis reduction, for errors.
func (f *FSDP) reduceOp() string {
	if f.cfg.stage == 1 {
		return "all-reduce (ZeRO-1)"
	}
	return "reduce-scatter"
}

// fillGrad copies p's unsharded gradient into the rank chunks of buf and
// reports whether it did: false when p has none, or one FSDP cannot
// reduce (kept as the step's error).
func (f *FSDP) fillGrad(u *fsdpUnit, p *fsdpParam, buf *comm.HostBuffer, dbuf device.Buffer, blk int) bool {
	g := p.unsharded.Grad()
	if g == nil {
		if p.gradSpec == nil {
			p.gradSpec = p.sharded.Spec()
		}
		return false
	}
	factor := f.factor()
	gs := g.Spec()
	places := gs.Placements()
	check := func(axis int, coord int) bool {
		switch pl := places[axis]; {
		case pl.IsPartial() && pl.Op() == comm.Sum:
		case pl.IsReplicate():
			// The whole gradient on every rank: as a sum, coordinate 0's.
			if coord != 0 {
				factor = 0
			}
		default:
			f.fail(fmt.Errorf("%w: FSDP: the gradient of %q is %v on axis %q; FSDP reduces Partial(sum) (or Replicate) gradients", ErrInvalid, p.name, pl, gs.Mesh().Names()[axis]))
			return false
		}
		return true
	}
	for i, a := range f.flat.axes {
		if !check(a, f.flat.coords[i]) {
			return false
		}
	}
	if f.rep >= 0 && !check(f.rep, f.repC) {
		return false
	}
	if f.rep >= 0 {
		places[f.rep] = placement.Replicate()
	}
	out, err := f.shardedSpec(gs, places, p.dim)
	if err != nil {
		f.fail(fmt.Errorf("fsdp: FSDP gradient of %q: %w", p.name, err))
		return false
	}
	want := out.LocalShape()
	if blocks.Prod(want) != p.outer*p.rows[f.rank]*p.inner || blocks.Prod(gs.LocalShape()) != p.n {
		f.fail(fmt.Errorf("%w: FSDP: the gradient of %q has local block %v; the parameter's is %v", ErrInvalid, p.name, gs.LocalShape(), p.local))
		return false
	}
	if dt := gs.DType(); dt != u.dtype {
		f.fail(fmt.Errorf("%w: FSDP: the gradient of %q is %v; the parameter is %v", ErrInvalid, p.name, dt, u.dtype))
		return false
	}
	if dbuf != nil {
		if err := f.fillGradDevice(p, g, dbuf, blk, factor); err != nil {
			f.fail(err)
			return false
		}
		p.gradSpec, p.has = out, 1
		return true
	}
	p.gradSpec = out
	p.has = 1
	for r := range f.p {
		seg := p.rows[r] * p.inner
		for o := range p.outer {
			src := (o*p.local[p.dim] + p.rowOff[r]) * p.inner
			dst := r*blk + p.chunkOff[r] + o*seg
			switch d := g.LocalData().(type) {
			case []float32:
				if u.dtype == comm.Float32 {
					scaleCopy(buf.Float32s()[dst:dst+seg], d[src:src+seg], float32(factor))
				}
			case []float64:
				if u.dtype == comm.Float64 {
					scaleCopy(buf.Float64s()[dst:dst+seg], d[src:src+seg], factor)
				}
			}
		}
	}
	return true
}

func scaleCopy[T float32 | float64](dst, src []T, f T) {
	if f == 1 {
		copy(dst, src)
		return
	}
	for i, v := range src {
		dst[i] = v * f
	}
}

// checkReduceTag checks the two tag elements of u's reduce-scatter
// result: the sums over the ranks of t and t² with t = u.index+1 on a rank
// that reduced u. Σt = p·a and Σt² = p·a² hold only when every rank's t
// is a, so a rank that reduced another unit at this point is an error
// (ErrMismatch) on every rank.
func (f *FSDP) checkReduceTag(u *fsdpUnit, s1, s2 float64) error {
	a, p := float64(u.index+1), float64(f.p)
	if s1 != p*a || s2 != p*a*a {
		return fmt.Errorf("fsdp: FSDP %s of unit %q: %w: the ranks reduced different units at the same point (non-SPMD control flow)", f.reduceOp(), u.path, loom.ErrMismatch)
	}
	return nil
}

// finishRS waits for u's reduce-scatter, checks that every rank reduced
// u, accumulates this rank's chunk into the sharded gradient and, for
// HSDP outside NoReplicaSync, starts its all-reduce over the replicate
// axis.
func (f *FSDP) finishRS(ctx context.Context, u *fsdpUnit) error {
	w := u.rsWork
	if w == nil {
		return nil
	}
	u.rsWork = nil
	st := f.rstage[u.rsAt]
	st.owner = nil
	if f.dev != nil {
		return f.finishRSDevice(ctx, u, w, st)
	}
	if err := w.Wait(ctx); err != nil {
		return fmt.Errorf("fsdp: FSDP %s of unit %q: %w", f.reduceOp(), u.path, err)
	}
	blk := u.L + tagElems
	own := st.buf.SliceHost(f.rank*blk, (f.rank+1)*blk)
	var s1, s2 float64
	if u.dtype == comm.Float32 {
		s := own.Float32s()
		s1, s2 = float64(s[u.L]), float64(s[u.L+1])
	} else {
		s := own.Float64s()
		s1, s2 = s[u.L], s[u.L+1]
	}
	if err := f.checkReduceTag(u, s1, s2); err != nil {
		return err
	}
	// The sharded gradient must not change under a replicate all-reduce
	// of an earlier pass.
	if err := f.finishAR(ctx, u); err != nil {
		return err
	}
	n := u.chunk[f.rank]
	// Once a pass's replicate all-reduce has summed the replicas into
	// acc, later passes reduce their own sum (pend) and add it: summing
	// acc over the replicas again would count the earlier passes repN
	// times.
	dst, started := &u.acc, &u.accum
	if u.repDone {
		dst, started = &u.pend, &u.pendAccum
	}
	if *dst == nil {
		*dst = allocBlock(u.dtype, n)
	}
	switch d := (*dst).(type) {
	case []float32:
		accumulate(d, own.Float32s()[:n], *started)
	case []float64:
		accumulate(d, own.Float64s()[:n], *started)
	}
	*started = true
	if f.repc != nil && f.noRep == 0 {
		var buf comm.Buffer
		if d, ok := (*dst).([]float32); ok {
			buf = comm.Host(d)
		} else {
			buf = comm.Host((*dst).([]float64))
		}
		w, err := comm.AllReduceAsync(comm.WithLabel(ctx, "fsdp replicate all-reduce "+u.path), f.repc, buf, buf, comm.Sum)
		if err != nil {
			return fmt.Errorf("fsdp: FSDP replicate all-reduce of unit %q: %w", u.path, err)
		}
		f.traffic.AllReduce += int64(2*(f.repN-1)) * int64(n*u.dtype.Size()) / int64(f.repN)
		u.arWork, u.arAdd = w, u.repDone
		u.repDone = true
	}
	return nil
}

// accumulate copies src into dst, or adds it when add is set.
func accumulate[T float32 | float64](dst, src []T, add bool) {
	if !add {
		copy(dst, src)
		return
	}
	for i, v := range src {
		dst[i] += v
	}
}

// finishAR waits for u's replicate all-reduce and, when it reduced a
// later pass's sum (pend), adds that into the sharded gradient.
func (f *FSDP) finishAR(ctx context.Context, u *fsdpUnit) error {
	w := u.arWork
	if w == nil {
		return nil
	}
	u.arWork = nil
	if f.dev != nil {
		return f.finishARDevice(ctx, u, w)
	}
	if err := w.Wait(ctx); err != nil {
		return fmt.Errorf("fsdp: FSDP replicate all-reduce of unit %q: %w", u.path, err)
	}
	if u.arAdd {
		u.arAdd, u.pendAccum = false, false
		switch acc := u.acc.(type) {
		case []float32:
			accumulate(acc, u.pend.([]float32), true)
		case []float64:
			accumulate(acc, u.pend.([]float64), true)
		}
	}
	return nil
}

// drain completes the pass's collectives: in-flight all-gathers, every
// reduce-scatter not launched (in order; parameters without a gradient
// contribute zeros, those accumulated under NoSync their sum), the
// reduce-scatters' results and the replicate all-reduces.
func (f *FSDP) drain(ctx context.Context) error {
	var errs []error
	for _, u := range f.units {
		if err := f.complete(ctx, u); err != nil {
			errs = append(errs, err)
		}
	}
	f.launchRest(ctx)
	for _, i := range f.rsOrder {
		if err := f.finishRS(ctx, f.units[i]); err != nil {
			errs = append(errs, err)
		}
	}
	for _, u := range f.units {
		if err := f.finishAR(ctx, u); err != nil {
			errs = append(errs, err)
		}
	}
	if f.err != nil {
		errs = append([]error{f.err}, errs...)
	}
	// Every rank has issued the same collectives: the point to name the
	// ranks and units of a failed SPMD check, the root cause of any other
	// error.
	if err := f.spmdError(ctx); err != nil {
		errs = append([]error{err}, errs...)
	}
	return errors.Join(errs...)
}

// launchRest launches, in order, every reduction of the pass not launched
// yet (parameters without a gradient contribute zeros, those accumulated
// under NoSync their sum), so that every pass issues every unit's.
// A launch error is kept in f.err; later units are still issued so that
// every rank's sequence matches.
func (f *FSDP) launchRest(ctx context.Context) {
	for ; f.next < len(f.rsOrder); f.next++ {
		u := f.units[f.rsOrder[f.next]]
		if f.cfg.stage == 3 {
			f.release(u)
		}
		u.rsReady = true
		_ = f.launch(ctx, u, f.next%2)
	}
}

// nextPass ends a synced pass when the step's next forward starts without
// a Finish: its remaining reductions launch now, and their results add to
// the sharded gradients with the next pass's (as a rank alone would
// accumulate the passes' gradients). Errors are kept for Finish.
func (f *FSDP) nextPass(ctx context.Context) {
	if !f.noGradSync {
		f.launchRest(ctx)
	}
	f.endPass()
}

// Finish completes the step's gradient reduction and installs every
// sharded parameter's gradient, laid out like the parameter on the shard
// and replicate axes (other axes as backward produced them: tp.ReduceGrads
// then sums what sequence parallelism leaves Partial on the TP axis). A
// parameter no rank gave a gradient keeps none, so the optimizer skips
// it. The installed gradients are views of FSDP's sharded gradient
// buffers, valid until the next step's reduction. Every rank calls it
// after the step's last backward (one pass or several: the gradients are
// their sum), before the optimizer step; the gathered parameters are then
// stale, and the next forward gathers again. It must not be called inside
// NoSync or NoReplicaSync (ErrInvalid).
//
// When the ranks entered different units in forward, Finish fails on
// every rank of the data-parallel group with the same
// *comm.DisagreementError (matching loom.ErrMismatch), naming the ranks
// and the first unit that differs, and installs nothing. A failed
// collective is returned wrapped with the operation and the unit's path.
func (f *FSDP) Finish(ctx context.Context) error {
	if f.noSync > 0 || f.noRep > 0 {
		return fmt.Errorf("%w: FSDP.Finish: called inside NoSync or NoReplicaSync", ErrInvalid)
	}
	if !f.ready {
		return fmt.Errorf("%w: FSDP.Finish: no forward has run", ErrInvalid)
	}
	defer f.reset()
	if err := f.drain(ctx); err != nil {
		return err
	}
	var has []int32
	for _, u := range f.units {
		for _, p := range u.params {
			has = append(has, p.has)
		}
	}
	flags := comm.Host(has)
	if err := comm.AllReduce(ctx, f.rs, flags, flags, comm.Sum); err != nil {
		return fmt.Errorf("fsdp: FSDP.Finish: gradient-presence all-reduce: %w", err)
	}
	if f.repc != nil {
		if err := comm.AllReduce(ctx, f.repc, flags, flags, comm.Sum); err != nil {
			return fmt.Errorf("fsdp: FSDP.Finish: replicate gradient-presence all-reduce: %w", err)
		}
	}
	k := 0
	for _, u := range f.units {
		for _, p := range u.params {
			used := has[k] > 0
			k++
			if !used {
				if err := p.sharded.SetGrad(nil); err != nil {
					return err
				}
				continue
			}
			off, n := p.chunkOff[f.rank], p.outer*p.rows[f.rank]*p.inner
			g, err := localOf(p.gradSpec, sliceRange(u.acc, off, off+n))
			if err != nil {
				return fmt.Errorf("fsdp: FSDP gradient of %q: %w", p.name, err)
			}
			if err := p.sharded.SetGrad(g); err != nil {
				return err
			}
		}
	}
	return nil
}

// Discard abandons the step after a failed Backward: it issues and waits
// for the same collectives as Finish (peers that call Finish are
// matched) but installs nothing. It returns Finish's errors, the SPMD
// check's included. Zero the gradients before retrying.
func (f *FSDP) Discard(ctx context.Context) error {
	if !f.ready {
		return nil
	}
	defer f.reset()
	if err := f.drain(ctx); err != nil {
		return err
	}
	flags := comm.Host(make([]int32, len(f.Params())))
	if err := comm.AllReduce(ctx, f.rs, flags, flags, comm.Sum); err != nil {
		return fmt.Errorf("fsdp: FSDP.Discard: gradient-presence all-reduce: %w", err)
	}
	if f.repc != nil {
		if err := comm.AllReduce(ctx, f.repc, flags, flags, comm.Sum); err != nil {
			return fmt.Errorf("fsdp: FSDP.Discard: replicate gradient-presence all-reduce: %w", err)
		}
	}
	return nil
}

// NoSync runs fn (a micro-batch's forward and backward) without gradient
// reduction: the gathered parameters' gradients accumulate, unsharded,
// and the next synced backward reduces their sum. ZeRO-3 still reshards
// (the next micro-batch gathers again). Passes outside NoSync accumulate
// too, each with its own reduction; NoSync saves those. It returns fn's
// error.
func (f *FSDP) NoSync(fn func() error) error {
	f.noSync++
	err := fn()
	f.noSync--
	f.endPass()
	return err
}

// NoReplicaSync runs fn (a micro-batch's forward and backward) with the
// reduce-scatters on the shard axis but without HSDP's all-reduce over
// the replicate axis: the sharded gradients accumulate, and the next
// synced step all-reduces their sum. Without a replicate axis it only
// reduces each micro-batch. At its end it completes the micro-batch's
// reduce-scatters under ctx. It returns fn's error, or the reduction's.
func (f *FSDP) NoReplicaSync(ctx context.Context, fn func() error) error {
	if f.noSync > 0 {
		return fmt.Errorf("%w: FSDP.NoReplicaSync: inside NoSync", ErrInvalid)
	}
	f.noRep++
	err := fn()
	if f.ready {
		err = errors.Join(err, f.drain(ctx))
	}
	f.noRep--
	f.err = nil
	f.endPass()
	return err
}

// endPass resets the per-pass state: the readiness of the hooks, the
// launch position, the recorded forward order; ZeRO-3 releases what no
// hook released.
func (f *FSDP) endPass() {
	for _, u := range f.units {
		if u.swapped { // a unit whose backward did not run to its end
			if err := f.swap(u, false); err != nil {
				f.fail(err)
			}
		}
		u.fired, u.rsReady = 0, false
		for _, p := range u.params {
			p.fired = false
		}
		if f.reshardsAfterBackward(u) {
			f.release(u)
		}
	}
	f.next = 0
	f.backward, f.compared = false, false
	f.endTrace()
	if len(f.order) > 0 {
		f.prevFwd = append(f.prevFwd[:0], f.order...)
	}
	f.order = f.order[:0]
	clear(f.entered)
}

// reset ends the step: beyond endPass, the accumulated sharded gradients
// start over and every unit's gathered parameters are stale (the
// optimizer changes the sharded ones).
func (f *FSDP) reset() {
	f.endPass()
	for _, u := range f.units {
		f.release(u)
		u.keptOK, u.accum, u.repDone, u.pendAccum = false, false, false, false
		for _, p := range u.params {
			p.has = 0
		}
	}
	f.err = nil
}

// gradPool holds the memory of reduce-scattered unsharded gradients for
// the units whose backward runs next, by element type and length, so that
// training allocates a few gradient blocks once instead of one per unit
// and step (the blocks of a model's alike units are alike). It holds
// what backward had live at once, no more: the blocks the next step's
// backward reuses, as a caching allocator keeps freed memory (a fresh
// block each step costs its page faults, more than the copy into it).
type gradPool map[gradKey][]any

type gradKey struct {
	float64 bool
	n       int
	dev     bool // a device.Buffer (FSDP's device's)
}

func keyOf(block any) (gradKey, bool) {
	switch b := block.(type) {
	case []float32:
		return gradKey{false, len(b), false}, true
	case []float64:
		return gradKey{true, len(b), false}, true
	case device.Buffer:
		return gradKey{b.DType() == comm.Float64, b.Len(), true}, true
	}
	return gradKey{}, false
}

// put keeps block (nil or not a block: ignored).
func (g gradPool) put(block any) {
	if k, ok := keyOf(block); ok && k.n > 0 {
		g[k] = append(g[k], block)
	}
}

// lend gives v a kept block of its gradient's type and length, if any.
func (g gradPool) lend(v *autograd.Value) {
	k, ok := keyOf(v.Data().LocalData())
	if !ok || v.Grad() != nil || len(g[k]) == 0 {
		return
	}
	list := g[k]
	v.KeepGradBuffer(list[len(list)-1])
	g[k] = list[:len(list)-1]
}

// bytes is the memory the pool holds.
func (g gradPool) bytes() int64 {
	var n int64
	for k, list := range g {
		es := int64(4)
		if k.float64 {
			es = 8
		}
		n += es * int64(k.n) * int64(len(list))
	}
	return n
}
