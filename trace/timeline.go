package trace

import (
	"cmp"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/b7ea7098/loom/comm"
)

// Lane is the kind of an event, and the row of the trace it is drawn on.
type Lane uint8

// The lanes.
const (
	// LaneCompute holds work on the rank's own cores: ops, optimizer steps.
	LaneCompute Lane = iota + 1
	// LaneComm holds the execution of communication operations.
	LaneComm
	// LaneWait holds the time a caller was blocked in communication.
	LaneWait
	// LaneStreamCompute holds the execution of a rank's ops on its
	// device's compute stream, timed by device events (Streams).
	LaneStreamCompute
	// LaneStreamComm holds the execution of a rank's collectives on its
	// communicator's device stream, timed by device events (Streams).
	LaneStreamComm
)

// String returns "compute", "comm", "wait", "stream compute" or "stream
// comm".
func (l Lane) String() string {
	switch l {
	case LaneCompute:
		return "compute"
	case LaneComm:
		return "comm"
	case LaneWait:
		return "wait"
	case LaneStreamCompute:
		return "stream compute"
	case LaneStreamComm:
		return "stream comm"
	}
	return "lane(" + strconv.Itoa(int(l)) + ")"
}

// Valid reports whether l is one of the lanes.
func (l Lane) Valid() bool { return l >= LaneCompute && l <= LaneStreamComm }

// IsStream reports whether l is one of the device stream lanes.
func (l Lane) IsStream() bool { return l == LaneStreamCompute || l == LaneStreamComm }

// DefaultCapacity is the number of events a Timeline keeps unless
// WithCapacity says otherwise (about 100 MB of events).
const DefaultCapacity = 1 << 20

// resolveEvery is how many communication calls may await their flight
// recorder entries before the timeline reads the recorders; it is well
// below comm.DefaultRecorderSize, so entries are read before the ring
// overwrites them.
const resolveEvery = 256

// Option configures NewTimeline.
type Option func(*Timeline)

// WithCapacity bounds the number of events kept (n > 0; otherwise
// DefaultCapacity). Events recorded once the timeline is full are dropped
// and counted (Dropped); Reset empties it.
func WithCapacity(n int) Option {
	return func(tl *Timeline) {
		if n > 0 {
			tl.capacity = n
		}
	}
}

// Timeline is a process's record of its ranks' compute, communication and
// wait spans. It is safe for concurrent use by every rank's goroutines.
// A nil *Timeline is valid: it records nothing and reads as empty.
type Timeline struct {
	epoch    time.Time
	capacity int

	resolveMu sync.Mutex // serialises resolve; held while reading recorders

	mu        sync.Mutex
	events    []event
	dropped   uint64
	pending   []pending // communication calls awaiting their recorder entry, by id
	nextID    uint64
	resolveAt int    // len(pending) at which the next automatic resolve runs
	gen       uint64 // incremented by Reset
	groups    []group
	groupIdx  map[string]int32
	streams   map[int32]*Streams // per rank: its device stream recorder
}

// NewTimeline returns an empty timeline whose clock starts now.
func NewTimeline(opts ...Option) *Timeline {
	tl := &Timeline{epoch: time.Now(), capacity: DefaultCapacity, resolveAt: resolveEvery, groupIdx: map[string]int32{}}
	for _, o := range opts {
		o(tl)
	}
	return tl
}

// flags qualify an event's times.
type flags uint8

const (
	flagFailed     flags = 1 << iota // the operation failed
	flagSeq                          // seq came from the flight recorder
	flagObserved                     // times seen by the wrapper, not the recorder
	flagEndBound                     // end is an upper bound of the completion
	flagEndUnknown                   // completion never observed
)

// event is the stored form of an Event: times in nanoseconds since the
// epoch, names shared with the caller, the group by index.
type event struct {
	start, end, issued int64
	name, cat          string
	bytes              int64
	seq                uint64
	rank, group, peer  int32
	lane               Lane
	op                 comm.Op
	dtype              comm.DType
	flags              flags
}

// Event is one recorded span, as Events returns it.
type Event struct {
	// Rank is the rank the event belongs to (the trace's process id).
	Rank int
	// Lane is the kind of event.
	Lane Lane
	// Name is the span's name for compute events (an op name such as
	// "Linear" for tape events) and the operation ("allreduce") for comm
	// and wait events.
	Name string
	// Cat is the category: the tape phase ("forward", "backward", "hooks")
	// for tape events, empty for other compute events, and the lane's name
	// ("comm", "wait") for comm and wait events.
	Cat string
	// Group labels the communicator of comm and wait events by its ranks
	// in communicator order ("[0,2]"); see the package documentation.
	Group string
	// Start and End bound the span, as time since the timeline's Epoch.
	Start, End time.Duration
	// Issued is when a communication call was made (Start or Do called);
	// Start - Issued is the time it queued behind earlier operations.
	// Other events have Issued == Start.
	Issued time.Duration
	// Op is the communication operation of comm and wait events.
	Op comm.Op
	// DType and Bytes describe the payload: the per-rank count (as
	// comm.Call.Count defines it) times the element size.
	DType comm.DType
	Bytes int64
	// Seq is the operation's sequence number on its communicator, from the
	// flight recorder (0 when not known).
	Seq uint64
	// Peer is the peer of Send and Recv, the root of rooted collectives,
	// and -1 otherwise.
	Peer int
	// Failed reports an operation that failed.
	Failed bool
	// Note says how approximate the times are, empty when they come from
	// the flight recorder or the caller: "observed by the wrapper", "end is
	// an upper bound" or "end unknown".
	Note string
}

// Duration returns End - Start.
func (e Event) Duration() time.Duration { return e.End - e.Start }

// Span is an open compute span made by Begin; End closes and records it.
// The zero Span (and one from a nil Timeline) records nothing.
type Span struct {
	tl    *Timeline
	name  string
	start int64
	rank  int32
}

// Begin opens a compute span named name on rank, starting now; call End on
// the result when the work is done:
//
//	defer tl.Begin(rank, "optimizer").End()
func (tl *Timeline) Begin(rank int, name string) Span {
	if tl == nil {
		return Span{}
	}
	return Span{tl: tl, name: name, start: tl.clock(), rank: int32(rank)}
}

// End records the span, ending now. Call it once.
func (s Span) End() {
	if s.tl == nil {
		return
	}
	s.tl.add(event{start: s.start, end: s.tl.clock(), issued: s.start, name: s.name, rank: s.rank, group: -1, peer: -1, lane: LaneCompute})
}

// Record adds a span of the given lane to rank. An end before start is
// recorded as a zero-length span at start. It returns an error, wrapping
// ErrInvalid, only for an invalid lane.
func (tl *Timeline) Record(rank int, lane Lane, name string, start, end time.Time) error {
	if tl == nil {
		return nil
	}
	if !lane.Valid() {
		return fmt.Errorf("trace: Record %q on rank %d: %w: lane %d", name, rank, ErrInvalid, lane)
	}
	s, e := tl.since(start), tl.since(end)
	tl.add(event{start: s, end: max(s, e), issued: s, name: name, rank: int32(rank), group: -1, peer: -1, lane: lane})
	return nil
}

// TapeObserver returns a function that records the spans an autograd tape
// reports as compute events of rank: pass it to autograd.NewTape with
// autograd.WithObserver. The event's Name is the op (or, for hooks, the
// leaf) and its Cat the phase. It returns nil for a nil Timeline, which
// the tape takes as no observer.
func (tl *Timeline) TapeObserver(rank int) func(op, phase string, start, end time.Time) {
	if tl == nil {
		return nil
	}
	r := int32(rank)
	return func(op, phase string, start, end time.Time) {
		s, e := tl.since(start), tl.since(end)
		tl.add(event{start: s, end: max(s, e), issued: s, name: op, cat: phase, rank: r, group: -1, peer: -1, lane: LaneCompute})
	}
}

// Epoch is the timeline's time zero: event times are durations since it.
func (tl *Timeline) Epoch() time.Time {
	if tl == nil {
		return time.Time{}
	}
	return tl.epoch
}

// Now returns the time since the epoch, for choosing Overlap windows.
func (tl *Timeline) Now() time.Duration {
	if tl == nil {
		return 0
	}
	return time.Duration(tl.clock())
}

// Dropped returns the number of events dropped because the timeline was
// full.
func (tl *Timeline) Dropped() uint64 {
	if tl == nil {
		return 0
	}
	tl.mu.Lock()
	defer tl.mu.Unlock()
	return tl.dropped
}

// Pending returns the number of communication calls whose event is not
// known yet (still running when the recorders were last read).
func (tl *Timeline) Pending() int {
	if tl == nil {
		return 0
	}
	tl.mu.Lock()
	defer tl.mu.Unlock()
	return len(tl.pending)
}

// Reset drops every event and pending call; the clock and the known groups
// stay. Work started before Reset and waited for after it is not recorded.
func (tl *Timeline) Reset() {
	if tl == nil {
		return
	}
	tl.mu.Lock()
	defer tl.mu.Unlock()
	tl.events = tl.events[:0]
	tl.pending = tl.pending[:0]
	tl.dropped = 0
	tl.resolveAt = resolveEvery
	tl.gen++
}

// Events resolves the communication calls whose recorder entries are
// complete and returns a copy of every event, ordered by rank, then start
// time, then longest first (so enclosing spans precede nested ones).
func (tl *Timeline) Events() []Event {
	if tl == nil {
		return nil
	}
	tl.resolve(true)
	tl.mu.Lock()
	defer tl.mu.Unlock()
	labels := tl.labelsLocked()
	out := make([]Event, len(tl.events))
	for i := range tl.events {
		out[i] = tl.events[i].export(labels)
	}
	slices.SortStableFunc(out, func(a, b Event) int {
		return cmp.Or(cmp.Compare(a.Rank, b.Rank), cmp.Compare(a.Start, b.Start), cmp.Compare(b.End, a.End))
	})
	return out
}

func (e *event) export(labels []string) Event {
	out := Event{
		Rank: int(e.rank), Lane: e.lane, Name: e.name, Cat: e.cat,
		Start: time.Duration(e.start), End: time.Duration(e.end), Issued: time.Duration(e.issued),
		Op: e.op, DType: e.dtype, Bytes: e.bytes, Peer: int(e.peer), Failed: e.flags&flagFailed != 0,
	}
	if out.Name == "" && e.op != 0 {
		out.Name = e.op.String()
	}
	if out.Cat == "" && e.lane != LaneCompute {
		out.Cat = e.lane.String()
	}
	if e.group >= 0 && int(e.group) < len(labels) {
		out.Group = labels[e.group]
	}
	if e.flags&flagSeq != 0 {
		out.Seq = e.seq
	}
	switch {
	case e.flags&flagEndUnknown != 0:
		out.Note = "end unknown"
	case e.flags&flagEndBound != 0:
		out.Note = "end is an upper bound"
	case e.flags&flagObserved != 0:
		out.Note = "observed by the wrapper"
	}
	return out
}

// clock is the time since the epoch in nanoseconds (monotonic).
func (tl *Timeline) clock() int64 { return int64(time.Since(tl.epoch)) }

// since converts a wall-clock time to nanoseconds since the epoch; times
// from time.Now use the monotonic clock.
func (tl *Timeline) since(t time.Time) int64 { return int64(t.Sub(tl.epoch)) }

// add appends an event, or counts it as dropped when the timeline is full.
func (tl *Timeline) add(e event) {
	tl.mu.Lock()
	tl.addLocked(e)
	tl.mu.Unlock()
}

func (tl *Timeline) addLocked(e event) {
	if len(tl.events) >= tl.capacity {
		tl.dropped++
		return
	}
	tl.events = append(tl.events, e)
}

// group is a communicator's member set as learned from its members'
// wrappers: each registers its (split key, parent rank) and trace rank.
type group struct {
	key     string
	size    int
	name    string // the backend's name for the communicator, if any
	members []member
}

type member struct {
	key, pos int // order in the communicator: by key, then parent rank
	rank     int // trace rank
}

// joinGroup registers rank as a member of the group key and returns the
// group's index.
func (tl *Timeline) joinGroup(key string, size int, m member, name string) int32 {
	tl.mu.Lock()
	defer tl.mu.Unlock()
	id, ok := tl.groupIdx[key]
	if !ok {
		id = int32(len(tl.groups))
		tl.groups = append(tl.groups, group{key: key, size: size, name: name})
		tl.groupIdx[key] = id
	}
	g := &tl.groups[id]
	if !slices.ContainsFunc(g.members, func(x member) bool { return x.rank == m.rank }) {
		g.members = append(g.members, m)
	}
	return id
}

// labelsLocked names every group: its trace ranks in communicator order
// when every member registered in this timeline, otherwise the backend's
// name (or the split path) and the size.
func (tl *Timeline) labelsLocked() []string {
	out := make([]string, len(tl.groups))
	for i := range tl.groups {
		g := &tl.groups[i]
		if len(g.members) == g.size {
			ms := slices.Clone(g.members)
			slices.SortFunc(ms, func(a, b member) int { return cmp.Or(cmp.Compare(a.key, b.key), cmp.Compare(a.pos, b.pos)) })
			var b strings.Builder
			b.WriteByte('[')
			for k, m := range ms {
				if k > 0 {
					b.WriteByte(',')
				}
				b.WriteString(strconv.Itoa(m.rank))
			}
			b.WriteByte(']')
			out[i] = b.String()
			continue
		}
		name := g.name
		if name == "" {
			name = g.key
		}
		out[i] = fmt.Sprintf("%s (size %d)", name, g.size)
	}
	return out
}
