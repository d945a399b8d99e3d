package train

import (
	"errors"
	"slices"
	"testing"

	"github.com/b7ea7098/loom"
)

// TestSamplerSplitsGlobalBatches: for every rank count, the ranks' rows
// of each global batch are disjoint, in batch order, cover the batch
// (torch.chunk pieces), every rank sees the same global batch, an epoch
// visits each row at most once, and the next epoch draws another order.
func TestSamplerSplitsGlobalBatches(t *testing.T) {
	for _, c := range []struct {
		name                string
		n, batch, ranks     int
		shuffle             bool
		wantPieces          []int // rows per rank
		wantBatchesPerEpoch int
	}{
		{"even", 20, 8, 2, true, []int{4, 4}, 2},
		{"uneven", 20, 7, 3, true, []int{3, 3, 1}, 2},
		{"empty piece", 9, 3, 4, false, []int{1, 1, 1, 0}, 3},
		{"one rank", 5, 5, 1, true, []int{5}, 1},
	} {
		t.Run(c.name, func(t *testing.T) {
			ss := make([]*Sampler, c.ranks)
			for r := range ss {
				var opts []SamplerOption
				if c.shuffle {
					opts = append(opts, WithShuffle(42))
				}
				var err error
				if ss[r], err = NewSampler(c.n, c.batch, r, c.ranks, opts...); err != nil {
					t.Fatal(err)
				}
			}
			if got := ss[0].BatchesPerEpoch(); got != c.wantBatchesPerEpoch {
				t.Fatalf("BatchesPerEpoch %d, want %d", got, c.wantBatchesPerEpoch)
			}
			var epochs [2][]int
			for b := range 2 * c.wantBatchesPerEpoch {
				var joined []int
				var global []int
				for r, s := range ss {
					smp := s.Next()
					if r == 0 {
						global = smp.Global
					} else if !slices.Equal(global, smp.Global) {
						t.Fatalf("batch %d: rank %d has global batch %v, rank 0 %v", b, r, smp.Global, global)
					}
					if len(smp.Rows) != c.wantPieces[r] {
						t.Fatalf("batch %d: rank %d has %d rows, want %d", b, r, len(smp.Rows), c.wantPieces[r])
					}
					if smp.Epoch != b/c.wantBatchesPerEpoch || smp.Index != b%c.wantBatchesPerEpoch {
						t.Fatalf("batch %d: epoch %d index %d", b, smp.Epoch, smp.Index)
					}
					joined = append(joined, smp.Rows...)
				}
				if !slices.Equal(joined, global) || len(global) != c.batch {
					t.Fatalf("batch %d: ranks' rows %v do not make up the global batch %v", b, joined, global)
				}
				epochs[b/c.wantBatchesPerEpoch] = append(epochs[b/c.wantBatchesPerEpoch], global...)
			}
			for e, rows := range epochs {
				seen := map[int]bool{}
				for _, r := range rows {
					if r < 0 || r >= c.n || seen[r] {
						t.Fatalf("epoch %d visits row %d twice or out of range: %v", e, r, rows)
					}
					seen[r] = true
				}
			}
			if c.shuffle && c.n > 5 && slices.Equal(epochs[0], epochs[1]) {
				t.Errorf("two epochs in the same order %v", epochs[0])
			}
			if !c.shuffle && !slices.IsSorted(epochs[0]) {
				t.Errorf("unshuffled epoch out of order: %v", epochs[0])
			}
		})
	}
}

// TestSamplerRestore: a sampler restored from another's State continues
// exactly as the original does, across an epoch boundary, and the order
// depends on the seed.
func TestSamplerRestore(t *testing.T) {
	a, err := NewSampler(50, 6, 1, 3, WithShuffle(7))
	if err != nil {
		t.Fatal(err)
	}
	for range 10 { // into the second epoch (8 batches per epoch)
		a.Next()
	}
	st := a.State()
	if st != (SamplerState{Epoch: 1, Index: 2}) {
		t.Fatalf("state %+v after 10 batches of 8 per epoch", st)
	}
	b, err := NewSampler(50, 6, 1, 3, WithShuffle(7))
	if err != nil {
		t.Fatal(err)
	}
	if err := b.Restore(st); err != nil {
		t.Fatal(err)
	}
	for i := range 12 {
		x, y := a.Next(), b.Next()
		if !slices.Equal(x.Global, y.Global) || !slices.Equal(x.Rows, y.Rows) || x.Epoch != y.Epoch || x.Index != y.Index {
			t.Fatalf("batch %d after restoring: %+v, the original %+v", i, y, x)
		}
	}
	c, err := NewSampler(50, 6, 1, 3, WithShuffle(8))
	if err != nil {
		t.Fatal(err)
	}
	d, err := NewSampler(50, 6, 1, 3, WithShuffle(7))
	if err != nil {
		t.Fatal(err)
	}
	if slices.Equal(c.Next().Global, d.Next().Global) {
		t.Error("seeds 7 and 8 give the same first batch")
	}
	for _, bad := range []SamplerState{{Epoch: -1}, {Index: 8}, {Index: -1}} {
		if err := b.Restore(bad); !errors.Is(err, loom.ErrInvalid) {
			t.Errorf("Restore(%+v): %v; want ErrInvalid", bad, err)
		}
	}
}

func TestNewSamplerRejects(t *testing.T) {
	for _, c := range []struct{ n, batch, rank, ranks int }{
		{10, 0, 0, 1}, {10, 11, 0, 1}, {0, 1, 0, 1}, {10, 2, 2, 2}, {10, 2, -1, 2}, {10, 2, 0, 0},
	} {
		if _, err := NewSampler(c.n, c.batch, c.rank, c.ranks); !errors.Is(err, ErrInvalid) || !errors.Is(err, loom.ErrInvalid) {
			t.Errorf("NewSampler%v: %v; want ErrInvalid", c, err)
		}
	}
}

func TestBlobs(t *testing.T) {
	x, y, err := Blobs(100, 3, 4, 5)
	if err != nil {
		t.Fatal(err)
	}
	x2, y2, _ := Blobs(100, 3, 4, 5)
	if len(x) != 300 || len(y) != 100 || !slices.Equal(x, x2) || !slices.Equal(y, y2) {
		t.Fatalf("Blobs: %d values, %d labels, repeatable %v", len(x), len(y), slices.Equal(x, x2))
	}
	seen := map[int64]bool{}
	for _, c := range y {
		if c < 0 || c >= 4 {
			t.Fatalf("label %d", c)
		}
		seen[c] = true
	}
	if len(seen) != 4 {
		t.Errorf("labels %v: not every class drawn", seen)
	}
	if _, _, err := Blobs(0, 3, 4, 5); !errors.Is(err, ErrInvalid) {
		t.Errorf("Blobs(0 rows): %v", err)
	}
}
