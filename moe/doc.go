// Package moe is loom's mixture-of-experts layer (docs/design.md §1, §3): the
// router, the Routed dispatch and combine that move token rows to the ranks
// owning their experts and back, grouped experts, and the load-balancing
// losses.
//
// # Router
//
// A Router holds the router weight Wr [E, D] (a parameter, no bias,
// Replicate on every mesh axis) and a RouterConfig. Router.Route takes this
// rank's tokens x [n, D], laid out Shard(0) on the token-sharding mesh axes
// (say "ep" and "dp") and Replicate on the others, and returns a Routing:
// for every local token its K experts in descending score (−1 for a slot
// dropped by the capacity limit), the differentiable gate weights [N, K]
// laid out like the token rows, the auxiliary losses as scalars that are
// Partial(sum) on the token-sharding axes, and the global tokens per expert.
//
// The forward pass, for token t with logits z_t = Wr·x_t:
//
//	p_t      = softmax(z_t)  or  σ(z_t)             # scores, [E]
//	e_t1..K  = the K largest p_t[e] + b[e]           # b: expert bias, selection only
//	           (descending; equal values: lower expert index first;
//	            optionally only inside the TopGroups best of NumGroups groups)
//	q_tj     = p_t[e_tj]
//	g_tj     = s·q_tj / Σ_i q_ti   (Renormalize)  or  s·q_tj,  s = GateScale
//	g_tj     = 0 for a slot dropped by the capacity limit
//
// With AuxCoef α and ZCoef β the Switch/GShard load-balancing loss and the
// ST-MoE z-loss over the N global tokens are
//
//	aux = α · E · Σ_e f_e · P_e,  f_e = c_e/(N·K) (a constant),  P_e = (1/N)·Σ_t p_t[e]
//	z   = β · (1/N) · Σ_t (log Σ_e exp z_t[e])²
//
// where c_e counts the slots that selected expert e (before the capacity
// limit) and, for sigmoid scores, P uses σ(z_t) normalised to sum to 1
// over the experts (as Megatron does). Gradients reach Wr and x through the gates (the renormalisation
// and the score function), through P_e and through the log-sum-exp, exactly
// as in reference/MOE_LAYER.md §4; the choice of experts and the
// counts carry no gradient.
//
// # Distribution
//
// The router communicates once per Route: one all-reduce(sum) of a few
// per-expert int64 counts over the token-sharding axes (nothing when they
// span a single rank), after every argument has been checked. Everything
// else is local: the logits are an autograd.Linear of the sharded tokens
// with the replicated weight, and the gates and losses are local functions
// (autograd.LocalFunc) with declared gradient placements, so the weight's
// gradient is Partial(sum) on the token-sharding axes, to be reduced by data
// parallelism like any replicated parameter's.
//
// The capacity limit is applied per rank over its local tokens, as Megatron
// does: capacity = ⌈CapacityFactor · n·K / E⌉ for the rank's n tokens,
// so token dropping (unlike dropless routing) depends on how the tokens are
// sharded. Dropless routing (the default) gives the same routing, gates and
// losses whatever the sharding.
//
// # Precision
//
// The router computes in the dtype of x and Wr, float32 or float64 (the
// only dtypes of loom's local tensors), so it never runs below float32:
// float32 inputs give the float32 arithmetic of the reference
// (reference/MOE_LAYER.md), float64 inputs Megatron's router_dtype fp64. Scores are
// rounded to that dtype before selection, as the reference selects on
// float32 probabilities; sums (softmax denominators, log-sum-exp, the
// losses) accumulate in float64.
//
// # Dispatch, experts and combine
//
// Dispatch moves every routed slot's token row to the rank that owns its
// expert (experts are Shard(0) over the expert-parallel axis, E/ep per
// rank): the rows are permuted expert-major with the kernels package's
// permute kernels, the ranks exchange their per-expert counts (one small
// all-gather that also checks that every rank was called alike, so a bad
// argument fails everywhere before any row moves), and the rows travel by
// all-to-all-v. The result is laid out Routed on the token-sharding axes,
// its data-dependent row counts carried by the spec
// (placement.WithRoutedRows), and a Handle remembers the permutation and
// the counts. Experts.Forward runs each local expert's MLP on its
// contiguous rows; Combine sends the rows back and sums each token's K
// outputs weighted by its gates. Dispatch and Combine are each other's
// backward through the Handle, so the gradient path moves exactly the
// forward's rows in reverse. Ranks and experts with no rows are ordinary.
//
// Where the ranks share one address space (comm.SharedMemory: comm/local's
// in-process ranks), the rows take a fused path instead of the
// all-to-all-v's: each pass is one comm.SharedMemory.Share in which an
// expert's rank gathers its rows straight from the token ranks' inputs
// and a token's rank sums its rows straight from the experts' outputs
// (kernels.PermuteExpert, kernels.UnpermuteSegments), so each row moves
// once, as DeepEP's kernels write into their peers' buffers over NVLink.
// In the combine's backward the expert's rank gathers the gate-scaled
// gradient rows and, in the same pass, computes the gates' gradient
// against the rows it holds, writing it into the token rank's buffer
// (kernels.UnpermuteBackwardExpert).
// DispatchConfig.Collectives selects the all-to-all-v path anyway, the one
// MPI and NCCL communicators take, to test it in process.
//
// With a capacity (DispatchConfig.Capacity, or a router that pads to
// capacity) every expert gets exactly that many rows, padded with zeros,
// and the count exchange is skipped unless diagnostics are asked for. The
// Layer puts router, dispatch, experts and combine together, and Stats
// reports per step the send-count matrix, tokens per expert, the largest
// row and column, dropped and padded fractions, and the time spent in
// permute, count exchange, payload exchange, experts and combine (with
// DispatchConfig.Diagnostics also the wait for the slowest rank before
// each later pass: what imbalance costs).
//
// A Layer is a parallel.Module, a leaf of a model's tree: parallel.Params
// collects its router and expert parameters, Plan and FullyShard patterns
// name it by its path (FSDP can make it a unit), and its Forward runs its
// hooks. ShardExperts names the expert parameters by the layer's path
// (WithPrefix). SeqLayer puts a Layer in a parallel.Sequential and adds
// the routing losses to the task loss (SeqLayer.AddLosses).
//
// # Devices
//
// Tokens and parameters whose local blocks live on a device
// (autograd.WithDevice; float32) run the same steps there, in the same
// order on the same values: the router's logits are computed on the
// device and copied to the host, where the experts are chosen and the
// gates and losses computed (the dispatch's plan is host metadata either
// way), and the gates and losses are copied back; the permutes run as the
// device's device.MoEKernels, the experts' GEMMs, GELU and sums as its
// Kernels, and the all-to-all-v's take the device buffers, ordered after
// the compute that wrote them (device.BeforeCollective) and before the
// compute that reads them (device.AfterCollective). The fused path is host
// memory's: on a device the payload always takes the all-to-all-v's. A
// device without MoE kernels, or float64 data on a device, is an error
// wrapping ErrUnsupported. On the emulated device (device/emu) the results
// are the host's bit for bit.
//
// The package holds no mutable global state; a Router's expert bias is
// the only state it keeps, and the training loop updates it explicitly
// (Router.UpdateExpertBias).
package moe

import "github.com/b7ea7098/loom"

// ErrInvalid marks arguments rejected before any data moved: a bad
// configuration, a nil router or value, shapes or placements that do not
// fit, counts of the wrong length. Test for it with errors.Is; errors from
// autograd, placement and comm are wrapped unchanged beside it.
var ErrInvalid = loom.NewSentinel("moe: invalid argument", loom.ErrInvalid)
