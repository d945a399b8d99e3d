package checkpoint

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
)

// BenchmarkSave saves 128 MiB of float32 tensors from tp=2 in-process
// ranks (8 tensors of 16 MiB, each sharded, 64 MiB a rank) and, in the
// same run and folder, writes and fsyncs one sequential file of the same
// size; it reports both rates and their ratio (save/sequential).
func BenchmarkSave(b *testing.B) {
	const tensors, rows, cols = 8, 1024, 4096 // 16 MiB each
	defs := map[string]tdef{}
	for i := range tensors {
		defs[string(rune('a'+i))] = tdef{shape: []int{rows, cols}, dtype: comm.Float32, seed: uint64(i)}
	}
	total := float64(tensors * rows * cols * 4)
	dir := b.TempDir()
	buf := make([]byte, int(total))
	var save, seq time.Duration
	for i := 0; b.Loop(); i++ {
		root := filepath.Join(dir, "ckpt")
		err := simulateErr([]int{2}, []string{"tp"}, func(ctx context.Context, m *mesh.Mesh) error {
			specs, err := specsOn(m, defs, func(*mesh.Mesh, string, tdef) ([]placement.Placement, []placement.SpecOption) {
				return []placement.Placement{S0}, nil
			})
			if err != nil {
				return err
			}
			st, err := stateOn(specs, defs)
			if err != nil {
				return err
			}
			if err := comm.Barrier(ctx, m.World()); err != nil {
				return err
			}
			t0 := time.Now()
			_, err = Save(ctx, root, st, WithStep(i))
			if m.Rank() == 0 {
				save += time.Since(t0)
			}
			return err
		})
		if err != nil {
			b.Fatal(err)
		}
		os.RemoveAll(root)
		t0 := time.Now()
		f, err := os.Create(filepath.Join(dir, "seq"))
		if err != nil {
			b.Fatal(err)
		}
		if _, err := f.Write(buf); err != nil {
			b.Fatal(err)
		}
		if err := f.Sync(); err != nil {
			b.Fatal(err)
		}
		f.Close()
		seq += time.Since(t0)
		os.Remove(filepath.Join(dir, "seq"))
	}
	n := float64(b.N)
	b.ReportMetric(total*n/save.Seconds()/(1<<20), "save-MiB/s")
	b.ReportMetric(total*n/seq.Seconds()/(1<<20), "seq-MiB/s")
	b.ReportMetric(seq.Seconds()/save.Seconds(), "ratio")
}
