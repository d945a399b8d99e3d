package placement

import (
	"context"
	"encoding/binary"
	"fmt"
	"hash/fnv"
	"slices"
	"strings"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/internal/checked"
	"github.com/b7ea7098/loom/kernels"
	"github.com/b7ea7098/loom/mesh"
)

// DTensor is one rank's handle on a distributed tensor: its local block
// plus the Spec that says which part of the global tensor the block is.
//
// The local block is loom's own dense representation: a []float32 or
// []float64 (the Spec's dtype) in row-major order over LocalShape, so an
// empty shard (some local dim 0) is an empty slice and a scalar is one
// element. LocalData returns it; there is no gorgonia tensor inside
// (package dense converts to and from gorgonia.org/tensor at the edge).
// A DTensor owns its local data; operations return new DTensors and never
// modify their inputs.
type DTensor struct {
	spec  *Spec
	shape []int // local shape
	data  any   // []float32 or []float64, or a device.Buffer; row-major over shape
}

// Spec returns the tensor's spec.
func (t *DTensor) Spec() *Spec { return t.spec }

// LocalShape returns the shape of this rank's block (dims may be 0).
func (t *DTensor) LocalShape() []int { return slices.Clone(t.shape) }

// LocalData returns this rank's block as a []float32 or []float64 in
// row-major order over LocalShape; it is empty, never nil, for an empty
// shard. The slice aliases the tensor's memory. For a tensor on a device
// other than the host (Device) it is the device.Buffer that holds the
// block.
func (t *DTensor) LocalData() any { return t.data }

// newDTensor wraps a block. An empty block's data is made non-nil (an
// Allocator may hand out nil for 0 elements), so LocalData never is nil.
func newDTensor[T elem](s *Spec, b block[T]) *DTensor {
	if b.data == nil {
		b.data = []T{}
	}
	return &DTensor{spec: s, shape: b.shape, data: b.data}
}

func blockOf[T elem](t *DTensor) block[T] {
	return block[T]{shape: t.shape, data: t.data.([]T)}
}

// checkData reports whether data is a []float32 or []float64 of dtype dt
// with prod(shape) elements; what names the data in errors.
func checkData(op string, data any, dt comm.DType, shape []int, what string) error {
	var n int
	switch d := data.(type) {
	case []float32:
		if dt != comm.Float32 {
			return invalidf(op, "%s data is []float32, the spec says %v", what, dt)
		}
		n = len(d)
	case []float64:
		if dt != comm.Float64 {
			return invalidf(op, "%s data is []float64, the spec says %v", what, dt)
		}
		n = len(d)
	case nil:
		return invalidf(op, "nil %s data: want a %v slice of %d elements (shape %v)", what, dt, prod(shape), shape)
	case device.Buffer:
		return invalidf(op, "%s data is a buffer on %s: this operation takes host data ([]float32 or []float64); copy it with DTensor.To(device.Host()) or build the tensor with NewLocalOn", what, d.Device())
	default:
		return invalidf(op, "%s data is %T, want []float32 or []float64", what, data)
	}
	if n != prod(shape) {
		return invalidf(op, "%s data has %d elements, shape %v holds %d", what, n, shape, prod(shape))
	}
	return nil
}

// cloneData returns a copy of a []float32 or []float64, never nil, or of
// a device buffer on its device (Alloc, then Copy on its compute stream).
func cloneData(op string, data any) (any, error) {
	switch d := data.(type) {
	case []float32:
		return append([]float32{}, d...), nil
	case []float64:
		return append([]float64{}, d...), nil
	case device.Buffer:
		dev := d.Owner()
		b, err := dev.Alloc(d.DType(), d.Len())
		if err != nil {
			return nil, wrapf(op, err, "allocating a copy of the local block on %s", dev.Name())
		}
		if d.Len() > 0 {
			if err := dev.Copy(b, d); err != nil {
				_ = b.Free()
				return nil, wrapf(op, err, "copying the local block on %s", dev.Name())
			}
		}
		return b, nil
	}
	return nil, invalidf(op, "local data is %T, want []float32, []float64 or a device.Buffer", data)
}

// checkLocal is checkData for a local block that may also be a buffer of
// a device other than the host, of dtype dt with prod(shape) elements.
func checkLocal(op string, data any, dt comm.DType, shape []int) error {
	b, ok := data.(device.Buffer)
	if !ok {
		return checkData(op, data, dt, shape, "local")
	}
	switch {
	case comm.IsNil(b) || b.Owner() == nil:
		return invalidf(op, "a local buffer without a device")
	case b.Owner().Kind() == device.KindHost:
		return invalidf(op, "local data is a host device.Buffer: pass its []float32 or []float64")
	case b.DType() != dt:
		return invalidf(op, "local buffer on %s is %v, the spec says %v", b.Device(), b.DType(), dt)
	case b.Len() != prod(shape):
		return invalidf(op, "local buffer on %s has %d elements, shape %v holds %d", b.Device(), b.Len(), shape, prod(shape))
	}
	return nil
}

// LocalOption configures where FromFull, FromRoot and FromLocal place the
// tensor they build.
type LocalOption func(*localConfig)

type localConfig struct {
	dev device.Device
	set bool
}

// WithDevice places the tensor's local block on d (nil: the host): the
// block is cut out on the host as without the option, then copied to d
// (DTensor.To). Without it the block stays where its data is: on the
// host, or for FromLocal on the device of a device buffer.
func WithDevice(d device.Device) LocalOption {
	return func(c *localConfig) { c.dev, c.set = d, true }
}

// place applies the LocalOptions to t, which op has just built.
func place(op string, t *DTensor, opts []LocalOption) (*DTensor, error) {
	var c localConfig
	for _, o := range opts { // checkOptions has run
		o(&c)
	}
	if !c.set {
		return t, nil
	}
	out, err := t.To(c.dev)
	if err != nil {
		return nil, wrapf(op, err, "placing the local block")
	}
	return out, nil
}

// checkOptions rejects nil LocalOptions before any data moves.
func checkOptions(op string, opts []LocalOption) error {
	for i, o := range opts {
		if o == nil {
			return invalidf(op, "option %d is nil", i)
		}
	}
	return nil
}

// FromFull distributes a tensor that every rank holds in full: full is a
// []float32 or []float64 (the spec's dtype) in row-major order over the
// global shape, with prod(shape) elements (1 for a scalar, 0 when a dim is
// 0). Each rank copies its block, with no communication; full is not
// retained. On a Partial(sum) axis the rank at coordinate 0 keeps the
// value and the others hold zeros; on Partial(avg|max|min) every rank
// keeps it. WithDevice places the block on a device; full is host data
// either way. Errors wrap ErrInvalid (ErrUnsupported for Routed specs).
func FromFull(spec *Spec, full any, opts ...LocalOption) (*DTensor, error) {
	const op = "FromFull"
	if spec == nil {
		return nil, invalidf(op, "nil spec")
	}
	if err := checkOptions(op, opts); err != nil {
		return nil, err
	}
	if spec.l.hasRouted() {
		return nil, unsupportedf(op, "Routed placements are built by the moe package's dispatch (NewLocal with WithRoutedRows), not distributed from a full tensor")
	}
	if err := checkData(op, full, spec.l.dtype, spec.l.shape, "full"); err != nil {
		return nil, err
	}
	var t *DTensor
	switch d := full.(type) {
	case []float32:
		t = newDTensor(spec, sliceFull(spec, permuteFull(spec.l, d)))
	default:
		t = newDTensor(spec, sliceFull(spec, permuteFull(spec.l, d.([]float64))))
	}
	return place(op, t, opts)
}

// sliceFull cuts this rank's block out of the full data and applies the
// Partial(sum) rule.
func sliceFull[T elem](spec *Spec, full []T) block[T] {
	l := spec.l
	coord := spec.m.Coord()
	off, sz := boxOf(l.shape, l.mshape, l.order, coord)
	b := block[T]{shape: sz, data: make([]T, prod(sz))}
	if len(l.shape) == 0 {
		b.data[0] = full[0]
	} else {
		kernels.CopyBox(b.data, sz, make([]int, len(sz)), full, l.shape, off, sz)
	}
	zeroPartialSum(l, coord, b.data)
	return b
}

// zeroPartialSum zeroes data unless this rank has coordinate 0 on every
// Partial(sum) axis.
func zeroPartialSum[T elem](l *layout, coord []int, data []T) {
	for a, p := range l.places {
		if p.IsPartial() && p.op == comm.Sum && coord[a] != 0 {
			clear(data)
			return
		}
	}
}

// FromRoot distributes a tensor held by one rank: root is a mesh rank (a
// position in spec's mesh, not a world rank) and full, laid out as for
// FromFull, is read only there (other ranks may pass nil). Without Shard
// placements the tensor is broadcast; otherwise every rank's block is
// scattered from root (blocks padded to the largest inside the collective
// only). Partial axes follow FromFull's rule. Root checks full's length and
// element type and tells every rank the verdict before any data moves, so
// a bad tensor is an error everywhere. full is host data (a device
// buffer is refused, naming its device); WithDevice places the block on a
// device once it has arrived.
func FromRoot(ctx context.Context, spec *Spec, full any, root int, opts ...LocalOption) (*DTensor, error) {
	const op = "FromRoot"
	if spec == nil {
		return nil, invalidf(op, "nil spec")
	}
	if err := checkOptions(op, opts); err != nil {
		return nil, err
	}
	if spec.l.hasRouted() {
		return nil, unsupportedf(op, "Routed placements are built by the moe package's dispatch (NewLocal with WithRoutedRows), not distributed from a full tensor")
	}
	m := spec.m
	if root < 0 || root >= m.Size() {
		return nil, invalidf(op, "root %d out of range [0, %d)", root, m.Size())
	}
	if slices.ContainsFunc(spec.l.places, Placement.IsShard) {
		// Root's scatter buffer holds every rank's block padded to the
		// largest; every rank sees the same spec, so all fail alike.
		if _, ok := checked.Product([]int{m.Size(), scatterBlock(spec.l), spec.l.dtype.Size()}); !ok {
			return nil, invalidf(op, "the scatter of %v %v to %d ranks (blocks padded to the largest) needs more bytes than an int holds", spec.l.shape, spec.l.dtype, m.Size())
		}
	}
	c, err := m.Group(ctx)
	if err != nil {
		return nil, err
	}
	// Root's verdict, then the data.
	verdict := []int64{0}
	var rootErr error
	if m.Rank() == root {
		if rootErr = checkData(op, full, spec.l.dtype, spec.l.shape, "root's"); rootErr != nil {
			verdict[0] = 1
		}
	}
	if err := comm.Broadcast(ctx, c, comm.Host(verdict), root); err != nil {
		return nil, err
	}
	if verdict[0] != 0 {
		if rootErr != nil {
			return nil, rootErr
		}
		return nil, invalidf(op, "root %d rejected its tensor (see root's error)", root)
	}
	if spec.l.dtype == comm.Float32 {
		d, _ := full.([]float32) // nil off root, where it is not read
		b, err := fromRoot(ctx, spec, c, d, root)
		if err != nil {
			return nil, err
		}
		return place(op, newDTensor(spec, b), opts)
	}
	d, _ := full.([]float64) // nil off root, where it is not read
	b, err := fromRoot(ctx, spec, c, d, root)
	if err != nil {
		return nil, err
	}
	return place(op, newDTensor(spec, b), opts)
}

func fromRoot[T elem](ctx context.Context, spec *Spec, c comm.Communicator, full []T, root int) (block[T], error) {
	l := spec.l
	m := spec.m
	coord := m.Coord()
	sharded := slices.ContainsFunc(l.places, Placement.IsShard)
	if !sharded {
		buf := full
		if m.Rank() != root {
			buf = make([]T, prod(l.shape))
		}
		if err := comm.Broadcast(ctx, c, comm.Host(buf), root); err != nil {
			return block[T]{}, err
		}
		b := block[T]{shape: slices.Clone(l.shape), data: slices.Clone(buf)}
		zeroPartialSum(l, coord, b.data)
		return b, nil
	}
	p := m.Size()
	maxBox := scatterBlock(l)
	var send []T
	if m.Rank() == root {
		send = make([]T, p*maxBox) // FromRoot checked the product
		full = permuteFull(l, full)
		for r := range p {
			off, sz := boxOf(l.shape, l.mshape, l.order, unravel(r, l.mshape))
			kernels.CopyBox(send[r*maxBox:], sz, make([]int, len(sz)), full, l.shape, off, sz)
		}
	}
	recv := make([]T, maxBox)
	var sb comm.Buffer
	if send != nil {
		sb = comm.Host(send)
	}
	if err := comm.Scatter(ctx, c, sb, comm.Host(recv), root); err != nil {
		return block[T]{}, err
	}
	_, sz := boxOf(l.shape, l.mshape, l.order, coord)
	b := block[T]{shape: sz, data: recv[:prod(sz)]}
	zeroPartialSum(l, coord, b.data)
	return b, nil
}

// scatterBlock is the largest block of any mesh rank, in elements.
func scatterBlock(l *layout) int {
	n := 0
	for r := range prod(l.mshape) {
		_, sz := boxOf(l.shape, l.mshape, l.order, unravel(r, l.mshape))
		n = max(n, prod(sz))
	}
	return n
}

// FromLocal builds a DTensor from a copy of this rank's block: local is a
// []float32 or []float64 (the spec's dtype) in row-major order over exactly
// the shape Spec.LocalShape gives this rank; an empty block is an empty
// slice (nil is accepted too). A Routed spec needs its row counts
// (WithRoutedRows). With check, the ranks first compare a fingerprint of
// the spec (mesh, global shape, dtype, placements, shard order) and whether
// each local block is right, with one small all-gather over the mesh; on
// any difference every rank returns the same ErrMismatch or ErrInvalid
// error naming the ranks. Without check nothing is communicated and only
// this rank's block is checked. NewLocal wraps a block without copying.
// local may also be a device.Buffer of a device other than the host, of
// the spec's dtype and local length: the copy is then made on that
// device. WithDevice places the copy on a device.
func FromLocal(ctx context.Context, spec *Spec, local any, check bool, opts ...LocalOption) (*DTensor, error) {
	const op = "FromLocal"
	if spec == nil {
		return nil, invalidf(op, "nil spec")
	}
	if err := checkOptions(op, opts); err != nil {
		return nil, err
	}
	if spec.l.hasRouted() && spec.l.rows == nil {
		return nil, unsupportedf(op, "a Routed spec without row counts has no local shape (WithRoutedRows; the moe package's dispatch builds Routed tensors)")
	}
	want := spec.LocalShape()
	if local == nil && prod(want) == 0 {
		local = zeroData(spec.l.dtype, 0)
	}
	localErr := checkLocal(op, local, spec.l.dtype, want)
	if check {
		if err := agree(ctx, op, spec.m, spec.l.key, localErr == nil); err != nil {
			if localErr != nil {
				return nil, fmt.Errorf("%w (this rank: %v)", err, localErr)
			}
			return nil, err
		}
	}
	if localErr != nil {
		return nil, localErr
	}
	data, err := cloneData(op, local)
	if err != nil {
		return nil, err
	}
	return place(op, &DTensor{spec: spec, shape: want, data: data}, opts)
}

// zeroData returns n zeros of dtype dt (float32 or float64).
func zeroData(dt comm.DType, n int) any {
	if dt == comm.Float32 {
		return make([]float32, n)
	}
	return make([]float64, n)
}

// fingerprint hashes a string to an int64.
func fingerprint(s string) int64 {
	h := fnv.New64a()
	h.Write([]byte(s))
	return int64(binary.LittleEndian.Uint64(h.Sum(nil)))
}

// agree all-gathers (fingerprint of key, ok) over the whole mesh and
// returns an error on every rank if the fingerprints differ or any rank is
// not ok.
func agree(ctx context.Context, op string, m *mesh.Mesh, key string, ok bool) error {
	c, err := m.Group(ctx)
	if err != nil {
		return err
	}
	me := []int64{fingerprint(key), 0}
	if ok {
		me[1] = 1
	}
	all := make([]int64, 2*c.Size())
	if err := comm.AllGather(ctx, c, comm.Host(me), comm.Host(all)); err != nil {
		return err
	}
	var differ, bad []int
	for r := range c.Size() {
		if all[2*r] != all[0] {
			differ = append(differ, r)
		}
		if all[2*r+1] == 0 {
			bad = append(bad, r)
		}
	}
	if len(differ) > 0 {
		return mismatchf(op, "mesh ranks %v hold a different spec (global shape, dtype, placements or shard order) from mesh rank 0; this rank has %s", differ, key)
	}
	if len(bad) > 0 {
		return invalidf(op, "mesh ranks %v passed local tensors whose shape or dtype does not match the spec %s", bad, key)
	}
	return nil
}

// Full materialises the global tensor on every rank (an all-gather or
// all-reduce per axis as needed) and returns it as a fresh []float32 or
// []float64 in row-major order over Spec().Shape(): prod(shape) elements,
// 1 for a scalar, none when a global dim is 0. Every rank of the mesh must
// call it.
func (t *DTensor) Full(ctx context.Context) (any, error) {
	places := make([]Placement, len(t.spec.l.places))
	for i := range places {
		places[i] = Replicate()
	}
	dst, err := t.spec.With(places)
	if err != nil {
		return nil, err
	}
	r, err := Redistribute(ctx, t, dst)
	if err != nil {
		return nil, err
	}
	if b, ok := r.data.(device.Buffer); ok {
		return hostCopy("Full", b, true)
	}
	return r.data, nil
}

// hostCopy returns a device buffer's elements as a fresh []float32 or
// []float64 (empty, never nil, for none), waiting for the work queued on
// its device; with free, it then frees b, a temporary of the caller's.
func hostCopy(op string, b device.Buffer, free bool) (any, error) {
	d := b.Owner()
	h, err := comm.NewHostBuffer(b.DType(), b.Len())
	if err == nil {
		err = d.CopyToHost(h, b)
	}
	if free {
		if ferr := b.Free(); err == nil {
			err = ferr
		}
	}
	if err != nil {
		return nil, wrapf(op, err, "copying the local block off %s", d.Name())
	}
	switch {
	case b.Len() == 0:
		return zeroData(b.DType(), 0), nil
	case b.DType() == comm.Float32:
		return h.Float32s(), nil
	case b.DType() == comm.Float64:
		return h.Float64s(), nil
	}
	return nil, invalidf(op, "a %v buffer on %s: want float32 or float64", b.DType(), d.Name())
}

// String shows the global shape, dtype, placements and every mesh rank's
// block ("[lo:hi, ...]"), computed from the spec without communication.
func (t *DTensor) String() string {
	l := t.spec.l
	var b strings.Builder
	fmt.Fprintf(&b, "DTensor %s", l)
	partial := slices.ContainsFunc(l.places, Placement.IsPartial)
	for r := range prod(l.mshape) {
		coord := unravel(r, l.mshape)
		off, sz := l.box(coord)
		fmt.Fprintf(&b, "\n  rank %d %v: [", r, coord)
		for d := range off {
			if d > 0 {
				b.WriteString(", ")
			}
			fmt.Fprintf(&b, "%d:%d", off[d], off[d]+sz[d])
		}
		b.WriteString("]")
		if prod(sz) == 0 {
			b.WriteString(" (empty)")
		}
		if partial {
			b.WriteString(" partial")
		}
		if r == t.spec.m.Rank() {
			b.WriteString(" <- this rank")
		}
	}
	return b.String()
}

// Redistribute returns t laid out by dst, planning without a cache (see
// Planner.Redistribute for cached plans and time estimates).
func Redistribute(ctx context.Context, t *DTensor, dst *Spec) (*DTensor, error) {
	var p *Planner
	return p.Redistribute(ctx, t, dst)
}

// Redistribute returns t laid out by dst. dst must have t's global shape
// and dtype and a mesh on the same world; if its mesh differs from t's, it
// must cover the same world ranks (a cross-mesh redistribute). Every rank
// of the mesh must call it with the same arguments; all checks that can be
// made locally run before any data moves. A nil Planner plans without a
// cache. The options are Execute's.
func (p *Planner) Redistribute(ctx context.Context, t *DTensor, dst *Spec, opts ...ExecuteOption) (*DTensor, error) {
	const op = "Redistribute"
	if t == nil || dst == nil {
		return nil, invalidf(op, "nil tensor or destination spec")
	}
	if t.spec.m.World() != dst.m.World() {
		return nil, invalidf(op, "the tensor is on mesh %v but the destination spec is on mesh %v, built on another world communicator", t.spec.m, dst.m)
	}
	pl, err := p.planLayouts(t.spec.l, dst.l)
	if err != nil {
		return nil, err
	}
	return p.Execute(ctx, pl, t, dst.m, opts...)
}

// Allocator supplies the memory a redistribution writes, so that a caller
// that recycles buffers (autograd's tape) can keep a training step from
// allocating. Each method returns at least n elements with arbitrary
// contents. result reports what the block is for: the data of the tensor
// Execute returns (it lives as long as that tensor), or a temporary that
// is dead once Execute returns. Execute may call it from the calling
// goroutine only.
type Allocator interface {
	Float32(n int, result bool) []float32
	Float64(n int, result bool) []float64
}

// ExecuteOption configures one Planner.Execute call.
type ExecuteOption func(*executeConfig)

type executeConfig struct {
	alloc Allocator
	reuse bool
}

// WithAllocator makes Execute take its buffers from a instead of
// allocating them. Without it every buffer is fresh memory. A cross-mesh
// step allocates its own buffers either way. It applies to host tensors
// only: a tensor on another device takes its buffers from that device's
// caching allocator, which already reuses them.
func WithAllocator(a Allocator) ExecuteOption {
	return func(c *executeConfig) { c.alloc = a }
}

// WithReuseInput lets Execute write its result over t's local block, so that a
// reduction such as Partial(sum) -> Replicate all-reduces in place and
// allocates nothing. The caller gives t up: after the call its data is
// undefined, and the result may share its memory.
func WithReuseInput() ExecuteOption {
	return func(c *executeConfig) { c.reuse = true }
}

// Execute applies a plan to t, which must be laid out as the plan's
// source; dst is the destination mesh (t's own mesh unless the plan is
// cross-mesh; nil means t's mesh). Autograd uses it to run backward plans.
// The result never shares memory with t, unless WithReuseInput says it may.
func (p *Planner) Execute(ctx context.Context, pl *Plan, t *DTensor, dst *mesh.Mesh, opts ...ExecuteOption) (*DTensor, error) {
	const op = "Execute"
	var cfg executeConfig
	for _, o := range opts {
		o(&cfg)
	}
	if pl == nil || t == nil {
		return nil, invalidf(op, "nil plan or tensor")
	}
	if dst == nil {
		dst = t.spec.m
	}
	if t.spec.l.key != pl.src.key {
		return nil, invalidf(op, "the tensor is laid out as %s but the plan starts from %s", t.spec.l, pl.src)
	}
	if dst.World() != t.spec.m.World() {
		return nil, invalidf(op, "the destination mesh %v is built on another world communicator than the tensor's mesh %v", dst, t.spec.m)
	}
	if err := checkMesh(op, dst, pl.dst, "destination"); err != nil {
		return nil, err
	}
	if p != nil && p.check {
		if err := agree(ctx, op, t.spec.m, pl.src.key+"\x00"+pl.dst.key, true); err != nil {
			return nil, err
		}
	}
	spec := &Spec{m: dst, l: pl.dst}
	switch d := t.data.(type) {
	case []float32:
		b, err := execute(ctx, pl, t.spec.m, dst, blockOf[float32](t), cfg.alloc, cfg.reuse)
		if err != nil {
			return nil, err
		}
		return newDTensor(spec, b), nil
	case []float64:
		b, err := execute(ctx, pl, t.spec.m, dst, blockOf[float64](t), cfg.alloc, cfg.reuse)
		if err != nil {
			return nil, err
		}
		return newDTensor(spec, b), nil
	case device.Buffer:
		b, err := executeDevice(ctx, pl, t.spec.m, dst, t.shape, d, cfg.reuse)
		if err != nil {
			return nil, err
		}
		return &DTensor{spec: spec, shape: b.shape, data: b.buf}, nil
	}
	return nil, invalidf(op, "the local block is %T, want []float32, []float64 or a device.Buffer", t.data)
}
