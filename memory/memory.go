// Package memory accounts for the bytes a rank holds during training, by
// kind: parameters (their local shards and any gathered copies),
// gradients, optimizer state, activations saved for backward, and
// communication buffers. A Meter sums the counts its sources report each
// time it is sampled (a training loop samples it after every op, through
// the tape's observer) and keeps each kind's largest value and the
// largest total since its last Reset: the peak of a step.
//
// The counts are of the memory loom's data structures hold, not of the
// process's heap: the garbage collector may hold freed memory longer, and
// Go's runtime and the program's own data are not counted. For data on a
// device the counts are of the tensors' buffers, and a Meter given the
// device (SetDevice) reports its caching allocator's statistics too:
// what the allocator holds, cached blocks included.
package memory

import (
	"context"
	"fmt"
	"math"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/placement"
)

// Use is a number of bytes by kind.
type Use struct {
	// Params is parameter memory: every parameter's local block (its
	// shard, for sharded parameters) and any gathered full copies.
	Params int64 `json:"params"`
	// Grads is gradient memory: the gradients leaves hold and the
	// unsharded gradients waiting to be reduced.
	Grads int64 `json:"grads"`
	// Optim is optimizer state (AdamW's moments, SGD's momentum).
	Optim int64 `json:"optim"`
	// Activations is the activations the tape keeps for backward.
	Activations int64 `json:"activations"`
	// Comm is communication buffers: DDP's buckets, FSDP's staging.
	Comm int64 `json:"comm"`
}

// Total is the sum over the kinds.
func (u Use) Total() int64 { return u.Params + u.Grads + u.Optim + u.Activations + u.Comm }

// Add returns u + v, kind by kind.
func (u Use) Add(v Use) Use {
	return Use{u.Params + v.Params, u.Grads + v.Grads, u.Optim + v.Optim, u.Activations + v.Activations, u.Comm + v.Comm}
}

// Max returns the larger of u and v, kind by kind.
func (u Use) Max(v Use) Use {
	return Use{max(u.Params, v.Params), max(u.Grads, v.Grads), max(u.Optim, v.Optim), max(u.Activations, v.Activations), max(u.Comm, v.Comm)}
}

// Report is what a Meter saw since its last Reset: each kind's largest
// value, and Peak, the largest total of one sample (at most
// Use.Total of the per-kind maxima, since the kinds peak at different
// moments).
type Report struct {
	Use
	Peak int64 `json:"peak"`
	// Device is the allocator statistics of the Meter's device (SetDevice)
	// when Report was called: the bytes loom's caching allocator holds
	// there, its peaks since the last Reset, fragmentation and driver
	// allocations. Nil without a device with an allocator (the host).
	Device *device.Stats `json:"device,omitempty"`
}

// Source reports the bytes some part of a training step holds now.
type Source func() Use

// Meter samples its sources and keeps the peaks. It belongs to one rank,
// like the tape that samples it; it is not safe for concurrent use.
type Meter struct {
	sources []Source
	rep     Report
	dev     device.Device // SetDevice; nil: none
}

// SetDevice makes Report include d's allocator statistics, and Reset
// reset the allocator's peaks (device.Allocator.ResetPeak), so that they
// are the step's like the Meter's own. A device without an allocator (the
// host) or nil reports none.
func (m *Meter) SetDevice(d device.Device) {
	m.dev = nil
	if d != nil && d.Memory() != nil {
		m.dev = d
	}
}

// Add registers a source; Sample sums every source.
func (m *Meter) Add(s Source) {
	if s != nil {
		m.sources = append(m.sources, s)
	}
}

// Sample sums the sources now and updates the peaks. It returns the sum.
func (m *Meter) Sample() Use {
	var u Use
	for _, s := range m.sources {
		u = u.Add(s())
	}
	m.rep.Use = m.rep.Use.Max(u)
	m.rep.Peak = max(m.rep.Peak, u.Total())
	return u
}

// Report returns the peaks since the last Reset, and the device's
// allocator statistics now (SetDevice).
func (m *Meter) Report() Report {
	r := m.rep
	if m.dev != nil {
		s := m.dev.Memory().Stats()
		r.Device = &s
	}
	return r
}

// Reset forgets the peaks (at the start of a step), the device
// allocator's included.
func (m *Meter) Reset() {
	m.rep = Report{}
	if m.dev != nil {
		m.dev.Memory().ResetPeak()
	}
}

// MaxOverRanks returns, on every rank of c, the element-wise maximum of
// the ranks' reports (each kind and the peak, and each field of the
// device statistics, present when any rank has them): what the largest
// rank needs. It is one all-reduce over c, the same whether or not a rank
// has device statistics, so it is collective over c.
func MaxOverRanks(ctx context.Context, c comm.Communicator, r Report) (Report, error) {
	var s device.Stats
	has := int64(0)
	if r.Device != nil {
		s, has = *r.Device, 1
	}
	// Fragmentation is in [0, 1]: the bits of a non-negative float64
	// order as int64 like its values, so the int64 maximum of the bits is
	// the bits of the maximum.
	v := []int64{r.Params, r.Grads, r.Optim, r.Activations, r.Comm, r.Peak, has,
		s.Allocated, s.Reserved, s.Pending, s.PeakAllocated, s.PeakReserved, s.LargestFree,
		s.Segments, s.DriverAllocs, s.DriverFrees, s.Retries, s.OOMs, int64(math.Float64bits(max(s.Fragmentation, 0)))}
	buf := comm.Host(v)
	if err := comm.AllReduce(ctx, c, buf, buf, comm.Max); err != nil {
		return Report{}, fmt.Errorf("memory: maximum over ranks: %w", err)
	}
	out := Report{Use: Use{v[0], v[1], v[2], v[3], v[4]}, Peak: v[5]}
	if v[6] != 0 {
		out.Device = &device.Stats{
			Allocated: v[7], Reserved: v[8], Pending: v[9], PeakAllocated: v[10], PeakReserved: v[11], LargestFree: v[12],
			Segments: v[13], DriverAllocs: v[14], DriverFrees: v[15], Retries: v[16], OOMs: v[17],
			Fragmentation: math.Float64frombits(uint64(v[18])),
		}
	}
	return out, nil
}

// Tensor returns the bytes of dt's local block (0 for nil), on the host
// or on a device (its buffer's Len()·DType().Size()).
func Tensor(dt *placement.DTensor) int64 {
	if dt == nil {
		return 0
	}
	switch d := dt.LocalData().(type) {
	case []float32:
		return 4 * int64(len(d))
	case []float64:
		return 8 * int64(len(d))
	case device.Buffer:
		return int64(d.Len()) * int64(d.DType().Size())
	}
	return 0
}
