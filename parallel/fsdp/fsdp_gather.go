package fsdp

import (
	"context"
	"fmt"
	"slices"

	"github.com/b7ea7098/loom"
	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/placement"
)

// tagElems is the number of elements appended to every all-gather and
// reduce-scatter chunk to name the unit, so that ranks running different
// modules (non-SPMD control flow) get an error, not each other's data.
const tagElems = 2

// policy is u's reshard-after-forward policy: 0 keeps the parameters
// gathered, -1 frees them, n > 0 keeps 1/n. The root unit and ZeRO-1/2
// never reshard after forward.
func (f *FSDP) policy(u *fsdpUnit) int {
	if f.cfg.stage < 3 || u.index == f.root {
		return 0
	}
	return f.cfg.reshard
}

// slotOf is the pooled buffer slot of u (-1: it owns its buffer). Units
// resharded after forward share two slots, alternating in wrap order:
// consecutive units (the one computing and the one prefetched) never
// share a slot, and the unit a backward re-gathers finds its forward's
// slot (the address its saved activations captured) free or in use by
// another unit, which is an error, never silent reuse.
func (f *FSDP) slotOf(u *fsdpUnit) int {
	if f.policy(u) == 0 {
		return -1
	}
	k := 0
	for _, w := range f.units[:u.index] {
		if f.policy(w) != 0 {
			k++
		}
	}
	return k % 2
}

// commDType is the dtype u's parameters are all-gathered in.
func (f *FSDP) commDType(u *fsdpUnit) comm.DType {
	if f.cfg.mp != 0 {
		return f.cfg.mp
	}
	return u.dtype
}

// setup runs at the first forward: it allocates the unsharded buffers,
// makes the unsharded leaves (views into them) and their gradient hooks,
// and fixes the orders.
func (f *FSDP) setup() error {
	if len(f.units) == 0 {
		return fmt.Errorf("%w: FSDP: no units wrapped", ErrInvalid)
	}
	var size [2]int
	var dt [2]comm.DType
	for _, u := range f.units {
		u.slot = f.slotOf(u)
		u.reshard = f.policy(u)
		if u.slot >= 0 {
			if dt[u.slot] != 0 && dt[u.slot] != u.dtype {
				return fmt.Errorf("%w: FSDP: units of dtypes %v and %v share a buffer slot; give units resharded after forward one dtype", ErrInvalid, dt[u.slot], u.dtype)
			}
			dt[u.slot] = u.dtype
			size[u.slot] = max(size[u.slot], u.elems)
		}
	}
	for s := range f.slots {
		if dt[s] != 0 {
			buf, err := f.allocBlock(dt[s], size[s])
			if err != nil {
				return fmt.Errorf("fsdp: FSDP: an unsharded buffer slot: %w", err)
			}
			f.slots[s] = &poolSlot{buf: buf}
		}
	}
	resolve := func(u *fsdpUnit, paths []string) ([]int, error) {
		var out []int
		for _, p := range paths {
			v := f.unitAt(p)
			if v == nil {
				return nil, fmt.Errorf("%w: FSDP unit %q: prefetch names %q, which is not a unit", ErrInvalid, u.path, p)
			}
			out = append(out, v.index)
		}
		return out, nil
	}
	for _, u := range f.units {
		var err error
		if u.fwdNext, err = resolve(u, u.cfg.fwd); err != nil {
			return err
		}
		if u.bwdNext, err = resolve(u, u.cfg.bwd); err != nil {
			return err
		}
		if u.slot >= 0 {
			u.buf = sliceBlock(f.slots[u.slot].buf, u.elems)
		} else if u.buf, err = f.allocBlock(u.dtype, u.elems); err != nil {
			return fmt.Errorf("fsdp: FSDP unit %q: its unsharded buffer: %w", u.path, err)
		}
		for _, p := range u.params {
			view := sliceRange(u.buf, p.off, p.off+p.n)
			dt, err := localOf(p.spec0, view)
			if err != nil {
				return fmt.Errorf("fsdp: FSDP unit %q: %w", u.path, err)
			}
			if p.unsharded, err = p.orig.Tape().Param(p.name, dt); err != nil {
				return err
			}
			if err := p.unsharded.OnGradReady(func(ctx context.Context, _ *autograd.Value) error { return f.gradReady(ctx, u, p) }); err != nil {
				return err
			}
		}
	}
	// The first forward's order is taken to be the root's, then wrap
	// order; later steps use the order recorded in the previous forward.
	if f.root >= 0 {
		f.prevFwd = append(f.prevFwd, f.root)
	}
	for i := range f.units {
		if i != f.root {
			f.prevFwd = append(f.prevFwd, i)
		}
		// Reduce-scatters go in reverse wrap order, the root last.
		if j := len(f.units) - 1 - i; j != f.root {
			f.rsOrder = append(f.rsOrder, j)
		}
	}
	if f.root >= 0 {
		f.rsOrder = append(f.rsOrder, f.root)
	}
	f.entered = make([]bool, len(f.units))
	f.ready = true
	return nil
}

// enter is a unit's enter hook: gather its parameters (waiting for a
// prefetch if one is in flight), swap them into the modules, prefetch the
// next unit.
func (f *FSDP) enter(ctx context.Context, u *fsdpUnit) error {
	if f.closed {
		return fmt.Errorf("%w: FSDP unit %q: FSDP.Close has run", ErrInvalid, u.path)
	}
	if !f.ready {
		if err := f.setup(); err != nil {
			return err
		}
	}
	recomputing := u.params[0].orig.Tape().Recomputing()
	if !recomputing {
		if f.backward {
			// A forward after a backward with no Finish between: the
			// step's next pass, whose gradients add to this one's.
			f.nextPass(ctx)
		}
		f.record(u)
	}
	if !f.entered[u.index] {
		f.entered[u.index] = true
		f.order = append(f.order, u.index)
	}
	if err := f.gather(ctx, u); err != nil {
		return err
	}
	if err := f.swap(u, true); err != nil {
		return err
	}
	// In a checkpointed region's recomputation the unit that forward
	// entered next has had its backward already: gathering it again
	// would only hold a pooled slot that the units before need.
	if !f.cfg.prefetch || recomputing {
		return nil
	}
	next := u.fwdNext
	if !u.cfg.fwdSet {
		if i := slices.Index(f.prevFwd, u.index); i >= 0 && i+1 < len(f.prevFwd) {
			next = f.prevFwd[i+1 : i+2]
		}
	}
	for _, i := range next {
		if _, err := f.issue(ctx, f.units[i], true); err != nil {
			return err
		}
	}
	return nil
}

// output is a unit's output hook: on the first output after the enter it
// swaps the sharded parameters back and reshards; every output is wrapped
// in an identity whose backward is the unit's pre-backward (re-gather,
// prefetch).
func (f *FSDP) output(ctx context.Context, u *fsdpUnit, v *autograd.Value) (*autograd.Value, error) {
	// A checkpointed forward recomputed during backward needs the
	// parameters right away: keep them.
	if u.swapped && !v.Tape().Recomputing() {
		if err := f.swap(u, false); err != nil {
			return nil, err
		}
		if u.reshard != 0 {
			f.release(u)
		}
	}
	// The identity is recorded whether or not v requires grad: inside a
	// checkpointed region v requires none in the first forward and does
	// when recomputed, and the region must run the same ops both times.
	return autograd.Custom("FSDPPreBackward "+u.path, []*autograd.Value{v},
		func() (*placement.DTensor, error) { return v.Data(), nil },
		func(ctx context.Context, g *placement.DTensor) ([]*placement.DTensor, error) {
			if err := f.preBackward(ctx, u); err != nil {
				return nil, err
			}
			return []*placement.DTensor{g}, nil
		})
}

// preBackward gathers u again if it was resharded and prefetches the unit
// that backward reaches next.
func (f *FSDP) preBackward(ctx context.Context, u *fsdpUnit) error {
	f.backward = true
	if f.cfg.stage == 3 {
		if err := f.gather(ctx, u); err != nil {
			return err
		}
	}
	// A checkpointed module recomputes its forward during backward, from
	// the parameters its fields hold: the gathered ones, until the unit's
	// gradients are all in (gradReady swaps them back).
	for _, p := range u.params {
		f.gradPool.lend(p.unsharded)
	}
	if !u.swapped {
		if err := f.swap(u, true); err != nil {
			return err
		}
	}
	if !f.cfg.prefetch {
		return nil
	}
	next := u.bwdNext
	if !u.cfg.bwdSet {
		if i := slices.Index(f.order, u.index); i > 0 {
			next = f.order[i-1 : i]
		}
	}
	for _, i := range next {
		if w := f.units[i]; w.reshard != 0 {
			if _, err := f.issue(ctx, w, true); err != nil {
				return err
			}
		}
	}
	return nil
}

// swap installs u's unsharded (on) or sharded leaves in its modules.
func (f *FSDP) swap(u *fsdpUnit, on bool) error {
	lists := make([][]*autograd.Value, len(u.holders))
	for i, h := range u.holders {
		lists[i] = h.OwnParams()
	}
	for _, p := range u.params {
		if on {
			lists[p.holder][p.pos] = p.unsharded
		} else {
			lists[p.holder][p.pos] = p.sharded
		}
	}
	for i, h := range u.holders {
		if err := h.SetOwnParams(lists[i]); err != nil {
			return fmt.Errorf("fsdp: FSDP unit %q: %w", u.path, err)
		}
	}
	u.swapped = on
	return nil
}

// release marks u's parameters not gathered and frees its pooled slot.
func (f *FSDP) release(u *fsdpUnit) {
	if !u.gathered {
		return
	}
	u.gathered = false
	if u.slot >= 0 && f.slots[u.slot].owner == u {
		f.slots[u.slot].owner = nil
	}
}

// gather makes u's parameters gathered: issue the all-gather unless a
// prefetch did, and complete it.
func (f *FSDP) gather(ctx context.Context, u *fsdpUnit) error {
	if u.gathered {
		return nil
	}
	if _, err := f.issue(ctx, u, false); err != nil {
		return err
	}
	return f.complete(ctx, u)
}

// stageFor returns staging slot i of ss, holding at least n elements of
// dt, after completing the operation of the unit using it.
func (f *FSDP) stageFor(ctx context.Context, ss *[2]*stageSlot, i int, dt comm.DType, n int, finish func(context.Context, *fsdpUnit) error) (*stageSlot, error) {
	s := ss[i]
	if s != nil && s.owner != nil {
		if err := finish(ctx, s.owner); err != nil {
			return nil, err
		}
	}
	if f.dev != nil {
		return f.stageDevice(ss, i, dt, n)
	}
	if s == nil || s.buf.DType() != dt || s.buf.Len() < n {
		size := n
		for _, u := range f.units { // size the slot once for every unit
			size = max(size, f.p*(u.L+tagElems))
		}
		buf, err := comm.NewHostBuffer(dt, size)
		if err != nil {
			return nil, err
		}
		s = &stageSlot{buf: buf}
		ss[i] = s
	}
	return s, nil
}

// issue starts u's all-gather (from its kept piece within its group when
// WithReshardTo left one). A prefetch that would take a slot another unit
// holds is skipped (false); a demand gather then fails.
func (f *FSDP) issue(ctx context.Context, u *fsdpUnit, prefetch bool) (bool, error) {
	if u.gathered || u.agWork != nil {
		return true, nil
	}
	if u.slot >= 0 {
		s := f.slots[u.slot]
		if s.owner != nil && s.owner != u {
			if prefetch {
				return false, nil
			}
			return false, fmt.Errorf("%w: FSDP unit %q: its unsharded buffer slot %d is held by unit %q, still gathered (units resharded after forward share two slots by wrap-order parity; wrap them in execution order, or use WithReshard(false))", ErrInvalid, u.path, u.slot, s.owner.path)
		}
		s.owner = u
	}
	blk := u.L + tagElems
	n := f.p * blk
	at := u.index % 2
	st, err := f.stageFor(ctx, &f.stage, at, f.commDType(u), n, f.complete)
	if err != nil {
		return false, err
	}
	if f.dev != nil {
		return f.issueDevice(ctx, u, st, at, n)
	}
	recv := st.buf.SliceHost(0, n)
	c := f.ag
	var send *comm.HostBuffer
	group := u.keptOK
	if group {
		g := f.cfg.reshard
		piece := (f.p / g) * blk
		j := f.rank % g
		send = recv.SliceHost(j*piece, (j+1)*piece)
		copy(send.Bytes(), u.kept.Bytes())
		c = f.group
	} else {
		send = recv.SliceHost(f.rank*blk, (f.rank+1)*blk)
		for _, p := range u.params {
			toStage(send, p.chunkOff[f.rank], p.sharded.Data().LocalData())
		}
		clearRange(send, u.chunk[f.rank], u.L) // the padding of a short chunk
		putTag(send, u.L, u.index)
	}
	w, err := comm.AllGatherAsync(comm.WithLabel(ctx, "fsdp all-gather "+u.path), c, send, recv)
	if err != nil {
		return false, f.gatherError(u, group, err)
	}
	f.traffic.AllGather += int64(c.Size()-1) * int64(len(send.Bytes()))
	u.agWork, u.agGroup, u.stageAt = w, group, at
	st.owner = u
	return true, nil
}

// complete waits for u's all-gather, checks that every rank gathered u,
// and copies the parameters out of the staging layout (casting up from
// the communication dtype).
func (f *FSDP) complete(ctx context.Context, u *fsdpUnit) error {
	w := u.agWork
	if w == nil {
		return nil
	}
	u.agWork = nil
	st := f.stage[u.stageAt]
	st.owner = nil
	if f.dev != nil {
		return f.completeDevice(ctx, u, w, st)
	}
	if err := w.Wait(ctx); err != nil {
		return f.gatherError(u, u.agGroup, err)
	}
	blk := u.L + tagElems
	recv := st.buf.SliceHost(0, f.p*blk)
	for r := range f.p {
		if got := getTag(recv, r*blk+u.L); got != u.index {
			other := fmt.Sprintf("unit %d", got)
			if got >= 0 && got < len(f.units) {
				other = fmt.Sprintf("unit %q", f.units[got].path)
			}
			return fmt.Errorf("fsdp: FSDP all-gather of unit %q: %w: shard-axis rank %d gathered %s at the same point: the ranks ran different modules (non-SPMD control flow)", u.path, loom.ErrMismatch, r, other)
		}
	}
	for r := range f.p {
		for _, p := range u.params {
			seg := p.rows[r] * p.inner
			src := r*blk + p.chunkOff[r]
			for o := range p.outer {
				fromStage(recv, src+o*seg, u.buf, p.off+(o*p.local[p.dim]+p.rowOff[r])*p.inner, seg)
			}
		}
	}
	if g := u.reshard; g > 0 && !u.agGroup {
		piece := (f.p / g) * blk
		j := f.rank % g
		if u.kept == nil {
			var err error
			if u.kept, err = comm.NewHostBuffer(recv.DType(), piece); err != nil {
				return err
			}
		}
		copy(u.kept.Bytes(), recv.SliceHost(j*piece, (j+1)*piece).Bytes())
		u.keptOK = true
	}
	u.gathered = true
	return nil
}

// gatherError wraps an error of u's all-gather, over the shard axis or
// (group) within its WithReshardTo group, whose communicator numbers its
// ranks from 0.
func (f *FSDP) gatherError(u *fsdpUnit, group bool, err error) error {
	if group {
		return fmt.Errorf("fsdp: FSDP all-gather of unit %q within its WithReshardTo(%d) group%s: %w", u.path, f.cfg.reshard, f.groupNote(), err)
	}
	return fmt.Errorf("fsdp: FSDP all-gather of unit %q: %w", u.path, err)
}

// putTag writes unit index i into the two elements at off (exact in
// bfloat16 too: each is below 256 for the low one, i/128 for the high).
func putTag(b *comm.HostBuffer, off, i int) {
	hi, lo := float32(i/128), float32(i%128)
	switch b.DType() {
	case comm.Float32:
		s := b.Float32s()
		s[off], s[off+1] = hi, lo
	case comm.Float64:
		s := b.Float64s()
		s[off], s[off+1] = float64(hi), float64(lo)
	case comm.BFloat16:
		s := b.BFloat16s()
		s[off], s[off+1] = comm.ToBFloat16(hi), comm.ToBFloat16(lo)
	}
}

// getTag reads what putTag wrote.
func getTag(b *comm.HostBuffer, off int) int {
	var hi, lo float64
	switch b.DType() {
	case comm.Float32:
		s := b.Float32s()
		hi, lo = float64(s[off]), float64(s[off+1])
	case comm.Float64:
		s := b.Float64s()
		hi, lo = s[off], s[off+1]
	case comm.BFloat16:
		s := b.BFloat16s()
		hi, lo = float64(s[off].Float32()), float64(s[off+1].Float32())
	}
	return int(hi)*128 + int(lo)
}

// toStage copies src ([]float32 or []float64) into b from element off,
// casting to b's dtype.
func toStage(b *comm.HostBuffer, off int, src any) {
	switch s := src.(type) {
	case []float32:
		switch b.DType() {
		case comm.Float32:
			copy(b.Float32s()[off:], s)
		case comm.BFloat16:
			d := b.BFloat16s()[off:]
			for i, v := range s {
				d[i] = comm.ToBFloat16(v)
			}
		}
	case []float64:
		copy(b.Float64s()[off:], s)
	}
}

// fromStage copies n elements of b from off into dst ([]float32 or
// []float64) at doff, casting up from b's dtype.
func fromStage(b *comm.HostBuffer, off int, dst any, doff, n int) {
	switch d := dst.(type) {
	case []float32:
		switch b.DType() {
		case comm.Float32:
			copy(d[doff:doff+n], b.Float32s()[off:off+n])
		case comm.BFloat16:
			for i, v := range b.BFloat16s()[off : off+n] {
				d[doff+i] = v.Float32()
			}
		}
	case []float64:
		copy(d[doff:doff+n], b.Float64s()[off:off+n])
	}
}

// clearRange zeroes elements lo..hi of b.
func clearRange(b *comm.HostBuffer, lo, hi int) {
	if lo < hi {
		clear(b.SliceHost(lo, hi).Bytes())
	}
}

// allocBlock allocates n elements of dt (float32 or float64): a host
// slice, or a buffer of FSDP's device.
func (f *FSDP) allocBlock(dt comm.DType, n int) (any, error) {
	if f.dev != nil {
		return f.dev.Alloc(dt, n)
	}
	return allocBlock(dt, n), nil
}

// allocBlock allocates n elements of dt (float32 or float64).
func allocBlock(dt comm.DType, n int) any {
	if dt == comm.Float32 {
		return make([]float32, n)
	}
	return make([]float64, n)
}

// sliceBlock returns the first n elements of a block.
func sliceBlock(b any, n int) any { return sliceRange(b, 0, n) }

// sliceRange returns elements lo..hi of a block, capped at hi.
func sliceRange(b any, lo, hi int) any {
	switch s := b.(type) {
	case []float32:
		return s[lo:hi:hi]
	case []float64:
		return s[lo:hi:hi]
	case device.Buffer:
		return s.Slice(lo, hi).(device.Buffer)
	}
	return nil
}
