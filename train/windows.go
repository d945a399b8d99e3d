package train

import (
	"context"
	"fmt"
	"math"
	"slices"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/internal/numcheck"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
)

// LM is a batch of a language model: token ids X and next-token targets
// Y, both [batch, T], Shard(0) on the data-parallel axes and Replicate on
// the others (what gpt.Model.Forward takes).
type LM struct {
	X, Y *autograd.Indices
}

// Windows is a token file cut into rows of T+1 tokens for a language
// model: row i is the window that starts at token (first+i)·T, its inputs
// the first T tokens and its targets the last T (the inputs shifted by
// one), so consecutive windows share one token and a file of n tokens
// gives (n−1)/T of them. It is a Dataset of LM batches over Mesh, sharded
// on the data-parallel Axes; a Sampler over it (Windows.Sampler) gives
// each rank its rows of every global batch, epochs, the seeded shuffle of
// the windows and the position to save and restore.
type Windows struct {
	file     *TokenFile
	t        int
	first, n int // the windows [first, first+n) of the file
	mesh     *mesh.Mesh
	axes     []string
	// seq shards T over a context-parallel axis ("" for none): seqPlace
	// is its placement, Shard(1) or ShardBalanced(1).
	seq      string
	seqPlace placement.Placement
}

// NewWindows returns the windows of T+1 tokens of f, with batches laid out
// on m, sharded on the data-parallel axes (outer to
// inner; none on one rank). T must be at least 1 and the file must hold
// at least one window (T+1 tokens); m must have every axis. Errors wrap
// ErrInvalid.
func NewWindows(f *TokenFile, T int, m *mesh.Mesh, axes ...string) (*Windows, error) {
	const op = "train: NewWindows"
	if f == nil || m == nil {
		return nil, fmt.Errorf("%s: %w: nil file or mesh", op, ErrInvalid)
	}
	if err := numcheck.Count(ErrInvalid, "window length T", T); err != nil {
		return nil, fmt.Errorf("%s: %w", op, err)
	}
	if _, _, err := DataRank(m, axes...); err != nil {
		return nil, fmt.Errorf("%s: %w", op, err)
	}
	n := (f.Len() - 1) / T
	if n < 1 {
		return nil, fmt.Errorf("%s: %w: %s has %d tokens, fewer than one window of T+1 = %d", op, ErrInvalid, f.Path(), f.Len(), T+1)
	}
	return &Windows{file: f, t: T, n: n, mesh: m, axes: slices.Clone(axes)}, nil
}

// ShardSequence returns w with the sequence dim T of its batches sharded
// over the mesh axis named axis as well (context parallelism): load
// balanced (placement.ShardBalanced: rank r of k holds chunks r and
// 2k−1−r of 2k) if balanced, else in contiguous blocks. Every rank of
// a data-parallel group reads the same windows and keeps its positions
// of them; targets follow the inputs, and position ids taken from the
// layout (Spec.Positions, as gpt.Model.Forward takes them) follow too.
// The axis must be a mesh axis other than the data-parallel ones; errors
// wrap ErrInvalid.
func (w *Windows) ShardSequence(axis string, balanced bool) (*Windows, error) {
	const op = "train: Windows.ShardSequence"
	if _, err := w.mesh.AxisSize(axis); err != nil || slices.Contains(w.axes, axis) {
		return nil, fmt.Errorf("%s: %w: %q is not a mesh axis other than the data-parallel axes %v (mesh axes %v)", op, ErrInvalid, axis, w.axes, w.mesh.Names())
	}
	c := *w
	c.seq, c.seqPlace = axis, placement.Shard(1)
	if balanced {
		c.seqPlace = placement.ShardBalanced(1)
	}
	return &c, nil
}

// Len is the number of windows.
func (w *Windows) Len() int { return w.n }

// T is the window's length in inputs (a row has T+1 tokens).
func (w *Windows) T() int { return w.t }

// Split holds out the last ⌈frac·Len⌉ windows for validation: it returns
// the windows before them (training) and those windows (validation),
// views of the same file. The two share one token at the boundary (the
// last training target is the first validation input), as nanoGPT's
// split of a corpus does. frac must be in (0, 1) and leave at least one
// window on each side; errors wrap ErrInvalid. A separate validation
// file (nanoGPT's val.bin) needs no Split: open it and give it to
// NewWindows.
func (w *Windows) Split(frac float64) (training, validation *Windows, err error) {
	if err := numcheck.Fraction(ErrInvalid, "validation fraction", frac); err != nil || frac == 0 {
		return nil, nil, fmt.Errorf("%w: Windows.Split: fraction %v must be in (0, 1)", ErrInvalid, frac)
	}
	held := int(math.Ceil(frac * float64(w.n)))
	if held >= w.n {
		return nil, nil, fmt.Errorf("%w: Windows.Split: holding out %d of %d windows leaves none to train on", ErrInvalid, held, w.n)
	}
	a, b := *w, *w
	a.n = w.n - held
	b.first, b.n = w.first+a.n, held
	return &a, &b, nil
}

// Sampler returns a Sampler of global batches of batch windows for this
// rank: its data-parallel rank and group are DataRank(mesh, axes...).
// Errors are NewSampler's.
func (w *Windows) Sampler(batch int, opts ...SamplerOption) (*Sampler, error) {
	rank, ranks, err := DataRank(w.mesh, w.axes...)
	if err != nil {
		return nil, fmt.Errorf("train: Windows.Sampler: %w", err)
	}
	return NewSampler(w.n, batch, rank, ranks, opts...)
}

// Rows reads the windows rows (indices into w) and returns their inputs
// and targets, row-major [len(rows), T]. A row outside w wraps
// ErrInvalid; a read error is the file's.
func (w *Windows) Rows(rows []int) (x, y []int64, err error) {
	T := w.t
	x, y = make([]int64, len(rows)*T), make([]int64, len(rows)*T)
	win := make([]int64, T+1)
	for i, r := range rows {
		if r < 0 || r >= w.n {
			return nil, nil, fmt.Errorf("%w: Windows.Rows: window %d of %d", ErrInvalid, r, w.n)
		}
		if err := w.file.Read(win, (w.first+r)*T); err != nil {
			return nil, nil, fmt.Errorf("train: Windows.Rows: %w", err)
		}
		copy(x[i*T:], win[:T])
		copy(y[i*T:], win[1:])
	}
	return x, y, nil
}

// Batch builds the batch of s: this rank's block of the global batch's
// windows (the block of a [batch, T] tensor Shard(0) on the data-parallel
// axes, which is s.Rows when there is one such axis, and sharded on T as
// ShardSequence says), read from the file now. Every rank checks every row of the batch, so that a bad batch
// fails on all of them alike. Errors wrap ErrInvalid or are the file's.
func (w *Windows) Batch(ctx context.Context, s Sample) (LM, error) {
	const op = "train: Windows.Batch"
	for _, r := range s.Global {
		if r < 0 || r >= w.n {
			return LM{}, fmt.Errorf("%s: %w: window %d of %d", op, ErrInvalid, r, w.n)
		}
	}
	places := make([]placement.Placement, w.mesh.NDim())
	for i, name := range w.mesh.Names() {
		places[i] = placement.Replicate()
		if slices.Contains(w.axes, name) {
			places[i] = placement.Shard(0)
		}
		if name == w.seq {
			places[i] = w.seqPlace
		}
	}
	var opts []placement.SpecOption
	if len(w.axes) > 1 {
		opts = append(opts, placement.WithOrder(0, w.axes...))
	}
	shape := []int{len(s.Global), w.t}
	// The spec only locates this rank's block; specs hold floats, and
	// the block of ids is the same whatever the dtype.
	spec, err := placement.NewSpec(w.mesh, shape, comm.Float32, places, opts...)
	if err != nil {
		return LM{}, fmt.Errorf("%s: %w", op, err)
	}
	// Positions, not Box: a load-balanced T is two runs, not a box.
	rows, err := spec.Positions(0, w.mesh.Rank())
	if err != nil {
		return LM{}, fmt.Errorf("%s: %w", op, err)
	}
	picked := make([]int, len(rows))
	for i, r := range rows {
		picked[i] = s.Global[r]
	}
	x, y, err := w.Rows(picked)
	if err != nil {
		return LM{}, fmt.Errorf("%s: %w", op, err)
	}
	if w.seq != "" {
		cols, err := spec.Positions(1, w.mesh.Rank())
		if err != nil {
			return LM{}, fmt.Errorf("%s: %w", op, err)
		}
		x, y = keepColumns(x, w.t, cols), keepColumns(y, w.t, cols)
	}
	xi, err := autograd.NewIndices(w.mesh, shape, places, x, opts...)
	if err != nil {
		return LM{}, fmt.Errorf("%s: %w", op, err)
	}
	yi, err := autograd.NewIndices(w.mesh, shape, places, y, opts...)
	if err != nil {
		return LM{}, fmt.Errorf("%s: %w", op, err)
	}
	return LM{X: xi, Y: yi}, nil
}

// keepColumns returns the columns cols of every row of the row-major
// [rows, t] matrix m, row-major [rows, len(cols)].
func keepColumns(m []int64, t int, cols []int) []int64 {
	out := make([]int64, 0, len(m)/t*len(cols))
	for r := 0; r < len(m); r += t {
		for _, c := range cols {
			out = append(out, m[r+c])
		}
	}
	return out
}

// ValLoss is the mean loss over the first batches global batches (0: a
// whole epoch) of s's epoch 0, the same batches at every call so that
// validation losses compare across a run: s is moved to the start of
// epoch 0 and put back where it was after. Each batch's recorded ops are
// reset after its loss is read (no backward). Call it in evaluation mode
// (parallel.Eval, or from a Trainer's WithEval function) on every rank:
// reading a Partial loss is collective. Nil arguments and a negative
// batches wrap ErrInvalid.
func ValLoss[B any](ctx context.Context, tape *autograd.Tape, data Dataset[B], s *Sampler, batches int, loss LossFunc[B]) (float64, error) {
	const op = "train: ValLoss"
	if tape == nil || data == nil || s == nil || loss == nil {
		return 0, fmt.Errorf("%s: %w: nil tape, dataset, sampler or loss", op, ErrInvalid)
	}
	if err := numcheck.NonNegativeCount(ErrInvalid, "batches", batches); err != nil {
		return 0, fmt.Errorf("%s: %w", op, err)
	}
	n := s.BatchesPerEpoch()
	if batches > 0 {
		n = min(n, batches)
	}
	saved := s.State()
	s.pos = SamplerState{}
	defer func() { s.pos = saved }()
	sum := 0.0
	for range n {
		b, err := data.Batch(ctx, s.Next())
		if err != nil {
			return 0, fmt.Errorf("%s: %w", op, err)
		}
		l, err := loss(ctx, b)
		if err == nil {
			var v float64
			if v, err = Item(ctx, l); err == nil {
				sum += v
			}
		}
		tape.Reset()
		if err != nil {
			return 0, fmt.Errorf("%s: %w", op, err)
		}
	}
	return sum / float64(n), nil
}
