package train_test

import (
	"context"
	"fmt"
	"slices"
	"testing"

	"github.com/b7ea7098/loom/checkpoint"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
	"github.com/b7ea7098/loom/train"
)

// The data's position under context parallelism: a Sampler of windows
// whose sequence is sharded over cp (ShardSequence, load balanced) saved
// after 3 batches on dp=2 × cp=2 and loaded (checkpoint.LoadJob) on one
// rank and on dp=1 × cp=3 draws the batch the saving run would have drawn
// next, each rank holding its own positions of its rows.
func TestSamplerResumesUnderContextParallelism(t *testing.T) {
	text := corpus(600)
	path := writeFile(t, "input.txt", text)
	f, err := train.OpenTokens(path, 256)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	const batch, T = 4, 12
	// sampler builds the sampler of balanced sequence shards on m.
	sampler := func(m *mesh.Mesh) (*train.Windows, *train.Sampler, error) {
		w, err := train.NewWindows(f, T, m, "dp")
		if err != nil {
			return nil, nil, err
		}
		if cp, _ := m.AxisSize("cp"); cp > 1 {
			if w, err = w.ShardSequence("cp", true); err != nil {
				return nil, nil, err
			}
		}
		s, err := w.Sampler(batch, train.WithShuffle(9))
		return w, s, err
	}
	// The straight run's fourth batch.
	var want []int
	placementtest.Run(t, []int{1, 1}, []string{"dp", "cp"}, func(ctx context.Context, m *mesh.Mesh) error {
		_, s, err := sampler(m)
		for range 4 {
			want = s.Next().Global
		}
		return err
	})
	root := t.TempDir()
	placementtest.Run(t, []int{2, 2}, []string{"dp", "cp"}, func(ctx context.Context, m *mesh.Mesh) error {
		_, s, err := sampler(m)
		if err != nil {
			return err
		}
		for range 3 {
			s.Next()
		}
		st, err := checkpoint.JobState(3, checkpoint.Parts{"data": s}, nil)
		if err != nil {
			return err
		}
		_, err = checkpoint.Save(ctx, root, st, checkpoint.WithComm(m.World()))
		return err
	})
	dir, err := checkpoint.Latest(root)
	if err != nil {
		t.Fatal(err)
	}
	for _, shape := range [][]int{{1, 1}, {1, 3}} {
		t.Run(fmt.Sprintf("dp=%d×cp=%d", shape[0], shape[1]), func(t *testing.T) {
			placementtest.Run(t, shape, []string{"dp", "cp"}, func(ctx context.Context, m *mesh.Mesh) error {
				w, s, err := sampler(m)
				if err != nil {
					return err
				}
				if _, _, err := checkpoint.LoadJob(ctx, dir, checkpoint.Parts{"data": s}, checkpoint.WithComm(m.World())); err != nil {
					return err
				}
				smp := s.Next()
				if !slices.Equal(smp.Global, want) {
					return fmt.Errorf("resumed batch rows %v, want %v", smp.Global, want)
				}
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
				xs, n := b.X.Local(), len(pos)
				for i, r := range smp.Rows {
					x, _ := windowRef(text, 0, r, T)
					for j, p := range pos {
						if xs[i*n+j] != x[p] {
							return fmt.Errorf("row %d position %d: input %d, want %d", r, p, xs[i*n+j], x[p])
						}
					}
				}
				return nil
			})
		})
	}
}
