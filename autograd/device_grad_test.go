package autograd_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/device/emu"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// deviceLeaf returns a recycling tape on a fresh emulated device and a
// 64×64 float32 leaf "w" on it, for the gradient-ownership tests.
func deviceLeaf(m *mesh.Mesh, recycling bool) (*emu.Device, *autograd.Tape, *autograd.Value, error) {
	d, err := emu.New(0)
	if err != nil {
		return nil, nil, nil, err
	}
	opts := []autograd.Option{autograd.WithDevice(d)}
	if recycling {
		opts = append(opts, autograd.WithRecycling())
	}
	tape := autograd.NewTape(opts...)
	w, err := randTensor(m, []int{64, 64}, 2)
	if err == nil {
		w, err = w.To(d)
	}
	if err != nil {
		d.Close()
		return nil, nil, nil, err
	}
	wv, err := tape.Param("w", w)
	return d, tape, wv, err
}

// squareSum records sum(w·w) and runs its backward.
func squareSum(ctx context.Context, tape *autograd.Tape, w *autograd.Value) error {
	y, err := autograd.Mul(w, w)
	if err != nil {
		return err
	}
	loss, err := autograd.Sum(y)
	if err != nil {
		return err
	}
	return tape.Backward(ctx, loss)
}

// TestDeviceGradOwnership: the ways of dropping or replacing a leaf's
// gradient and the memory kept for it free the device memory the leaf
// owns, so the device's allocation stays flat over steps (device memory
// has no garbage collector).
func TestDeviceGradOwnership(t *testing.T) {
	const block = 64 * 64 * 4
	cases := []struct {
		name string
		// drop lets go of the gradient of a step.
		drop func(w *autograd.Value) error
	}{
		{"SetGrad(nil)", func(w *autograd.Value) error { return w.SetGrad(nil) }},
		{"ZeroGrad", func(w *autograd.Value) error { w.ZeroGrad(); return nil }},
		{"ReleaseGrad then KeepGradBuffer", func(w *autograd.Value) error {
			b, ok := w.ReleaseGrad().(device.Buffer)
			if !ok {
				return fmt.Errorf("ReleaseGrad gave no device buffer")
			}
			w.KeepGradBuffer(b)
			return nil
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			placementtest.Run(t, []int{1}, []string{"x"}, func(ctx context.Context, m *mesh.Mesh) error {
				d, tape, w, err := deviceLeaf(m, true)
				if err != nil {
					return err
				}
				defer d.Close()
				var alloc []int64
				for range 4 {
					if err := squareSum(ctx, tape, w); err != nil {
						return err
					}
					tape.Recycle()
					if err := tc.drop(w); err != nil {
						return err
					}
					alloc = append(alloc, d.Memory().Stats().Allocated)
				}
				if alloc[3] != alloc[1] {
					t.Errorf("device memory after each step %v: grows", alloc)
				}
				return nil
			})
		})
	}
	// A spare the leaf owns (ZeroGrad's on a recycling tape) is freed when
	// KeepGradBuffer replaces it and ReleaseGrad hands the leaf's memory
	// back: after the caller frees what it gave, nothing is left.
	placementtest.Run(t, []int{1}, []string{"x"}, func(ctx context.Context, m *mesh.Mesh) error {
		d, tape, w, err := deviceLeaf(m, true)
		if err != nil {
			return err
		}
		defer d.Close()
		if err := squareSum(ctx, tape, w); err != nil {
			return err
		}
		tape.Recycle()
		w.ZeroGrad() // the leaf keeps its gradient's memory as its own spare
		before := d.Memory().Stats().Allocated
		nb, err := d.Alloc(comm.Float32, 64*64)
		if err != nil {
			return err
		}
		w.KeepGradBuffer(nb) // replaces (and frees) the old spare; the leaf owns nb
		if got := w.ReleaseGrad(); got != nil {
			return fmt.Errorf("ReleaseGrad without a gradient = %T", got)
		}
		if after := d.Memory().Stats().Allocated; after != before-block {
			t.Errorf("allocated %d after KeepGradBuffer and ReleaseGrad, want %d (both spares freed)", after, before-block)
		}
		return nil
	})
}

// TestDeviceSetGradOtherDevice: SetGrad refuses a gradient on another
// device than its value's, before anything changes.
func TestDeviceSetGradOtherDevice(t *testing.T) {
	placementtest.Run(t, []int{1}, []string{"x"}, func(ctx context.Context, m *mesh.Mesh) error {
		d, _, w, err := deviceLeaf(m, false)
		if err != nil {
			return err
		}
		defer d.Close()
		host, err := randTensor(m, []int{64, 64}, 3)
		if err != nil {
			return err
		}
		err = w.SetGrad(host)
		if !errors.Is(err, autograd.ErrInvalid) || !errors.Is(err, device.ErrMixed) || !strings.Contains(err.Error(), "emu:0") {
			t.Errorf("SetGrad(host gradient) for a value on emu:0 = %v; want ErrInvalid and ErrMixed naming the devices", err)
		}
		if w.Grad() != nil {
			t.Errorf("the refused gradient was installed")
		}
		return nil
	})
}

// TestCheckGradRefusesDevice: finite differences perturb host blocks, so
// CheckGrad refuses a parameter on a device with ErrInvalid (it panicked).
func TestCheckGradRefusesDevice(t *testing.T) {
	placementtest.Run(t, []int{1}, []string{"x"}, func(ctx context.Context, m *mesh.Mesh) error {
		d, err := emu.New(0)
		if err != nil {
			return err
		}
		defer d.Close()
		spec, err := placement.NewSpec(m, []int{3}, comm.Float64, []placement.Placement{placement.Replicate()})
		if err != nil {
			return err
		}
		h, err := placement.FromFull(spec, []float64{1, 2, 3})
		if err != nil {
			return err
		}
		on, err := h.To(d)
		if err != nil {
			return err
		}
		err = autograd.CheckGrad(ctx, func(tp *autograd.Tape, in []*autograd.Value) (*autograd.Value, error) {
			x, err := autograd.To(in[0], device.Host())
			if err != nil {
				return nil, err
			}
			return autograd.Sum(x)
		}, on)
		if !errors.Is(err, autograd.ErrInvalid) || !strings.Contains(err.Error(), "emu:0") {
			t.Errorf("CheckGrad of a parameter on emu:0 = %v; want ErrInvalid naming the device", err)
		}
		return nil
	})
}
