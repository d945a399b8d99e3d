package comm

import (
	"context"
)

// Communicator is a fixed, ordered set of ranks that exchange data. Every
// collective is issued by all members in the same order with matching
// arguments; sequence numbers count them. Calls on one Communicator are
// issued from one goroutine at a time (their order defines the sequence);
// async work runs in that order in the background.
//
// Every blocking call honours its context and the communicator's timeout.
// Cancelling a context or timing out aborts the communicator, because the
// ranks can no longer agree on the sequence: every pending and later call on
// it, on every rank, then fails with an error naming who aborted and why.
//
// A call given a context that has already ended (Do, Start, Split, and the
// background work that Start queued, when it starts to run) aborts the
// communicator as it is issued, whether its rank arrives before its peers
// or after them: that call returns an error matching the context's error
// (context.Canceled or context.DeadlineExceeded), and every peer's call an
// AbortError naming the rank and the op. A context that ends while a call
// waits aborts the same way, unless the call completes first.
//
// Once a communicator is aborted, its cause wins: every wait that ends
// then, blocking or async (Work.Wait), returns an error for which
// errors.Is(err, ErrAborted) holds and which carries the aborting rank's
// message, even when the waiter's own context is cancelled meanwhile (as
// comm/local's Run cancels it when a rank fails).
type Communicator interface {
	// Rank is this member's position, 0..Size()-1.
	Rank() int
	// Size is the number of members.
	Size() int
	// Do runs one operation to completion.
	Do(ctx context.Context, c Call) error
	// Start issues one operation and returns at once; the Work handle
	// completes when the data is in place. Buffers must not be touched
	// until then.
	Start(ctx context.Context, c Call) (Work, error)
	// Split partitions the members by color, ordering each part by (key,
	// rank), like MPI_Comm_split. Every member calls it; a member passing a
	// negative color gets a nil Communicator.
	Split(ctx context.Context, color, key int) (Communicator, error)
	// Abort fails every pending and later call on this communicator, on
	// every rank, with an AbortError carrying cause.
	Abort(cause error)
	// Err returns the error that aborted the communicator, or nil.
	Err() error
	// Recorder is the communicator's flight recorder.
	Recorder() *Recorder
	// Backend names the implementation ("local", "mpi", "nccl").
	Backend() string
}

// Work is the handle of an operation issued with Start.
type Work interface {
	// Wait blocks until the operation completes, ctx is done or the
	// communicator fails. A cancelled ctx aborts the communicator; when
	// the communicator was aborted first, Wait returns that abort
	// (errors.Is ErrAborted), not the cancellation.
	Wait(ctx context.Context) error
	// Done is closed when the operation has completed or failed.
	Done() <-chan struct{}
}

// AllReduce reduces send element-wise across ranks with op into recv on
// every rank. send and recv have the same length; send == recv is in place.
func AllReduce(ctx context.Context, c Communicator, send, recv Buffer, op ReduceOp) error {
	return c.Do(ctx, Call{Op: OpAllReduce, Send: send, Recv: recv, Reduce: op})
}

// AllReduceAsync is the async form of AllReduce.
func AllReduceAsync(ctx context.Context, c Communicator, send, recv Buffer, op ReduceOp) (Work, error) {
	return c.Start(ctx, Call{Op: OpAllReduce, Send: send, Recv: recv, Reduce: op})
}

// Broadcast copies root's buf into buf on every rank.
func Broadcast(ctx context.Context, c Communicator, buf Buffer, root int) error {
	return c.Do(ctx, Call{Op: OpBroadcast, Send: buf, Recv: buf, Root: root})
}

// BroadcastAsync is the async form of Broadcast.
func BroadcastAsync(ctx context.Context, c Communicator, buf Buffer, root int) (Work, error) {
	return c.Start(ctx, Call{Op: OpBroadcast, Send: buf, Recv: buf, Root: root})
}

// Reduce reduces send across ranks with op into recv on root; recv is
// ignored (and may be nil) elsewhere: it is neither checked nor written.
func Reduce(ctx context.Context, c Communicator, send, recv Buffer, op ReduceOp, root int) error {
	return c.Do(ctx, Call{Op: OpReduce, Send: send, Recv: recv, Reduce: op, Root: root})
}

// ReduceAsync is the async form of Reduce.
func ReduceAsync(ctx context.Context, c Communicator, send, recv Buffer, op ReduceOp, root int) (Work, error) {
	return c.Start(ctx, Call{Op: OpReduce, Send: send, Recv: recv, Reduce: op, Root: root})
}

// AllGather concatenates every rank's send (n elements) into recv (p·n
// elements) in rank order. In place: send is recv's block at rank·n.
func AllGather(ctx context.Context, c Communicator, send, recv Buffer) error {
	return c.Do(ctx, Call{Op: OpAllGather, Send: send, Recv: recv})
}

// AllGatherAsync is the async form of AllGather.
func AllGatherAsync(ctx context.Context, c Communicator, send, recv Buffer) (Work, error) {
	return c.Start(ctx, Call{Op: OpAllGather, Send: send, Recv: recv})
}

// ReduceScatter reduces send (p·n elements) across ranks with op and leaves
// block r (n elements) on rank r in recv. In place: recv is send's block at
// rank·n.
func ReduceScatter(ctx context.Context, c Communicator, send, recv Buffer, op ReduceOp) error {
	return c.Do(ctx, Call{Op: OpReduceScatter, Send: send, Recv: recv, Reduce: op})
}

// ReduceScatterAsync is the async form of ReduceScatter.
func ReduceScatterAsync(ctx context.Context, c Communicator, send, recv Buffer, op ReduceOp) (Work, error) {
	return c.Start(ctx, Call{Op: OpReduceScatter, Send: send, Recv: recv, Reduce: op})
}

// Gather concatenates every rank's send (n elements) into recv (p·n) on
// root; recv is ignored elsewhere.
func Gather(ctx context.Context, c Communicator, send, recv Buffer, root int) error {
	return c.Do(ctx, Call{Op: OpGather, Send: send, Recv: recv, Root: root})
}

// GatherAsync is the async form of Gather.
func GatherAsync(ctx context.Context, c Communicator, send, recv Buffer, root int) (Work, error) {
	return c.Start(ctx, Call{Op: OpGather, Send: send, Recv: recv, Root: root})
}

// Scatter sends block r of root's send (p·n elements) to rank r's recv (n).
func Scatter(ctx context.Context, c Communicator, send, recv Buffer, root int) error {
	return c.Do(ctx, Call{Op: OpScatter, Send: send, Recv: recv, Root: root})
}

// ScatterAsync is the async form of Scatter.
func ScatterAsync(ctx context.Context, c Communicator, send, recv Buffer, root int) (Work, error) {
	return c.Start(ctx, Call{Op: OpScatter, Send: send, Recv: recv, Root: root})
}

// AllToAll sends block j of send (len/p elements) to rank j, which stores it
// as block r of its recv. send and recv must not overlap.
func AllToAll(ctx context.Context, c Communicator, send, recv Buffer) error {
	return c.Do(ctx, Call{Op: OpAllToAll, Send: send, Recv: recv})
}

// AllToAllAsync is the async form of AllToAll.
func AllToAllAsync(ctx context.Context, c Communicator, send, recv Buffer) (Work, error) {
	return c.Start(ctx, Call{Op: OpAllToAll, Send: send, Recv: recv})
}

// AllToAllV sends sendCounts[j] elements to rank j and receives
// recvCounts[j] from it; blocks are packed in rank order in both buffers.
// Counts are checked pairwise across ranks before any data moves.
func AllToAllV(ctx context.Context, c Communicator, send, recv Buffer, sendCounts, recvCounts []int) error {
	return c.Do(ctx, Call{Op: OpAllToAllV, Send: send, Recv: recv, SendCounts: sendCounts, RecvCounts: recvCounts})
}

// AllToAllVAsync is the async form of AllToAllV.
func AllToAllVAsync(ctx context.Context, c Communicator, send, recv Buffer, sendCounts, recvCounts []int) (Work, error) {
	return c.Start(ctx, Call{Op: OpAllToAllV, Send: send, Recv: recv, SendCounts: sendCounts, RecvCounts: recvCounts})
}

// Send sends buf to peer; it matches the peer's Recv with the same tag, in
// order. It returns once the data has been delivered.
func Send(ctx context.Context, c Communicator, buf Buffer, peer, tag int) error {
	return c.Do(ctx, Call{Op: OpSend, Send: buf, Peer: peer, Tag: tag})
}

// SendAsync is the async form of Send. Point-to-point work is posted at once
// and does not wait behind earlier async collectives.
func SendAsync(ctx context.Context, c Communicator, buf Buffer, peer, tag int) (Work, error) {
	return c.Start(ctx, Call{Op: OpSend, Send: buf, Peer: peer, Tag: tag})
}

// Recv receives into buf from peer's Send with the same tag. The lengths
// must agree.
func Recv(ctx context.Context, c Communicator, buf Buffer, peer, tag int) error {
	return c.Do(ctx, Call{Op: OpRecv, Recv: buf, Peer: peer, Tag: tag})
}

// RecvAsync is the async form of Recv.
func RecvAsync(ctx context.Context, c Communicator, buf Buffer, peer, tag int) (Work, error) {
	return c.Start(ctx, Call{Op: OpRecv, Recv: buf, Peer: peer, Tag: tag})
}

// Barrier returns once every rank has entered it.
func Barrier(ctx context.Context, c Communicator) error {
	return c.Do(ctx, Call{Op: OpBarrier})
}

// BarrierAsync is the async form of Barrier.
func BarrierAsync(ctx context.Context, c Communicator) (Work, error) {
	return c.Start(ctx, Call{Op: OpBarrier})
}

// WaitAll waits for every handle and returns the first error.
func WaitAll(ctx context.Context, ws ...Work) error {
	var first error
	for _, w := range ws {
		if w == nil {
			continue
		}
		if err := w.Wait(ctx); err != nil && first == nil {
			first = err
		}
	}
	return first
}
