//go:build linux && (amd64 || arm64)

package launch_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/nccl/topology"
	"github.com/b7ea7098/loom/comm/rendezvous"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/device/cuda"
	"github.com/b7ea7098/loom/launch"
	"github.com/b7ea7098/loom/train"
)

// fakeNCCLJobs builds the fake NCCL and CUDA library of comm/nccl, points
// LOOM_NCCL and the driver variable at it and returns the NCCL jobs of n
// torchrun "processes" on one host, bootstrapped through a fresh
// rendezvous server that the test closes. It skips without gcc.
func fakeNCCLJobs(t *testing.T, ctx context.Context, n int) []*launch.Job {
	t.Helper()
	gcc, err := exec.LookPath("gcc")
	if err != nil {
		t.Skip("no gcc to build the fake NCCL")
	}
	lib := filepath.Join(t.TempDir(), "libfakenccl.so")
	if out, err := exec.Command(gcc, "-shared", "-fPIC", "-O1", "-Wall", "-pthread", "-o", lib, filepath.Join("..", "comm", "nccl", "testdata", "fakenccl.c")).CombinedOutput(); err != nil {
		t.Fatalf("building the fake NCCL: %v\n%s", err, out)
	}
	t.Setenv("LOOM_NCCL", lib)
	t.Setenv(cuda.DriverEnv, lib)
	t.Setenv(cuda.NVRTCEnv, cuda.Off)                                            // no NVRTC: nothing here compiles
	t.Setenv(topology.NVMLEnv, filepath.Join(t.TempDir(), "no-libnvidia-ml.so")) // the uniform topology, even on a GPU host
	t.Setenv("LOOM_COSTMODEL", "off")
	srv, err := rendezvous.Listen(ctx, "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close() })
	host, port, err := net.SplitHostPort(srv.Addr())
	if err != nil {
		t.Fatal(err)
	}
	jobs := make([]*launch.Job, n)
	for rank := range n {
		env := map[string]string{"RANK": fmt.Sprint(rank), "WORLD_SIZE": fmt.Sprint(n), "LOCAL_RANK": fmt.Sprint(rank), "LOCAL_WORLD_SIZE": fmt.Sprint(n),
			"MASTER_ADDR": host, "MASTER_PORT": port, cuda.DriverEnv: lib}
		if jobs[rank], err = launch.Detect(func(k string) string { return env[k] }, "", n); err != nil {
			t.Fatal(err)
		}
		if jobs[rank].Backend != launch.NCCL {
			t.Fatalf("rank %d: Detect = %+v, want NCCL", rank, *jobs[rank])
		}
	}
	return jobs
}

// runRanks runs f for every job on its own goroutine and fails the test
// on the first error.
func runRanks(t *testing.T, jobs []*launch.Job, f func(rank int, job *launch.Job) error) {
	t.Helper()
	errs := make([]error, len(jobs))
	var wg sync.WaitGroup
	for rank, job := range jobs {
		wg.Go(func() { errs[rank] = f(rank, job) })
	}
	wg.Wait()
	for rank, err := range errs {
		if err != nil {
			t.Fatalf("rank %d: %v", rank, err)
		}
	}
}

// TestNCCLDeviceFake: with launch.WithDevice each NCCL rank gets its GPU
// as a device/cuda device named cuda:<GPU>, whose context is the one its
// communicator was made on (one context and driver binding for compute
// and NCCL); the communicator works (an all-reduce), and Job.Run closes
// the device after the rank. Without WithDevice a rank has none. Through
// train.Run, -device cuda hands the same device to the rank's setup.
func TestNCCLDeviceFake(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	type ctxer interface{ Device() *cuda.Context }

	devs := make([]device.Device, 2)
	runRanks(t, fakeNCCLJobs(t, ctx, 2), func(rank int, job *launch.Job) error {
		return job.Run(ctx, func(ctx context.Context, c comm.Communicator) error {
			d, ok := launch.DeviceOf(ctx).(*cuda.Device)
			if !ok {
				return fmt.Errorf("DeviceOf = %v, want a *cuda.Device", launch.DeviceOf(ctx))
			}
			devs[rank] = d
			if want := fmt.Sprintf("cuda:%d", rank); d.Name() != want || d.Kind() != device.KindCUDA {
				return fmt.Errorf("device %s (%v), want %s", d.Name(), d.Kind(), want)
			}
			nc, ok := c.(ctxer)
			if !ok {
				return fmt.Errorf("communicator %T has no Device", c)
			}
			if nc.Device() != d.Context() {
				return fmt.Errorf("the communicator's context %p is not the device's %p", nc.Device(), d.Context())
			}
			x := []float32{float32(rank + 1)}
			if err := comm.AllReduce(ctx, c, comm.Host(x), comm.Host(x), comm.Sum); err != nil {
				return err
			}
			if x[0] != 3 {
				return fmt.Errorf("all-reduce gave %v, want 3", x[0])
			}
			return nil
		}, launch.WithDevice())
	})
	for rank, d := range devs {
		if _, err := d.Alloc(comm.Float32, 1); !errors.Is(err, device.ErrInvalid) || !strings.Contains(err.Error(), "the device is closed") {
			t.Errorf("rank %d: %s after Job.Run returned: Alloc gave %v, want the closed device's error", rank, d.Name(), err)
		}
	}

	runRanks(t, fakeNCCLJobs(t, ctx, 2), func(rank int, job *launch.Job) error {
		return job.Run(ctx, func(ctx context.Context, c comm.Communicator) error {
			if d := launch.DeviceOf(ctx); d != nil {
				return fmt.Errorf("without WithDevice: DeviceOf = %s, want nil", d.Name())
			}
			return nil
		})
	})

	for _, tf32 := range []bool{false, true} {
		names := make([]string, 2)
		runRanks(t, fakeNCCLJobs(t, ctx, 2), func(rank int, job *launch.Job) error {
			l := train.Loop{Ranks: 2, Shape: []int{2}, Steps: 1, Every: 1, Tokens: 1, Flags: train.Flags{Threads: 1, TraceSteps: 1, Device: train.DeviceCUDA, TF32: tf32}}
			_, err := train.Run(ctx, nil, job, l, func(ctx context.Context, r train.Rank) (train.Stepper[float64], error) {
				names[rank] = r.Device.Name()
				if got := r.Device.(*cuda.Device).TF32(); got != tf32 {
					return nil, fmt.Errorf("-tf32=%v: the device's TF32() is %v", tf32, got)
				}
				return nopStepper{}, nil
			}, nil)
			return err
		})
		for rank, name := range names {
			if want := fmt.Sprintf("cuda:%d", rank); name != want {
				t.Errorf("train.Run -device cuda: rank %d's device %q, want %s", rank, name, want)
			}
		}
	}
}

// nopStepper is a training step that does nothing.
type nopStepper struct{}

func (nopStepper) Step(context.Context) (float64, error) { return 0, nil }
