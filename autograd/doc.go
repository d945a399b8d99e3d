// Package autograd is tape-based reverse-mode differentiation over
// distributed tensors (docs/design.md §4). Values and gradients are
// placement.DTensors; every op has a sharding rule; no op inserts a
// collective the caller did not ask for.
//
// # Tapes and values
//
// A Tape belongs to one rank (it is not safe for concurrent use; simulated
// ranks each make their own) and records ops in forward order. Param makes
// a leaf that requires grad, Constant one that does not; ops take Values
// and record a node when some input requires grad and recording is on.
// The ops: Redistribute (the only one that communicates), Add, Mul, Scale,
// Sum, MatMul, BatchedMatMul, Linear (replicated, data-parallel, colwise,
// rowwise), Transpose, Permute, Reshape, Narrow, SplitLast, Concat, GELU,
// Softmax, LogSoftmax, CausalSoftmax, LayerNorm, Embedding, CrossEntropy
// and CausalAttention; integer ids and targets travel as Indices. NoGrad runs a function
// with recording off. Every rank records the same ops in the same order.
// LocalFunc.Apply is the local escape hatch, with mandatory gradient placements;
// Custom records an op whose forward and backward may communicate (MoE
// dispatch and combine are built on it). Checkpoint runs a region of ops
// without saving activations and recomputes it during Backward.
//
// Backward(ctx, loss) needs a scalar loss (global shape [] or [1]) that is
// Replicate or Partial(sum) on every mesh axis; it seeds ones laid out as
// placement.GradSpec(loss), walks the nodes in reverse and accumulates
// into the leaves' Grad. It then clears the tape (also on error); leaves
// and their gradients survive, so gradients accumulate across Backward
// calls until ZeroGrad. Results of ops do not retain gradients.
//
// Gradients meeting at one value are added locally when their specs are
// equal; when they differ one is moved to the other's spec only if that
// needs no collective (Replicate -> Partial(sum) keeps the value on one
// rank, Replicate -> Shard takes the local chunk); otherwise Backward fails
// with ErrGradPlacement naming both placements. A gradient keeps the
// placement backward produced, which may differ from GradSpec of its value:
// a replicated weight used with a batch-sharded input gets a gradient that
// is Partial(sum) on the batch axis, which data parallelism then reduces.
//
// OnGradReady registers a hook on a leaf that fires during Backward the
// moment the leaf's gradient for the pass is final: right after the
// backward of the earliest recorded op that uses it, before any op recorded
// earlier is differentiated. The hook gets the context given to Backward
// and may return an error, which stops Backward. DDP and FSDP start their
// communication there.
//
// # Pipeline stages: graphs and the split backward
//
// A Graph is a recording scope of a tape (Graph.Do): a pipeline stage
// records each micro-batch's forward in its own Graph over the shared
// parameter leaves, keeps several in flight, and runs their backwards in
// any order; each walks and clears only its Graph, and the gradients add
// up in the leaves. BackwardFrom starts a backward from a stage's outputs
// with the gradients the next stage sent (or from the loss), and
// accumulates into the stage's input leaves too. BackwardInput and
// BackwardWeight split it as zero-bubble schedules need: the first
// computes the gradients of the inputs and of everything between, the
// second the weights' (Linear, MatMul, BatchedMatMul, LayerNorm and Mul
// compute the two separately; other ops' weight gradients are kept from
// the first half), and the sum is bit for bit BackwardFrom's.
//
// # Activation checkpointing
//
// Checkpoint runs a function of values (a region: a transformer block)
// without saving activations: its ops record nothing, one checkpoint node
// takes their place, and when Backward reaches it the region runs again
// with recording on (Tape.Recomputing reports true meanwhile) and a nested
// walk differentiates the recomputed ops, continuing the gradients
// pending for the region's inputs. The node's inputs are the given inputs
// and every value requiring grad the region read (parameters, captured
// values), so each leaf's OnGradReady hooks still fire once, after the
// node's backward. Gradients are bit for bit those without checkpointing.
// WithKeepOps (WithKeepMatrixProducts: Linear, MatMul, BatchedMatMul,
// CausalAttention) keeps those ops' results from the first run and reuses
// them in the recompute, looked up by the op's position in the region and
// checked against its name and spec; a region that runs other ops when
// recomputed fails Backward with ErrInvalid. Regions nest and may
// communicate. Under NoGrad Checkpoint just runs the function.
//
// ActivationBytes counts what the tape holds for backward: the distinct
// local blocks of the results of recorded ops not yet passed by the walk
// (and fused attention's probabilities), plus a checkpoint node's
// outputs, non-leaf inputs and kept results; PeakActivationBytes is its
// maximum since ResetPeak, recomputation included.
//
// # Local compute and memory
//
// Ops compute on local blocks: GEMMs on the tape's kernels.BLAS (one GEMM
// per Linear, with [..., in] flattened to rows and transposes passed as
// BLAS flags rather than copied) and, for float32, the fused row kernels of
// package kernels (LayerNorm, GELU, softmax, cross-entropy; float64
// accumulation, one rounding). CausalAttention on float32 inputs is one
// fused op. float64 blocks run plain loops and serve as references.
//
// Op results, the loss and leaf gradients are freshly allocated: a user
// may keep them. A tape made WithRecycling takes op results from its
// arena as well, for a training loop that declares each step's values
// dead with Tape.Recycle (WithPoisonRecycled checks that nothing reads them
// afterwards), and writes a leaf's next gradient into the memory ZeroGrad
// dropped. Custom ops take part through ResultBlock and ScratchBlock. What
// dies with a pass is recycled by every tape:
// values saved for backward and the gradients of intermediate values come
// from a per-tape arena, go back to it as soon as Backward has consumed
// them (unless another pending gradient shares their memory) and in any
// case when the tape is cleared, and are reused by the next pass. A
// LocalFunc's Backward therefore gets a gradient block that is valid only
// during the call. An arena holds about one pass's worth of such buffers
// between passes.
//
// # Sharding rules
//
// Each op has a rule (AddRule, MatMulRule, LinearRule, ...) that maps
// input specs to the output spec, or return an error wrapping ErrRule that
// names the mismatch and what would work. Linear reductions over a sharded
// dim (a sum over it, a sharded matmul contraction) give Partial(sum) with
// no communication; nonlinear ops (Mul) reject Partial inputs; elementwise
// ops accept only Partial(sum) among the Partials. Redistribute is the only
// op that communicates; its backward runs the dual plan
// (placement.Planner.Backward), or placement.Planner.ExtremumGrad from a
// Partial(max|min) source.
//
// # Checking gradients
//
// CheckGrad (and Checker) compares Backward's gradients with central
// finite differences of the global loss in float64, on a simulated mesh
// like any other collective code.
//
// The package holds no mutable global state.
package autograd
