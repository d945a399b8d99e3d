package checkpoint

import (
	"context"
	"sync"
	"time"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/internal/numcheck"
	"github.com/b7ea7098/loom/placement"
)

// WithMemoryLimit bounds the host memory an async save holds for its
// snapshot, in bytes per rank (NewSaver). Save then copies this rank's
// chunks piece by piece into at most bytes of host memory, waiting while
// the background writer frees what it has written, and returns once the
// last piece is copied: the bound trades blocked time for memory. A block
// on a device is copied whole, so a larger device block is held alone
// (PeakBytes reports it). 0, the default, snapshots everything at once.
// Given to Export, it bounds the slab of a tensor that the assembling
// rank holds (default 64 MiB).
func WithMemoryLimit(bytes int) Option {
	return func(c *config) {
		c.note("WithMemoryLimit", forSaver|forExport)
		if err := numcheck.NonNegativeCount(ErrInvalid, "memory limit", bytes); err != nil {
			c.errs = append(c.errs, err)
		}
		c.memLimit = bytes
	}
}

// Saver writes checkpoints under one root in the background: Save
// snapshots the state to host memory and returns, and the files are
// written while training goes on. Saves run one at a time: the next Save,
// Wait or Close waits for the previous one and returns its error. Every
// rank of the job makes a Saver with the same options and calls its
// methods at the same points of the training loop.
//
// A Saver's methods are called from one goroutine (the training loop's).
// The background writer talks to the other ranks on its own communicator,
// split once from the job's, so it never interleaves with the training's
// collectives.
type Saver struct {
	root  string
	opts  []Option
	world comm.Communicator // the job's, from the first save
	bg    comm.Communicator // split from world for the background phases
	prev  *AsyncSave
}

// NewSaver returns a Saver of checkpoints under root. opts are Save's
// options (WithKeep, WithBlockSize, WithComm) and WithMemoryLimit; they
// apply to every save, whose own options (WithStep) add to them. A bad
// option is an error wrapping ErrInvalid.
func NewSaver(root string, opts ...Option) (*Saver, error) {
	if _, err := newConfig("NewSaver", forSave|forSaver, opts); err != nil {
		return nil, err
	}
	return &Saver{root: root, opts: opts}, nil
}

// AsyncSave is one background save of a Saver.
type AsyncSave struct {
	done    chan struct{}
	path    string
	err     error
	blocked time.Duration
	peak    int64
}

// Wait blocks until the save is complete and returns the checkpoint's
// folder, or the save's error (on every rank when any rank failed).
func (a *AsyncSave) Wait() (string, error) {
	<-a.done
	return a.path, a.err
}

// Done is closed when the save has completed or failed.
func (a *AsyncSave) Done() <-chan struct{} { return a.done }

// Blocked is how long Save kept its caller: agreeing with the other ranks,
// waiting for the previous save, and copying the snapshot.
func (a *AsyncSave) Blocked() time.Duration { return a.blocked }

// PeakBytes is the most host memory, in bytes, this rank's snapshot held
// at once (the copies of host blocks and of device blocks).
func (a *AsyncSave) PeakBytes() int64 { return a.peak }

// Save waits for the previous save (returning its error, and starting
// nothing, if it failed), then snapshots state: every chunk this rank
// writes is copied to host memory (a device block copied off the device)
// before Save returns, so the caller may update the tensors at once. The
// files are then written in the background with Save's crash safety,
// which AsyncSave.Wait, the next Save, Wait or Close waits for. ctx must
// stay live until the save completes. opts add to NewSaver's (WithStep).
// Errors before the snapshot are Save's; later ones come from Wait.
func (s *Saver) Save(ctx context.Context, state State, opts ...Option) (*AsyncSave, error) {
	const op = "Saver.Save"
	t0 := time.Now()
	if err := s.Wait(); err != nil {
		return nil, err
	}
	cfg, err := newConfig(op, forSave|forSaver, append(append([]Option(nil), s.opts...), opts...))
	if err != nil {
		return nil, err
	}
	world, err := worldOf(op, cfg, tensorMeshes(state.Tensors))
	if err != nil {
		return nil, err
	}
	if s.world == nil {
		// Every rank makes its first save at the same point: the split
		// is collective like the save.
		bg, err := world.Split(ctx, 0, world.Rank())
		if err != nil {
			return nil, wrapf(op, err, "making the background communicator")
		}
		s.world, s.bg = world, bg
	} else if world != s.world {
		return nil, invalidf(op, "the state is on another job's communicator than this Saver's earlier saves")
	}
	fs := files{rank: world.Rank(), hook: cfg.hook}
	sv, err := prepare(ctx, op, s.root, cfg, state, world, s.bg, fs)
	if err != nil {
		return nil, err
	}
	a := &AsyncSave{done: make(chan struct{})}
	snap := newSnapshot(sv.plan, cfg.memLimit)
	go func() {
		defer close(a.done)
		defer sv.release()
		a.path, a.err = sv.finish(ctx, op, s.bg, fs, snap.source)
		snap.stop()
	}()
	a.peak = snap.take(sv.plan, state.Tensors)
	a.blocked = time.Since(t0)
	s.prev = a
	return a, nil
}

// Wait waits for the last save and returns its error (nil when there was
// none or it succeeded).
func (s *Saver) Wait() error {
	if s.prev == nil {
		return nil
	}
	_, err := s.prev.Wait()
	return err
}

// Close waits for the last save and returns its error; the Saver takes no
// more saves' errors from before it.
func (s *Saver) Close() error {
	err := s.Wait()
	s.prev = nil
	return err
}

// piece is a copied run of a chunk's bytes, or the error that stopped
// the copying.
type piece struct {
	data []byte
	err  error
}

// snapshot hands copied pieces from the caller (take) to the background
// writer (source), holding at most limit bytes at once (0: no limit).
type snapshot struct {
	plan    *filePlan
	limit   int64
	pieces  chan piece
	quit    chan struct{} // closed when the writer has ended
	mu      sync.Mutex
	cond    *sync.Cond
	held    int64
	stopped bool
}

func newSnapshot(p *filePlan, limit int) *snapshot {
	n := 2
	if p != nil {
		n += len(p.items)
	}
	// Room for every piece the bound lets take hold at once (whole
	// chunks, or one full piece and chunks' short last pieces), so that
	// take waits on the memory bound, never on the writer's reading.
	s := &snapshot{plan: p, limit: int64(limit), pieces: make(chan piece, n), quit: make(chan struct{})}
	s.cond = sync.NewCond(&s.mu)
	return s
}

// send hands a piece to the writer and reports whether it still takes
// pieces (a writer that failed reads no more).
func (s *snapshot) send(pc piece) bool {
	select {
	case s.pieces <- pc:
		return true
	case <-s.quit:
		return false
	}
}

// acquire waits until n more bytes fit the bound (or nothing is held, so
// that a piece larger than the bound still goes alone) and reports
// whether the writer still takes pieces.
func (s *snapshot) acquire(n int64) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	for s.limit > 0 && s.held > 0 && s.held+n > s.limit && !s.stopped {
		s.cond.Wait()
	}
	s.held += n
	return !s.stopped
}

func (s *snapshot) free(n int64) {
	s.mu.Lock()
	s.held -= n
	s.mu.Unlock()
	s.cond.Broadcast()
}

// stop tells take that the writer has ended (done or failed).
func (s *snapshot) stop() {
	s.mu.Lock()
	s.stopped = true
	s.mu.Unlock()
	s.cond.Broadcast()
	close(s.quit)
}

// take copies every chunk of p into pieces for the writer and returns the
// peak bytes held. A copy that fails is passed on as the writer's error.
func (s *snapshot) take(p *filePlan, tensors map[string]*placement.DTensor) int64 {
	var peak int64
	note := func() {
		s.mu.Lock()
		peak = max(peak, s.held)
		s.mu.Unlock()
	}
	if p == nil {
		return 0
	}
	for _, c := range p.items {
		t := tensors[c.name]
		if t.Device().Kind() != device.KindHost {
			if !s.acquire(int64(c.bytes)) {
				return peak
			}
			note()
			data, err := hostBytes(t) // a fresh host copy
			if err == nil && len(data) != c.bytes {
				err = invalidf("Save", "tensor %q: local block of %d bytes, its box %v holds %d", c.name, len(data), c.size, c.bytes)
			}
			if err != nil {
				err = wrapf("Save", err, "copying tensor %q to the host", c.name)
			}
			if !s.send(piece{data: data, err: err}) || err != nil {
				return peak
			}
			continue
		}
		src, err := hostBytes(t) // a view
		if err == nil && len(src) != c.bytes {
			err = invalidf("Save", "tensor %q: local block of %d bytes, its box %v holds %d", c.name, len(src), c.size, c.bytes)
		}
		if err != nil {
			s.send(piece{err: err})
			return peak
		}
		step := len(src)
		if s.limit > 0 {
			step = int(s.limit)
		}
		for lo := 0; lo < len(src); lo += step {
			hi := min(lo+step, len(src))
			if !s.acquire(int64(hi - lo)) {
				return peak
			}
			note()
			if !s.send(piece{data: append([]byte(nil), src[lo:hi]...)}) {
				return peak
			}
		}
	}
	return peak
}

// source is the writer's chunkSource: it delivers chunk i's pieces as
// take copied them, freeing each once written.
func (s *snapshot) source(i int, emit func([]byte) error) error {
	for got := 0; got < s.plan.items[i].bytes; {
		pc := <-s.pieces
		if pc.err != nil {
			return pc.err
		}
		err := emit(pc.data)
		s.free(int64(len(pc.data)))
		if err != nil {
			return err
		}
		got += len(pc.data)
	}
	return nil
}
