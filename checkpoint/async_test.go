package checkpoint

import (
	"context"
	"errors"
	"fmt"
	"math"
	"os"
	"slices"
	"strings"
	"testing"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/device/emu"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// clobber overwrites a tensor's local block with NaNs, in place, on the
// host or on its device: what a training step does to saved state.
func clobber(x *placement.DTensor) error {
	switch d := x.LocalData().(type) {
	case []float32:
		for i := range d {
			d[i] = float32(math.NaN())
		}
	case []float64:
		for i := range d {
			d[i] = math.NaN()
		}
	case device.Buffer:
		n := prod(x.LocalShape())
		var h *comm.HostBuffer
		if x.Spec().DType() == comm.Float64 {
			h = comm.Host(make([]float64, n))
		} else {
			h = comm.Host(make([]float32, n))
		}
		return x.Device().CopyFromHost(d, h)
	}
	return nil
}

// TestAsyncSave saves with a Saver on several layouts, memory bounds and
// devices, overwrites every tensor as soon as Save returns, and loads the
// checkpoint: it holds the values at the time of Save, bit for bit.
// Unbounded, the writer is held before its first file operation until the
// tensors are overwritten, so that nothing is written from them early. The
// blocked time is reported; the peak of host memory is within the bound
// (host blocks) and at most the rank's chunk bytes.
func TestAsyncSave(t *testing.T) {
	cases := []struct {
		name  string
		lay   meshLayout
		limit int
		emu   bool
	}{
		{"dp2×tp2 unbounded", dp2tp2, 0, false},
		{"tp3 in 12-byte pieces", tp3, 12, false},
		{"5 ranks in 1-byte pieces", five, 1, false},
		{"dp2×tp2 on devices", dp2tp2, 0, true},
		{"tp3 on devices, bound 8", tp3, 8, true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			root := t.TempDir()
			var opts []placementtest.Option
			if c.emu {
				opts = append(opts, placementtest.WithDevice(func(rank int) (device.Device, error) { return emu.New(rank) }))
			}
			paths := make([]string, 2)
			size := prod(c.lay.shape)
			gates := make([][]chan struct{}, 2)
			for round := range gates {
				gates[round] = make([]chan struct{}, size)
				for r := range size {
					gates[round][r] = make(chan struct{})
				}
			}
			simulate(t, c.lay.shape, c.lay.axes, func(ctx context.Context, m *mesh.Mesh) error {
				round := 0
				hook := func(ev event) {
					if c.limit == 0 && ev.Op == "create" {
						<-gates[round][ev.Rank]
					}
				}
				sv, err := NewSaver(root, WithMemoryLimit(c.limit), WithBlockSize(8), withHook(hook))
				if err != nil {
					return err
				}
				for defs := range slices.Values([]map[string]tdef{testTensors, step2Tensors()}) {
					specs, err := specsOn(m, defs, c.lay.lay)
					if err != nil {
						return err
					}
					st, err := stateOn(specs, defs)
					if err != nil {
						return err
					}
					for n, x := range st.Tensors {
						if st.Tensors[n], err = x.To(placementtest.Device(ctx)); err != nil {
							return err
						}
					}
					a, err := sv.Save(ctx, st, WithStep(round))
					if err != nil {
						return err
					}
					for _, x := range st.Tensors {
						if err := clobber(x); err != nil {
							return err
						}
					}
					close(gates[round][m.Rank()])
					if a.Blocked() <= 0 {
						return fmt.Errorf("blocked %v", a.Blocked())
					}
					if c.limit > 0 && !c.emu && a.PeakBytes() > int64(c.limit) {
						return fmt.Errorf("peak %d bytes over the bound %d", a.PeakBytes(), c.limit)
					}
					p, err := a.Wait()
					if err != nil {
						return err
					}
					if m.Rank() == 0 {
						paths[round] = p
					}
					round++
				}
				return sv.Close()
			}, opts...)
			for round, defs := range []map[string]tdef{testTensors, step2Tensors()} {
				if err := loadCheck(paths[round], defs); err != nil {
					t.Fatalf("save %d: %v", round, err)
				}
			}
		})
	}
}

// TestAsyncPeak: unbounded, a rank's peak is all the bytes it writes;
// bounded by a chunk's size, it holds one chunk at a time at most.
func TestAsyncPeak(t *testing.T) {
	defs := map[string]tdef{
		"a": {shape: []int{64}, dtype: comm.Float32, seed: 1},
		"b": {shape: []int{64}, dtype: comm.Float32, seed: 2},
		"c": {shape: []int{64}, dtype: comm.Float32, seed: 3},
	}
	for _, c := range []struct {
		limit, want int64
	}{{0, 3 * 256}, {256, 256}, {100, 100}} {
		t.Run(fmt.Sprint(c.limit), func(t *testing.T) {
			simulate(t, []int{1}, []string{"x"}, func(ctx context.Context, m *mesh.Mesh) error {
				specs, err := specsOn(m, defs, allReplicated(1))
				if err != nil {
					return err
				}
				st, err := stateOn(specs, defs)
				if err != nil {
					return err
				}
				sv, err := NewSaver(t.TempDir(), WithMemoryLimit(int(c.limit)))
				if err != nil {
					return err
				}
				a, err := sv.Save(ctx, st)
				if err != nil {
					return err
				}
				if err := sv.Close(); err != nil {
					return err
				}
				if c.limit == 0 && a.PeakBytes() != c.want || c.limit > 0 && (a.PeakBytes() > c.want || a.PeakBytes() < c.want/2) {
					return fmt.Errorf("peak %d bytes, want %d", a.PeakBytes(), c.want)
				}
				return nil
			})
		})
	}
}

// TestAsyncError: a background save that fails (its staging folder
// removed under it) fails Wait on every rank; the next Save returns that
// error and starts nothing; Close returns it too; and the folder holds no
// checkpoint.
func TestAsyncError(t *testing.T) {
	root := t.TempDir()
	simulate(t, tp3.shape, tp3.axes, func(ctx context.Context, m *mesh.Mesh) error {
		hook := func(ev event) {
			if ev.Op == "create" && ev.Rank == 1 {
				_ = os.RemoveAll(strings.TrimSuffix(ev.Path, "/"+fileName(1)+".tmp"))
			}
		}
		sv, err := NewSaver(root, withHook(hook))
		if err != nil {
			return err
		}
		specs, err := specsOn(m, testTensors, tp3.lay)
		if err != nil {
			return err
		}
		st, err := stateOn(specs, testTensors)
		if err != nil {
			return err
		}
		a, err := sv.Save(ctx, st)
		if err != nil {
			return err
		}
		<-a.Done()
		_, werr := a.Wait()
		if werr == nil {
			return errors.New("the save succeeded without its staging folder")
		}
		if _, err := sv.Save(ctx, st); err == nil || err.Error() != werr.Error() {
			return fmt.Errorf("the next Save returned %v, want the previous save's %v", err, werr)
		}
		if err := sv.Close(); err == nil || err.Error() != werr.Error() {
			return fmt.Errorf("Close returned %v, want %v", err, werr)
		}
		if err := sv.Close(); err != nil {
			return fmt.Errorf("a second Close returned %v", err)
		}
		return nil
	})
	if _, err := Latest(root); !errors.Is(err, ErrNotFound) {
		t.Fatalf("Latest after the failed save: %v, want ErrNotFound", err)
	}
}

// TestSaverRefuses: a memory bound is an option of the Saver only, and a
// negative one is refused.
func TestSaverRefuses(t *testing.T) {
	for _, c := range []struct {
		name string
		err  func() error
		says string
	}{
		{"Save takes no bound", func() error {
			_, err := Save(context.Background(), t.TempDir(), State{}, WithMemoryLimit(1))
			return err
		}, "WithMemoryLimit is not an option of Save"},
		{"negative bound", func() error { _, err := NewSaver(t.TempDir(), WithMemoryLimit(-1)); return err }, "memory limit -1"},
		{"load option", func() error { _, err := NewSaver(t.TempDir(), WithDevice(nil)); return err }, "WithDevice is not an option of NewSaver"},
	} {
		t.Run(c.name, func(t *testing.T) {
			err := c.err()
			if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), c.says) {
				t.Fatalf("got %v, want ErrInvalid saying %q", err, c.says)
			}
		})
	}
}
