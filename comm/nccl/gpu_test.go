//go:build linux && (amd64 || arm64)

package nccl

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/commtest"
	"github.com/b7ea7098/loom/comm/nccl/topology"
	"github.com/b7ea7098/loom/comm/rendezvous"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/device/cuda"
)

// The TestGPU* tests run on the real NCCL and CUDA driver (found as Load
// finds them: LOOM_NCCL, LOOM_CUDA_DRIVER, or libnccl.so.2 and
// libcuda.so.1 on the loader path) and need one GPU; with two or more
// they also run multi-rank communicators in this process, one device per
// rank. Without the libraries or a device they skip, or fail when
// LOOM_NCCL_REQUIRE=1 (gpu_check.sh sets it). The bad-pointer check needs
// NCCL_CHECK_POINTERS=1, without which NCCL does not validate pointers and
// the kernel would fault and spoil the context for the rest of the run.

var (
	gpuOnce sync.Once
	gpuL    *Library
	gpuErr  error
)

// gpuLib returns the real library, or skips (fails with
// LOOM_NCCL_REQUIRE=1) without it or without a device.
func gpuLib(t *testing.T) *Library {
	t.Helper()
	gpuOnce.Do(func() {
		gpuL, gpuErr = Load()
		if gpuErr == nil {
			n, err := gpuL.DeviceCount()
			if err == nil && n < 1 {
				err = errors.New("no CUDA device")
			}
			gpuErr = err
		}
	})
	if gpuErr != nil {
		if os.Getenv("LOOM_NCCL_REQUIRE") == "1" {
			t.Fatalf("LOOM_NCCL_REQUIRE=1 but NCCL/CUDA cannot be used: %v", gpuErr)
		}
		t.Skipf("needs NCCL, the CUDA driver and a GPU: %v", gpuErr)
	}
	return gpuL
}

// gpuDevice opens a device that is closed when the test ends, after
// whatever the test registers later (communicators on it).
func gpuDevice(t *testing.T, l *Library, ordinal int) *cuda.Context {
	t.Helper()
	d, err := l.Driver().Open(ordinal)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := d.Close(); err != nil {
			t.Error(err)
		}
	})
	return d
}

func gpuDevices(t *testing.T, l *Library) int {
	n, err := l.DeviceCount()
	if err != nil {
		t.Fatal(err)
	}
	return n
}

func TestGPUInfo(t *testing.T) {
	l := gpuLib(t)
	dv, err := l.DriverVersion()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%v; NCCL version code %d; driver %d; %d devices; unique id passed by %s; config layout %s, %d bytes; split %v; native alltoall %v",
		l, l.Version(), dv, gpuDevices(t, l), l.InitPath(), VersionString(l.ConfigLayout().Version), l.ConfigLayout().Size, l.HasSplit(), l.HasNativeAllToAll())
	for _, a := range l.Tried() {
		t.Log(a)
	}
	d := gpuDevice(t, l, 0)
	bus, err := d.PCIBusID()
	t.Logf("device 0: PCI %s (%v)", bus, err)
}

// TestGPUDeviceMemory: allocation, copies both ways, slices, streams and
// events, and a copy to an address that is not device memory.
func TestGPUDeviceMemory(t *testing.T) {
	l := gpuLib(t)
	d := gpuDevice(t, l, 0)
	src := commtest.Fill(comm.Float32, 1<<20+3, 1, 0, commtest.Mixed)
	b, err := upload(d, src)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Free()
	got, err := b.download()
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got.Bytes(), src.Bytes()) {
		t.Error("round trip through device memory changed the data")
	}
	part, err := b.slice(5, 9).download()
	if err != nil || !bytes.Equal(part.Bytes(), src.SliceHost(5, 9).Bytes()) {
		t.Errorf("slice download: %v", err)
	}
	s, err := d.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	e, err := d.NewEvent(false)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	if err := e.Record(s); err != nil {
		t.Fatal(err)
	}
	if err := errors.Join(e.Synchronize(), s.WaitEvent(e), s.Synchronize(), d.Synchronize()); err != nil {
		t.Fatal(err)
	}
	if done, err := e.Query(); !done || err != nil {
		t.Errorf("event query: %v %v", done, err)
	}
	if done, err := s.Query(); !done || err != nil {
		t.Errorf("stream query: %v %v", done, err)
	}
	bad := &devBuf{ctx: d, dt: comm.Float32, ptr: 0x10, n: 4}
	if err := bad.copyFromHost(comm.Host([]float32{1, 2, 3, 4})); cuCode(err) == 0 {
		t.Errorf("copy to a bad address: %v, want a CUDA error", err)
	} else {
		t.Logf("copy to a bad address: %v", err)
	}
}

// gpuStoreComm creates a one-rank communicator through a rendezvous store
// on localhost.
func gpuStoreComm(t *testing.T, l *Library, d *cuda.Context, name string, opts ...Option) *Comm {
	t.Helper()
	ctx := context.Background()
	srv, err := rendezvous.Listen(ctx, "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close() })
	cl, err := rendezvous.Dial(ctx, srv.Addr())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cl.Close() })
	opts = append([]Option{WithOptions(comm.Options{Timeout: 2 * time.Minute})}, opts...)
	c, err := l.NewComm(ctx, d, cl, name, 0, 1, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := c.Close(); err != nil {
			t.Error(err)
		}
	})
	return c
}

// TestGPUCollectivesSize1 runs every collective on a one-rank
// communicator made through the store, on device buffers, for every dtype
// and reduce op, out of place and in place, blocking and async, and checks
// the results (on one rank every collective is a copy).
func TestGPUCollectivesSize1(t *testing.T) {
	l := gpuLib(t)
	d := gpuDevice(t, l, 0)
	c := gpuStoreComm(t, l, d, "gpu/size1")
	ctx := context.Background()
	const n = 1031
	for _, dt := range comm.AllDTypes() {
		in := commtest.Fill(dt, n, uint64(dt), 0, commtest.Mixed)
		src, err := upload(d, in)
		if err != nil {
			t.Fatal(err)
		}
		dst, err := allocDev(d, dt, n)
		if err != nil {
			t.Fatal(err)
		}
		check := func(what string, b *devBuf) {
			t.Helper()
			got, err := b.download()
			if err != nil {
				t.Fatalf("%v %s: %v", dt, what, err)
			}
			if !bytes.Equal(got.Bytes(), in.Bytes()) {
				t.Errorf("%v %s: result differs from the input", dt, what)
			}
		}
		reset := func() {
			if err := dst.copyFromHost(commtest.Fill(dt, n, 99, 0, commtest.Mixed)); err != nil {
				t.Fatal(err)
			}
		}
		for _, op := range comm.AllReduceOps() {
			reset()
			if err := comm.AllReduce(ctx, c, src, dst, op); err != nil {
				t.Fatalf("allreduce %v %v: %v", dt, op, err)
			}
			check("allreduce "+op.String(), dst)
			reset()
			if err := comm.Reduce(ctx, c, src, dst, op, 0); err != nil {
				t.Fatal(err)
			}
			check("reduce "+op.String(), dst)
			reset()
			if err := comm.ReduceScatter(ctx, c, src, dst, op); err != nil {
				t.Fatal(err)
			}
			check("reducescatter "+op.String(), dst)
		}
		calls := []struct {
			name string
			run  func() error
		}{
			{"broadcast", func() error { return c.Do(ctx, comm.Call{Op: comm.OpBroadcast, Send: src, Recv: dst}) }},
			{"allgather", func() error { return comm.AllGather(ctx, c, src, dst) }},
			{"gather", func() error { return comm.Gather(ctx, c, src, dst, 0) }},
			{"scatter", func() error { return comm.Scatter(ctx, c, src, dst, 0) }},
			{"alltoall", func() error { return comm.AllToAll(ctx, c, src, dst) }},
			{"alltoallv", func() error { return comm.AllToAllV(ctx, c, src, dst, []int{n}, []int{n}) }},
		}
		for _, call := range calls {
			reset()
			if err := call.run(); err != nil {
				t.Fatalf("%s %v: %v", call.name, dt, err)
			}
			check(call.name, dst)
		}
		// In place: the result must be the input again.
		inPlace, err := upload(d, in)
		if err != nil {
			t.Fatal(err)
		}
		for _, call := range []comm.Call{
			{Op: comm.OpAllReduce, Send: inPlace, Recv: inPlace, Reduce: comm.Max},
			{Op: comm.OpBroadcast, Send: inPlace, Recv: inPlace},
			{Op: comm.OpAllGather, Send: inPlace, Recv: inPlace},
			{Op: comm.OpReduceScatter, Send: inPlace, Recv: inPlace, Reduce: comm.Sum},
		} {
			if err := c.Do(ctx, call); err != nil {
				t.Fatalf("%v in place %v: %v", call.Op, dt, err)
			}
			check(call.Op.String()+" in place", inPlace)
		}
		// Async, back to back, then wait for all.
		outs := make([]*devBuf, 4)
		var works []comm.Work
		for i := range outs {
			if outs[i], err = allocDev(d, dt, n); err != nil {
				t.Fatal(err)
			}
			wk, err := comm.AllGatherAsync(ctx, c, src, outs[i])
			if err != nil {
				t.Fatal(err)
			}
			works = append(works, wk)
		}
		bw, err := comm.BarrierAsync(ctx, c)
		if err != nil {
			t.Fatal(err)
		}
		if err := comm.WaitAll(ctx, append(works, bw)...); err != nil {
			t.Fatal(err)
		}
		for i, o := range outs {
			select {
			case <-works[i].Done():
			default:
				t.Error("Wait returned before Done closed")
			}
			check(fmt.Sprintf("async allgather %d", i), o)
			o.Free()
		}
		for _, b := range []*devBuf{src, dst, inPlace} {
			if err := b.Free(); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := comm.Barrier(ctx, c); err != nil {
		t.Fatal(err)
	}
	if n := len(c.Recorder().Entries()); n == 0 {
		t.Error("the flight recorder is empty")
	}
}

// TestGPUDeviceOrder: device code's ordering of a collective on device
// buffers, with no host wait between compute and communication. Compute
// is kept busy by a chain of large device copies and then writes x; the
// all-reduce (x into y) on the communicator's stream must see that
// write (BeforeCollective), and compute's copy of y must see the
// all-reduce's result (AfterCollective). Without BeforeCollective NCCL
// reads x while compute is still busy (about 5 ms of copies on an H200),
// so out is zero; without AfterCollective compute's copy races the
// all-reduce, which shows less reliably.
func TestGPUDeviceOrder(t *testing.T) {
	l := gpuLib(t)
	d := gpuDevice(t, l, 0)
	c := gpuStoreComm(t, l, d, "gpu/order")
	ctx := context.Background()
	compute, err := d.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	defer compute.Close()
	dev := ctxDevice{ctx: d, compute: compute}
	const n = 1 << 20
	const big = 256 << 20 // bytes per copy of the busy chain
	in := commtest.Fill(comm.Float32, n, 1, 0, commtest.Mixed)
	bufs := make([]*devBuf, 5)
	for i := range bufs {
		size := n
		if i >= 3 {
			size = big / 4
		}
		if bufs[i], err = allocDev(d, comm.Float32, size); err != nil {
			t.Fatal(err)
		}
		defer bufs[i].Free()
	}
	src, x, y, busyA, busyB := bufs[0], bufs[1], bufs[2], bufs[3], bufs[4]
	out, err := allocDev(d, comm.Float32, n)
	if err != nil {
		t.Fatal(err)
	}
	defer out.Free()
	if err := src.copyFromHost(in); err != nil {
		t.Fatal(err)
	}
	for _, b := range []*devBuf{x, y, out} {
		if err := compute.Memset32(b.span(), 0, n); err != nil {
			t.Fatal(err)
		}
	}
	if err := compute.Synchronize(); err != nil {
		t.Fatal(err)
	}
	for i := range 20 {
		a, b := busyA, busyB
		if i%2 == 1 {
			a, b = b, a
		}
		if err := compute.Copy(b.span(), a.span(), big); err != nil {
			t.Fatal(err)
		}
	}
	if err := compute.Copy(x.span(), src.span(), 4*n); err != nil {
		t.Fatal(err)
	}
	if err := device.BeforeCollective(c, dev); err != nil {
		t.Fatal(err)
	}
	wk, err := comm.AllReduceAsync(ctx, c, x, y, comm.Sum)
	if err != nil {
		t.Fatal(err)
	}
	if err := device.AfterCollective(ctx, wk, dev); err != nil {
		t.Fatal(err)
	}
	if err := compute.Copy(out.span(), y.span(), 4*n); err != nil {
		t.Fatal(err)
	}
	got := make([]float32, n)
	// Pageable memory: the copy returns once it and compute's work before
	// it are done.
	if err := cuda.CopyFromDeviceAsync(compute, got, out.span()); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(comm.Host(got).Bytes(), in.Bytes()) {
		t.Error("compute read the all-reduce's result out of order (stale memory)")
	}
	if err := wk.Wait(ctx); err != nil {
		t.Fatal(err)
	}
}

// TestGPUSplitAndStreams: Split on one rank, a communicator on the
// caller's stream, and ordering through an event.
func TestGPUSplitAndStreams(t *testing.T) {
	l := gpuLib(t)
	d := gpuDevice(t, l, 0)
	ctx := context.Background()
	s, err := d.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	c := gpuStoreComm(t, l, d, "gpu/streams", WithStream(s))
	if c.Stream() != s {
		t.Fatal("WithStream ignored")
	}
	x := []int32{3}
	if err := comm.AllReduce(ctx, c, comm.Host(x), comm.Host(x), comm.Sum); err != nil || x[0] != 3 {
		t.Fatalf("allreduce on the caller's stream: %v %v", x, err)
	}
	e, err := d.NewEvent(false)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	if err := errors.Join(e.Record(s), e.Synchronize()); err != nil {
		t.Fatal(err)
	}
	if !l.HasSplit() {
		if _, err := c.Split(ctx, 0, 0); !errors.Is(err, comm.ErrUnsupported) {
			t.Errorf("Split without ncclCommSplit: %v", err)
		}
		return
	}
	sub, err := c.SplitComm(ctx, 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	if sub.Size() != 1 || sub.Rank() != 0 {
		t.Errorf("split: rank %d of %d", sub.Rank(), sub.Size())
	}
	y := []float64{2.5}
	if err := comm.AllReduce(ctx, sub, comm.Host(y), comm.Host(y), comm.Avg); err != nil || y[0] != 2.5 {
		t.Errorf("allreduce on the split: %v %v", y, err)
	}
	if err := sub.Close(); err != nil {
		t.Error(err)
	}
	if none, err := c.Split(ctx, -1, 0); none != nil || err != nil {
		t.Errorf("Split(-1) = %v, %v", none, err)
	}
}

// TestGPUConfigs creates communicators with Config fields the loaded NCCL
// knows, blocking and not, and through ncclCommInitRankScalable when it
// exists: the real NCCL accepts the bytes this package lays out.
func TestGPUConfigs(t *testing.T) {
	l := gpuLib(t)
	d := gpuDevice(t, l, 0)
	ctx := context.Background()
	v := l.Version()
	cfgs := map[string]Config{"nonblocking": {}, "blocking": {Blocking: true}}
	if v >= 21700 {
		cfgs["ctas"] = Config{MinCTAs: Int(1), MaxCTAs: Int(16), CGAClusterSize: Int(0)}
	}
	if v >= 22700 {
		cfgs["named"] = Config{CommName: "loom-gpu-check"}
	}
	for name, cfg := range cfgs {
		t.Run(name, func(t *testing.T) {
			id, err := l.UniqueID()
			if err != nil {
				t.Fatal(err)
			}
			c, err := l.NewCommFromID(ctx, d, id, 0, 1, WithConfig(cfg), WithOptions(comm.Options{Timeout: time.Minute}))
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			x := []float32{1.5}
			if err := comm.AllReduce(ctx, c, comm.Host(x), comm.Host(x), comm.Sum); err != nil || x[0] != 1.5 {
				t.Errorf("allreduce: %v %v", x, err)
			}
		})
	}
	if l.nc.commInitRankScalable != nil && l.InitPath() != "scalable" {
		t.Run("scalable", func(t *testing.T) {
			ls, err := Load(func(c *loadConfig) { c.initVia = "scalable" })
			if err != nil {
				t.Fatal(err)
			}
			id, err := ls.UniqueID()
			if err != nil {
				t.Fatal(err)
			}
			ds, err := ls.Driver().Open(0)
			if err != nil {
				t.Fatal(err)
			}
			defer ds.Close()
			c, err := ls.NewCommFromID(ctx, ds, id, 0, 1, WithOptions(comm.Options{Timeout: time.Minute}))
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			if err := comm.Barrier(ctx, c); err != nil {
				t.Error(err)
			}
		})
	}
}

// TestGPUErrors: a communicator whose second rank never joins times out
// and is aborted; a pointer NCCL rejects (with NCCL_CHECK_POINTERS=1) is
// an error matching comm.ErrInvalid and aborts the communicator; buffers
// of another device are rejected before NCCL.
func TestGPUErrors(t *testing.T) {
	l := gpuLib(t)
	d := gpuDevice(t, l, 0)
	ctx := context.Background()
	id, err := l.UniqueID()
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	_, err = l.NewCommFromID(ctx, d, id, 0, 2, WithOptions(comm.Options{Timeout: 3 * time.Second}))
	if !errors.Is(err, comm.ErrTimeout) {
		t.Errorf("init without rank 1: %v, want a timeout", err)
	}
	t.Logf("init without rank 1 failed after %v: %v", time.Since(start).Round(time.Millisecond), err)

	c := gpuStoreComm(t, l, d, "gpu/errors")
	if n := gpuDevices(t, l); n > 1 {
		d1 := gpuDevice(t, l, 1)
		b1, err := allocDev(d1, comm.Float32, 4)
		if err != nil {
			t.Fatal(err)
		}
		defer b1.Free()
		if err := comm.AllReduce(ctx, c, b1, b1, comm.Sum); !errors.Is(err, comm.ErrInvalid) || !strings.Contains(err.Error(), "cuda:1") {
			t.Errorf("buffer of another device: %v", err)
		}
	}
	if err := comm.Barrier(ctx, c); err != nil {
		t.Fatalf("rejected calls spoiled the communicator: %v", err)
	}
	if os.Getenv("NCCL_CHECK_POINTERS") != "1" {
		t.Log("NCCL_CHECK_POINTERS is not 1: skipping the bad-pointer collective")
		return
	}
	c2 := gpuStoreComm(t, l, d, "gpu/badptr")
	bad := &devBuf{ctx: d, dt: comm.Float32, ptr: 0x10, n: 4}
	err = comm.AllReduce(ctx, c2, bad, bad, comm.Sum)
	if !errors.Is(err, InvalidArgument) || !errors.Is(err, comm.ErrInvalid) {
		t.Errorf("bad pointer: %v, want ncclInvalidArgument", err)
	}
	t.Logf("bad pointer: %v", err)
	if !errors.Is(c2.Err(), comm.ErrAborted) {
		t.Errorf("the communicator was not aborted: %v", c2.Err())
	}
}

// gpuLauncher runs conformance ranks as communicators on the first p
// devices of this process, reusing one communicator per rank count while
// it stays healthy (NCCL's init takes long enough that a fresh one per
// case would dominate the run).
type gpuLauncher struct {
	l      *Library
	mu     sync.Mutex
	worlds map[int]*world
}

func (g *gpuLauncher) launch(ctx context.Context, p int, fn func(ctx context.Context, c comm.Communicator) error) error {
	g.mu.Lock()
	w := g.worlds[p]
	if w != nil {
		for _, c := range w.comms {
			if c.Err() != nil {
				w.close()
				w = nil
				break
			}
		}
	}
	if w == nil {
		var err error
		if w, err = startWorld(ctx, g.l, p, WithOptions(comm.Options{Timeout: 2 * time.Minute})); err != nil {
			g.mu.Unlock()
			return err
		}
		g.worlds[p] = w
	}
	g.mu.Unlock()
	return w.run(func(r int, c *Comm) error {
		if err := fn(ctx, c); err != nil {
			return fmt.Errorf("rank %d: %w", r, err)
		}
		return nil
	})
}

func (g *gpuLauncher) close() {
	for _, w := range g.worlds {
		w.close()
	}
}

// TestGPUConformance runs the conformance suite on the GPU(s): one rank,
// and, with several devices, up to four ranks, one device each. Host
// buffers go through the staging path. The split case's communicators are
// not closed (the suite has no Close), which is harmless at exit.
func TestGPUConformance(t *testing.T) {
	l := gpuLib(t)
	ranks := []int{1}
	for p := 2; p <= min(gpuDevices(t, l), 4); p++ {
		ranks = append(ranks, p)
	}
	g := &gpuLauncher{l: l, worlds: map[int]*world{}}
	defer g.close()
	commtest.Run(t, g.launch, commtest.Config{Ranks: ranks, Short: os.Getenv("LOOM_NCCL_GPU_FULL") != "1"})
}

// TestGPUTopology reads the GPUs through NVML (comm/nccl/topology), maps
// them to CUDA ordinals by PCI bus id, and orders a one-axis mesh over
// them. Without NVML (a container without libnvidia-ml.so.1) it checks
// the fallback instead.
func TestGPUTopology(t *testing.T) {
	l := gpuLib(t)
	n := gpuDevices(t, l)
	top, err := topology.Discover()
	if err != nil {
		if !errors.Is(err, topology.ErrUnavailable) {
			t.Fatal(err)
		}
		t.Logf("NVML unavailable (%v); fallback: %v", err, topology.Detect(n))
		return
	}
	var bus []string
	for i := range n {
		id, err := gpuDevice(t, l, i).PCIBusID()
		if err != nil {
			t.Fatal(err)
		}
		bus = append(bus, id)
	}
	cudaTop, err := top.ForBusIDs(bus)
	if err != nil {
		t.Fatalf("matching CUDA's bus ids %v with NVML's: %v", bus, err)
	}
	order, err := cudaTop.Order([]int{n})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%vCUDA order for a %d-way axis: %v", cudaTop, n, order)
}
