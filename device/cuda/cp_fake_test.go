//go:build linux && (amd64 || arm64)

package cuda_test

import (
	"context"
	"fmt"
	"math"
	"testing"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/device/cuda"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/parallel/cp"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// cpAttention runs cp.Attention of q, k, v [1, 2, 40, 8] of dt over a
// one-rank cp axis laid out by p with method m, the tensors on the device
// open returns (on the host for nil), and returns the output and, in
// float32, the gradients of q, k and v of the sum of the output (the
// device's Sum is float32 only), as float64.
func cpAttention(t *testing.T, open func(t *testing.T) (*cuda.Lib, *cuda.Device), dt comm.DType, p placement.Placement, m cp.Method) [4][]float64 {
	t.Helper()
	shape := []int{1, 2, 40, 8}
	var res [4][]float64
	var opts []placementtest.Option
	if open != nil {
		opts = append(opts, placementtest.WithDevice(func(int) (device.Device, error) {
			l, d := open(t)
			t.Cleanup(func() {
				if err := l.Close(); err != nil {
					t.Error(err)
				}
			})
			return d, nil
		}))
	}
	placementtest.Run(t, []int{1}, []string{"cp"}, func(ctx context.Context, msh *mesh.Mesh) error {
		dev := placementtest.Device(ctx)
		spec, err := placement.NewSpec(msh, shape, dt, []placement.Placement{p})
		if err != nil {
			return err
		}
		tp := autograd.NewTape(autograd.WithDevice(dev))
		var vs [3]*autograd.Value
		for i := range vs {
			d, err := placement.FromFull(spec, placementtest.Random(shape, dt, uint64(i+1)), placement.WithDevice(dev))
			if err != nil {
				return err
			}
			if vs[i], err = tp.Param(fmt.Sprint(i), d); err != nil {
				return err
			}
		}
		y, err := cp.Attention(ctx, vs[0], vs[1], vs[2], "cp", cp.WithMethod(m))
		if err != nil {
			return err
		}
		outs := []*placement.DTensor{y.Data()}
		if dt == comm.Float32 {
			loss, err := autograd.Sum(y)
			if err != nil {
				return err
			}
			if err := tp.Backward(ctx, loss); err != nil {
				return err
			}
			outs = append(outs, vs[0].Grad(), vs[1].Grad(), vs[2].Grad())
		}
		for i, d := range outs {
			f, err := d.Full(ctx)
			if err != nil {
				return err
			}
			switch x := f.(type) {
			case []float32:
				for _, e := range x {
					res[i] = append(res[i], float64(e))
				}
			case []float64:
				res[i] = x
			}
		}
		return nil
	}, opts...)
	return res
}

// TestFakeDeviceContextParallel runs context parallelism on the fake CUDA
// device (kernels/block_attn.cu under the emulator; one rank, since the
// in-process backend moves host buffers only and NCCL is not faked),
// balanced and plain, float64 (forward) and float32 (forward and
// backward), against the same run on the host: the device's block
// attention is no longer refused, and its result agrees within 1e-12
// relative in float64, result and gradients within float32 attention
// tolerances in float32 (the device computes the softmax in float32, the
// host in float64).
func TestFakeDeviceContextParallel(t *testing.T) {
	open := cuda.OpenFakeDevice(t)
	for _, c := range []struct {
		p  placement.Placement
		m  cp.Method
		dt comm.DType
	}{
		{placement.ShardBalanced(2), cp.Ring, comm.Float64}, {placement.Shard(2), cp.Ring, comm.Float64},
		{placement.ShardBalanced(2), cp.Ring, comm.Float32}, {placement.Shard(2), cp.Ring, comm.Float32},
	} {
		t.Run(fmt.Sprintf("%v/%v/%v", c.p, c.m, c.dt), func(t *testing.T) {
			rtol, atol := 1e-12, 1e-13
			if c.dt == comm.Float32 {
				rtol, atol = 2e-4, 5e-5
			}
			want := cpAttention(t, nil, c.dt, c.p, c.m)
			got := cpAttention(t, open, c.dt, c.p, c.m)
			for i, name := range []string{"out", "dq", "dk", "dv"} {
				if i > 0 && c.dt == comm.Float64 {
					break
				}
				if len(got[i]) != len(want[i]) || len(got[i]) == 0 {
					t.Fatalf("%s: %d values, want %d", name, len(got[i]), len(want[i]))
				}
				for j, g := range got[i] {
					if w := want[i][j]; !(math.Abs(g-w) <= rtol*math.Abs(w)+atol) {
						t.Errorf("%s[%d] = %v on the device, %v on the host", name, j, g, w)
						break
					}
				}
			}
		})
	}
}
