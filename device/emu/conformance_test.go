package emu_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"unsafe"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/commtest"
	"github.com/b7ea7098/loom/comm/local"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/device/emu"
)

// TestLocalConformanceOnEmu runs comm/local's conformance suite with every
// buffer on an emulated device (one per rank): each call's host buffers
// are copied to device buffers (in-place forms kept as slices of one
// buffer), the collective runs on those after device.BeforeCollective,
// and the results come back after device.AfterCollective. So comm/local
// takes emu buffers (comm.HostBacked) for every op, size, dtype, reduce
// op, root and algorithm of the -short matrix, for p = 2, 3, 4.
func TestLocalConformanceOnEmu(t *testing.T) {
	opts, err := comm.OptionsFromEnv()
	if err != nil {
		t.Fatal(err)
	}
	opts.RecorderSize = 64 // see comm/local's TestConformance
	launch := func(ctx context.Context, p int, fn func(ctx context.Context, c comm.Communicator) error) error {
		return local.Run(ctx, p, func(ctx context.Context, c comm.Communicator) error {
			d, err := emu.New(c.Rank())
			if err != nil {
				return err
			}
			w := &onDevice{Communicator: c, d: d}
			return errors.Join(fn(ctx, w), w.close())
		}, local.WithOptions(opts))
	}
	commtest.Run(t, launch, commtest.Config{
		Ranks:      []int{2, 3, 4},
		Algorithms: local.Algorithms,
		Short:      true,
	})
}

// onDevice is a communicator whose callers' host buffers are moved to an
// emulated device for each call.
type onDevice struct {
	comm.Communicator
	d    *emu.Device
	subs []*onDevice
}

func (c *onDevice) close() error {
	var errs []error
	for _, s := range c.subs {
		errs = append(errs, s.close())
	}
	if st := c.d.Memory().Stats(); st.Allocated != 0 {
		errs = append(errs, fmt.Errorf("%s: %d bytes still allocated after the calls", c.d.Name(), st.Allocated))
	}
	return errors.Join(append(errs, c.d.Close())...)
}

func (c *onDevice) Do(ctx context.Context, call comm.Call) error {
	dc, back, err := c.toDevice(call)
	if err != nil {
		return err
	}
	if err := device.BeforeCollective(c.Communicator, c.d); err != nil {
		return errors.Join(err, back())
	}
	err = c.Communicator.Do(ctx, dc)
	if err == nil {
		err = device.AfterCollective(ctx, nil, c.d)
	}
	return errors.Join(err, back())
}

func (c *onDevice) Start(ctx context.Context, call comm.Call) (comm.Work, error) {
	dc, back, err := c.toDevice(call)
	if err != nil {
		return nil, err
	}
	if err := device.BeforeCollective(c.Communicator, c.d); err != nil {
		return nil, errors.Join(err, back())
	}
	w, err := c.Communicator.Start(ctx, dc)
	if err != nil {
		return nil, errors.Join(err, back())
	}
	return &deviceWork{Work: w, dev: c.d, back: back}, nil
}

func (c *onDevice) Split(ctx context.Context, color, key int) (comm.Communicator, error) {
	sub, err := c.Communicator.Split(ctx, color, key)
	if err != nil || sub == nil {
		return sub, err
	}
	d, err := emu.New(sub.Rank())
	if err != nil {
		return nil, err
	}
	s := &onDevice{Communicator: sub, d: d}
	c.subs = append(c.subs, s)
	return s, nil
}

// deviceWork copies the results back when the work is waited for.
type deviceWork struct {
	comm.Work
	dev  device.Device
	once sync.Once
	back func() error
}

func (w *deviceWork) Wait(ctx context.Context) error {
	err := device.AfterCollective(ctx, w.Work, w.dev)
	w.once.Do(func() { err = errors.Join(err, w.back()) })
	return err
}

// span is a host buffer's bytes as addresses.
func span(h *comm.HostBuffer) (lo, hi uintptr) {
	b := h.Bytes()
	if len(b) == 0 {
		return 0, 0
	}
	lo = uintptr(unsafe.Pointer(&b[0]))
	return lo, lo + uintptr(len(b))
}

// toDevice returns call on device copies of its host buffers, and a
// function that copies the recv buffer back and frees the copies.
// Overlapping send and recv (in-place forms, and the overlaps validation
// must reject) become slices of one device buffer over their union.
func (c *onDevice) toDevice(call comm.Call) (comm.Call, func() error, error) {
	s, _ := call.Send.(*comm.HostBuffer)
	r, _ := call.Recv.(*comm.HostBuffer)
	if comm.IsNil(call.Send) {
		s = nil
	}
	if comm.IsNil(call.Recv) {
		r = nil
	}
	type moved struct {
		host *comm.HostBuffer
		dev  device.Buffer
	}
	var owned []moved
	var recvBack moved
	alloc := func(h *comm.HostBuffer) (device.Buffer, error) {
		b, err := c.d.Alloc(h.DType(), h.Len())
		if err != nil {
			return nil, err
		}
		owned = append(owned, moved{h, b})
		return b, c.d.CopyFromHost(b, h)
	}
	back := func() error {
		var errs []error
		if recvBack.dev != nil {
			errs = append(errs, c.d.CopyToHost(recvBack.host, recvBack.dev))
		}
		for _, m := range owned {
			errs = append(errs, m.dev.Free())
		}
		return errors.Join(errs...)
	}
	fail := func(err error) (comm.Call, func() error, error) { return call, nil, errors.Join(err, back()) }
	sLo, sHi := uintptr(0), uintptr(0)
	rLo, rHi := uintptr(0), uintptr(0)
	if s != nil {
		sLo, sHi = span(s)
	}
	if r != nil {
		rLo, rHi = span(r)
	}
	if s != nil && r != nil && s.DType() == r.DType() && sLo < rHi && rLo < sHi {
		// One device buffer over the union, as the host memory is one.
		lo, hi := min(sLo, rLo), max(sHi, rHi)
		size := uintptr(s.DType().Size())
		base := s
		if rLo < sLo {
			base = r
		}
		full := unsafe.Slice((*byte)(unsafe.Pointer(&base.Bytes()[0])), hi-lo)
		uh, err := comm.HostBytes(s.DType(), full)
		if err != nil {
			return fail(err)
		}
		ub, err := alloc(uh)
		if err != nil {
			return fail(err)
		}
		call.Send = ub.Slice(int((sLo-lo)/size), int((sHi-lo)/size))
		call.Recv = ub.Slice(int((rLo-lo)/size), int((rHi-lo)/size))
		recvBack = moved{uh, ub}
		return call, back, nil
	}
	if s != nil {
		b, err := alloc(s)
		if err != nil {
			return fail(err)
		}
		call.Send = b
	}
	if r != nil {
		b, err := alloc(r)
		if err != nil {
			return fail(err)
		}
		call.Recv = b
		recvBack = moved{r, b}
	}
	return call, back, nil
}
