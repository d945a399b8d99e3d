package tinygpt

import "fmt"

// Batch is one training step's data (reference/TINY_GPT.md §2.3): B rows of T input
// tokens and T target tokens. X and Y are row-major [B, T]; row b is
// X[b*T : (b+1)*T]. Tokens are int64, like the fixture's I64 tensors x1/y1.
type Batch struct {
	// Step is the training step this batch belongs to, counted from 1.
	Step int
	// B is the number of rows, T the number of tokens per row.
	B, T int
	// Offsets are the corpus offsets of the rows: x[b] = corpus[off_b :
	// off_b+T] and y[b] = corpus[off_b+1 : off_b+T+1].
	Offsets []int
	// X holds the input tokens, [B, T].
	X []int64
	// Y holds the target tokens, [B, T] (X shifted by one byte).
	Y []int64
}

// Shape returns the shape of X and Y, [B, T].
func (b Batch) Shape() []int { return []int{b.B, b.T} }

// Row returns row i of X and Y (sub-slices, not copies).
func (b Batch) Row(i int) (x, y []int64) {
	return b.X[i*b.T : (i+1)*b.T], b.Y[i*b.T : (i+1)*b.T]
}

// Rows returns the rows [lo, hi) as a batch that shares memory with b.
func (b Batch) Rows(lo, hi int) Batch {
	return Batch{
		Step:    b.Step,
		B:       hi - lo,
		T:       b.T,
		Offsets: b.Offsets[lo:hi:hi],
		X:       b.X[lo*b.T : hi*b.T : hi*b.T],
		Y:       b.Y[lo*b.T : hi*b.T : hi*b.T],
	}
}

// RankRows returns the rows [r·B/R, (r+1)·B/R) that data-parallel rank r of
// R keeps (§2.3). Ranks must have equal shares, so B must be divisible by R.
func RankRows(B, R, r int) (lo, hi int, err error) {
	switch {
	case R < 1:
		return 0, 0, fmt.Errorf("tinygpt: %d ranks; need at least 1", R)
	case r < 0 || r >= R:
		return 0, 0, fmt.Errorf("tinygpt: rank %d out of range [0, %d)", r, R)
	case B%R != 0:
		return 0, 0, fmt.Errorf("tinygpt: batch B=%d is not divisible by R=%d ranks (ranks need equal shares)", B, R)
	}
	return r * B / R, (r + 1) * B / R, nil
}

// Shard returns the rows data-parallel rank r of R keeps; see RankRows. The
// result shares memory with b.
func (b Batch) Shard(r, R int) (Batch, error) {
	lo, hi, err := RankRows(b.B, R, r)
	if err != nil {
		return Batch{}, err
	}
	return b.Rows(lo, hi), nil
}

// Sampler draws training batches per §2.3 from its own LCG seeded with
// BATCH_SEED. Step s (from 1) uses draws (s−1)·B … s·B−1 of that stream; no
// other draws are taken from it. Every data-parallel rank draws the full
// batch and keeps its rows with Batch.Shard.
type Sampler struct {
	cfg    Config
	corpus []byte
	rng    *LCG
	step   int
}

// NewSampler returns a sampler over corpus (normally Corpus(cfg)) that will
// draw batch 1 next. It checks cfg and that the corpus has cfg.CorpusLen
// bytes, all below cfg.V. The corpus is not copied and must not change.
func NewSampler(cfg Config, corpus []byte) (*Sampler, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if len(corpus) != cfg.CorpusLen {
		return nil, fmt.Errorf("tinygpt: corpus has %d bytes, config says CORPUS_LEN=%d", len(corpus), cfg.CorpusLen)
	}
	for i, c := range corpus {
		if int(c) >= cfg.V {
			return nil, fmt.Errorf("tinygpt: corpus byte %d at offset %d is not below V=%d", c, i, cfg.V)
		}
	}
	return &Sampler{cfg: cfg, corpus: corpus, rng: NewLCG(cfg.BatchSeed)}, nil
}

// Step returns the number of batches drawn so far; the next batch is Step()+1.
func (s *Sampler) Step() int { return s.step }

// NextOffsets draws the next step's B offsets without building the tokens,
// advancing the stream exactly as Next does.
func (s *Sampler) NextOffsets() []int {
	m := s.cfg.OffsetRange()
	offs := make([]int, s.cfg.B)
	for b := range offs {
		offs[b] = s.rng.Randint(m)
	}
	s.step++
	return offs
}

// Next draws the next step's batch: B offsets for rows b = 0 … B−1 in order,
// off_b = randint(CORPUS_LEN − T − 1), then the [B, T] inputs and targets.
func (s *Sampler) Next() Batch {
	offs := s.NextOffsets()
	B, T := s.cfg.B, s.cfg.T
	x := make([]int64, B*T)
	y := make([]int64, B*T)
	for b, off := range offs {
		for t := 0; t < T; t++ {
			x[b*T+t] = int64(s.corpus[off+t])
			y[b*T+t] = int64(s.corpus[off+t+1])
		}
	}
	return Batch{Step: s.step, B: B, T: T, Offsets: offs, X: x, Y: y}
}

// BatchAt returns the batch of training step step (from 1) by replaying the
// stream from the start; for tests and for resuming. It costs step·B draws.
func BatchAt(cfg Config, corpus []byte, step int) (Batch, error) {
	if step < 1 {
		return Batch{}, fmt.Errorf("tinygpt: step %d; steps count from 1", step)
	}
	s, err := NewSampler(cfg, corpus)
	if err != nil {
		return Batch{}, err
	}
	for s.Step() < step-1 {
		s.NextOffsets()
	}
	return s.Next(), nil
}
