package comm

import "context"

// SharedMemory is implemented by communicators whose ranks run in one
// address space (comm/local), so that a rank can read its peers' memory
// directly. A fused kernel then moves data once, from a peer's buffers
// straight into its own, where a collective would pack a send buffer, copy
// it and unpack it: MoE dispatch and combine take this path (the
// shared-memory analogue of NVSHMEM or NCCL's symmetric memory windows).
type SharedMemory interface {
	Communicator
	// Share is a collective. Every rank passes a value v; once all have
	// arrived, use runs on every rank with peers[q] the v of rank q
	// (peers[Rank()] is its own). Share returns after every rank's use
	// has returned, so each rank's v, and the memory it points to, stays
	// valid for its peers throughout; the ranks must agree on who writes
	// what (typically each writes only its own memory and reads its
	// peers').
	//
	// Share is ordered with the communicator's other collectives, and it
	// fails like them: on timeout, cancellation or abort (naming rank, op
	// and sequence number; it is recorded as a barrier), and on every rank
	// alike when a rank issued a different collective at its sequence
	// number. An error returned by use (or a panic in it, as an error) is
	// returned on that rank only, once every rank has left. After a
	// timeout or abort a rank may return while a peer's use still reads
	// its value: a failed Share leaves its values to the garbage
	// collector, not to reuse. use runs on the communicator's stream (on
	// a background goroutine when Share waits behind async work), so it
	// must not call collectives on the same communicator.
	Share(ctx context.Context, v any, use func(peers []any) error) error
}
