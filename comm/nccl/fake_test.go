//go:build linux && (amd64 || arm64)

package nccl

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"unsafe"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device/cuda"
	"github.com/b7ea7098/loom/internal/dynlib"
)

// The tests in the *_fake_test.go files load testdata/fakenccl.c, built
// here with gcc, as both NCCL and the CUDA driver. The fake records every
// call with its arguments and runs multi-rank communicators inside the
// process (see the comment at its top), so these tests cover everything
// but the GPU: symbol binding, argument marshalling, the by-value unique
// id, the ncclConfig_t bytes, the order of calls, nonblocking settling,
// error mapping and aborts, and, through the conformance suite, the data
// every collective produces.

// fake is the test-only API of the fake library.
type fake struct {
	path        string
	logLen      func() uintptr
	logCopy     func(dst *byte, n uintptr) uintptr
	logClear    func()
	reset       func()
	setVersion  func(v int32)
	setSettle   func(n int32)
	setAbortPro func(on int32)
	abortDelay  func(us int32)
	fail        func(fn string, rc, count int32)
	setAsync    func(rank, rc int32)
	setLastErr  func(s string)
	live        func(what string) int32
	cfgSizeof   func(v int32) int64
	cfgOffsetof func(v int32, name string) int64
	asyncPolls  func() int64
}

var (
	fakeOnce sync.Once
	fakeLib  *fake
	fakeErr  error
	fakeDir  string
	fakeMu   sync.Mutex // one test at a time drives the shared fake
)

func TestMain(m *testing.M) {
	code := m.Run()
	if fakeDir != "" {
		os.RemoveAll(fakeDir)
	}
	os.Exit(code)
}

// buildFake compiles and binds the fake once per test binary.
func buildFake() (*fake, error) {
	gcc, err := exec.LookPath("gcc")
	if err != nil {
		return nil, fmt.Errorf("no gcc to build the fake NCCL: %w", err)
	}
	dir, err := os.MkdirTemp("", "loom-fakenccl-")
	if err != nil {
		return nil, err
	}
	fakeDir = dir
	lib := filepath.Join(dir, "libfakenccl.so")
	cmd := exec.Command(gcc, "-shared", "-fPIC", "-O1", "-g", "-Wall", "-Werror", "-pthread", "-o", lib, filepath.Join("testdata", "fakenccl.c"))
	if out, err := cmd.CombinedOutput(); err != nil {
		return nil, fmt.Errorf("building the fake NCCL: %v\n%s", err, out)
	}
	dl, err := dynlib.Open(lib)
	if err != nil {
		return nil, err
	}
	f := &fake{path: lib}
	if err := dl.Bind([]dynlib.Symbol{
		{Name: "fake_log_len", Fn: &f.logLen}, {Name: "fake_log_copy", Fn: &f.logCopy}, {Name: "fake_log_clear", Fn: &f.logClear},
		{Name: "fake_reset", Fn: &f.reset}, {Name: "fake_set_version", Fn: &f.setVersion}, {Name: "fake_set_settle_polls", Fn: &f.setSettle},
		{Name: "fake_set_abort_propagates", Fn: &f.setAbortPro},
		{Name: "fake_set_abort_delay", Fn: &f.abortDelay}, {Name: "fake_fail", Fn: &f.fail}, {Name: "fake_set_async", Fn: &f.setAsync},
		{Name: "fake_set_last_error", Fn: &f.setLastErr}, {Name: "fake_live", Fn: &f.live}, {Name: "fake_cfg_sizeof", Fn: &f.cfgSizeof},
		{Name: "fake_cfg_offsetof", Fn: &f.cfgOffsetof}, {Name: "fake_async_polls", Fn: &f.asyncPolls},
	}); err != nil {
		return nil, err
	}
	return f, nil
}

// useFake returns the fake, reset, locked for the test; it skips the test
// when gcc is missing.
func useFake(t *testing.T) *fake {
	t.Helper()
	fakeOnce.Do(func() { fakeLib, fakeErr = buildFake() })
	if fakeErr != nil {
		if strings.Contains(fakeErr.Error(), "no gcc") {
			t.Skip(fakeErr)
		}
		t.Fatal(fakeErr)
	}
	fakeMu.Lock()
	t.Cleanup(fakeMu.Unlock)
	fakeLib.reset()
	return fakeLib
}

// log returns the fake's call log.
func (f *fake) log() string {
	n := f.logLen()
	if n == 0 {
		return ""
	}
	b := make([]byte, n+1024)
	k := f.logCopy(&b[0], uintptr(len(b)))
	return string(b[:k])
}

// lines returns the log lines containing every one of subs.
func (f *fake) lines(subs ...string) []string {
	var out []string
	for _, l := range strings.Split(f.log(), "\n") {
		ok := l != ""
		for _, s := range subs {
			ok = ok && strings.Contains(l, s)
		}
		if ok {
			out = append(out, l)
		}
	}
	return out
}

// clean fails the test if the fake saw a protocol violation: a CUDA call
// without a current context, use of a freed or aborted communicator, a
// bad free, a destroy with work pending, or mismatched operations.
func (f *fake) clean(t *testing.T) {
	t.Helper()
	for _, bad := range []string{"NOCTX", "USE-AFTER-FREE", "USE-AFTER-ABORT", "BADFREE", "DESTROY-PENDING", "MISMATCH", "BADCOMM"} {
		if ls := f.lines(bad); len(ls) > 0 {
			t.Errorf("fake saw %s:\n%s", bad, strings.Join(ls[:min(len(ls), 5)], "\n"))
		}
	}
}

// snapshot returns the fake's live resource counts.
func (f *fake) snapshot() map[string]int32 {
	m := map[string]int32{}
	for _, w := range []string{"allocs", "streams", "events", "comms", "ctxrefs"} {
		m[w] = f.live(w)
	}
	return m
}

// noLeaks fails the test if live resources differ from before.
func (f *fake) noLeaks(t *testing.T, before map[string]int32) {
	t.Helper()
	after := f.snapshot()
	for k, v := range before {
		if after[k] != v {
			t.Errorf("live %s: %d before, %d after", k, v, after[k])
		}
	}
}

// load loads the fake as both libraries, the driver through device/cuda.
func (f *fake) load(t *testing.T, opts ...LoadOption) *Library {
	t.Helper()
	l, err := Load(append([]LoadOption{WithNCCL(f.path), WithCUDA(f.path)}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// hexOf formats bytes as the fake logs them.
func hexOf(b []byte) string { return fmt.Sprintf("%x", b) }

// ptr formats an address as the fake logs it.
func ptr(p uintptr) string { return fmt.Sprintf("0x%x", p) }

// world is p ranks of one communicator on the fake, one device each.
type world struct {
	lib   *Library
	devs  []*cuda.Context
	comms []*Comm
}

// newWorld creates p ranks concurrently (ncclCommInitRankConfig returns
// only once all have joined).
func newWorld(t *testing.T, l *Library, p int, opts ...Option) *world {
	t.Helper()
	w, err := startWorld(context.Background(), l, p, opts...)
	if err != nil {
		t.Fatal(err)
	}
	return w
}

func startWorld(ctx context.Context, l *Library, p int, opts ...Option) (*world, error) {
	w := &world{lib: l, devs: make([]*cuda.Context, p), comms: make([]*Comm, p)}
	id, err := l.UniqueID()
	if err != nil {
		return nil, err
	}
	opts = append([]Option{WithOptions(comm.Options{})}, opts...)
	errs := make([]error, p)
	var wg sync.WaitGroup
	for r := range p {
		wg.Add(1)
		go func() {
			defer wg.Done()
			d, err := l.Driver().Open(r)
			if err != nil {
				errs[r] = err
				return
			}
			w.devs[r] = d
			w.comms[r], errs[r] = l.NewCommFromID(ctx, d, id, r, p, opts...)
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		w.close()
		return nil, err
	}
	return w, nil
}

// run runs fn on every rank concurrently and joins the errors.
func (w *world) run(fn func(r int, c *Comm) error) error {
	errs := make([]error, len(w.comms))
	var wg sync.WaitGroup
	for r, c := range w.comms {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[r] = fn(r, c)
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}

func (w *world) close() error {
	var errs []error
	for _, c := range w.comms {
		if c != nil {
			errs = append(errs, c.Close())
		}
	}
	for _, d := range w.devs {
		if d != nil {
			errs = append(errs, d.Close())
		}
	}
	return errors.Join(errs...)
}

// devBuf is a typed span of device memory, as device/cuda's device buffers
// present themselves to the communicator: a comm.Buffer with a device
// address (Ptr) on "cuda:N". Slices share the allocation; the buffer
// allocDev returns owns it.
type devBuf struct {
	ctx   *cuda.Context
	dt    comm.DType
	alloc cuda.Buffer // zero in slices
	ptr   uintptr
	n     int
}

// allocDev allocates n elements of dt on ctx.
func allocDev(ctx *cuda.Context, dt comm.DType, n int) (*devBuf, error) {
	a, err := ctx.Alloc(n * dt.Size())
	if err != nil {
		return nil, err
	}
	return &devBuf{ctx: ctx, dt: dt, alloc: a, ptr: uintptr(a.Ptr), n: n}, nil
}

// upload allocates a buffer like h on ctx and copies h into it.
func upload(ctx *cuda.Context, h *comm.HostBuffer) (*devBuf, error) {
	b, err := allocDev(ctx, h.DType(), h.Len())
	if err != nil {
		return nil, err
	}
	if err := b.copyFromHost(h); err != nil {
		return nil, errors.Join(err, b.Free())
	}
	return b, nil
}

func (b *devBuf) DType() comm.DType { return b.dt }
func (b *devBuf) Len() int          { return b.n }
func (b *devBuf) Device() string    { return fmt.Sprintf("cuda:%d", b.ctx.Ordinal()) }
func (b *devBuf) Ptr() uintptr      { return b.ptr }

func (b *devBuf) Slice(lo, hi int) comm.Buffer { return b.slice(lo, hi) }

func (b *devBuf) slice(lo, hi int) *devBuf {
	if lo < 0 || hi < lo || hi > b.n {
		panic(fmt.Sprintf("slice [%d:%d] of %d elements", lo, hi, b.n))
	}
	return &devBuf{ctx: b.ctx, dt: b.dt, ptr: b.ptr + uintptr(lo*b.dt.Size()), n: hi - lo}
}

// span is the buffer's memory as device/cuda addresses it.
func (b *devBuf) span() cuda.Buffer {
	return cuda.Buffer{Ptr: cuda.DevicePtr(b.ptr), Bytes: b.n * b.dt.Size()}
}

// Free releases the allocation (a no-op on a slice or a freed buffer).
func (b *devBuf) Free() error {
	a := b.alloc
	b.alloc = cuda.Buffer{}
	return b.ctx.Free(a)
}

func (b *devBuf) copyFromHost(h *comm.HostBuffer) error {
	return cuda.CopyToDevice(b.ctx, b.span(), h.Bytes())
}

// download copies the buffer into a new host buffer.
func (b *devBuf) download() (*comm.HostBuffer, error) {
	h, err := comm.NewHostBuffer(b.dt, b.n)
	if err != nil {
		return nil, err
	}
	return h, cuda.CopyFromDevice(b.ctx, h.Bytes(), b.span())
}

// goString copies a NUL-terminated C string (at most 4 KiB of it).
func goString(p *byte) string {
	if p == nil {
		return ""
	}
	var b []byte
	for i := 0; i < 4096; i++ {
		c := *(*byte)(unsafe.Add(unsafe.Pointer(p), i))
		if c == 0 {
			break
		}
		b = append(b, c)
	}
	return string(b)
}

// cuCode returns the CUresult of the *cuda.Error in err's chain, 0 if none.
func cuCode(err error) int {
	var e *cuda.Error
	if errors.As(err, &e) {
		return e.Code
	}
	return 0
}

// noDriver returns a *cuda.Lib loaded without the driver.
func noDriver(t *testing.T) *cuda.Lib {
	t.Helper()
	l, err := cuda.Load(cuda.WithDriver(cuda.Off), cuda.WithNVRTC(cuda.Off))
	if err != nil {
		t.Fatal(err)
	}
	return l
}
