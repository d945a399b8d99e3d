package emu_test

import (
	"errors"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/b7ea7098/loom"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/device/emu"
)

func newDevice(t *testing.T, opts ...emu.Option) *emu.Device {
	t.Helper()
	d, err := emu.New(0, opts...)
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

// newGate returns a channel that holds stream work until open is called;
// a failing test opens it before the device closes, so Close does not
// wait for it forever.
func newGate(t *testing.T) (gate chan struct{}, open func()) {
	gate = make(chan struct{})
	var once sync.Once
	open = func() { once.Do(func() { close(gate) }) }
	t.Cleanup(open)
	return gate, open
}

func newStream(t *testing.T, d *emu.Device) *emu.Stream {
	t.Helper()
	s, err := d.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	return s.(*emu.Stream)
}

// log records the order in which stream work ran.
type log struct {
	mu  sync.Mutex
	got []string
}

func (l *log) add(s string) func() error {
	return func() error {
		l.mu.Lock()
		defer l.mu.Unlock()
		l.got = append(l.got, s)
		return nil
	}
}

func (l *log) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return strings.Join(l.got, " ")
}

// TestStreamOrder checks that one stream runs its work in FIFO order, and
// that a stream waiting for another's event runs the work queued after
// the wait only once the other stream has reached the event.
func TestStreamOrder(t *testing.T) {
	d := newDevice(t)
	a := d.Compute().(*emu.Stream)
	b := newStream(t, d)
	var l log
	gate, open := newGate(t)
	if err := a.Launch(func() error { <-gate; return nil }); err != nil {
		t.Fatal(err)
	}
	for _, s := range []string{"a1", "a2", "a3"} {
		if err := a.Launch(l.add(s)); err != nil {
			t.Fatal(err)
		}
	}
	ev, err := d.NewEvent(true)
	if err != nil {
		t.Fatal(err)
	}
	if err := ev.Record(a); err != nil {
		t.Fatal(err)
	}
	if err := a.Launch(l.add("a4")); err != nil {
		t.Fatal(err)
	}
	if err := b.Launch(l.add("b1")); err != nil {
		t.Fatal(err)
	}
	if err := b.WaitEvent(ev); err != nil {
		t.Fatal(err)
	}
	if err := b.Launch(l.add("b2")); err != nil {
		t.Fatal(err)
	}
	// b runs b1 and then waits: a is held by the gate.
	deadline := time.Now().Add(5 * time.Second)
	for l.String() != "b1" && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	time.Sleep(20 * time.Millisecond)
	if got := l.String(); got != "b1" {
		t.Fatalf("before a ran: %q, want %q", got, "b1")
	}
	for _, q := range []interface{ Query() (bool, error) }{a, b, ev} {
		if done, err := q.Query(); done || err != nil {
			t.Fatalf("Query %T = %v, %v while the work waits", q, done, err)
		}
	}
	open()
	if err := b.Synchronize(); err != nil {
		t.Fatal(err)
	}
	// b2 comes after a3 (the event); a4 may run before or after b2.
	got := l.String()
	if !strings.HasPrefix(got, "b1 a1 a2 a3") || strings.Index(got, "b2") < strings.Index(got, "a3") {
		t.Fatalf("order %q: want b1 a1 a2 a3 before b2", got)
	}
	if err := d.Synchronize(); err != nil {
		t.Fatal(err)
	}
	if done, _ := ev.Query(); !done {
		t.Fatal("event not complete after Synchronize")
	}
}

// TestEventTiming checks Since against host time across a recorded sleep.
func TestEventTiming(t *testing.T) {
	d := newDevice(t)
	s := d.Compute()
	start, _ := d.NewEvent(true)
	end, _ := d.NewEvent(true)
	untimed, _ := d.NewEvent(false)
	if err := start.Record(s); err != nil {
		t.Fatal(err)
	}
	if err := s.(*emu.Stream).Launch(func() error { time.Sleep(30 * time.Millisecond); return nil }); err != nil {
		t.Fatal(err)
	}
	if err := end.Record(s); err != nil {
		t.Fatal(err)
	}
	if err := untimed.Record(s); err != nil {
		t.Fatal(err)
	}
	if err := end.Synchronize(); err != nil {
		t.Fatal(err)
	}
	el, err := end.Since(start)
	if err != nil {
		t.Fatal(err)
	}
	if el < 30*time.Millisecond || el > 5*time.Second {
		t.Fatalf("Since = %v across a 30 ms sleep", el)
	}
	if _, err := untimed.Since(start); !errors.Is(err, device.ErrInvalid) {
		t.Fatalf("Since of an event without timing: %v", err)
	}
	never, _ := d.NewEvent(true)
	if _, err := never.Since(start); !errors.Is(err, device.ErrInvalid) {
		t.Fatalf("Since of an event never recorded: %v", err)
	}
	if err := never.Close(); err != nil {
		t.Fatal(err)
	}
	if err := never.Record(s); !errors.Is(err, device.ErrInvalid) {
		t.Fatalf("Record after Close: %v", err)
	}
}

// TestOutOfMemory fills a capped device: the request beyond the cap is an
// *OOMError naming the request, a smaller one then succeeds, and freeing
// everything and emptying the cache leaves nothing held.
func TestOutOfMemory(t *testing.T) {
	d := newDevice(t, emu.WithMemory(64<<20))
	held, err := d.Alloc(comm.Float32, 6<<20) // 24 MiB: its own segment
	if err != nil {
		t.Fatal(err)
	}
	_, err = d.Alloc(comm.Float32, 12<<20) // 48 MiB more: over the cap
	var oom *device.OOMError
	if !errors.As(err, &oom) || !errors.Is(err, device.ErrOutOfMemory) {
		t.Fatalf("allocating past the cap: %v", err)
	}
	if oom.Requested != 48<<20 || oom.Total != 64<<20 || oom.Device != "emu:0" || !strings.Contains(err.Error(), "48.0 MiB") {
		t.Fatalf("OOMError %+v: %v", oom, err)
	}
	small, err := d.Alloc(comm.Float32, 4<<20)
	if err != nil {
		t.Fatalf("a smaller request after the OOM: %v", err)
	}
	k := d.Kernels()
	if err := k.Fill(small, 2); err != nil {
		t.Fatal(err)
	}
	out := make([]float32, small.Len())
	if err := d.CopyToHost(comm.Host(out), small); err != nil {
		t.Fatal(err)
	}
	if out[0] != 2 || out[len(out)-1] != 2 {
		t.Fatalf("the buffer after the OOM holds %v … %v", out[0], out[len(out)-1])
	}
	for _, b := range []device.Buffer{held, small} {
		if err := b.Free(); err != nil {
			t.Fatal(err)
		}
	}
	if err := d.Memory().EmptyCache(); err != nil {
		t.Fatal(err)
	}
	st := d.Memory().Stats()
	if st.Allocated != 0 || st.Reserved != 0 || st.Segments != 0 || st.OOMs != 1 {
		t.Fatalf("after freeing everything: %+v", st)
	}
	if st.DriverAllocs != st.DriverFrees {
		t.Fatalf("%d driver allocations, %d frees", st.DriverAllocs, st.DriverFrees)
	}
}

// TestFreeWaitsForOtherStream frees a buffer still in use on another
// stream: its memory is not handed out again until that stream has
// reached the point of the free.
func TestFreeWaitsForOtherStream(t *testing.T) {
	d := newDevice(t)
	side := newStream(t, d)
	b, err := d.Alloc(comm.Float32, 1000)
	if err != nil {
		t.Fatal(err)
	}
	p := b.Ptr()
	gate, open := newGate(t)
	if err := side.Launch(func() error { <-gate; return nil }); err != nil {
		t.Fatal(err)
	}
	if err := d.RecordStream(b, side); err != nil {
		t.Fatal(err)
	}
	if err := b.Free(); err != nil {
		t.Fatal(err)
	}
	early, err := d.Alloc(comm.Float32, 1000)
	if err != nil {
		t.Fatal(err)
	}
	if early.Ptr() == p {
		t.Fatal("the freed buffer was reused while another stream still used it")
	}
	open()
	if err := side.Synchronize(); err != nil {
		t.Fatal(err)
	}
	late, err := d.Alloc(comm.Float32, 1000)
	if err != nil {
		t.Fatal(err)
	}
	if late.Ptr() != p {
		t.Fatalf("after the stream finished, got %#x, want the freed %#x", late.Ptr(), p)
	}
	for _, x := range []device.Buffer{early, late} {
		if err := x.Free(); err != nil {
			t.Fatal(err)
		}
	}
	if st := d.Memory().Stats(); st.Allocated != 0 || st.Pending != 0 {
		t.Fatalf("leak: %+v", st)
	}
}

// TestCopyFromHostReadsNow checks that CopyFromHost has read its source
// when it returns, though the copy itself waits behind other work.
func TestCopyFromHostReadsNow(t *testing.T) {
	d := newDevice(t)
	b, err := d.Alloc(comm.Float32, 3)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Free()
	gate, open := newGate(t)
	if err := d.Compute().(*emu.Stream).Launch(func() error { <-gate; return nil }); err != nil {
		t.Fatal(err)
	}
	src := []float32{1, 2, 3}
	if err := d.CopyFromHost(b, comm.Host(src)); err != nil {
		t.Fatal(err)
	}
	src[0] = 9
	open()
	got := make([]float32, 3)
	if err := d.CopyToHost(comm.Host(got), b); err != nil {
		t.Fatal(err)
	}
	if got[0] != 1 {
		t.Fatalf("copied %v: the source was read after CopyFromHost returned", got)
	}
	// Copy on the device, and the slice of a buffer.
	c, _ := d.Alloc(comm.Float32, 2)
	defer c.Free()
	if err := d.Copy(c, b.Slice(1, 3).(device.Buffer)); err != nil {
		t.Fatal(err)
	}
	if err := d.CopyToHost(comm.Host(got[:2]), c); err != nil {
		t.Fatal(err)
	}
	if got[0] != 2 || got[1] != 3 {
		t.Fatalf("Copy of a slice: %v", got[:2])
	}
}

// TestErrors checks the errors found before work is queued (each wraps
// device.ErrInvalid and names the device and op), and that an error a
// kernel finds while it runs comes back from Synchronize once, leaving
// the device usable.
func TestErrors(t *testing.T) {
	d := newDevice(t)
	other := newDevice(t)
	k := d.Kernels()
	buf := func(d *emu.Device, dt comm.DType, n int) device.Buffer {
		b, err := d.Alloc(dt, n)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	x, y := buf(d, comm.Float32, 8), buf(d, comm.Float32, 8)
	theirs := buf(other, comm.Float32, 8)
	wide := buf(d, comm.Float64, 8)
	freed := buf(d, comm.Float32, 8)
	if err := freed.Free(); err != nil {
		t.Fatal(err)
	}
	hostBuf, _ := device.Host().Alloc(comm.Float32, 8)
	cases := []struct {
		name string
		err  error
		want string
		is   error
	}{
		{"mixed emu devices", k.Add(x, x, theirs), "inputs on two devices named emu:0", device.ErrMixed},
		{"host buffer", k.Mul(x, hostBuf, y), "inputs on emu:0 and host", device.ErrMixed},
		{"wrong dtype", k.Add(x, wide, y), "a is float64", device.ErrInvalid},
		{"freed buffer", k.Softmax(x, freed, 8, false), "src was freed", device.ErrInvalid},
		{"nil buffer", k.Add(nil, x, y), "dst is nil", device.ErrInvalid},
		{"free twice", freed.Free(), "freed already", device.ErrInvalid},
		{"free a slice", x.Slice(0, 4).(device.Buffer).Free(), "slice does not own", device.ErrInvalid},
		{"copy lengths", d.Copy(x, x.Slice(0, 4).(device.Buffer)), "destination of 8 elements, source of 4", device.ErrInvalid},
		{"copy dtypes", d.CopyFromHost(x, comm.Host(make([]float64, 8))), "float32 destination, float64 source", device.ErrInvalid},
		{"cast", k.Cast(wide, buf(d, comm.BFloat16, 8)), "no cast from bfloat16 to float64", device.ErrInvalid},
		{"gemm batch", k.Gemm(device.Gemm{M: 1, N: 1, K: 1, A: x, B: x, C: x, LDA: 1, LDB: 1, LDC: 1, Batch: 3, StrideA: 5}), "passes the end of A", device.ErrInvalid},
		{"gemm bf16 float64", k.Gemm(device.Gemm{M: 1, N: 1, K: 1, A: wide, B: wide, C: wide, LDA: 1, LDB: 1, LDC: 1, Precision: device.GemmBF16}), "a bfloat16 GEMM takes Float32 buffers, not float64", device.ErrInvalid},
		{"gemm precision", k.Gemm(device.Gemm{M: 1, N: 1, K: 1, A: x, B: x, C: x, LDA: 1, LDB: 1, LDC: 1, Precision: 7}), "precision GemmPrecision(7)", device.ErrInvalid},
		{"bad dtype alloc", func() error { _, err := d.Alloc(comm.DType(99), 1); return err }(), "invalid dtype", device.ErrInvalid},
		{"negative alloc", func() error { _, err := d.Alloc(comm.Float32, -1); return err }(), "must be zero or positive", device.ErrInvalid},
		{"negative index", func() error { _, err := emu.New(-1); return err }(), "emu.New index -1", device.ErrInvalid},
		{"zero memory", func() error { _, err := emu.New(0, emu.WithMemory(0)); return err }(), "emu.WithMemory", device.ErrInvalid},
		{"nil BLAS", func() error { _, err := emu.New(0, emu.WithBLAS(nil)); return err }(), "WithBLAS(nil)", device.ErrInvalid},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if c.err == nil || !errors.Is(c.err, c.is) || !errors.Is(c.err, loom.ErrInvalid) || !strings.Contains(c.err.Error(), c.want) {
				t.Fatalf("got %v, want an error matching %v and loom.ErrInvalid, containing %q", c.err, c.is, c.want)
			}
		})
	}
	if err := d.Synchronize(); err != nil {
		t.Fatalf("nothing bad was queued: %v", err)
	}

	// A length the kernel rejects when it runs.
	if err := k.Softmax(x, x, 3, false); err != nil {
		t.Fatalf("queueing: %v", err)
	}
	err := d.Synchronize()
	// The error names the kernel and the call that queued it (this
	// test), not only the Synchronize that reports it.
	if !errors.Is(err, loom.ErrInvalid) || !strings.Contains(err.Error(), "emu:0: Softmax: kernels: SoftmaxRows") ||
		!strings.Contains(err.Error(), "queued by emu_test.TestErrors (emu_test.go:") || !strings.Contains(err.Error(), "reported at the next synchronisation") {
		t.Fatalf("Synchronize after a bad Softmax: %v", err)
	}
	if err := d.Synchronize(); err != nil {
		t.Fatalf("the error came back twice: %v", err)
	}
	if err := k.Fill(x, 1); err != nil {
		t.Fatal(err)
	}
	got := make([]float32, 8)
	if err := d.CopyToHost(comm.Host(got), x); err != nil || got[7] != 1 {
		t.Fatalf("after the error: %v, %v", got, err)
	}

	// Under Synchronous the error comes from the call, and a panic of a
	// launched function is an error, not a crash.
	s := newDevice(t, emu.WithSynchronous())
	sx, _ := s.Alloc(comm.Float32, 8)
	if err := s.Kernels().Softmax(sx, sx, 3, false); !errors.Is(err, loom.ErrInvalid) {
		t.Fatalf("Synchronous Softmax: %v", err)
	}
	if err := s.Compute().(*emu.Stream).Launch(func() error { panic("boom") }); err == nil || !strings.Contains(err.Error(), "panic: boom") {
		t.Fatalf("panic under Synchronous: %v", err)
	}
	if err := d.Compute().(*emu.Stream).Launch(func() error { panic("boom") }); err != nil {
		t.Fatal(err)
	}
	if err := d.Synchronize(); err == nil || !strings.Contains(err.Error(), "panic: boom") {
		t.Fatalf("panic on a stream: %v", err)
	}

	// After Close nothing is queued.
	c, _ := emu.New(1)
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Alloc(comm.Float32, 1); !errors.Is(err, device.ErrInvalid) {
		t.Fatalf("Alloc after Close: %v", err)
	}
	if err := c.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
}

// TestDeviceBasics checks names, kinds, buffer views and Same.
func TestDeviceBasics(t *testing.T) {
	d, err := emu.New(3)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if d.Name() != "emu:3" || d.Kind() != device.KindEmulated || d.Kind().String() != "emulated" {
		t.Fatalf("name %q kind %v", d.Name(), d.Kind())
	}
	b, err := d.Alloc(comm.Float64, 5)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Free()
	if b.Device() != "emu:3" || b.Owner() != device.Device(d) || b.Ptr()%256 != 0 || b.Len() != 5 || b.DType() != comm.Float64 {
		t.Fatalf("buffer %s %v %#x %d %v", b.Device(), b.Owner(), b.Ptr(), b.Len(), b.DType())
	}
	hv := b.(comm.HostBacked).HostView()
	if hv.Len() != 5 || hv.DType() != comm.Float64 {
		t.Fatalf("HostView %d %v", hv.Len(), hv.DType())
	}
	sl := b.Slice(2, 4).(device.Buffer)
	if sl.Ptr() != b.Ptr()+16 || sl.Len() != 2 {
		t.Fatalf("slice at %#x (buffer at %#x), %d elements", sl.Ptr(), b.Ptr(), sl.Len())
	}
	if d.Compute().(*emu.Stream).Owner() != device.Device(d) {
		t.Fatal("Compute().Owner() is not the device")
	}
	if err := device.Same("op", d, d); err != nil {
		t.Fatal(err)
	}
	if err := device.Same("autograd: Linear", d, device.Host()); !errors.Is(err, device.ErrMixed) ||
		err.Error() != "autograd: Linear: data on different devices: inputs on emu:3 and host" {
		t.Fatalf("Same: %v", err)
	}
}

// TestLostBufferFreed: a buffer dropped without Free is given back to the
// allocator once it and its slices are unreachable (the safety net for op
// results a caller never frees), and not while a slice is still live.
func TestLostBufferFreed(t *testing.T) {
	d := newDevice(t)
	b, err := d.Alloc(comm.Float32, 1000)
	if err != nil {
		t.Fatal(err)
	}
	s := b.Slice(10, 20).(device.Buffer)
	b = nil
	for range 3 {
		runtime.GC()
	}
	time.Sleep(10 * time.Millisecond)
	if d.Memory().Stats().Allocated == 0 {
		t.Fatal("a buffer with a live slice was freed")
	}
	if err := d.Kernels().Fill(s, 1); err != nil {
		t.Fatal(err)
	}
	if err := d.Synchronize(); err != nil {
		t.Fatal(err)
	}
	runtime.KeepAlive(s)
	s = nil
	deadline := time.Now().Add(5 * time.Second)
	for d.Memory().Stats().Allocated != 0 {
		if time.Now().After(deadline) {
			t.Fatal("a lost buffer was not freed")
		}
		runtime.GC()
		time.Sleep(time.Millisecond)
	}
	// A buffer freed by its owner is not freed again by the cleanup.
	c, err := d.Alloc(comm.Float32, 1000)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Free(); err != nil {
		t.Fatal(err)
	}
	keep, err := d.Alloc(comm.Float32, 1000) // may reuse c's block
	if err != nil {
		t.Fatal(err)
	}
	c = nil
	for range 3 {
		runtime.GC()
	}
	time.Sleep(10 * time.Millisecond)
	if got := d.Memory().Stats().Allocated; got == 0 {
		t.Fatal("the cleanup of a freed buffer freed its block again")
	}
	if err := keep.Free(); err != nil {
		t.Fatal(err)
	}
}
