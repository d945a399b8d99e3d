package cuda

import (
	"fmt"
	"math"
	"sync"

	"github.com/b7ea7098/loom/kernels"
)

// DType is the element type of the typed kernels.
type DType int

const (
	// Float32 is C float.
	Float32 DType = iota + 1
	// Float64 is C double.
	Float64
)

// Size returns the element size in bytes (0 for an unknown DType).
func (t DType) Size() int {
	switch t {
	case Float32:
		return 4
	case Float64:
		return 8
	}
	return 0
}

// String returns "float32" or "float64".
func (t DType) String() string {
	switch t {
	case Float32:
		return "float32"
	case Float64:
		return "float64"
	}
	return fmt.Sprintf("DType(%d)", int(t))
}

// ChooseArch picks the NVRTC target for a device of compute capability cc
// (major·10 + minor) given NVRTC's supported real architectures (nil when
// unknown). A cubin runs on devices of the same major version and an equal
// or higher minor one, so it returns the newest supported architecture of
// the device's major version not above cc, as a cubin. Failing that (the
// device is newer than NVRTC) it returns PTX for the newest supported
// architecture below cc, which the driver compiles when loading. With no
// list it targets cc itself. It returns an error when NVRTC supports
// nothing at or below cc.
func ChooseArch(cc int, supported []int) (arch int, ptx bool, err error) {
	if cc <= 0 {
		return 0, false, fmt.Errorf("cuda: ChooseArch: %w: bad compute capability %d", ErrInvalid, cc)
	}
	if len(supported) == 0 {
		return cc, false, nil
	}
	best := 0
	for _, a := range supported {
		if a <= cc && a/10 == cc/10 && a > best {
			best = a
		}
	}
	if best > 0 {
		return best, false, nil
	}
	for _, a := range supported {
		if a <= cc && a > best {
			best = a
		}
	}
	if best > 0 {
		return best, true, nil
	}
	return 0, false, fmt.Errorf("cuda: ChooseArch: %w: NVRTC supports architectures %v, none at or below the device's %d", ErrUnsupported, supported, cc)
}

// MoE holds the compiled permute kernels of [Source] loaded on one
// [Context]. Its methods mirror package kernels' permute kernels on device
// buffers: they check buffer sizes, queue the copies and kernels on the
// MoE's stream (the legacy default stream unless [WithStream]) and return
// without waiting ([Stream.Synchronize] or [Context.Synchronize] waits).
// Close it before the Context.
type MoE struct {
	ctx    *Context
	stream *Stream
	mod    *Module
	fns    map[string]Function

	mu     sync.Mutex
	closed bool
}

// MoEOption configures [NewMoE].
type MoEOption func(*moeConfig)

type moeConfig struct{ stream *Stream }

// WithStream makes the MoE queue its uploads and kernels on s, a stream of
// the MoE's Context, instead of the legacy default stream.
func WithStream(s *Stream) MoEOption {
	return func(c *moeConfig) { c.stream = s }
}

// NewMoE compiles [Source] for c's device through c's module cache
// ([Context.CompileModule]) and looks up its kernels.
func NewMoE(c *Context, opts ...MoEOption) (*MoE, error) {
	if c == nil {
		return nil, fmt.Errorf("cuda: NewMoE: %w: nil Context", ErrInvalid)
	}
	cfg := moeConfig{stream: c.Legacy()}
	for _, o := range opts {
		if o != nil {
			o(&cfg)
		}
	}
	if cfg.stream == nil || cfg.stream.ctx != c {
		return nil, fmt.Errorf("cuda: NewMoE: %w: WithStream needs a stream of the same Context", ErrInvalid)
	}
	mod, err := c.CompileModule(Source(), "loom_permute.cu")
	if err != nil {
		return nil, fmt.Errorf("cuda: NewMoE: %w", err)
	}
	m := &MoE{ctx: c, stream: cfg.stream, mod: mod, fns: map[string]Function{}}
	for _, n := range KernelNames() {
		f, err := mod.Function(n)
		if err != nil {
			return nil, fmt.Errorf("cuda: NewMoE: %w", err)
		}
		m.fns[n] = f
	}
	return m, nil
}

// Program returns the compiled program: its options (architecture), PTX
// or cubin, NVRTC's log, and whether it came from the kernel cache.
func (m *MoE) Program() *Program { return m.mod.Program() }

// Stream returns the stream the MoE queues its work on.
func (m *MoE) Stream() *Stream { return m.stream }

// Close makes the MoE unusable. Its module stays in the Context's module
// cache until the Context closes. Closing twice is a no-op.
func (m *MoE) Close() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.closed = true
	return nil
}

// fn returns kernel name, or an error when m is closed.
func (m *MoE) fn(name string) (Function, error) {
	if m == nil {
		return Function{}, fmt.Errorf("cuda: %s: %w: nil MoE", name, ErrInvalid)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return Function{}, fmt.Errorf("cuda: %s: %w: MoE is closed", name, ErrInvalid)
	}
	return m.fns[name], nil
}

// DeviceRouting is a [kernels.Routing]'s row maps on the device, made by
// [MoE.Upload]; Free releases them.
type DeviceRouting struct {
	// Tokens, TopK and Rows are the routing's n, K and packed row count.
	Tokens, TopK, Rows int
	// RowSlot (Rows int32 entries) and SlotRow (Tokens·TopK entries) are
	// the routing's maps.
	RowSlot, SlotRow Buffer

	ctx *Context
}

// Upload copies r's row maps to the device, after checking that every
// entry is in range (so that no kernel can read outside its buffers).
func (m *MoE) Upload(r *kernels.Routing) (*DeviceRouting, error) {
	if r == nil {
		return nil, fmt.Errorf("cuda: Upload: %w: nil Routing", ErrInvalid)
	}
	slots, rows := len(r.SlotRow), len(r.RowSlot)
	if r.TopK < 1 || slots != r.Tokens*r.TopK || rows != r.Rows() {
		return nil, fmt.Errorf("cuda: Upload: %w: Routing is not planned (tokens %d, top-k %d, %d rows, %d slot map, %d row map)",
			ErrInvalid, r.Tokens, r.TopK, r.Rows(), slots, rows)
	}
	if err := checkIndex("Upload: RowSlot", r.RowSlot, slots); err != nil {
		return nil, err
	}
	if err := checkIndex("Upload: SlotRow", r.SlotRow, rows); err != nil {
		return nil, err
	}
	d := &DeviceRouting{Tokens: r.Tokens, TopK: r.TopK, Rows: rows, ctx: m.ctx}
	var err error
	if d.RowSlot, err = m.uploadInt32(r.RowSlot); err != nil {
		return nil, fmt.Errorf("cuda: Upload: %w", err)
	}
	if d.SlotRow, err = m.uploadInt32(r.SlotRow); err != nil {
		_ = m.ctx.Free(d.RowSlot) // cleanup; the upload error is the one to report
		return nil, fmt.Errorf("cuda: Upload: %w", err)
	}
	return d, nil
}

// Free releases the device maps (cuMemFree_v2), once the kernels that
// read them have completed (synchronise the MoE's stream first). Freeing
// twice is a no-op.
func (d *DeviceRouting) Free() error {
	if d == nil || d.ctx == nil {
		return nil
	}
	err1 := d.ctx.Free(d.RowSlot)
	err2 := d.ctx.Free(d.SlotRow)
	d.RowSlot, d.SlotRow, d.ctx = Buffer{}, Buffer{}, nil
	if err1 != nil {
		return err1
	}
	return err2
}

// checkIndex checks that every entry of idx is −1 or in [0, limit).
func checkIndex(what string, idx []int32, limit int) error {
	for i, v := range idx {
		if v < -1 || int(v) >= limit {
			return fmt.Errorf("cuda: %s[%d]: %w: %d, want -1 or [0, %d)", what, i, ErrInvalid, v, limit)
		}
	}
	return nil
}

// uploadInt32 allocates a buffer for idx and queues copying it there on
// m's stream, ahead of the kernels that read it.
func (m *MoE) uploadInt32(idx []int32) (Buffer, error) {
	c := m.ctx
	b, err := c.Alloc(4 * len(idx))
	if err != nil {
		return Buffer{}, err
	}
	if err := CopyToDeviceAsync(m.stream, b, idx); err != nil {
		_ = c.Free(b) // cleanup; the copy error is the one to report
		return Buffer{}, err
	}
	return b, nil
}

// RowMap is a row index on the device for [MoE.Gather]: Rows entries, each
// −1 (a zero row) or a source row below SrcRows. [MoE.UploadRowMap] makes
// it; Free releases it.
type RowMap struct {
	// Rows is the number of entries (destination rows); SrcRows bounds
	// them.
	Rows, SrcRows int
	// Idx holds the Rows int32 entries on the device.
	Idx Buffer

	ctx *Context
}

// UploadRowMap checks idx (every entry −1 or in [0, srcRows)) and copies it
// to the device.
func (m *MoE) UploadRowMap(idx []int32, srcRows int) (*RowMap, error) {
	if err := checkIndex("UploadRowMap: idx", idx, srcRows); err != nil {
		return nil, err
	}
	b, err := m.uploadInt32(idx)
	if err != nil {
		return nil, fmt.Errorf("cuda: UploadRowMap: %w", err)
	}
	return &RowMap{Rows: len(idx), SrcRows: srcRows, Idx: b, ctx: m.ctx}, nil
}

// Free releases the device index (cuMemFree_v2), once the kernels that
// read it have completed. Freeing twice is a no-op.
func (r *RowMap) Free() error {
	if r == nil || r.ctx == nil {
		return nil
	}
	err := r.ctx.Free(r.Idx)
	r.Idx, r.ctx = Buffer{}, nil
	return err
}

// GroupIndex returns the row map that moves the chunks of a [ranks, local]
// count matrix between the rank-major and the expert-major layouts, for
// [MoE.Gather]: with toExpert, destination row i (expert-major) comes from
// source row idx[i] (rank-major), as [kernels.GroupByExpert]; otherwise
// the inverse, as [kernels.GroupByRank].
func GroupIndex(counts []int, ranks, local int, toExpert bool) ([]int32, error) {
	if ranks < 0 || local < 0 || len(counts) != ranks*local {
		return nil, fmt.Errorf("cuda: GroupIndex: %w: %d counts for %d ranks × %d local experts", ErrInvalid, len(counts), ranks, local)
	}
	total := 0
	for i, c := range counts {
		if c < 0 {
			return nil, fmt.Errorf("cuda: GroupIndex: %w: counts[%d] = %d is negative", ErrInvalid, i, c)
		}
		total += c
	}
	if total > math.MaxInt32 {
		return nil, fmt.Errorf("cuda: GroupIndex: %w: %d rows exceed int32", ErrInvalid, total)
	}
	// rankStart[q·local+l]: rank-major offset of chunk (q, l);
	// expertStart likewise in the expert-major layout.
	idx := make([]int32, total)
	rankStart := make([]int, len(counts))
	off := 0
	for i, c := range counts {
		rankStart[i] = off
		off += c
	}
	off = 0
	for l := range local {
		for q := range ranks {
			c := counts[q*local+l]
			for j := range c {
				rm, em := rankStart[q*local+l]+j, off+j
				if toExpert {
					idx[em] = int32(rm)
				} else {
					idx[rm] = int32(em)
				}
			}
			off += c
		}
	}
	return idx, nil
}

// rowLaunch returns the 2-D block and the grid for rows rows of words
// words: threadIdx.x over a row (the power of two that covers it, up to
// 256), threadIdx.y over rows (256 threads a block), at most 65535 blocks
// (the kernels stride over the rest). Rows narrower than a warp share
// one, so that short rows keep every lane busy.
func rowLaunch(rows, words int) (grid, block Dim3) {
	bx := 1
	for bx < 256 && bx < words {
		bx *= 2
	}
	by := 256 / bx
	g := min((rows+by-1)/by, 65535)
	return Dim3{X: uint32(max(g, 1))}, Dim3{X: uint32(bx), Y: uint32(by)}
}

// warpLaunch returns the 1-D block (8 warps) and the grid of the
// gate-gradient kernel, which gives each slot a warp: at most 65535
// blocks (the kernel strides over the rest).
func warpLaunch(slots int) (grid, block Dim3) {
	const warps = 8
	return Dim3{X: uint32(max(min((slots+warps-1)/warps, 65535), 1))}, Dim3{X: 32 * warps}
}

// vector returns whether rows of d elements of size es at ptrs can move in
// 16-byte words, and the elements a thread then handles at once (16/es,
// else 1).
func vector(es, d int, ptrs ...DevicePtr) (wide bool, elems int) {
	if wordSize(d*es, ptrs...) == 16 {
		return true, 16 / es
	}
	return false, 1
}

// wordSize returns the widest copy word (16, 8, 4 or 1 bytes) that divides
// rowBytes and every pointer.
func wordSize(rowBytes int, ptrs ...DevicePtr) int {
	for _, w := range []int{16, 8, 4} {
		ok := rowBytes%w == 0
		for _, p := range ptrs {
			ok = ok && uint64(p)%uint64(w) == 0
		}
		if ok {
			return w
		}
	}
	return 1
}

// need checks that buffer name holds at least n bytes.
func need(op, name string, b Buffer, n int) error {
	if b.Bytes < n || (n > 0 && b.Ptr == 0) {
		return fmt.Errorf("cuda: %s: %w: %s holds %d bytes at %#x, need %d", op, ErrInvalid, name, b.Bytes, b.Ptr, n)
	}
	return nil
}

// gather launches the gather kernel: dst row r = src row idx[r]/div or
// zeros.
func (m *MoE) gather(op string, dst, src, idx Buffer, rows, div, rowBytes int) error {
	if rows == 0 || rowBytes == 0 {
		return nil
	}
	w := wordSize(rowBytes, dst.Ptr, src.Ptr)
	name := map[int]string{16: kGatherW16, 8: kGatherW8, 4: kGatherW4, 1: kGatherW1}[w]
	f, err := m.fn(name)
	if err != nil {
		return err
	}
	words := rowBytes / w
	grid, block := rowLaunch(rows, words)
	if err := m.stream.Launch(f, grid, block, 0, dst, src, idx, int32(div), int64(rows), int64(words)); err != nil {
		return fmt.Errorf("cuda: %s: %w", op, err)
	}
	return nil
}

// Gather sets row i of dst to row Idx[i] of src, or to zeros where Idx[i]
// is −1; rows are rowBytes bytes. dst must hold rm.Rows rows and src
// rm.SrcRows rows. With a [GroupIndex] map it is the device
// [kernels.GroupByExpert] / [kernels.GroupByRank].
func (m *MoE) Gather(dst, src Buffer, rowBytes int, rm *RowMap) error {
	const op = "Gather"
	if rm == nil || rm.ctx == nil {
		return fmt.Errorf("cuda: %s: %w: nil or freed RowMap", op, ErrInvalid)
	}
	if rowBytes < 0 {
		return fmt.Errorf("cuda: %s: %w: negative row size %d", op, ErrInvalid, rowBytes)
	}
	if err := firstErr(need(op, "dst", dst, rm.Rows*rowBytes), need(op, "src", src, rm.SrcRows*rowBytes)); err != nil {
		return err
	}
	return m.gather(op, dst, src, rm.Idx, rm.Rows, 1, rowBytes)
}

func firstErr(errs ...error) error {
	for _, e := range errs {
		if e != nil {
			return e
		}
	}
	return nil
}

// typed checks the dtype and the routing and returns the element size.
func typed(op string, t DType, d int, r *DeviceRouting) (int, error) {
	switch {
	case t.Size() == 0:
		return 0, fmt.Errorf("cuda: %s: %w: unknown %v", op, ErrInvalid, t)
	case d < 0:
		return 0, fmt.Errorf("cuda: %s: %w: negative row width %d", op, ErrInvalid, d)
	case r == nil || r.ctx == nil:
		return 0, fmt.Errorf("cuda: %s: %w: nil or freed DeviceRouting", op, ErrInvalid)
	}
	return t.Size(), nil
}

// Permute is the device [kernels.Permute]: packed row p of out becomes
// token row RowSlot[p]/K of x, pad rows zero. x holds r.Tokens rows of d
// elements of type t, out r.Rows rows.
func (m *MoE) Permute(t DType, out, x Buffer, d int, r *DeviceRouting) error {
	const op = "Permute"
	es, err := typed(op, t, d, r)
	if err != nil {
		return err
	}
	if err := firstErr(need(op, "out", out, r.Rows*d*es), need(op, "x", x, r.Tokens*d*es)); err != nil {
		return err
	}
	return m.gather(op, out, x, r.RowSlot, r.Rows, r.TopK, d*es)
}

// PermuteSlots is the device [kernels.PermuteSlots]: packed row p of out
// becomes slot row RowSlot[p] of v (Tokens·TopK rows), pad rows zero.
func (m *MoE) PermuteSlots(t DType, out, v Buffer, d int, r *DeviceRouting) error {
	const op = "PermuteSlots"
	es, err := typed(op, t, d, r)
	if err != nil {
		return err
	}
	if err := firstErr(need(op, "out", out, r.Rows*d*es), need(op, "v", v, r.Tokens*r.TopK*d*es)); err != nil {
		return err
	}
	return m.gather(op, out, v, r.RowSlot, r.Rows, 1, d*es)
}

// UnpermuteSlots is the device [kernels.UnpermuteSlots]: slot row s of v
// becomes packed row SlotRow[s], or zeros for a dead slot.
func (m *MoE) UnpermuteSlots(t DType, v, packed Buffer, d int, r *DeviceRouting) error {
	const op = "UnpermuteSlots"
	es, err := typed(op, t, d, r)
	if err != nil {
		return err
	}
	if err := firstErr(need(op, "v", v, r.Tokens*r.TopK*d*es), need(op, "packed", packed, r.Rows*d*es)); err != nil {
		return err
	}
	return m.gather(op, v, packed, r.SlotRow, r.Tokens*r.TopK, 1, d*es)
}

// Unpermute is the device [kernels.Unpermute]: token row t of out becomes
// Σ_j gates[t·K+j]·packed[SlotRow[t·K+j]] over live slots, summed in slot
// order. The zero gates Buffer weights every slot by 1.
func (m *MoE) Unpermute(t DType, out, packed, gates Buffer, d int, r *DeviceRouting) error {
	const op = "Unpermute"
	es, err := typed(op, t, d, r)
	if err != nil {
		return err
	}
	errs := []error{need(op, "out", out, r.Tokens*d*es), need(op, "packed", packed, r.Rows*d*es)}
	if gates.Ptr != 0 {
		errs = append(errs, need(op, "gates", gates, r.Tokens*r.TopK*es))
	}
	if err := firstErr(errs...); err != nil {
		return err
	}
	if r.Tokens == 0 || d == 0 {
		return nil
	}
	wide, v := vector(es, d, out.Ptr, packed.Ptr)
	f, err := m.fn(typedKernel(kUnpermute, t, wide))
	if err != nil {
		return err
	}
	grid, block := rowLaunch(r.Tokens, d/v)
	if err := m.stream.Launch(f, grid, block, 0, out, packed, gates, r.SlotRow, int32(r.TopK), int64(r.Tokens), int64(d)); err != nil {
		return fmt.Errorf("cuda: %s: %w", op, err)
	}
	return nil
}

// UnpermuteBackward is the device [kernels.UnpermuteBackward]: dpacked
// (skipped when zero) gets gates[s]·dout[s/K] in each live slot's row and
// zeros in pad rows; dgates (skipped when zero) gets
// ⟨packed[SlotRow[s]], dout[s/K]⟩, accumulated in double, or 0 for a dead
// slot. The zero gates Buffer weights every slot by 1.
func (m *MoE) UnpermuteBackward(t DType, dpacked, dgates, dout, packed, gates Buffer, d int, r *DeviceRouting) error {
	const op = "UnpermuteBackward"
	es, err := typed(op, t, d, r)
	if err != nil {
		return err
	}
	slots := r.Tokens * r.TopK
	errs := []error{need(op, "dout", dout, r.Tokens*d*es)}
	if dpacked.Ptr != 0 {
		errs = append(errs, need(op, "dpacked", dpacked, r.Rows*d*es))
	}
	if dgates.Ptr != 0 {
		errs = append(errs, need(op, "dgates", dgates, slots*es), need(op, "packed", packed, r.Rows*d*es))
	}
	if gates.Ptr != 0 {
		errs = append(errs, need(op, "gates", gates, slots*es))
	}
	if err := firstErr(errs...); err != nil {
		return err
	}
	if dpacked.Ptr != 0 && r.Rows > 0 && d > 0 {
		wide, v := vector(es, d, dpacked.Ptr, dout.Ptr)
		f, err := m.fn(typedKernel(kScaleGather, t, wide))
		if err != nil {
			return err
		}
		grid, block := rowLaunch(r.Rows, d/v)
		if err := m.stream.Launch(f, grid, block, 0, dpacked, dout, gates, r.RowSlot, int32(r.TopK), int64(r.Rows), int64(d)); err != nil {
			return fmt.Errorf("cuda: %s: %w", op, err)
		}
	}
	if dgates.Ptr != 0 && slots > 0 {
		wide, _ := vector(es, d, packed.Ptr, dout.Ptr)
		f, err := m.fn(typedKernel(kGateGrad, t, wide))
		if err != nil {
			return err
		}
		grid, block := warpLaunch(slots)
		if err := m.stream.Launch(f, grid, block, 0, dgates, packed, dout, r.SlotRow, int32(r.TopK), int64(slots), int64(d)); err != nil {
			return fmt.Errorf("cuda: %s: %w", op, err)
		}
	}
	return nil
}
