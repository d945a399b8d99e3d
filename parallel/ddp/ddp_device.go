package ddp

import (
	"errors"
	"fmt"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/placement"
)

// DDP on a device: the buckets and the reduced-gradient blocks are device
// buffers, allocated by New and freed by Close; the hooks' copies, the
// scaling and Finish's copies run on the device's compute stream, in the
// order the host path does them, so results match the host's bit for
// bit on a device whose kernels are the CPU's (device/emu).

// slice is slot s of bucket b on the device.
func (d *DDP) slice(b *bucket, s slot) device.Buffer {
	return b.dev.Slice(s.off, s.off+s.n).(device.Buffer)
}

// deviceName names the device of the buckets.
func (d *DDP) deviceName() string {
	if d.dev == nil {
		return device.Host().Name()
	}
	return d.dev.Name()
}

// allocGrads allocates each parameter's reduced-gradient block: its
// bucket slot under WithGradientAsBucketView, a block of its own otherwise.
func (d *DDP) allocGrads() error {
	d.gbuf = make([]device.Buffer, len(d.params))
	for i, s := range d.slots {
		b := d.buckets[s.bucket]
		if d.cfg.views {
			d.gbuf[i] = d.slice(b, s)
			continue
		}
		g, err := d.dev.Alloc(b.dtype, s.n)
		if err != nil {
			return fmt.Errorf("the gradient block of %q on %s: %w", d.names[i], d.dev.Name(), err)
		}
		d.gbuf[i] = g
	}
	return nil
}

// fillDevice copies src, parameter gradient for slot s, into bucket b,
// scaled by factor; a gradient that is already the slot (a bucket view
// Backward wrote into) is left in place when factor is 1.
func (d *DDP) fillDevice(b *bucket, s slot, src device.Buffer, factor float64) error {
	dst := d.slice(b, s)
	if factor != 1 {
		return d.k.Scale(dst, src, factor)
	}
	if s.n == 0 || src.Ptr() == dst.Ptr() {
		return nil
	}
	return d.dev.Copy(dst, src)
}

// installDevice installs parameter i's reduced gradient: its block,
// filled from the bucket (unless it is the bucket's slot), laid out as
// d.out[i]. A gradient Backward allocated for the leaf alone is freed: it
// was copied into the bucket, and DDP's block replaces it.
func (d *DDP) installDevice(p *autograd.Value, i int) error {
	s := d.slots[i]
	g := d.gbuf[i]
	if !d.cfg.views && s.n > 0 {
		if err := d.dev.Copy(g, d.slice(d.buckets[s.bucket], s)); err != nil {
			return fmt.Errorf("ddp: DDP gradient of %q: %w", d.names[i], err)
		}
	}
	if err := d.dropGrad(p); err != nil {
		return fmt.Errorf("ddp: DDP gradient of %q: %w", d.names[i], err)
	}
	dt, err := placement.NewLocalOn(d.out[i], g)
	if err != nil {
		return fmt.Errorf("ddp: DDP gradient of %q: %w", d.names[i], err)
	}
	return p.SetGrad(dt)
}

// dropGrad drops p's gradient and frees its block when the leaf owned it
// and it is not one of DDP's (the allocator orders the free after the
// copies queued on it).
func (d *DDP) dropGrad(p *autograd.Value) error {
	b, ok := p.ReleaseGrad().(device.Buffer)
	if !ok || d.owns(b) {
		return nil
	}
	return b.Free()
}

// owns reports whether b is one of DDP's device blocks or inside one.
func (d *DDP) owns(b device.Buffer) bool {
	p := b.Ptr()
	for _, bk := range d.buckets {
		if bk.dev != nil && bk.dev.Len() > 0 && p >= bk.dev.Ptr() && p < bk.dev.Ptr()+uintptr(bk.dev.Len()*bk.dtype.Size()) {
			return true
		}
	}
	if d.cfg.views {
		return false
	}
	for _, g := range d.gbuf {
		if g != nil && g.Len() > 0 && g.Ptr() == p {
			return true
		}
	}
	return false
}

// freeDevice frees the device blocks (buckets and gradient blocks).
func (d *DDP) freeDevice() error {
	var errs []error
	if !d.cfg.views {
		for _, g := range d.gbuf {
			if g != nil {
				errs = append(errs, g.Free())
			}
		}
	}
	for _, b := range d.buckets {
		if b.dev != nil {
			errs = append(errs, b.dev.Free())
			b.dev = nil
		}
	}
	d.gbuf = nil
	return errors.Join(errs...)
}

// Close frees DDP's device memory (buckets and gradient blocks; nothing
// on the host, whose buffers are the garbage collector's) and drops the
// gradients that live in it, with the memory kept for the next gradient,
// so that no leaf refers to freed memory. Later Finish, Discard and
// synced backward passes are errors. Close is idempotent.
func (d *DDP) Close() error {
	if d.closed {
		return nil
	}
	d.closed = true
	if d.dev == nil {
		return nil
	}
	for _, p := range d.params {
		g := p.Grad()
		if g == nil {
			p.ReleaseGrad() // memory kept for the next gradient may be a bucket
			continue
		}
		if b, ok := g.LocalData().(device.Buffer); ok && d.owns(b) {
			p.ReleaseGrad()
		}
	}
	if err := d.freeDevice(); err != nil {
		return fmt.Errorf("ddp: DDP.Close: %w", err)
	}
	return nil
}

// paramsDevice returns the device that holds every parameter's block (the
// host for an empty list), or an error wrapping device.ErrMixed that names
// op, two of the devices and the parameter on the second; New wraps it in
// ErrInvalid.
func paramsDevice(op string, params []*autograd.Value) (device.Device, error) {
	var d device.Device
	for _, p := range params {
		pd := p.Data().Device()
		if d == nil {
			d = pd
			continue
		}
		if err := device.Same(op, d, pd); err != nil {
			return nil, fmt.Errorf("%w (parameter %q)", err, p.Name())
		}
	}
	if d == nil {
		d = device.Host()
	}
	return d, nil
}
