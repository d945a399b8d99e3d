package placement

import (
	"fmt"

	"github.com/b7ea7098/loom/comm"
)

// Kind is the kind of a Placement.
type Kind uint8

// The placement kinds of docs/design.md §3.
const (
	// KindReplicate: every rank on the axis holds the whole value.
	KindReplicate Kind = iota + 1
	// KindShard: one tensor dim is split over the axis (torch.chunk rule).
	KindShard
	// KindPartial: the value is a reduction of the ranks' local tensors.
	KindPartial
	// KindRouted: MoE layout decided by a routing handle (moe package).
	KindRouted
)

// String returns the kind's name ("replicate", "shard", ...).
func (k Kind) String() string {
	switch k {
	case KindReplicate:
		return "replicate"
	case KindShard:
		return "shard"
	case KindPartial:
		return "partial"
	case KindRouted:
		return "routed"
	}
	return fmt.Sprintf("kind(%d)", uint8(k))
}

// Placement says how a tensor is laid out along one mesh axis. The zero
// value is invalid; build one with Replicate, Shard, Partial or Routed.
// Placements are comparable values.
type Placement struct {
	kind Kind
	dim  int
	op   comm.ReduceOp
	bal  bool // ShardBalanced
}

// Replicate is the placement where every rank on the axis holds the whole
// value.
func Replicate() Placement { return Placement{kind: KindReplicate} }

// Shard splits tensor dim over the axis in rank order with the torch.chunk
// rule: chunk = ceil(n/k), so trailing ranks may hold fewer rows or none.
func Shard(dim int) Placement { return Placement{kind: KindShard, dim: dim} }

// Partial is the placement where the global value is op over the ranks'
// local tensors along the axis. Sum, Avg, Max and Min are supported; Sum and
// Avg may be mixed across axes, Max and Min may not be mixed with any other
// operator (the order of reduction would change the value).
//
// Max and Min reduce as the communicator's all-reduce does: comm/local and
// NCCL propagate NaN, so an element is NaN when any rank's is. Their
// gradient (Planner.ExtremumGrad) goes to one rank per element: the lowest
// whose value equals the extremum, and where the extremum is NaN, the
// lowest rank holding a NaN; summed over the ranks it is the incoming
// gradient, NaN positions included.
func Partial(op comm.ReduceOp) Placement { return Placement{kind: KindPartial, op: op} }

// Routed is the MoE placement: the rows of dim 0 (token copies, one per
// token and chosen expert) live on the ranks that own their experts, as the
// routing decided. The row counts, known only at run time, are given with
// WithRoutedRows; the moe package's dispatch and combine create and consume
// Routed tensors and hold the routing handle (the permutation and the
// per-rank, per-expert counts). Redistribute rejects Routed with
// ErrUnsupported.
func Routed() Placement { return Placement{kind: KindRouted} }

// Kind returns the placement's kind.
func (p Placement) Kind() Kind { return p.kind }

// Dim returns the sharded tensor dim of a Shard placement, or -1.
func (p Placement) Dim() int {
	if p.kind != KindShard {
		return -1
	}
	return p.dim
}

// Op returns the reduce operator of a Partial placement, or 0.
func (p Placement) Op() comm.ReduceOp {
	if p.kind != KindPartial {
		return 0
	}
	return p.op
}

// IsReplicate reports whether p is Replicate.
func (p Placement) IsReplicate() bool { return p.kind == KindReplicate }

// IsShard reports whether p is a Shard placement.
func (p Placement) IsShard() bool { return p.kind == KindShard }

// IsPartial reports whether p is a Partial placement.
func (p Placement) IsPartial() bool { return p.kind == KindPartial }

// IsRouted reports whether p is Routed.
func (p Placement) IsRouted() bool { return p.kind == KindRouted }

// String returns the short form used in plans and errors: "R", "S(0)",
// "Sbal(1)" (ShardBalanced), "P(sum)", "Routed".
func (p Placement) String() string {
	switch p.kind {
	case KindReplicate:
		return "R"
	case KindShard:
		if p.bal {
			return fmt.Sprintf("Sbal(%d)", p.dim)
		}
		return fmt.Sprintf("S(%d)", p.dim)
	case KindPartial:
		return fmt.Sprintf("P(%v)", p.op)
	case KindRouted:
		return "Routed"
	}
	return "invalid"
}

// validate checks p for a tensor of rank ndim.
func (p Placement) validate(ndim int) error {
	switch p.kind {
	case KindReplicate, KindRouted:
		return nil
	case KindShard:
		if p.dim < 0 || p.dim >= ndim {
			return fmt.Errorf("shard dim %d out of range for a %d-d tensor", p.dim, ndim)
		}
		return nil
	case KindPartial:
		switch p.op {
		case comm.Sum, comm.Avg, comm.Max, comm.Min:
			return nil
		}
		return fmt.Errorf("partial reduce op %v is not one of sum, avg, max, min", p.op)
	}
	return fmt.Errorf("zero or unknown placement (build one with Replicate, Shard, Partial or Routed)")
}

// linear reports whether a Partial op is linear (sum, avg).
func linear(op comm.ReduceOp) bool { return op == comm.Sum || op == comm.Avg }
