// Package comm is how loom's ranks talk to each other: one small
// interface, [Communicator], with backends as packages of their own
// (comm/local for ranks in one process, comm/mpi over Open MPI, comm/nccl
// over NCCL), in the manner of database/sql and its drivers.
//
// # For programs
//
// A program gets a Communicator from a backend (local.Run, or package
// launch, which picks the backend from how the process was started) and
// calls the typed collectives on it: [AllReduce], [AllGather],
// [ReduceScatter], [Broadcast], [Reduce], [Gather], [Scatter], [AllToAll],
// [AllToAllV], [Send], [Recv] and [Barrier], each blocking, and each with
// an Async form that returns a [Work] to wait for. Data is passed as
// [Buffer]s: [Host] wraps a Go slice without copying; backends add their
// own kinds (device memory under NCCL). Every blocking call takes a
// context and honours the communicator's timeout ([Options]).
//
// Errors are values that say what went wrong where: an [*Error] names the
// rank, the op and its sequence number (and the caller's label, see
// [WithLabel]); a timeout is a [*TimeoutError] whose [LateRanks] are the
// ranks that never arrived, on every rank; an abort reaches every rank as
// an [*AbortError]. errors.Is finds the kind: [ErrInvalid] and
// [ErrMismatch] (which also match loom's kinds), [ErrTimeout],
// [ErrAborted]. Arguments are
// checked before any data moves, and ranks that issue different calls are
// caught by a fingerprint of each call ([Fingerprint]). Lists the ranks
// must agree on are compared cheaply with [Agree]. Every communicator
// keeps a flight recorder of its recent calls ([Recorder]).
//
// # For backends
//
// A backend implements [Communicator]: Do and Start execute one [Call]
// (an [Op] with its buffers, reduce op, root and counts), after
// [Call.Validate] and the consistency check, and Split makes
// sub-communicators. The package gives backends the shared pieces: the
// call description and its validation, dtypes and reduce ops, the error
// types, fingerprints, the flight recorder, the algorithm names with
// their overrides ([ParseAlgorithmOverrides], LOOM_ALGO) and the α-β
// [CostModel] that chooses among them. A backend proves itself by passing
// the conformance suite, package comm/commtest, as every backend here
// does.
package comm
