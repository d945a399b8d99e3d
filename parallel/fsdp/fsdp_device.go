package fsdp

import (
	"context"
	"errors"
	"fmt"

	"github.com/b7ea7098/loom"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/parallel/internal/blocks"
	"github.com/b7ea7098/loom/placement"
)

// FSDP on a device: the shards, the unsharded buffers (pooled slots and
// units' own), the staging buffers, the sharded gradients and the pooled
// unsharded gradients are buffers of the parameters' device. The steps
// are the host's, on device slices: copies into and out of the staging
// layout are Copy, CopyBox and Cast (WithMixedPrecision's bfloat16) on the
// compute stream; the unit tags go through small host copies; every
// collective is ordered after compute by device.BeforeCollective and
// later compute after it by device.AfterCollective. Each contribution is
// scaled as on the host, so results on device/emu are the host's bit for
// bit. WithReshardTo's kept pieces and HSDP's replicate all-reduces are
// device buffers too.

// takeDevice records the device of a unit's parameter: every parameter of
// every unit on one device (the host, or one other).
func (f *FSDP) takeDevice(path, name string, d device.Device) error {
	fail := func(err error) error {
		return fmt.Errorf("%w: FSDP.Wrap %q: %w (parameter %q)", ErrInvalid, path, err, name)
	}
	if blocks.OnHost(d) {
		if f.dev != nil {
			return fail(device.Same("FSDP", f.dev, d))
		}
		f.hostParams = true
		return nil
	}
	if f.dev == nil && f.hostParams {
		return fail(device.Same("FSDP", device.Host(), d))
	}
	if f.dev != nil {
		if err := device.Same("FSDP", f.dev, d); err != nil {
			return fail(err)
		}
		return nil
	}
	k := d.Kernels()
	if k == nil {
		return fmt.Errorf("%w: FSDP.Wrap %q: device %s has no kernels (parameter %q)", ErrInvalid, path, d.Name(), name)
	}
	f.dev, f.k = d, k
	return nil
}

// localOf wraps a block of FSDP's memory (a host slice or a device
// buffer, not copied) as a DTensor of spec.
func localOf(spec *placement.Spec, data any) (*placement.DTensor, error) {
	if b, ok := data.(device.Buffer); ok {
		return placement.NewLocalOn(spec, b)
	}
	return placement.NewLocal(spec, data)
}

// freeAll frees the device blocks of ts (nil entries skipped).
func freeAll(ts []*placement.DTensor) error {
	var errs []error
	for _, t := range ts {
		errs = append(errs, blocks.FreeLocal(t))
	}
	return errors.Join(errs...)
}

// shardDevice copies this rank's rows of p's unsharded block src into a
// new block of n elements, laid out as s1.
func (f *FSDP) shardDevice(p *fsdpParam, s1 *placement.Spec, src device.Buffer, n int) (*placement.DTensor, error) {
	dst, err := f.dev.Alloc(src.DType(), n)
	if err != nil {
		return nil, err
	}
	if n > 0 {
		rows := p.rows[f.rank]
		err = f.k.CopyBox(dst, []int{p.outer, rows, p.inner}, []int{0, 0, 0},
			src, []int{p.outer, p.local[p.dim], p.inner}, []int{0, p.rowOff[f.rank], 0}, []int{p.outer, rows, p.inner})
	}
	var t *placement.DTensor
	if err == nil {
		t, err = placement.NewLocalOn(s1, dst)
	}
	if err != nil {
		return nil, errors.Join(err, dst.Free())
	}
	return t, nil
}

// stageDevice is stageFor's allocation on the device: staging slot i of
// ss, of at least n elements of dt, sized once for every unit.
func (f *FSDP) stageDevice(ss *[2]*stageSlot, i int, dt comm.DType, n int) (*stageSlot, error) {
	s := ss[i]
	if s != nil && s.dbuf != nil && s.dbuf.DType() == dt && s.dbuf.Len() >= n {
		return s, nil
	}
	size := n
	for _, u := range f.units {
		size = max(size, f.p*(u.L+tagElems))
	}
	b, err := f.dev.Alloc(dt, size)
	if err != nil {
		return nil, fmt.Errorf("fsdp: FSDP staging on %s: %w", f.dev.Name(), err)
	}
	if s != nil && s.dbuf != nil {
		if err := s.dbuf.Free(); err != nil {
			return nil, errors.Join(err, b.Free())
		}
	}
	s = &stageSlot{dbuf: b}
	ss[i] = s
	return s, nil
}

// hostScalars returns vals as a host buffer of dt (a tag, or the
// reduce-scatter check's pair).
func hostScalars(dt comm.DType, vals ...float64) (*comm.HostBuffer, error) {
	h, err := comm.NewHostBuffer(dt, len(vals))
	if err != nil {
		return nil, err
	}
	for i, v := range vals {
		switch dt {
		case comm.Float32:
			h.Float32s()[i] = float32(v)
		case comm.Float64:
			h.Float64s()[i] = v
		case comm.BFloat16:
			h.BFloat16s()[i] = comm.ToBFloat16(float32(v))
		}
	}
	return h, nil
}

// slice is b's elements [lo, hi).
func slice(b device.Buffer, lo, hi int) device.Buffer { return b.Slice(lo, hi).(device.Buffer) }

// issueDevice is issue's staging and all-gather on the device.
func (f *FSDP) issueDevice(ctx context.Context, u *fsdpUnit, st *stageSlot, at, n int) (bool, error) {
	blk := u.L + tagElems
	recv := slice(st.dbuf, 0, n)
	fail := func(err error) (bool, error) {
		return false, fmt.Errorf("fsdp: FSDP all-gather of unit %q: staging on %s: %w", u.path, f.dev.Name(), err)
	}
	if u.keptOK { // WithReshardTo: gather within the group, from the kept piece
		g := f.cfg.reshard
		piece := (f.p / g) * blk
		j := f.rank % g
		send := slice(recv, j*piece, (j+1)*piece)
		err := f.dev.Copy(send, u.dkept)
		if err == nil {
			err = device.BeforeCollective(f.group, f.dev)
		}
		if err != nil {
			return fail(err)
		}
		w, err := comm.AllGatherAsync(comm.WithLabel(ctx, "fsdp all-gather "+u.path), f.group, send, recv)
		if err != nil {
			return false, f.gatherError(u, true, err)
		}
		f.traffic.AllGather += int64(f.group.Size()-1) * int64(piece*send.DType().Size())
		u.agWork, u.agGroup, u.stageAt = w, true, at
		st.owner = u
		return true, nil
	}
	send := slice(recv, f.rank*blk, (f.rank+1)*blk)
	for _, p := range u.params {
		sh, ok := p.sharded.Data().LocalData().(device.Buffer)
		if !ok || sh.Owner() != f.dev {
			return false, fmt.Errorf("%w: FSDP all-gather of unit %q: the shard of %q is not on %s", ErrInvalid, u.path, p.name, f.dev.Name())
		}
		if sh.Len() == 0 {
			continue
		}
		dst := slice(send, p.chunkOff[f.rank], p.chunkOff[f.rank]+sh.Len())
		var err error
		if dst.DType() == sh.DType() {
			err = f.dev.Copy(dst, sh)
		} else {
			err = f.k.Cast(dst, sh) // WithMixedPrecision
		}
		if err != nil {
			return fail(err)
		}
	}
	if c := u.chunk[f.rank]; c < u.L { // the padding of a short chunk
		if err := f.k.Fill(slice(send, c, u.L), 0); err != nil {
			return fail(err)
		}
	}
	tag, err := hostScalars(send.DType(), float64(u.index/128), float64(u.index%128)) // putTag's layout
	if err == nil {
		err = f.dev.CopyFromHost(slice(send, u.L, u.L+tagElems), tag)
	}
	if err == nil {
		err = device.BeforeCollective(f.ag, f.dev)
	}
	if err != nil {
		return fail(err)
	}
	w, err := comm.AllGatherAsync(comm.WithLabel(ctx, "fsdp all-gather "+u.path), f.ag, send, recv)
	if err != nil {
		return false, f.gatherError(u, false, err)
	}
	f.traffic.AllGather += int64(f.ag.Size()-1) * int64(blk*send.DType().Size())
	u.agWork, u.agGroup, u.stageAt = w, false, at
	st.owner = u
	return true, nil
}

// completeDevice is complete's wait, tag check and copy out of the
// staging layout on the device.
func (f *FSDP) completeDevice(ctx context.Context, u *fsdpUnit, w comm.Work, st *stageSlot) error {
	if err := device.AfterCollective(ctx, w, f.dev); err != nil {
		return f.gatherError(u, u.agGroup, err)
	}
	blk := u.L + tagElems
	recv := slice(st.dbuf, 0, f.p*blk)
	fail := func(err error) error {
		return fmt.Errorf("fsdp: FSDP all-gather of unit %q: on %s: %w", u.path, f.dev.Name(), err)
	}
	// Every rank's tag, in one copy to the host.
	tags, err := f.dev.Alloc(recv.DType(), f.p*tagElems)
	if err != nil {
		return fail(err)
	}
	h, err := comm.NewHostBuffer(recv.DType(), f.p*tagElems)
	if err == nil {
		err = f.k.CopyBox(tags, []int{f.p, tagElems}, []int{0, 0}, recv, []int{f.p, blk}, []int{0, u.L}, []int{f.p, tagElems})
	}
	if err == nil {
		err = f.dev.CopyToHost(h, tags)
	}
	if err = errors.Join(err, tags.Free()); err != nil {
		return fail(err)
	}
	for r := range f.p {
		if got := getTag(h, r*tagElems); got != u.index {
			other := fmt.Sprintf("unit %d", got)
			if got >= 0 && got < len(f.units) {
				other = fmt.Sprintf("unit %q", f.units[got].path)
			}
			return fmt.Errorf("fsdp: FSDP all-gather of unit %q: %w: shard-axis rank %d gathered %s at the same point: the ranks ran different modules (non-SPMD control flow)", u.path, loom.ErrMismatch, r, other)
		}
	}
	src := recv
	if recv.DType() != u.dtype { // WithMixedPrecision: cast up once
		wide, err := f.dev.Alloc(u.dtype, recv.Len())
		if err != nil {
			return fail(err)
		}
		defer wide.Free() // ordered after the copies below
		if err := f.k.Cast(wide, recv); err != nil {
			return fail(err)
		}
		src = wide
	}
	buf := u.buf.(device.Buffer)
	for r := range f.p {
		for _, p := range u.params {
			seg := p.rows[r] * p.inner
			if seg == 0 || p.outer == 0 {
				continue
			}
			lo := r*blk + p.chunkOff[r]
			err := f.k.CopyBox(slice(buf, p.off, p.off+p.n), []int{p.outer, p.local[p.dim] * p.inner}, []int{0, p.rowOff[r] * p.inner},
				slice(src, lo, lo+p.outer*seg), []int{p.outer, seg}, []int{0, 0}, []int{p.outer, seg})
			if err != nil {
				return fail(err)
			}
		}
	}
	if g := u.reshard; g > 0 && !u.agGroup { // WithReshardTo: keep the group's piece
		piece := (f.p / g) * blk
		j := f.rank % g
		if u.dkept == nil {
			var err error
			if u.dkept, err = f.dev.Alloc(recv.DType(), piece); err != nil {
				return fail(err)
			}
		}
		if err := f.dev.Copy(u.dkept, slice(recv, j*piece, (j+1)*piece)); err != nil {
			return fail(err)
		}
		u.keptOK = true
	}
	u.gathered = true
	return nil
}

// launchDevice is launch's staging and reduction on the device.
func (f *FSDP) launchDevice(ctx context.Context, u *fsdpUnit, st *stageSlot, at, n int) error {
	blk := u.L + tagElems
	buf := slice(st.dbuf, 0, n)
	fail := func(err error) error {
		err = fmt.Errorf("fsdp: FSDP %s of unit %q: staging on %s: %w", f.reduceOp(), u.path, f.dev.Name(), err)
		f.fail(err)
		return err
	}
	zero := func(lo, hi int) error {
		if lo >= hi {
			return nil
		}
		return f.k.Fill(slice(buf, lo, hi), 0)
	}
	for r := range f.p { // the padding of short chunks
		if err := zero(r*blk+u.chunk[r], r*blk+u.L); err != nil {
			return fail(err)
		}
	}
	for _, p := range u.params {
		if !f.fillGrad(u, p, nil, buf, blk) {
			for r := range f.p { // no gradient: zeros
				lo := r*blk + p.chunkOff[r]
				if err := zero(lo, lo+p.outer*p.rows[r]*p.inner); err != nil {
					return fail(err)
				}
			}
		}
		// As on the host, the memory goes to the next unit's backward;
		// an empty block (still an allocation) is freed.
		g := p.unsharded.ReleaseGrad()
		if b, ok := g.(device.Buffer); ok && b.Len() == 0 {
			if err := b.Free(); err != nil {
				return fail(err)
			}
			continue
		}
		f.gradPool.put(g)
	}
	a := float64(u.index + 1)
	tag, err := hostScalars(u.dtype, a, a*a)
	for r := range f.p {
		if err == nil {
			err = f.dev.CopyFromHost(slice(buf, r*blk+u.L, r*blk+u.L+tagElems), tag)
		}
	}
	if err == nil {
		err = device.BeforeCollective(f.rs, f.dev)
	}
	if err != nil {
		return fail(err)
	}
	var w comm.Work
	ctx = comm.WithLabel(ctx, "fsdp "+f.reduceOp()+" "+u.path)
	bytes := int64(n * buf.DType().Size())
	if f.cfg.stage == 1 {
		w, err = comm.AllReduceAsync(ctx, f.rs, buf, buf, comm.Sum)
		f.traffic.AllReduce += int64(2*(f.p-1)) * bytes / int64(f.p)
	} else {
		recv := slice(buf, f.rank*blk, (f.rank+1)*blk)
		w, err = comm.ReduceScatterAsync(ctx, f.rs, buf, recv, comm.Sum)
		f.traffic.ReduceScatter += int64(f.p-1) * int64(blk*buf.DType().Size())
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

// fillGradDevice copies p's unsharded gradient g into the rank chunks of
// the staging buffer dbuf, scaled by factor after the copy (the host's
// product, element by element).
func (f *FSDP) fillGradDevice(p *fsdpParam, g *placement.DTensor, dbuf device.Buffer, blk int, factor float64) error {
	src, ok := g.LocalData().(device.Buffer)
	if !ok || src.Owner() != f.dev {
		return fmt.Errorf("%w: FSDP: the gradient of %q is on %s, the parameters on %s", ErrInvalid, p.name, g.Device().Name(), f.dev.Name())
	}
	for r := range f.p {
		seg := p.rows[r] * p.inner
		m := p.outer * seg
		if m == 0 {
			continue
		}
		lo := r*blk + p.chunkOff[r]
		dst := slice(dbuf, lo, lo+m)
		err := f.k.CopyBox(dst, []int{p.outer, seg}, []int{0, 0},
			src, []int{p.outer, p.local[p.dim] * p.inner}, []int{0, p.rowOff[r] * p.inner}, []int{p.outer, seg})
		if err == nil && factor != 1 {
			err = f.k.Scale(dst, dst, factor)
		}
		if err != nil {
			return fmt.Errorf("fsdp: FSDP gradient of %q: %w", p.name, err)
		}
	}
	return nil
}

// finishRSDevice is finishRS's wait, check and accumulation on the
// device, and HSDP's replicate all-reduce.
func (f *FSDP) finishRSDevice(ctx context.Context, u *fsdpUnit, w comm.Work, st *stageSlot) error {
	if err := device.AfterCollective(ctx, w, f.dev); err != nil {
		return fmt.Errorf("fsdp: FSDP %s of unit %q: %w", f.reduceOp(), u.path, err)
	}
	fail := func(err error) error {
		return fmt.Errorf("fsdp: FSDP %s of unit %q: on %s: %w", f.reduceOp(), u.path, f.dev.Name(), err)
	}
	blk := u.L + tagElems
	own := slice(st.dbuf, f.rank*blk, (f.rank+1)*blk)
	h, err := comm.NewHostBuffer(u.dtype, tagElems)
	if err == nil {
		err = f.dev.CopyToHost(h, slice(own, u.L, u.L+tagElems))
	}
	if err != nil {
		return fail(err)
	}
	var s1, s2 float64
	if u.dtype == comm.Float32 {
		s1, s2 = float64(h.Float32s()[0]), float64(h.Float32s()[1])
	} else {
		s1, s2 = h.Float64s()[0], h.Float64s()[1]
	}
	if err := f.checkReduceTag(u, s1, s2); err != nil {
		return err
	}
	// As on the host: an earlier pass's replicate all-reduce completes
	// first, and later passes reduce their own sum (pend).
	if err := f.finishAR(ctx, u); err != nil {
		return err
	}
	n := u.chunk[f.rank]
	dst, started := &u.acc, &u.accum
	if u.repDone {
		dst, started = &u.pend, &u.pendAccum
	}
	if *dst == nil {
		if *dst, err = f.allocBlock(u.dtype, n); err != nil {
			return fail(err)
		}
	}
	acc := (*dst).(device.Buffer)
	if n > 0 {
		if *started {
			err = f.k.Add(acc, acc, slice(own, 0, n))
		} else {
			err = f.dev.Copy(acc, slice(own, 0, n))
		}
		if err != nil {
			return fail(err)
		}
	}
	*started = true
	if f.repc != nil && f.noRep == 0 {
		if err := device.BeforeCollective(f.repc, f.dev); err != nil {
			return fail(err)
		}
		w, err := comm.AllReduceAsync(comm.WithLabel(ctx, "fsdp replicate all-reduce "+u.path), f.repc, acc, acc, comm.Sum)
		if err != nil {
			return fmt.Errorf("fsdp: FSDP replicate all-reduce of unit %q: %w", u.path, err)
		}
		f.traffic.AllReduce += int64(2*(f.repN-1)) * int64(n*u.dtype.Size()) / int64(f.repN)
		u.arWork, u.arAdd = w, u.repDone
		u.repDone = true
	}
	return nil
}

// finishARDevice is finishAR on the device: compute waits for the
// replicate all-reduce, and a later pass's reduced sum is added into the
// sharded gradient.
func (f *FSDP) finishARDevice(ctx context.Context, u *fsdpUnit, w comm.Work) error {
	if err := device.AfterCollective(ctx, w, f.dev); err != nil {
		return fmt.Errorf("fsdp: FSDP replicate all-reduce of unit %q: %w", u.path, err)
	}
	if !u.arAdd {
		return nil
	}
	u.arAdd, u.pendAccum = false, false
	acc := u.acc.(device.Buffer)
	if acc.Len() == 0 {
		return nil
	}
	if err := f.k.Add(acc, acc, u.pend.(device.Buffer)); err != nil {
		return fmt.Errorf("fsdp: FSDP replicate all-reduce of unit %q: on %s: %w", u.path, f.dev.Name(), err)
	}
	return nil
}

// Close frees FSDP's device memory (unsharded buffers, staging, sharded
// gradients and the pooled unsharded gradients; nothing on the host,
// whose memory is the garbage collector's) and drops the gradients that
// live in it, so that no leaf refers to freed memory. The sharded
// parameters stay, with the module holding them. The FSDP must not run
// another step after Close; Close is idempotent.
func (f *FSDP) Close() error {
	if f.dev == nil || f.closed {
		f.closed = true
		return nil
	}
	f.closed = true
	var errs []error
	free := func(x any) {
		if b, ok := x.(device.Buffer); ok {
			errs = append(errs, b.Free())
		}
	}
	for _, u := range f.units {
		for _, p := range u.params {
			if err := p.sharded.SetGrad(nil); err != nil { // a view of u.acc
				errs = append(errs, err)
			}
			if p.unsharded != nil {
				free(p.unsharded.ReleaseGrad())
			}
		}
		if u.slot < 0 {
			free(u.buf)
		}
		free(u.acc)
		free(u.pend)
		if u.dkept != nil {
			errs = append(errs, u.dkept.Free())
		}
		u.buf, u.acc, u.pend, u.dkept, u.keptOK = nil, nil, nil, nil, false
	}
	for i, s := range f.slots {
		if s != nil {
			free(s.buf)
			f.slots[i] = nil
		}
	}
	for _, ss := range []*[2]*stageSlot{&f.stage, &f.rstage} {
		for i, s := range ss {
			if s != nil && s.dbuf != nil {
				errs = append(errs, s.dbuf.Free())
			}
			ss[i] = nil
		}
	}
	for k, list := range f.gradPool {
		for _, b := range list {
			free(b)
		}
		delete(f.gradPool, k)
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("fsdp: FSDP.Close: %w", err)
	}
	return nil
}
