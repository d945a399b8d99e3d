// Package placement describes distributed tensors on a DeviceMesh and moves
// them between layouts (docs/design.md §3).
//
// A Spec is one global tensor laid out on a mesh: the mesh, the global
// shape, the dtype (float32 or float64) and one Placement per mesh axis:
// Replicate, Shard(d), Partial(op) with op sum, avg, max or min, and Routed
// (the MoE placement: the rows of dim 0 sit on the ranks owning their
// experts, in run-time row counts given by WithRoutedRows; the moe package's
// dispatch and combine create and consume such tensors). When
// several axes shard the same tensor dim, the spec records their order,
// outer to inner (WithOrder); the default is mesh-axis order, and
// WithOrder(0, "tp", "dp") is FSDP over TP. Layout math (Spec.Box) gives
// every rank's offset and size in every dim for any nesting, with the
// torch.chunk rule: chunk = ceil(n/k), trailing ranks may hold fewer rows or
// none. Uneven and empty shards are exact, and so are global dims of 0 (a
// tensor with no elements redistributes like any other); padding used
// inside a collective is never visible.
//
// A DTensor is a rank's local block plus its Spec. Tensor data, local or
// global, is loom's own dense representation: a []float32 or []float64
// (the spec's dtype) in row-major order over the shape, so an empty block
// is an empty slice and a scalar is one element; LocalShape and LocalData
// give the local block. FromFull slices a tensor every rank holds, FromRoot
// scatters or broadcasts from one rank, FromLocal copies local blocks,
// optionally checking with one small all-gather that every rank agrees on
// the spec (global shape included) before any data moves, and NewLocal
// wraps a local block without copying. Full materialises the global
// tensor. This package does not use gorgonia.org/tensor; package
// github.com/b7ea7098/loom/dense converts at the edge.
//
// # Semantics of Partial
//
// As a source, the global value of a Partial(op) axis is op over the
// ranks' local tensors along it. Going to Partial(sum) from Replicate, the
// rank with coordinate 0 on the axis keeps the value and the others hold
// zeros; to Partial(avg|max|min) every rank keeps the value. Shard(d) ->
// Partial(sum) places the shard in zeros (no communication); Shard ->
// Partial(avg|max|min) gathers first. Partial -> Partial with the same op
// is a no-op; another op goes through Replicate. Sum and avg may be mixed
// across axes; max and min may not be mixed with any other op, since the
// order of reduction would change the value. Max and min propagate NaN as
// the communicator does (comm/local and NCCL: an element is NaN when any
// rank's is), and their gradient has one winner per element: the lowest
// rank whose value is the extremum, or, for a NaN extremum, the lowest
// rank holding a NaN (see Duality).
//
// # Redistribution
//
// A Planner turns (source spec, destination spec) into a Plan, caches it,
// and executes it. Plans are per-axis steps (all-gather, all-reduce,
// reduce-scatter, all-to-all, and local chunk / to-partial steps) chosen
// greedily like DTensor's planner: local moves first, then reductions while
// the data is small, then removals of shards inner to outer (all-to-all
// when the axis lands where the destination wants it), and misaligned
// nested shards gathered to Replicate and re-chunked. Size-1 axes and no-op
// steps never appear. When the per-axis plan needs two or more collectives,
// the planner also prices a direct plan, one all-to-all-v over the whole
// mesh that moves exactly the boxes whose owner changes, and takes it if it
// is faster by the cost model (without a model: fewer collectives and no
// more bytes). The same direct step moves a tensor between two meshes over
// the same world ranks (say the same 8 ranks as 2x4 and as 8); Partial
// sources are reduced on the source mesh first.
//
// Every step records its mesh axis, collective, tensor dim, the largest
// number of bytes any rank receives, and the cost model's estimate; a Plan
// prints them.
//
// # Duality
//
// Planner.Backward turns a forward plan into the plan that moves a gradient
// from the placement it arrives in (by default the destination with
// Partial -> Replicate) to the forward source's gradient placement (the
// source with Partial -> Replicate). This yields the table of docs/design.md §3:
// all-gather <-> local chunk or reduce-scatter, all-reduce -> identity,
// reduce-scatter -> all-gather, all-to-all(i->j) -> all-to-all(j->i),
// chunk -> all-gather, R->P(sum) -> identity, S->P(sum) -> chunk. Inner
// computes the cross-rank pairing <x, y> under which the backward plan is
// the adjoint. Partial(max|min) is not linear: its gradient goes to the
// rank whose value won (ties to the lowest rank; a NaN extremum is won by
// the lowest rank holding a NaN), which needs the forward values, so Backward returns ErrUnsupported for it and ExtremumGrad, given
// the forward source and result, computes it (laid out as Partial(sum)).
//
// # SPMD
//
// Every rank of the mesh calls the same functions with the same specs in
// the same order: collectives (and the first use of a mesh axis's
// communicator) are collective over the mesh. Errors wrap ErrInvalid,
// ErrMismatch or ErrUnsupported; local checks run before any data moves.
package placement
