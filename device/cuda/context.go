package cuda

import (
	"errors"
	"fmt"
	"math"
	"runtime"
	"sync"
	"unsafe"
)

// CUdevice_attribute values (cuda.h).
const (
	attrMultiprocessorCount = 16
	attrComputeMajor        = 75
	attrComputeMinor        = 76
)

// DriverVersion returns the driver's CUDA version as major·1000 + minor·10
// (12040 for CUDA 12.4), from cuDriverGetVersion.
func (l *Lib) DriverVersion() (int, error) {
	l.mu.RLock()
	defer l.mu.RUnlock()
	d, err := l.driver("DriverVersion")
	if err != nil {
		return 0, err
	}
	var v int32
	if err := l.cuCheck("cuDriverGetVersion", d.cuDriverGetVersion(&v), ""); err != nil {
		return 0, err
	}
	return int(v), nil
}

// DeviceCount returns the number of CUDA devices (cuDeviceGetCount).
func (l *Lib) DeviceCount() (int, error) {
	l.mu.RLock()
	defer l.mu.RUnlock()
	d, err := l.driver("DeviceCount")
	if err != nil {
		return 0, err
	}
	var n int32
	if err := l.cuCheck("cuDeviceGetCount", d.cuDeviceGetCount(&n), ""); err != nil {
		return 0, err
	}
	return int(n), nil
}

// Context is one device's primary context, retained by [Lib.Open] and
// released by Close. Its methods may be called from any goroutine: each
// locks the goroutine to its OS thread and makes the context current for
// the call. Allocations, modules and events made through it must be freed
// before Close.
type Context struct {
	lib     *Lib
	ordinal int
	dev     int32
	ctx     uintptr
	name    string
	major   int
	minor   int
	sms     int
	total   int64

	mu     sync.RWMutex
	closed bool

	// modMu guards modules, the programs CompileModule loaded, by the
	// key of their source, options and target; Close unloads them.
	modMu      sync.Mutex
	modules    map[string]*Module
	modsClosed bool
}

// Open retains the primary context of device ordinal (0-based) and reads
// its name, compute capability and multiprocessor count.
func (l *Lib) Open(ordinal int) (*Context, error) {
	l.mu.RLock()
	defer l.mu.RUnlock()
	d, err := l.driver("Open")
	if err != nil {
		return nil, err
	}
	if ordinal < 0 || ordinal > math.MaxInt32 {
		return nil, fmt.Errorf("cuda: Open: %w: bad device ordinal %d", ErrInvalid, ordinal)
	}
	what := fmt.Sprintf("opening device %d", ordinal)
	c := &Context{lib: l, ordinal: ordinal}
	if err := l.cuCheck("cuDeviceGet", d.cuDeviceGet(&c.dev, int32(ordinal)), what); err != nil {
		return nil, err
	}
	var name [256]byte
	if err := l.cuCheck("cuDeviceGetName", d.cuDeviceGetName(&name[0], int32(len(name)), c.dev), what); err != nil {
		return nil, err
	}
	c.name = goString(&name[0])
	for _, a := range []struct {
		attr int32
		dst  *int
	}{{attrComputeMajor, &c.major}, {attrComputeMinor, &c.minor}, {attrMultiprocessorCount, &c.sms}} {
		var v int32
		if err := l.cuCheck("cuDeviceGetAttribute", d.cuDeviceGetAttribute(&v, a.attr, c.dev), what); err != nil {
			return nil, err
		}
		*a.dst = int(v)
	}
	var total uintptr
	if err := l.cuCheck("cuDeviceTotalMem_v2", d.cuDeviceTotalMem_v2(&total, c.dev), what); err != nil {
		return nil, err
	}
	c.total = int64(total)
	if err := l.cuCheck("cuDevicePrimaryCtxRetain", d.cuDevicePrimaryCtxRetain(&c.ctx, c.dev), what); err != nil {
		return nil, err
	}
	return c, nil
}

// Name returns the device's name, e.g. "NVIDIA H200".
func (c *Context) Name() string { return c.name }

// Ordinal returns the device ordinal the context was opened on.
func (c *Context) Ordinal() int { return c.ordinal }

// ComputeCapability returns the device's compute capability, e.g. 9, 0.
func (c *Context) ComputeCapability() (major, minor int) { return c.major, c.minor }

// Multiprocessors returns the device's number of SMs.
func (c *Context) Multiprocessors() int { return c.sms }

// TotalMemory returns the device's memory in bytes (cuDeviceTotalMem_v2).
func (c *Context) TotalMemory() int64 { return c.total }

// MemInfo returns the device's free and total memory in bytes as the
// driver sees them, every process's allocations counted (cuMemGetInfo_v2).
func (c *Context) MemInfo() (free, total int64, err error) {
	var f, t uintptr
	err = c.do("MemInfo", func(d *driverFns) error {
		return c.lib.cuCheck("cuMemGetInfo_v2", d.cuMemGetInfo_v2(&f, &t), "")
	})
	if err != nil {
		return 0, 0, err
	}
	return int64(f), int64(t), nil
}

// PCIBusID returns the device's PCI address as the driver reports it
// (cuDeviceGetPCIBusId), "domain:bus:device.function" in hex, for matching
// CUDA ordinals with NVML's devices. It fails with [ErrUnsupported] when
// the driver lacks the entry point.
func (c *Context) PCIBusID() (string, error) {
	var buf [64]byte
	err := c.do("PCIBusID", func(d *driverFns) error {
		if d.cuDeviceGetPCIBusId == nil {
			return fmt.Errorf("cuda: PCIBusID: %w: the CUDA driver has no cuDeviceGetPCIBusId", ErrUnsupported)
		}
		return c.lib.cuCheck("cuDeviceGetPCIBusId", d.cuDeviceGetPCIBusId(&buf[0], int32(len(buf)), c.dev),
			fmt.Sprintf("device %d", c.ordinal))
	})
	if err != nil {
		return "", err
	}
	return goString(&buf[0]), nil
}

// Close unloads the modules of [Context.CompileModule] and releases the
// primary context (cuDevicePrimaryCtxRelease). Free every Buffer, [Stream],
// [Event], [Module] of [Context.LoadModule] and [MoE] made through c
// first. Closing twice is a no-op.
func (c *Context) Close() error {
	if c == nil {
		return nil
	}
	c.modMu.Lock()
	mods := c.modules
	c.modules, c.modsClosed = nil, true
	c.modMu.Unlock()
	var errs []error
	for _, m := range mods {
		errs = append(errs, m.unload())
	}
	if err := errors.Join(errs...); err != nil {
		return err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil
	}
	c.lib.mu.RLock()
	defer c.lib.mu.RUnlock()
	d, err := c.lib.driver("Context.Close")
	if err != nil {
		return err
	}
	c.closed = true
	return c.lib.cuCheck("cuDevicePrimaryCtxRelease_v2", d.cuDevicePrimaryCtxRelease_v2(c.dev),
		fmt.Sprintf("releasing device %d", c.ordinal))
}

// do runs f with the context current on a locked OS thread, holding the
// read locks that keep c and its Lib open.
func (c *Context) do(what string, f func(d *driverFns) error) error {
	if c == nil {
		return fmt.Errorf("cuda: %s: %w: nil Context", what, ErrInvalid)
	}
	c.mu.RLock()
	defer c.mu.RUnlock()
	if c.closed {
		return fmt.Errorf("cuda: %s: %w: Context is closed", what, ErrInvalid)
	}
	c.lib.mu.RLock()
	defer c.lib.mu.RUnlock()
	d, err := c.lib.driver(what)
	if err != nil {
		return err
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := c.lib.cuCheck("cuCtxSetCurrent", d.cuCtxSetCurrent(c.ctx), what); err != nil {
		return err
	}
	return f(d)
}

// Alloc allocates bytes bytes of device memory (cuMemAlloc_v2). Free it
// with [Context.Free]. A zero-byte request returns the zero Buffer.
func (c *Context) Alloc(bytes int) (Buffer, error) {
	if bytes < 0 {
		return Buffer{}, fmt.Errorf("cuda: Alloc: %w: negative size %d", ErrInvalid, bytes)
	}
	if bytes == 0 {
		return Buffer{}, nil
	}
	var p uint64
	err := c.do("Alloc", func(d *driverFns) error {
		return c.lib.cuCheck("cuMemAlloc_v2", d.cuMemAlloc_v2(&p, uintptr(bytes)), fmt.Sprintf("allocating %d bytes", bytes))
	})
	if err != nil {
		return Buffer{}, err
	}
	return Buffer{Ptr: DevicePtr(p), Bytes: bytes}, nil
}

// Free releases a Buffer from [Context.Alloc] (cuMemFree_v2). Freeing the
// zero Buffer is a no-op.
func (c *Context) Free(b Buffer) error {
	if b.Ptr == 0 {
		return nil
	}
	return c.do("Free", func(d *driverFns) error {
		return c.lib.cuCheck("cuMemFree_v2", d.cuMemFree_v2(uint64(b.Ptr)), fmt.Sprintf("freeing %d bytes at %#x", b.Bytes, b.Ptr))
	})
}

// Zero sets the first bytes bytes of b to zero (cuMemsetD8_v2).
func (c *Context) Zero(b Buffer, bytes int) error {
	if bytes < 0 || bytes > b.Bytes {
		return fmt.Errorf("cuda: Zero: %w: %d bytes of a %d-byte buffer", ErrInvalid, bytes, b.Bytes)
	}
	if bytes == 0 {
		return nil
	}
	return c.do("Zero", func(d *driverFns) error {
		return c.lib.cuCheck("cuMemsetD8_v2", d.cuMemsetD8_v2(uint64(b.Ptr), 0, uintptr(bytes)), fmt.Sprintf("zeroing %d bytes", bytes))
	})
}

// CopyDtoD copies the first bytes bytes of src to dst on the device
// (cuMemcpyDtoD_v2), ordered with the kernels launched through c.
func (c *Context) CopyDtoD(dst, src Buffer, bytes int) error {
	if bytes < 0 || bytes > dst.Bytes || bytes > src.Bytes {
		return fmt.Errorf("cuda: CopyDtoD: %w: %d bytes from a %d-byte into a %d-byte buffer", ErrInvalid, bytes, src.Bytes, dst.Bytes)
	}
	if bytes == 0 {
		return nil
	}
	return c.do("CopyDtoD", func(d *driverFns) error {
		return c.lib.cuCheck("cuMemcpyDtoD_v2", d.cuMemcpyDtoD_v2(uint64(dst.Ptr), uint64(src.Ptr), uintptr(bytes)), fmt.Sprintf("copying %d bytes", bytes))
	})
}

// Elem is the element type of host slices copied to and from the device.
type Elem interface {
	~int8 | ~uint8 | ~int16 | ~uint16 | ~int32 | ~uint32 | ~int64 | ~uint64 | ~float32 | ~float64
}

// CopyToDevice copies src into the start of dst (cuMemcpyHtoD_v2, which
// returns once the data has been read). It returns an error when src does
// not fit.
func CopyToDevice[T Elem](c *Context, dst Buffer, src []T) error {
	n := len(src) * int(unsafe.Sizeof(*new(T)))
	if n > dst.Bytes {
		return fmt.Errorf("cuda: CopyToDevice: %w: %d bytes into a %d-byte buffer", ErrInvalid, n, dst.Bytes)
	}
	if n == 0 {
		return nil
	}
	err := c.do("CopyToDevice", func(d *driverFns) error {
		return c.lib.cuCheck("cuMemcpyHtoD_v2", d.cuMemcpyHtoD_v2(uint64(dst.Ptr), unsafe.Pointer(unsafe.SliceData(src)), uintptr(n)),
			fmt.Sprintf("copying %d bytes to the device", n))
	})
	runtime.KeepAlive(src)
	return err
}

// CopyFromDevice copies the start of src into dst (cuMemcpyDtoH_v2, which
// waits for the work before it). It returns an error when src is shorter
// than dst.
func CopyFromDevice[T Elem](c *Context, dst []T, src Buffer) error {
	n := len(dst) * int(unsafe.Sizeof(*new(T)))
	if n > src.Bytes {
		return fmt.Errorf("cuda: CopyFromDevice: %w: %d bytes from a %d-byte buffer", ErrInvalid, n, src.Bytes)
	}
	if n == 0 {
		return nil
	}
	err := c.do("CopyFromDevice", func(d *driverFns) error {
		return c.lib.cuCheck("cuMemcpyDtoH_v2", d.cuMemcpyDtoH_v2(unsafe.Pointer(unsafe.SliceData(dst)), uint64(src.Ptr), uintptr(n)),
			fmt.Sprintf("copying %d bytes from the device", n))
	})
	runtime.KeepAlive(dst)
	return err
}

// Synchronize waits for all work issued through the context
// (cuCtxSynchronize) and returns the first asynchronous error, such as a
// kernel's illegal address.
func (c *Context) Synchronize() error {
	return c.do("Synchronize", func(d *driverFns) error {
		return c.lib.cuCheck("cuCtxSynchronize", d.cuCtxSynchronize(), "")
	})
}

// Module is a loaded CUDA module (cuModuleLoadData); Close unloads it.
type Module struct {
	ctx    *Context
	mod    uintptr
	prog   *Program // the compiled program, for modules of CompileModule
	shared bool     // owned by ctx's module cache: Close leaves it loaded

	mu     sync.Mutex
	closed bool
}

// Function is a kernel of a [Module].
type Function struct {
	name string
	fn   uintptr
}

// Name returns the kernel's name.
func (f Function) Name() string { return f.name }

// LoadModule loads a cubin or NUL-terminated PTX image (cuModuleLoadData).
func (c *Context) LoadModule(image []byte) (*Module, error) {
	if len(image) == 0 {
		return nil, fmt.Errorf("cuda: LoadModule: %w: empty image", ErrInvalid)
	}
	var mod uintptr
	err := c.do("LoadModule", func(d *driverFns) error {
		return c.lib.cuCheck("cuModuleLoadData", d.cuModuleLoadData(&mod, unsafe.Pointer(&image[0])),
			fmt.Sprintf("loading a %d-byte module", len(image)))
	})
	runtime.KeepAlive(image)
	if err != nil {
		return nil, err
	}
	return &Module{ctx: c, mod: mod}, nil
}

// Function looks up an extern "C" kernel by name (cuModuleGetFunction).
func (m *Module) Function(name string) (Function, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return Function{}, fmt.Errorf("cuda: Function %s: %w: Module is closed", name, ErrInvalid)
	}
	var fn uintptr
	err := m.ctx.do("Function", func(d *driverFns) error {
		return m.ctx.lib.cuCheck("cuModuleGetFunction", d.cuModuleGetFunction(&fn, m.mod, name), "looking up kernel "+name)
	})
	if err != nil {
		return Function{}, err
	}
	return Function{name: name, fn: fn}, nil
}

// Program returns the program the module was compiled from, for a module
// of [Context.CompileModule]; nil for one of [Context.LoadModule].
func (m *Module) Program() *Program { return m.prog }

// Close unloads the module (cuModuleUnload). A module of
// [Context.CompileModule] is shared by every caller that compiled the same
// program and stays loaded until the Context closes, so its Close is a
// no-op. Closing twice is a no-op.
func (m *Module) Close() error {
	if m.shared {
		return nil
	}
	return m.unload()
}

// unload unloads the module unless it already is.
func (m *Module) unload() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return nil
	}
	m.closed = true
	return m.ctx.do("Module.Close", func(d *driverFns) error {
		return m.ctx.lib.cuCheck("cuModuleUnload", d.cuModuleUnload(m.mod), "")
	})
}

// CompileModule compiles CUDA C++ source src (name is used in messages)
// for c's device with NVRTC options extra, through the on-disk kernel
// cache ([Lib.Compile]), and loads it. The target is [ChooseArch]'s for
// the device and NVRTC's supported architectures. The module is kept per
// context: compiling the same source with the same options again returns
// the same *Module without calling NVRTC or the driver. It stays loaded
// until c closes (its Close is a no-op). Failures are [Lib.Compile]'s
// (a *CompileError with NVRTC's log) and the driver's.
func (c *Context) CompileModule(src, name string, extra ...string) (*Module, error) {
	if c == nil {
		return nil, fmt.Errorf("cuda: CompileModule %s: %w: nil Context", name, ErrInvalid)
	}
	archs, err := c.lib.SupportedArchs()
	if err != nil {
		return nil, fmt.Errorf("cuda: CompileModule %s: %w", name, err)
	}
	arch, ptx, err := ChooseArch(c.major*10+c.minor, archs)
	if err != nil {
		return nil, err
	}
	o := CompileOptions{Arch: arch, PTX: ptx, Extra: extra}
	// Lib.Compile may turn ptx on (an NVRTC without cubins), which the
	// options then say; the key needs no NVRTC version, as c's Lib has one.
	key := cacheKey(src, CompileFlags(o), arch, ptx, 0, 0)
	c.modMu.Lock()
	defer c.modMu.Unlock()
	if c.modsClosed {
		return nil, fmt.Errorf("cuda: CompileModule %s: %w: Context is closed", name, ErrInvalid)
	}
	if m := c.modules[key]; m != nil {
		return m, nil
	}
	prog, err := c.lib.Compile(src, name, o)
	if err != nil {
		return nil, fmt.Errorf("cuda: CompileModule: %w", err)
	}
	m, err := c.LoadModule(prog.Image)
	if err != nil {
		return nil, fmt.Errorf("cuda: CompileModule %s: %w", name, err)
	}
	m.prog, m.shared = prog, true
	if c.modules == nil {
		c.modules = map[string]*Module{}
	}
	c.modules[key] = m
	return m, nil
}

// SetMaxDynamicSharedMemory lets kernel f take up to bytes of dynamic
// shared memory per block (cuFuncSetAttribute with
// CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES); launches asking for more
// than 48 KiB fail without it.
func (c *Context) SetMaxDynamicSharedMemory(f Function, bytes int) error {
	if f.fn == 0 {
		return fmt.Errorf("cuda: SetMaxDynamicSharedMemory: %w: zero Function", ErrInvalid)
	}
	if bytes < 0 || bytes > math.MaxInt32 {
		return fmt.Errorf("cuda: SetMaxDynamicSharedMemory %s: %w: bad size %d", f.name, ErrInvalid, bytes)
	}
	return c.do("SetMaxDynamicSharedMemory", func(d *driverFns) error {
		return c.lib.cuCheck("cuFuncSetAttribute", d.cuFuncSetAttribute(f.fn, funcMaxDynamicSmem, int32(bytes)),
			fmt.Sprintf("letting %s use %d bytes of shared memory", f.name, bytes))
	})
}

// Launch queues kernel f on s (cuLaunchKernel) with the given grid, block
// and dynamic shared memory, passing args in order (see the package doc
// for the accepted types). It returns once the launch is queued; errors
// in the kernel itself surface at the next synchronising call.
func (s *Stream) Launch(f Function, grid, block Dim3, sharedBytes int, args ...any) error {
	if f.fn == 0 {
		return fmt.Errorf("cuda: Launch: %w: zero Function", ErrInvalid)
	}
	if sharedBytes < 0 || uint64(sharedBytes) > math.MaxUint32 {
		return fmt.Errorf("cuda: Launch %s: %w: bad shared memory size %d", f.name, ErrInvalid, sharedBytes)
	}
	k, err := packArgs(args)
	if err != nil {
		return fmt.Errorf("cuda: Launch %s: %w", f.name, err)
	}
	g, b := grid.norm(), block.norm()
	return s.do("Launch", func(d *driverFns) error {
		var params unsafe.Pointer
		var pin runtime.Pinner
		defer pin.Unpin()
		if len(k.vals) > 0 {
			pin.Pin(&k.vals[0])
			pin.Pin(&k.ptrs[0])
			params = unsafe.Pointer(&k.ptrs[0])
		}
		res := d.cuLaunchKernel(f.fn, g.X, g.Y, g.Z, b.X, b.Y, b.Z, uint32(sharedBytes), s.h, params, nil)
		return s.ctx.lib.cuCheck("cuLaunchKernel", res, fmt.Sprintf("launching %s on grid %v, block %v", f.name, g, b))
	})
}
