//go:build mpi

// Package mpi is loom's multi-process CPU backend: a comm.Communicator on
// MPI through cgo against mpi.h. It is built only with the build tag `mpi`
// (go build -tags mpi), so that the default build never needs an MPI
// library; it links Open MPI through `pkg-config ompi-c` (Debian:
// apt-get install openmpi-bin libopenmpi-dev).
//
// A program calls World, which initialises MPI (MPI_Init_thread asking for
// MPI_THREAD_MULTIPLE) on first use and returns a communicator over every
// process of the job, reading the rank and size from MPI, and Finalize
// before it exits:
//
//	world, err := mpi.World()
//	...
//	err = comm.AllReduce(ctx, world, comm.Host(x), comm.Host(x), comm.Sum)
//	...
//	mpi.Finalize()
//
// and is started with `mpirun -np N prog`.
//
// # Mapping
//
// By default every operation is a nonblocking MPI call (MPI_Iallreduce, MPI_Ibcast,
// MPI_Ireduce, MPI_Iallgather, MPI_Ireduce_scatter_block, MPI_Igather,
// MPI_Iscatter, MPI_Ialltoall, MPI_Ialltoallv, MPI_Ibarrier, MPI_Issend,
// MPI_Irecv); Start issues it and returns a comm.Work, Do is Start then
// Wait. Collectives are issued strictly in call order, which MPI requires;
// a call whose pre-checks (below) are still in flight holds back the calls
// after it. Wait drives MPI's progress (Open MPI progresses only inside
// MPI calls) as MPI_Wait does, by testing the first pending collective's
// requests in a loop in C, for up to 2 ms at a time or until an abort
// notice arrives; between those spins, and for point-to-point work, it
// polls MPI_Test from Go: a tight loop for the first 50 µs, then yielding
// the processor between polls for up to a second, then sleeping up to a
// millisecond between polls, so a long wait costs little CPU; all along
// it honours the context and the communicator's timeout. Async
// work that nobody waits on is driven by a background goroutine that exists
// only while such work is pending.
//
// # Blocking calls
//
// WithBlockingCalls (or LOOM_MPI_BLOCKING=1) makes Do, and so the
// synchronous comm helpers, call MPI's blocking collectives instead
// (MPI_Allreduce, ...; Start stays nonblocking): Do first lets the async
// collectives issued before it post all their steps, so the issue order
// stays the same on every rank, then blocks in MPI outside the package's
// lock. MPI never matches a blocking collective with a nonblocking one,
// so every rank must choose alike; World checks that they do, and that
// MPI provided MPI_THREAD_MULTIPLE, and fails on every rank otherwise.
// Which mode is faster depends on the MPI library, the size and the
// machine (cmd/loombench/compare_mpi.sh measures both against raw MPI).
//
// A blocking call cannot be interrupted. A watchdog goroutine watches each
// one that runs longer than 5-10 ms (a sentry goroutine per communicator
// looks every 5 ms while blocking calls are made, so that short calls pay
// for no timer): when the call outlives the timeout, its context ends, or the
// communicator is aborted meanwhile (Abort, or a peer's notice, which the
// watchdog polls for every 50 ms), it aborts the communicator and notifies
// the peers; if the call has still not returned 100 ms later, it prints the
// error (rank, op, sequence number) on stderr and ends the job with
// MPI_Abort. A call that does return after an abort fails with the
// *comm.AbortError.
//
// Sends are synchronous (MPI_Issend): a Send completes once the matching
// Recv has begun, as comm documents. A Recv of a different length than the
// Send fails. Tags must lie in [0, MPI_TAG_UB); the top tag carries this
// package's abort notices.
//
// In-place forms follow NCCL's offset rules as package comm documents them:
// AllReduce, Broadcast and Reduce with Send == Recv, and AllGather with Send
// the rank-th block of Recv, map to MPI_IN_PLACE. ReduceScatter with Recv
// the rank-th block of Send does not: MPI_IN_PLACE there leaves the result
// at the start of the buffer, so the backend reduces into a scratch block
// and copies it to Recv, leaving the rest of Send untouched. Other
// overlapping buffers are rejected.
//
// Reduce ops: sum, prod, min and max are MPI's own for float32, float64,
// int32 and int64, and min and max for uint8 (MPI's min and max do not
// propagate NaN, unlike comm/local's). uint8 sum and prod are user
// operators in C that wrap modulo 256, because Open MPI 4.1's vectorised
// MPI_SUM on MPI_UINT8_T saturates at 255. Avg is a sum divided afterwards by the number of ranks
// (truncating integer types), as in comm/local. bfloat16 and float16 travel
// as MPI_UINT16_T and reduce through user operators (MPI_Op_create) written
// in C: each combining step widens both operands to float32, applies the
// op and rounds back to nearest even, exactly like comm/local's kernels.
//
// MPI counts are C ints. AllReduce, Broadcast, Reduce, Send and Recv split
// larger buffers into pieces of at most 2^31-1 elements; the block
// collectives (AllGather, ReduceScatter, Gather, Scatter, AllToAll) and
// AllToAllV reject per-rank counts or displacements above that with
// comm.ErrUnsupported, on every rank alike.
//
// # Checks
//
// Every call is validated (comm.Call.Validate, host buffers only, buffer
// overlap, the count limit) before any data moves. AllToAllV always
// exchanges its counts first (MPI_Alltoall of the send counts, compared
// with the receive counts, then MPI_Allreduce of a verdict flag), so a
// disagreement is an error on every rank, listing every disagreeing pair.
// With comm.Options.ConsistencyCheck (or LOOM_DEBUG=consistency) every
// collective first allgathers a fixed-size encoding of its
// comm.Fingerprint, with the caller's file:line and any local validation
// error; a mismatch is a *comm.MismatchError and a rejected call an
// ErrInvalid error on every rank, and the communicator stays usable.
// Without the check, a call rejected on one rank fails there at once and
// does not take a sequence number; its peers wait for it until the
// timeout. Split always allgathers (color, key) first, so that it honours
// its context.
//
// # Failures
//
// MPI cannot cancel a collective. When a Wait times out or its context is
// cancelled, the call returns a *comm.Error naming the rank, op and
// sequence number (with comm.ErrTimeout on timeout, and the flight
// recorder dumped to comm.Options.DumpDir when set), and the communicator
// is marked aborted: every pending and later call on it fails fast with a
// *comm.AbortError. The operation itself stays posted in MPI, with its
// buffers kept alive. MPI may still read or write them, and no MPI call
// stops it (where comm/nccl's ncclCommAbort does), so a failed
// operation's buffers must not be reused for anything that matters.
// Abort and timeouts also send a small notice to every peer on a reserved
// tag, so the peers' pending and later calls fail too, naming the rank
// that aborted. A timeout cannot name the late rank: MPI tells no rank
// how far its peers are through a collective, so the error names the
// call (and, for a Send or Recv, the peer it waits for, which may itself
// be waiting for another rank), with no comm.TimeoutError; comm/local,
// whose ranks publish their arrival, names the rank that never joined.
//
// What really ends a stuck job is MPI_Abort: call AbortJob, or configure
// WithHardAbort (or LOOM_MPI_HARD_ABORT=1) so that Abort and timeouts call
// MPI_Abort after marking the communicator. Without it, Finalize refuses
// to call MPI_Finalize while operations are stuck, and the program should
// call AbortJob. A program that runs its ranks with launch.Job.Run (as
// the training programs do, through train.Run) need not: a rank whose
// body fails with a timeout or an abort writes its error to stderr and
// ends the job with MPI_Abort there, so mpirun exits non-zero at once; a
// rank that succeeds calls MPI_Finalize.
//
// MPI_Abort travels through Open MPI's daemons (mpirun and each host's
// orted), so across a network partition it cannot reach the other side.
// Open MPI's runtime learns that a daemon is lost only through TCP
// keepalive on its own connections, after 300 s of silence by default;
// for a job across hosts, pass smaller values to mpirun, e.g.
// --mca oob_tcp_keepalive_time 1 --mca oob_tcp_keepalive_intvl 1
// --mca oob_tcp_keepalive_probes 3, and mpirun and every orted end within
// seconds of a partition (scripts/netns_check.sh checks this on two
// network namespaces).
//
// The backend chooses no algorithms of its own (MPI does): a call that
// forces one other than comm.Auto is rejected with comm.ErrUnsupported,
// and comm.Options.Algorithms (LOOM_ALGO) is ignored.
//
// # Tests
//
// Each MPI process runs the same test binary and is one rank:
//
//	go test -tags mpi -c -o /tmp/mpi.test ./comm/mpi
//	mpirun --allow-run-as-root --oversubscribe -np 4 /tmp/mpi.test -test.short
//
// run_tests.sh does this for -np 2, 3 and 4.
package mpi
