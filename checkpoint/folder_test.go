package checkpoint

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/device/emu"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// TestLocked: a folder whose lock another writer holds is refused on every
// rank with ErrLocked naming the holder, and nothing is written; once the
// holder lets go, the save goes through.
func TestLocked(t *testing.T) {
	root := t.TempDir()
	other, err := acquire("test", root, 99)
	if err != nil {
		t.Fatal(err)
	}
	err = simulateErr(tp3.shape, tp3.axes, func(ctx context.Context, m *mesh.Mesh) error {
		specs, err := specsOn(m, testTensors, tp3.lay)
		if err != nil {
			return err
		}
		st, err := stateOn(specs, testTensors)
		if err != nil {
			return err
		}
		_, err = Save(ctx, root, st)
		want := fmt.Sprintf("pid %d on ", os.Getpid())
		if !errors.Is(err, ErrLocked) || !strings.Contains(err.Error(), want) || !strings.Contains(err.Error(), "saving step 99") {
			return fmt.Errorf("got %v, want ErrLocked naming %q", err, want)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if ents, _ := os.ReadDir(root); len(ents) != 1 || ents[0].Name() != lockName {
		t.Errorf("the refused save left %v", ents)
	}
	other.release()
	saveOn(t, root, tp3, testTensors)
}

// TestKeepAndLatest saves five checkpoints keeping three: the oldest two
// are gone, Latest is the newest, steps count on from the newest without
// WithStep, and an existing step is refused.
func TestKeepAndLatest(t *testing.T) {
	root := t.TempDir()
	if _, err := Latest(root); !errors.Is(err, ErrNotFound) {
		t.Fatalf("Latest of an empty folder: %v, want ErrNotFound", err)
	}
	if _, err := Latest(filepath.Join(root, "nope")); !errors.Is(err, ErrNotFound) {
		t.Fatalf("Latest of a missing folder: %v, want ErrNotFound", err)
	}
	for i := range 5 {
		opts := []Option{WithKeep(3)}
		if i == 0 {
			opts = append(opts, WithStep(10))
		}
		saveOn(t, root, tp2, testTensors, opts...)
	}
	var got []string
	ents, _ := os.ReadDir(root)
	for _, e := range ents {
		got = append(got, e.Name())
	}
	want := []string{lockName, stepName(12), stepName(13), stepName(14)}
	if !slices.Equal(got, want) {
		t.Errorf("folder holds %v, want %v", got, want)
	}
	if p, err := Latest(root); err != nil || p != filepath.Join(root, stepName(14)) {
		t.Errorf("Latest: %s, %v", p, err)
	}
	err := simulateErr(tp2.shape, tp2.axes, func(ctx context.Context, m *mesh.Mesh) error {
		specs, _ := specsOn(m, testTensors, tp2.lay)
		st, _ := stateOn(specs, testTensors)
		if _, err := Save(ctx, root, st, WithStep(13)); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "already exists") {
			return fmt.Errorf("saving an existing step: %v, want ErrInvalid", err)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// TestEmulatedDevice saves tensors whose blocks live on emulated devices
// and loads them onto emulated devices on another layout, bit for bit.
func TestEmulatedDevice(t *testing.T) {
	root := t.TempDir()
	onEmu := placementtest.WithDevice(func(rank int) (device.Device, error) { return emu.New(rank) })
	var path string
	simulate(t, dp2tp2.shape, dp2tp2.axes, func(ctx context.Context, m *mesh.Mesh) error {
		specs, err := specsOn(m, testTensors, dp2tp2.lay)
		if err != nil {
			return err
		}
		st, err := stateOn(specs, testTensors)
		if err != nil {
			return err
		}
		dev := placementtest.Device(ctx)
		for n, x := range st.Tensors {
			if st.Tensors[n], err = x.To(dev); err != nil {
				return err
			}
			if st.Tensors[n].Device() != dev {
				return fmt.Errorf("%s is on %s", n, st.Tensors[n].Device().Name())
			}
		}
		p, err := Save(ctx, root, st)
		if m.Rank() == 0 {
			path = p
		}
		return err
	}, onEmu)
	simulate(t, tp3.shape, tp3.axes, func(ctx context.Context, m *mesh.Mesh) error {
		specs, err := specsOn(m, testTensors, tp3.lay)
		if err != nil {
			return err
		}
		dev := placementtest.Device(ctx)
		st, err := Load(ctx, path, specs, WithDevice(dev))
		if err != nil {
			return err
		}
		for _, n := range slices.Sorted(maps.Keys(st.Tensors)) {
			x := st.Tensors[n]
			if x.Device() != dev {
				return fmt.Errorf("%s loaded onto %s, want %s", n, x.Device().Name(), dev.Name())
			}
			full, err := x.Full(ctx)
			if err != nil {
				return err
			}
			if err := bitsEqual(full, testTensors[n].full()); err != nil {
				return fmt.Errorf("%s: %v", n, err)
			}
		}
		return nil
	}, onEmu)
}

// TestLoadInto loads into existing tensors, on the host and on emulated
// devices, on another layout: their memory is kept and now holds the
// saved values; the entries are set.
func TestLoadInto(t *testing.T) {
	root := t.TempDir()
	path := saveOn(t, root, dp2tp2, testTensors)
	zero := map[string]tdef{}
	for n, d := range testTensors {
		d.seed += 1000 // other values, to be overwritten
		zero[n] = d
	}
	for _, dev := range []bool{false, true} {
		var opts []placementtest.Option
		if dev {
			opts = append(opts, placementtest.WithDevice(func(rank int) (device.Device, error) { return emu.New(rank) }))
		}
		simulate(t, tp3.shape, tp3.axes, func(ctx context.Context, m *mesh.Mesh) error {
			specs, err := specsOn(m, zero, tp3.lay)
			if err != nil {
				return err
			}
			st, err := stateOn(specs, zero)
			if err != nil {
				return err
			}
			for n, x := range st.Tensors {
				if st.Tensors[n], err = x.To(placementtest.Device(ctx)); err != nil {
					return err
				}
			}
			before := map[string]any{}
			for n, x := range st.Tensors {
				before[n] = x.LocalData()
			}
			st.Entries = map[string]any{"stale": true}
			if err := LoadInto(ctx, path, &st); err != nil {
				return err
			}
			if len(st.Entries) != 0 {
				return fmt.Errorf("entries %v, want the checkpoint's (none)", st.Entries)
			}
			for _, n := range slices.Sorted(maps.Keys(st.Tensors)) {
				x := st.Tensors[n]
				if fmt.Sprintf("%p", x.LocalData()) != fmt.Sprintf("%p", before[n]) {
					return fmt.Errorf("%s: the block was replaced, not filled", n)
				}
				full, err := x.Full(ctx)
				if err != nil {
					return err
				}
				if err := bitsEqual(full, testTensors[n].full()); err != nil {
					return fmt.Errorf("%s (device %v): %v", n, dev, err)
				}
			}
			return nil
		}, opts...)
	}
}
