package nccl

import (
	"fmt"
	"strings"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device/cuda"
)

// bufInfo is one buffer of a call as the stager sees it.
type bufInfo struct {
	present bool
	host    []byte // host memory; nil for device memory
	onHost  bool
	ptr     uintptr // device address of device memory
	bytes   int
}

// relation is how a call's send and recv buffers share memory.
type relation int

const (
	disjoint   relation = iota
	same                // identical
	sendInRecv          // send lies inside recv at off
	recvInSend          // recv lies inside send at off
)

// stagePlan says how to get a call's buffers onto the device: device
// buffers are used as they are; host buffers are copied into device
// memory allocated for the call, one allocation per distinct host span.
type stagePlan struct {
	send, recv bufInfo
	rel        relation
	off        int  // byte offset of the inner buffer (sendInRecv, recvInSend)
	copyIn     bool // copy send's host bytes to the device before the call
	copyOut    int  // bytes of recv (a prefix) to copy back when the call completes
}

// plan classifies call's buffers (host, device of this communicator, or
// rejected), checks how they overlap against NCCL's in-place rules, and
// decides what to copy. Its error wraps comm.ErrInvalid or
// comm.ErrUnsupported.
func (c *Comm) plan(call *comm.Call) (*stagePlan, error) {
	p := &stagePlan{}
	send := call.Send
	if call.Op == comm.OpBroadcast && c.rank != call.Root {
		send = nil // NCCL reads sendbuff on the root only
	}
	var err error
	if p.send, err = c.classify(send, "send"); err != nil {
		return nil, err
	}
	if p.recv, err = c.classify(call.Recv, "recv"); err != nil {
		return nil, err
	}
	p.rel, p.off, err = overlap(call.Send, call.Recv, p.send, p.recv)
	if err != nil {
		return nil, fmt.Errorf("%w: %v: %v; in place, %s", comm.ErrInvalid, call.Op, err, comm.InPlaceRule(call.Op))
	}
	if p.rel != disjoint {
		ok := false
		switch call.Op {
		case comm.OpAllReduce, comm.OpBroadcast, comm.OpReduce:
			ok = p.rel == same
		case comm.OpAllGather:
			ok = (p.rel == sendInRecv || p.rel == same) && p.off == c.rank*p.send.bytes
		case comm.OpReduceScatter:
			ok = (p.rel == recvInSend || p.rel == same) && p.off == c.rank*p.recv.bytes
		}
		if !ok {
			return nil, fmt.Errorf("%w: %v: send and recv overlap; in place, %s", comm.ErrInvalid, call.Op, comm.InPlaceRule(call.Op))
		}
	}
	p.copyIn = p.send.present && p.send.onHost && p.send.bytes > 0
	if p.recv.present && p.recv.onHost {
		p.copyOut = p.recv.bytes
		if call.Op == comm.OpAllToAllV {
			n := 0
			for _, k := range call.RecvCounts {
				n += k
			}
			p.copyOut = n * call.Recv.DType().Size()
		}
		if call.Op == comm.OpBroadcast && c.rank == call.Root && p.rel == same {
			p.copyOut = 0
		}
	}
	return p, nil
}

// devicePtr is a buffer in device memory that can say its address: the
// buffers of device/cuda's device, and those of any other binding that
// follows device.Buffer.
type devicePtr interface {
	comm.Buffer
	// Ptr is the device address of the first element (a CUdeviceptr).
	Ptr() uintptr
}

// deviceName is the comm.Buffer.Device name of a context's buffers.
func deviceName(c *cuda.Context) string { return fmt.Sprintf("cuda:%d", c.Ordinal()) }

// classify describes one buffer; nil is absent. Host buffers are staged;
// device buffers of the communicator's device are used where they are;
// anything else (another GPU, the emulated device's host-backed buffers,
// a type with no device address) is refused before any data moves.
func (c *Comm) classify(b comm.Buffer, name string) (bufInfo, error) {
	if b == nil {
		return bufInfo{}, nil
	}
	if h, ok := b.(*comm.HostBuffer); ok {
		return bufInfo{present: true, onHost: true, host: h.Bytes(), bytes: len(h.Bytes())}, nil
	}
	d, ok := b.(devicePtr)
	where := b.Device()
	switch {
	case ok && where == c.devName:
		return bufInfo{present: true, ptr: d.Ptr(), bytes: b.Len() * b.DType().Size()}, nil
	case ok && strings.HasPrefix(where, "cuda:"):
		return bufInfo{}, fmt.Errorf("%w: %s buffer is on %s, the communicator on %s", comm.ErrInvalid, name, where, c.devName)
	}
	return bufInfo{}, fmt.Errorf("%w: %s buffer of type %T on %q: the NCCL backend takes host buffers (*comm.HostBuffer) and device buffers of its device %s",
		comm.ErrUnsupported, name, b, where, c.devName)
}

// overlap works out how send and recv share memory.
func overlap(sb, rb comm.Buffer, s, r bufInfo) (relation, int, error) {
	if !s.present || !r.present || s.bytes == 0 || r.bytes == 0 || s.onHost != r.onHost {
		return disjoint, 0, nil
	}
	if s.onHost {
		hs, hr := sb.(*comm.HostBuffer), rb.(*comm.HostBuffer)
		switch comm.HostOverlap(hs, hr) {
		case comm.Disjoint:
			return disjoint, 0, nil
		case comm.Same:
			return same, 0, nil
		}
		if off, ok := comm.ByteOffset(hr, hs); ok {
			return sendInRecv, off, nil
		}
		if off, ok := comm.ByteOffset(hs, hr); ok {
			return recvInSend, off, nil
		}
		return disjoint, 0, fmt.Errorf("send and recv overlap partially")
	}
	sLo, sHi := s.ptr, s.ptr+uintptr(s.bytes)
	rLo, rHi := r.ptr, r.ptr+uintptr(r.bytes)
	switch {
	case sHi <= rLo || rHi <= sLo:
		return disjoint, 0, nil
	case sLo == rLo && sHi == rHi:
		return same, 0, nil
	case rLo <= sLo && sHi <= rHi:
		return sendInRecv, int(sLo - rLo), nil
	case sLo <= rLo && rHi <= sHi:
		return recvInSend, int(rLo - sLo), nil
	}
	return disjoint, 0, fmt.Errorf("send and recv overlap partially")
}

// stage gets w's buffers onto the device per plan: device pointers as
// they are, host buffers into fresh device memory (copying send in now
// and arranging for recv to be copied out when w completes).
func (c *Comm) stage(w *work, p *stagePlan) error {
	if p == nil {
		return nil
	}
	alloc := func(n int) (uintptr, error) {
		if n == 0 {
			return 0, nil
		}
		d, err := c.dev.Alloc(n)
		if err != nil {
			return 0, fmt.Errorf("staging %d bytes of host memory: %w", n, err)
		}
		w.scratch = append(w.scratch, d)
		return uintptr(d.Ptr), nil
	}
	var err error
	s, r := p.send, p.recv
	switch {
	case s.onHost && r.onHost && p.rel == same:
		if w.sendPtr, err = alloc(s.bytes); err != nil {
			return err
		}
		w.recvPtr = w.sendPtr
	case s.onHost && r.onHost && p.rel == sendInRecv:
		if w.recvPtr, err = alloc(r.bytes); err != nil {
			return err
		}
		w.sendPtr = w.recvPtr + uintptr(p.off)
	case s.onHost && r.onHost && p.rel == recvInSend:
		if w.sendPtr, err = alloc(s.bytes); err != nil {
			return err
		}
		w.recvPtr = w.sendPtr + uintptr(p.off)
	default:
		if w.sendPtr, err = c.place(s, alloc); err != nil {
			return err
		}
		if w.recvPtr, err = c.place(r, alloc); err != nil {
			return err
		}
	}
	if !s.present {
		w.sendPtr = w.recvPtr // Broadcast away from the root: NCCL ignores it
	}
	if p.copyIn {
		if err := cuda.CopyToDevice(c.dev, span(w.sendPtr, len(s.host)), s.host); err != nil {
			return err
		}
	}
	if p.copyOut > 0 {
		w.copyOut = append(w.copyOut, hostCopy{host: r.host[:p.copyOut], dev: span(w.recvPtr, p.copyOut)})
	}
	return nil
}

// span is the n bytes of device memory at p.
func span(p uintptr, n int) cuda.Buffer { return cuda.Buffer{Ptr: cuda.DevicePtr(p), Bytes: n} }

// place returns a buffer's device address, allocating for host memory.
func (c *Comm) place(b bufInfo, alloc func(int) (uintptr, error)) (uintptr, error) {
	switch {
	case !b.present:
		return 0, nil
	case b.onHost:
		return alloc(b.bytes)
	}
	return b.ptr, nil
}
