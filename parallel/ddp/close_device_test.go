package ddp

import (
	"context"
	"errors"
	"fmt"
	"time"

	"testing"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/device/emu"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// TestCloseAfterFailedBackwardOnDevice: on emulated devices, a Backward
// that fails after some buckets were launched, followed by Close without
// Discard, returns promptly and gives back every byte DDP held: once the
// tape's results and the leaves' gradients are freed too, each device
// holds exactly the parameters. Rank 1 reaches its Backward 300 ms after
// rank 0, so rank 0's launched all-reduces are still in flight when it
// closes; memory rank 0 allocates and writes right after Close (which the
// allocator may carve from a freed bucket) still holds what was written
// once rank 1 has caught up: no collective writes into a bucket after
// Close gave it back.
func TestCloseAfterFailedBackwardOnDevice(t *testing.T) {
	onEmu := placementtest.WithDevice(func(r int) (device.Device, error) { return emu.New(r) })
	placementtest.Run(t, []int{2}, []string{"dp"}, func(ctx context.Context, m *mesh.Mesh) error {
		d := placementtest.Device(ctx)
		tape := autograd.NewTape(autograd.WithDevice(d))
		var params []*autograd.Value
		var owned []device.Buffer // what the test frees itself
		for k, sh := range [][]int{{8, 4}, {8}, {3, 8}, {3}} {
			spec, err := placement.NewSpec(m, sh, comm.Float32, []placement.Placement{placement.Replicate()})
			if err != nil {
				return err
			}
			dt, err := placement.FromFull(spec, placementtest.Random(sh, comm.Float32, uint64(10+k)), placement.WithDevice(d))
			if err != nil {
				return err
			}
			p, err := tape.Param(fmt.Sprint("p", k), dt)
			if err != nil {
				return err
			}
			params = append(params, p)
		}
		if err := d.Synchronize(); err != nil {
			return err
		}
		paramBytes := d.Memory().Stats().Allocated
		dd, err := New(ctx, params, WithFirstBucket(8), WithBucketCap(8))
		if err != nil {
			return err
		}
		xspec, _ := placement.NewSpec(m, []int{6, 4}, comm.Float32, []placement.Placement{placement.Shard(0)})
		xd, err := placement.FromFull(xspec, placementtest.Random([]int{6, 4}, comm.Float32, 3), placement.WithDevice(d))
		if err != nil {
			return err
		}
		owned = append(owned, xd.LocalData().(device.Buffer))
		x, _ := tape.Constant(xd)
		h, err := autograd.Linear(x, params[0], params[1])
		if err != nil {
			return err
		}
		fail := autograd.LocalFunc[float32]{
			Name: "fails", In: [][]placement.Placement{h.Spec().Placements()}, GradIn: [][]placement.Placement{h.Spec().Placements()},
			Out: h.Spec().Placements(), GradOut: h.Spec().Placements(),
			Forward: func(in []autograd.Block[float32]) (autograd.Block[float32], error) {
				return autograd.Block[float32]{Shape: in[0].Shape, Data: append([]float32(nil), in[0].Data...)}, nil
			},
			Backward: func(g autograd.Block[float32], in []autograd.Block[float32], out autograd.Block[float32]) ([]autograd.Block[float32], error) {
				return nil, errors.New("injected backward failure")
			},
		}
		h2, err := fail.Apply(h)
		if err != nil {
			return err
		}
		logits, err := autograd.Linear(h2, params[2], params[3])
		if err != nil {
			return err
		}
		loss, err := autograd.Sum(logits)
		if err != nil {
			return err
		}
		if m.Rank() == 1 {
			time.Sleep(300 * time.Millisecond)
		}
		if err := tape.Backward(ctx, loss); err == nil {
			return errors.New("expected the injected failure")
		}
		launched := 0
		for _, b := range dd.buckets {
			if b.work != nil {
				launched++
			}
		}
		if launched == 0 {
			return errors.New("no bucket was launched before the failure: the test does not test Close with work in flight")
		}
		done := make(chan error, 1)
		go func() { done <- dd.Close() }()
		select {
		case err := <-done:
			if err != nil {
				return fmt.Errorf("Close after a failed Backward: %w", err)
			}
		case <-time.After(time.Minute):
			return errors.New("Close after a failed Backward did not return within a minute")
		}
		// Memory from the freed buckets, written now; an all-reduce
		// still in flight into a bucket would overwrite it.
		probe, err := d.Alloc(comm.Float32, 8)
		if err != nil {
			return err
		}
		if err := d.Kernels().Fill(probe, 7); err != nil {
			return err
		}
		dp, err := m.Comm(ctx, "dp")
		if err != nil {
			return err
		}
		if err := comm.Barrier(ctx, dp); err != nil {
			return err
		}
		time.Sleep(50 * time.Millisecond) // let a late all-reduce land
		got := make([]float32, 8)
		if err := d.CopyToHost(comm.Host(got), probe); err != nil {
			return err
		}
		for i, v := range got {
			if v != 7 {
				return fmt.Errorf("memory allocated after Close holds %v at %d, not the 7 written: an all-reduce wrote into a freed bucket", v, i)
			}
		}
		owned = append(owned, probe)
		for _, v := range []*autograd.Value{h, h2, logits, loss} {
			if b, ok := v.Data().LocalData().(device.Buffer); ok {
				owned = append(owned, b)
			}
		}
		for _, p := range params {
			if b, ok := p.ReleaseGrad().(device.Buffer); ok {
				owned = append(owned, b)
			}
		}
		for _, b := range owned {
			if err := b.Free(); err != nil {
				return err
			}
		}
		tape.Reset()
		if err := d.Synchronize(); err != nil {
			return err
		}
		if held := d.Memory().Stats().Allocated; held != paramBytes {
			return fmt.Errorf("%s holds %d bytes after Close and freeing the step's values, %d of them parameters (%d launched buckets)", d.Name(), held, paramBytes, launched)
		}
		return nil
	}, onEmu)
}
