// Package parallel holds loom's parallelism modules (docs/design.md §5), built on
// autograd's gradient hooks and the placement and comm packages. It starts
// with DDP, data parallelism with replicated parameters, and tensor and
// sequence parallelism of modules written in global terms.
//
// # DDP
//
// With the batch sharded on the data-parallel mesh axis ("dp" by default)
// and every parameter Replicate there, backward leaves each parameter's
// gradient Partial(sum) on dp: every rank holds its batch shard's
// contribution. DDP all-reduces those contributions in buckets while
// backward is still running and, at Finish, installs the reduced gradients
// laid out Replicate on dp, which optim.AdamW accepts.
//
// Buckets are planned once, at New, from the parameter list alone (local
// block sizes and dtypes, which are the same on every rank of a dp group),
// so every rank holds the same buckets in the same order (New checks that
// the ranks' lists agree, since lists in different orders would sum one
// parameter's gradient into another's): parameters are
// taken in reverse order (backward produces the last layers' gradients
// first), the first bucket is small (DefaultFirstBucket, 1 MiB) so that
// communication starts early, later buckets are capped (DefaultBucketCap,
// 25 MiB), and a parameter larger than the limit gets a bucket of its own.
// A bucket also ends where the dtype changes. Buckets are launched strictly
// in bucket order, each as soon as it and all buckets before it are
// complete (PyTorch's rule), so the sequence of collectives on the dp
// communicator is identical on every rank even when hooks fire in a
// slightly different order.
//
// # Bucket size and dp
//
// A ring all-reduce of b bytes over dp ranks moves 2(dp−1)/dp·b bytes per
// rank in 2(dp−1) steps: the bandwidth term is almost independent of dp but
// the latency term grows linearly with it. To stay bandwidth-bound at large
// dp the cap should grow with dp (Megatron uses max(40M, 1M·dp) elements);
// ScaledBucketCap(dp) = max(25 MiB, dp·1 MiB) is that rule with PyTorch's
// base. The first bucket should stay small (it exists only to start
// communication early) and need not scale.
//
// # Loss convention and scaling
//
// DDP sums the ranks' contributions. That is right when the loss is already
// normalised by the global count, as autograd.CrossEntropy does: with rows
// sharded on dp each rank contributes its rows' losses divided by the global
// number of rows, and the sum of the contributions is the global mean. For
// other conventions, scale each rank's contribution before the sum:
//
//   - a per-rank mean over equal local counts: the Average option (1/dp);
//   - a per-rank mean over n_r of N global tokens (uneven shards, padding):
//     SetScale(n_r/N) before the synced backward;
//   - a per-rank sum of token losses: SetScale(1/N).
//
// # Accumulation and unused parameters
//
// NoSync runs a function (forward and backward of a micro-batch) with the
// hooks disabled: gradients accumulate locally, Partial(sum) on dp. The
// next backward outside NoSync sees the accumulated gradient in its hooks,
// and Finish reduces the sum of all micro-batches.
//
// A parameter that gets no gradient in a step keeps its bucket from
// completing during backward; Finish then launches every remaining bucket
// in order, filling such parameters with zeros (or with the gradient they
// accumulated under NoSync), so no rank hangs and every rank issues the
// same collectives. A parameter that some ranks used gets the reduced sum;
// one that no rank used keeps no gradient after Finish (one small
// all-reduce of presence flags decides), so the optimizer leaves it alone
// as serial training would. Unused lists those; the ReportUnused option
// reports them at every Finish. An unused
// parameter in an early bucket delays every later bucket to Finish, so
// overlap is lost: remove such parameters from the list given to New.
//
// When Backward fails midway, some buckets may have launched: call
// Discard, which completes the step's collectives without installing
// anything (peers that call Finish are matched), then ZeroGrad and retry.
//
// # FSDP (ZeRO) and HSDP
//
// FSDP shards parameters, gradients and optimizer state over a mesh axis
// ("fsdp" by default), in the manner of PyTorch's FSDP2 fully_shard.
// NewFSDP takes the mesh and options; Wrap makes a module a unit,
// bottom-up with the root last; FullyShard does both for the modules
// whose paths match Plan patterns ("h.*"). A unit's parameters (those of
// its subtree not in units wrapped before it) are laid out anew, in place,
// as Shard(0) on the shard axis (ShardDim picks another dim; a dim
// already sharded by tensor parallelism keeps that axis outer:
// WithOrder(dim, "tp", "fsdp")), exactly, by the chunk rule of the
// placement package (uneven and empty shards included). The leaves stay
// the parameters (autograd.Value.Relayout), so FSDP.Params, Params of the
// model and a list collected before wrapping all hold the sharded leaves:
// the optimizer's parameters, so that its state is 1/p. Every ParamHolder in a unit must
// implement ParamSetter (Linear, Embedding and LayerNorm do).
//
// The gathered form of each parameter is a second leaf, laid out as the
// parameter was before FSDP, whose local block is a view into a per-unit
// flat buffer. A unit's enter hook waits for (or issues) its all-gather,
// copies the parameters out of the gather's staging layout (each rank's
// chunk is its shards concatenated, padded to the largest rank's share,
// plus two elements naming the unit) into the views and swaps the module
// fields to the gathered leaves; its first output hook of the pass swaps
// them back and, by the reshard policy, frees the gathered buffer
// (Reshard(true), the default), keeps it (Reshard(false)) or keeps this
// rank's 1/n of it (ReshardTo(n), gathered again in backward within
// groups of n consecutive shard-axis ranks). Every output is wrapped in an
// identity op whose backward is the unit's pre-backward: gather again if
// resharded and prefetch the unit backward reaches next. With Prefetch
// (the default) the enter hook also issues the next unit's all-gather:
// by explicit lists (PrefetchForward, PrefetchBackward), else the forward
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
// as backward produced them: ReduceGrads then handles sequence
// parallelism's Partial norm weights). All-gathers and reduce-scatters
// run on two duplicates of the shard-axis communicator, so their relative
// order cannot differ across ranks. A parameter no rank gave a gradient
// keeps none. Gradients are summed, the convention of CrossEntropy;
// FSDPAverage divides by the data-parallel ranks, GradientDivideFactor by
// a given factor.
//
// HSDP: with ReplicateAxis (a mesh ("dp", "fsdp") and the batch sharded on
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
// one. ZeROStage(2) keeps the
// parameters gathered from a step's first forward to Finish; ZeROStage(1)
// also all-reduces gradients in full, each rank keeping its slice.
// MixedPrecision(comm.BFloat16) all-gathers bfloat16 copies of the float32
// master weights (half the bytes) and reduces gradients in float32.
//
// Ranks that run different modules (non-SPMD control flow) gather or
// reduce different units at the same point: the unit tags in every chunk
// make that an error on every rank naming the units (ErrMismatch), or the
// communicator's timeout, wrapped with the operation and the unit's path.
// A rank can also skip a unit and still issue its peers' collectives (the
// unit was prefetched, or kept gathered by Reshard(false) or ZeRO-1/2, and
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
// parameter that only some ranks used). A ReshardTo group's communicator
// numbers its ranks from 0: errors of its all-gathers say which
// shard-axis rank each group rank is. Bytes reports the memory FSDP holds; Traffic the bytes each rank
// sent: an all-gather of chunk c bytes over k ranks sends (k−1)·c, that
// is (k−1)/k of the padded unit, and the flight recorders of the
// communicators count c per call.
//
// # Building a model
//
// NewLinear, NewEmbedding, NewLayerNorm, NewAttention and NewMLP make
// modules with fresh parameters on a tape, Replicate on every axis of a
// mesh: the dims are positional, the rest are LayerOptions (WithName,
// WithBias, WithInit, WithBiasInit, WithDType, WithEps). An Init fills a
// parameter the same way on every rank: Normal(std, seed) draws from a
// seeded generator shared by every copy of it (so the construction order
// fixes the values), Zeros, Ones, Values (one parameter's given values) or
// ByName (given values by parameter name, e.g. a checkpoint). Weights
// default to N(0, 0.02²) seeded by the parameter's name, LayerNorm weights
// to ones, biases to zeros.
//
// # Paths and names
//
// A model is a tree: each module's Children are named, and a module's path
// is its ancestors' names joined with dots from the root, which has path ""
// (a GPT's first MLP fc: "h.0.mlp.fc", where "h" is the block list, "0"
// the first block, "mlp" its MLP and "fc" the MLP's first Linear). Plan
// patterns match those paths, segment by segment, "*" matching any one
// segment ("h.*.mlp.fc"). The built-in modules' child names are fixed:
// Attention has "qkv" and "proj", MLP has "fc" and "proj"; Linear,
// Embedding and LayerNorm are leaves. Parameter names are separate from
// paths: the constructors name them <path>.weight and <path>.bias (an
// Embedding's table <path>) when given the module's path with WithName,
// which keeps them aligned with PyTorch's state_dict keys.
//
// # Tensor and sequence parallelism
//
// A model is a tree of Modules (Linear, Embedding, LayerNorm, Attention,
// MLP, or the user's own) written in global terms. Parallelize applies a
// Plan, rules of dotted path patterns and Styles, on one mesh axis:
// ColwiseParallel and RowwiseParallel reshard Linear weights (Megatron's
// column and row parallel; RowwiseParallel on an Embedding is vocab
// parallel) and install the redistributions at the module boundaries;
// SequenceParallel, PrepareInput and PrepareOutput only install
// redistributions. Resharding lays each parameter out anew in place
// (autograd.Value.Relayout): a parameter list collected before Parallelize
// still holds the parameters. It runs before DDP or FSDP take the
// parameters (gradient hooks, buckets sized for a layout) and before the
// first backward. After
// backward (and DDP.Finish), ReduceGrads sums the gradients that sequence
// parallelism leaves Partial(sum) on the tensor-parallel axis.
// VocabParallelCrossEntropy takes vocab-sharded logits without gathering
// them.
//
// # Activation checkpointing
//
// Checkpoint(root, patterns, opts...) wraps the forward body of every
// module whose path matches a pattern ("h.*": every GPT block) in
// autograd.Checkpoint, through an Around wrapper: the module's input hooks
// and computation keep no activations and are recomputed during backward,
// with gradients identical bit for bit; its enter and output hooks run
// once, outside. autograd.KeepMatrixProducts() makes it selective (the
// matrix products' results are kept, the rest recomputed). It composes
// with Parallelize (in either order), DDP (each hook fires once, after the
// checkpointed module's backward) and FSDP (Tape.Recomputing tells a hook
// that the region is being rerun: a unit entered again then keeps its
// parameters for the backward that follows, prefetches nothing and starts
// no new pass), whether the checkpointed modules are FSDP units or
// contain them. Tape.PeakActivationBytes measures the saving.
//
// # Devices
//
// A module's parameters live on its tape's device (autograd.WithDevice:
// the host by default, or a device of package device such as device/emu
// or a GPU): the constructors compute the initial value on the host and
// copy it there once. Parallelize, SequenceParallel, Checkpoint and
// VocabParallelCrossEntropy work on device tensors with the host's
// results (the vocab-parallel loss through a host copy of the local
// logits), and Parallelize frees the replicated block each resharded
// parameter leaves behind. DDP keeps its buckets, and a reduced-gradient
// block per parameter (none under GradientAsBucketView), on the
// parameters' device, allocated at New and freed by Close, so a step
// allocates no device memory: the hooks copy and scale gradients on the
// device's compute stream, each all-reduce is ordered after that stream
// (device.BeforeCollective) and later compute after it
// (device.AfterCollective), and Finish copies the reduced values into the
// gradient blocks. FSDP and ZeRO keep their shards, unsharded buffers,
// staging buffers (cast to bfloat16 under MixedPrecision with the
// device's Cast), sharded gradients, pooled unsharded gradients,
// ReshardTo's kept pieces and HSDP's replicate all-reduces on the
// parameters' device, with the same ordering, and free them in Close.
// Results on device/emu are the host's bit for bit.
package parallel
