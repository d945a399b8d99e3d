// Package tp is tensor and sequence parallelism of a model written in
// global terms from package parallel's modules (docs/design.md §5), in the
// manner of PyTorch's parallelize_module and Megatron-LM: tp.Parallelize
// lays the modules a tp.Plan names out on one mesh axis, and
// VocabParallelCrossEntropy computes the loss of vocab-sharded logits.
//
// Use it when a model's layers are too large or too slow for one device:
// each rank holds a slice of every matched weight and the redistributions
// at the module boundaries keep the model's results those of one rank.
// Combine it with parallel/ddp or parallel/fsdp on other mesh axes for
// data parallelism. ExampleParallelize shards an MLP over two ranks.
//
// # Tensor and sequence parallelism
//
// A model is a tree of parallel.Modules (Linear, Embedding, LayerNorm,
// Attention, MLP, or the user's own) written in global terms. Parallelize
// applies a Plan, rules of dotted path patterns and Styles, on one mesh
// axis: ColwiseParallel and RowwiseParallel reshard Linear weights
// (Megatron's column and row parallel; RowwiseParallel on an Embedding is
// vocab parallel) and install the redistributions at the module
// boundaries; SequenceParallel, PrepareModuleInput and PrepareModuleOutput
// only install redistributions. Resharding lays each parameter out anew in place
// (autograd.Value.Relayout): a parameter list collected before Parallelize
// still holds the parameters. It runs before DDP or FSDP take the
// parameters (gradient hooks, buckets sized for a layout) and before the
// first backward. After
// backward (and ddp.DDP.Finish), ReduceGrads sums the gradients that sequence
// parallelism leaves Partial(sum) on the tensor-parallel axis.
// VocabParallelCrossEntropy takes vocab-sharded logits without gathering
// them.
//
// # Devices
//
// Parallelize, SequenceParallel and VocabParallelCrossEntropy work on
// device tensors with the host's results (the vocab-parallel loss through
// a host copy of the local logits), and Parallelize frees the replicated
// block each resharded parameter leaves behind.
package tp
