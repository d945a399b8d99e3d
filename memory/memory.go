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
// Go's runtime and the program's own data are not counted.
package memory

import (
	"context"
	"fmt"

	"github.com/b7ea7098/loom/comm"
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
}

// Source reports the bytes some part of a training step holds now.
type Source func() Use

// Meter samples its sources and keeps the peaks. It belongs to one rank,
// like the tape that samples it; it is not safe for concurrent use.
type Meter struct {
	sources []Source
	rep     Report
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

// Report returns the peaks since the last Reset.
func (m *Meter) Report() Report { return m.rep }

// Reset forgets the peaks (at the start of a step).
func (m *Meter) Reset() { m.rep = Report{} }

// MaxOverRanks returns, on every rank of c, the element-wise maximum of
// the ranks' reports (each kind and the peak): what the largest rank
// needs. It is collective over c.
func MaxOverRanks(ctx context.Context, c comm.Communicator, r Report) (Report, error) {
	v := []int64{r.Params, r.Grads, r.Optim, r.Activations, r.Comm, r.Peak}
	buf := comm.Host(v)
	if err := comm.AllReduce(ctx, c, buf, buf, comm.Max); err != nil {
		return Report{}, fmt.Errorf("memory: maximum over ranks: %w", err)
	}
	return Report{Use: Use{v[0], v[1], v[2], v[3], v[4]}, Peak: v[5]}, nil
}

// Tensor returns the bytes of dt's local block (0 for nil).
func Tensor(dt *placement.DTensor) int64 {
	if dt == nil {
		return 0
	}
	switch d := dt.LocalData().(type) {
	case []float32:
		return 4 * int64(len(d))
	case []float64:
		return 8 * int64(len(d))
	}
	return 0
}
