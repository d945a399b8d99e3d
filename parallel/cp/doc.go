// Package cp is context parallelism: exact causal attention over a
// sequence whose dim T is sharded over a mesh axis (the cp axis), so that
// long sequences fit where attention and its activations would not fit on
// one rank.
//
// Every activation is laid out with T sharded over cp (placement.Shard,
// or placement.ShardBalanced for causal load balancing: rank r of k holds
// chunks r and 2k−1−r of 2k, so every rank does the same attention work);
// elementwise ops, LayerNorm, the MLP and the loss run on the local rows
// as they are. Only attention needs the other ranks' rows, and Attention
// computes it exactly by one of four methods:
//
//   - Ring: K/V blocks rotate around the cp ranks by send/receive,
//     double-buffered so the next block's transfer overlaps this block's
//     attention; partial results merge by log-sum-exp. Backward rotates
//     K and V again, with dK and dV travelling beside them back to their
//     owners; each step uses the K/V block of that step.
//   - AllGather: gather K and V once (fewer transfers, cp× K/V memory).
//   - Ulysses: all-to-all to head-sharded, attention over the whole
//     sequence, all-to-all back (the local heads must divide by cp).
//   - Hybrid: Ulysses within groups along an inner axis, ring across them.
//
// The block kernels are kernels.BlockAttentionForward, MergeAttention,
// AttentionRowDots and BlockAttentionBackward. The position ids of a
// sequence shard (for position embeddings and for the data loader) are
// placement's Spec.Positions.
package cp
