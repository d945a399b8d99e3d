// Package ddp is data parallelism with replicated parameters (DDP, in the
// manner of PyTorch's DistributedDataParallel; docs/design.md §5): every
// rank holds the whole model and a shard of the batch, and New's hooks
// all-reduce the gradients in buckets while backward runs.
//
// Use it when the model, its gradients and its optimizer state fit on every
// rank; parallel/fsdp shards them when they do not. ExampleNew trains a
// Linear on two ranks.
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
//   - a per-rank mean over equal local counts: the WithAverage option (1/dp);
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
// as serial training would. Unused lists those; the WithReportUnused option
// reports them at every Finish. An unused
// parameter in an early bucket delays every later bucket to Finish, so
// overlap is lost: remove such parameters from the list given to New.
//
// When Backward fails midway, some buckets may have launched: call
// Discard, which completes the step's collectives without installing
// anything (peers that call Finish are matched), then ZeroGrad and retry.
//
// # Devices
//
// DDP keeps its buckets, and a reduced-gradient block per parameter (none
// under WithGradientAsBucketView), on the parameters' device, allocated at New
// and freed by Close, so a step allocates no device memory: the hooks copy
// and scale gradients on the device's compute stream, each all-reduce is
// ordered after that stream (device.BeforeCollective) and later compute
// after it (device.AfterCollective), and Finish copies the reduced values
// into the gradient blocks. Results on device/emu are the host's bit for
// bit.
package ddp
