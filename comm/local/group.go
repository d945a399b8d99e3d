package local

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"time"
	"weak"

	"github.com/b7ea7098/loom/comm"
)

// Progress marks. A rank's progress word is seq<<markBits | mark: mark 0
// means "arrived at collective seq, descriptor posted", mark k means "steps
// before k are done", and departMark means "finished reading every peer".
// The word only grows, so "peer reached (seq, k)" is one comparison.
const (
	markBits   = 20
	departMark = 1<<markBits - 1
	maxSteps   = departMark - 1
)

func progressWord(seq uint64, mark int) uint64 { return seq<<markBits | uint64(mark) }

// world is the failure domain of one Run or NewWorld: every communicator
// split from it fails when it is aborted.
type world struct {
	opts  comm.Options
	model *comm.CostModel
	cores int
	bound bool   // every rank runs on CPUs of its own (WithCPUBinding)
	tune  Tuning // which calls may time close candidates (WithTuning)
	// trialTime, when set (by tests), replaces the measured span of a
	// tuning trial of an algorithm.
	trialTime func(comm.Algorithm, time.Duration) time.Duration

	failure atomic.Pointer[comm.AbortError]
	failed  chan struct{}
	once    sync.Once

	// left[r] is set when world rank r has finished its work for good;
	// leftCh is closed (and replaced) each time a rank leaves, to wake
	// parked waiters.
	left   []atomic.Bool
	leftMu sync.Mutex
	leftCh chan struct{}

	// groups lists the world's communicators, for a timed-out call to
	// find where the ranks it waits for are blocked (blame.go); weak, so
	// that a communicator no rank holds any more is not kept.
	groupsMu sync.Mutex
	groups   []weak.Pointer[group]
}

// register adds g to the world's list, dropping communicators gone since.
func (w *world) register(g *group) {
	w.groupsMu.Lock()
	defer w.groupsMu.Unlock()
	live := w.groups[:0]
	for _, p := range w.groups {
		if p.Value() != nil {
			live = append(live, p)
		}
	}
	clear(w.groups[len(live):])
	w.groups = append(live, weak.Make(g))
}

// liveGroups returns the world's communicators that still exist.
func (w *world) liveGroups() []*group {
	w.groupsMu.Lock()
	defer w.groupsMu.Unlock()
	out := make([]*group, 0, len(w.groups))
	for _, p := range w.groups {
		if g := p.Value(); g != nil {
			out = append(out, g)
		}
	}
	return out
}

// leave records that world rank r will issue no more calls: peers waiting
// for it fail at once instead of timing out.
func (w *world) leave(r int) {
	w.left[r].Store(true)
	w.leftMu.Lock()
	close(w.leftCh)
	w.leftCh = make(chan struct{})
	w.leftMu.Unlock()
}

// leaving returns a channel closed when the next rank leaves.
func (w *world) leaving() <-chan struct{} {
	w.leftMu.Lock()
	defer w.leftMu.Unlock()
	return w.leftCh
}

// abort ends the world with e unless it has ended already; it reports
// whether e is the abort that counts.
func (w *world) abort(e *comm.AbortError) bool {
	won := false
	w.once.Do(func() {
		w.failure.Store(e)
		close(w.failed)
		won = true
	})
	return won
}

// group is the state that the members of one communicator share.
type group struct {
	w          *world
	name       string
	size       int
	worldRanks []int // world rank of each member
	slots      []slot

	failure atomic.Pointer[comm.AbortError]
	failed  chan struct{}
	once    sync.Once

	schedMu   sync.Mutex
	schedules map[schedKey]*schedule
	choices   map[choiceKey]comm.Algorithm
	// tunes holds the online tuning of each size class (tune.go). Entries
	// are never removed: members decide from them at different moments,
	// and a removed entry would let two members decide differently.
	tunes map[tuneKey]*tuning

	splitMu sync.Mutex
	splits  map[splitKey]*splitResult

	p2p []pairQueue // size*size, indexed src*size+dst
}

// slot is one member's published state, padded so that members spinning on
// different slots do not share cache lines.
type slot struct {
	progress atomic.Uint64
	parked   atomic.Bool
	wake     chan struct{}
	desc     descriptor
	// rec is the member's flight recorder, where a peer that times out
	// reads what the member is blocked in.
	rec atomic.Pointer[comm.Recorder]
	_   [64]byte
}

func newGroup(w *world, name string, worldRanks []int) *group {
	size := len(worldRanks)
	g := &group{
		w: w, name: name, size: size, worldRanks: worldRanks,
		slots:     make([]slot, size),
		failed:    make(chan struct{}),
		schedules: map[schedKey]*schedule{},
		choices:   map[choiceKey]comm.Algorithm{},
		tunes:     map[tuneKey]*tuning{},
		splits:    map[splitKey]*splitResult{},
		p2p:       make([]pairQueue, size*size),
	}
	for i := range g.slots {
		g.slots[i].wake = make(chan struct{}, 1)
	}
	w.register(g)
	return g
}

// abort ends the group with e unless it or its world has ended already;
// it reports whether e is the abort that counts. The world's abort is
// kept even when a group aborts later: local.Run aborts the world with a
// rank's error and only then cancels the context, and a rank whose wait
// ends on that cancellation must not replace the cause by its own.
func (g *group) abort(e *comm.AbortError) bool {
	if g.w.failure.Load() != nil {
		return false
	}
	won := false
	g.once.Do(func() {
		g.failure.Store(e)
		close(g.failed)
		won = true
	})
	return won
}

// err returns the abort that ends this group, its own or its world's.
func (g *group) err() *comm.AbortError {
	if e := g.failure.Load(); e != nil {
		return e
	}
	return g.w.failure.Load()
}

// publish sets member r's progress and wakes parked members. Parking is
// Dekker-style: a waiter sets parked then re-reads progress, a publisher
// stores progress then reads parked, so one of them always sees the other.
func (g *group) publish(r int, word uint64) {
	g.slots[r].progress.Store(word)
	for i := range g.slots {
		if i != r && g.slots[i].parked.Load() {
			select {
			case g.slots[i].wake <- struct{}{}:
			default:
			}
		}
	}
}

// Wait phases. A handoff between running ranks takes well under a
// microsecond, so a rank polls for spinFor; then it yields, for yieldFor
// when every rank has a core (a peer sharing this P runs at once) or
// yieldOversubscribed when ranks outnumber cores (others need the core);
// longer waits park, so an idle rank gives its core back. A rank bound to
// its own CPUs polls for spinFor+yieldFor instead and never yields: its
// goroutine is locked to its thread, so every yield would hand its P to
// another thread and back.
const (
	spinFor             = 2 * time.Microsecond
	yieldFor            = time.Millisecond
	yieldOversubscribed = 50 * time.Microsecond
)

// waiter carries the context, deadline and identity of one blocking call.
type waiter struct {
	g        *group
	rank     int
	ctx      context.Context
	deadline time.Time
	spin     time.Duration // polling before yielding; 0 when ranks outnumber cores
	yield    time.Duration // yielding before parking; 0 for bound ranks
	timer    *time.Timer   // reused across parks (Go 1.23 timers need no draining)
}

// errWait describes why a wait ended early; the caller wraps it.
type errWait struct {
	peer  int
	cause error
}

func (e *errWait) Error() string { return e.cause.Error() }
func (e *errWait) Unwrap() error { return e.cause }

// until blocks until member peer's progress reaches word, the group fails,
// the context ends or the deadline passes.
func (wt *waiter) until(peer int, word uint64) error {
	s := &wt.g.slots[peer]
	if s.progress.Load() >= word {
		return nil
	}
	// Poll briefly: with no more ranks than cores the peer is running and a
	// handoff costs well under a microsecond. Then poll while yielding: the
	// peer may share this P (after a GC or a sleep both ranks can land on
	// one P while the other sleeps, and waking a sleeping P can take tens of
	// microseconds), and a yield runs it at once. Park only for long waits.
	start := time.Now()
	if wt.spin > 0 {
		for i := 1; ; i++ {
			if s.progress.Load() >= word {
				return nil
			}
			if i&63 == 0 && time.Since(start) > wt.spin {
				break
			}
		}
	}
	ready := func() bool { return s.progress.Load() >= word }
	for i := 1; wt.yield > 0; i++ {
		runtime.Gosched()
		if ready() {
			return nil
		}
		if i&63 == 0 {
			if err := wt.check(peer, ready); err != nil {
				return err
			}
			if time.Since(start) > wt.yield {
				break
			}
		}
	}
	return wt.park(peer, ready)
}

// park sleeps on this member's wake channel until ready() holds.
func (wt *waiter) park(peer int, ready func() bool) error {
	me := &wt.g.slots[wt.rank]
	armed := false
	defer func() {
		if armed {
			wt.timer.Stop()
		}
	}()
	for {
		left := wt.g.w.leaving()
		me.parked.Store(true)
		if ready() {
			me.parked.Store(false)
			return nil
		}
		if err := wt.check(peer, ready); err != nil {
			me.parked.Store(false)
			return err
		}
		if !armed {
			if wt.timer == nil {
				wt.timer = time.NewTimer(time.Until(wt.deadline))
			} else {
				wt.timer.Reset(time.Until(wt.deadline))
			}
			armed = true
		}
		select {
		case <-me.wake:
		case <-wt.g.failed:
		case <-wt.g.w.failed:
		case <-wt.ctx.Done():
		case <-wt.timer.C:
		case <-left:
		}
		me.parked.Store(false)
		if ready() {
			return nil
		}
	}
}

// check returns the reason to stop waiting for peer, if there is one;
// ready re-reads the condition, for a peer that left just after meeting it.
func (wt *waiter) check(peer int, ready func() bool) error {
	if e := wt.g.err(); e != nil {
		return &errWait{peer: -1, cause: e}
	}
	if err := wt.ctx.Err(); err != nil {
		return &errWait{peer: peer, cause: fmt.Errorf("%w (context: %w)", errCancelled, err)}
	}
	if !time.Now().Before(wt.deadline) {
		return &errWait{peer: peer, cause: comm.ErrTimeout} // waitFailed says for whom
	}
	if wt.g.w.left[wt.g.worldRanks[peer]].Load() && !ready() {
		return &errWait{peer: peer, cause: fmt.Errorf("%w: rank %d finished without joining this call", ErrRankLeft, peer)}
	}
	return nil
}

// ErrRankLeft: a call waits for a rank that has finished its work for good
// (its Run function returned, or World.Leave was called for it).
var ErrRankLeft = errors.New("rank left")

var errCancelled = errors.New("cancelled")
