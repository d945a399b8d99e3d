package train

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/internal/numcheck"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
)

// Dataset is a training set of Len rows that builds a batch of type B
// (the loss function's input) from one rank's Sample of a global batch.
// Batch is called on every rank with that rank's Sample; it must not
// communicate (every rank builds its own block of the batch).
type Dataset[B any] interface {
	// Len is the number of rows, at least 1.
	Len() int
	// Batch builds the batch of s on this rank.
	Batch(ctx context.Context, s Sample) (B, error)
}

// Sample is one global batch as one rank sees it: the rows of the whole
// batch, in batch order, the same on every rank, and this rank's share of
// them.
type Sample struct {
	// Epoch counts passes over the dataset from 0; Index counts the
	// global batches of the epoch from 0.
	Epoch, Index int
	// Global are the dataset rows of the global batch, in order.
	Global []int
	// Rows are this data-parallel rank's rows: piece rank of Global split
	// over the ranks by the torch.chunk rule of placement.Spec (pieces of
	// ceil(len/ranks) rows, the trailing ones short or empty), which is
	// the block a tensor of the batch Shard(0) on one data-parallel mesh
	// axis holds.
	Rows []int
}

// SamplerState is a Sampler's position: the next global batch it gives.
// It is plain data, to be saved with a checkpoint and given to Restore.
type SamplerState struct {
	// Epoch and Index are the next batch's Sample.Epoch and Sample.Index.
	Epoch int `json:"epoch"`
	Index int `json:"index"`
}

// Sampler splits a dataset of n rows into global batches of a fixed size,
// epoch after epoch, and gives each data-parallel rank its rows of each
// (PyTorch's DistributedSampler over a BatchSampler, with drop_last: an
// epoch is the n/batch whole batches, the rows left over are not used in
// that epoch). With WithShuffle every epoch visits the rows in a
// permutation drawn from the seed and the epoch number, the same on every
// rank; without, in order. Its position (State) restores exactly
// (Restore). A Sampler belongs to one rank.
type Sampler struct {
	n, batch, rank, ranks int
	shuffle               bool
	seed                  uint64
	pos                   SamplerState
	perm                  []int // the permutation of perm's epoch, nil before
	permEpoch             int
}

// SamplerOption configures NewSampler.
type SamplerOption func(*Sampler)

// WithShuffle makes the sampler visit each epoch's rows in a random
// permutation seeded by seed and the epoch (the same on every rank).
func WithShuffle(seed uint64) SamplerOption {
	return func(s *Sampler) { s.shuffle, s.seed = true, seed }
}

// NewSampler returns a sampler of global batches of batch rows of a
// dataset of n rows, for data-parallel rank rank of ranks (DataRank gives
// them from a mesh). n must be at least batch, batch at least 1, ranks at
// least 1 and rank in [0, ranks); errors wrap ErrInvalid. A batch smaller
// than ranks leaves some ranks with no rows, which the layouts allow.
func NewSampler(n, batch, rank, ranks int, opts ...SamplerOption) (*Sampler, error) {
	const op = "train: NewSampler"
	for _, err := range []error{
		numcheck.Count(ErrInvalid, "batch", batch),
		numcheck.Count(ErrInvalid, "ranks", ranks),
		numcheck.Count(ErrInvalid, "dataset rows", n),
	} {
		if err != nil {
			return nil, fmt.Errorf("%s: %w", op, err)
		}
	}
	if n < batch {
		return nil, fmt.Errorf("%s: %w: a batch of %d rows from a dataset of %d", op, ErrInvalid, batch, n)
	}
	if rank < 0 || rank >= ranks {
		return nil, fmt.Errorf("%s: %w: rank %d of %d", op, ErrInvalid, rank, ranks)
	}
	s := &Sampler{n: n, batch: batch, rank: rank, ranks: ranks}
	for _, o := range opts {
		o(s)
	}
	return s, nil
}

// BatchesPerEpoch is the number of global batches in an epoch.
func (s *Sampler) BatchesPerEpoch() int { return s.n / s.batch }

// Batch is the global batch size in rows.
func (s *Sampler) Batch() int { return s.batch }

// State returns the position: the batch Next gives next.
func (s *Sampler) State() SamplerState { return s.pos }

// Restore moves the sampler to st, so that Next continues exactly where
// the sampler that gave st would have. A negative epoch or an index
// outside the epoch's batches is an error wrapping ErrInvalid.
func (s *Sampler) Restore(st SamplerState) error {
	if st.Epoch < 0 || st.Index < 0 || st.Index >= s.BatchesPerEpoch() {
		return fmt.Errorf("%w: Sampler.Restore: epoch %d, batch %d of %d per epoch", ErrInvalid, st.Epoch, st.Index, s.BatchesPerEpoch())
	}
	s.pos = st
	return nil
}

// Next returns the next global batch and advances the position, starting
// a new epoch after the last whole batch of one.
func (s *Sampler) Next() Sample {
	order := s.order(s.pos.Epoch)
	global := slices.Clone(order[s.pos.Index*s.batch : (s.pos.Index+1)*s.batch])
	off, size := chunk(len(global), s.ranks, s.rank)
	out := Sample{Epoch: s.pos.Epoch, Index: s.pos.Index, Global: global, Rows: global[off : off+size]}
	if s.pos.Index++; s.pos.Index == s.BatchesPerEpoch() {
		s.pos = SamplerState{Epoch: s.pos.Epoch + 1}
	}
	return out
}

// order returns the rows of epoch in visiting order.
func (s *Sampler) order(epoch int) []int {
	if s.perm != nil && s.permEpoch == epoch {
		return s.perm
	}
	perm := make([]int, s.n)
	for i := range perm {
		perm[i] = i
	}
	if s.shuffle {
		// Seeded by (seed, epoch), like DistributedSampler's seed+epoch,
		// so that every rank and every resumed run draws the same order.
		r := rand.New(rand.NewPCG(s.seed, uint64(epoch)))
		r.Shuffle(len(perm), func(i, j int) { perm[i], perm[j] = perm[j], perm[i] })
	}
	s.perm, s.permEpoch = perm, epoch
	return perm
}

// chunk is piece c of n split over k by the torch.chunk rule (placement's).
func chunk(n, k, c int) (off, size int) {
	ch := (n + k - 1) / k
	off = min(c*ch, n)
	return off, min(ch, n-off)
}

// DataRank returns this rank's position in the data-parallel group of m
// formed by axes (its coordinates on them, row-major in the given order)
// and the group's size: the rank and ranks of NewSampler. Axes that m does
// not have are an error wrapping ErrInvalid.
func DataRank(m *mesh.Mesh, axes ...string) (rank, ranks int, err error) {
	if m == nil {
		return 0, 0, fmt.Errorf("%w: DataRank: nil mesh", ErrInvalid)
	}
	ranks = 1
	for _, a := range axes {
		size, err := m.AxisSize(a)
		if err != nil {
			return 0, 0, fmt.Errorf("%w: DataRank: %w", ErrInvalid, err)
		}
		pos, err := m.Local(a)
		if err != nil {
			return 0, 0, fmt.Errorf("%w: DataRank: %w", ErrInvalid, err)
		}
		rank, ranks = rank*size+pos, ranks*size
	}
	return rank, ranks, nil
}

// Classification is a batch of a classification set: features X [batch,
// features] and class labels Y [batch], both Shard(0) on the
// data-parallel axes and Replicate on the others.
type Classification struct {
	X *autograd.Value
	Y *autograd.Indices
}

// InMemory is a classification dataset held in memory: Features float32
// features per row, row-major in X, and one class label per row in Y. It
// builds Classification batches as constants on Tape over Mesh, sharded on
// the data-parallel Axes (outer to inner; none on one rank).
type InMemory struct {
	X        []float32
	Features int
	Y        []int64
	Tape     *autograd.Tape
	Mesh     *mesh.Mesh
	Axes     []string
}

// Len is the number of rows.
func (d *InMemory) Len() int { return len(d.Y) }

// Batch builds the batch of s: this rank's block of the global batch's
// rows (the block of a tensor Shard(0) on d.Axes, which is s.Rows when
// there is one data-parallel axis), a constant on d.Tape. A row outside
// the dataset or fields that do not fit (X not len(Y)×Features) are
// errors wrapping ErrInvalid.
func (d *InMemory) Batch(ctx context.Context, s Sample) (Classification, error) {
	const op = "train: InMemory.Batch"
	if d.Tape == nil || d.Mesh == nil || d.Features < 1 || len(d.X) != len(d.Y)*d.Features {
		return Classification{}, fmt.Errorf("%s: %w: a tape, a mesh and X of len(Y)×Features values are needed (%d values, %d labels, %d features)", op, ErrInvalid, len(d.X), len(d.Y), d.Features)
	}
	places := make([]placement.Placement, d.Mesh.NDim())
	for i, name := range d.Mesh.Names() {
		places[i] = placement.Replicate()
		if slices.Contains(d.Axes, name) {
			places[i] = placement.Shard(0)
		}
	}
	var opts []placement.SpecOption
	if len(d.Axes) > 1 {
		opts = append(opts, placement.WithOrder(0, d.Axes...))
	}
	// Every rank checks every row, not only its own, so that a bad batch
	// fails on all of them alike rather than leaving some waiting in the
	// next collective.
	for _, r := range s.Global {
		if r < 0 || r >= len(d.Y) {
			return Classification{}, fmt.Errorf("%s: %w: row %d of %d", op, ErrInvalid, r, len(d.Y))
		}
	}
	b := len(s.Global)
	spec, err := placement.NewSpec(d.Mesh, []int{b, d.Features}, comm.Float32, places, opts...)
	if err != nil {
		return Classification{}, fmt.Errorf("%s: %w", op, err)
	}
	off, size, err := spec.Box(d.Mesh.Rank())
	if err != nil {
		return Classification{}, fmt.Errorf("%s: %w", op, err)
	}
	rows := s.Global[off[0] : off[0]+size[0]]
	x := make([]float32, 0, len(rows)*d.Features)
	y := make([]int64, 0, len(rows))
	for _, r := range rows {
		x = append(x, d.X[r*d.Features:(r+1)*d.Features]...)
		y = append(y, d.Y[r])
	}
	dt, err := placement.NewLocal(spec, x)
	if err != nil {
		return Classification{}, fmt.Errorf("%s: %w", op, err)
	}
	xv, err := d.Tape.Constant(dt)
	if err != nil {
		return Classification{}, fmt.Errorf("%s: %w", op, err)
	}
	yi, err := autograd.NewIndices(d.Mesh, []int{b}, places, y, opts...)
	if err != nil {
		return Classification{}, fmt.Errorf("%s: %w", op, err)
	}
	return Classification{X: xv, Y: yi}, nil
}

// Split returns the first n rows of d and the rest as two datasets on the
// same tape, mesh and axes (views of d's slices, not copies): a training
// and a held-out set. n must be in [1, Len()); errors wrap ErrInvalid.
func (d *InMemory) Split(n int) (*InMemory, *InMemory, error) {
	if n < 1 || n >= d.Len() || len(d.X) != d.Len()*d.Features {
		return nil, nil, fmt.Errorf("%w: InMemory.Split: %d rows of %d (%d values, %d features)", ErrInvalid, n, d.Len(), len(d.X), d.Features)
	}
	a, b := *d, *d
	a.X, a.Y = d.X[:n*d.Features], d.Y[:n]
	b.X, b.Y = d.X[n*d.Features:], d.Y[n:]
	return &a, &b, nil
}

// Blobs draws a synthetic classification set of rows rows: each class
// has a centre drawn from N(0, 1) in every feature, and each row is its
// class's centre (the class drawn uniformly) plus N(0, 1) noise. It
// returns the features, row-major (rows × features), and the labels; the
// same seed gives the same set. Counts below 1 are errors wrapping
// ErrInvalid.
func Blobs(rows, features, classes int, seed uint64) ([]float32, []int64, error) {
	for _, err := range []error{
		numcheck.Count(ErrInvalid, "rows", rows),
		numcheck.Count(ErrInvalid, "features", features),
		numcheck.Count(ErrInvalid, "classes", classes),
	} {
		if err != nil {
			return nil, nil, fmt.Errorf("train: Blobs: %w", err)
		}
	}
	r := rand.New(rand.NewPCG(seed, 0x626c6f6273)) // "blobs"
	centres := make([]float64, classes*features)
	for i := range centres {
		centres[i] = r.NormFloat64()
	}
	x, y := make([]float32, rows*features), make([]int64, rows)
	for i := range y {
		c := r.IntN(classes)
		y[i] = int64(c)
		for j := range features {
			x[i*features+j] = float32(centres[c*features+j] + r.NormFloat64())
		}
	}
	return x, y, nil
}

// Sampler returns a Sampler of global batches of batch rows of d for
// this rank: its data-parallel rank and group are DataRank(d.Mesh,
// d.Axes...). Errors are NewSampler's and DataRank's.
func (d *InMemory) Sampler(batch int, opts ...SamplerOption) (*Sampler, error) {
	rank, ranks, err := DataRank(d.Mesh, d.Axes...)
	if err != nil {
		return nil, fmt.Errorf("train: InMemory.Sampler: %w", err)
	}
	return NewSampler(d.Len(), batch, rank, ranks, opts...)
}
