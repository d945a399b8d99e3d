package pp

import (
	"context"
	"fmt"
	"slices"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
)

// Transport moves distributed tensors between the stage ranks of one
// pipeline: each rank talks to its neighbours on the pp axis, over the
// communicator of that axis (any backend: comm/local, tcp, mpi, nccl, by
// comm.SendAsync and comm.RecvAsync). A tensor travels as a small header
// — its global shape, dtype and placements over the stage's own sub-mesh
// (the mesh without the pp axis) — then its local block. The receiver
// builds the spec from the header on its own sub-mesh and checks it, so
// shapes may change from one micro-batch to the next without any prior
// agreement. Receives are posted when asked for (Post), not all up front.
// NewTransport also makes the stage mesh's communicators, which every
// rank must make together.
//
// A Transport belongs to one rank and one goroutine, as its communicator
// does.
type Transport struct {
	c    comm.Communicator // the pp axis's
	sub  *mesh.Mesh        // this rank's stage sub-mesh
	sent []comm.Work       // sends not yet known to be complete
}

// maxDims bounds the header: rank of the tensor and of the sub-mesh.
const maxDims = 8

// headerLen is the header's length in int64s: magic, dtype, ndim, shape
// (maxDims), nplacements, placements (maxDims), local length.
const headerLen = 4 + 2*maxDims + 1

// headerMagic marks a header (a mismatched tag shows as a bad magic).
const headerMagic = 0x706970656c696e65 // "pipeline"

// NewTransport returns the transport of the rank whose mesh is m, which
// has the pipeline axis axis; the stage's sub-mesh is m without it. Every
// rank calls it alike (the axis's communicator may be created). Errors wrap
// ErrInvalid for a missing axis.
func NewTransport(ctx context.Context, m *mesh.Mesh, axis string) (*Transport, error) {
	if m == nil {
		return nil, fmt.Errorf("%w: NewTransport: nil mesh", ErrInvalid)
	}
	names := m.Names()
	if !slices.Contains(names, axis) {
		return nil, fmt.Errorf("%w: NewTransport: the mesh %v has no axis %q", ErrInvalid, m, axis)
	}
	c, err := m.Comm(ctx, axis)
	if err != nil {
		return nil, fmt.Errorf("pp: NewTransport: %w", err)
	}
	var rest []string
	for _, n := range names {
		if n != axis {
			rest = append(rest, n)
		}
	}
	sub, err := stageMesh(m, rest)
	if err != nil {
		return nil, err
	}
	// The stage mesh's communicators, made now on every rank: made lazily
	// (mesh.Comm on first use) they would be collective over the whole
	// world, which the other stages' ranks, busy elsewhere in the
	// schedule, never join.
	for set := 1; set < 1<<len(rest); set++ {
		var names []string
		for i, n := range rest {
			if set&(1<<i) != 0 {
				names = append(names, n)
			}
		}
		if _, err := sub.Group(ctx, names...); err != nil {
			return nil, fmt.Errorf("pp: NewTransport: the stage mesh's communicator over %v: %w", names, err)
		}
	}
	return &Transport{c: c, sub: sub}, nil
}

// stageMesh is m restricted to the axes rest; with none left, m's
// one-member view of the pp axis is not what a stage wants, so a stage on
// a pure pipeline mesh gets a mesh of one rank over a size-1 axis.
func stageMesh(m *mesh.Mesh, rest []string) (*mesh.Mesh, error) {
	if len(rest) == 0 {
		return nil, fmt.Errorf("%w: the mesh %v has only the pipeline axis; give it a second axis of size 1 (e.g. dp=1) for the stage's tensors", ErrInvalid, m)
	}
	sub, err := m.Sub(rest...)
	if err != nil {
		return nil, fmt.Errorf("pp: stage mesh: %w", err)
	}
	return sub, nil
}

// Mesh returns the stage's sub-mesh: the mesh tensors crossing stage
// boundaries are laid out on.
func (tr *Transport) Mesh() *mesh.Mesh { return tr.sub }

// Rank returns this rank's position on the pp axis.
func (tr *Transport) Rank() int { return tr.c.Rank() }

// Send starts sending dt to the rank at position peer of the pp axis with
// tag; it returns at once. The local block must not change until Flush.
// A tensor on a device is sent from a host copy.
func (tr *Transport) Send(ctx context.Context, dt *placement.DTensor, peer, tag int) error {
	const op = "Send"
	if dt == nil {
		return fmt.Errorf("%w: %s: nil tensor", ErrInvalid, op)
	}
	if dt.Device().Kind() != device.KindHost {
		// The block travels from host memory: a device's block is copied
		// there first (a device-to-device path for NCCL is not built).
		var err error
		if dt, err = dt.To(device.Host()); err != nil {
			return fmt.Errorf("pp: %s: %w", op, err)
		}
	}
	s := dt.Spec()
	buf, err := bufferOf(dt)
	if err != nil {
		return err
	}
	if len(s.Shape()) > maxDims || len(s.Placements()) > maxDims {
		return fmt.Errorf("%w: %s: a tensor of %d dims on %d mesh axes; at most %d", ErrInvalid, op, len(s.Shape()), len(s.Placements()), maxDims)
	}
	h := make([]int64, headerLen)
	h[0], h[1], h[2] = headerMagic, int64(s.DType()), int64(len(s.Shape()))
	for i, d := range s.Shape() {
		h[3+i] = int64(d)
	}
	h[3+maxDims] = int64(len(s.Placements()))
	for i, p := range s.Placements() {
		code, err := placementCode(p)
		if err != nil {
			return err
		}
		h[4+maxDims+i] = code
	}
	if err := checkMeshOrder(s); err != nil {
		return err
	}
	h[headerLen-1] = int64(buf.Len())
	hw, err := comm.SendAsync(ctx, tr.c, comm.Host(h), peer, 2*tag)
	if err != nil {
		return fmt.Errorf("pp: send header to pp rank %d (tag %d): %w", peer, tag, err)
	}
	dw, err := comm.SendAsync(ctx, tr.c, buf, peer, 2*tag+1)
	if err != nil {
		return fmt.Errorf("pp: send to pp rank %d (tag %d): %w", peer, tag, err)
	}
	tr.sent = append(tr.sent, hw, dw)
	return nil
}

// Flush waits for every send started so far.
func (tr *Transport) Flush(ctx context.Context) error {
	defer func() { tr.sent = tr.sent[:0] }()
	for _, w := range tr.sent {
		if err := w.Wait(ctx); err != nil {
			return fmt.Errorf("pp: send: %w", err)
		}
	}
	return nil
}

// Pending is a posted receive (Post); Wait returns its tensor.
type Pending struct {
	tr        *Transport
	peer, tag int
	header    []int64
	hw        comm.Work
}

// Post posts the receive of the tensor the rank at position peer sends
// with tag: its header is received in the background; Wait receives the
// block.
func (tr *Transport) Post(ctx context.Context, peer, tag int) (*Pending, error) {
	h := make([]int64, headerLen)
	hw, err := comm.RecvAsync(ctx, tr.c, comm.Host(h), peer, 2*tag)
	if err != nil {
		return nil, fmt.Errorf("pp: receive header from pp rank %d (tag %d): %w", peer, tag, err)
	}
	return &Pending{tr: tr, peer: peer, tag: tag, header: h, hw: hw}, nil
}

// Wait completes the receive: it waits for the header, builds and checks
// the spec on the stage's sub-mesh, and receives the local block into a
// fresh host block (the Runtime copies it to its tape's device). Errors wrap ErrMismatch when the header does not
// describe a tensor of this stage's mesh (a different number of mesh axes,
// an unknown dtype or placement, a local length the spec does not give).
func (p *Pending) Wait(ctx context.Context) (*placement.DTensor, error) {
	tr := p.tr
	if err := p.hw.Wait(ctx); err != nil {
		return nil, fmt.Errorf("pp: receive header from pp rank %d (tag %d): %w", p.peer, p.tag, err)
	}
	h := p.header
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: receive from pp rank %d (tag %d): "+format, append([]any{ErrMismatch, p.peer, p.tag}, args...)...)
	}
	if h[0] != headerMagic {
		return nil, bad("not a tensor header")
	}
	nd, np := int(h[2]), int(h[3+maxDims])
	if nd < 0 || nd > maxDims || np < 0 || np > maxDims {
		return nil, bad("header with %d dims and %d placements", nd, np)
	}
	if np != tr.sub.NDim() {
		return nil, bad("a tensor laid out on %d mesh axes; this stage's mesh %v has %d", np, tr.sub, tr.sub.NDim())
	}
	shape := make([]int, nd)
	for i := range shape {
		shape[i] = int(h[3+i])
	}
	pl := make([]placement.Placement, np)
	for i := range pl {
		var err error
		if pl[i], err = placementOf(h[4+maxDims+i]); err != nil {
			return nil, bad("%v", err)
		}
	}
	dt := comm.DType(h[1])
	spec, err := placement.NewSpec(tr.sub, shape, dt, pl)
	if err != nil {
		return nil, bad("%v", err)
	}
	n := 1
	for _, d := range spec.LocalShape() {
		n *= d
	}
	if int64(n) != h[headerLen-1] {
		return nil, bad("%d local values sent; the spec %v gives this rank %d", h[headerLen-1], spec, n)
	}
	var data any
	var buf comm.Buffer
	switch dt {
	case comm.Float32:
		d := make([]float32, n)
		data, buf = d, comm.Host(d)
	case comm.Float64:
		d := make([]float64, n)
		data, buf = d, comm.Host(d)
	default:
		return nil, bad("dtype %v: only float32 and float64 activations cross stages", dt)
	}
	if err := comm.Recv(ctx, tr.c, buf, p.peer, 2*p.tag+1); err != nil {
		return nil, fmt.Errorf("pp: receive from pp rank %d (tag %d): %w", p.peer, p.tag, err)
	}
	out, err := placement.NewLocal(spec, data)
	if err != nil {
		return nil, bad("%v", err)
	}
	return out, nil
}

// bufferOf returns dt's local block as a comm.Buffer.
func bufferOf(dt *placement.DTensor) (comm.Buffer, error) {
	switch d := dt.LocalData().(type) {
	case []float32:
		return comm.Host(d), nil
	case []float64:
		return comm.Host(d), nil
	case comm.Buffer:
		return d, nil
	}
	return nil, fmt.Errorf("%w: send: a local block of type %T", ErrInvalid, dt.LocalData())
}

// placementCode encodes p for the header: -1 Replicate, d ≥ 0 Shard(d),
// maxDims+d ShardBalanced(d) (context parallelism's causal load
// balancing: a plain Shard would give the receiver other positions for
// the same rows), -100-op Partial(op).
func placementCode(p placement.Placement) (int64, error) {
	switch {
	case p.IsReplicate():
		return -1, nil
	case p.IsBalanced():
		return int64(maxDims + p.Dim()), nil
	case p.IsShard():
		return int64(p.Dim()), nil
	case p.IsPartial():
		return -100 - int64(p.Op()), nil
	}
	return 0, fmt.Errorf("%w: send: placement %v cannot cross stages (only Replicate, Shard and Partial)", ErrInvalid, p)
}

// placementOf decodes placementCode.
func placementOf(c int64) (placement.Placement, error) {
	switch {
	case c == -1:
		return placement.Replicate(), nil
	case c >= 0 && c < maxDims:
		return placement.Shard(int(c)), nil
	case c >= maxDims && c < 2*maxDims:
		return placement.ShardBalanced(int(c - maxDims)), nil
	case c <= -100 && c > -200:
		return placement.Partial(comm.ReduceOp(-100 - c)), nil
	}
	return placement.Placement{}, fmt.Errorf("unknown placement code %d", c)
}

// checkMeshOrder checks that every dim sharded over several axes is sharded
// over them in mesh order, the order the receiver's spec takes: the header
// does not carry another, and the receiver would read the blocks as other
// rows.
func checkMeshOrder(s *placement.Spec) error {
	names := s.Mesh().Names()
	for d := range s.Shape() {
		o := s.Order(d)
		if !slices.IsSortedFunc(o, func(a, b string) int { return slices.Index(names, a) - slices.Index(names, b) }) {
			return fmt.Errorf("%w: Send: dim %d is sharded over %v, not in the mesh's order %v; only mesh-order shardings cross stages", ErrInvalid, d, o, names)
		}
	}
	return nil
}
