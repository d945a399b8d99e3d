package fsdp

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/device/emu"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/parallel"
	"github.com/b7ea7098/loom/parallel/internal/ptest"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// TestCloseAfterFailedBackwardOnDevice: an MLP fully sharded over two
// ranks on emulated devices, whose Backward fails after the MLP's own
// backward ran, its units' gradient reductions issued (the failing op is
// before the MLP). Close without Discard returns promptly, and afterwards
// (the tape's results recycled, the input's gradient freed) each device
// holds only the sharded parameters and the input, as on the documented
// path (Discard, then Close): FSDP gives back all its device memory
// either way.
func TestCloseAfterFailedBackwardOnDevice(t *testing.T) {
	held := map[bool][]int64{} // by Discard first, per rank
	var mu sync.Mutex
	for _, discard := range []bool{true, false} {
		onEmu := placementtest.WithDevice(func(r int) (device.Device, error) { return emu.New(r) })
		placementtest.Run(t, []int{2}, []string{"fsdp"}, func(ctx context.Context, m *mesh.Mesh) error {
			d := placementtest.Device(ctx)
			// Recycling: the tape's op results (the MLP's intermediate
			// values included) go back with Recycle.
			tape := autograd.NewTape(autograd.WithDevice(d), autograd.WithRecycling())
			mlp, err := parallel.NewMLP(tape, m, 8, 16, parallel.WithName("mlp"), parallel.WithInit(parallel.Normal(0.3, 1)))
			if err != nil {
				return err
			}
			f, err := FullyShard(ctx, mlp, []string{"fc", "proj"})
			if err != nil {
				return err
			}
			spec, err := placement.NewSpec(m, []int{6, 8}, comm.Float32, ptest.DataPlaces(m))
			if err != nil {
				return err
			}
			xd, err := placement.FromFull(spec, placementtest.Random([]int{6, 8}, comm.Float32, 3), placement.WithDevice(d))
			if err != nil {
				return err
			}
			x, err := tape.Param("x", xd)
			if err != nil {
				return err
			}
			fail := autograd.LocalFunc[float32]{
				Name: "fails", In: [][]placement.Placement{x.Spec().Placements()}, GradIn: [][]placement.Placement{x.Spec().Placements()},
				Out: x.Spec().Placements(), GradOut: x.Spec().Placements(),
				Forward: func(in []autograd.Block[float32]) (autograd.Block[float32], error) {
					return autograd.Block[float32]{Shape: in[0].Shape, Data: append([]float32(nil), in[0].Data...)}, nil
				},
				Backward: func(g autograd.Block[float32], in []autograd.Block[float32], out autograd.Block[float32]) ([]autograd.Block[float32], error) {
					return nil, errors.New("injected backward failure")
				},
			}
			h, err := fail.Apply(x)
			if err != nil {
				return err
			}
			y, err := mlp.Forward(ctx, h)
			if err != nil {
				return err
			}
			loss, err := autograd.Sum(y)
			if err != nil {
				return err
			}
			if err := tape.Backward(ctx, loss); err == nil {
				return errors.New("expected the injected failure")
			}
			if discard {
				if err := f.Discard(ctx); err != nil {
					return fmt.Errorf("Discard: %w", err)
				}
			}
			done := make(chan error, 1)
			go func() { done <- f.Close() }()
			select {
			case err := <-done:
				if err != nil {
					return fmt.Errorf("Close (Discard first: %v): %w", discard, err)
				}
			case <-time.After(time.Minute):
				return fmt.Errorf("Close (Discard first: %v) did not return within a minute", discard)
			}
			if b, ok := x.ReleaseGrad().(device.Buffer); ok {
				if err := b.Free(); err != nil {
					return err
				}
			}
			tape.Recycle()
			tape.Reset()
			if err := d.Synchronize(); err != nil {
				return err
			}
			// What is left is the sharded parameters and x, each a
			// block of the allocator's 512-byte granule.
			ps, err := parallel.Params(mlp)
			if err != nil {
				return err
			}
			var want int64
			for _, b := range []any{xd.LocalData(), ps[0].Data().LocalData(), ps[1].Data().LocalData(), ps[2].Data().LocalData(), ps[3].Data().LocalData()} {
				db := b.(device.Buffer)
				want += (int64(db.Len()*db.DType().Size()) + 511) / 512 * 512
			}
			got := d.Memory().Stats().Allocated
			if got != want || len(ps) != 4 {
				return fmt.Errorf("Discard first %v: %s holds %d bytes after Close, want %d: the sharded parameters and x", discard, d.Name(), got, want)
			}
			mu.Lock()
			defer mu.Unlock()
			held[discard] = append(held[discard], got)
			return nil
		}, onEmu)
	}
	if len(held[true]) != 2 || len(held[false]) != 2 || held[true][0]+held[true][1] != held[false][0]+held[false][1] {
		t.Errorf("bytes held after Close: %v with Discard first, %v without; want the same", held[true], held[false])
	}
	t.Logf("bytes held after Close: %v with Discard first, %v without", held[true], held[false])
}
