package local

import (
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/internal/kernel"
)

// schedule returns the compiled schedule for call, choosing the algorithm
// if the call left it to the backend, and the trial the call is when its
// size class is being tuned (nil otherwise).
func (c *Comm) schedule(call *comm.Call, me *descriptor) (*schedule, *trial, error) {
	p := c.g.size
	key := shapeKey{op: call.Op, algo: call.Algorithm, n: call.Count(), root: call.Root, dtype: me.dtype, reduce: call.Reduce}
	cacheable := p <= 64
	if cacheable {
		for q := 0; q < p; q++ {
			if c.g.slots[q].desc.inPlace {
				key.inPlace |= 1 << q
			}
		}
		if s, ok := c.plans[key]; ok {
			return s, nil, nil
		}
	}
	inPlace := make([]byte, p)
	for q := range inPlace {
		if c.g.slots[q].desc.inPlace {
			inPlace[q] = 1
		}
	}
	n := call.Count()
	if call.Op == comm.OpReduceScatter {
		n = len(me.recv) / me.dtype.Size()
	}
	pl := plan{
		op: call.Op, algo: call.Algorithm, p: p, n: n, root: call.Root,
		avg:    call.Op.Reduces() && call.Reduce == comm.Avg && !halfAvg(call, me.dtype),
		stream: c.footprint() > c.g.w.model.CacheBytes/2, // the cache is shared with everything else
	}
	pl.piece = pieceElems(me.dtype, pl.stream)
	if !call.Op.Rooted() {
		pl.root = 0
	}
	var tr *trial
	if pl.algo == comm.Auto {
		pl.algo, tr = c.autoAlgorithm(pl, inPlace, me.dtype, call.Reduce)
	}
	s, err := c.g.compiled(pl, inPlace)
	if err == nil && cacheable && tr == nil { // a trial's algorithm is not the call's for good
		if len(c.plans) >= maxCachedSchedules {
			clear(c.plans)
		}
		c.plans[key] = s
	}
	return s, tr, err
}

// shapeKey identifies a call's shape for this rank's schedule cache.
type shapeKey struct {
	op      comm.Op
	algo    comm.Algorithm
	n, root int
	dtype   comm.DType
	reduce  comm.ReduceOp
	inPlace uint64 // bit q: rank q called in place
}

// footprint is the bytes every member's buffers of the current call span:
// beyond the last-level cache the call runs at memory speed.
func (c *Comm) footprint() int64 {
	var n int64
	for q := range c.g.slots {
		d := &c.g.slots[q].desc
		n += int64(len(d.send) + len(d.recv))
	}
	return n
}

// The pipeline granularity of tree and chain algorithms: large enough to
// amortise a handoff, small enough to fill the pipeline; from memory,
// large enough for the streaming stores of kernel.ReduceStream.
const (
	pieceBytes       = 256 << 10
	pieceBytesStream = kernel.StreamBytes
)

func pieceElems(dt comm.DType, stream bool) int {
	if stream {
		return max(1, pieceBytesStream/dt.Size())
	}
	return max(1, pieceBytes/dt.Size())
}

// compiled returns the cached schedule for pl, generating it on first use.
func (g *group) compiled(pl plan, inPlace []byte) (*schedule, error) {
	key := schedKey{op: pl.op, algo: pl.algo, n: pl.n, root: pl.root, piece: pl.piece, avg: pl.avg, stream: pl.stream, inPlace: string(inPlace)}
	g.schedMu.Lock()
	defer g.schedMu.Unlock()
	if s, ok := g.schedules[key]; ok {
		return s, nil
	}
	pl.inPlace = make([]bool, len(inPlace))
	for i, b := range inPlace {
		pl.inPlace[i] = b == 1
	}
	s, err := generate(pl)
	if err != nil {
		return nil, err
	}
	if len(g.schedules) >= maxCachedSchedules {
		clear(g.schedules)
	}
	g.schedules[key] = s
	return s, nil
}

// maxCachedSchedules bounds the schedule cache of one communicator; a
// training loop uses a handful of sizes, so eviction is rare.
const maxCachedSchedules = 512
