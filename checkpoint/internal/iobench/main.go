// Command iobench measures checkpoint I/O on this machine, for the
// closing note of issue 29: it saves a model of -mb MiB of float32
// tensors (row-sharded over -ranks in-process ranks, each rank writing its
// own chunks) into -dir, and in the same run and folder writes and fsyncs
// one sequential file of the same size (what dd conv=fsync does), and
// saves the model with a background checkpoint.Saver. The sequential
// file's bytes are real data, like the model's (a buffer never written
// holds the zero page, which the kernel copies from cache in about half
// the time), and every timed write starts after a sync(2), so that none
// pays for the dirty pages, or the discards of removed files, that the
// one before it left (the root file system here mounts with discard,
// which a later journal commit carries out). Over -rounds
// rounds it prints the medians of the save's bandwidth, the sequential
// write's and their ratio; of the time a synchronous save takes and the
// time the background save blocks training (and their ratio); and the
// peak of extra host memory during the background save (the snapshot the
// Saver reports and the Go heap's growth over the heap that holds the
// model). It
// prints the load average next to the CPU count and says when the machine
// is loaded, since the numbers are then not the disk's.
//
//	go run ./checkpoint/internal/iobench -dir /tmp/ck -mb 128 -rounds 5
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/b7ea7098/loom/checkpoint"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

func main() {
	if err := run(os.Args[1:], os.Stdout); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return
		}
		fmt.Fprintln(os.Stderr, "iobench:", err)
		os.Exit(1)
	}
}

type options struct {
	dir            string
	mb, ranks, nrd int
}

func run(args []string, out io.Writer) error {
	var o options
	fs := flag.NewFlagSet("iobench", flag.ContinueOnError)
	fs.StringVar(&o.dir, "dir", os.TempDir(), "the folder to write in (a checkpoint root and the sequential file)")
	fs.IntVar(&o.mb, "mb", 128, "the model's size in MiB (float32 tensors of 16 MiB)")
	fs.IntVar(&o.ranks, "ranks", 2, "in-process ranks the tensors are sharded over")
	fs.IntVar(&o.nrd, "rounds", 5, "rounds; medians are printed")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if o.mb < 16 || o.ranks < 1 || o.nrd < 1 {
		return fmt.Errorf("-mb %d (at least 16), -ranks %d, -rounds %d (at least 1)", o.mb, o.ranks, o.nrd)
	}
	dir, err := os.MkdirTemp(o.dir, "iobench-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	fmt.Fprintln(out, loadLine())
	const rows, cols = 1024, 4096 // 16 MiB
	n := o.mb / 16
	total := float64(n * rows * cols * 4)
	fmt.Fprintf(out, "model: %d tensors [%d, %d] float32 = %.0f MiB, row-sharded over %d in-process ranks; folder %s\n", n, rows, cols, total/(1<<20), o.ranks, dir)

	var (
		saves, seqs, syncs, blocks []time.Duration
		peakSnap, peakHeap         int64
	)
	buf := make([]byte, int(total))
	for i := range buf {
		buf[i] = byte(i*7 + i>>12)
	}
	for r := range o.nrd {
		settle()
		seq, err := sequential(filepath.Join(dir, "seq"), buf)
		if err != nil {
			return err
		}
		seqs = append(seqs, seq)
		var mu sync.Mutex
		err = placementtest.Simulate(context.Background(), []int{o.ranks}, []string{"x"}, func(ctx context.Context, m *mesh.Mesh) error {
			st, err := model(m, n, rows, cols)
			if err != nil {
				return err
			}
			// Sync save.
			if m.Rank() == 0 {
				settle()
			}
			if err := comm.Barrier(ctx, m.World()); err != nil {
				return err
			}
			t0 := time.Now()
			if _, err := checkpoint.Save(ctx, filepath.Join(dir, "sync"), st, checkpoint.WithStep(r)); err != nil {
				return err
			}
			if err := comm.Barrier(ctx, m.World()); err != nil {
				return err
			}
			d := time.Since(t0)
			// Background save, with the heap sampled while it runs.
			sv, err := checkpoint.NewSaver(filepath.Join(dir, "async"))
			if err != nil {
				return err
			}
			var heap atomic.Int64
			stop := make(chan struct{})
			done := make(chan struct{})
			if err := comm.Barrier(ctx, m.World()); err != nil {
				return err
			}
			if m.Rank() == 0 {
				// The baseline holds every rank's model: what grows
				// after it is the save's.
				var base runtime.MemStats
				runtime.GC()
				runtime.ReadMemStats(&base)
				go sample(&base, &heap, stop, done)
			} else {
				close(done)
			}
			if err := comm.Barrier(ctx, m.World()); err != nil {
				return err
			}
			a, err := sv.Save(ctx, st, checkpoint.WithStep(r))
			if err != nil {
				return err
			}
			err = sv.Close()
			close(stop)
			<-done
			if m.Rank() == 0 {
				mu.Lock()
				syncs, saves = append(syncs, d), append(saves, d)
				blocks = append(blocks, a.Blocked())
				peakSnap = max(peakSnap, a.PeakBytes())
				peakHeap = max(peakHeap, heap.Load())
				mu.Unlock()
			}
			return err
		})
		if err != nil {
			return err
		}
		for _, sub := range []string{"sync", "async"} {
			if err := os.RemoveAll(filepath.Join(dir, sub)); err != nil {
				return err
			}
		}
	}
	mbps := func(d time.Duration) float64 { return total / d.Seconds() / (1 << 20) }
	save, seq := median(saves), median(seqs)
	fmt.Fprintf(out, "medians of %d rounds:\n", o.nrd)
	fmt.Fprintf(out, "  save %.0f MiB/s (%v), sequential write+fsync %.0f MiB/s (%v): %.0f%% of sequential\n",
		mbps(save), save.Round(time.Millisecond), mbps(seq), seq.Round(time.Millisecond), 100*seq.Seconds()/save.Seconds())
	sy, bl := median(syncs), median(blocks)
	fmt.Fprintf(out, "  async save blocked training %v, the sync save took %v: %.1f%%\n", bl.Round(time.Microsecond), sy.Round(time.Millisecond), 100*bl.Seconds()/sy.Seconds())
	fmt.Fprintf(out, "  peak extra host memory of the async save: snapshot %.1f MiB on rank 0 (%.1f MiB for all %d ranks); Go heap growth over the baseline %.1f MiB\n",
		float64(peakSnap)/(1<<20), float64(peakSnap)*float64(o.ranks)/(1<<20), o.ranks, float64(peakHeap)/(1<<20))
	fmt.Fprintln(out, loadLine())
	return nil
}

// model is this rank's shards of n tensors [rows, cols], row-sharded.
func model(m *mesh.Mesh, n, rows, cols int) (checkpoint.State, error) {
	st := checkpoint.State{Tensors: map[string]*placement.DTensor{}}
	for i := range n {
		s, err := placement.NewSpec(m, []int{rows, cols}, comm.Float32, []placement.Placement{placement.Shard(0)})
		if err != nil {
			return st, err
		}
		local := make([]float32, s.LocalShape()[0]*cols)
		for j := range local {
			local[j] = float32(i*7+j) * 0.25
		}
		t, err := placement.NewLocal(s, local)
		if err != nil {
			return st, err
		}
		st.Tensors["w"+strconv.Itoa(i)] = t
	}
	return st, nil
}

// sequential writes buf to path and fsyncs it, as dd conv=fsync would.
func sequential(path string, buf []byte) (time.Duration, error) {
	t0 := time.Now()
	f, err := os.Create(path)
	if err != nil {
		return 0, err
	}
	if _, err := f.Write(buf); err != nil {
		return 0, errors.Join(err, f.Close())
	}
	if err := f.Sync(); err != nil {
		return 0, errors.Join(err, f.Close())
	}
	if err := f.Close(); err != nil {
		return 0, err
	}
	d := time.Since(t0)
	return d, os.Remove(path)
}

// sample records the Go heap's largest growth over base until stop.
func sample(base *runtime.MemStats, peak *atomic.Int64, stop, done chan struct{}) {
	defer close(done)
	var ms runtime.MemStats
	for {
		runtime.ReadMemStats(&ms)
		if d := int64(ms.HeapAlloc) - int64(base.HeapAlloc); d > peak.Load() {
			peak.Store(d)
		}
		select {
		case <-stop:
			return
		case <-time.After(2 * time.Millisecond):
		}
	}
}

func median(ds []time.Duration) time.Duration {
	s := slices.Sorted(slices.Values(ds))
	return s[len(s)/2]
}

// loadLine is the 1-minute load average against the CPUs, saying whether
// the machine is loaded (load above half the CPUs).
func loadLine() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return fmt.Sprintf("load average unknown (%v); %d CPUs", err, runtime.NumCPU())
	}
	f := strings.Fields(string(b))
	load, _ := strconv.ParseFloat(f[0], 64)
	s := fmt.Sprintf("load average %.2f on %d CPUs", load, runtime.NumCPU())
	if load > float64(runtime.NumCPU())/2 {
		s += ": the machine is loaded (other work competes for the CPUs and the disk), so these numbers understate it"
	}
	return s
}
