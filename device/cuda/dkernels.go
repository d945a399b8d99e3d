package cuda

import (
	"fmt"
	"math"
	"slices"

	"github.com/b7ea7098/loom"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/internal/checked"
	"github.com/b7ea7098/loom/internal/half"
	"github.com/b7ea7098/loom/kernels"
)

// cudaKernels is a Device's device.Kernels: each method checks its
// buffers, dtypes and lengths now (a kernel given a short buffer would
// read or write outside it, where the CPU kernel returns an error), then
// queues NVRTC kernels and cuBLAS calls on the compute stream. The
// kernels are those of kernels/*.cu, compiled once per context.
type cudaKernels struct{ d *Device }

var _ device.Kernels = cudaKernels{}

// Launch shapes. Grid-stride loops make any grid correct; these keep
// enough blocks in flight without launching more than the device runs at
// once.
const (
	blockThreads  = 256 // 1-D blocks: 8 warps
	warpsPerBlock = blockThreads / 32
	blocksPerSM   = 16 // grid cap per multiprocessor
)

// arg is one buffer argument of a kernel: its name, the buffer, the
// dtypes it may have, and whether it may be nil.
type arg struct {
	name     string
	b        device.Buffer
	dtypes   []comm.DType
	optional bool
}

func f32(name string, b device.Buffer) arg {
	return arg{name: name, b: b, dtypes: []comm.DType{comm.Float32}}
}

func optF32(name string, b device.Buffer) arg {
	return arg{name: name, b: b, dtypes: []comm.DType{comm.Float32}, optional: true}
}

func f64(name string, b device.Buffer, optional bool) arg {
	return arg{name: name, b: b, dtypes: []comm.DType{comm.Float64}, optional: optional}
}

func i64s(name string, b device.Buffer) arg {
	return arg{name: name, b: b, dtypes: []comm.DType{comm.Int64}}
}

// check validates the arguments of op and returns them as device
// buffers, nil for a nil optional one.
func (k cudaKernels) check(op string, args ...arg) ([]*DeviceBuffer, error) {
	if err := k.d.live(op); err != nil {
		return nil, err
	}
	out := make([]*DeviceBuffer, len(args))
	for i, a := range args {
		b, err := k.d.buffer(op, a.name, a.b, a.optional)
		if err != nil {
			return nil, err
		}
		if b == nil {
			continue
		}
		ok := false
		for _, dt := range a.dtypes {
			ok = ok || b.DType() == dt
		}
		if !ok {
			if len(a.dtypes) == 1 && a.dtypes[0] == comm.Float32 && b.DType() == comm.Float64 {
				return nil, unsupported(k.d, op, "float64 %s: the kernel exists for float32 only", a.name)
			}
			return nil, k.invalid(op, "%s is %v, want %v", a.name, b.DType(), a.dtypes)
		}
		out[i] = b
	}
	return out, nil
}

// invalid is an error of op wrapping device.ErrInvalid.
func (k cudaKernels) invalid(op, format string, args ...any) error {
	return fmt.Errorf("%s: %s: %w: %s", k.d.name, op, device.ErrInvalid, fmt.Sprintf(format, args...))
}

// unsupported is an error of op wrapping loom.ErrUnsupported: a
// well-formed request this device has no kernel for.
func unsupported(d *Device, op, format string, args ...any) error {
	return fmt.Errorf("%s: %s: %w: %s", d.name, op, loom.ErrUnsupported, fmt.Sprintf(format, args...))
}

// lens checks that each buffer holds want elements (names for errors).
func (k cudaKernels) lens(op string, want int, names string, bufs ...*DeviceBuffer) error {
	for i, b := range bufs {
		if b != nil && b.Len() != want {
			return k.invalid(op, "%c has %d elements, want %d", names[i], b.Len(), want)
		}
	}
	return nil
}

// rowsOf returns how many rows of n elements b holds, or an error when n
// is not positive or does not divide b's length.
func (k cudaKernels) rowsOf(op string, b *DeviceBuffer, name string, n int) (int, error) {
	if n <= 0 {
		return 0, k.invalid(op, "row length %d", n)
	}
	if b.Len()%n != 0 {
		return 0, k.invalid(op, "%s has %d elements, not whole rows of %d", name, b.Len(), n)
	}
	return b.Len() / n, nil
}

// function returns kernel name of kernels/file, compiling the file for
// the device at its first use.
func (d *Device) function(op, file, name string) (Function, error) {
	d.fnMu.Lock()
	defer d.fnMu.Unlock()
	if f, ok := d.fns[name]; ok {
		return f, nil
	}
	var src KernelFile
	for _, f := range KernelFiles() {
		if f.Name == file {
			src = f
		}
	}
	if src.Name == "" {
		return Function{}, fmt.Errorf("%s: %s: internal: no kernel file %s", d.name, op, file)
	}
	m, err := d.ctx.CompileModule(src.Source(), src.Name)
	if err != nil {
		return Function{}, fmt.Errorf("%s: %s: %w", d.name, op, err)
	}
	f, err := m.Function(name)
	if err != nil {
		return Function{}, fmt.Errorf("%s: %s: %w", d.name, op, err)
	}
	if d.fns == nil {
		d.fns = map[string]Function{}
	}
	d.fns[name] = f
	return f, nil
}

// launch queues kernel name of file on the compute stream.
func (k cudaKernels) launch(op, file, name string, grid, block Dim3, smem int, args ...any) error {
	f, err := k.d.function(op, file, name)
	if err != nil {
		return err
	}
	if err := k.d.compute.Launch(f, grid, block, smem, args...); err != nil {
		return fmt.Errorf("%s: %s: %w", k.d.name, op, err)
	}
	return nil
}

// gridFor is the grid of blockThreads-thread blocks for n work items,
// each block taking per items per pass, capped.
func (k cudaKernels) gridFor(n, per int) Dim3 {
	g := (n + per - 1) / per
	return Dim3{X: uint32(max(1, min(g, blocksPerSM*max(k.d.ctx.Multiprocessors(), 1))))}
}

// elementwise queues a grid-stride kernel over n elements; nothing for
// n = 0.
func (k cudaKernels) elementwise(op, file, name string, n int, args ...any) error {
	if n == 0 {
		return nil
	}
	return k.launch(op, file, name, k.gridFor(n, blockThreads), Dim3{X: blockThreads}, 0, args...)
}

// rowwise queues a warp-per-row kernel over rows rows; nothing for 0.
func (k cudaKernels) rowwise(op, file, name string, rows int, args ...any) error {
	if rows == 0 {
		return nil
	}
	return k.launch(op, file, name, k.rowGrid(rows), Dim3{X: blockThreads}, 0, args...)
}

func (k cudaKernels) rowGrid(rows int) Dim3 { return k.gridFor(rows, warpsPerBlock) }

// sumMid queues loom_sum_mid_f32: out[o, i] = Σ_m x[o, m, i].
func (k cudaKernels) sumMid(op string, out, x Buffer, outer, mid, inner int) error {
	if outer*inner == 0 {
		return nil
	}
	const bx, by = 32, 8
	tiles := (inner + bx - 1) / bx
	return k.launch(op, "elementwise.cu", "loom_sum_mid_f32", k.gridFor(outer*tiles, 1), Dim3{X: bx, Y: by}, 8*bx*by,
		out, x, int64(outer), int64(mid), int64(inner))
}

// scratch allocates a temporary of n elements on the compute stream; the
// caller frees it once the work that uses it is queued (the allocator
// reuses it only on the same stream, after that work).
func (k cudaKernels) scratch(dt comm.DType, n int) (*DeviceBuffer, error) {
	b, err := k.d.Alloc(dt, n)
	if err != nil {
		return nil, err
	}
	return b.(*DeviceBuffer), nil
}

// withScratch runs f with temporaries of the given sizes (dtype dt) and
// frees them after.
func (k cudaKernels) withScratch(dt comm.DType, sizes []int, f func(s []*DeviceBuffer) error) error {
	s := make([]*DeviceBuffer, 0, len(sizes))
	defer func() {
		for _, b := range s {
			// Free of a live, owning buffer cannot fail but for a bug.
			_ = b.Free()
		}
	}()
	for _, n := range sizes {
		b, err := k.scratch(dt, n)
		if err != nil {
			return err
		}
		s = append(s, b)
	}
	return f(s)
}

// Gemm runs one GEMM, or a strided batch, on cuBLAS: float32 (TF32 when
// the BLAS allows it) or float64.
func (k cudaKernels) Gemm(g device.Gemm) error {
	const op = "Gemm"
	dts := []comm.DType{comm.Float32, comm.Float64}
	v, err := k.check(op, arg{name: "A", b: g.A, dtypes: dts}, arg{name: "B", b: g.B, dtypes: dts}, arg{name: "C", b: g.C, dtypes: dts})
	if err != nil {
		return err
	}
	if v[0].DType() != v[1].DType() || v[0].DType() != v[2].DType() {
		return k.invalid(op, "A, B and C are %v, %v and %v", v[0].DType(), v[1].DType(), v[2].DType())
	}
	if g.Batch < 0 || g.M < 0 || g.N < 0 || g.K < 0 {
		return k.invalid(op, "negative size: M %d, N %d, K %d, batch %d", g.M, g.N, g.K, g.Batch)
	}
	batch := max(g.Batch, 1)
	rowA, colA, rowB, colB := g.M, g.K, g.K, g.N
	if g.TransA {
		rowA, colA = g.K, g.M
	}
	if g.TransB {
		rowB, colB = g.N, g.K
	}
	var needs [2]int // the elements of A and B the GEMM reads
	for i, o := range []struct {
		name           string
		b              *DeviceBuffer
		rows, cols, ld int
		stride         int
		skip           bool
	}{
		{"A", v[0], rowA, colA, g.LDA, g.StrideA, g.M == 0 || g.N == 0},
		{"B", v[1], rowB, colB, g.LDB, g.StrideB, g.M == 0 || g.N == 0},
		{"C", v[2], g.M, g.N, g.LDC, g.StrideC, false},
	} {
		if o.skip || o.rows == 0 || o.cols == 0 {
			continue
		}
		ld := ldOr(o.ld, o.cols)
		if ld < o.cols {
			return k.invalid(op, "LD%s %d is less than its row length %d", o.name, o.ld, o.cols)
		}
		if batch > 1 && o.stride < 0 {
			return k.invalid(op, "negative stride %d of %s", o.stride, o.name)
		}
		need, ok := extent(o.rows, o.cols, ld, batch, o.stride)
		if !ok || need > o.b.Len() {
			return k.invalid(op, "%s needs %d elements (%d×%d, ld %d, batch %d at stride %d), has %d",
				o.name, need, o.rows, o.cols, ld, batch, o.stride, o.b.Len())
		}
		if i < 2 {
			needs[i] = need
		}
	}
	switch g.Precision {
	case device.GemmF32:
	case device.GemmBF16:
		if v[0].DType() != comm.Float32 {
			return k.invalid(op, "a bfloat16 GEMM takes Float32 buffers, not %v", v[0].DType())
		}
	default:
		return k.invalid(op, "precision %v", g.Precision)
	}
	h, err := k.d.blasHandle(op)
	if err != nil {
		return err
	}
	prec := PrecisionF64
	if v[0].DType() == comm.Float32 {
		prec = PrecisionF32
		if h.b.TF32() {
			prec = PrecisionTF32
		}
	}
	cg := Gemm{
		TransA: g.TransA, TransB: g.TransB, M: g.M, N: g.N, K: g.K, LDA: g.LDA, LDB: g.LDB, LDC: g.LDC,
		A: v[0].Ptr(), B: v[1].Ptr(), C: v[2].Ptr(), Alpha: g.Alpha, Beta: g.Beta,
		Precision: prec,
	}
	if batch > 1 {
		cg.Batch, cg.StrideA, cg.StrideB, cg.StrideC = batch, int64(g.StrideA), int64(g.StrideB), int64(g.StrideC)
	}
	if g.Precision != device.GemmBF16 || g.M == 0 || g.N == 0 {
		return k.gemm(op, h, cg)
	}
	// Autocast: A and B cast to bfloat16 scratch in their layout (the
	// elements the GEMM reads, gaps between rows included), then cuBLAS's
	// bfloat16 GEMM with float32 accumulation into C.
	return k.withScratch(comm.BFloat16, needs[:], func(sc []*DeviceBuffer) error {
		for i, src := range v[:2] {
			if err := k.elementwise(op, "elementwise.cu", "loom_cast_f32_bf16", needs[i], sc[i].raw(), src.raw(), int64(needs[i])); err != nil {
				return err
			}
		}
		cg.A, cg.B, cg.Precision = sc[0].Ptr(), sc[1].Ptr(), PrecisionBF16
		return k.gemm(op, h, cg)
	})
}

// gemm runs cg on h with the context current (cuBLAS works on the
// current device).
func (k cudaKernels) gemm(op string, h *BLASHandle, cg Gemm) error {
	err := k.d.ctx.do(op, func(*driverFns) error {
		_, err := h.Gemm(cg)
		return err
	})
	if err != nil {
		return fmt.Errorf("%s: %s: %w", k.d.name, op, err)
	}
	return nil
}

// extent is the elements a rows×cols matrix with leading dimension ld,
// batch times at stride, reaches; ok is false on overflow.
func extent(rows, cols, ld, batch, stride int) (int, bool) {
	last, ok1 := checked.Mul(rows-1, ld)
	step, ok2 := checked.Mul(batch-1, stride)
	n, ok3 := checked.Add(last, cols)
	n, ok4 := checked.Add(n, step)
	return n, ok1 && ok2 && ok3 && ok4
}

// blasHandle returns the device's cuBLAS handle, loading cuBLAS and
// making the handle (on the compute stream, with a workspace from the
// allocator) at the first call. A cuBLAS that cannot be loaded is a
// *BLASLoadError naming the library and LOOM_CUBLAS; the next call tries
// again.
func (d *Device) blasHandle(op string) (*BLASHandle, error) {
	d.blasMu.Lock()
	defer d.blasMu.Unlock()
	if d.handle != nil {
		return d.handle, nil
	}
	if d.blas == nil {
		b, err := LoadBLAS(d.blasOpts...)
		if err != nil {
			return nil, fmt.Errorf("%s: %s: %w", d.name, op, err)
		}
		d.blas = b
	}
	ws, err := d.Alloc(comm.Uint8, blasWorkspace)
	if err != nil {
		return nil, fmt.Errorf("%s: %s: the cuBLAS workspace: %w", d.name, op, err)
	}
	var h *BLASHandle
	err = d.ctx.do(op, func(*driverFns) error {
		var err error
		h, err = d.blas.NewHandle(d.compute.Handle(), ws.Ptr(), blasWorkspace)
		return err
	})
	if err != nil {
		_ = ws.Free() // the handle's error is the one to report
		return nil, fmt.Errorf("%s: %s: %w", d.name, op, err)
	}
	d.handle, d.ws = h, ws
	return h, nil
}

// TF32 reports whether the device's float32 GEMMs may use TF32: the
// setting of the BLAS given by [WithBLAS], or of [WithBLASOptions]'
// [WithTF32] for the one loaded at the first GEMM (off by default).
func (d *Device) TF32() bool {
	if d.blas != nil {
		return d.blas.TF32()
	}
	var c blasConfig
	for _, o := range d.blasOpts {
		o(&c)
	}
	return c.tf32
}

// GEMMPath says which GEMM path the device's cuBLAS calls took, for a
// program's "GEMM:" line ([BLASHandle.Path]); "cuBLAS not loaded yet"
// before the first GEMM.
func (d *Device) GEMMPath() string {
	d.blasMu.Lock()
	defer d.blasMu.Unlock()
	if d.handle == nil {
		return "cuBLAS not loaded yet"
	}
	return d.handle.Path()
}

// Fill sets every element of dst to v, rounded to dst's type.
func (k cudaKernels) Fill(dst device.Buffer, v float64) error {
	const op = "Fill"
	b, err := k.check(op, arg{name: "dst", b: dst, dtypes: []comm.DType{comm.Float32, comm.Float64, comm.BFloat16, comm.Float16}})
	if err != nil {
		return err
	}
	o, n := b[0].raw(), int64(b[0].Len())
	switch b[0].DType() {
	case comm.Float32:
		return k.elementwise(op, "elementwise.cu", "loom_fill_f32", int(n), o, float32(v), n)
	case comm.Float64:
		return k.elementwise(op, "convert.cu", "loom_fill_u64", int(n), o, math.Float64bits(v), n)
	case comm.BFloat16:
		return k.elementwise(op, "convert.cu", "loom_fill_u16", int(n), o, uint32(half.ToBFloat16(float32(v))), n)
	default:
		return k.elementwise(op, "convert.cu", "loom_fill_u16", int(n), o, uint32(half.ToFloat16(float32(v))), n)
	}
}

// Cast converts src into dst between Float32 and BFloat16 or Float64.
// Float16 has no kernel: an error wrapping loom.ErrUnsupported.
func (k cudaKernels) Cast(dst, src device.Buffer) error {
	const op = "Cast"
	dts := []comm.DType{comm.Float32, comm.Float64, comm.BFloat16, comm.Float16}
	v, err := k.check(op, arg{name: "dst", b: dst, dtypes: dts}, arg{name: "src", b: src, dtypes: dts})
	if err != nil {
		return err
	}
	d, s := v[0], v[1]
	if d.Len() != s.Len() {
		return k.invalid(op, "dst has %d elements, src %d", d.Len(), s.Len())
	}
	n := int64(d.Len())
	var file, name string
	switch [2]comm.DType{s.DType(), d.DType()} {
	case [2]comm.DType{comm.Float32, comm.BFloat16}:
		file, name = "elementwise.cu", "loom_cast_f32_bf16"
	case [2]comm.DType{comm.BFloat16, comm.Float32}:
		file, name = "elementwise.cu", "loom_cast_bf16_f32"
	case [2]comm.DType{comm.Float32, comm.Float64}:
		file, name = "convert.cu", "loom_cast_f32_f64"
	case [2]comm.DType{comm.Float64, comm.Float32}:
		file, name = "convert.cu", "loom_cast_f64_f32"
	case [2]comm.DType{comm.Float32, comm.Float16}, [2]comm.DType{comm.Float16, comm.Float32}:
		return unsupported(k.d, op, "%v to %v: no float16 cast kernel", s.DType(), d.DType())
	default:
		return k.invalid(op, "no cast from %v to %v (one side must be float32, the other another float type)", s.DType(), d.DType())
	}
	return k.elementwise(op, file, name, int(n), d.raw(), s.raw(), n)
}

// Add is dst = a + b (loom_axpby_f32 with a = b = 1).
func (k cudaKernels) Add(dst, a, b device.Buffer) error {
	const op = "Add"
	v, err := k.check(op, f32("dst", dst), f32("a", a), f32("b", b))
	if err != nil {
		return err
	}
	n := v[0].Len()
	if err := k.lens(op, n, "dab", v...); err != nil {
		return err
	}
	return k.elementwise(op, "elementwise.cu", "loom_axpby_f32", n, v[0].raw(), v[1].raw(), v[2].raw(), float32(1), float32(1), int64(n))
}

// Mul is dst = a·b elementwise.
func (k cudaKernels) Mul(dst, a, b device.Buffer) error {
	const op = "Mul"
	v, err := k.check(op, f32("dst", dst), f32("a", a), f32("b", b))
	if err != nil {
		return err
	}
	n := v[0].Len()
	if err := k.lens(op, n, "dab", v...); err != nil {
		return err
	}
	return k.elementwise(op, "elementwise.cu", "loom_mul_f32", n, v[0].raw(), v[1].raw(), v[2].raw(), int64(n))
}

// ColumnSums is out (n values) = the sum of the rows of x, in double.
func (k cudaKernels) ColumnSums(out, x device.Buffer, n int) error {
	const op = "ColumnSums"
	v, err := k.check(op, f32("out", out), f32("x", x))
	if err != nil {
		return err
	}
	rows, err := k.rowsOf(op, v[1], "x", n)
	if err != nil {
		return err
	}
	if v[0].Len() != n {
		return k.invalid(op, "out has %d elements, want %d", v[0].Len(), n)
	}
	return k.sumMid(op, v[0].raw(), v[1].raw(), 1, rows, n)
}

// Softmax is the softmax (or log-softmax) of every row of n.
func (k cudaKernels) Softmax(dst, src device.Buffer, n int, log bool) error {
	const op = "Softmax"
	v, err := k.check(op, f32("dst", dst), f32("src", src))
	if err != nil {
		return err
	}
	rows, err := k.rowsOf(op, v[1], "src", n)
	if err != nil {
		return err
	}
	if err := k.lens(op, v[1].Len(), "d", v[0]); err != nil {
		return err
	}
	flag := int32(0)
	if log {
		flag = 1
	}
	return k.rowwise(op, "softmax.cu", "loom_softmax_rows_f32", rows, v[0].raw(), v[1].raw(), int64(rows), int32(n), flag)
}

// SoftmaxBackward is the gradient of Softmax from its output y.
func (k cudaKernels) SoftmaxBackward(dx, y, dy device.Buffer, n int, log bool) error {
	const op = "SoftmaxBackward"
	v, err := k.check(op, f32("dx", dx), f32("y", y), f32("dy", dy))
	if err != nil {
		return err
	}
	rows, err := k.rowsOf(op, v[1], "y", n)
	if err != nil {
		return err
	}
	if err := k.lens(op, v[1].Len(), "xyd", v...); err != nil {
		return err
	}
	name := "loom_softmax_rows_bwd_f32"
	if log {
		name = "loom_logsoftmax_rows_bwd_f32"
	}
	return k.rowwise(op, "softmax.cu", name, rows, v[0].raw(), v[1].raw(), v[2].raw(), int64(rows), int32(n))
}

// causalBlocks returns the t×t blocks b holds.
func (k cudaKernels) causalBlocks(op string, b *DeviceBuffer, t int) (int, error) {
	if t <= 0 {
		return 0, k.invalid(op, "block size t = %d", t)
	}
	tt, ok := checked.Mul(t, t)
	if !ok || t > math.MaxInt32 {
		return 0, k.invalid(op, "block size t = %d is too large", t)
	}
	if b.Len()%tt != 0 {
		return 0, k.invalid(op, "%d elements are not whole %d×%d blocks", b.Len(), t, t)
	}
	return b.Len() / tt, nil
}

// CausalSoftmax is the causal softmax of scale·src over t×t blocks.
func (k cudaKernels) CausalSoftmax(dst, src device.Buffer, t int, scale float32) error {
	const op = "CausalSoftmax"
	v, err := k.check(op, f32("dst", dst), f32("src", src))
	if err != nil {
		return err
	}
	blocks, err := k.causalBlocks(op, v[1], t)
	if err != nil {
		return err
	}
	if err := k.lens(op, v[1].Len(), "d", v[0]); err != nil {
		return err
	}
	return k.rowwise(op, "softmax.cu", "loom_causal_softmax_f32", blocks*t, v[0].raw(), v[1].raw(), int64(blocks), int32(t), scale)
}

// CausalSoftmaxBackward is the gradient of CausalSoftmax from its output.
func (k cudaKernels) CausalSoftmaxBackward(dx, y, dy device.Buffer, t int, scale float32) error {
	const op = "CausalSoftmaxBackward"
	v, err := k.check(op, f32("dx", dx), f32("y", y), f32("dy", dy))
	if err != nil {
		return err
	}
	blocks, err := k.causalBlocks(op, v[1], t)
	if err != nil {
		return err
	}
	if err := k.lens(op, v[1].Len(), "xyd", v...); err != nil {
		return err
	}
	return k.rowwise(op, "softmax.cu", "loom_causal_softmax_bwd_f32", blocks*t, v[0].raw(), v[1].raw(), v[2].raw(),
		int64(blocks), int32(t), scale)
}

// LayerNorm normalises rows of n; mean and rstd (Float64) are both given
// or both nil.
func (k cudaKernels) LayerNorm(y, mean, rstd, x, w, b device.Buffer, n int, eps float64) error {
	const op = "LayerNorm"
	v, err := k.check(op, f32("y", y), f64("mean", mean, true), f64("rstd", rstd, true), f32("x", x), optF32("w", w), optF32("b", b))
	if err != nil {
		return err
	}
	if (v[1] == nil) != (v[2] == nil) {
		return k.invalid(op, "mean and rstd must both be given or both be nil")
	}
	rows, err := k.rowsOf(op, v[3], "x", n)
	if err != nil {
		return err
	}
	if err := k.lens(op, v[3].Len(), "y", v[0]); err != nil {
		return err
	}
	if err := k.lens(op, rows, "mr", v[1], v[2]); err != nil {
		return err
	}
	if err := k.lens(op, n, "wb", v[4], v[5]); err != nil {
		return err
	}
	if n > math.MaxInt32 {
		return k.invalid(op, "row length %d does not fit a C int", n)
	}
	return k.rowwise(op, "layernorm.cu", "loom_layernorm_fwd_f32", rows, v[0].raw(), v[1].raw(), v[2].raw(), v[3].raw(),
		v[4].raw(), v[5].raw(), int64(rows), int32(n), eps)
}

// LayerNormBackward is LayerNorm's gradient; each warp adds its rows' dw
// and db terms into its own row of a scratch, then loom_sum_mid_f32 adds
// the warps' rows.
func (k cudaKernels) LayerNormBackward(dx, dw, db, dy, x, w, mean, rstd device.Buffer, n int) error {
	const op = "LayerNormBackward"
	v, err := k.check(op, optF32("dx", dx), optF32("dw", dw), optF32("db", db), f32("dy", dy), f32("x", x), optF32("w", w),
		f64("mean", mean, false), f64("rstd", rstd, false))
	if err != nil {
		return err
	}
	rows, err := k.rowsOf(op, v[4], "x", n)
	if err != nil {
		return err
	}
	if err := k.lens(op, v[4].Len(), "xwby", v[0], nil, nil, v[3]); err != nil {
		return err
	}
	if err := k.lens(op, n, "_wb__w", nil, v[1], v[2], nil, nil, v[5]); err != nil {
		return err
	}
	if err := k.lens(op, rows, "mr", v[6], v[7]); err != nil {
		return err
	}
	if n > math.MaxInt32 {
		return k.invalid(op, "row length %d does not fit a C int", n)
	}
	grid := k.rowGrid(max(rows, 1))
	warps := int(grid.X) * warpsPerBlock
	var sizes []int
	if v[1] != nil {
		sizes = append(sizes, warps*n)
	}
	if v[2] != nil {
		sizes = append(sizes, warps*n)
	}
	return k.withScratch(comm.Float32, sizes, func(s []*DeviceBuffer) error {
		var dwp, dbp *DeviceBuffer
		if v[1] != nil {
			dwp, s = s[0], s[1:]
		}
		if v[2] != nil {
			dbp = s[0]
		}
		if rows == 0 && dwp == nil && dbp == nil {
			return nil
		}
		if err := k.launch(op, "layernorm.cu", "loom_layernorm_bwd_f32", grid, Dim3{X: blockThreads}, 0, v[0].raw(), dwp.raw(), dbp.raw(),
			v[3].raw(), v[4].raw(), v[5].raw(), v[6].raw(), v[7].raw(), int64(rows), int32(n)); err != nil {
			return err
		}
		for _, p := range [][2]*DeviceBuffer{{v[1], dwp}, {v[2], dbp}} {
			if p[0] != nil {
				if err := k.sumMid(op, p[0].raw(), p[1].raw(), 1, warps, n); err != nil {
					return err
				}
			}
		}
		return nil
	})
}

// BiasGELU is y = GELU(x + bias) over rows of n, with GELU' in deriv.
func (k cudaKernels) BiasGELU(y, deriv, x, bias device.Buffer, n int) error {
	const op = "BiasGELU"
	v, err := k.check(op, f32("y", y), optF32("deriv", deriv), f32("x", x), optF32("bias", bias))
	if err != nil {
		return err
	}
	rows, err := k.rowsOf(op, v[2], "x", n)
	if err != nil {
		return err
	}
	if err := k.lens(op, v[2].Len(), "yd", v[0], v[1]); err != nil {
		return err
	}
	if err := k.lens(op, n, "b", v[3]); err != nil {
		return err
	}
	if n > math.MaxInt32 {
		return k.invalid(op, "row length %d does not fit a C int", n)
	}
	return k.elementwise(op, "gelu.cu", "loom_bias_gelu_fwd_f32", v[2].Len(), v[0].raw(), v[1].raw(), v[2].raw(), v[3].raw(),
		int64(rows), int32(n))
}

// BiasGELUBackward is dx = dy·deriv, and dbias the column sums of dx.
func (k cudaKernels) BiasGELUBackward(dx, dbias, dy, deriv device.Buffer, n int) error {
	const op = "BiasGELUBackward"
	v, err := k.check(op, f32("dx", dx), optF32("dbias", dbias), f32("dy", dy), f32("deriv", deriv))
	if err != nil {
		return err
	}
	rows, err := k.rowsOf(op, v[2], "dy", n)
	if err != nil {
		return err
	}
	if err := k.lens(op, v[2].Len(), "x_yd", v[0], nil, nil, v[3]); err != nil {
		return err
	}
	if err := k.lens(op, n, "b", v[1]); err != nil {
		return err
	}
	m := v[0].Len()
	if err := k.elementwise(op, "elementwise.cu", "loom_mul_f32", m, v[0].raw(), v[2].raw(), v[3].raw(), int64(m)); err != nil {
		return err
	}
	if v[1] == nil {
		return nil
	}
	return k.sumMid(op, v[1].raw(), v[0].raw(), 1, rows, n)
}

// attnCheck checks the buffers of attention of shape s.
func (k cudaKernels) attnCheck(op string, s device.AttnShape, lens map[string][2]int) error {
	if s.Batch < 0 || s.T < 0 || s.DH < 0 || s.DV < 0 {
		return k.invalid(op, "negative shape %+v", s)
	}
	for _, name := range []string{"out", "probs", "q", "k", "v", "g", "dq", "dk", "dv"} {
		if l, ok := lens[name]; ok && l[0] != l[1] {
			return k.invalid(op, "%s has %d elements, want %d for %+v", name, l[0], l[1], s)
		}
	}
	return nil
}

// Attention is causal attention by the reference path: probs = the causal
// softmax of scale·q·kᵀ (a strided batched GEMM, then the softmax kernel
// in place), out = probs·v (a batched GEMM).
func (k cudaKernels) Attention(out, probs, q, kk, vv device.Buffer, s device.AttnShape) error {
	const op = "Attention"
	v, err := k.check(op, f32("out", out), f32("probs", probs), f32("q", q), f32("k", kk), f32("v", vv))
	if err != nil {
		return err
	}
	b, t, dh, dv := s.Batch, s.T, s.DH, s.DV
	if err := k.attnCheck(op, s, map[string][2]int{
		"out": {v[0].Len(), b * t * dv}, "probs": {v[1].Len(), b * t * t},
		"q": {v[2].Len(), b * t * dh}, "k": {v[3].Len(), b * t * dh}, "v": {v[4].Len(), b * t * dv},
	}); err != nil {
		return err
	}
	if b*t == 0 {
		return nil
	}
	h, err := k.d.blasHandle(op)
	if err != nil {
		return err
	}
	// probs[b] = scale·q[b]·k[b]ᵀ, all t×t (the softmax ignores and
	// clears what lies above the diagonal).
	if err := k.gemm(op, h, Gemm{TransB: true, M: t, N: t, K: dh, A: v[2].Ptr(), B: v[3].Ptr(), C: v[1].Ptr(),
		Alpha: float64(s.Scale), Batch: b, StrideA: int64(t * dh), StrideB: int64(t * dh), StrideC: int64(t * t),
		Precision: k.precision(h)}); err != nil {
		return err
	}
	if err := k.rowwise(op, "softmax.cu", "loom_causal_softmax_f32", b*t, v[1].raw(), v[1].raw(), int64(b), int32(t), float32(1)); err != nil {
		return err
	}
	return k.gemm(op, h, Gemm{M: t, N: dv, K: t, A: v[1].Ptr(), B: v[4].Ptr(), C: v[0].Ptr(), Alpha: 1,
		Batch: b, StrideA: int64(t * t), StrideB: int64(t * dv), StrideC: int64(t * dv), Precision: k.precision(h)})
}

// precision is the float32 GEMM precision of h: TF32 where allowed.
func (k cudaKernels) precision(h *BLASHandle) Precision {
	if h.b.TF32() {
		return PrecisionTF32
	}
	return PrecisionF32
}

// AttentionBackward is the gradient of Attention: dv = Pᵀ·g, dP = g·vᵀ,
// dS = the causal softmax backward of P and dP (scale included),
// dq = dS·k, dk = dSᵀ·q, each a strided batched GEMM or the kernel.
func (k cudaKernels) AttentionBackward(dq, dk, dv, g, probs, q, kk, vv device.Buffer, s device.AttnShape) error {
	const op = "AttentionBackward"
	v, err := k.check(op, optF32("dq", dq), optF32("dk", dk), optF32("dv", dv), f32("g", g), f32("probs", probs),
		f32("q", q), f32("k", kk), f32("v", vv))
	if err != nil {
		return err
	}
	b, t, dh, dvw := s.Batch, s.T, s.DH, s.DV
	lens := map[string][2]int{
		"g": {v[3].Len(), b * t * dvw}, "probs": {v[4].Len(), b * t * t},
		"q": {v[5].Len(), b * t * dh}, "k": {v[6].Len(), b * t * dh}, "v": {v[7].Len(), b * t * dvw},
	}
	for i, name := range []string{"dq", "dk", "dv"} {
		if v[i] != nil {
			lens[name] = [2]int{v[i].Len(), b * t * []int{dh, dh, dvw}[i]}
		}
	}
	if err := k.attnCheck(op, s, lens); err != nil {
		return err
	}
	if b*t == 0 || (v[0] == nil && v[1] == nil && v[2] == nil) {
		return nil
	}
	h, err := k.d.blasHandle(op)
	if err != nil {
		return err
	}
	p := k.precision(h)
	tt, tdh, tdv := int64(t*t), int64(t*dh), int64(t*dvw)
	if v[2] != nil {
		if err := k.gemm(op, h, Gemm{TransA: true, M: t, N: dvw, K: t, A: v[4].Ptr(), B: v[3].Ptr(), C: v[2].Ptr(), Alpha: 1,
			Batch: b, StrideA: tt, StrideB: tdv, StrideC: tdv, Precision: p}); err != nil {
			return err
		}
	}
	if v[0] == nil && v[1] == nil {
		return nil
	}
	return k.withScratch(comm.Float32, []int{b * t * t}, func(sc []*DeviceBuffer) error {
		ds := sc[0]
		if err := k.gemm(op, h, Gemm{TransB: true, M: t, N: t, K: dvw, A: v[3].Ptr(), B: v[7].Ptr(), C: ds.Ptr(), Alpha: 1,
			Batch: b, StrideA: tdv, StrideB: tdv, StrideC: tt, Precision: p}); err != nil {
			return err
		}
		if err := k.rowwise(op, "softmax.cu", "loom_causal_softmax_bwd_f32", b*t, ds.raw(), v[4].raw(), ds.raw(),
			int64(b), int32(t), s.Scale); err != nil {
			return err
		}
		if v[0] != nil {
			if err := k.gemm(op, h, Gemm{M: t, N: dh, K: t, A: ds.Ptr(), B: v[6].Ptr(), C: v[0].Ptr(), Alpha: 1,
				Batch: b, StrideA: tt, StrideB: tdh, StrideC: tdh, Precision: p}); err != nil {
				return err
			}
		}
		if v[1] != nil {
			return k.gemm(op, h, Gemm{TransA: true, M: t, N: dh, K: t, A: ds.Ptr(), B: v[5].Ptr(), C: v[1].Ptr(), Alpha: 1,
				Batch: b, StrideA: tt, StrideB: tdh, StrideC: tdh, Precision: p})
		}
		return nil
	})
}

// CrossEntropy is the summed negative log-likelihood of rows of v logits
// into loss (Float64, one element), with each row's log-sum-exp in lse
// when given. A target outside [0, v) gives a NaN loss, and the next
// Synchronize or CopyToHost returns the CPU kernel's error for it
// (loom_xent_targets).
func (k cudaKernels) CrossEntropy(loss, lse, logits, targets device.Buffer, v int) error {
	const op = "CrossEntropy"
	b, err := k.check(op, f64("loss", loss, false), f64("lse", lse, true), f32("logits", logits), i64s("targets", targets))
	if err != nil {
		return err
	}
	if b[0].Len() != 1 {
		return k.invalid(op, "loss has %d elements, want 1", b[0].Len())
	}
	rows, err := k.rowsOf(op, b[2], "logits", v)
	if err != nil {
		return err
	}
	if err := k.lens(op, rows, "_lst", nil, b[1], nil, b[3]); err != nil {
		return err
	}
	if v > math.MaxInt32 {
		return k.invalid(op, "%d classes do not fit a C int", v)
	}
	if err := k.checkTargets(op, b[3], rows, v); err != nil {
		return err
	}
	return k.withScratch(comm.Float64, []int{rows}, func(s []*DeviceBuffer) error {
		if err := k.rowwise(op, "xent.cu", "loom_xent_fwd_f32", rows, s[0].raw(), b[1].raw(), b[2].raw(), b[3].raw(),
			int64(rows), int32(v)); err != nil {
			return err
		}
		return k.launch(op, "elementwise.cu", "loom_sum_f64", Dim3{X: 1}, Dim3{X: blockThreads}, 0, b[0].raw(), s[0].raw(), int64(rows))
	})
}

// CrossEntropyBackward is dx = scale·(softmax(logits) − onehot(targets)).
// A target outside [0, v) is found as CrossEntropy's is.
func (k cudaKernels) CrossEntropyBackward(dx, logits, targets, lse device.Buffer, v int, scale float64) error {
	const op = "CrossEntropyBackward"
	b, err := k.check(op, f32("dx", dx), f32("logits", logits), i64s("targets", targets), f64("lse", lse, false))
	if err != nil {
		return err
	}
	rows, err := k.rowsOf(op, b[1], "logits", v)
	if err != nil {
		return err
	}
	if err := k.lens(op, b[1].Len(), "d", b[0]); err != nil {
		return err
	}
	if err := k.lens(op, rows, "__tl", nil, nil, b[2], b[3]); err != nil {
		return err
	}
	if v > math.MaxInt32 {
		return k.invalid(op, "%d classes do not fit a C int", v)
	}
	if err := k.checkTargets(op, b[2], rows, v); err != nil {
		return err
	}
	return k.rowwise(op, "xent.cu", "loom_xent_bwd_f32", rows, b[0].raw(), b[1].raw(), b[2].raw(), b[3].raw(),
		int64(rows), int32(v), float32(scale))
}

// AdamW is one AdamW step on Float32 buffers, the coefficients rounded to
// float32; Float64 has no kernel (an error wrapping loom.ErrUnsupported).
func (k cudaKernels) AdamW(p, g, m, v device.Buffer, c [8]float64) error {
	const op = "AdamW"
	b, err := k.check(op, f32("p", p), f32("g", g), f32("m", m), f32("v", v))
	if err != nil {
		return err
	}
	n := b[0].Len()
	if err := k.lens(op, n, "pgmv", b...); err != nil {
		return err
	}
	args := []any{b[0].raw(), b[1].raw(), b[2].raw(), b[3].raw(), int64(n)}
	for _, x := range c {
		args = append(args, float32(x))
	}
	return k.elementwise(op, "optim.cu", "loom_adamw_f32", n, args...)
}

// SGD is one SGD step (kernels.SGD) on Float32 buffers, the coefficients
// rounded to float32; buf may be nil when s.Momentum is 0. Float64 has no
// kernel (an error wrapping loom.ErrUnsupported).
func (k cudaKernels) SGD(p, g, buf device.Buffer, s kernels.SGDStep) error {
	const op = "SGD"
	b, err := k.check(op, f32("p", p), f32("g", g), arg{name: "buf", b: buf, dtypes: []comm.DType{comm.Float32}, optional: s.Momentum == 0})
	if err != nil {
		return err
	}
	n := b[0].Len()
	if err := k.lens(op, n, "pgb", b...); err != nil {
		return err
	}
	flags := int32(0)
	if s.Maximize {
		flags |= 1 // LOOM_SGD_MAXIMIZE
	}
	if s.Nesterov {
		flags |= 2 // LOOM_SGD_NESTEROV
	}
	if s.First {
		flags |= 4 // LOOM_SGD_FIRST
	}
	var bufRaw Buffer
	if s.Momentum != 0 {
		bufRaw = b[2].raw()
	}
	return k.elementwise(op, "optim.cu", "loom_sgd_f32", n, b[0].raw(), b[1].raw(), bufRaw, int64(n),
		float32(s.LR), float32(s.WeightDecay), float32(s.Momentum), float32(1-s.Dampening), flags)
}

// SumSquares is Σ x² of a Float32 x into out (Float64, one element), in
// double: partial sums per block, then one block adds them. Float64 x has
// no kernel (an error wrapping loom.ErrUnsupported).
func (k cudaKernels) SumSquares(out, x device.Buffer) error {
	const op = "SumSquares"
	b, err := k.check(op, f64("out", out, false), f32("x", x))
	if err != nil {
		return err
	}
	if b[0].Len() != 1 {
		return k.invalid(op, "out has %d elements, want 1", b[0].Len())
	}
	n := b[1].Len()
	grid := k.gridFor(max(n, 1), blockThreads)
	return k.withScratch(comm.Float64, []int{int(grid.X)}, func(s []*DeviceBuffer) error {
		if err := k.launch(op, "elementwise.cu", "loom_sumsq_f32", grid, Dim3{X: blockThreads}, 0, s[0].raw(), b[1].raw(), int64(n)); err != nil {
			return err
		}
		return k.launch(op, "elementwise.cu", "loom_sum_f64", Dim3{X: 1}, Dim3{X: blockThreads}, 0, b[0].raw(), s[0].raw(), int64(grid.X))
	})
}

// Scale is dst = c·x on Float32 buffers (loom_axpby_f32 with b = 0), c
// rounded to float32; dst may be x. Float64 has no kernel (an error
// wrapping loom.ErrUnsupported).
func (k cudaKernels) Scale(dst, x device.Buffer, c float64) error {
	const op = "Scale"
	b, err := k.check(op, f32("dst", dst), f32("x", x))
	if err != nil {
		return err
	}
	n := b[0].Len()
	if err := k.lens(op, n, "dx", b...); err != nil {
		return err
	}
	return k.elementwise(op, "elementwise.cu", "loom_axpby_f32", n, b[0].raw(), b[1].raw(), Buffer{}, float32(c), float32(0), int64(n))
}

// CopyBox copies a box between two row-major arrays of one dtype
// (kernels.CopyBox), checked by kernels.CheckBox first: 4-byte elements
// in up to 6 dims by shape.cu's loom_copy_box_f32 (a bit copy), other
// boxes by one cuMemcpyDtoDAsync per contiguous run on the compute stream
// (the box's rows, merged where the box spans whole trailing dims of both
// arrays), which is right but slow for boxes of many short rows.
func (k cudaKernels) CopyBox(dst device.Buffer, dshape, doff []int, src device.Buffer, sshape, soff, size []int) error {
	const op = "CopyBox"
	all := comm.AllDTypes()
	v, err := k.check(op, arg{name: "dst", b: dst, dtypes: all}, arg{name: "src", b: src, dtypes: all})
	if err != nil {
		return err
	}
	if v[0].DType() != v[1].DType() {
		return k.invalid(op, "dst is %v, src %v", v[0].DType(), v[1].DType())
	}
	if err := kernels.CheckBox(v[0].Len(), dshape, doff, v[1].Len(), sshape, soff, size); err != nil {
		return fmt.Errorf("%s: %s: %w: %w", k.d.name, op, device.ErrInvalid, err)
	}
	es := v[0].DType().Size()
	nd := len(size)
	if nd == 0 {
		return k.copyRun(op, v[0], 0, v[1], 0, es)
	}
	for _, s := range size {
		if s == 0 {
			return nil
		}
	}
	if es == 4 && nd <= 6 {
		return k.copyBox4(op, v[0], dshape, doff, v[1], sshape, soff, size)
	}
	// Merge trailing dims the box spans in both arrays into one run: run
	// covers dims [inner, nd).
	run, inner := size[nd-1], nd-1
	for inner > 0 && size[inner] == dshape[inner] && size[inner] == sshape[inner] {
		inner--
		run *= size[inner]
	}
	// Strides in elements of both arrays.
	dstr, sstr := make([]int, nd), make([]int, nd)
	dstr[nd-1], sstr[nd-1] = 1, 1
	for i := nd - 2; i >= 0; i-- {
		dstr[i], sstr[i] = dstr[i+1]*dshape[i+1], sstr[i+1]*sshape[i+1]
	}
	// idx walks the box's indices of dims [0, inner).
	idx := make([]int, inner)
	for {
		do, so := 0, 0
		for i := range nd {
			j := 0
			if i < inner {
				j = idx[i]
			}
			do += (doff[i] + j) * dstr[i]
			so += (soff[i] + j) * sstr[i]
		}
		if err := k.copyRun(op, v[0], do*es, v[1], so*es, run*es); err != nil {
			return err
		}
		i := inner - 1
		for ; i >= 0; i-- {
			if idx[i]++; idx[i] < size[i] {
				break
			}
			idx[i] = 0
		}
		if i < 0 {
			return nil
		}
	}
}

// copyRun queues a copy of bytes bytes from src at byte so to dst at do.
func (k cudaKernels) copyRun(op string, dst *DeviceBuffer, do int, src *DeviceBuffer, so, bytes int) error {
	d := Buffer{Ptr: DevicePtr(dst.ptr + uintptr(do)), Bytes: bytes}
	s := Buffer{Ptr: DevicePtr(src.ptr + uintptr(so)), Bytes: bytes}
	if err := k.d.compute.Copy(d, s, bytes); err != nil {
		return fmt.Errorf("%s: %s: %w", k.d.name, op, err)
	}
	return nil
}

// FillRows sets every row of dst (rows of row.Len()) to row
// (loom_broadcast_mid_f32 with outer 1).
func (k cudaKernels) FillRows(dst, row device.Buffer) error {
	const op = "FillRows"
	v, err := k.check(op, f32("dst", dst), f32("row", row))
	if err != nil {
		return err
	}
	n := v[1].Len()
	if n == 0 {
		if v[0].Len() != 0 {
			return k.invalid(op, "an empty row for %d elements", v[0].Len())
		}
		return nil
	}
	rows, err := k.rowsOf(op, v[0], "dst", n)
	if err != nil {
		return err
	}
	return k.broadcastMid(op, v[0].raw(), v[1].raw(), 1, rows, n)
}

// broadcastMid queues out [outer, mid, inner] = g [outer, inner] repeated
// over mid.
func (k cudaKernels) broadcastMid(op string, out, g Buffer, outer, mid, inner int) error {
	return k.elementwise(op, "convert.cu", "loom_broadcast_mid_f32", outer*mid*inner, out, g, int64(outer), int64(mid), int64(inner))
}

// dimGroups checks shape and reduce (one flag per dim, no negative size)
// and returns the element counts of x and of the result, and the dims
// merged into groups of one flag: their sizes and whether each is
// reduced.
func (k cudaKernels) dimGroups(op string, shape []int, reduce []bool) (n, kept int, sizes []int, red []bool, err error) {
	if len(shape) != len(reduce) {
		return 0, 0, nil, nil, k.invalid(op, "shape %v and reduce %v differ in length", shape, reduce)
	}
	n, kept = 1, 1
	for i, d := range shape {
		if d < 0 {
			return 0, 0, nil, nil, k.invalid(op, "negative size in %v", shape)
		}
		var ok bool
		if n, ok = checked.Mul(n, d); !ok {
			return 0, 0, nil, nil, k.invalid(op, "sizes %v overflow int", shape)
		}
		if !reduce[i] {
			kept *= d
		}
		if i > 0 && reduce[i] == reduce[i-1] {
			sizes[len(sizes)-1] *= d
			continue
		}
		sizes, red = append(sizes, d), append(red, reduce[i])
	}
	return n, kept, sizes, red, nil
}

// SumDims sums x (of shape) over the dims where reduce is set into out:
// one loom_sum_mid_f32 pass per group of adjacent reduced dims, the
// innermost first, through scratch between passes. Sums accumulate in
// double and round once per pass (the CPU adds in float32).
func (k cudaKernels) SumDims(out, x device.Buffer, shape []int, reduce []bool) error {
	const op = "SumDims"
	v, err := k.check(op, f32("out", out), f32("x", x))
	if err != nil {
		return err
	}
	n, kept, sizes, red, err := k.dimGroups(op, shape, reduce)
	if err != nil {
		return err
	}
	if v[1].Len() != n || v[0].Len() != kept {
		return k.invalid(op, "x has %d elements and out %d, want %d and %d for shape %v reducing %v", v[1].Len(), v[0].Len(), n, kept, shape, reduce)
	}
	if kept == 0 {
		return nil
	}
	first := slices.Index(red, true)
	if first < 0 {
		return k.copyRun(op, v[0], 0, v[1], 0, 4*n)
	}
	if kept == 1 {
		return k.total(op, v[0], v[1])
	}
	var scratch []*DeviceBuffer
	defer func() {
		for _, b := range scratch {
			_ = b.Free() // a live owning buffer's Free fails only on a bug
		}
	}()
	cur := v[1].raw()
	for p := len(sizes) - 1; p >= 0; p-- {
		if !red[p] {
			continue
		}
		outer, inner := dimsProduct(sizes[:p]), dimsProduct(sizes[p+1:])
		dst := v[0].raw()
		if p != first {
			s, err := k.scratch(comm.Float32, outer*inner)
			if err != nil {
				return err
			}
			scratch = append(scratch, s)
			dst = s.raw()
		}
		if err := k.sumMid(op, dst, cur, outer, sizes[p], inner); err != nil {
			return err
		}
		cur = dst
		sizes = slices.Delete(slices.Clone(sizes), p, p+1)
	}
	return nil
}

// BroadcastDims sets out (of shape) to g repeated along the dims where
// reduce is set: one loom_broadcast_mid_f32 pass per group of adjacent
// reduced dims, the innermost first. Bit-exact copies.
func (k cudaKernels) BroadcastDims(out, g device.Buffer, shape []int, reduce []bool) error {
	const op = "BroadcastDims"
	v, err := k.check(op, f32("out", out), f32("g", g))
	if err != nil {
		return err
	}
	n, kept, sizes, red, err := k.dimGroups(op, shape, reduce)
	if err != nil {
		return err
	}
	if v[0].Len() != n || v[1].Len() != kept {
		return k.invalid(op, "out has %d elements and g %d, want %d and %d for shape %v reducing %v", v[0].Len(), v[1].Len(), n, kept, shape, reduce)
	}
	if n == 0 {
		return nil
	}
	first := slices.Index(red, true)
	if first < 0 {
		return k.copyRun(op, v[0], 0, v[1], 0, 4*n)
	}
	var scratch []*DeviceBuffer
	defer func() {
		for _, b := range scratch {
			_ = b.Free() // a live owning buffer's Free fails only on a bug
		}
	}()
	// present[q]: group q is in the current layout (kept groups, and the
	// reduced ones expanded so far).
	present := make([]bool, len(sizes))
	for q := range sizes {
		present[q] = !red[q]
	}
	cur := v[1].raw()
	for p := len(sizes) - 1; p >= 0; p-- {
		if !red[p] {
			continue
		}
		outer, inner := 1, 1
		for q := range sizes {
			switch {
			case present[q] && q < p:
				outer *= sizes[q]
			case present[q] && q > p:
				inner *= sizes[q]
			}
		}
		dst := v[0].raw()
		if p != first {
			s, err := k.scratch(comm.Float32, outer*sizes[p]*inner)
			if err != nil {
				return err
			}
			scratch = append(scratch, s)
			dst = s.raw()
		}
		if err := k.broadcastMid(op, dst, cur, outer, sizes[p], inner); err != nil {
			return err
		}
		cur, present[p] = dst, true
	}
	return nil
}

// dimsProduct is the product of dims (1 for none).
func dimsProduct(dims []int) int {
	p := 1
	for _, d := range dims {
		p *= d
	}
	return p
}

// total sets out (one element) to Σ x in double, rounded once: per-block
// partials over the whole grid, their sum by one block, then the cast
// (loom_sum_mid_f32 would put a total on one block's 8 threads).
func (k cudaKernels) total(op string, out, x *DeviceBuffer) error {
	n := x.Len()
	grid := k.gridFor(max(n, 1), blockThreads)
	return k.withScratch(comm.Float64, []int{int(grid.X), 1}, func(s []*DeviceBuffer) error {
		if err := k.launch(op, "convert.cu", "loom_sum_f32_partial", grid, Dim3{X: blockThreads}, 0, s[0].raw(), x.raw(), int64(n)); err != nil {
			return err
		}
		if err := k.launch(op, "elementwise.cu", "loom_sum_f64", Dim3{X: 1}, Dim3{X: blockThreads}, 0, s[1].raw(), s[0].raw(), int64(grid.X)); err != nil {
			return err
		}
		return k.elementwise(op, "convert.cu", "loom_cast_f64_f32", 1, out.raw(), s[1].raw(), int64(1))
	})
}

// copyBox4 queues loom_copy_box_f32 for a checked box of 4-byte elements
// in at most 6 dims: the offsets fold into the pointers, unused dims are
// of size 1.
func (k cudaKernels) copyBox4(op string, dst *DeviceBuffer, dshape, doff []int, src *DeviceBuffer, sshape, soff, size []int) error {
	nd := len(size)
	var n, ds, ss [6]int64
	for i := range n {
		n[i] = 1
	}
	do, so, dst1, sst1 := 0, 0, 1, 1
	for i := nd - 1; i >= 0; i-- {
		n[i], ds[i], ss[i] = int64(size[i]), int64(dst1), int64(sst1)
		do += doff[i] * dst1
		so += soff[i] * sst1
		dst1 *= dshape[i]
		sst1 *= sshape[i]
	}
	count := dimsProduct(size)
	d := Buffer{Ptr: DevicePtr(dst.ptr + uintptr(4*do)), Bytes: 4 * (dst.Len() - do)}
	s := Buffer{Ptr: DevicePtr(src.ptr + uintptr(4*so)), Bytes: 4 * (src.Len() - so)}
	args := []any{d, s, int32(nd)}
	for _, a := range [][6]int64{n, ds, ss} {
		for _, x := range a {
			args = append(args, x)
		}
	}
	return k.elementwise(op, "shape.cu", "loom_copy_box_f32", count, args...)
}

// NarrowDim is out ([outer, length, inner]) = entries [start,
// start+length) of x ([outer, n, inner]) along the middle dim: a CopyBox.
func (k cudaKernels) NarrowDim(out, x device.Buffer, outer, n, inner, start, length int) error {
	if _, err := k.check("NarrowDim", f32("out", out), f32("x", x)); err != nil {
		return err
	}
	return k.CopyBox(out, []int{outer, length, inner}, []int{0, 0, 0}, x, []int{outer, n, inner}, []int{0, start, 0}, []int{outer, length, inner})
}

// PadDim is out ([outer, full, inner]) = g ([outer, n, inner]) at [start,
// start+n) and zero elsewhere: a fill, then a CopyBox.
func (k cudaKernels) PadDim(out, g device.Buffer, outer, n, inner, start, full int) error {
	v, err := k.check("PadDim", f32("out", out), f32("g", g))
	if err != nil {
		return err
	}
	if err := kernels.CheckBox(v[0].Len(), []int{outer, full, inner}, []int{0, start, 0}, v[1].Len(), []int{outer, n, inner}, []int{0, 0, 0}, []int{outer, n, inner}); err != nil {
		return fmt.Errorf("%s: PadDim: %w: %w", k.d.name, device.ErrInvalid, err)
	}
	if err := k.Fill(out, 0); err != nil {
		return err
	}
	return k.CopyBox(out, []int{outer, full, inner}, []int{0, start, 0}, g, []int{outer, n, inner}, []int{0, 0, 0}, []int{outer, n, inner})
}

// ConcatDim joins xs[i] ([outer, sizes[i], inner]) along the middle dim
// into out ([outer, Σ sizes, inner]): one CopyBox per part.
func (k cudaKernels) ConcatDim(out device.Buffer, xs []device.Buffer, sizes []int, outer, inner int) error {
	const op = "ConcatDim"
	args := []arg{f32("out", out)}
	for i, x := range xs {
		args = append(args, f32(fmt.Sprintf("xs[%d]", i), x))
	}
	if _, err := k.check(op, args...); err != nil {
		return err
	}
	if len(xs) != len(sizes) {
		return k.invalid(op, "%d parts and %d sizes", len(xs), len(sizes))
	}
	total := 0
	for _, s := range sizes {
		if s < 0 {
			return k.invalid(op, "negative size in %v", sizes)
		}
		total += s
	}
	off := 0
	for i, x := range xs {
		if err := k.CopyBox(out, []int{outer, total, inner}, []int{0, off, 0}, x, []int{outer, sizes[i], inner}, []int{0, 0, 0},
			[]int{outer, sizes[i], inner}); err != nil {
			return err
		}
		off += sizes[i]
	}
	return nil
}

// embeddingShape checks an embedding's buffers and returns the ids and
// the table's rows.
func (k cudaKernels) embeddingShape(op string, rows, table, ids *DeviceBuffer, d int) (nids, vl int, err error) {
	if d <= 0 {
		return 0, 0, k.invalid(op, "row width %d", d)
	}
	nids = ids.Len()
	if rows.Len() != nids*d {
		return 0, 0, k.invalid(op, "%d rows of %d for %d ids", rows.Len(), d, nids)
	}
	if table.Len()%d != 0 {
		return 0, 0, k.invalid(op, "the table's %d elements are not rows of %d", table.Len(), d)
	}
	return nids, table.Len() / d, nil
}

// Embedding is out's row i = table's row ids[i] − lo, zeros for ids
// outside the table's rows (loom_embedding_fwd_f32).
func (k cudaKernels) Embedding(out, table, ids device.Buffer, lo, d int) error {
	const op = "Embedding"
	v, err := k.check(op, f32("out", out), f32("table", table), i64s("ids", ids))
	if err != nil {
		return err
	}
	nids, vl, err := k.embeddingShape(op, v[0], v[1], v[2], d)
	if err != nil {
		return err
	}
	return k.elementwise(op, "embedding.cu", "loom_embedding_fwd_f32", nids*d, v[0].raw(), v[1].raw(), v[2].raw(),
		int64(nids), int64(lo), int64(vl), int64(d))
}

// EmbeddingBackward is dtable = the sum by id of g's rows: a zero fill,
// then loom_embedding_bwd_f32's float32 atomic adds (acc, the CPU's
// float64 scratch, is checked but not used; repeated ids add in the
// order the threads run, so the last bits vary).
func (k cudaKernels) EmbeddingBackward(dtable, acc, g, ids device.Buffer, lo, d int) error {
	const op = "EmbeddingBackward"
	v, err := k.check(op, f32("dtable", dtable), f64("acc", acc, false), f32("g", g), i64s("ids", ids))
	if err != nil {
		return err
	}
	nids, vl, err := k.embeddingShape(op, v[2], v[0], v[3], d)
	if err != nil {
		return err
	}
	if v[1].Len() != v[0].Len() {
		return k.invalid(op, "acc has %d elements, dtable %d", v[1].Len(), v[0].Len())
	}
	if err := k.Fill(dtable, 0); err != nil {
		return err
	}
	return k.elementwise(op, "embedding.cu", "loom_embedding_bwd_f32", nids*d, v[0].raw(), v[2].raw(), v[3].raw(),
		int64(nids), int64(lo), int64(vl), int64(d))
}

// maxND is the most dims the shape kernels take (six sizes and six
// strides as scalar arguments).
const maxND = 6

// PermuteDims is out = x (of shape) with out's dim i x's dim perm[i], by
// loom_permute_nd_f32 (a gather, bit-exact). Dims of size 1 are dropped
// and dims that stay adjacent and in order are merged first, so more than
// six dims work when they fold into six; a permutation that does not is an
// error wrapping loom.ErrUnsupported.
func (k cudaKernels) PermuteDims(out, x device.Buffer, shape, perm []int) error {
	const op = "PermuteDims"
	v, err := k.check(op, f32("out", out), f32("x", x))
	if err != nil {
		return err
	}
	n, err := k.shapeSize(op, shape)
	if err != nil {
		return err
	}
	if v[0].Len() != n || v[1].Len() != n {
		return k.invalid(op, "out %d and x %d elements for shape %v", v[0].Len(), v[1].Len(), shape)
	}
	if len(perm) != len(shape) {
		return k.invalid(op, "perm %v for a %d-d shape", perm, len(shape))
	}
	seen := make([]bool, len(perm))
	for _, p := range perm {
		if p < 0 || p >= len(perm) || seen[p] {
			return k.invalid(op, "perm %v is not a permutation of 0..%d", perm, len(perm)-1)
		}
		seen[p] = true
	}
	if n == 0 {
		return nil
	}
	s, p := foldPermutation(shape, perm)
	if len(s) > maxND {
		return unsupported(k.d, op, "shape %v permuted by %v folds into %d dims; loom_permute_nd_f32 takes %d", shape, perm, len(s), maxND)
	}
	args := []any{v[0].raw(), v[1].raw(), int32(len(s))}
	for d := range maxND {
		args = append(args, int64(at(s, d, 1)))
	}
	for d := range maxND {
		args = append(args, int32(at(p, d, 0)))
	}
	return k.elementwise(op, "shape.cu", "loom_permute_nd_f32", n, args...)
}

// at is s[i], or def past s's end.
func at(s []int, i, def int) int {
	if i < len(s) {
		return s[i]
	}
	return def
}

// foldPermutation returns the shape and permutation of the same
// rearrangement with the dims of size 1 dropped and each run of output
// dims that reads adjacent input dims in order (perm[i+1] = perm[i]+1)
// merged into one dim.
func foldPermutation(shape, perm []int) (s, p []int) {
	// Input dims kept, renumbered.
	id := make([]int, len(shape))
	var kept []int
	for d, n := range shape {
		id[d] = -1
		if n != 1 {
			id[d] = len(kept)
			kept = append(kept, n)
		}
	}
	var q []int // the permutation of the kept dims
	for _, d := range perm {
		if id[d] >= 0 {
			q = append(q, id[d])
		}
	}
	// Runs of q that read consecutive input dims become one input dim.
	start := make([]bool, len(kept)) // input dim d begins a run
	for i, d := range q {
		start[d] = i == 0 || q[i-1] != d-1
	}
	merged := make([]int, len(kept)) // input dim of a run's start → new index
	for d := range kept {
		if start[d] {
			merged[d] = len(s)
			s = append(s, kept[d])
		} else {
			s[len(s)-1] *= kept[d]
		}
	}
	for _, d := range q {
		if start[d] {
			p = append(p, merged[d])
		}
	}
	return s, p
}

// shapeSize is the element count of shape, or an error for a negative
// size or an overflowing product.
func (k cudaKernels) shapeSize(op string, shape []int) (int, error) {
	n := 1
	for _, d := range shape {
		if d < 0 {
			return 0, k.invalid(op, "negative size in %v", shape)
		}
		var ok bool
		if n, ok = checked.Mul(n, d); !ok {
			return 0, k.invalid(op, "sizes %v overflow int", shape)
		}
	}
	return n, nil
}

// act is the selector of loom_act_f32 and loom_act_bwd_f32 for f
// (pointwise.cu's LOOM_ACT_*).
func (k cudaKernels) act(op string, f device.Pointwise) (int32, error) {
	switch f {
	case device.ReLU:
		return 0, nil
	case device.SiLU:
		return 1, nil
	case device.Tanh:
		return 2, nil
	case device.Sigmoid:
		return 3, nil
	}
	return 0, k.invalid(op, "unknown activation %v", f)
}

// Pointwise is dst = f(x) by loom_act_f32: ReLU selects (bit-exact);
// SiLU, Tanh and Sigmoid compute in double and round once, as the CPU
// does (the device's exp and tanh may differ from Go's in the double's
// last bit, so a float32 result may differ by one ulp at a near-tie).
func (k cudaKernels) Pointwise(f device.Pointwise, dst, x device.Buffer) error {
	const op = "Pointwise"
	a, err := k.act(op, f)
	if err != nil {
		return err
	}
	v, err := k.check(op, f32("dst", dst), f32("x", x))
	if err != nil {
		return err
	}
	n := v[1].Len()
	if err := k.lens(op, n, "d", v[0]); err != nil {
		return err
	}
	return k.elementwise(op, "pointwise.cu", "loom_act_f32", n, v[0].raw(), v[1].raw(), int64(n), a)
}

// PointwiseBackward is dx from dy and saved (x for ReLU and SiLU, the
// forward's result for Tanh and Sigmoid) by loom_act_bwd_f32, in double
// as on the CPU.
func (k cudaKernels) PointwiseBackward(f device.Pointwise, dx, saved, dy device.Buffer) error {
	const op = "PointwiseBackward"
	a, err := k.act(op, f)
	if err != nil {
		return err
	}
	v, err := k.check(op, f32("dx", dx), f32("saved", saved), f32("dy", dy))
	if err != nil {
		return err
	}
	n := v[1].Len()
	if err := k.lens(op, n, "d_y", v[0], nil, v[2]); err != nil {
		return err
	}
	return k.elementwise(op, "pointwise.cu", "loom_act_bwd_f32", n, v[0].raw(), v[1].raw(), v[2].raw(), int64(n), a)
}

// DropoutMask fills mask, the block at offset of shape box of a tensor of
// shape global, by loom_dropout_mask_f32: the CPU's hash of (seed, step,
// global index), so the same mask bit for bit. The arguments are checked
// as kernels.DropoutMask checks them, at the call. Dims where the box has
// size 1 are dropped and a dim is merged into the one before it where the
// box spans it whole, so more than six dims work when they fold into six;
// a block that does not is an error wrapping loom.ErrUnsupported.
func (k cudaKernels) DropoutMask(mask device.Buffer, offset, box, global []int, p float64, seed, step uint64) error {
	const op = "DropoutMask"
	v, err := k.check(op, f32("mask", mask))
	if err != nil {
		return err
	}
	if !(p >= 0 && p < 1) {
		return k.invalid(op, "probability %v outside [0, 1)", p)
	}
	if len(offset) != len(global) || len(box) != len(global) {
		return k.invalid(op, "offset %v and size %v for a %d-d tensor", offset, box, len(global))
	}
	if _, err := k.shapeSize(op, global); err != nil {
		return err
	}
	n, err := k.shapeSize(op, box)
	if err != nil {
		return err
	}
	for d := range global {
		if offset[d] < 0 || box[d] > global[d]-offset[d] {
			return k.invalid(op, "block at %v of size %v outside %v", offset, box, global)
		}
	}
	if v[0].Len() != n {
		return k.invalid(op, "mask of %d elements for a block of %d", v[0].Len(), n)
	}
	if n == 0 {
		return nil
	}
	base, b, g := foldBlock(offset, box, global)
	if len(b) > maxND {
		return unsupported(k.d, op, "a block %v of %v folds into %d dims; loom_dropout_mask_f32 takes %d", box, global, len(b), maxND)
	}
	args := []any{v[0].raw(), int32(len(b)), int64(base)}
	for d := range maxND {
		args = append(args, int64(at(b, d, 1)))
	}
	for d := range maxND {
		args = append(args, int64(at(g, d, 0)))
	}
	args = append(args, p, float32(1/(1-p)), seed, step)
	return k.elementwise(op, "pointwise.cu", "loom_dropout_mask_f32", n, args...)
}

// foldBlock returns the global row-major index base of the first element
// of the block at offset of shape box in a tensor of shape global, and the
// block's dims folded: sizes b with global strides g, row-major, with the
// dims of size 1 dropped and a dim merged into the one before it where the
// block's dims after it span a whole stride of the global tensor. Element
// i of the block (row-major) has the same global index either way.
func foldBlock(offset, box, global []int) (base int, b, g []int) {
	st := 1
	for d := len(global) - 1; d >= 0; d-- {
		base += offset[d] * st
		switch {
		case box[d] == 1:
		case len(b) > 0 && g[len(g)-1]*b[len(b)-1] == st:
			// The kept dims after d span st elements: one dim with d.
			b[len(b)-1] *= box[d]
		default:
			b, g = append(b, box[d]), append(g, st)
		}
		st *= global[d]
	}
	slices.Reverse(b)
	slices.Reverse(g)
	return base, b, g
}

// ArgmaxRows is dst[r] = the index of row r's largest element of x (rows
// of n), by loom_argmax_rows_f32, a warp per row: the CPU's order (the
// first NaN, else the largest, else the first index), so exact.
func (k cudaKernels) ArgmaxRows(dst, x device.Buffer, n int) error {
	const op = "ArgmaxRows"
	v, err := k.check(op, i64s("dst", dst), f32("x", x))
	if err != nil {
		return err
	}
	if n < 1 || n > math.MaxInt32 {
		return k.invalid(op, "row width %d", n)
	}
	if v[1].Len() != v[0].Len()*n {
		return k.invalid(op, "%d values for %d rows of %d", v[1].Len(), v[0].Len(), n)
	}
	rows := v[0].Len()
	return k.rowwise(op, "pointwise.cu", "loom_argmax_rows_f32", rows, v[0].raw(), v[1].raw(), int64(rows), int32(n))
}
