// Package fsdp is fully sharded data parallelism (FSDP, ZeRO and HSDP, in
// the manner of PyTorch's FSDP2 fully_shard; docs/design.md §5): each rank
// holds a shard of every parameter, gradient and optimizer state, and the
// units gather their parameters for forward and backward and
// reduce-scatter their gradients.
//
// Use it when the model's parameters, gradients and optimizer state do not
// fit on every rank (parallel/ddp is simpler when they do); FullyShard
// makes units of the modules a list of path patterns names.
// ExampleFullyShard shards an MLP over two ranks.
//
// # FSDP (ZeRO) and HSDP
//
// FSDP shards parameters, gradients and optimizer state over a mesh axis
// ("fsdp" by default), in the manner of PyTorch's FSDP2 fully_shard.
// New takes the mesh and options; Wrap makes a module a unit, bottom-up
// with the root last; FullyShard does both for the modules whose paths
// match path patterns ("h.*", as in tp.Plan). A unit's parameters (those
// of its subtree not in units wrapped before it) are laid out anew, in
// place, as Shard(0) on the shard axis (WithShardDim picks another dim; a
// dim already sharded by tensor parallelism keeps that axis outer:
// placement.WithOrder(dim, "tp", "fsdp")), exactly, by the chunk rule of
// the placement package (uneven and empty shards included). The leaves
// stay the parameters (autograd.Value.Relayout), so FSDP.Params,
// parallel.Params of the model and a list collected before wrapping all
// hold the sharded leaves: the optimizer's parameters, so that its state
// is 1/p. Every parallel.ParamHolder in a unit must implement
// parallel.ParamSetter (Linear, Embedding and LayerNorm do).
//
// The gathered form of each parameter is a second leaf, laid out as the
// parameter was before FSDP, whose local block is a view into a per-unit
// flat buffer. A unit's enter hook waits for (or issues) its all-gather,
// copies the parameters out of the gather's staging layout (each rank's
// chunk is its shards concatenated, padded to the largest rank's share,
// plus two elements naming the unit) into the views and swaps the module
// fields to the gathered leaves; its first output hook of the pass swaps
// them back and, by the reshard policy, frees the gathered buffer
// (WithReshard(true), the default), keeps it (WithReshard(false)) or keeps this
// rank's 1/n of it (WithReshardTo(n), gathered again in backward within
// groups of n consecutive shard-axis ranks). Every output is wrapped in an
// identity op whose backward is the unit's pre-backward: gather again if
// resharded and prefetch the unit backward reaches next. Under WithPrefetch(true)
// (the default) the enter hook also issues the next unit's all-gather:
// by explicit lists (WithPrefetchForward, WithPrefetchBackward), else the forward
// order recorded in the previous step (the first step assumes the root,
// then wrap order) and its reverse in backward. The root unit (wrapped
// last, containing every other) is never resharded after forward, as in
// FSDP2: its parameters are used first in forward and last in backward.
//
// Go cannot free memory that saved activations still reference, so
// resharding reuses memory instead: units resharded after forward take
// their gathered buffer from one of two pooled slots, alternating in wrap
// order, each sized to its largest unit, so that a unit's backward gathers
// into the very memory its forward's ops captured. Other units own their
// buffer. A unit that needs its slot while another unit holds it fails
// with ErrInvalid (a prefetch is skipped instead): wrap units in execution
// order.
//
// In backward, hooks on the gathered leaves mark a unit ready once all of
// its leaves are final; reduce-scatters launch strictly in reverse wrap
// order (the root last), each as soon as it and all before it are ready,
// as DDP's buckets do, and Finish launches the rest (parameters without a
// gradient contribute zeros) and installs the sharded gradients, laid out
// like the sharded parameters on the shard and replicate axes (other axes
// as backward produced them: tp.ReduceGrads then handles sequence
// parallelism's Partial norm weights). All-gathers and reduce-scatters
// run on two duplicates of the shard-axis communicator, so their relative
// order cannot differ across ranks. A parameter no rank gave a gradient
// keeps none. Gradients are summed, the convention of CrossEntropy;
// WithAverage divides by the data-parallel ranks, WithGradientDivideFactor by
// a given factor.
//
// HSDP: with WithReplicateAxis (a mesh ("dp", "fsdp") and the batch sharded on
// both), each unit's reduce-scatter on the shard axis is followed by an
// all-reduce of its shard over the replicate axis. Accumulation: several
// forward and backward passes before one Finish add up as on one rank,
// in every configuration, as in FSDP2: each pass reduces its gradients (a
// forward that follows a backward first launches the reductions the
// previous pass left: every pass issues every unit's) and adds them to the
// sharded gradient (HSDP reduces a later pass's sum over the replicas on
// its own and adds it). NoSync runs micro-batches without reduction (the
// gathered leaves accumulate gradients); NoReplicaSync reduce-scatters
// each micro-batch and skips the replicate all-reduce until the synced
// one. WithZeROStage(2) keeps the
// parameters gathered from a step's first forward to Finish; WithZeROStage(1)
// also all-reduces gradients in full, each rank keeping its slice.
// WithMixedPrecision(comm.BFloat16) all-gathers bfloat16 copies of the float32
// master weights (half the bytes) and reduces gradients in float32.
//
// WithShardAxes shards over several mesh axes flattened into one shard
// group (torchtitan's dp_shard×cp): each rank holds 1/(n₁·n₂·…) of a
// parameter, Shard(dim) on every named axis in the nested chunk order, and
// the one reduce-scatter over the group also sums the gradients'
// Partial(sum) over a context-parallel axis.
//
// Ranks that run different modules (non-SPMD control flow) gather or
// reduce different units at the same point: the unit tags in every chunk
// make that an error on every rank naming the units (ErrMismatch), or the
// communicator's timeout, wrapped with the operation and the unit's path.
// A rank can also skip a unit and still issue its peers' collectives (the
// unit was prefetched, or kept gathered by WithReshard(false) or ZeRO-1/2, and
// is reduced with zeros), which the tags cannot see. So each rank keeps a
// trace of the units it enters in forward (not a checkpointed region's
// recomputation), and at the first reduction of every pass the
// data-parallel ranks (shard and replicate axes) compare its 64-bit hash:
// an all-gather of 8 bytes a rank on a communicator of its own, in flight
// while the reductions run. When the hashes differ, the end of the pass
// (Finish, Discard, NoReplicaSync), where every rank has issued the same
// collectives, exchanges the traces and fails on every rank with the same
// *comm.DisagreementError naming the ranks and the first unit that
// differs ("rank 1 has nothing at position 1 where ranks 0, 2, 3 have
// "proj""), before any gradient is installed. A unit that some ranks skip
// is therefore an error, never a sum with zeros (DDP, by contrast, sums a
// parameter that only some ranks used). A WithReshardTo group's communicator
// numbers its ranks from 0: errors of its all-gathers say which
// shard-axis rank each group rank is. Bytes reports the memory FSDP holds; Traffic the bytes each rank
// sent: an all-gather of chunk c bytes over k ranks sends (k−1)·c, that
// is (k−1)/k of the padded unit, and the flight recorders of the
// communicators count c per call.
//
// # Explicit control (pipelining)
//
// A caller may decide when parameters are gathered and gradients reduced,
// as a pipeline schedule's UNSHARD, RESHARD and REDUCE_GRAD do (FSDP2's
// unshard, reshard, set_requires_gradient_sync and
// set_reshard_after_backward): UnshardAsync starts the all-gathers of
// some or all units (Wait completes them; Unshard does both), Reshard
// frees them, SetRequiresGradientSync(false) makes every backward of the
// step (micro-batches interleaved, split backwards) add its gradients
// unsharded so that Finish reduce-scatters their sum once, and
// SetReshardAfterBackward(false) keeps the units not resharded after
// forward gathered until Reshard or Finish. The hooks still gather what is
// not gathered when a unit is entered.
//
// # Devices
//
// FSDP and ZeRO keep their shards, unsharded buffers, staging buffers
// (cast to bfloat16 under WithMixedPrecision with the device's Cast), sharded
// gradients, pooled unsharded gradients, WithReshardTo's kept pieces and
// HSDP's replicate all-reduces on the parameters' device, ordered after
// the compute stream (device.BeforeCollective) and before later compute
// (device.AfterCollective), and free them in Close. Results on device/emu
// are the host's bit for bit.
package fsdp
