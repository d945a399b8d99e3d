// Package trace records a per-rank timeline of compute, communication and
// waiting, writes it as Chrome trace JSON for Perfetto (ui.perfetto.dev) or
// chrome://tracing, and measures how much communication is hidden behind
// compute.
//
// # Recording
//
// A Timeline belongs to a process and is shared by all its ranks (the
// goroutines of comm/local, or the one rank of an MPI process). Each event
// has a rank, a lane (LaneCompute, LaneComm, LaneWait, or on a device
// LaneStreamCompute and LaneStreamComm), a name and a time
// span; communication events also carry the op, the group of ranks, the
// payload in bytes, the dtype, the sequence number and the peer or root.
// Recording an event appends a small struct under a mutex; nothing else is
// allocated per event beyond the amortised growth of the event slice (the
// wrapper of an async operation's Work is one small allocation per Start).
// A nil *Timeline is a valid no-op everywhere, so code can trace
// unconditionally and pay one nil check when tracing is off.
//
// Events come from four sources:
//
//   - Comm wraps a comm.Communicator. Every Do, Start and Split and every
//     Wait on a Work it returns are recorded, and Split returns a wrapped
//     child, so the sub-communicators that mesh creates on first use are
//     traced too.
//   - Begin and Span.End mark compute phases by hand (forward, backward,
//     optimizer step), and Record adds any span.
//   - TapeObserver is an autograd.Observer (pass it to autograd.NewTape with
//     autograd.WithObserver): every op's forward, every op's backward and
//     every leaf's gradient-ready hooks become compute events.
//   - Streams, on a device: an event recorded on the compute stream after
//     each op (Streams.Op, which package train's tape observer calls) and
//     on the communicator's stream around each collective of a Comm of the
//     same rank that is a device.StreamComm (NCCL's), read once when the
//     step ends (Streams.End), give the spans the device executed: the
//     "stream compute" and "stream comm" tracks, which Overlap then uses
//     in place of the host lanes. Comm keeps a wrapped communicator's
//     device.StreamComm and its works' device.EventWork, so tracing does
//     not make device.BeforeCollective synchronise compute.
//
// # What the communication spans mean
//
// A comm-lane event is the time the backend spent executing the operation:
// from when it started running it (after the operations queued before it on
// the same communicator, and including the wait for peers to arrive) to when
// it completed or failed. Those two times come from the backend's flight
// recorder (comm.Recorder), which stamps them on the goroutine that does
// the work, so an async operation's completion is known exactly without a
// goroutine per call and without the caller having to Wait at the right
// moment. The time the caller issued it is kept as the "queued_us" argument.
// The wrapper finds the recorder entry of each call by its op and issue time
// and reads the recorder lazily: when events are read (Events, WriteChrome,
// Overlap) and every few hundred operations, well within the recorder's
// capacity (comm.DefaultRecorderSize). Operations still running at that
// moment stay pending until a later read.
//
// When the recorder has no entry for a call (a backend that records
// nothing, or a ring overwritten because it was configured smaller than a
// few hundred entries), the event falls back to what the wrapper saw: a
// blocking call spans the whole call; an async call spans from issue to the
// return of the first Wait that blocked (exact up to scheduling), or to the
// moment a Wait found it already complete (an upper bound, marked in the
// event's arguments). An async call nobody waited for and the recorder does
// not know is kept as a zero-length event at its issue time, marked "end
// unknown".
//
// A wait-lane event is the time a caller was blocked in communication: a
// whole Do or Split call, or a Work.Wait that did not find the work already
// complete.
//
// # Chrome trace
//
// WriteChrome writes the "traceEvents" JSON format with one process per
// rank ("rank N") and one thread per lane ("compute", "wait") and per
// communicator's group on the comm lane ("comm [0,1]"), so data-parallel
// and tensor-parallel collectives are on separate rows. Events of one row
// that overlap without nesting (two goroutines computing at once, an async
// Send beside a collective) are spread over extra rows ("compute #2"), as
// the format requires properly nested spans per thread.
//
// # Overlap
//
// Overlap measures, for one rank and a window of time, the length of the
// union of its communication spans and how much of it is covered by the
// union of its compute spans: hidden/comm is the fraction of communication
// hidden behind compute. Nested and overlapping spans are counted once.
//
// One Timeline should trace one world: groups are identified by the world
// communicator's size and the sequence of Splits made on it.
package trace

import "github.com/b7ea7098/loom"

// ErrInvalid marks arguments rejected without recording anything (an
// invalid Lane); errors.Is(err, loom.ErrInvalid) matches it too.
var ErrInvalid = loom.NewSentinel("invalid argument", loom.ErrInvalid)
