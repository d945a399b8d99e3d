//go:build linux && (amd64 || arm64)

package nccl

import (
	"context"
	"errors"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/rendezvous"
	"github.com/b7ea7098/loom/device/cuda"
)

func TestLoadErrors(t *testing.T) {
	f := useFake(t)
	cases := []struct {
		name    string
		setup   func()
		opts    []LoadOption
		want    []error
		mention string
	}{
		{"missing nccl", nil, []LoadOption{WithCUDA(f.path), WithNCCL("/nonexistent/libnccl.so.2")}, []error{ErrUnavailable}, "/nonexistent/libnccl.so.2"},
		{"missing nccl names the variable", nil, []LoadOption{WithCUDA(f.path), WithNCCL("/nonexistent/libnccl.so.2")}, []error{ErrUnavailable}, "set LOOM_NCCL to the path of another copy"},
		{"missing cuda", nil, []LoadOption{WithCUDA("/nonexistent/libcuda.so.1"), WithNCCL(f.path)}, []error{ErrUnavailable}, "no usable CUDA driver library; set LOOM_CUDA_DRIVER to the path of another copy"},
		{"missing cuda lists the attempt", nil, []LoadOption{WithCUDA("/nonexistent/libcuda.so.1"), WithNCCL(f.path)}, []error{ErrUnavailable}, "cuda /nonexistent/libcuda.so.1"},
		{"cuda lib without a driver", nil, []LoadOption{WithDriverLib(noDriver(t)), WithNCCL(f.path)}, []error{ErrUnavailable, cuda.ErrUnsupported}, "has no usable driver"},
		{"off", nil, []LoadOption{WithCUDA(Off), WithNCCL(f.path)}, []error{ErrUnavailable}, "disabled"},
		{"not nccl", nil, []LoadOption{WithCUDA(f.path), WithNCCL("libc.so.6")}, []error{ErrUnavailable}, "missing symbols ncclGetVersion"},
		{"too old", func() { f.setVersion(21305) }, []LoadOption{WithCUDA(f.path), WithNCCL(f.path)}, []error{ErrUnavailable, comm.ErrUnsupported}, "2.13.5"},
		{"no device", func() { f.fail("cuInit", 100, 1) }, []LoadOption{WithCUDA(f.path), WithNCCL(f.path)}, []error{ErrUnavailable}, "cuInit failed with 100 CUDA_ERROR_NO_DEVICE"},
		{"version fails", func() { f.fail("ncclGetVersion", 3, 1) }, []LoadOption{WithCUDA(f.path), WithNCCL(f.path)}, []error{ErrUnavailable, InternalError}, "ncclGetVersion: ncclInternalError (internal error)"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			f.reset()
			if tc.setup != nil {
				tc.setup()
			}
			_, err := Load(tc.opts...)
			for _, w := range tc.want {
				if !errors.Is(err, w) {
					t.Errorf("err = %v, want %v", err, w)
				}
			}
			if err == nil || !strings.Contains(err.Error(), tc.mention) {
				t.Errorf("err = %v, want it to mention %q", err, tc.mention)
			}
		})
	}
	t.Run("env", func(t *testing.T) {
		f.reset()
		t.Setenv(NCCLEnv, Off)
		if _, err := Load(WithCUDA(f.path)); !errors.Is(err, ErrUnavailable) {
			t.Errorf("with %s=off: %v", NCCLEnv, err)
		}
		t.Setenv(NCCLEnv, f.path)
		t.Setenv(cuda.DriverEnv, f.path)
		l, err := Load()
		if err != nil {
			t.Fatal(err)
		}
		if l.NCCLPath() != f.path || l.CUDAPath() != f.path || len(l.Tried()) != 2 {
			t.Errorf("paths %q %q, tried %v", l.NCCLPath(), l.CUDAPath(), l.Tried())
		}
		if v, err := l.DriverVersion(); err != nil || v != 12040 {
			t.Errorf("DriverVersion = %d, %v", v, err)
		}
		if n, err := l.DeviceCount(); err != nil || n != 8 {
			t.Errorf("DeviceCount = %d, %v", n, err)
		}
	})
}

// aborted checks that c was aborted exactly once through ncclCommAbort.
func aborted(t *testing.T, f *fake, c *Comm) {
	t.Helper()
	if !errors.Is(c.Err(), comm.ErrAborted) {
		t.Errorf("Err() = %v, want an abort", c.Err())
	}
	if n := len(f.lines("ncclCommAbort comm=" + ptr(c.h))); n != 1 {
		t.Errorf("ncclCommAbort called %d times, want 1", n)
	}
	if err := comm.Barrier(context.Background(), c); !errors.Is(err, comm.ErrAborted) {
		t.Errorf("a call after the abort: %v, want ErrAborted", err)
	}
}

// TestErrorMapping injects NCCL and CUDA failures into one-rank
// communicators and checks the Go error: the result or CUresult, the call
// named, NCCL's last error, the comm.Error fields, the comm sentinel, and
// that the communicator was aborted with ncclCommAbort.
func TestErrorMapping(t *testing.T) {
	f := useFake(t)
	cases := []struct {
		name     string
		version  int32
		inject   func()
		call     comm.Call
		want     []error
		mention  []string
		noAbort  bool
		cuCode   int // the CUresult of a *cuda.Error, if not 0
		lastErr  string
		wantCall string
	}{
		{name: "unhandled cuda error", inject: func() { f.fail("ncclAllReduce", 1, 1) },
			call: comm.Call{Op: comm.OpAllReduce, Reduce: comm.Sum}, want: []error{UnhandledCudaError},
			lastErr: "Cuda failure 'an illegal memory access'", wantCall: "ncclAllReduce",
			mention: []string{"rank 0", "allreduce #1", "ncclAllReduce: ncclUnhandledCudaError (unhandled cuda error): Cuda failure"}},
		{name: "invalid argument", inject: func() { f.fail("ncclReduce", 4, 1) },
			call: comm.Call{Op: comm.OpReduce, Reduce: comm.Max}, want: []error{InvalidArgument, comm.ErrInvalid}, wantCall: "ncclReduce"},
		{name: "remote error in group", version: 22105, inject: func() { f.fail("ncclGroupEnd", 6, 1) },
			call: comm.Call{Op: comm.OpAllToAll}, want: []error{RemoteError}, wantCall: "ncclGroupEnd",
			mention: []string{"alltoall #1", "remote process exited"}},
		{name: "async error while settling", inject: func() { f.setAsync(-1, 6) },
			call: comm.Call{Op: comm.OpAllGather}, want: []error{RemoteError}, wantCall: "ncclAllGather (async)"},
		{name: "timeout result", inject: func() { f.fail("ncclBroadcast", 8, 1) },
			call: comm.Call{Op: comm.OpBroadcast}, want: []error{Timeout, comm.ErrTimeout}, wantCall: "ncclBroadcast"},
		{name: "illegal address", inject: func() { f.fail("cuEventQuery", 700, 1) },
			call: comm.Call{Op: comm.OpAllReduce, Reduce: comm.Sum}, cuCode: 700,
			mention: []string{"cuEventQuery failed with 700 CUDA_ERROR_ILLEGAL_ADDRESS (an illegal memory access was encountered)"}},
		{name: "staging out of memory", inject: func() { f.fail("cuMemAlloc_v2", 2, 1) },
			call: comm.Call{Op: comm.OpAllReduce, Reduce: comm.Sum}, cuCode: 2,
			mention: []string{"staging 16 bytes", "cuMemAlloc_v2 failed with 2 CUDA_ERROR_OUT_OF_MEMORY (out of memory)"}},
		{name: "event record", inject: func() { f.fail("cuEventRecord", 400, 1) },
			call: comm.Call{Op: comm.OpReduceScatter, Reduce: comm.Sum}, cuCode: 400},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			f.reset()
			if tc.version != 0 {
				f.setVersion(tc.version)
			}
			l := f.load(t)
			w := newWorld(t, l, 1)
			defer w.close()
			c := w.comms[0]
			call := tc.call
			buf := comm.Host([]float32{1, 2, 3, 4})
			if call.Op != comm.OpBarrier {
				call.Send, call.Recv = buf, buf
			}
			if call.Op == comm.OpAllToAll || call.Op == comm.OpReduceScatter {
				call.Recv = comm.Host(make([]float32, 4))
			}
			if tc.lastErr != "" {
				f.setLastErr(tc.lastErr)
			}
			f.logClear()
			tc.inject()
			err := c.Do(context.Background(), call)
			for _, want := range tc.want {
				if !errors.Is(err, want) {
					t.Errorf("err = %v, want %v", err, want)
				}
			}
			var ce *comm.Error
			if !errors.As(err, &ce) || ce.Backend != "nccl" || ce.Rank != 0 || ce.Op != tc.call.Op || ce.Seq != 1 {
				t.Errorf("err = %#v, want a *comm.Error for rank 0, %v #1", err, tc.call.Op)
			}
			if tc.wantCall != "" {
				var ne *NCCLError
				if !errors.As(err, &ne) || ne.Call != tc.wantCall || ne.Msg == "" {
					t.Errorf("NCCLError = %+v, want call %s with a message", ne, tc.wantCall)
				}
			}
			if tc.cuCode != 0 && cuCode(err) != tc.cuCode {
				t.Errorf("err = %v, want a *cuda.Error with CUresult %d", err, tc.cuCode)
			}
			for _, m := range tc.mention {
				if !strings.Contains(err.Error(), m) {
					t.Errorf("error %q does not mention %q", err, m)
				}
			}
			aborted(t, f, c)
			f.setAsync(-1, 0)
			f.clean(t)
		})
	}
}

// TestBadPointers checks device-memory errors: a pointer NCCL rejects, a
// copy to an address that is not device memory, a freed buffer, a buffer
// of another device, and buffer types the backend does not take.
func TestBadPointers(t *testing.T) {
	f := useFake(t)
	l := f.load(t)
	w := newWorld(t, l, 1)
	defer w.close()
	c, d := w.comms[0], w.devs[0]
	ctx := context.Background()

	bad := &devBuf{ctx: d, dt: comm.Float32, ptr: 0xdead0000, n: 4}
	f.setLastErr("")
	err := comm.AllReduce(ctx, c, bad, bad, comm.Sum)
	var ne *NCCLError
	if !errors.Is(err, comm.ErrInvalid) || !errors.As(err, &ne) || !strings.Contains(ne.Detail, "invalid device pointer") {
		t.Errorf("bad pointer: %v", err)
	}
	aborted(t, f, c)

	w2 := newWorld(t, l, 1)
	defer w2.close()
	c2 := w2.comms[0]
	f.logClear()
	cases := []struct {
		name string
		call comm.Call
		want error
		msg  string
	}{
		{"other device", comm.Call{Op: comm.OpBroadcast, Send: otherDevice(t, l), Recv: otherDevice(t, l)}, comm.ErrInvalid, "on cuda:3, the communicator on cuda:0"},
		{"emulated device", comm.Call{Op: comm.OpAllReduce, Send: emuBuf{}, Recv: emuBuf{}, Reduce: comm.Sum}, comm.ErrUnsupported, `on "emu:0"`},
		{"foreign type", comm.Call{Op: comm.OpAllGather, Send: foreign{}, Recv: foreign{}}, comm.ErrUnsupported, "nccl.foreign"},
		{"forced algorithm", comm.Call{Op: comm.OpBarrier, Algorithm: comm.Ring}, comm.ErrUnsupported, "NCCL chooses its own algorithms"},
		{"partial overlap", overlapping(), comm.ErrInvalid, "overlap"},
	}
	for _, tc := range cases {
		err := c2.Do(ctx, tc.call)
		if !errors.Is(err, tc.want) || !strings.Contains(err.Error(), tc.msg) {
			t.Errorf("%s: %v, want %v mentioning %q", tc.name, err, tc.want, tc.msg)
		}
	}
	if got := f.lines("nccl"); len(got) > 0 {
		t.Errorf("rejected calls reached NCCL: %q", got)
	}
	// Rejected locally: the communicator is still usable.
	if err := comm.Barrier(ctx, c2); err != nil {
		t.Errorf("after rejected calls: %v", err)
	}
	f.clean(t)
}

func otherDevice(t *testing.T, l *Library) *devBuf {
	d, err := l.Driver().Open(3)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	return &devBuf{ctx: d, dt: comm.Int32, ptr: 0x1000, n: 2}
}

// emuBuf is a buffer of the emulated device: it has an address (host
// memory) but is no CUDA device's.
type emuBuf struct{}

func (emuBuf) DType() comm.DType            { return comm.Float32 }
func (emuBuf) Len() int                     { return 4 }
func (emuBuf) Slice(lo, hi int) comm.Buffer { return emuBuf{} }
func (emuBuf) Device() string               { return "emu:0" }
func (emuBuf) Ptr() uintptr                 { return 0x1000 }

func overlapping() comm.Call {
	b := comm.Host(make([]float32, 6))
	return comm.Call{Op: comm.OpAllReduce, Send: b.Slice(0, 4), Recv: b.Slice(2, 6), Reduce: comm.Sum}
}

// foreign is a Buffer the backend does not know.
type foreign struct{}

func (foreign) DType() comm.DType            { return comm.Float32 }
func (foreign) Len() int                     { return 1 }
func (foreign) Slice(lo, hi int) comm.Buffer { return foreign{} }
func (foreign) Device() string               { return "tpu:0" }

// TestTimeoutAndPeerFailure: rank 1 never issues the all-reduce, so rank
// 0's call times out, names rank, op and sequence, dumps the flight
// recorder and aborts; rank 1 then sees NCCL's remote error (the fake's
// model of a network transport noticing the abort) on its next call.
func TestTimeoutAndPeerFailure(t *testing.T) {
	f := useFake(t)
	l := f.load(t)
	dir := t.TempDir()
	w := newWorld(t, l, 2, WithOptions(comm.Options{Timeout: 300 * time.Millisecond, DumpDir: dir}))
	defer w.close()
	ctx := context.Background()
	c0, c1 := w.comms[0], w.comms[1]
	if err := w.run(func(r int, c *Comm) error { return comm.Barrier(ctx, c) }); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	err := comm.AllReduce(ctx, c0, comm.Host([]float32{1}), comm.Host([]float32{0}), comm.Sum)
	if time.Since(start) > 5*time.Second {
		t.Errorf("took %v", time.Since(start))
	}
	var ce *comm.Error
	if !errors.Is(err, comm.ErrTimeout) || !errors.As(err, &ce) || ce.Rank != 0 || ce.Op != comm.OpAllReduce || ce.Seq != 2 {
		t.Fatalf("err = %v, want a timeout of rank 0's allreduce #2", err)
	}
	if !strings.Contains(err.Error(), "flight recorder dumped to") {
		t.Errorf("no dump mentioned: %v", err)
	}
	if files, _ := filepath.Glob(filepath.Join(dir, "loom_fr_*rank0_seq2.*")); len(files) != 2 {
		t.Errorf("dump files: %v", files)
	}
	aborted(t, f, c0)
	err = comm.AllReduce(ctx, c1, comm.Host([]float32{1}), comm.Host([]float32{0}), comm.Sum)
	if !errors.Is(err, RemoteError) || !errors.Is(err, comm.ErrAborted) || !strings.Contains(err.Error(), "rank 1: allreduce #2") ||
		!strings.Contains(err.Error(), "aborted by rank 1") {
		t.Errorf("rank 1: %v, want ncclRemoteError naming rank 1's allreduce #2", err)
	}
	f.clean(t)
}

// TestAsyncErrorWhileWaiting: an asynchronous error that appears while a
// call is waiting fails it, naming the pending operation, and aborts. The
// background driver finds the error; the wait must not return before its
// ncclCommAbort has, however long that takes.
func TestAsyncErrorWhileWaiting(t *testing.T) {
	f := useFake(t)
	l := f.load(t)
	w := newWorld(t, l, 2)
	defer w.close()
	c0 := w.comms[0]
	ctx := context.Background()
	wk, err := comm.BroadcastAsync(ctx, c0, comm.Host([]int64{5}), 0)
	if err != nil {
		t.Fatal(err)
	}
	select {
	case <-wk.Done():
		t.Fatal("completed without rank 1")
	case <-time.After(50 * time.Millisecond):
	}
	f.abortDelay(int32((30 * time.Millisecond).Microseconds()))
	f.setAsync(0, int32(SystemError))
	defer f.setAsync(-1, 0)
	<-wk.Done()
	if n := len(f.lines("ncclCommAbort comm=" + ptr(c0.h))); n != 1 {
		t.Errorf("Done closed with ncclCommAbort called %d times, want 1", n)
	}
	err = wk.Wait(ctx)
	if !errors.Is(err, SystemError) || !errors.Is(err, comm.ErrAborted) || !strings.Contains(err.Error(), "broadcast #1") {
		t.Errorf("err = %v", err)
	}
	aborted(t, f, c0)
}

// TestCancel: cancelling the context of a wait aborts the communicator.
func TestCancel(t *testing.T) {
	f := useFake(t)
	l := f.load(t)
	w := newWorld(t, l, 2)
	defer w.close()
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	err := comm.AllGather(ctx, w.comms[0], comm.Host([]uint8{1}), comm.Host([]uint8{0, 0}))
	if !errors.Is(err, context.DeadlineExceeded) || !errors.Is(err, errCancelled) {
		t.Errorf("err = %v", err)
	}
	aborted(t, f, w.comms[0])
}

// TestInitFailures: a failed or stuck ncclCommInitRankConfig is an error
// naming the call and rank, and a stuck one is aborted.
func TestInitFailures(t *testing.T) {
	f := useFake(t)
	l := f.load(t)
	d, err := l.Driver().Open(0)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	id, _ := l.UniqueID()
	f.fail("ncclCommInitRankConfig", int32(SystemError), 1)
	_, err = l.NewCommFromID(context.Background(), d, id, 0, 1, WithOptions(comm.Options{}))
	if !errors.Is(err, SystemError) || !strings.Contains(err.Error(), "rank 0 of 1") || !strings.Contains(err.Error(), "ncclCommInitRankConfig") {
		t.Errorf("failed init: %v", err)
	}
	id, _ = l.UniqueID()
	f.logClear()
	_, err = l.NewCommFromID(context.Background(), d, id, 0, 2, WithOptions(comm.Options{Timeout: 200 * time.Millisecond}))
	if !errors.Is(err, comm.ErrTimeout) || !strings.Contains(err.Error(), "ncclCommInitRankConfig still in progress") {
		t.Errorf("stuck init: %v", err)
	}
	if len(f.lines("ncclCommAbort")) != 1 {
		t.Errorf("stuck init not aborted:\n%s", f.log())
	}
	for _, bad := range []struct{ rank, size int }{{0, 0}, {2, 2}, {-1, 3}} {
		if _, err := l.NewCommFromID(context.Background(), d, id, bad.rank, bad.size); !errors.Is(err, comm.ErrInvalid) {
			t.Errorf("rank %d of %d: %v", bad.rank, bad.size, err)
		}
	}
	f.clean(t)
}

// TestStoreBootstrapAndAbortNotice creates communicators through a
// rendezvous store, then aborts one rank: the other learns of it through
// the store (the fake's NCCL does not propagate aborts here), and its
// pending call fails promptly naming the rank that aborted and why.
func TestStoreBootstrapAndAbortNotice(t *testing.T) {
	f := useFake(t)
	f.setAbortPro(0)
	l := f.load(t)
	ctx := context.Background()
	srv, err := rendezvous.Listen(ctx, "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	const p = 2
	comms := make([]*Comm, p)
	errs := make(chan error, p)
	for r := range p {
		go func() {
			cl, err := rendezvous.Dial(ctx, srv.Addr())
			if err != nil {
				errs <- err
				return
			}
			t.Cleanup(func() { cl.Close() })
			d, err := l.Driver().Open(r)
			if err != nil {
				errs <- err
				return
			}
			t.Cleanup(func() { d.Close() })
			comms[r], err = l.NewComm(ctx, d, cl, "job1/world", r, p, WithOptions(comm.Options{Timeout: time.Minute}))
			errs <- err
		}()
	}
	for range p {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	defer func() {
		for _, c := range comms {
			c.Close()
		}
	}()
	if comms[0].Name() != "job1/world" {
		t.Errorf("Name = %q", comms[0].Name())
	}
	wk, err := comm.AllReduceAsync(ctx, comms[1], comm.Host([]float64{1}), comm.Host([]float64{0}), comm.Sum)
	if err != nil {
		t.Fatal(err)
	}
	comms[0].Abort(errors.New("boom"))
	start := time.Now()
	err = wk.Wait(ctx)
	var ae *comm.AbortError
	if !errors.As(err, &ae) || ae.Rank != 0 || !strings.Contains(err.Error(), "boom") {
		t.Errorf("rank 1: %v, want an abort by rank 0 (boom)", err)
	}
	if time.Since(start) > 10*time.Second {
		t.Errorf("the notice took %v", time.Since(start))
	}
	// Rank 1's watcher fails the pending call first and then calls
	// ncclCommAbort, so the call can return before the abort is logged.
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
		if len(f.lines("ncclCommAbort comm="+ptr(comms[1].h))) > 0 {
			break
		}
	}
	aborted(t, f, comms[1])
	f.clean(t)
}

// TestSplitUnsupported: NCCL before 2.18 has no ncclCommSplit.
func TestSplitUnsupported(t *testing.T) {
	f := useFake(t)
	f.setVersion(21702)
	l := f.load(t)
	if l.HasSplit() {
		t.Fatal("HasSplit with NCCL 2.17")
	}
	w := newWorld(t, l, 1)
	defer w.close()
	_, err := w.comms[0].Split(context.Background(), 0, 0)
	if !errors.Is(err, comm.ErrUnsupported) || !strings.Contains(err.Error(), "needs NCCL 2.18") {
		t.Errorf("Split: %v", err)
	}
	f.clean(t)
}

// TestConsistencyCheck: with the check on, mismatched calls and a call
// one rank rejects fail on every rank before data moves, and the
// communicator stays usable; AllToAllV counts are always checked.
func TestConsistencyCheck(t *testing.T) {
	f := useFake(t)
	l := f.load(t)
	w := newWorld(t, l, 2, WithOptions(comm.Options{ConsistencyCheck: true}))
	defer w.close()
	ctx := context.Background()
	err := w.run(func(r int, c *Comm) error {
		n := 4 + r
		err := comm.AllReduce(ctx, c, comm.Host(make([]float32, n)), comm.Host(make([]float32, n)), comm.Sum)
		var me *comm.MismatchError
		if !errors.As(err, &me) || len(me.Calls) != 2 || me.Calls[1].Count != 5 || !strings.Contains(me.Calls[0].Site, "errors_fake_test.go") {
			return errors.New("mismatch not reported: " + errString(err))
		}
		recv := make([]float32, 4)
		if r == 1 {
			recv = recv[:3] // rejected locally on rank 1
		}
		err = comm.AllReduce(ctx, c, comm.Host(make([]float32, 4)), comm.Host(recv), comm.Sum)
		if !errors.Is(err, comm.ErrInvalid) || !strings.Contains(err.Error(), "rank 1: ") {
			return errors.New("rejection not reported on every rank: " + errString(err))
		}
		// AllToAllV: rank 0 sends 2 to rank 1, which expects 1.
		sc, rc := []int{1, 2}, []int{1, 1}
		if r == 1 {
			sc, rc = []int{1, 1}, []int{1, 1}
		}
		err = comm.AllToAllV(ctx, c, comm.Host(make([]int32, 3)), comm.Host(make([]int32, 2)), sc, rc)
		if !errors.Is(err, comm.ErrInvalid) || !strings.Contains(err.Error(), "rank 0 sends 2 elements to rank 1, which expects 1") {
			return errors.New("counts not checked: " + errString(err))
		}
		x := []float32{float32(r + 1)}
		if err := comm.AllReduce(ctx, c, comm.Host(x), comm.Host(x), comm.Sum); err != nil || x[0] != 3 {
			return errors.New("not usable afterwards: " + errString(err))
		}
		return nil
	})
	if err != nil {
		t.Error(err)
	}
	f.clean(t)
}

func errString(err error) string {
	if err == nil {
		return "<nil>"
	}
	return err.Error()
}

// TestClose: Close refuses while work is pending, finalises and destroys
// a healthy communicator, does not touch an aborted one's freed handle,
// is idempotent, and later calls fail.
func TestClose(t *testing.T) {
	f := useFake(t)
	l := f.load(t)
	before := f.snapshot()
	w := newWorld(t, l, 2)
	ctx := context.Background()
	c0, c1 := w.comms[0], w.comms[1]
	wk, err := comm.BarrierAsync(ctx, c0)
	if err != nil {
		t.Fatal(err)
	}
	if err := c0.Close(); !errors.Is(err, comm.ErrInvalid) || !strings.Contains(err.Error(), "1 operations pending") {
		t.Errorf("Close with pending work: %v", err)
	}
	if err := comm.Barrier(ctx, c1); err != nil {
		t.Fatal(err)
	}
	if err := wk.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	f.logClear()
	if err := c0.Close(); err != nil {
		t.Fatal(err)
	}
	if len(f.lines("ncclCommFinalize comm="+ptr(c0.h))) != 1 || len(f.lines("ncclCommDestroy comm="+ptr(c0.h))) != 1 {
		t.Errorf("close:\n%s", f.log())
	}
	if err := c0.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
	if err := comm.Barrier(ctx, c0); !errors.Is(err, comm.ErrInvalid) {
		t.Errorf("call after Close: %v", err)
	}
	c1.Abort(errors.New("done"))
	f.logClear()
	if err := c1.Close(); err != nil {
		t.Errorf("Close after Abort: %v", err)
	}
	if len(f.lines("ncclCommDestroy")) != 0 || len(f.lines("ncclCommFinalize")) != 0 {
		t.Errorf("an aborted communicator was destroyed again:\n%s", f.log())
	}
	for _, d := range w.devs {
		d.Close()
	}
	f.noLeaks(t, before)
	f.clean(t)
}

// TestDriverOnFake checks that the fake serves as device/cuda's driver:
// the devices, memory, copies, streams and events the communicator uses
// come from there, and a device's buffers are named as the communicator
// expects them.
func TestDriverOnFake(t *testing.T) {
	f := useFake(t)
	l := f.load(t)
	before := f.snapshot()
	d, err := l.Driver().Open(2)
	if err != nil {
		t.Fatal(err)
	}
	if deviceName(d) != "cuda:2" || d.Ordinal() != 2 || d.Lib() != l.Driver() || d.Name() != "Fake NCCL GPU 2" {
		t.Errorf("device %s %d %q", deviceName(d), d.Ordinal(), d.Name())
	}
	if _, err := l.Driver().Open(99); cuCode(err) != 101 {
		t.Errorf("Open(99): %v", err)
	}
	if id, err := d.PCIBusID(); err != nil || id != "0000:30:00.0" {
		t.Errorf("PCIBusID = %q, %v", id, err)
	}
	src := comm.Host([]float64{1, 2, 3, 4, 5})
	b, err := upload(d, src)
	if err != nil {
		t.Fatal(err)
	}
	if b.Device() != "cuda:2" {
		t.Errorf("buffer on %s", b.Device())
	}
	h, err := b.slice(1, 4).download()
	if err != nil || h.Float64s()[0] != 2 || h.Float64s()[2] != 4 {
		t.Errorf("download = %v, %v", h, err)
	}
	f.fail("cuMemAlloc_v2", 2, 1)
	if _, err := allocDev(d, comm.Float32, 1<<20); cuCode(err) != 2 || !strings.Contains(err.Error(), "allocating 4194304 bytes") {
		t.Errorf("OOM: %v", err)
	}
	st, err := d.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	ev, err := d.NewEvent(false)
	if err != nil {
		t.Fatal(err)
	}
	if len(f.lines("cuStreamCreate flags=1")) != 1 || len(f.lines("cuEventCreate flags=2")) != 1 {
		t.Errorf("stream and event flags:\n%s", f.log())
	}
	if err := ev.Record(st); err != nil {
		t.Fatal(err)
	}
	if done, err := ev.Query(); !done || err != nil {
		t.Errorf("event Query = %v, %v", done, err)
	}
	for _, err := range []error{ev.Synchronize(), st.Synchronize(), st.WaitEvent(ev), d.Synchronize()} {
		if err != nil {
			t.Error(err)
		}
	}
	if len(f.lines("cuStreamWaitEvent stream="+ptr(st.Handle())+" event="+ptr(ev.Handle())+" flags=0")) != 1 {
		t.Error("cuStreamWaitEvent arguments")
	}
	// What the nccl tests do not use the fake refuses, naming it.
	if err := st.Memset8(b.span(), 0, 8); cuCode(err) != 801 || !strings.Contains(err.Error(), "CUDA_ERROR_NOT_SUPPORTED") {
		t.Errorf("Memset8 on the fake: %v", err)
	}
	for _, err := range []error{ev.Close(), st.Close(), b.Free(), b.Free(), d.Close(), d.Close()} {
		if err != nil {
			t.Error(err)
		}
	}
	if _, err := allocDev(d, comm.Float32, 1); !errors.Is(err, cuda.ErrInvalid) {
		t.Errorf("Alloc on a closed device: %v", err)
	}
	f.noLeaks(t, before)
	f.clean(t)
}

// TestDriverLib: Load takes the caller's *cuda.Lib (one driver binding
// for NCCL and compute), and a communicator refuses a device of another
// Lib, or a WithStream stream of another device, before NCCL is called.
func TestDriverLib(t *testing.T) {
	f := useFake(t)
	cl, err := cuda.Load(cuda.WithDriver(f.path), cuda.WithNVRTC(cuda.Off))
	if err != nil {
		t.Fatal(err)
	}
	l, err := Load(WithDriverLib(cl), WithNCCL(f.path))
	if err != nil {
		t.Fatal(err)
	}
	if l.Driver() != cl || l.CUDAPath() != f.path {
		t.Errorf("Driver() = %p, want the Lib passed (%p); CUDAPath %q", l.Driver(), cl, l.CUDAPath())
	}
	other := f.load(t)
	d, err := other.Driver().Open(0)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	d1, err := cl.Open(1)
	if err != nil {
		t.Fatal(err)
	}
	defer d1.Close()
	s1, err := d1.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	defer s1.Close()
	mine, err := cl.Open(0)
	if err != nil {
		t.Fatal(err)
	}
	defer mine.Close()
	id, err := l.UniqueID()
	if err != nil {
		t.Fatal(err)
	}
	f.logClear()
	ctx := context.Background()
	if _, err := l.NewCommFromID(ctx, d, id, 0, 1); !errors.Is(err, comm.ErrInvalid) || !strings.Contains(err.Error(), "another *cuda.Lib") {
		t.Errorf("device of another Lib: %v", err)
	}
	if _, err := l.NewCommFromID(ctx, mine, id, 0, 1, WithStream(s1)); !errors.Is(err, comm.ErrInvalid) || !strings.Contains(err.Error(), "WithStream") {
		t.Errorf("stream of another device: %v", err)
	}
	if got := f.lines("nccl"); len(got) > 0 {
		t.Errorf("refused communicators reached NCCL: %q", got)
	}
}
