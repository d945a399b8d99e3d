// Package parallel holds loom's module tree (docs/design.md §5): Module and
// its Hooks, Walk and Params, the layers (Linear, Embedding, LayerNorm,
// Attention, MLP, Sequential, the activations and Dropout) and their Inits,
// train and eval modes, and activation checkpointing. A model is written
// once, in global terms, from these modules; the parallelisms beside this
// package lay it out without touching its code:
//
//   - parallel/tp: tensor and sequence parallelism (tp.Parallelize with a
//     tp.Plan of tp.ColwiseParallel, tp.RowwiseParallel, ...);
//   - parallel/ddp: data parallelism with replicated parameters (ddp.New);
//   - parallel/fsdp: fully sharded data parallelism, ZeRO and HSDP
//     (fsdp.FullyShard).
//
// Use this package to build a model and to write modules of your own; use
// the others to distribute it. ExampleNewSequential builds a model, walks
// its paths and runs it; the README's "A first program" and examples/mlp
// show the whole path to a trained, distributed model.
//
// A parallelism acts on modules through their Hooks (Boundary): an enter
// hook, input and output hooks and Around wrappers that Hooks.Run calls
// around the module's computation, and through ParamSetter, which lets
// FSDP swap a module's parameter leaves. A module of your own takes part
// when it embeds Hooks and runs its forward through Hooks.Run.
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
// the first block, "mlp" its MLP and "fc" the MLP's first Linear). Path
// patterns (tp.Plan, fsdp.FullyShard, Checkpoint) match those paths, segment by segment, "*" matching any one
// segment ("h.*.mlp.fc"). The built-in modules' child names are fixed:
// Attention has "qkv" and "proj", MLP has "fc" and "proj"; Linear,
// Embedding and LayerNorm are leaves. Parameter names are separate from
// paths: the constructors name them <path>.weight and <path>.bias (an
// Embedding's table <path>) when given the module's path with WithName,
// which keeps them aligned with PyTorch's state_dict keys.
//
// # Activation checkpointing
//
// Checkpoint(root, patterns, opts...) wraps the forward body of every
// module whose path matches a pattern ("h.*": every GPT block) in
// autograd.Checkpoint, through an Around wrapper: the module's input hooks
// and computation keep no activations and are recomputed during backward,
// with gradients identical bit for bit; its enter and output hooks run
// once, outside. autograd.WithKeepMatrixProducts() makes it selective (the
// matrix products' results are kept, the rest recomputed). It composes
// with tp.Parallelize (in either order), DDP (each hook fires once, after the
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
// copy it there once. Checkpoint works on device tensors with the host's
// results. The parallelism packages keep every block they make on the
// parameters' device too (see their documentation).
package parallel
