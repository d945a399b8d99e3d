package parallel_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"testing"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/device/emu"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/optim"
	"github.com/b7ea7098/loom/parallel"
	"github.com/b7ea7098/loom/parallel/ddp"
	"github.com/b7ea7098/loom/parallel/fsdp"
	"github.com/b7ea7098/loom/parallel/internal/blocks"
	"github.com/b7ea7098/loom/parallel/internal/ptest"
	"github.com/b7ea7098/loom/parallel/tp"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// devRun is one configuration of the device parity tests: a float32
// transformer block made by the constructors on a tape of the rank's
// device, trained for a few SGD steps on a dp × tp mesh.
type devRun struct {
	dp, tp  int
	sp      bool // sequence parallelism (tp > 1)
	views   bool // ddp.WithGradientAsBucketView
	recycle bool // a tape made WithRecycling
	ckpt    bool // activation checkpointing of attn and mlp
	head    bool // a colwise lm head and VocabParallelCrossEntropy (tp > 1)
	accum   bool // each step a micro-batch under NoSync, then a synced one
	scale   bool // DDP's WithAverage and SetScale(0.5): gradients scaled into the buckets
	vocab   int  // the head's outputs (0: headVocab)
	steps   int
}

func (c devRun) String() string {
	return fmt.Sprintf("dp=%d,tp=%d,sp=%v,views=%v,recycle=%v,ckpt=%v,head=%v,accum=%v,scale=%v", c.dp, c.tp, c.sp, c.views, c.recycle, c.ckpt, c.head, c.accum, c.scale)
}

// devTrace is what one rank saw: per step the loss and every parameter's
// local block after the optimizer step, and the device allocator's driver
// allocations after each step (none on the host).
type devTrace struct {
	values [][]float32
	allocs []int64
	held   []int64 // the device's allocated bytes after each step
	final  int64   // and once everything is freed
}

// newConstructedBlock builds ptest.Block with the
// constructors, in float32, on tape (so on the tape's device).
func newConstructedBlock(tape *autograd.Tape, m *mesh.Mesh) (*ptest.Block, error) {
	ln1, err := parallel.NewLayerNorm(tape, m, ptest.BlkD, parallel.WithName("ln1"))
	if err != nil {
		return nil, err
	}
	attn, err := parallel.NewAttention(tape, m, ptest.BlkD, ptest.BlkH, parallel.WithName("attn"), parallel.WithBiasInit(parallel.Normal(0.1, 5)))
	if err != nil {
		return nil, err
	}
	ln2, err := parallel.NewLayerNorm(tape, m, ptest.BlkD, parallel.WithName("ln2"), parallel.WithBiasInit(parallel.Normal(0.1, 6)))
	if err != nil {
		return nil, err
	}
	mlp, err := parallel.NewMLP(tape, m, ptest.BlkD, ptest.BlkF, parallel.WithName("mlp"), parallel.WithInit(parallel.Normal(0.3, 7)))
	if err != nil {
		return nil, err
	}
	return &ptest.Block{LN1: ln1, Attn: attn, LN2: ln2, MLP: mlp}, nil
}

// headed is the block under "blk" with an lm head "head" of vocab
// outputs (by default headVocab, uneven over 2 and 3 ranks).
type headed struct {
	parallel.Hooks
	blk   *ptest.Block
	head  *parallel.Linear
	vocab int
}

const headVocab = 7

func (h *headed) Children() []parallel.Child {
	return []parallel.Child{{Name: "blk", Module: h.blk}, {Name: "head", Module: h.head}}
}

// headLoss is VocabParallelCrossEntropy of the head's logits of the
// block's output y, against fixed targets, rows sharded on dp.
func (h *headed) headLoss(ctx context.Context, m *mesh.Mesh, y *autograd.Value) (*autograd.Value, error) {
	logits, err := h.head.Forward(ctx, y)
	if err != nil {
		return nil, err
	}
	if logits, err = autograd.Reshape(logits, ptest.BlkB*ptest.BlkT, h.vocab); err != nil {
		return nil, err
	}
	full := make([]int64, ptest.BlkB*ptest.BlkT)
	for i := range full {
		full[i] = int64((i * 5) % h.vocab)
	}
	tg, err := autograd.IndicesFromFull(m, []int{ptest.BlkB * ptest.BlkT}, ptest.BatchPlaces(m), full)
	if err != nil {
		return nil, err
	}
	return tp.VocabParallelCrossEntropy(ctx, logits, tg, "tp")
}

// devLoss is ptest.Block.Loss in float32 (a mean), its input x on the tape's
// device; the caller frees x after the backward pass.
func devLoss(ctx context.Context, b *ptest.Block, tape *autograd.Tape, m *mesh.Mesh, sp bool, step int, hd *headed) (*autograd.Value, *placement.DTensor, error) {
	places := ptest.BatchPlaces(m)
	if sp {
		places[1] = placement.Shard(1)
	}
	spec, err := placement.NewSpec(m, []int{ptest.BlkB, ptest.BlkT, ptest.BlkD}, comm.Float32, places)
	if err != nil {
		return nil, nil, err
	}
	xd, err := placement.FromFull(spec, placementtest.Random([]int{ptest.BlkB, ptest.BlkT, ptest.BlkD}, comm.Float32, uint64(99+step)))
	if err != nil {
		return nil, nil, err
	}
	if xd, err = xd.To(tape.Device()); err != nil {
		return nil, nil, err
	}
	x, err := tape.Constant(xd)
	if err != nil {
		return nil, nil, err
	}
	a, err := b.LN1.Forward(ctx, x)
	if err != nil {
		return nil, nil, err
	}
	if a, err = b.Attn.Forward(ctx, a); err != nil {
		return nil, nil, err
	}
	h, err := autograd.Add(x, a)
	if err != nil {
		return nil, nil, err
	}
	u, err := b.LN2.Forward(ctx, h)
	if err != nil {
		return nil, nil, err
	}
	if u, err = b.MLP.Forward(ctx, u); err != nil {
		return nil, nil, err
	}
	y, err := autograd.Add(h, u)
	if err != nil {
		return nil, nil, err
	}
	if hd != nil {
		l, err := hd.headLoss(ctx, m, y)
		return l, xd, err
	}
	sq, err := autograd.Mul(y, y)
	if err != nil {
		return nil, nil, err
	}
	l, err := autograd.Mean(sq)
	return l, xd, err
}

// hostF32 returns dt's local block as float32s on the host.
func hostF32(dt *placement.DTensor) ([]float32, error) {
	h, err := dt.To(device.Host())
	if err != nil {
		return nil, err
	}
	v, ok := h.LocalData().([]float32)
	if !ok {
		return nil, fmt.Errorf("local block %T, want []float32", h.LocalData())
	}
	return slices.Clone(v), nil
}

// train runs c on one rank with its parameters on d.
func (c devRun) train(ctx context.Context, m *mesh.Mesh, d device.Device) (devTrace, error) {
	var tr devTrace
	opts := []autograd.Option{autograd.WithDevice(d)}
	if c.recycle {
		opts = append(opts, autograd.WithRecycling())
	}
	tape := autograd.NewTape(opts...)
	b, err := newConstructedBlock(tape, m)
	if err != nil {
		return tr, err
	}
	var root parallel.Module = b
	var hd *headed
	if c.head {
		v := c.vocab
		if v == 0 {
			v = headVocab
		}
		lin, err := parallel.NewLinear(tape, m, ptest.BlkD, v, parallel.WithName("head"), parallel.WithBias(false))
		if err != nil {
			return tr, err
		}
		hd = &headed{blk: b, head: lin, vocab: v}
		root = hd
	}
	if c.tp > 1 {
		plan := ptest.BlockPlan(c.sp)
		if c.head {
			for i := range plan {
				plan[i].Pattern = "blk." + plan[i].Pattern
			}
			plan = append(plan, tp.Rule{Pattern: "head", Style: tp.ColwiseParallel{}})
		}
		if err := tp.Parallelize(ctx, root, "tp", plan); err != nil {
			return tr, err
		}
	}
	if c.ckpt {
		if err := parallel.Checkpoint(b, []string{"attn", "mlp"}); err != nil { // b, not root: the paths are the block's
			return tr, err
		}
	}
	params, err := parallel.Params(root)
	if err != nil {
		return tr, err
	}
	dopts := []ddp.Option{ddp.WithFirstBucket(4 * ptest.BlkD), ddp.WithBucketCap(4 * ptest.BlkD * ptest.BlkF)}
	if c.views {
		dopts = append(dopts, ddp.WithGradientAsBucketView())
	}
	if c.scale {
		dopts = append(dopts, ddp.WithAverage())
	}
	dd, err := ddp.New(ctx, params, dopts...)
	if err != nil {
		return tr, err
	}
	defer dd.Close()
	if c.scale {
		if err := dd.SetScale(0.5); err != nil {
			return tr, err
		}
	}
	opt, err := optim.NewSGD(params, 0.05, optim.WithMomentum(0.9))
	if err != nil {
		return tr, err
	}
	defer opt.Close()
	for step := range c.steps {
		if c.recycle {
			tape.Recycle()
		}
		if c.accum {
			// A first micro-batch (another input) whose gradients
			// accumulate locally, then the synced one below.
			err := dd.NoSync(func() error {
				l, x, err := devLoss(ctx, b, tape, m, c.sp, step+10, hd)
				if err != nil {
					return err
				}
				return errors.Join(tape.Backward(ctx, l), blocks.FreeLocal(x))
			})
			if err != nil {
				return tr, fmt.Errorf("step %d: NoSync: %w", step, err)
			}
		}
		l, x, err := devLoss(ctx, b, tape, m, c.sp, step, hd)
		if err != nil {
			return tr, fmt.Errorf("step %d: %w", step, err)
		}
		if l.Data().Device() != d {
			return tr, fmt.Errorf("step %d: the loss is on %s, want %s", step, l.Data().Device().Name(), d.Name())
		}
		loss, err := hostF32(l.Data())
		if err != nil {
			return tr, err
		}
		if err := tape.Backward(ctx, l); err != nil {
			return tr, fmt.Errorf("step %d: %w", step, err)
		}
		if err := blocks.FreeLocal(x); err != nil {
			return tr, err
		}
		if err := dd.Finish(ctx); err != nil {
			return tr, fmt.Errorf("step %d: %w", step, err)
		}
		if err := tp.ReduceGrads(ctx, params); err != nil {
			return tr, fmt.Errorf("step %d: %w", step, err)
		}
		if err := opt.Step(); err != nil {
			return tr, fmt.Errorf("step %d: %w", step, err)
		}
		tr.values = append(tr.values, loss)
		for _, p := range params {
			if p.Data().Device() != d {
				return tr, fmt.Errorf("step %d: %s is on %s, want %s", step, p.Name(), p.Data().Device().Name(), d.Name())
			}
			g := p.Grad()
			if g == nil || g.Device() != d {
				return tr, fmt.Errorf("step %d: the gradient of %s is not on %s", step, p.Name(), d.Name())
			}
			v, err := hostF32(p.Data())
			if err != nil {
				return tr, err
			}
			tr.values = append(tr.values, v)
			p.ZeroGrad()
		}
		if mem := d.Memory(); mem != nil {
			if err := d.Synchronize(); err != nil {
				return tr, err
			}
			tr.allocs = append(tr.allocs, mem.Stats().DriverAllocs)
			tr.held = append(tr.held, mem.Stats().Allocated)
		}
	}
	// Everything allocated for the run comes back: DDP's buckets and
	// gradient blocks, the optimizer's state, the parameters, and the
	// tape's results and scratch.
	if err := errors.Join(dd.Close(), opt.Close()); err != nil {
		return tr, err
	}
	for _, p := range params {
		if g, ok := p.ReleaseGrad().(device.Buffer); ok {
			if err := g.Free(); err != nil {
				return tr, err
			}
		}
		if err := blocks.FreeLocal(p.Data()); err != nil {
			return tr, err
		}
	}
	tape.Recycle()
	tape.Reset()
	if mem := d.Memory(); mem != nil {
		if err := d.Synchronize(); err != nil {
			return tr, err
		}
		tr.final = mem.Stats().Allocated
	}
	return tr, nil
}

// sameF32 compares two traces bit for bit.
func sameF32(host, dev [][]float32) error {
	if len(host) != len(dev) {
		return fmt.Errorf("%d blocks on the host, %d on the device", len(host), len(dev))
	}
	for i := range host {
		if len(host[i]) != len(dev[i]) {
			return fmt.Errorf("block %d: %d values on the host, %d on the device", i, len(host[i]), len(dev[i]))
		}
		for k := range host[i] {
			if math.Float32bits(host[i][k]) != math.Float32bits(dev[i][k]) {
				return fmt.Errorf("block %d[%d]: host %v, device %v", i, k, host[i][k], dev[i][k])
			}
		}
	}
	return nil
}

// TestDeviceMatchesHost: tensor and sequence parallelism, DDP (with and
// without bucket views, on recycling and plain tapes) and activation
// checkpointing train a block made by the constructors on emulated
// devices (each rank its own) exactly as on the host: every loss and every
// parameter after every step is bit for bit the host's (tolerance 0: the
// emulated device runs the host's CPU kernels on the same data, so any
// difference is work the device path reordered, dropped or repeated), on
// even and odd rank counts with uneven shards; the device makes no driver
// allocation after the first step.
func TestDeviceMatchesHost(t *testing.T) {
	for _, c := range []devRun{
		{dp: 2, tp: 1, steps: 3},
		{dp: 3, tp: 1, steps: 3, views: true, recycle: true},
		{dp: 3, tp: 1, steps: 3, views: true},
		{dp: 2, tp: 1, steps: 3, recycle: true, ckpt: true},
		{dp: 1, tp: 3, steps: 2},
		{dp: 3, tp: 1, steps: 3, accum: true, scale: true},
		{dp: 2, tp: 1, steps: 3, accum: true, scale: true, views: true, recycle: true},
		{dp: 2, tp: 2, steps: 3, recycle: true, head: true},
		{dp: 1, tp: 3, sp: true, steps: 2, ckpt: true, head: true},
		// A head of 2 outputs over 3 ranks: one rank's weight block, and
		// its DDP bucket slot, is empty.
		{dp: 2, tp: 3, steps: 2, head: true, vocab: 2, views: true, recycle: true},
		{dp: 2, tp: 3, steps: 2, head: true, vocab: 2, scale: true},
		{dp: 2, tp: 2, sp: true, steps: 3, views: true, recycle: true},
	} {
		t.Run(c.String(), func(t *testing.T) {
			placementtest.Run(t, []int{c.dp, c.tp}, []string{"dp", "tp"}, func(ctx context.Context, m *mesh.Mesh) error {
				host, err := c.train(ctx, m, device.Host())
				if err != nil {
					return fmt.Errorf("host: %w", err)
				}
				d, err := emu.New(m.Rank())
				if err != nil {
					return err
				}
				dev, err := c.train(ctx, m, d)
				if err != nil {
					return fmt.Errorf("%s: %w", d.Name(), errors.Join(err, d.Close()))
				}
				if err := sameF32(host.values, dev.values); err != nil {
					return errors.Join(fmt.Errorf("%s against the host: %w", d.Name(), err), d.Close())
				}
				if a := dev.allocs; a[len(a)-1] != a[0] {
					return errors.Join(fmt.Errorf("%s: driver allocations after each step %v, want none after the first", d.Name(), a), d.Close())
				}
				// A recycling tape frees the last step's results at
				// Recycle, so the memory held after each step is the
				// same; a plain tape's results are the caller's.
				if h := dev.held; c.recycle && slices.Min(h) != slices.Max(h) {
					return errors.Join(fmt.Errorf("%s: bytes allocated after each step %v, want them flat", d.Name(), h), d.Close())
				}
				if c.recycle && dev.final != 0 {
					return errors.Join(fmt.Errorf("%s: %d bytes still allocated once everything is freed", d.Name(), dev.final), d.Close())
				}
				return d.Close()
			})
		})
	}
}

// TestDeviceRejects: parameters on two devices are an error naming the
// devices before any data moves, and a DDP that runs out of device memory
// while allocating its buckets frees what it took and leaves the device
// usable.
func TestDeviceRejects(t *testing.T) {
	for _, tc := range []struct {
		name  string
		names []string // the mesh's axes, each of size 2 (default "dp")
		run   func(ctx context.Context, m *mesh.Mesh, d device.Device) error
		is    []error
		says  []string
	}{
		{
			name: "DDP/two devices",
			run: func(ctx context.Context, m *mesh.Mesh, d device.Device) error {
				on, err := parallel.NewLinear(autograd.NewTape(autograd.WithDevice(d)), m, 3, 2, parallel.WithName("a"))
				if err != nil {
					return err
				}
				host, err := parallel.NewLinear(autograd.NewTape(), m, 3, 2, parallel.WithName("b"))
				if err != nil {
					return err
				}
				_, err = ddp.New(ctx, []*autograd.Value{on.Weight, host.Weight})
				return err
			},
			is:   []error{device.ErrMixed, ddp.ErrInvalid},
			says: []string{"emu:", "host", `"b.weight"`},
		},
		{
			name: "FSDP/two devices",
			run: func(ctx context.Context, m *mesh.Mesh, d device.Device) error {
				fc, err := parallel.NewLinear(autograd.NewTape(autograd.WithDevice(d)), m, 4, 6, parallel.WithName("fc"))
				if err != nil {
					return err
				}
				proj, err := parallel.NewLinear(autograd.NewTape(), m, 6, 4, parallel.WithName("proj"))
				if err != nil {
					return err
				}
				_, err = fsdp.FullyShard(ctx, &parallel.MLP{FC: fc, Proj: proj}, []string{"fc", "proj"}, fsdp.WithShardAxis("dp"))
				return err
			},
			is:   []error{fsdp.ErrInvalid, device.ErrMixed},
			says: []string{"emu:", "host", `"proj.weight"`},
		},
		{
			name: "DDP/out of memory",
			run: func(ctx context.Context, m *mesh.Mesh, _ device.Device) error {
				// 40 MiB: the 16 MiB weight (a segment of its own) and
				// the bucket fit, the gradient block beside them does
				// not.
				d, err := emu.New(m.Rank(), emu.WithMemory(40<<20))
				if err != nil {
					return err
				}
				defer d.Close()
				lin, err := parallel.NewLinear(autograd.NewTape(autograd.WithDevice(d)), m, 2048, 2048, parallel.WithBias(false), parallel.WithInit(parallel.Zeros()))
				if err != nil {
					return err
				}
				held := d.Memory().Stats().Allocated
				_, err = ddp.New(ctx, []*autograd.Value{lin.Weight}, ddp.WithBucketCap(1<<20))
				// Failures of the checks below quote New's error (%v),
				// so that they do not pass for it.
				if after := d.Memory().Stats().Allocated; after != held {
					return fmt.Errorf("%d bytes allocated after the failed New, %d before (New: %v)", after, held, err)
				}
				// The device is still usable: a smaller block.
				b, aerr := d.Alloc(comm.Float32, 1<<20)
				if aerr == nil {
					aerr = b.Free()
				}
				if aerr != nil {
					return fmt.Errorf("after the failed New: %v (New: %v)", aerr, err)
				}
				return err
			},
			is:   []error{device.ErrOutOfMemory},
			says: []string{"gradient block", "emu:"},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			names := tc.names
			if names == nil {
				names = []string{"dp"}
			}
			shape := slices.Repeat([]int{2}, len(names))
			placementtest.Run(t, shape, names, func(ctx context.Context, m *mesh.Mesh) error {
				err := tc.run(ctx, m, placementtest.Device(ctx))
				if err == nil {
					return errors.New("no error")
				}
				for _, want := range tc.is {
					if !errors.Is(err, want) {
						return fmt.Errorf("error %v does not match %v", err, want)
					}
				}
				for _, s := range tc.says {
					if !strings.Contains(err.Error(), s) {
						return fmt.Errorf("error %q does not say %q", err, s)
					}
				}
				return nil
			}, placementtest.WithDevice(func(r int) (device.Device, error) { return emu.New(r) }))
		})
	}
}

// fsdpDevRun is one configuration of the FSDP device parity test: the
// constructed block, every child an FSDP unit on the "dp" axis (the batch
// sharded there; with tensor parallelism on "tp" first when tp > 1, and
// HSDP's replicate axis "rep" when rep > 0), trained for a few SGD steps.
type fsdpDevRun struct {
	fsdp, tp int
	rep      int // HSDP's replicas (0: none)
	to       int // WithReshardTo(to) (0: none)
	stage    int
	mp       bool // WithMixedPrecision(bfloat16)
	prefetch bool
	reshard  bool // WithReshard(false) when not set
	accum    bool // a NoSync micro-batch before the synced one
	twice    bool // a synced pass before the last one (no Finish between)
	head     int  // a colwise lm head of this many outputs and VocabParallelCrossEntropy (tp > 1)
	steps    int
}

func (c fsdpDevRun) String() string {
	return fmt.Sprintf("fsdp=%d,tp=%d,rep=%d,to=%d,zero=%d,mp=%v,prefetch=%v,reshard=%v,accum=%v,twice=%v,head=%d", c.fsdp, c.tp, c.rep, c.to, c.stage, c.mp, c.prefetch, c.reshard, c.accum, c.twice, c.head)
}

// mesh is the run's mesh shape and axis names.
func (c fsdpDevRun) mesh() ([]int, []string) {
	if c.rep > 0 {
		return []int{c.rep, c.fsdp, c.tp}, []string{"rep", "dp", "tp"}
	}
	return []int{c.fsdp, c.tp}, []string{"dp", "tp"}
}

// train runs c on one rank with its parameters on d.
func (c fsdpDevRun) train(ctx context.Context, m *mesh.Mesh, d device.Device) (devTrace, error) {
	var tr devTrace
	tape := autograd.NewTape(autograd.WithDevice(d), autograd.WithRecycling())
	b, err := newConstructedBlock(tape, m)
	if err != nil {
		return tr, err
	}
	var root parallel.Module = b
	var hd *headed
	units := []string{"ln1", "attn", "ln2", "mlp"}
	plan := ptest.BlockPlan(false)
	if c.head > 0 {
		lin, err := parallel.NewLinear(tape, m, ptest.BlkD, c.head, parallel.WithName("head"), parallel.WithBias(false))
		if err != nil {
			return tr, err
		}
		hd = &headed{blk: b, head: lin, vocab: c.head}
		root = hd
		for i := range units {
			units[i] = "blk." + units[i]
		}
		units = append(units, "head")
		for i := range plan {
			plan[i].Pattern = "blk." + plan[i].Pattern
		}
		plan = append(plan, tp.Rule{Pattern: "head", Style: tp.ColwiseParallel{}})
	}
	if c.tp > 1 {
		if err := tp.Parallelize(ctx, root, "tp", plan); err != nil {
			return tr, err
		}
	}
	opts := []fsdp.Option{fsdp.WithShardAxis("dp"), fsdp.WithZeROStage(c.stage), fsdp.WithPrefetch(c.prefetch), fsdp.WithReshard(c.reshard), fsdp.WithAverage()}
	if c.rep > 0 {
		opts = append(opts, fsdp.WithReplicateAxis("rep"))
	}
	if c.to > 0 {
		opts = append(opts, fsdp.WithReshardTo(c.to))
	}
	if c.mp {
		opts = append(opts, fsdp.WithMixedPrecision(comm.BFloat16))
	}
	f, err := fsdp.FullyShard(ctx, root, units, opts...)
	if err != nil {
		return tr, err
	}
	defer f.Close()
	params := f.Params()
	opt, err := optim.NewSGD(params, 0.05, optim.WithMomentum(0.9))
	if err != nil {
		return tr, err
	}
	defer opt.Close()
	pass := func(step int) error {
		l, x, err := devLoss(ctx, b, tape, m, false, step, hd)
		if err != nil {
			return err
		}
		if l.Data().Device() != d {
			return fmt.Errorf("the loss is on %s, want %s", l.Data().Device().Name(), d.Name())
		}
		loss, err := hostF32(l.Data())
		if err != nil {
			return err
		}
		tr.values = append(tr.values, loss)
		return errors.Join(tape.Backward(ctx, l), blocks.FreeLocal(x))
	}
	for step := range c.steps {
		tape.Recycle()
		if c.accum {
			if err := f.NoSync(func() error { return pass(step + 10) }); err != nil {
				return tr, fmt.Errorf("step %d: NoSync: %w", step, err)
			}
		}
		if c.twice { // its reduction adds into the sharded gradients
			if err := pass(step + 20); err != nil {
				return tr, fmt.Errorf("step %d: first pass: %w", step, err)
			}
		}
		if err := pass(step); err != nil {
			return tr, fmt.Errorf("step %d: %w", step, err)
		}
		if err := f.Finish(ctx); err != nil {
			return tr, fmt.Errorf("step %d: %w", step, err)
		}
		if err := tp.ReduceGrads(ctx, params); err != nil {
			return tr, fmt.Errorf("step %d: %w", step, err)
		}
		if err := opt.Step(); err != nil {
			return tr, fmt.Errorf("step %d: %w", step, err)
		}
		for _, p := range params {
			if p.Data().Device() != d {
				return tr, fmt.Errorf("step %d: %s is on %s, want %s", step, p.Name(), p.Data().Device().Name(), d.Name())
			}
			if g := p.Grad(); g != nil && g.Device() != d {
				return tr, fmt.Errorf("step %d: the gradient of %s is on %s", step, p.Name(), g.Device().Name())
			}
			v, err := hostF32(p.Data())
			if err != nil {
				return tr, err
			}
			tr.values = append(tr.values, v)
			p.ZeroGrad()
		}
		if mem := d.Memory(); mem != nil {
			if err := d.Synchronize(); err != nil {
				return tr, err
			}
			tr.allocs = append(tr.allocs, mem.Stats().DriverAllocs)
			tr.held = append(tr.held, mem.Stats().Allocated)
		}
	}
	if err := errors.Join(f.Close(), opt.Close()); err != nil {
		return tr, err
	}
	for _, p := range params {
		if err := blocks.FreeLocal(p.Data()); err != nil {
			return tr, err
		}
	}
	tape.Recycle()
	tape.Reset()
	if mem := d.Memory(); mem != nil {
		if err := d.Synchronize(); err != nil {
			return tr, err
		}
		tr.final = mem.Stats().Allocated
	}
	return tr, nil
}

// TestFSDPDeviceMatchesHost: FSDP (ZeRO-1, 2 and 3, with and without
// prefetch and resharding, WithReshardTo, HSDP, bfloat16 WithMixedPrecision,
// NoSync accumulation and passes without Finish, with tensor parallelism)
// trains the constructed block on emulated
// devices exactly as on the host: every loss and parameter after every
// step bit for bit (tolerance 0, for the reason TestDeviceMatchesHost
// gives), on odd and even shard counts with uneven and empty shards;
// after the first step the device makes no driver allocation and holds
// the same bytes, and everything comes back once freed.
func TestFSDPDeviceMatchesHost(t *testing.T) {
	for _, c := range []fsdpDevRun{
		{fsdp: 2, tp: 1, stage: 3, prefetch: true, reshard: true, steps: 3},
		{fsdp: 3, tp: 1, stage: 3, prefetch: false, reshard: true, steps: 3},
		{fsdp: 3, tp: 1, stage: 3, prefetch: true, reshard: false, mp: true, steps: 3},
		{fsdp: 2, tp: 1, stage: 2, prefetch: true, accum: true, steps: 3},
		{fsdp: 3, tp: 1, stage: 1, steps: 2},
		{fsdp: 3, tp: 1, stage: 3, prefetch: true, reshard: true, twice: true, steps: 2},
		{fsdp: 2, tp: 1, stage: 2, twice: true, accum: true, steps: 2},
		{fsdp: 2, tp: 2, stage: 3, prefetch: true, reshard: true, mp: true, accum: true, steps: 2},
		{fsdp: 5, tp: 1, stage: 3, prefetch: true, reshard: true, steps: 2}, // a 12-wide weight over 5: empty chunks of 1-dim params
		{fsdp: 2, tp: 1, rep: 2, stage: 3, prefetch: true, reshard: true, steps: 3},
		{fsdp: 3, tp: 1, rep: 2, stage: 2, twice: true, mp: true, steps: 2},
		{fsdp: 4, tp: 1, to: 2, stage: 3, prefetch: true, steps: 3},
		{fsdp: 2, tp: 2, to: 1, stage: 3, mp: true, twice: true, steps: 2},
		// A head of 2 outputs over tp 3: one rank's unsharded weight, and
		// its gradient, is empty.
		{fsdp: 2, tp: 3, stage: 3, prefetch: true, reshard: true, head: 2, steps: 2},
	} {
		t.Run(c.String(), func(t *testing.T) {
			shape, names := c.mesh()
			placementtest.Run(t, shape, names, func(ctx context.Context, m *mesh.Mesh) error {
				host, err := c.train(ctx, m, device.Host())
				if err != nil {
					return fmt.Errorf("host: %w", err)
				}
				d, err := emu.New(m.Rank())
				if err != nil {
					return err
				}
				dev, err := c.train(ctx, m, d)
				if err != nil {
					return fmt.Errorf("%s: %w", d.Name(), errors.Join(err, d.Close()))
				}
				if err := sameF32(host.values, dev.values); err != nil {
					return errors.Join(fmt.Errorf("%s against the host: %w", d.Name(), err), d.Close())
				}
				if a := dev.allocs; a[len(a)-1] != a[0] {
					return errors.Join(fmt.Errorf("%s: driver allocations after each step %v, want none after the first", d.Name(), a), d.Close())
				}
				if h := dev.held; slices.Min(h) != slices.Max(h) {
					return errors.Join(fmt.Errorf("%s: bytes allocated after each step %v, want them flat", d.Name(), h), d.Close())
				}
				if dev.final != 0 {
					return errors.Join(fmt.Errorf("%s: %d bytes still allocated once everything is freed", d.Name(), dev.final), d.Close())
				}
				return d.Close()
			})
		})
	}
}
