package ddp

import (
	"context"
	"errors"
	"fmt"
	"slices"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/internal/numcheck"
	"github.com/b7ea7098/loom/memory"
	"github.com/b7ea7098/loom/parallel/internal/blocks"
	"github.com/b7ea7098/loom/placement"
)

// Default bucket limits, in bytes of gradient data (PyTorch's defaults).
const (
	// DefaultFirstBucket is the limit of the first bucket: small, so that
	// the first all-reduce starts early in backward.
	DefaultFirstBucket int64 = 1 << 20
	// DefaultBucketCap is the limit of every later bucket.
	DefaultBucketCap int64 = 25 << 20
)

// ScaledBucketCap returns a bucket cap for dp data-parallel ranks:
// max(DefaultBucketCap, dp·1 MiB), so that each bucket's all-reduce stays
// bandwidth-bound as the ring's latency term grows with dp (see the package
// documentation).
func ScaledBucketCap(dp int) int64 {
	return max(DefaultBucketCap, int64(dp)<<20)
}

// Option configures New.
type Option func(*config)

type config struct {
	axis   string
	first  int64
	cap    int64
	avg    bool
	report func(names []string)
	views  bool
}

// WithAxis names the data-parallel mesh axis (default "dp").
func WithAxis(name string) Option { return func(c *config) { c.axis = name } }

// WithFirstBucket sets the byte limit of the first bucket (default
// DefaultFirstBucket). It must be at least 1: New fails with ErrInvalid
// otherwise.
func WithFirstBucket(bytes int64) Option { return func(c *config) { c.first = bytes } }

// WithBucketCap sets the byte limit of every bucket after the first
// (default DefaultBucketCap; see ScaledBucketCap for large dp). It must be
// at least 1: New fails with ErrInvalid otherwise.
func WithBucketCap(bytes int64) Option { return func(c *config) { c.cap = bytes } }

// WithGradientAsBucketView makes the reduced gradients DDP installs views of
// its buckets rather than copies (PyTorch's gradient_as_bucket_view): no
// pass copies them out, and on a tape made autograd.WithRecycling the next
// step's Backward writes each gradient straight into its bucket (ZeroGrad
// keeps the view for it), so the bucket needs no filling either. An
// installed gradient is then valid only until the next backward pass
// reaches its bucket: copy it to keep it longer.
func WithGradientAsBucketView() Option { return func(c *config) { c.views = true } }

// WithAverage divides every rank's contribution by dp before the sum, for
// losses that are a per-rank mean over equal local counts. Without it the
// contributions are summed (the convention of autograd.CrossEntropy, which
// already divides by the global row count).
func WithAverage() Option { return func(c *config) { c.avg = true } }

// WithReportUnused makes Finish call fn with the names of the parameters that
// no rank gave a gradient in the step (in parameter order), when there
// are any.
func WithReportUnused(fn func(names []string)) Option { return func(c *config) { c.report = fn } }

// BucketInfo describes one bucket: the parameters in it (indices into the
// list given to New, in bucket order, which is reverse parameter order),
// its element count, its size in bytes and its dtype.
type BucketInfo struct {
	Params []int
	Names  []string
	Elems  int
	Bytes  int64
	DType  comm.DType
}

// bucket is one flat gradient buffer and its state in the current step.
type bucket struct {
	params []int
	elems  int
	dtype  comm.DType
	f32    []float32
	f64    []float64
	dev    device.Buffer // the bucket on a device (f32 and f64 nil)
	ready  int
	work   comm.Work
}

// slot is where a parameter's local gradient lives in its bucket.
type slot struct {
	bucket, off, n int
}

// DDP reduces the data-parallel gradients of a fixed parameter list (see
// the package documentation). It belongs to one rank, like the tape the
// parameters live on; every rank of the mesh builds one with the same
// parameter list and options. Its hooks stay registered on the parameters
// for their lifetime: build one DDP per parameter list.
//
// A step is: forward and Backward (hooks fill buckets and launch their
// all-reduces as they complete), then Finish, then the optimizer step and
// ZeroGrad. Micro-batches before the last run inside NoSync.
type DDP struct {
	cfg     config
	params  []*autograd.Value
	names   []string
	c       comm.Communicator
	axis    int // index of the dp axis in the mesh
	dp      int
	coord   int // this rank's coordinate on the dp axis
	buckets []*bucket
	slots   []slot
	filled  []bool
	has     []int32 // 1 where this rank contributed a gradient this step
	out     []*placement.Spec
	next    int // the next bucket to launch
	noSync  int
	scale   float64
	err     error
	unused  []string
	trace   func(event string)

	// On a device (dev not nil): the parameters' device, its kernels,
	// and each parameter's reduced gradient block (a bucket slice under
	// WithGradientAsBucketView), which Finish installs every step.
	dev    device.Device
	k      device.Kernels
	gbuf   []device.Buffer
	closed bool
}

// New builds a DDP for params on the data-parallel axis of their mesh and
// registers its gradient hooks. Every parameter must be a leaf that requires
// grad, float32 or float64, on one mesh, and Replicate on the dp axis (any
// layout on other axes: DDP reduces local blocks, which are the same size
// on every rank of a dp group). It is collective over the mesh (it may
// create the dp communicator, under ctx).
//
// Before planning any bucket, New checks that every rank of the dp group
// passed the same parameters (names, global and local shapes, dtypes) in
// the same order, and the same bucket limits and WithAverage option; otherwise
// every rank of the group returns the same *comm.DisagreementError
// (matching loom.ErrMismatch), which names the ranks that differ and the
// first entry where they do. The check costs one all-gather of 8 bytes per
// rank for each of the two lists.
//
// The all-reduces issued from the hooks during backward run under the
// context given to Tape.Backward; Finish and Discard wait under their own.
//
// Parameters on a device (autograd.WithDevice; all on one, else an error
// matching device.ErrMixed) get their buckets on that device, allocated
// here, and each a block for its reduced gradient (none under
// WithGradientAsBucketView, whose gradients are bucket slices): the hooks copy
// (and scale) gradients into the buckets with the device's kernels, each
// all-reduce is ordered after the device's compute by
// device.BeforeCollective and before later compute by
// device.AfterCollective, and Finish copies the reduced values into the
// gradient blocks, so a step allocates nothing on the device. An
// installed gradient is then DDP's memory: valid until the next Finish
// (or, on a tape made WithRecycling, the next Backward), and freed by
// Close. A gradient Backward allocated for a leaf is freed at Finish.
func New(ctx context.Context, params []*autograd.Value, opts ...Option) (*DDP, error) {
	cfg := config{axis: "dp", first: DefaultFirstBucket, cap: DefaultBucketCap}
	for _, o := range opts {
		o(&cfg)
	}
	if err := errors.Join(numcheck.Count(ErrInvalid, "New: WithFirstBucket bytes", int(cfg.first)), numcheck.Count(ErrInvalid, "New: WithBucketCap bytes", int(cfg.cap))); err != nil {
		return nil, err // the sentinel's text says "ddp: "
	}
	if len(params) == 0 {
		return nil, fmt.Errorf("%w: no parameters", ErrInvalid)
	}
	seen := map[*autograd.Value]bool{}
	for i, p := range params {
		if p == nil || !p.IsLeaf() || !p.RequiresGrad() {
			return nil, fmt.Errorf("%w: parameter %d (%q) is not a leaf that requires grad", ErrInvalid, i, p.Name())
		}
		if seen[p] {
			return nil, fmt.Errorf("%w: parameter %q listed twice", ErrInvalid, p.Name())
		}
		seen[p] = true
	}
	m := params[0].Spec().Mesh()
	axis := slices.Index(m.Names(), cfg.axis)
	if axis < 0 {
		return nil, fmt.Errorf("%w: mesh %v has no axis %q", ErrInvalid, m, cfg.axis)
	}
	elems := make([]int, len(params))
	dtypes := make([]comm.DType, len(params))
	names := make([]string, len(params))
	for i, p := range params {
		s := p.Spec()
		names[i] = p.Name()
		if !slices.Equal(s.Mesh().Names(), m.Names()) || !slices.Equal(s.Mesh().Shape(), m.Shape()) {
			return nil, fmt.Errorf("%w: parameter %q is on mesh %v, not %v", ErrInvalid, p.Name(), s.Mesh(), m)
		}
		if pl := s.Placements()[axis]; !pl.IsReplicate() {
			return nil, fmt.Errorf("%w: parameter %q is %v on axis %q; DDP needs Replicate there (FSDP shards parameters)", ErrInvalid, p.Name(), pl, cfg.axis)
		}
		if dt := s.DType(); dt != comm.Float32 && dt != comm.Float64 {
			return nil, fmt.Errorf("%w: parameter %q has dtype %v; want float32 or float64", ErrInvalid, p.Name(), dt)
		}
		dtypes[i] = s.DType()
		elems[i] = blocks.Prod(s.LocalShape())
	}
	dev, err := paramsDevice("DDP", params)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	c, err := m.Comm(ctx, cfg.axis)
	if err != nil {
		return nil, err
	}
	coord, err := m.Local(cfg.axis)
	if err != nil {
		return nil, err
	}
	// Buckets are planned from the list alone, so ranks whose lists differ
	// in order would sum one parameter's gradient into another's without
	// any collective noticing: check the lists agree before planning.
	// The error counts ranks on the dp communicator: say so when they are
	// not world ranks.
	along := ""
	if m.NDim() > 1 {
		along = fmt.Sprintf(" (ranks along axis %q)", cfg.axis)
	}
	if err := comm.Agree(ctx, c, "the parameter list"+along, describe(params)); err != nil {
		return nil, fmt.Errorf("ddp: New: %w", err)
	}
	// WithAverage on some ranks only would silently scale some contributions.
	opt := []string{fmt.Sprintf("first bucket %d B", cfg.first), fmt.Sprintf("bucket cap %d B", cfg.cap), fmt.Sprintf("WithAverage %v", cfg.avg)}
	if err := comm.Agree(ctx, c, "the DDP options"+along, opt); err != nil {
		return nil, fmt.Errorf("ddp: New: %w", err)
	}
	d := &DDP{
		cfg: cfg, params: slices.Clone(params), names: names, c: c,
		axis: axis, dp: c.Size(), coord: coord,
		slots: make([]slot, len(params)), filled: make([]bool, len(params)), has: make([]int32, len(params)),
		out: make([]*placement.Spec, len(params)), scale: 1,
	}
	if !blocks.OnHost(dev) {
		if d.k = dev.Kernels(); d.k == nil {
			return nil, fmt.Errorf("%w: New: device %s has no kernels", ErrInvalid, dev.Name())
		}
		d.dev = dev
	}
	for bi, idx := range planBuckets(elems, dtypes, cfg.first, cfg.cap) {
		b := &bucket{params: idx, dtype: dtypes[idx[0]]}
		for _, i := range idx {
			d.slots[i] = slot{bucket: bi, off: b.elems, n: elems[i]}
			b.elems += elems[i]
		}
		switch {
		case d.dev != nil:
			var err error
			if b.dev, err = d.dev.Alloc(b.dtype, b.elems); err != nil {
				return nil, errors.Join(fmt.Errorf("ddp: New: a %d-element bucket on %s: %w", b.elems, d.dev.Name(), err), d.freeDevice())
			}
		case b.dtype == comm.Float32:
			b.f32 = make([]float32, b.elems)
		default:
			b.f64 = make([]float64, b.elems)
		}
		d.buckets = append(d.buckets, b)
	}
	if d.dev != nil {
		if err := d.allocGrads(); err != nil {
			return nil, errors.Join(fmt.Errorf("ddp: New: %w", err), d.freeDevice())
		}
	}
	for i, p := range d.params {
		if err := p.OnGradReady(func(ctx context.Context, _ *autograd.Value) error { return d.ready(ctx, i) }); err != nil {
			return nil, err
		}
	}
	return d, nil
}

// planBuckets assigns parameters (by local element count and dtype) to
// buckets: in reverse order, the first bucket limited to first bytes and
// the others to cap; a parameter that would push a non-empty bucket past
// its limit, or has another dtype, starts a new bucket; a bucket that
// reaches its limit is closed. A parameter larger than the limit thus gets
// a bucket of its own.
func planBuckets(elems []int, dtypes []comm.DType, first, cap int64) [][]int {
	var out [][]int
	var cur []int
	var size int64
	limit := func() int64 {
		if len(out) == 0 {
			return first
		}
		return cap
	}
	closeCur := func() {
		if len(cur) > 0 {
			out = append(out, cur)
			cur, size = nil, 0
		}
	}
	for i := len(elems) - 1; i >= 0; i-- {
		bytes := int64(elems[i]) * int64(dtypes[i].Size())
		if len(cur) > 0 && (size+bytes > limit() || dtypes[cur[0]] != dtypes[i]) {
			closeCur()
		}
		cur = append(cur, i)
		size += bytes
		if size >= limit() {
			closeCur()
		}
	}
	closeCur()
	return out
}

// Buckets describes the buckets, in launch order.
func (d *DDP) Buckets() []BucketInfo {
	out := make([]BucketInfo, len(d.buckets))
	for k, b := range d.buckets {
		info := BucketInfo{Params: slices.Clone(b.params), Elems: b.elems, DType: b.dtype, Bytes: int64(b.elems) * int64(b.dtype.Size())}
		for _, i := range b.params {
			info.Names = append(info.Names, d.names[i])
		}
		out[k] = info
	}
	return out
}

// Bytes returns the memory DDP holds: its buckets. With
// WithGradientAsBucketView the buckets are the gradients' memory and count as
// Grads (the leaves' gradients are views of them: do not count those
// again); otherwise they are communication buffers (Comm).
//
// On a device, the reduced-gradient blocks DDP keeps without
// WithGradientAsBucketView count as Grads too.
func (d *DDP) Bytes() memory.Use {
	var n int64
	for _, b := range d.buckets {
		n += int64(b.elems) * int64(b.dtype.Size())
	}
	if d.cfg.views {
		return memory.Use{Grads: n}
	}
	var g int64
	for _, b := range d.gbuf {
		g += int64(b.Len()) * int64(b.DType().Size())
	}
	return memory.Use{Comm: n, Grads: g}
}

// Comm returns the data-parallel communicator the buckets are reduced on.
func (d *DDP) Comm() comm.Communicator { return d.c }

// SetScale sets the factor every rank applies to its own gradient
// contribution before the sum (default 1; with WithAverage it is further
// divided by dp). Set it before the synced backward of a step: the hooks
// apply it when they copy gradients into the buckets. For example, with a
// per-rank mean loss over n of N global tokens use n/N; with a per-rank
// sum of token losses use 1/N. s must be finite (zero drops this rank's
// contribution, for a rank with no tokens); NaN or ±Inf is refused with
// ErrInvalid and the scale stays as it was.
func (d *DDP) SetScale(s float64) error {
	if err := numcheck.Finite(ErrInvalid, "DDP.SetScale", s); err != nil {
		return err // the sentinel's text already says "ddp: "
	}
	d.scale = s
	return nil
}

// NoSync runs fn (typically a micro-batch's forward and backward) with
// DDP's hooks disabled: gradients accumulate locally, Partial(sum) on dp,
// and the next backward outside NoSync reduces the accumulated sum. It
// returns fn's error.
func (d *DDP) NoSync(fn func() error) error {
	d.noSync++
	defer func() { d.noSync-- }()
	return fn()
}

// Unused returns the names of the parameters that no rank gave a gradient
// at the last Finish (in parameter order).
func (d *DDP) Unused() []string { return slices.Clone(d.unused) }

// ready is the gradient hook of parameter i. It returns only the error of
// launching an all-reduce (a broken communicator or a cancelled context,
// which every rank sees), so that Backward stops; a problem of this rank's
// gradient is kept for Finish instead, since stopping one rank's backward
// would leave its peers waiting in the collectives that follow.
func (d *DDP) ready(ctx context.Context, i int) error {
	if d.noSync > 0 {
		return nil
	}
	if d.trace != nil {
		d.trace("ready " + d.names[i])
	}
	if d.closed {
		d.fail(fmt.Errorf("%w: a gradient of %q arrived after DDP.Close", ErrInvalid, d.names[i]))
		return nil
	}
	if d.filled[i] {
		d.fail(fmt.Errorf("%w: the gradient of %q arrived twice before Finish (run the earlier micro-batches inside NoSync)", ErrInvalid, d.names[i]))
		return nil
	}
	d.fill(i, d.params[i].Grad())
	return d.launchReady(ctx)
}

// fail keeps the first error of the step; Finish returns it.
func (d *DDP) fail(err error) {
	if d.err == nil {
		d.err = err
	}
}

// fill copies parameter i's gradient g (nil: zeros), scaled, into its
// bucket and records the layout of the reduced gradient. It always fills
// the slot (with zeros on an error) so that every rank's bucket completes.
func (d *DDP) fill(i int, g *placement.DTensor) {
	s := d.slots[i]
	b := d.buckets[s.bucket]
	d.filled[i] = true
	b.ready++
	factor := d.scale
	if d.cfg.avg {
		factor /= float64(d.dp)
	}
	zero := func() {
		switch {
		case b.dev != nil:
			if err := d.k.Fill(d.slice(b, s), 0); err != nil {
				d.fail(fmt.Errorf("ddp: DDP zeroing the bucket slot of %q: %w", d.names[i], err))
			}
		case b.f32 != nil:
			clear(b.f32[s.off : s.off+s.n])
		default:
			clear(b.f64[s.off : s.off+s.n])
		}
	}
	ps := d.params[i].Spec()
	if g != nil {
		d.has[i] = 1
	}
	if g == nil {
		zero()
		gs, err := placement.GradSpec(ps)
		if err != nil {
			d.fail(err)
		}
		d.out[i] = gs
		return
	}
	gs := g.Spec()
	places := gs.Placements()
	switch pl := places[d.axis]; {
	case pl.IsPartial() && pl.Op() == comm.Sum:
	case pl.IsReplicate():
		// Every rank holds the whole gradient: as Partial(sum) it is the
		// value at coordinate 0 and zeros elsewhere.
		if d.coord != 0 {
			factor = 0
		}
	default:
		zero()
		d.out[i] = ps
		d.fail(fmt.Errorf("%w: the gradient of %q is %v on axis %q; DDP reduces Partial(sum) (or Replicate) gradients", ErrInvalid, d.names[i], pl, d.cfg.axis))
		return
	}
	places[d.axis] = placement.Replicate()
	out, err := gs.With(places, blocks.Orders(gs, -1, "")...)
	if err != nil {
		zero()
		d.out[i] = ps
		d.fail(err)
		return
	}
	d.out[i] = out
	switch src := g.LocalData().(type) {
	case device.Buffer:
		if b.dev == nil || src.Owner() != d.dev || src.DType() != b.dtype || src.Len() != s.n {
			break
		}
		if err := d.fillDevice(b, s, src, factor); err != nil {
			zero()
			d.out[i] = ps
			d.fail(fmt.Errorf("ddp: DDP gradient of %q: %w", d.names[i], err))
		}
		return
	case []float32:
		if b.f32 == nil || len(src) != s.n {
			break
		}
		dst := b.f32[s.off : s.off+s.n]
		if factor == 1 {
			if len(src) > 0 && &src[0] != &dst[0] { // a bucket view is in place already
				copy(dst, src)
			}
		} else {
			f := float32(factor)
			for k, v := range src {
				dst[k] = v * f
			}
		}
		return
	case []float64:
		if b.f64 == nil || len(src) != s.n {
			break
		}
		dst := b.f64[s.off : s.off+s.n]
		if factor == 1 {
			if len(src) > 0 && &src[0] != &dst[0] {
				copy(dst, src)
			}
		} else {
			for k, v := range src {
				dst[k] = v * factor
			}
		}
		return
	}
	zero()
	d.out[i] = ps
	d.fail(fmt.Errorf("%w: the gradient of %q has a local block of %v %v elements on %s; its bucket expects %d %v elements (the parameter's local block) on %s", ErrInvalid, d.names[i], gs.LocalShape(), gs.DType(), g.Device().Name(), s.n, d.buckets[s.bucket].dtype, d.deviceName()))
}

// launchReady launches, in bucket order, every complete bucket whose
// predecessors are launched, and returns the first launch error.
func (d *DDP) launchReady(ctx context.Context) error {
	for d.next < len(d.buckets) && d.buckets[d.next].ready == len(d.buckets[d.next].params) {
		b := d.buckets[d.next]
		d.next++
		if err := d.launch(ctx, b); err != nil {
			return err
		}
	}
	return nil
}

// launch issues a bucket's in-place all-reduce under ctx. A launch error
// is also kept for Finish (or Discard), which returns the step's first
// error.
func (d *DDP) launch(ctx context.Context, b *bucket) error {
	if d.trace != nil {
		d.trace(fmt.Sprintf("launch %d", slices.Index(d.buckets, b)))
	}
	var buf comm.Buffer
	switch {
	case b.dev != nil:
		// The hooks' copies into the bucket are queued on compute.
		if err := device.BeforeCollective(d.c, d.dev); err != nil {
			err = fmt.Errorf("ddp: DDP all-reduce of a %d-element bucket: %w", b.elems, err)
			d.fail(err)
			return err
		}
		buf = b.dev
	case b.f32 != nil:
		buf = comm.Host(b.f32)
	default:
		buf = comm.Host(b.f64)
	}
	w, err := comm.AllReduceAsync(ctx, d.c, buf, buf, comm.Sum)
	if err != nil {
		err = fmt.Errorf("ddp: DDP all-reduce of a %d-element bucket: %w", b.elems, err)
		d.fail(err)
		return err
	}
	b.work = w
	return nil
}

// Finish completes the step's gradient reduction: it launches, in order,
// every bucket not launched during backward (parameters whose hook did not
// fire contribute the gradient they hold, accumulated under NoSync, or
// zeros), waits for every all-reduce, and replaces each parameter's
// gradient by the reduced one, laid out Replicate on the dp axis (other
// axes as backward produced them; a parameter that no rank gave a gradient
// keeps none, so optimizers skip it). Every rank calls it,
// after the synced backward and before the optimizer step. It returns the
// first error of the step, after every rank's collectives have completed.
// It must not be called inside NoSync.
func (d *DDP) Finish(ctx context.Context) error {
	if d.closed {
		return fmt.Errorf("%w: DDP.Finish after Close", ErrInvalid)
	}
	if d.noSync > 0 {
		return fmt.Errorf("%w: Finish called inside NoSync", ErrInvalid)
	}
	defer d.reset()
	if err := d.complete(ctx); err != nil {
		return err
	}
	return d.install()
}

// Discard abandons the current step, after a Backward that failed: it
// issues and waits for the same collectives as Finish (so peers whose
// backward succeeded and who call Finish are not left waiting) but
// installs nothing, and resets the step. Every rank calls Finish or
// Discard once per step. Zero the gradients (ZeroGrad) before retrying.
func (d *DDP) Discard(ctx context.Context) error {
	if d.closed {
		return fmt.Errorf("%w: DDP.Discard after Close", ErrInvalid)
	}
	defer d.reset()
	return d.complete(ctx)
}

// complete launches every bucket not yet launched, in order (parameters
// whose hook did not fire contribute the gradient they hold, or zeros),
// waits for them, and all-reduces the gradient-presence flags.
func (d *DDP) complete(ctx context.Context) error {
	for ; d.next < len(d.buckets); d.next++ {
		b := d.buckets[d.next]
		for _, i := range b.params {
			if !d.filled[i] {
				d.fill(i, d.params[i].Grad())
			}
		}
		// A launch error is kept in d.err, returned below; the later
		// buckets are still issued so that every rank's sequence matches.
		_ = d.launch(ctx, b)
	}
	var errs []error
	for _, b := range d.buckets {
		if b.work == nil {
			continue
		}
		var err error
		if b.dev != nil {
			// Later compute (Finish's copies, the optimizer) waits for
			// the bucket without blocking the host where it can.
			err = device.AfterCollective(ctx, b.work, d.dev)
		} else {
			err = b.work.Wait(ctx)
		}
		if err != nil {
			errs = append(errs, err)
		}
	}
	// Which parameters had a gradient on any rank: one small all-reduce,
	// issued by every rank here in the same order. A parameter no rank
	// used keeps no gradient, so the optimizer skips it as serial training
	// would (a zero gradient would still decay it and advance its step).
	if len(errs) == 0 {
		flags := comm.Host(d.has)
		if err := comm.AllReduce(ctx, d.c, flags, flags, comm.Sum); err != nil {
			errs = append(errs, err)
		}
	}
	if d.err != nil {
		errs = append([]error{d.err}, errs...)
	}
	return errors.Join(errs...)
}

// install replaces each parameter's gradient by its reduced value.
func (d *DDP) install() error {
	var unused []int
	for i, p := range d.params {
		if d.has[i] == 0 {
			unused = append(unused, i)
			if err := p.SetGrad(nil); err != nil {
				return err
			}
			continue
		}
		s := d.slots[i]
		b := d.buckets[s.bucket]
		if b.dev != nil {
			if err := d.installDevice(p, i); err != nil {
				return err
			}
			continue
		}
		var data any
		switch {
		case b.f32 != nil && d.cfg.views:
			data = b.f32[s.off : s.off+s.n : s.off+s.n]
		case b.f32 != nil:
			data = slices.Clone(b.f32[s.off : s.off+s.n])
		case d.cfg.views:
			data = b.f64[s.off : s.off+s.n : s.off+s.n]
		default:
			data = slices.Clone(b.f64[s.off : s.off+s.n])
		}
		g, err := placement.NewLocal(d.out[i], data)
		if err != nil {
			return fmt.Errorf("ddp: DDP gradient of %q: %w", d.names[i], err)
		}
		if err := p.SetGrad(g); err != nil {
			return err
		}
	}
	slices.Sort(unused)
	d.unused = d.unused[:0]
	for _, i := range unused {
		d.unused = append(d.unused, d.names[i])
	}
	if len(d.unused) > 0 && d.cfg.report != nil {
		d.cfg.report(slices.Clone(d.unused))
	}
	return nil
}

// reset clears the per-step state.
func (d *DDP) reset() {
	clear(d.filled)
	clear(d.has)
	clear(d.out)
	for _, b := range d.buckets {
		b.ready, b.work = 0, nil
	}
	d.next = 0
	d.err = nil
}

// describe describes each parameter as the ranks of a data-parallel group
// must agree on it: "w [2 3] float64", its name, global shape and dtype,
// with its local shape appended when another mesh axis shards it.
func describe(params []*autograd.Value) []string {
	out := make([]string, len(params))
	for i, p := range params {
		s := p.Spec()
		out[i] = fmt.Sprintf("%s %v %v", p.Name(), s.Shape(), s.DType())
		if local := s.LocalShape(); !slices.Equal(local, s.Shape()) {
			out[i] += fmt.Sprintf(" local %v", local)
		}
	}
	return out
}
