package checkpoint

import (
	"context"
	"os"
	"path/filepath"
	"slices"
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

// BenchmarkAsyncSave saves the 128 MiB model of BenchmarkSave from tp=2
// in-process ranks, in each round once with Save and once with a Saver,
// and reports the medians of Save's time, of the time Saver.Save blocked
// its caller, their ratio (blocked/sync), and the peak host bytes one
// rank's snapshot held (64 MiB unbounded), without a memory bound and
// with one of 16 MiB.
func BenchmarkAsyncSave(b *testing.B) {
	for _, limit := range []int{0, 16 << 20} {
		b.Run(map[int]string{0: "unbounded", 16 << 20: "16MiB"}[limit], func(b *testing.B) { benchAsync(b, limit) })
	}
}

func benchAsync(b *testing.B, limit int) {
	const tensors, rows, cols = 8, 1024, 4096 // 16 MiB each
	defs := map[string]tdef{}
	for i := range tensors {
		defs[string(rune('a'+i))] = tdef{shape: []int{rows, cols}, dtype: comm.Float32, seed: uint64(i)}
	}
	dir := b.TempDir()
	var syncs, blocks []time.Duration
	var peak int64
	for i := 0; b.Loop(); i++ {
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
			if _, err := Save(ctx, filepath.Join(dir, "sync"), st, WithStep(i)); err != nil {
				return err
			}
			d := time.Since(t0)
			sv, err := NewSaver(filepath.Join(dir, "async"), WithMemoryLimit(limit))
			if err != nil {
				return err
			}
			if err := comm.Barrier(ctx, m.World()); err != nil {
				return err
			}
			a, err := sv.Save(ctx, st, WithStep(i))
			if err != nil {
				return err
			}
			if m.Rank() == 0 {
				syncs, blocks = append(syncs, d), append(blocks, a.Blocked())
				peak = max(peak, a.PeakBytes())
			}
			return sv.Close()
		})
		if err != nil {
			b.Fatal(err)
		}
		os.RemoveAll(filepath.Join(dir, "sync"))
		os.RemoveAll(filepath.Join(dir, "async"))
	}
	med := func(ds []time.Duration) time.Duration {
		ds = slices.Clone(ds)
		slices.Sort(ds)
		return ds[len(ds)/2]
	}
	b.ReportMetric(float64(med(syncs))/1e6, "sync-ms")
	b.ReportMetric(float64(med(blocks))/1e6, "blocked-ms")
	b.ReportMetric(float64(med(blocks))/float64(med(syncs)), "ratio")
	b.ReportMetric(float64(peak), "peak-B")
}
