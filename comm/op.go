package comm

import (
	"fmt"
	"strings"

	"github.com/b7ea7098/loom/internal/checked"
)

// Op names one communication operation.
type Op uint8

// The operations of a Communicator. Counts follow NCCL: AllGather sends n and
// receives p·n elements, ReduceScatter sends p·n and receives n, Gather and
// Scatter move n per rank, AllToAll moves n to each peer.
const (
	OpAllReduce Op = iota + 1
	OpBroadcast
	OpReduce
	OpAllGather
	OpReduceScatter
	OpGather
	OpScatter
	OpAllToAll
	OpAllToAllV
	OpSend
	OpRecv
	OpBarrier
	OpSplit
)

var opNames = map[Op]string{
	OpAllReduce: "allreduce", OpBroadcast: "broadcast", OpReduce: "reduce",
	OpAllGather: "allgather", OpReduceScatter: "reducescatter", OpGather: "gather",
	OpScatter: "scatter", OpAllToAll: "alltoall", OpAllToAllV: "alltoallv",
	OpSend: "send", OpRecv: "recv", OpBarrier: "barrier", OpSplit: "split",
}

// String returns the lower-case name of the operation ("allreduce").
func (o Op) String() string {
	if s, ok := opNames[o]; ok {
		return s
	}
	return fmt.Sprintf("op(%d)", uint8(o))
}

// ParseOp parses an operation name as printed by String, in any case. An
// unknown name is an error wrapping ErrInvalid.
func ParseOp(s string) (Op, error) {
	o, ok := lookupOp(s)
	if !ok {
		return 0, fmt.Errorf("comm: ParseOp: %w: unknown op %q (want one of %s)", ErrInvalid, s, opList())
	}
	return o, nil
}

// lookupOp is ParseOp without the error.
func lookupOp(s string) (Op, bool) {
	for o, name := range opNames {
		if strings.EqualFold(s, name) {
			return o, true
		}
	}
	return 0, false
}

// opList lists the op names in declaration order, for error messages.
func opList() string {
	names := make([]string, 0, len(opNames))
	for o := OpAllReduce; o <= OpSplit; o++ {
		names = append(names, opNames[o])
	}
	return strings.Join(names, ", ")
}

// Collective reports whether every rank of the communicator takes part.
func (o Op) Collective() bool { return o != OpSend && o != OpRecv }

// Rooted reports whether the operation has a root rank.
func (o Op) Rooted() bool {
	return o == OpBroadcast || o == OpReduce || o == OpGather || o == OpScatter
}

// Reduces reports whether the operation applies a ReduceOp.
func (o Op) Reduces() bool {
	return o == OpAllReduce || o == OpReduce || o == OpReduceScatter
}

// Call describes one operation for Communicator.Do and Start. The typed
// helpers (AllReduce, AllGather, ...) fill it in; backends validate it with
// Validate before any data moves.
type Call struct {
	Op Op
	// Send and Recv are the input and output buffers. Which are required, and
	// their lengths, depend on Op (see the helper functions). In-place forms
	// follow NCCL: AllReduce and Broadcast with Send == Recv; AllGather with
	// Send the rank-th block of Recv; ReduceScatter with Recv the rank-th
	// block of Send.
	Send, Recv Buffer
	// Reduce is the operator of AllReduce, Reduce and ReduceScatter.
	Reduce ReduceOp
	// Root is the root rank of Broadcast, Reduce, Gather and Scatter.
	Root int
	// Peer and Tag address Send and Recv.
	Peer, Tag int
	// SendCounts[j] and RecvCounts[j] are the elements this rank sends to and
	// receives from rank j in AllToAllV; blocks are packed in rank order.
	SendCounts, RecvCounts []int
	// Algorithm forces an algorithm; Auto lets the backend choose.
	Algorithm Algorithm
}

// ForRank returns the call as rank issues it: a nil-pointer buffer becomes
// nil, and buffers the op ignores on this rank are dropped (recv of Reduce
// and Gather, send of Scatter, away from the root), so they are neither
// validated nor used. Backends call it before Validate.
func (c Call) ForRank(rank int) Call {
	if IsNil(c.Send) {
		c.Send = nil
	}
	if IsNil(c.Recv) {
		c.Recv = nil
	}
	if rank != c.Root {
		switch c.Op {
		case OpReduce, OpGather:
			c.Recv = nil
		case OpScatter:
			c.Send = nil
		}
	}
	return c
}

// Count is the per-rank element count that fingerprints and benchmarks
// report: the length of the Send buffer, or of Recv where the op has no
// meaningful Send on this rank.
func (c *Call) Count() int {
	switch c.Op {
	case OpAllReduce, OpBroadcast, OpRecv:
		return lenOf(c.Recv)
	case OpScatter, OpReduceScatter:
		return lenOf(c.Recv)
	}
	return lenOf(c.Send)
}

func lenOf(b Buffer) int {
	if b == nil {
		return 0
	}
	return b.Len()
}

// Validate checks c as issued by rank of a communicator of size ranks. It
// looks only at local facts (buffer lengths, types, ranks in range, counts);
// cross-rank agreement is the backend's job. The error wraps ErrInvalid.
func (c *Call) Validate(rank, size int) error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: %v: %s", ErrInvalid, c.Op, fmt.Sprintf(format, args...))
	}
	// need checks that b holds blocks·n elements; the product is checked,
	// so a huge buffer cannot wrap it to an empty one that passes.
	need := func(name string, b Buffer, blocks, n int) error {
		want, ok := checked.Mul(blocks, n)
		if !ok {
			return bad("%s buffer of %d blocks of %d elements: the count overflows int", name, blocks, n)
		}
		if b == nil {
			return bad("%s buffer is nil, want %d elements", name, want)
		}
		if b.Len() != want {
			return bad("%s buffer has %d elements, want %d", name, b.Len(), want)
		}
		return nil
	}
	if _, ok := opNames[c.Op]; !ok {
		return bad("unknown op")
	}
	if c.Op.Rooted() && (c.Root < 0 || c.Root >= size) {
		return bad("root %d out of range [0,%d)", c.Root, size)
	}
	if c.Op.Reduces() && !c.Reduce.Valid() {
		return bad("reduce op %v is not one of sum, avg, prod, min, max", c.Reduce)
	}
	if !c.Algorithm.Valid() {
		return bad("unknown algorithm %d", c.Algorithm)
	}
	if c.Send != nil && c.Recv != nil {
		if c.Send.DType() != c.Recv.DType() {
			return bad("send is %v but recv is %v", c.Send.DType(), c.Recv.DType())
		}
	}
	for _, b := range []Buffer{c.Send, c.Recv} {
		if b != nil && !b.DType().Valid() {
			return bad("invalid dtype %v", b.DType())
		}
	}
	switch c.Op {
	case OpAllReduce:
		if c.Send == nil {
			return bad("send buffer is nil")
		}
		return need("recv", c.Recv, 1, c.Send.Len())
	case OpBroadcast:
		if c.Recv == nil {
			return bad("buffer is nil")
		}
		if c.Send != nil && c.Send.Len() != c.Recv.Len() {
			return bad("send has %d elements but recv has %d", c.Send.Len(), c.Recv.Len())
		}
	case OpReduce:
		if c.Send == nil {
			return bad("send buffer is nil")
		}
		if rank == c.Root {
			return need("recv", c.Recv, 1, c.Send.Len())
		}
	case OpAllGather:
		if c.Send == nil {
			return bad("send buffer is nil")
		}
		return need("recv", c.Recv, size, c.Send.Len())
	case OpReduceScatter:
		if c.Recv == nil {
			return bad("recv buffer is nil")
		}
		return need("send", c.Send, size, c.Recv.Len())
	case OpGather:
		if c.Send == nil {
			return bad("send buffer is nil")
		}
		if rank == c.Root {
			return need("recv", c.Recv, size, c.Send.Len())
		}
	case OpScatter:
		if c.Recv == nil {
			return bad("recv buffer is nil")
		}
		if rank == c.Root {
			return need("send", c.Send, size, c.Recv.Len())
		}
	case OpAllToAll:
		if c.Send == nil {
			return bad("send buffer is nil")
		}
		if c.Send.Len()%size != 0 {
			return bad("send has %d elements, not a multiple of %d ranks", c.Send.Len(), size)
		}
		return need("recv", c.Recv, 1, c.Send.Len())
	case OpAllToAllV:
		return c.validateCounts(size, bad)
	case OpSend, OpRecv:
		if c.Peer < 0 || c.Peer >= size {
			return bad("peer %d out of range [0,%d)", c.Peer, size)
		}
		if c.Peer == rank {
			return bad("peer %d is this rank", c.Peer)
		}
		if c.Op == OpSend && c.Send == nil {
			return bad("send buffer is nil")
		}
		if c.Op == OpRecv && c.Recv == nil {
			return bad("recv buffer is nil")
		}
	}
	return nil
}

func (c *Call) validateCounts(size int, bad func(string, ...any) error) error {
	if c.Send == nil || c.Recv == nil {
		return bad("send and recv buffers are required")
	}
	total := func(name string, counts []int, have int) error {
		if len(counts) != size {
			return bad("%d %s counts for %d ranks", len(counts), name, size)
		}
		sum := 0
		for j, n := range counts {
			if n < 0 {
				return bad("%s count for rank %d is negative (%d)", name, j, n)
			}
			if n > have-sum { // compare before adding: a sum could overflow
				return bad("%s counts exceed the buffer of %d elements at rank %d", name, have, j)
			}
			sum += n
		}
		return nil
	}
	if err := total("send", c.SendCounts, c.Send.Len()); err != nil {
		return err
	}
	return total("recv", c.RecvCounts, c.Recv.Len())
}

// InPlace reports whether the call, as rank issues it, uses NCCL's in-place
// form: AllReduce, Broadcast and Reduce with send == recv; AllGather with
// send the rank-th block of recv; ReduceScatter with recv the rank-th block
// of send. Broadcast with no send buffer is in place too. Only memory the
// host addresses is inspected: host buffers and HostBacked views.
func (c *Call) InPlace(rank int) bool {
	s, r := HostView(c.Send), HostView(c.Recv)
	if s == nil || r == nil || len(s.Bytes()) == 0 {
		return c.Op == OpBroadcast
	}
	switch c.Op {
	case OpAllReduce, OpBroadcast, OpReduce:
		return HostOverlap(s, r) == Same
	case OpAllGather:
		off, ok := ByteOffset(r, s)
		return ok && off == rank*len(s.Bytes())
	case OpReduceScatter:
		off, ok := ByteOffset(s, r)
		return ok && off == rank*len(r.Bytes())
	}
	return false
}

// InPlaceRule describes op's in-place form, for error messages.
func InPlaceRule(op Op) string {
	switch op {
	case OpAllReduce, OpBroadcast, OpReduce:
		return "send == recv"
	case OpAllGather:
		return "send is recv's block at rank·n"
	case OpReduceScatter:
		return "recv is send's block at rank·n"
	}
	return "this op has no in-place form"
}
