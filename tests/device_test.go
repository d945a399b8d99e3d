package tests

import (
	"context"
	"fmt"
	"math"
	"sync"
	"testing"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/device/emu"
	"github.com/b7ea7098/loom/kernels"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/models/gpt"
	"github.com/b7ea7098/loom/models/moegpt"
	"github.com/b7ea7098/loom/parallel/fsdp"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// deviceSteps is how many steps TestDeviceMatchesHost trains: 20, or 5
// under -short to keep the suite's time.
func deviceSteps() int {
	if testing.Short() {
		return 5
	}
	return 20
}

// stepFunc runs one training step and returns its global loss.
type stepFunc func(ctx context.Context) (float64, error)

// deviceRun trains steps steps on a simulated mesh of shape and names,
// every rank on the host or, with onDevice, on an emulated device of its
// own (emu:<rank>) whose kernels run on bl; build makes the rank's
// trainer. It returns rank 0's losses, and on the devices checks that no
// rank's allocator asked the driver for memory after step settle.
func deviceRun(shape []int, names []string, steps, settle int, onDevice bool, bl *kernels.BLAS, build func(ctx context.Context, m *mesh.Mesh, d device.Device) (stepFunc, error)) ([]float64, error) {
	var mu sync.Mutex
	var losses []float64
	err := placementtest.Simulate(context.Background(), shape, names, func(ctx context.Context, m *mesh.Mesh) error {
		var d device.Device
		if onDevice {
			e, err := emu.New(m.Rank(), emu.WithBLAS(bl))
			if err != nil {
				return err
			}
			defer e.Close()
			d = e
		}
		step, err := build(ctx, m, d)
		if err != nil {
			return err
		}
		var mine []float64
		var allocs int64
		for i := range steps {
			loss, err := step(ctx)
			if err != nil {
				return fmt.Errorf("step %d: %w", i+1, err)
			}
			mine = append(mine, loss)
			if d == nil {
				continue
			}
			if err := d.Synchronize(); err != nil {
				return err
			}
			n := d.Memory().Stats().DriverAllocs
			if n == 0 {
				return fmt.Errorf("%s: step %d: nothing was allocated on the device", d.Name(), i+1)
			}
			if i+1 <= settle {
				allocs = n
			} else if n != allocs {
				return fmt.Errorf("%s: step %d: %d driver allocations, %d after step %d", d.Name(), i+1, n, allocs, settle)
			}
		}
		if m.Rank() == 0 {
			mu.Lock()
			losses = mine
			mu.Unlock()
		}
		return nil
	})
	return losses, err
}

// TestDeviceMatchesHost trains the tiny GPT (dp2×tp2, and fsdp=4 with
// FSDP's bf16 mixed precision) and the MoE GPT on ep=2 (dropless, and
// padded to capacity) with every rank on an emulated device and on the
// host, and compares rank 0's losses at every step bit for bit. The
// tolerance is 0 because the emulated device runs the host's CPU kernels,
// on the same BLAS, on the same data: any difference means the device
// path reordered or dropped work. FSDP's bf16 rounds the gathered weights
// on both paths alike (round to nearest even), so bf16 keeps it 0.
//
// No rank's device allocator calls the driver once the steps are alike:
// after step 2 for the GPT, whose second step is the first to run its
// forward with AdamW's state and the previous step's gradient buffers
// held (the caching allocator's best fit then adds a 2 MiB segment, once),
// and after step 2 for the MoE GPT padded to capacity (every buffer's size
// fixed). The dropless MoE GPT's buffers follow the routing, so a step
// more imbalanced than every earlier one may add a segment (as with
// PyTorch's caching allocator): its allocations are not checked.
func TestDeviceMatchesHost(t *testing.T) {
	ref := loadReference(t)
	bl, err := kernels.Load(kernels.WithLibrary("go"), kernels.WithThreads(1))
	if err != nil {
		t.Fatal(err)
	}
	steps := deviceSteps()
	gptRun := func(opts ...gpt.TrainOption) func(ctx context.Context, m *mesh.Mesh, d device.Device) (stepFunc, error) {
		return func(ctx context.Context, m *mesh.Mesh, d device.Device) (stepFunc, error) {
			all := append([]gpt.TrainOption{gpt.WithRun(ref.cfg), gpt.WithModel(gpt.WithParams(ref.init)), gpt.WithTape(autograd.WithBLAS(bl))}, opts...)
			if d != nil {
				all = append(all, gpt.WithDevice(d))
			}
			tr, err := gpt.NewTrainer(ctx, m, gpt.FromReference(ref.cfg), all...)
			if err != nil {
				return nil, err
			}
			return func(ctx context.Context) (float64, error) {
				_, loss, err := tr.Step(ctx)
				return loss, err
			}, nil
		}
	}
	moeRun := func(capacity float64) func(ctx context.Context, m *mesh.Mesh, d device.Device) (stepFunc, error) {
		return func(ctx context.Context, m *mesh.Mesh, d device.Device) (stepFunc, error) {
			cfg := moegpt.Default()
			cfg.CapacityFactor, cfg.Pad = capacity, capacity > 0
			return moeTrainer(ctx, m, d, bl, cfg)
		}
	}
	for _, c := range []struct {
		name   string
		shape  []int
		names  []string
		settle int
		build  func(ctx context.Context, m *mesh.Mesh, d device.Device) (stepFunc, error)
	}{
		{"gpt dp2×tp2", []int{2, 2}, []string{"dp", "tp"}, 2, gptRun(gpt.WithDataParallel("dp"), gpt.WithTensorParallel("tp"))},
		{"gpt fsdp4 bf16", []int{4}, []string{"fsdp"}, 2, gptRun(gpt.WithFullyShard("fsdp", fsdp.WithMixedPrecision(comm.BFloat16)))},
		{"moegpt ep2", []int{2}, []string{"ep"}, steps, moeRun(0)},
		{"moegpt ep2 capacity", []int{2}, []string{"ep"}, 2, moeRun(1.25)},
	} {
		t.Run(c.name, func(t *testing.T) {
			host, err := deviceRun(c.shape, c.names, steps, c.settle, false, bl, c.build)
			if err != nil {
				t.Fatalf("host: %v", err)
			}
			dev, err := deviceRun(c.shape, c.names, steps, c.settle, true, bl, c.build)
			if err != nil {
				t.Fatalf("emulated device: %v", err)
			}
			for i := range host {
				if math.Float64bits(dev[i]) != math.Float64bits(host[i]) {
					t.Fatalf("step %d: loss %v on the emulated devices, %v on the host", i+1, dev[i], host[i])
				}
			}
		})
	}
}

// moeTrainer is a rank's MoE GPT trainer of cfg (the payload on
// all-to-all-v's, the fused path being host memory's), from a fixed random
// init, on d when it is not nil, with its GEMMs on bl.
func moeTrainer(ctx context.Context, m *mesh.Mesh, d device.Device, bl *kernels.BLAS, cfg moegpt.Config) (stepFunc, error) {
	opts := []moegpt.TrainOption{moegpt.WithModel(moegpt.WithBLAS(bl), moegpt.WithCollectives()), moegpt.WithTape(autograd.WithBLAS(bl))}
	if d != nil {
		opts = append(opts, moegpt.WithDevice(d))
	}
	tr, err := moegpt.NewTrainer(ctx, m, cfg, moegpt.RandomInit(cfg, 1), "ep", opts...)
	if err != nil {
		return nil, err
	}
	return func(ctx context.Context) (float64, error) {
		r, err := tr.Step(ctx)
		if err != nil {
			return 0, err
		}
		return r.Loss, nil
	}, nil
}
