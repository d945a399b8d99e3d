package train_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"testing"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
	"github.com/b7ea7098/loom/train"
)

// TestWindowsShardSequence: with the sequence sharded over cp, each rank's
// block of a batch holds its data-parallel rows' tokens at exactly its
// sequence positions (balanced: chunks r and 2k−1−r of 2k, uneven ones
// included; plain: a contiguous block), inputs and targets alike, and the
// ids' layout says so (its Positions are those positions).
func TestWindowsShardSequence(t *testing.T) {
	text := corpus(600)
	path := writeFile(t, "input.txt", text)
	const batch = 4
	for _, c := range []struct {
		name     string
		shape    []int
		T        int
		balanced bool
		want     map[int][]int // cp coordinate: its positions (nil: not checked)
	}{
		{"dp=2,cp=2 balanced", []int{2, 2}, 8, true, map[int][]int{0: {0, 1, 6, 7}, 1: {2, 3, 4, 5}}},
		{"dp=2,cp=2 plain", []int{2, 2}, 8, false, map[int][]int{0: {0, 1, 2, 3}, 1: {4, 5, 6, 7}}},
		{"dp=1,cp=3 balanced T=7", []int{1, 3}, 7, true, map[int][]int{0: {0, 1, 6}, 1: {2, 3, 5}, 2: {4}}},
	} {
		t.Run(c.name, func(t *testing.T) {
			f, err := train.OpenTokens(path, 256)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			placementtest.Run(t, c.shape, []string{"dp", "cp"}, func(ctx context.Context, m *mesh.Mesh) error {
				all, err := train.NewWindows(f, c.T, m, "dp")
				if err != nil {
					return err
				}
				w, err := all.ShardSequence("cp", c.balanced)
				if err != nil {
					return err
				}
				s, err := w.Sampler(batch, train.WithShuffle(1))
				if err != nil {
					return err
				}
				me, err := m.Local("cp")
				if err != nil {
					return err
				}
				for range 3 {
					smp := s.Next()
					b, err := w.Batch(ctx, smp)
					if err != nil {
						return err
					}
					spec, err := placement.NewSpec(m, b.X.Shape(), comm.Float32, b.X.Placements())
					if err != nil {
						return err
					}
					pos, err := spec.Positions(1, m.Rank())
					if err != nil {
						return err
					}
					if want := c.want[me]; !slices.Equal(pos, want) {
						return fmt.Errorf("cp rank %d holds positions %v, want %v", me, pos, want)
					}
					xs, ys := b.X.Local(), b.Y.Local()
					n := len(pos)
					if len(xs) != len(smp.Rows)*n || len(ys) != len(xs) {
						return fmt.Errorf("blocks of %d and %d ids for %d rows of %d positions", len(xs), len(ys), len(smp.Rows), n)
					}
					for i, r := range smp.Rows {
						x, y := windowRef(text, 0, r, c.T)
						for j, p := range pos {
							if xs[i*n+j] != x[p] || ys[i*n+j] != y[p] {
								return fmt.Errorf("step %d row %d position %d: input %d target %d, want %d %d", smp.Index, r, p, xs[i*n+j], ys[i*n+j], x[p], y[p])
							}
						}
					}
				}
				return nil
			})
		})
	}
}

// ShardSequence refuses an axis that is not a mesh axis or that already
// shards the batch.
func TestWindowsShardSequenceRefused(t *testing.T) {
	f, err := train.OpenTokens(writeFile(t, "input.txt", corpus(100)), 256)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	placementtest.Run(t, []int{2}, []string{"dp"}, func(ctx context.Context, m *mesh.Mesh) error {
		w, err := train.NewWindows(f, 8, m, "dp")
		if err != nil {
			return err
		}
		for _, axis := range []string{"cp", "dp"} {
			if _, err := w.ShardSequence(axis, true); !errors.Is(err, train.ErrInvalid) {
				return fmt.Errorf("ShardSequence(%q): %v, want ErrInvalid", axis, err)
			}
		}
		return nil
	})
}
