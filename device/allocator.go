package device

import (
	"cmp"
	"errors"
	"fmt"
	"reflect"
	"slices"
	"sync"
)

// Size classes, PyTorch's (c10/cuda/CUDACachingAllocator.cpp).
const (
	minBlock   = 512      // every size is rounded up to a multiple of it
	smallSize  = 1 << 20  // largest request served from the small pool
	smallSeg   = 2 << 20  // segment size of the small pool
	minLarge   = 10 << 20 // smallest request given a segment of its own
	largeSeg   = 20 << 20 // segment size for requests between 1 and 10 MiB
	roundLarge = 2 << 20  // own segments are rounded to a multiple of it
	maxRequest = 1 << 62  // larger requests cannot be rounded without overflow
)

// Option configures NewAllocator.
type Option func(*config)

type config struct {
	newEvent func() (Event, error)
	err      error
}

// WithEvents gives the allocator a way to make events, so that freeing a
// block used on other streams (RecordStream) records an event on each of
// them and parks the block until they complete, without blocking. Events
// are pooled and reused; EmptyCache closes the idle ones. Without it,
// such a Free synchronises each of those streams before returning.
func WithEvents(newEvent func() (Event, error)) Option {
	return func(c *config) {
		if newEvent == nil {
			c.err = errors.New("WithEvents(nil)")
		}
		c.newEvent = newEvent
	}
}

// Block is device memory handed out by an Allocator: Size bytes from
// address Ptr, usable on the stream it was allocated on (and, after
// RecordStream, on others). It is a value; give it back with Free.
type Block struct {
	// Ptr is the block's device address, a multiple of 512 from its
	// segment's start.
	Ptr uintptr
	// Size is the bytes requested; the block holds at least that many
	// (Stats count the rounded size).
	Size int64

	id    uint64 // which allocation, so that a stale copy is not freed twice
	owner *Allocator
}

// Allocator is a caching allocator of one device's memory. It is safe for
// concurrent use; one lock guards it, held while it calls the Raw, the
// sync function, streams and events, which therefore must not call back
// into it.
type Allocator struct {
	name     string
	raw      Raw
	sync     func() error
	newEvent func() (Event, error)

	mu      sync.Mutex
	pools   map[poolKey][]*block // free blocks by (stream, size class), sorted by (size, ptr)
	live    map[uintptr]*block   // allocated blocks by address
	pending []*block             // freed blocks waiting for events
	events  []Event              // idle events for reuse
	nextID  uint64
	st      Stats
}

type poolKey struct {
	stream Stream
	small  bool
}

type state int8

const (
	free      state = iota // in its pool
	allocated              // handed out
	pending                // freed, waiting for events on other streams
)

// block is a piece of a segment. The blocks of one segment form a list in
// address order; a block without prev starts its segment, so one without
// prev and next is a whole segment.
type block struct {
	ptr        uintptr
	size       int64
	stream     Stream
	small      bool
	prev, next *block
	state      state
	id         uint64
	uses       []Stream // streams other than stream it was used on
	events     []Event  // while pending: recorded on those streams at Free
}

// NewAllocator returns an allocator named name (the device, "cuda:0",
// used in errors) over raw. sync, which may be nil, waits for all work on
// the device (cuCtxSynchronize); the allocator calls it once before
// reporting out of memory, so that frees waiting for events become
// usable. A nil raw or a nil option is an error wrapping ErrInvalid.
func NewAllocator(name string, raw Raw, sync func() error, opts ...Option) (*Allocator, error) {
	if raw == nil {
		return nil, invalidf(name, "NewAllocator", "nil Raw")
	}
	var c config
	for i, o := range opts {
		if o == nil {
			return nil, invalidf(name, "NewAllocator", "option %d is nil", i)
		}
		o(&c)
		if c.err != nil {
			return nil, invalidf(name, "NewAllocator", "%v", c.err)
		}
	}
	return &Allocator{
		name:     name,
		raw:      raw,
		sync:     sync,
		newEvent: c.newEvent,
		pools:    map[poolKey][]*block{},
		live:     map[uintptr]*block{},
	}, nil
}

// roundSize is the block size for a request: at least minBlock, a
// multiple of it.
func roundSize(n int64) int64 {
	if n < minBlock {
		return minBlock
	}
	return (n + minBlock - 1) / minBlock * minBlock
}

// segmentSize is the driver allocation made for a block of size bytes
// that the cache cannot serve.
func segmentSize(size int64) int64 {
	switch {
	case size <= smallSize:
		return smallSeg
	case size < minLarge:
		return largeSeg
	}
	return (size + roundLarge - 1) / roundLarge * roundLarge
}

// checkStream rejects streams that cannot be map keys.
func (a *Allocator) checkStream(op string, s Stream) error {
	if s == nil {
		return invalidf(a.name, op, "nil stream")
	}
	if !reflect.TypeOf(s).Comparable() {
		return invalidf(a.name, op, "stream type %T is not comparable", s)
	}
	return nil
}

// Alloc returns a block of at least bytes bytes for use on stream s,
// from the cache when it can. When the driver is out of memory it
// releases the cached free segments and retries; then, given a sync
// function, it synchronises the device, so that the frees waiting for
// events complete, and retries once more; then it returns an *OOMError.
// A negative size or a nil stream is an error wrapping ErrInvalid.
func (a *Allocator) Alloc(bytes int64, s Stream) (Block, error) {
	if bytes < 0 {
		return Block{}, invalidf(a.name, "Alloc", "negative size %d", bytes)
	}
	if err := a.checkStream("Alloc", s); err != nil {
		return Block{}, err
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if err := a.processEvents(); err != nil {
		return Block{}, err
	}
	if bytes > maxRequest {
		return Block{}, a.oom(bytes, bytes, 0, false)
	}
	size := roundSize(bytes)
	key := poolKey{s, size <= smallSize}
	if b := a.bestFit(key, size); b != nil {
		return a.use(b, size, bytes), nil
	}
	seg := segmentSize(size)
	b, err := a.malloc(seg, key)
	if err == nil {
		return a.use(b, size, bytes), nil
	}
	if !errors.Is(err, ErrOutOfMemory) {
		return Block{}, err
	}
	a.st.Retries++
	if err := a.releaseFree(); err != nil {
		return Block{}, err
	}
	if b, err = a.malloc(seg, key); err == nil {
		return a.use(b, size, bytes), nil
	} else if !errors.Is(err, ErrOutOfMemory) {
		return Block{}, err
	}
	if a.sync == nil {
		return Block{}, a.oom(bytes, size, seg, false)
	}
	// Work queued on any stream may still hold blocks whose frees wait
	// for events; after the device is idle they are all usable.
	if err := a.sync(); err != nil {
		return Block{}, fmt.Errorf("device: %s: synchronising before retrying an allocation: %w", a.name, err)
	}
	if err := a.processEvents(); err != nil {
		return Block{}, err
	}
	if b := a.bestFit(key, size); b != nil {
		return a.use(b, size, bytes), nil
	}
	if err := a.releaseFree(); err != nil {
		return Block{}, err
	}
	if b, err = a.malloc(seg, key); err == nil {
		return a.use(b, size, bytes), nil
	} else if !errors.Is(err, ErrOutOfMemory) {
		return Block{}, err
	}
	return Block{}, a.oom(bytes, size, seg, true)
}

// oom counts and returns the *OOMError for a request.
func (a *Allocator) oom(requested, rounded, seg int64, synced bool) error {
	a.st.OOMs++
	free, total := a.raw.MemInfo()
	return &OOMError{Device: a.name, Requested: requested, Rounded: rounded, Segment: seg,
		Free: free, Total: total, Stats: a.statsLocked(), Synced: synced}
}

// malloc makes a segment of seg bytes for pool key and puts it in that
// pool as one free block.
func (a *Allocator) malloc(seg int64, key poolKey) (*block, error) {
	p, err := a.raw.Malloc(seg)
	if err != nil {
		return nil, fmt.Errorf("device: %s: allocating a segment of %d bytes: %w", a.name, seg, err)
	}
	a.st.DriverAllocs++
	a.st.Segments++
	a.st.Reserved += seg
	a.st.PeakReserved = max(a.st.PeakReserved, a.st.Reserved)
	b := &block{ptr: p, size: seg, stream: key.stream, small: key.small}
	a.insert(b)
	return b, nil
}

// less orders a pool by size, then address.
func less(x, y *block) int {
	if c := cmp.Compare(x.size, y.size); c != 0 {
		return c
	}
	return cmp.Compare(x.ptr, y.ptr)
}

func (a *Allocator) insert(b *block) {
	key := poolKey{b.stream, b.small}
	p := a.pools[key]
	i, _ := slices.BinarySearchFunc(p, b, less)
	a.pools[key] = slices.Insert(p, i, b)
}

func (a *Allocator) remove(b *block) {
	key := poolKey{b.stream, b.small}
	p := a.pools[key]
	if i, ok := slices.BinarySearchFunc(p, b, less); ok {
		a.pools[key] = slices.Delete(p, i, i+1)
	}
}

// bestFit is the smallest free block of pool key that holds size bytes,
// or nil.
func (a *Allocator) bestFit(key poolKey, size int64) *block {
	p := a.pools[key]
	i, _ := slices.BinarySearchFunc(p, &block{size: size}, less)
	if i < len(p) {
		return p[i]
	}
	return nil
}

// use hands out free block b for a request of size bytes (rounded) and
// requested bytes, splitting off the rest when it is worth keeping.
func (a *Allocator) use(b *block, size, requested int64) Block {
	a.remove(b)
	rest := b.size - size
	if (b.small && rest >= minBlock) || (!b.small && rest > smallSize) {
		r := &block{ptr: b.ptr + uintptr(size), size: rest, stream: b.stream, small: b.small, prev: b, next: b.next}
		if b.next != nil {
			b.next.prev = r
		}
		b.next = r
		b.size = size
		a.insert(r)
	}
	a.nextID++
	b.id = a.nextID
	b.state = allocated
	b.uses = nil
	a.live[b.ptr] = b
	a.st.Allocated += b.size
	a.st.PeakAllocated = max(a.st.PeakAllocated, a.st.Allocated)
	return Block{Ptr: b.ptr, Size: requested, id: b.id, owner: a}
}

// release returns b to its pool, merged with free neighbours.
func (a *Allocator) release(b *block) {
	b.state = free
	b.uses = nil
	if p := b.prev; p != nil && p.state == free {
		a.remove(p)
		p.size += b.size
		p.next = b.next
		if b.next != nil {
			b.next.prev = p
		}
		b = p
	}
	if n := b.next; n != nil && n.state == free {
		a.remove(n)
		b.size += n.size
		b.next = n.next
		if n.next != nil {
			n.next.prev = b
		}
	}
	a.insert(b)
}

// lookup finds the allocated block blk stands for.
func (a *Allocator) lookup(op string, blk Block) (*block, error) {
	switch {
	case blk.owner == nil:
		return nil, invalidf(a.name, op, "a zero Block")
	case blk.owner != a:
		return nil, invalidf(a.name, op, "block %#x was allocated by allocator %q, not this one", blk.Ptr, blk.owner.name)
	}
	b := a.live[blk.Ptr]
	if b == nil || b.id != blk.id {
		return nil, invalidf(a.name, op, "block %#x (%d bytes) is not allocated: freed twice?", blk.Ptr, blk.Size)
	}
	return b, nil
}

// RecordStream tells the allocator that blk is used on stream s as well
// as on the stream it was allocated on (an all-gather into it on a
// communication stream, say), so that Free does not hand it out again
// before the work queued on s by then has completed. A block that is not
// allocated, or a nil stream, is an error wrapping ErrInvalid.
func (a *Allocator) RecordStream(blk Block, s Stream) error {
	if err := a.checkStream("RecordStream", s); err != nil {
		return err
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	b, err := a.lookup("RecordStream", blk)
	if err != nil {
		return err
	}
	if s != b.stream && !slices.Contains(b.uses, s) {
		b.uses = append(b.uses, s)
	}
	return nil
}

// Free gives blk back to the cache. A block used on other streams
// (RecordStream) is reused only after the work queued on them by now has
// completed: with WithEvents, an event is recorded on each and the block
// waits for them, without blocking; without, Free synchronises those
// streams. A block that is not allocated (freed twice, a zero Block, one
// of another allocator) is an error wrapping ErrInvalid; when recording
// an event or synchronising fails, the block stays allocated and the
// error is returned.
func (a *Allocator) Free(blk Block) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	b, err := a.lookup("Free", blk)
	if err != nil {
		return err
	}
	if len(b.uses) > 0 {
		if err := a.waitUses(b); err != nil {
			return err
		}
	}
	delete(a.live, b.ptr)
	a.st.Allocated -= b.size
	if len(b.events) > 0 {
		b.state = pending
		a.pending = append(a.pending, b)
		a.st.Pending += b.size
		return nil
	}
	a.release(b)
	return nil
}

// waitUses records an event on each stream of b.uses into b.events, or
// synchronises them when the allocator makes no events.
func (a *Allocator) waitUses(b *block) error {
	if a.newEvent == nil {
		for _, s := range b.uses {
			if err := s.Synchronize(); err != nil {
				return fmt.Errorf("device: %s: Free: synchronising a stream the block was used on: %w", a.name, err)
			}
		}
		return nil
	}
	for _, s := range b.uses {
		var ev Event
		if n := len(a.events); n > 0 {
			ev, a.events = a.events[n-1], a.events[:n-1]
		} else {
			var err error
			if ev, err = a.newEvent(); err != nil {
				a.events = append(a.events, b.events...)
				b.events = nil
				return fmt.Errorf("device: %s: Free: making an event: %w", a.name, err)
			}
		}
		b.events = append(b.events, ev)
		if err := ev.Record(s); err != nil {
			a.events = append(a.events, b.events...)
			b.events = nil
			return fmt.Errorf("device: %s: Free: recording an event on a stream the block was used on: %w", a.name, err)
		}
	}
	return nil
}

// processEvents returns to their pools the pending blocks whose events
// have all completed.
func (a *Allocator) processEvents() error {
	var firstErr error
	kept := a.pending[:0]
	for _, b := range a.pending {
		left := b.events[:0]
		for _, ev := range b.events {
			done, err := ev.Query()
			if err != nil && firstErr == nil {
				firstErr = fmt.Errorf("device: %s: querying an event of a pending free: %w", a.name, err)
			}
			if done && err == nil {
				a.events = append(a.events, ev)
			} else {
				left = append(left, ev)
			}
		}
		clear(b.events[len(left):])
		b.events = left
		if len(left) > 0 {
			kept = append(kept, b)
			continue
		}
		b.events = nil
		a.st.Pending -= b.size
		a.release(b)
	}
	clear(a.pending[len(kept):])
	a.pending = kept
	return firstErr
}

// releaseFree gives every wholly free segment back to the driver.
func (a *Allocator) releaseFree() error {
	var errs []error
	for key, p := range a.pools {
		kept := p[:0]
		for _, b := range p {
			if b.prev != nil || b.next != nil {
				kept = append(kept, b)
				continue
			}
			if err := a.raw.Free(b.ptr); err != nil {
				errs = append(errs, fmt.Errorf("device: %s: freeing a segment of %d bytes: %w", a.name, b.size, err))
				kept = append(kept, b)
				continue
			}
			a.st.DriverFrees++
			a.st.Segments--
			a.st.Reserved -= b.size
		}
		clear(p[len(kept):])
		if len(kept) == 0 {
			delete(a.pools, key)
		} else {
			a.pools[key] = kept
		}
	}
	return errors.Join(errs...)
}

// EmptyCache waits for the events of pending frees, then gives every
// wholly free segment back to the driver and closes the idle events.
// Segments that hold an allocated block stay. Errors of the events, the
// driver or Close are returned joined.
func (a *Allocator) EmptyCache() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	var errs []error
	for _, b := range a.pending {
		for _, ev := range b.events {
			if err := ev.Synchronize(); err != nil {
				errs = append(errs, fmt.Errorf("device: %s: EmptyCache: waiting for an event of a pending free: %w", a.name, err))
			}
		}
	}
	errs = append(errs, a.processEvents(), a.releaseFree())
	for _, ev := range a.events {
		if err := ev.Close(); err != nil {
			errs = append(errs, fmt.Errorf("device: %s: EmptyCache: closing an event: %w", a.name, err))
		}
	}
	clear(a.events)
	a.events = a.events[:0]
	return errors.Join(errs...)
}

// Stats returns the allocator's statistics now.
func (a *Allocator) Stats() Stats {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.statsLocked()
}

func (a *Allocator) statsLocked() Stats {
	st := a.st
	for _, p := range a.pools {
		if n := len(p); n > 0 {
			st.LargestFree = max(st.LargestFree, p[n-1].size)
		}
	}
	if cached := st.Reserved - st.Allocated - st.Pending; cached > 0 {
		st.Fragmentation = 1 - float64(st.LargestFree)/float64(cached)
	}
	return st
}

// ResetPeak sets PeakAllocated and PeakReserved to the current Allocated
// and Reserved, so that the next Stats report the peaks of what follows
// (one training step, say).
func (a *Allocator) ResetPeak() {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.st.PeakAllocated = a.st.Allocated
	a.st.PeakReserved = a.st.Reserved
}
