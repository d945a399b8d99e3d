//go:build linux && (amd64 || arm64)

package cuda

import (
	"errors"
	"math"
	"slices"
	"testing"
	"time"

	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/kernels"
)

// fakeOpen loads the fake driver (without a kernel cache) and opens its
// device; everything is released, and checked for leaks, when the test
// ends.
func fakeOpen(t *testing.T) (*Context, *fakeCounters) {
	t.Helper()
	lib, fc := buildFake(t)
	l, err := Load(WithDriver(lib), WithNVRTC(lib), WithKernelCache(Off))
	if err != nil {
		t.Fatal(err)
	}
	c, err := l.Open(0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		must(t, c.Close())
		must(t, l.Close())
		if a, r, mo, e, s := fc.allocs(), fc.ctxRefs(), fc.modules(), fc.events(), fc.streams(); a != 0 || r != 0 || mo != 0 || e != 0 || s != 0 {
			t.Errorf("leaked: %d allocations, %d context references, %d modules, %d events, %d streams", a, r, mo, e, s)
		}
	})
	return c, fc
}

// otherStream is a device.Stream that is not a CUDA stream.
type otherStream struct{}

func (otherStream) WaitEvent(device.Event) error { return nil }
func (otherStream) Synchronize() error           { return nil }
func (otherStream) Query() (bool, error)         { return true, nil }

// TestFakeStreamOrder checks that work on a stream runs in its order and
// that events order it across streams: the fake runs a stream's queue only
// when something waits for it, so a missing or misdirected wait reads
// stale memory.
func TestFakeStreamOrder(t *testing.T) {
	c, fc := fakeOpen(t)
	a, err := c.NewStream()
	must(t, err)
	defer func() { must(t, a.Close()) }()
	b, err := c.NewStream()
	must(t, err)
	defer func() { must(t, b.Close()) }()
	e, err := c.NewEvent(false)
	must(t, err)
	defer func() { must(t, e.Close()) }()
	if fc.streams() != 2 || fc.events() != 1 {
		t.Fatalf("%d streams, %d events on the driver, want 2 and 1", fc.streams(), fc.events())
	}
	src := dev(t, c, []uint32{1, 2, 3, 4})
	dst := dev(t, c, []uint32{0, 0, 0, 0})
	read := func(buf Buffer) []uint32 { return host[uint32](t, c, buf, 4) }
	query := func(q interface{ Query() (bool, error) }) bool {
		t.Helper()
		done, err := q.Query()
		must(t, err)
		return done
	}

	// a fills src, records e; b waits for e and copies src to dst.
	must(t, a.Memset32(src, 7, 4))
	must(t, e.Record(a))
	must(t, b.WaitEvent(e))
	must(t, b.Copy(dst, src, 16))
	if query(a) || query(b) || query(e) {
		t.Fatal("queued work reported done before anything waited for it")
	}
	if got := read(src); !slices.Equal(got, []uint32{1, 2, 3, 4}) {
		t.Fatalf("src = %v before any stream ran, want it unchanged", got)
	}
	must(t, b.Synchronize())
	if got := read(dst); !slices.Equal(got, []uint32{7, 7, 7, 7}) {
		t.Errorf("dst = %v after b waited for a's event, want a's fill", got)
	}
	if !query(e) || !query(a) || !query(b) {
		t.Error("the event or the streams are not done after b's synchronisation")
	}

	// Without the event, b does not wait for a: the copy reads the old
	// fill. Then a's own synchronisation runs its fill.
	must(t, a.Memset32(src, 9, 4))
	must(t, b.Copy(dst, src, 16))
	must(t, b.Synchronize())
	if got := read(dst); !slices.Equal(got, []uint32{7, 7, 7, 7}) {
		t.Errorf("dst = %v without an event, want the fake to have run b before a", got)
	}
	must(t, a.Synchronize())
	if got := read(src); !slices.Equal(got, []uint32{9, 9, 9, 9}) {
		t.Errorf("src = %v after a's synchronisation", got)
	}

	// Asynchronous copies: the host source is staged at the call, and a
	// copy back waits for the stream's earlier work.
	host4 := []uint32{5, 6, 7, 8}
	must(t, CopyToDeviceAsync(a, dst, host4))
	host4[0] = 99 // reusing the source at once is allowed
	must(t, a.Memset8(src, 0, 8))
	back := make([]uint32, 4)
	must(t, CopyFromDeviceAsync(a, back, dst))
	if !slices.Equal(back, []uint32{5, 6, 7, 8}) {
		t.Errorf("CopyFromDeviceAsync = %v, want the staged 5 6 7 8", back)
	}
	must(t, CopyFromDeviceAsync(a, back, src))
	if !slices.Equal(back, []uint32{0, 0, 9, 9}) {
		t.Errorf("src after Memset8 of 8 bytes = %v", back)
	}

	// Timing events: 3 operations between them take 0.75 ms of fake
	// time; not before they complete, nor without timing.
	t0, err := c.NewEvent(true)
	must(t, err)
	defer func() { must(t, t0.Close()) }()
	t1, err := c.NewEvent(true)
	must(t, err)
	defer func() { must(t, t1.Close()) }()
	must(t, t0.Record(a))
	for range 3 {
		must(t, a.Copy(dst, src, 16))
	}
	must(t, t1.Record(a))
	var ce *Error
	if _, err := t1.Since(t0); !errors.As(err, &ce) || ce.Code != errNotReady || ce.Call != "cuEventElapsedTime" {
		t.Errorf("Since before completion: %v, want CUDA_ERROR_NOT_READY", err)
	}
	must(t, t1.Synchronize())
	if d, err := t1.Since(t0); err != nil || d != 750*time.Microsecond {
		t.Errorf("Since = %v, %v, want 750µs", d, err)
	}
	// The driver itself was told which events time: one made without,
	// passed off as timing, is refused by cuEventElapsedTime.
	e.timing = true
	must(t, e.Record(a))
	must(t, e.Synchronize())
	if _, err := t1.Since(e); !errors.As(err, &ce) || ce.Code != 400 {
		t.Errorf("Since from an event made without timing: %v, want the driver's CUDA_ERROR_INVALID_HANDLE", err)
	}
	e.timing = false
	if d, err := a.Time(func() error { return a.Copy(dst, src, 16) }); err != nil || d != 250*time.Microsecond {
		t.Errorf("Stream.Time = %v, %v, want 250µs", d, err)
	}

	// Misuse is refused before the driver sees it.
	other, err := c.NewStream()
	must(t, err)
	must(t, other.Close())
	must(t, other.Close())
	for _, tc := range []struct {
		name string
		err  error
	}{
		{"Since without timing", func() error { _, err := e.Since(t0); return err }()},
		{"Record on a foreign stream", t0.Record(otherStream{})},
		{"Record on a closed stream", t0.Record(other)},
		{"WaitEvent of a foreign event", a.WaitEvent(nil)},
		{"Synchronize of a closed stream", other.Synchronize()},
		{"Memset32 past the end", a.Memset32(src, 0, 5)},
		{"Memset32 unaligned", a.Memset32(Buffer{Ptr: src.Ptr + 2, Bytes: 8}, 0, 1)},
		{"Copy past the end", a.Copy(dst, src, 17)},
		{"CopyToDeviceAsync too long", CopyToDeviceAsync(a, dst, make([]uint32, 5))},
	} {
		if !errors.Is(tc.err, ErrInvalid) {
			t.Errorf("%s: %v, want ErrInvalid", tc.name, tc.err)
		}
	}
	must(t, c.Legacy().Close()) // a no-op
	must(t, c.Synchronize())
}

// TestFakeMoEOnStream runs the MoE kernels on a non-blocking stream: the
// row maps' upload and the kernels are queued there, and the result shows
// only after the stream is synchronised.
func TestFakeMoEOnStream(t *testing.T) {
	c, _ := fakeOpen(t)
	s, err := c.NewStream()
	must(t, err)
	defer func() { must(t, s.Close()) }()
	if _, err := NewMoE(c, WithStream(&Stream{ctx: &Context{}})); !errors.Is(err, ErrInvalid) {
		t.Errorf("NewMoE with a stream of another context: %v", err)
	}
	m, err := NewMoE(c, WithStream(s))
	must(t, err)
	defer func() { must(t, m.Close()) }()
	if m.Stream() != s {
		t.Fatal("the MoE is not on its stream")
	}
	ids := []int32{0, 1, 1, 0, 2, 1}
	var r kernels.Routing
	must(t, kernels.PlanRouting(&r, ids, 2, 3, 0))
	dr, err := m.Upload(&r)
	must(t, err)
	defer func() { must(t, dr.Free()) }()
	const d = 4
	x := []float32{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}
	dx := dev(t, c, x)
	out := devGarbage[float32](t, c, r.Rows()*d)
	must(t, m.Permute(Float32, out, dx, d, dr))
	if got := host[float32](t, c, out, r.Rows()*d); !math.IsNaN(float64(got[0])) {
		t.Fatalf("Permute's output shows before its stream ran: %v", got)
	}
	must(t, s.Synchronize())
	want := make([]float32, r.Rows()*d)
	must(t, kernels.Permute(want, x, d, &r))
	sameVec(t, "Permute on a stream", host[float32](t, c, out, r.Rows()*d), want, 0)
}

// TestFakeDeviceQueries checks the memory, PCI and shared-memory calls.
func TestFakeDeviceQueries(t *testing.T) {
	c, _ := fakeOpen(t)
	const total = 1 << 36
	if c.TotalMemory() != total {
		t.Errorf("TotalMemory = %d, want %d", c.TotalMemory(), total)
	}
	b, err := c.Alloc(1 << 20)
	must(t, err)
	free, tot, err := c.MemInfo()
	if err != nil || tot != total || free != total-1<<20 {
		t.Errorf("MemInfo = %d, %d, %v; want %d free of %d", free, tot, err, total-1<<20, total)
	}
	must(t, c.Free(b))
	if bus, err := c.PCIBusID(); err != nil || bus != "0000:3B:00.0" {
		t.Errorf("PCIBusID = %q, %v", bus, err)
	}

	m, err := NewMoE(c)
	must(t, err)
	defer func() { must(t, m.Close()) }()
	f, err := m.fn(kGatherW4)
	must(t, err)
	args := []any{Buffer{}, Buffer{}, Buffer{}, int32(1), int64(0), int64(0)}
	var ce *Error
	if err := c.Legacy().Launch(f, Dim3{X: 1}, Dim3{X: 32}, 64<<10, args...); !errors.As(err, &ce) || ce.Call != "cuLaunchKernel" {
		t.Errorf("a 64 KiB launch without the attribute: %v", err)
	}
	must(t, c.SetMaxDynamicSharedMemory(f, 64<<10))
	must(t, c.Legacy().Launch(f, Dim3{X: 1}, Dim3{X: 32}, 64<<10, args...))
	if err := c.SetMaxDynamicSharedMemory(f, 1<<20); !errors.As(err, &ce) || ce.Call != "cuFuncSetAttribute" {
		t.Errorf("1 MiB of shared memory: %v", err)
	}
	if err := c.SetMaxDynamicSharedMemory(Function{}, 1); !errors.Is(err, ErrInvalid) {
		t.Errorf("zero Function: %v", err)
	}
}
