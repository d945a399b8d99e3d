// Package nccl is loom's GPU backend: a comm.Communicator on NCCL. NCCL is
// loaded at run time (libnccl.so.2, with github.com/ebitengine/purego);
// the CUDA driver, device contexts, streams, events and device memory come
// from package device/cuda, the process's one binding of the driver, which
// compute uses too. The package needs no CUDA headers and no cgo, builds
// everywhere, and its tests skip where the libraries are missing. Load
// fails with an error matching ErrUnavailable there (and on every platform
// but Linux amd64 and arm64).
//
//	lib, err := nccl.Load()                  // or WithNCCL(path), LOOM_NCCL; WithDriverLib(cudaLib)
//	dev, err := lib.Driver().Open(localRank) // a *cuda.Context: the primary context
//	store, err := rendezvous.DialEnv(ctx)
//	c, err := lib.NewComm(ctx, dev, store, "job42/world", rank, size)
//	err = comm.AllReduce(ctx, c, x, x, comm.Sum) // x: a host buffer, or a device buffer on dev
//	...
//	c.Close(); dev.Close()
//
// # Creating communicators
//
// NewComm bootstraps through a Store (*rendezvous.Client implements it):
// rank 0 calls ncclGetUniqueId and sets the 128 bytes at key+"/id", the
// other ranks get them, and every rank calls ncclCommInitRankConfig.
// NewCommFromID takes an id the caller distributed. Split uses
// ncclCommSplit (NCCL 2.18; before that it fails with
// comm.ErrUnsupported).
//
// ncclCommInitRankConfig takes ncclUniqueId, a 128-byte struct, by value.
// On x86-64 the System V ABI passes it in memory on the stack, which purego
// cannot do (it places at most nine words there), so the call goes through
// a small machine-code stub mapped executable once per Library, which copies
// the id onto its stack and moves the other arguments into their registers
// (InitPath "thunk"). On arm64 the ABI passes a pointer to a caller-made
// copy, so the id is passed as a pointer to a copy ("pointer"). Where the
// stub cannot be mapped, ncclCommInitRankScalable (NCCL 2.23), which takes
// the id by pointer, is used instead ("scalable").
//
// # ncclConfig_t
//
// ncclConfig_t is versioned and grows by appending fields; NCCL copies
// min(size, its own sizeof) bytes, rejects the struct without magic
// 0xcafebeef, and resets fields newer than version to defaults. The
// package reads ncclGetVersion and passes the layout of that release
// (LayoutFor), with size, magic and version filled in and every field the
// caller left unset at NCCL_CONFIG_UNDEF_INT or NULL. Offsets on LP64:
//
//	field                 offset  since   sizeof by release
//	size                   0      2.14    2.14-2.16: 24
//	magic                  8      2.14    2.17:      40
//	version               12      2.14    2.18-2.26: 48
//	blocking              16      2.14    2.27:      72
//	cgaClusterSize        20      2.17    2.28:      80
//	minCTAs               24      2.17    2.29:      88
//	maxCTAs               28      2.17    2.30:      96
//	netName               32      2.17
//	splitShare            40      2.18
//	trafficClass          44      2.26
//	commName              48      2.27
//	collnetEnable         56      2.27
//	CTAPolicy             60      2.27
//	shrinkShare           64      2.27
//	nvlsCTAs              68      2.27
//	nChannelsPerNetPeer   72      2.28
//	nvlinkCentricSched    76      2.28
//	graphUsageMode        80      2.29
//	numRmaCtx             84      2.29
//	maxP2pPeers           88      2.30
//	graphStreamOrdering   92      2.30.5
//
// The version field carries the loaded release's code, capped at 2.30.5,
// the newest layout known here: a newer NCCL gets that layout and defaults
// whatever it added since. Setting a Config field the loaded NCCL lacks is
// an error naming the field and the release that added it. NCCL older than
// 2.14 is not supported.
//
// # Nonblocking mode, waiting and failures
//
// Communicators are created nonblocking (ncclConfig_t.blocking = 0) unless
// Config.Blocking is set. Every NCCL call that returns ncclInProgress is
// settled by polling ncclCommGetAsyncError until the communicator leaves
// that state, under the call's context and the communicator's timeout;
// only then is the work's CUDA event recorded on the stream, since NCCL
// enqueues a nonblocking group's kernels from its own thread. So even
// communicator creation honours the context and the timeout: a peer that
// never arrives is an error, not a hang.
//
// A Work completes when its event has fired (cuEventQuery). Wait polls the
// event and ncclCommGetAsyncError with a backoff (yielding for 50 µs, then
// sleeping up to 1 ms); async work nobody waits for is completed by a
// background goroutine that lives while work is queued. An asynchronous
// NCCL error (a peer that failed, a network error), a CUDA error, a
// cancelled context or a timeout fails the call with a *comm.Error naming
// this rank, the operation, its sequence number and the peer, and aborts
// the communicator: ncclCommAbort, which also stops its kernels, and every
// pending and later call fails with a *comm.AbortError. Pending work fails
// only after ncclCommAbort has returned, and a call that another
// goroutine's abort fails (Start, Do, Flush, Split) returns only then too:
// whoever sees the failure may rely on NCCL's kernels having stopped with
// the buffers. Waiting for another goroutine's abort ends, though, when the
// caller's context does or the operation's time is up; the call then
// returns its own cause. A timeout also
// dumps the flight recorder to comm.Options.DumpDir. A timeout cannot
// name the late rank: NCCL's kernels wait on the GPU and report no
// peer's progress, so the error names the call (and, for a Send or Recv,
// the peer it waits for, which may itself be waiting for another rank),
// with no comm.TimeoutError; comm/local, whose ranks publish their
// arrival, names the rank that never joined. A communicator made
// with NewComm also watches key+"/abort" in the store and posts there when
// it aborts, so that an abort on one rank promptly fails the others even
// where NCCL's transport would leave their kernels waiting (over NVLink).
// In blocking mode a call blocked inside NCCL is unblocked by calling
// ncclCommAbort from another thread, NCCL's documented way.
//
// NCCL errors are *NCCLError (the call, its ncclResult_t as a Result, and
// NCCL's last error text), which match their code with errors.Is;
// ncclInvalidArgument and ncclInvalidUsage also match comm.ErrInvalid,
// ncclTimeout comm.ErrTimeout. Driver errors are device/cuda's *cuda.Error
// (the entry point, its CUresult as Code, the driver's name and
// description).
//
// # Buffers
//
// Calls take *comm.HostBuffer and device buffers of the communicator's
// device: any comm.Buffer with a device address (a Ptr() uintptr method,
// as device.Buffer has) whose Device() is the communicator's "cuda:N".
// Device buffers are given to NCCL where they are, unstaged; a buffer of
// another GPU is rejected with comm.ErrInvalid, and one of any other
// device (the emulated device's host-backed buffers among them) or type
// with comm.ErrUnsupported, both naming the device and before any data
// moves. Host buffers are staged: each distinct host span is copied into
// device memory allocated for the call before it is enqueued, and results
// are copied back and the memory freed when the Work completes; NCCL's
// in-place forms (comm.InPlaceRule) map to one allocation with the inner
// buffer at its offset. Any other overlap of send and recv is rejected.
// The caller orders its own work on device buffers against Comm.Stream:
// device.BeforeCollective makes it wait for the compute stream (Comm
// implements device.StreamComm) and device.AfterCollective makes compute
// wait for the Work's event (the Work implements device.EventWork), both
// without blocking the host; or it issues the communicator's work on its
// own stream (WithStream). Collectives that move no data on any rank
// (count 0) skip NCCL.
//
// # Operations
//
// AllReduce, Broadcast, Reduce, AllGather and ReduceScatter are NCCL's own
// calls. AllToAll, Gather and Scatter are ncclAlltoAll, ncclGather and
// ncclScatter from NCCL 2.28, and grouped ncclSend/ncclRecv before.
// AllToAllV is always grouped ncclSend/ncclRecv, one pair per peer,
// zero-length ones included; its counts are first allgathered (through
// NCCL, on the host) so that every rank checks every pair
// (comm.CheckCounts) and a disagreement is the same error everywhere.
// Barrier is a one-element float32 all-reduce. Reduce ops map to ncclSum,
// ncclProd, ncclMax, ncclMin and ncclAvg (integer averages truncate);
// dtypes to ncclFloat32, ncclFloat64, ncclBfloat16, ncclFloat16, ncclInt32,
// ncclInt64 and ncclUint8. NCCL chooses its own algorithms: a call that
// forces one is rejected with comm.ErrUnsupported.
//
// NCCL has no tags, and a lone send blocks its stream until the peer
// receives. So Send and Recv are batched: they are given to NCCL as one
// group when one of them is waited for (Wait, or Done), before the next
// collective, or by Flush. Within a group, operations are ordered by tag
// and then issue order, on both sides, so sends and receives posted before
// the same wait match by tag as comm promises; messages separated by waits
// match in issue order. Lengths must agree (NCCL does not check).
//
// With comm.Options.ConsistencyCheck every collective first allgathers its
// fingerprint (op, dtype, count, root, reduce op, call site, and any local
// validation error); a mismatch is a *comm.MismatchError and a call any
// rank rejected an ErrInvalid error, on every rank, and the communicator
// stays usable.
//
// # Threads and resources
//
// CUDA contexts are per OS thread: every driver and NCCL call runs with the
// goroutine locked to its thread and the device's primary context made
// current (the context NCCL's static runtime uses). A Comm's calls are
// issued from one goroutine at a time; Wait, Done, Abort, Err and Close may
// be used from any. Close finalises and destroys the communicator (or
// leaves it to ncclCommAbort's cleanup), its stream and pooled events;
// Close communicators, then free buffers, then close the device's
// *cuda.Context. Library handles are values the caller owns: nothing here
// is global.
//
// # Tests
//
// The tests build testdata/fakenccl.c with gcc into a temporary folder and
// load it as both libraries (the driver through device/cuda, whose symbols
// it exports, those NCCL's use does not need as CUDA_ERROR_NOT_SUPPORTED
// stubs): a fake that records every call's arguments,
// keeps "device memory" on the host, runs multi-rank communicators in one
// process and models nonblocking settling and asynchronous errors. They
// check the marshalling of every call, the config bytes of every release
// against structs gcc lays out, the by-value id, error mapping and aborts,
// and run the conformance suite (comm/commtest). The TestGPU tests run the
// real libraries when present; gpu_check.sh runs them on a GPU machine.
package nccl
