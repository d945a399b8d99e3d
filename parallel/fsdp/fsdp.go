package fsdp

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/internal/numcheck"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/parallel"
	"github.com/b7ea7098/loom/parallel/internal/blocks"
	"github.com/b7ea7098/loom/parallel/internal/tree"
	"github.com/b7ea7098/loom/placement"
)

// Option configures New (and FullyShard).
type Option func(*config)

type config struct {
	axis, repAxis string
	reshard       int  // 0: keep gathered; -1: reshard fully; n > 0: to groups of n
	reshardTo     bool // reshard is WithReshardTo's n, checked as a count
	stage         int
	mp            comm.DType // 0: gather in the parameters' dtype
	avg           bool
	divide        float64
	divideSet     bool // WithGradientDivideFactor was given (divide is checked, never "none")
	prefetch      bool
	axes          []string // WithShardAxes's, in place of axis when axesSet
	axesSet       bool
}

// WithShardAxis names the mesh axis parameters are sharded on (default
// "fsdp"); of it and WithShardAxes the last given applies.
func WithShardAxis(name string) Option {
	return func(c *config) { c.axis, c.axes, c.axesSet = name, nil, false }
}

// WithReplicateAxis names a mesh axis parameters stay replicated on while the
// batch is sharded there too (HSDP): gradients are reduce-scattered on the
// shard axis, then all-reduced on this one. Default: none.
func WithReplicateAxis(name string) Option { return func(c *config) { c.repAxis = name } }

// WithReshard sets whether units free their gathered parameters after their
// forward (true, the default: ZeRO-3, gathered again in backward) or keep
// them until their backward (false: one all-gather a step, more memory).
// The root unit never reshards after forward.
func WithReshard(on bool) Option {
	return func(c *config) {
		c.reshard, c.reshardTo = 0, false
		if on {
			c.reshard = -1
		}
	}
}

// WithReshardTo makes units keep, after their forward, the 1/n of the
// gathered unit that the backward all-gather within a group of n
// consecutive shard-axis ranks rebuilds (FSDP2's reshard_after_forward=n).
// n must be at least 1 and divide the shard axis size (New fails with
// ErrInvalid otherwise); n equal to it is WithReshard(true), 1 is
// WithReshard(false) with less memory.
func WithReshardTo(n int) Option { return func(c *config) { c.reshard, c.reshardTo = n, true } }

// WithZeROStage selects the ZeRO stage, 1, 2 or 3 (default 3; New fails
// with ErrInvalid on another): 3 shards parameters,
// gradients and optimizer state (the units gather their parameters in
// forward and, when resharded, again in backward); 2 keeps every unit's
// parameters gathered from its first forward of a step to Finish (no
// backward all-gather) and reduce-scatters gradients; 1 keeps them
// gathered likewise and all-reduces gradients in full, each rank keeping
// its shard's slice. In every stage the optimizer sees only the sharded
// parameters, so its state is 1/p.
func WithZeROStage(s int) Option { return func(c *config) { c.stage = s } }

// WithMixedPrecision all-gathers parameters in dt (comm.BFloat16: half the
// bytes of float32) and casts them up to the parameters' dtype for
// compute; the sharded master weights stay float32 and gradients are
// reduced in float32. comm.Float32 (or the zero value) turns it off.
func WithMixedPrecision(dt comm.DType) Option { return func(c *config) { c.mp = dt } }

// WithAverage divides every rank's gradient contribution by the number of
// data-parallel ranks (shard × replicate axis) before the sum, for losses
// that are a per-rank mean. Without it contributions are summed (the
// convention of autograd.CrossEntropy, normalised by the global count).
func WithAverage() Option { return func(c *config) { c.avg = true } }

// WithGradientDivideFactor divides every rank's gradient contribution by f
// (FSDP2's set_gradient_divide_factor); it replaces WithAverage's factor.
// f must be positive and finite: New fails with ErrInvalid on zero, a
// negative value, NaN or ±Inf (+Inf would zero every gradient).
func WithGradientDivideFactor(f float64) Option {
	return func(c *config) { c.divide, c.divideSet = f, true }
}

// WithPrefetch turns on (default) or off the all-gather of the next unit
// while the current one computes, in forward and in backward.
func WithPrefetch(on bool) Option { return func(c *config) { c.prefetch = on } }

// UnitOption configures one Wrap.
type UnitOption func(*unitConfig)

type unitConfig struct {
	dims     map[string]int
	fwd, bwd []string
	fwdSet   bool
	bwdSet   bool
}

// WithShardDim shards the parameter named param (its Value name) on tensor
// dim dim instead of 0.
func WithShardDim(param string, dim int) UnitOption {
	return func(c *unitConfig) {
		if c.dims == nil {
			c.dims = map[string]int{}
		}
		c.dims[param] = dim
	}
}

// WithPrefetchForward replaces the default forward prefetch (the unit that
// entered next in the previous step's forward) by the units at paths
// (Wrap paths); none turns it off for this unit.
func WithPrefetchForward(paths ...string) UnitOption {
	return func(c *unitConfig) { c.fwd, c.fwdSet = slices.Clone(paths), true }
}

// WithPrefetchBackward replaces the default backward prefetch (the unit
// before this one in the forward order) by the units at paths.
func WithPrefetchBackward(paths ...string) UnitOption {
	return func(c *unitConfig) { c.bwd, c.bwdSet = slices.Clone(paths), true }
}

// UnitInfo describes one FSDP unit.
type UnitInfo struct {
	// Path is the path given to Wrap.
	Path string
	// Params names the unit's parameters, in gather order.
	Params []string
	// Elems is the unit's gathered element count on this rank (the
	// local blocks of the unsharded parameters).
	Elems int
	// Chunk is the element count of every rank's all-gather chunk: the
	// largest rank's share of Elems (shorter shares are padded to it),
	// plus 2 elements naming the unit (the tag that makes ranks gathering
	// or reducing different units at the same point an error).
	Chunk int
	// Reshard is the unit's policy after forward: 0 keeps the
	// parameters gathered, -1 frees them, n > 0 keeps 1/n.
	Reshard int
	// Root reports whether the unit is the root (never resharded).
	Root bool
	// Slot is the pooled unsharded buffer the unit uses (0 or 1), or -1
	// when it owns its buffer.
	Slot int
}

// Bytes counts the bytes FSDP holds on this rank.
type Bytes struct {
	// Sharded is the sharded parameters' local blocks (the optimizer's
	// parameters).
	Sharded int64
	// Unsharded is the memory of the gathered-parameter buffers: the two
	// pooled slots and the buffers of units that own theirs, whether or
	// not they hold valid parameters now.
	Unsharded int64
	// Gathered is the part of Unsharded that holds gathered parameters
	// now.
	Gathered int64
	// Kept is the 1/n pieces WithReshardTo units keep between forward and
	// backward.
	Kept int64
	// ShardedGrads is the reduced (sharded) gradient buffers.
	ShardedGrads int64
	// UnshardedGrads is the gradients live on the gathered parameters
	// now (between their backward and their unit's reduce-scatter, or
	// accumulated under NoSync) and the memory of reduce-scattered ones
	// kept for the units whose backward comes next (between steps: for
	// the next step's backward, at most what one backward had live).
	UnshardedGrads int64
	// Staging is the communication buffers (all-gather and
	// reduce-scatter staging).
	Staging int64
}

// Traffic counts the bytes this rank sent in FSDP's collectives since
// New, by the ring rule: k−1 chunks of an all-gather or a
// reduce-scatter of chunk c bytes over k ranks, 2(k−1)/k of an
// all-reduce's buffer.
type Traffic struct {
	AllGather, ReduceScatter, AllReduce int64
}

// FSDP shards parameters, gradients and optimizer state over a mesh axis
// (ZeRO, PyTorch's FSDP2 fully_shard), optionally replicating over
// another (HSDP). See the package documentation.
//
// A step is one or more forward and backward passes, then Finish, then
// the optimizer step. Gradients accumulate over the passes as one rank's
// would, in every configuration: each pass reduces its own (a forward
// that follows a backward launches the reductions the previous pass left)
// and adds them to the sharded gradient, as FSDP2 does; NoSync saves
// those per-pass reductions. Every data-parallel rank must enter the same
// units in the same order: at each pass's first reduction the ranks
// compare a hash of the units they entered in forward, and Finish (or
// Discard, or NoReplicaSync) returns an error matching loom.ErrMismatch
// on every rank, naming the ranks and the first unit that differs, when
// they did not.
type FSDP struct {
	cfg      config
	m        *mesh.Mesh
	axis     int // mesh index of the shard axis
	rep      int // mesh index of the replicate axis, -1 if none
	p        int // shard axis size
	rank     int // coordinate on the shard axis
	repN     int
	repC     int // coordinate on the replicate axis
	shard    comm.Communicator
	ag, rs   comm.Communicator
	group    comm.Communicator // ReshardTo's groups
	repc     comm.Communicator
	units    []*fsdpUnit
	root     int // index of the root unit, -1 if none
	ready    bool
	owned    map[*autograd.Value]int // original leaves taken by a unit
	slots    [2]*poolSlot
	stage    [2]*stageSlot // all-gather staging
	rstage   [2]*stageSlot // reduce-scatter staging
	gradPool gradPool
	flat     flatAxes

	order   []int // this pass's forward order (units by first enter)
	prevFwd []int // the last complete forward order
	entered []bool
	rsOrder []int // reduce-scatter launch order
	next    int   // next position of rsOrder to launch
	noSync  int
	noRep   int
	// The explicit controls of fsdp_control.go: no reduction at all
	// until Finish (SetRequiresGradientSync(false)), and units kept
	// gathered after their backward (SetReshardAfterBackward(false)).
	noGradSync bool
	keepAfterB bool
	err        error
	traffic    Traffic

	// backward reports that a backward reached the units in this pass:
	// the next forward starts another pass of the step.
	backward bool
	// compared reports that this pass's first reduction compared the
	// trace.
	compared bool
	trace    unitTrace         // the SPMD check (fsdp_spmd.go)
	fpc      comm.Communicator // its communicator: the data-parallel group's; nil for one rank
	fpAlong  string            // what its ranks are, for errors

	// On a device (fsdp_device.go): the parameters' device and its
	// kernels, nil on the host.
	dev        device.Device
	k          device.Kernels
	hostParams bool // a unit holds host parameters
	closed     bool
}

// New prepares FSDP on mesh m; Wrap then shards modules, bottom-up,
// root last. It checks the options, before any communication, and creates
// the communicators (a collective over m): the shard-axis communicator is
// split twice, one duplicate for all-gathers and one for reduce-scatters,
// so that their relative order cannot differ across ranks, and the
// data-parallel group's (shard and replicate axes) once for the SPMD
// check (see FSDP). Errors wrap ErrInvalid: a missing axis, WithZeROStage
// other than 1, 2 or 3, WithReshardTo(n) with n < 1 or not dividing the shard
// axis, WithGradientDivideFactor not positive and finite, WithMixedPrecision in
// another dtype than bfloat16 or float32; ranks whose options differ get
// a *comm.DisagreementError.
func New(ctx context.Context, m *mesh.Mesh, opts ...Option) (*FSDP, error) {
	cfg := config{axis: "fsdp", reshard: -1, stage: 3, prefetch: true}
	for _, o := range opts {
		o(&cfg)
	}
	if m == nil {
		return nil, fmt.Errorf("%w: New: nil mesh", ErrInvalid)
	}
	names := m.Names()
	f := &FSDP{cfg: cfg, m: m, rep: -1, root: -1, owned: map[*autograd.Value]int{}, gradPool: gradPool{}}
	if err := f.initShard(m); err != nil {
		return nil, err
	}
	if cfg.repAxis != "" {
		if f.rep = slices.Index(names, cfg.repAxis); f.rep < 0 || f.isShardAxis(f.rep) {
			return nil, fmt.Errorf("%w: New: mesh %v has no replicate axis %q distinct from the shard axes", ErrInvalid, m, cfg.repAxis)
		}
	}
	if cfg.stage < 1 || cfg.stage > 3 {
		return nil, fmt.Errorf("%w: New: WithZeROStage(%d): want 1, 2 or 3", ErrInvalid, cfg.stage)
	}
	if cfg.reshardTo {
		if err := numcheck.Count(ErrInvalid, "New: WithReshardTo", cfg.reshard); err != nil {
			return nil, err
		}
		if f.p%cfg.reshard != 0 {
			return nil, fmt.Errorf("%w: New: WithReshardTo(%d) does not divide the shard axis %q of size %d", ErrInvalid, cfg.reshard, f.shardLabel(), f.p)
		}
		if cfg.reshard == f.p {
			f.cfg.reshard = -1
		}
	}
	if cfg.divideSet {
		if err := numcheck.Positive(ErrInvalid, "New: WithGradientDivideFactor", cfg.divide); err != nil {
			return nil, err
		}
	}
	if cfg.mp == comm.Float32 {
		f.cfg.mp = 0
	} else if cfg.mp != 0 && cfg.mp != comm.BFloat16 {
		return nil, fmt.Errorf("%w: New: WithMixedPrecision(%v); want bfloat16 or float32", ErrInvalid, cfg.mp)
	}
	var err error
	if f.shard, err = f.shardComm(ctx, m); err != nil {
		return nil, err
	}
	if f.ag, err = f.shard.Split(ctx, 0, f.rank); err != nil {
		return nil, fmt.Errorf("fsdp: New: all-gather communicator: %w", err)
	}
	if f.rs, err = f.shard.Split(ctx, 0, f.rank); err != nil {
		return nil, fmt.Errorf("fsdp: New: reduce-scatter communicator: %w", err)
	}
	if n := f.cfg.reshard; n > 0 {
		if f.group, err = f.shard.Split(ctx, f.rank/n, f.rank); err != nil {
			return nil, fmt.Errorf("fsdp: New: WithReshardTo group communicator: %w", err)
		}
	}
	f.repN = 1
	if f.rep >= 0 {
		f.repN = m.Shape()[f.rep]
		if f.repC, err = m.Local(cfg.repAxis); err != nil {
			return nil, err
		}
		if f.repc, err = m.Comm(ctx, cfg.repAxis); err != nil {
			return nil, err
		}
	}
	if err := f.traceComm(ctx); err != nil {
		return nil, fmt.Errorf("fsdp: New: SPMD check communicator: %w", err)
	}
	desc := []string{fmt.Sprintf("axis %s rep %s reshard %d stage %d mp %v avg %v divide %v %v prefetch %v", f.shardLabel(), cfg.repAxis, f.cfg.reshard, cfg.stage, f.cfg.mp, cfg.avg, cfg.divideSet, cfg.divide, cfg.prefetch)}
	if err := f.agree(ctx, "the FSDP options", desc); err != nil {
		return nil, fmt.Errorf("fsdp: New: %w", err)
	}
	return f, nil
}

// traceComm creates the communicator of the SPMD check: a duplicate of
// the data-parallel group's (the shard axis, and the replicate axis for
// HSDP, in mesh order), so that its ranks are the mesh's when those are
// its only axes.
func (f *FSDP) traceComm(ctx context.Context) error {
	f.trace.reset()
	names := slices.Clone(f.flat.names)
	g := f.shard
	if f.rep >= 0 {
		names = append(names, f.cfg.repAxis)
	}
	if len(names) > 1 {
		mn := f.m.Names()
		slices.SortFunc(names, func(a, b string) int { return slices.Index(mn, a) - slices.Index(mn, b) })
		var err error
		if g, err = f.m.Group(ctx, names...); err != nil {
			return err
		}
	}
	if g.Size() == 1 {
		return nil
	}
	if f.m.NDim() > len(names) {
		f.fpAlong = fmt.Sprintf(" (ranks along axis %q)", names[0])
		if len(names) == 2 {
			f.fpAlong = fmt.Sprintf(" (ranks over axes %q, %q)", names[0], names[1])
		} else if len(names) > 2 {
			f.fpAlong = fmt.Sprintf(" (ranks over axes %q)", names)
		}
	}
	var err error
	f.fpc, err = g.Split(ctx, 0, g.Rank())
	return err
}

// agree checks that the ranks of the shard and replicate groups pass the
// same items.
func (f *FSDP) agree(ctx context.Context, what string, items []string) error {
	if err := comm.Agree(ctx, f.shard, what+fmt.Sprintf(" (ranks along axis %q)", f.shardLabel()), items); err != nil {
		return err
	}
	if f.repc != nil {
		return comm.Agree(ctx, f.repc, what+fmt.Sprintf(" (ranks along axis %q)", f.cfg.repAxis), items)
	}
	return nil
}

// fsdpParam is one parameter of a unit.
type fsdpParam struct {
	name      string
	holder    int // index into the unit's holders
	pos       int // position in the holder's OwnParams
	orig      *autograd.Value
	sharded   *autograd.Value
	unsharded *autograd.Value
	spec0     *placement.Spec // the unsharded layout (pre-FSDP)
	dim       int
	local     []int // the unsharded local block's shape
	outer     int   // elements before dim: product of local[:dim]
	inner     int   // product of local[dim+1:]
	rows      []int // rows of dim held by each shard-axis coordinate
	rowOff    []int
	chunkOff  []int // offset of this parameter in each rank's chunk
	off       int   // offset in the unit's unsharded buffer
	n         int   // elements of the unsharded local block
	fired     bool
	has       int32
	gradSpec  *placement.Spec // layout of the reduced gradient
}

// fsdpUnit is one wrapped module.
type fsdpUnit struct {
	index   int
	path    string
	module  parallel.Module
	cfg     unitConfig
	holders []parallel.ParamSetter
	params  []*fsdpParam
	dtype   comm.DType // the parameters' dtype
	elems   int
	chunk   []int // each rank's chunk elements (without padding)
	L       int   // max chunk
	reshard int
	slot    int
	buf     any // the unsharded buffer: []float32 or []float64
	// per-step state
	gathered bool
	agWork   comm.Work
	agGroup  bool
	stageAt  int // staging slot of the in-flight all-gather
	kept     *comm.HostBuffer
	dkept    device.Buffer // kept, on a device
	keptOK   bool
	swapped  bool
	fired    int
	rsReady  bool
	rsWork   comm.Work
	rsAt     int
	arWork   comm.Work
	arAdd    bool // arWork reduces pend, to be added into acc
	acc      any  // the sharded gradient: []float32 or []float64, chunk[rank] elements
	accum    bool
	// HSDP, once a pass's replicate all-reduce has summed acc over the
	// replicas: the later passes' shard-axis sum, reduced over the
	// replicas on its own and then added to acc.
	repDone   bool
	pend      any
	pendAccum bool
	fwdNext   []int
	bwdNext   []int
}

// poolSlot is an unsharded buffer shared by units resharded after forward.
type poolSlot struct {
	buf   any
	owner *fsdpUnit
}

// stageSlot is a communication staging buffer and the unit using it.
type stageSlot struct {
	buf   *comm.HostBuffer
	dbuf  device.Buffer // on a device, instead of buf
	owner *fsdpUnit
}

// Wrap makes module m (at path, for errors and prefetch lists) an FSDP
// unit: its parameters, except those of units wrapped before it, are
// laid out anew, in place, sharded on the shard axis (Shard(0), or the dim
// WithShardDim gives; a dim that another axis already shards keeps that axis
// outer: placement.WithOrder(dim, tp, fsdp)). Wrap modules bottom-up and the root
// last; a unit wrapped after units it contains is the root when it
// contains all of them. Every parallel.ParamHolder in the unit must
// implement parallel.ParamSetter. Wrap is collective over the shard and replicate groups
// (comm.Agree on the unit's description); it must precede the first
// forward.
//
// Parameters may live on a device (every unit's on one): FSDP's buffers
// are then on it too (see the package documentation), and Wrap frees the
// whole block each shard replaces.
//
// Errors wrap ErrInvalid: a module wrapped twice or inside a unit already
// wrapped, a path another unit has (the controls name units by path), a shard dim out of range, a parameter that is not a fresh leaf
// (a gradient already), not Replicate on the shard and replicate axes,
// of a dtype other than float32 or float64 (float32 with WithMixedPrecision),
// held by another unit, or on another device than the others' (matching
// device.ErrMixed); *comm.DisagreementError when ranks disagree.
func (f *FSDP) Wrap(ctx context.Context, path string, m parallel.Module, opts ...UnitOption) error {
	var cfg unitConfig
	for _, o := range opts {
		o(&cfg)
	}
	fail := func(format string, args ...any) error {
		return fmt.Errorf("%w: FSDP.Wrap %q: %s", ErrInvalid, path, fmt.Sprintf(format, args...))
	}
	if f.ready {
		return fail("the first forward has run; wrap every unit before it")
	}
	if tree.IsNil(m) || !tree.Comparable(m) {
		return fail("nil or non-pointer module")
	}
	for _, u := range f.units {
		if u.module == m {
			return fail("module already wrapped as %q", u.path)
		}
		if u.path == path {
			return fail("the path names unit %d already", u.index)
		}
		if err := parallel.Walk(u.module, func(_ string, sub parallel.Module) error {
			if tree.Comparable(sub) && sub == m {
				return fail("module is inside unit %q, wrapped before it (wrap bottom-up, the root last)", u.path)
			}
			return nil
		}); err != nil {
			return err
		}
	}
	inner := map[parallel.Module]bool{} // modules of units wrapped before, which m may contain
	for _, u := range f.units {
		inner[u.module] = true
	}
	u := &fsdpUnit{index: len(f.units), path: path, module: m, cfg: cfg, slot: -1}
	contained := map[parallel.Module]bool{} // units inside m, wrapped before it
	seen := map[*autograd.Value]bool{}
	var visit func(p string, mod parallel.Module) error
	visit = func(p string, mod parallel.Module) error {
		if tree.Comparable(mod) && inner[mod] && mod != m {
			// An inner unit and, through it, the units inside it.
			return parallel.Walk(mod, func(_ string, sub parallel.Module) error {
				if tree.Comparable(sub) && inner[sub] {
					contained[sub] = true
				}
				return nil
			})
		}
		if h, ok := mod.(parallel.ParamHolder); ok {
			ps := h.OwnParams()
			if slices.ContainsFunc(ps, func(v *autograd.Value) bool { return v != nil }) {
				setter, ok := mod.(parallel.ParamSetter)
				if !ok {
					return fail("module %q (%T) holds parameters but does not implement ParamSetter, so FSDP cannot swap them", p, mod)
				}
				hi := len(u.holders)
				u.holders = append(u.holders, setter)
				for pos, v := range ps {
					if v == nil {
						continue
					}
					if owner, ok := f.owned[v]; ok {
						return fail("parameter %q is already in unit %q", v.Name(), f.units[owner].path)
					}
					if seen[v] {
						return fail("parameter %q is held twice in the unit (tied parameters are not supported across holders)", v.Name())
					}
					seen[v] = true
					u.params = append(u.params, &fsdpParam{name: v.Name(), holder: hi, pos: pos, orig: v})
				}
			}
		}
		for _, c := range mod.Children() {
			if tree.IsNil(c.Module) {
				return fail("module %q has a nil child %q", p, c.Name)
			}
			if err := visit(p+"."+c.Name, c.Module); err != nil {
				return err
			}
		}
		return nil
	}
	if err := visit(path, m); err != nil {
		return err
	}
	if len(u.params) == 0 {
		return fail("the module has no parameters of its own")
	}
	for name := range cfg.dims {
		if !slices.ContainsFunc(u.params, func(p *fsdpParam) bool { return p.name == name }) {
			return fail("WithShardDim names %q, which is not a parameter of the unit", name)
		}
	}
	if err := f.plan(u, fail); err != nil {
		return err
	}
	if err := f.agree(ctx, "the FSDP unit "+path, u.describe()); err != nil {
		return fmt.Errorf("fsdp: FSDP.Wrap %q: %w", path, err)
	}
	if err := f.shardParams(u); err != nil {
		return fmt.Errorf("fsdp: FSDP.Wrap %q: %w", path, err)
	}
	for _, p := range u.params {
		f.owned[p.orig] = u.index
	}
	f.units = append(f.units, u)
	b := m.Boundary()
	b.OnEnter(func(ctx context.Context) error { return f.enter(ctx, u) })
	b.OnOutput(func(ctx context.Context, v *autograd.Value) (*autograd.Value, error) { return f.output(ctx, u, v) })
	// The unit is the root when every unit wrapped before is inside it.
	f.root = -1
	if len(contained) == len(f.units)-1 {
		f.root = u.index
	}
	return nil
}

// plan checks a unit's parameters and lays out its chunks.
func (f *FSDP) plan(u *fsdpUnit, fail func(string, ...any) error) error {
	m := f.m
	for i, p := range u.params {
		v := p.orig
		if !v.IsLeaf() || !v.RequiresGrad() || v.Grad() != nil {
			return fail("%q is not a fresh parameter leaf (a leaf that requires grad and has no gradient)", p.name)
		}
		if err := f.takeDevice(u.path, p.name, v.Data().Device()); err != nil {
			return err
		}
		s := v.Spec()
		if !slices.Equal(s.Mesh().Names(), m.Names()) || !slices.Equal(s.Mesh().Shape(), m.Shape()) {
			return fail("parameter %q is on mesh %v, not %v", p.name, s.Mesh(), m)
		}
		places := s.Placements()
		for _, a := range f.flat.axes {
			if !places[a].IsReplicate() {
				return fail("parameter %q is %v on the shard axis %q; want Replicate", p.name, places[a], m.Names()[a])
			}
		}
		if f.rep >= 0 && !places[f.rep].IsReplicate() {
			return fail("parameter %q is %v on the replicate axis %q; want Replicate", p.name, places[f.rep], f.cfg.repAxis)
		}
		dt := s.DType()
		if dt != comm.Float32 && dt != comm.Float64 {
			return fail("parameter %q has dtype %v; want float32 or float64", p.name, dt)
		}
		if f.cfg.mp != 0 && dt != comm.Float32 {
			return fail("parameter %q has dtype %v; WithMixedPrecision needs float32 master weights", p.name, dt)
		}
		if i == 0 {
			u.dtype = dt
		} else if dt != u.dtype {
			return fail("parameter %q has dtype %v, another %v; a unit's parameters share one dtype", p.name, dt, u.dtype)
		}
		p.spec0 = s
		p.local = s.LocalShape()
		if len(p.local) == 0 {
			return fail("parameter %q is a scalar; FSDP shards a tensor dim", p.name)
		}
		if d, ok := u.cfg.dims[p.name]; ok {
			p.dim = d
		}
		if p.dim < 0 || p.dim >= len(p.local) {
			return fail("WithShardDim(%q, %d) is out of range for shape %v", p.name, p.dim, s.Shape())
		}
		p.outer, p.inner = blocks.Prod(p.local[:p.dim]), blocks.Prod(p.local[p.dim+1:])
		p.n = blocks.Prod(p.local)
		p.off = u.elems
		u.elems += p.n
		p.rows, p.rowOff = make([]int, f.p), make([]int, f.p)
		for r := range f.p {
			p.rowOff[r], p.rows[r] = f.chunkOf(p.local[p.dim], r)
		}
	}
	u.chunk = make([]int, f.p)
	for _, p := range u.params {
		p.chunkOff = make([]int, f.p)
		for r := range f.p {
			p.chunkOff[r] = u.chunk[r]
			u.chunk[r] += p.outer * p.rows[r] * p.inner
		}
	}
	u.L = slices.Max(u.chunk)
	return nil
}

// chunkOf is torch.chunk's rule (placement's): piece c of n over k is
// ceil(n/k) long, trailing pieces short or empty.
func chunkOf(n, k, c int) (off, size int) {
	ch := (n + k - 1) / k
	off = min(c*ch, n)
	return off, min(ch, n-off)
}

// describe is what the ranks must agree on about a unit.
func (u *fsdpUnit) describe() []string {
	out := []string{fmt.Sprintf("unit %d %q", u.index, u.path)}
	for _, p := range u.params {
		out = append(out, fmt.Sprintf("%s %v %v dim %d local %v", p.name, p.spec0.Shape(), p.spec0.DType(), p.dim, p.local))
	}
	return out
}

// shardParams lays every parameter of the unit out as this rank's shard,
// in place (autograd's Relayout), so that the leaf the model and the
// user's parameter lists hold is the sharded leaf the optimizer updates.
// Every shard is made before any parameter changes.
func (f *FSDP) shardParams(u *fsdpUnit) error {
	shards := make([]*placement.DTensor, len(u.params))
	for i, p := range u.params {
		s1, err := f.shardedSpec(p.spec0, p.spec0.Placements(), p.dim)
		if err != nil {
			return fmt.Errorf("laying out %q: %w", p.name, err)
		}
		want := slices.Clone(p.local)
		want[p.dim] = p.rows[f.rank]
		if got := s1.LocalShape(); !slices.Equal(got, want) {
			return fmt.Errorf("%w: sharded %q has local shape %v, want %v", ErrInvalid, p.name, got, want)
		}
		n := p.outer * p.rows[f.rank] * p.inner
		var data any
		switch src := p.orig.Data().LocalData().(type) {
		case device.Buffer:
			if shards[i], err = f.shardDevice(p, s1, src, n); err != nil {
				return errors.Join(fmt.Errorf("sharding %q: %w", p.name, err), freeAll(shards[:i]))
			}
			continue
		case []float32:
			d := make([]float32, n)
			p.extract(d, src, f.rank)
			data = d
		case []float64:
			d := make([]float64, n)
			p.extract(d, src, f.rank)
			data = d
		}
		if shards[i], err = placement.NewLocal(s1, data); err != nil {
			return fmt.Errorf("sharding %q: %w", p.name, err)
		}
	}
	for i, p := range u.params {
		old := p.orig.Data()
		if err := p.orig.Relayout(shards[i]); err != nil {
			return errors.Join(fmt.Errorf("sharding %q: %w", p.name, err), freeAll(shards[i:]))
		}
		p.sharded = p.orig
		// On a device nothing else frees the whole block the shard
		// replaces.
		if err := blocks.FreeLocal(old); err != nil {
			return fmt.Errorf("sharding %q: freeing the unsharded block: %w", p.name, err)
		}
	}
	return nil
}

// extract copies rank r's rows of the unsharded block src into dst.
func extract[T float32 | float64](p *fsdpParam, dst, src []T, r int) {
	seg := p.rows[r] * p.inner
	for o := range p.outer {
		copy(dst[o*seg:(o+1)*seg], src[(o*p.local[p.dim]+p.rowOff[r])*p.inner:][:seg])
	}
}

func (p *fsdpParam) extract(dst, src any, r int) {
	switch d := dst.(type) {
	case []float32:
		extract(p, d, src.([]float32), r)
	case []float64:
		extract(p, d, src.([]float64), r)
	}
}

// FullyShard wraps every module of root whose path matches one of
// patterns (path patterns such as "h.*", as in tp.Plan), deepest first and
// in parallel.Walk order among equals, then root itself (unless the
// matches hold every parameter), on a new FSDP over the mesh of root's
// parameters. A pattern that matches no module is an error wrapping
// ErrInvalid, as in tp.Parallelize.
func FullyShard(ctx context.Context, root parallel.Module, patterns []string, opts ...Option) (*FSDP, error) {
	params, err := parallel.Params(root)
	if err != nil {
		return nil, err
	}
	if len(params) == 0 {
		return nil, fmt.Errorf("%w: FullyShard: the model has no parameters", ErrInvalid)
	}
	type match struct {
		path  string
		m     parallel.Module
		depth int
	}
	var ms []match
	if err := parallel.Walk(root, func(path string, m parallel.Module) error {
		if path == "" {
			return nil
		}
		for _, pat := range patterns {
			if tree.MatchPath(strings.Split(pat, "."), path) {
				ms = append(ms, match{path, m, strings.Count(path, ".")})
				break
			}
		}
		return nil
	}); err != nil {
		return nil, err
	}
	// A pattern that matches nothing is a typo, as in tp.Parallelize and
	// Checkpoint: silently sharding only the root would hide it.
	for _, pat := range patterns {
		if !slices.ContainsFunc(ms, func(mm match) bool { return tree.MatchPath(strings.Split(pat, "."), mm.path) }) {
			return nil, fmt.Errorf("%w: FullyShard: pattern %q matches no module", ErrInvalid, pat)
		}
	}
	slices.SortStableFunc(ms, func(a, b match) int { return b.depth - a.depth })
	f, err := New(ctx, params[0].Spec().Mesh(), opts...)
	if err != nil {
		return nil, err
	}
	for _, mm := range ms {
		if err := f.Wrap(ctx, mm.path, mm.m); err != nil {
			return nil, err
		}
	}
	// The root takes the parameters no match holds; it is not wrapped
	// when there are none.
	if slices.ContainsFunc(params, func(v *autograd.Value) bool { _, ok := f.owned[v]; return !ok }) {
		if err := f.Wrap(ctx, "", root); err != nil {
			return nil, err
		}
	}
	return f, nil
}

// Params returns the sharded parameter leaves of every unit, in wrap and
// parameter order: the list to give the optimizer.
func (f *FSDP) Params() []*autograd.Value {
	var out []*autograd.Value
	for _, u := range f.units {
		for _, p := range u.params {
			out = append(out, p.sharded)
		}
	}
	return out
}

// Units describes the units, in wrap order.
func (f *FSDP) Units() []UnitInfo {
	out := make([]UnitInfo, len(f.units))
	for i, u := range f.units {
		info := UnitInfo{Path: u.path, Elems: u.elems, Chunk: u.L + tagElems, Reshard: f.policy(u), Root: i == f.root, Slot: f.slotOf(u)}
		for _, p := range u.params {
			info.Params = append(info.Params, p.name)
		}
		out[i] = info
	}
	return out
}

// Traffic returns the bytes this rank sent in FSDP's collectives so far.
func (f *FSDP) Traffic() Traffic { return f.traffic }

// Bytes counts the memory FSDP holds on this rank now.
func (f *FSDP) Bytes() Bytes {
	var b Bytes
	size := func(x any) int64 {
		switch s := x.(type) {
		case []float32:
			return 4 * int64(len(s))
		case []float64:
			return 8 * int64(len(s))
		case device.Buffer:
			return int64(s.Len()) * int64(s.DType().Size())
		}
		return 0
	}
	for _, s := range f.slots {
		if s != nil {
			b.Unsharded += size(s.buf)
		}
	}
	for _, ss := range [][2]*stageSlot{f.stage, f.rstage} {
		for _, s := range ss {
			switch {
			case s != nil && s.dbuf != nil:
				b.Staging += int64(s.dbuf.Len()) * int64(s.dbuf.DType().Size())
			case s != nil:
				b.Staging += int64(len(s.buf.Bytes()))
			}
		}
	}
	b.UnshardedGrads += f.gradPool.bytes()
	for _, u := range f.units {
		es := int64(u.dtype.Size())
		for _, p := range u.params {
			b.Sharded += size(p.sharded.Data().LocalData())
			b.UnshardedGrads += p.unsharded.GradBytes() // 0 for a nil leaf
		}
		if u.slot < 0 {
			b.Unsharded += size(u.buf)
		}
		if u.gathered {
			b.Gathered += int64(u.elems) * es
		}
		if u.kept != nil {
			b.Kept += int64(len(u.kept.Bytes()))
		}
		b.Kept += size(u.dkept)
		b.ShardedGrads += size(u.acc) + size(u.pend)
	}
	return b
}
