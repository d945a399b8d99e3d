package optim

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/internal/numcheck"
	"github.com/b7ea7098/loom/kernels"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
)

// ClipOption configures ClipGradNorm: it is Option, so that the options
// ClipGradNorm shares with the optimizers (WithAllowFrozen) are the same
// values, and one it does not take is an error.
type ClipOption = Option

// clipOptions are the options ClipGradNorm takes.
var clipOptions = []string{"WithNormType", "WithErrorIfNonfinite", "WithAllowFrozen"}

// WithNormType sets the norm ClipGradNorm measures: p > 0 for the p-norm
// (Σ|g|^p)^(1/p) over every element of every gradient (default 2),
// or math.Inf(1) for the largest absolute element.
func WithNormType(p float64) ClipOption {
	return func(c *config) { c.normType = p; c.set("WithNormType") }
}

// WithErrorIfNonfinite makes ClipGradNorm return an error, without scaling
// anything, when the total norm is NaN or infinite (PyTorch's
// error_if_nonfinite=True). Without it such a norm scales the gradients
// like any other, which turns them into NaN (PyTorch's default).
func WithErrorIfNonfinite() ClipOption {
	return func(c *config) { c.errNonfinite = true; c.set("WithErrorIfNonfinite") }
}

// clipEps is PyTorch's 1e-6 added to the norm before dividing.
const clipEps = 1e-6

// ClipGradNorm rescales the gradients of params so that their total norm
// is at most maxNorm, like torch.nn.utils.clip_grad_norm_, and returns the
// total norm before clipping. The norm (2 by default, see WithNormType) is
// over the global gradient tensors, as if every gradient were gathered on
// one rank: each distinct element counts once whatever the placement.
// When maxNorm/(norm + 1e-6) < 1 (or is NaN), every gradient is multiplied
// by it; otherwise nothing changes. A parameter without a gradient is an
// error naming it, as in the optimizers' Step, unless WithAllowFrozen is
// given: then it is skipped, and with no gradient at all the norm is 0.
//
// Each rank sums |g|^p (or takes max |g|) over its local blocks, in
// float64. On a mesh axis where a gradient is Shard the blocks hold
// different elements, so the sums are reduced over that axis; where it is
// Replicate every rank already holds the same elements, so they are not.
// Gradients are grouped by the set of mesh axes (of size > 1) that shard
// them, and each group with a non-empty set is all-reduced once over the
// communicator of those axes (mesh.Group), all groups issued together in
// a fixed order (by axis set), so the collectives are the same on every
// rank. The result is then the same on every rank. Scaled gradients are
// installed with SetGrad as new tensors in the same layout (the old ones
// are not modified).
//
// ClipGradNorm is collective: every rank of the mesh calls it with the
// same parameters, whose gradients are present on every rank or on none
// and laid out alike. Every gradient must live on one mesh layout and
// hold float32 or float64. A Partial gradient (on an axis of size > 1) is
// an error, since its norm is not determined by any rank's block: reduce
// it first (DDP's all-reduce, FSDP's reduce-scatter). Errors also for a
// maxNorm that is not positive and finite (0 would zero every gradient),
// a WithNormType that is neither positive and finite nor +Inf, an option
// ClipGradNorm does not take, or (with WithErrorIfNonfinite) a non-finite
// norm; all checks but the last run before any communication,
// and no gradient changes on an error. Bad arguments wrap ErrInvalid, a
// non-finite norm ErrNonfinite (a training loop may skip that step).
//
// Gradients on a device (all on one: gradients on two devices are an
// error matching device.ErrMixed and ErrInvalid) are measured there, for
// the 2-norm by the device's Kernels.SumSquares with the partial sums
// read back in one copy (other orders copy each block to the host), and
// the all-reduce is the host one above. They are scaled in place by
// Kernels.Scale, on the device's compute stream, instead of being
// replaced by new tensors: a new device block every step would need an
// owner to free the one it replaces. The norm and the scaled values are
// those of the host path, bit for bit.
func ClipGradNorm(ctx context.Context, params []*autograd.Value, maxNorm float64, opts ...ClipOption) (float64, error) {
	const what = "ClipGradNorm"
	cfg, err := newConfig(what, config{normType: 2}, clipOptions, opts)
	if err != nil {
		return 0, err
	}
	p := cfg.normType
	if err := checkNums(what, numcheck.Positive(ErrInvalid, "maxNorm", maxNorm), normOrder(p)); err != nil {
		return 0, err
	}
	inf := math.IsInf(p, 1)

	var (
		withGrad []*autograd.Value
		masks    []uint64 // of withGrad's gradients
		missing  []string
		m        *mesh.Mesh
		acc      = map[uint64]float64{} // sharding-axis mask -> local partial
	)
	for i, v := range params {
		if v == nil {
			return 0, fmt.Errorf("optim: ClipGradNorm: %w: parameter %d is nil", ErrInvalid, i)
		}
		g := v.Grad()
		if g == nil {
			if !cfg.frozen {
				missing = append(missing, v.Name())
			}
			continue
		}
		s := g.Spec()
		if m == nil {
			m = s.Mesh()
		} else if err := sameMesh(m, s.Mesh()); err != nil {
			return 0, fmt.Errorf("optim: ClipGradNorm: %w: the gradient of %q: %w", ErrInvalid, v.Name(), err)
		}
		mask, err := shardMask(s)
		if err != nil {
			return 0, fmt.Errorf("optim: ClipGradNorm: %w: the gradient of %q: %w", ErrInvalid, v.Name(), err)
		}
		if err := checkBlock(g.LocalData()); err != nil {
			return 0, fmt.Errorf("optim: ClipGradNorm: %w: the gradient of %q holds %w", ErrInvalid, v.Name(), err)
		}
		if len(withGrad) > 0 {
			if err := device.Same("gradients", withGrad[0].Grad().Device(), g.Device()); err != nil {
				return 0, fmt.Errorf("optim: ClipGradNorm: %w: the gradients of %q and %q: %w", ErrInvalid, withGrad[0].Name(), v.Name(), err)
			}
		}
		withGrad = append(withGrad, v)
		masks = append(masks, mask)
	}
	if err := noGrad(what, missing); err != nil {
		return 0, err
	}
	if len(withGrad) == 0 {
		return 0, nil
	}
	parts, err := localNorms(withGrad, p)
	if err != nil {
		return 0, fmt.Errorf("optim: ClipGradNorm: %w", err)
	}
	for i, part := range parts {
		if prev, ok := acc[masks[i]]; !ok {
			acc[masks[i]] = part
		} else if inf {
			acc[masks[i]] = max(prev, part)
		} else {
			acc[masks[i]] = prev + part
		}
	}

	op := comm.Sum
	if inf {
		op = comm.Max
	}
	sets := make([]uint64, 0, len(acc))
	for k := range acc {
		sets = append(sets, k)
	}
	slices.Sort(sets)
	names := m.Names()
	var (
		works []comm.Work
		recvs [][]float64
	)
	for _, mask := range sets {
		if mask == 0 {
			recvs = append(recvs, []float64{acc[mask]})
			continue
		}
		var axes []string
		for a, n := range names {
			if mask&(1<<a) != 0 {
				axes = append(axes, n)
			}
		}
		c, err := m.Group(ctx, axes...)
		if err != nil {
			return 0, fmt.Errorf("optim: ClipGradNorm: communicator of mesh axes %v: %w", axes, err)
		}
		recv := []float64{0}
		w, err := comm.AllReduceAsync(ctx, c, comm.Host([]float64{acc[mask]}), comm.Host(recv), op)
		if err != nil {
			return 0, fmt.Errorf("optim: ClipGradNorm: all-reduce over mesh axes %v: %w", axes, err)
		}
		works = append(works, w)
		recvs = append(recvs, recv)
	}
	if err := comm.WaitAll(ctx, works...); err != nil {
		return 0, fmt.Errorf("optim: ClipGradNorm: reducing the norm: %w", err)
	}
	total := 0.0
	for _, r := range recvs {
		if inf {
			total = max(total, r[0])
		} else {
			total += r[0]
		}
	}
	norm := total
	switch {
	case inf:
	case p == 2:
		norm = math.Sqrt(total)
	case p == 1:
	default:
		norm = math.Pow(total, 1/p)
	}
	if cfg.errNonfinite && (math.IsNaN(norm) || math.IsInf(norm, 0)) {
		return norm, fmt.Errorf("optim: ClipGradNorm: %w: the total norm of order %v of the gradients is %v; nothing was scaled", ErrNonfinite, p, norm)
	}
	coef := maxNorm / (norm + clipEps)
	if coef >= 1 {
		return norm, nil
	}
	if deviceBlock(withGrad[0].Grad()) != nil {
		return norm, scaleOnDevice(withGrad, coef)
	}
	// Scale into new tensors first, then install them all, so that an
	// error leaves every gradient as it was.
	scaled := make([]*placement.DTensor, len(withGrad))
	for i, v := range withGrad {
		g := v.Grad()
		var err error
		switch d := g.LocalData().(type) {
		case []float32:
			scaled[i], err = placement.NewLocal(g.Spec(), scaleBy(d, float32(coef)))
		case []float64:
			scaled[i], err = placement.NewLocal(g.Spec(), scaleBy(d, coef))
		}
		if err != nil {
			return norm, fmt.Errorf("optim: ClipGradNorm: scaling the gradient of %q: %w", v.Name(), err)
		}
	}
	for i, v := range withGrad {
		if err := v.SetGrad(scaled[i]); err != nil {
			return norm, fmt.Errorf("optim: ClipGradNorm: installing the scaled gradient of %q: %w", v.Name(), err)
		}
	}
	return norm, nil
}

// scaleOnDevice multiplies the device gradients of params by coef in
// place, each buffer once (two leaves given one gradient tensor share its
// buffer). In place, unlike the host path's new tensors, because a new
// device block per step would need an owner to free the one it replaces.
func scaleOnDevice(params []*autograd.Value, coef float64) error {
	done := map[uintptr]bool{}
	for _, v := range params {
		b := deviceBlock(v.Grad())
		if p := b.Ptr(); p != 0 {
			if done[p] {
				continue
			}
			done[p] = true
		}
		if err := b.Owner().Kernels().Scale(b, b, coef); err != nil {
			return fmt.Errorf("optim: ClipGradNorm: scaling the gradient of %q on %s: %w", v.Name(), b.Device(), err)
		}
	}
	return nil
}

// localNorms returns Σ|g|^p (or max|g| for p = +Inf) of each parameter's
// local gradient block, in float64. Host blocks are measured here; device
// blocks (all on one device) by its Kernels.SumSquares for p = 2, into
// one buffer of partial sums read back at once, and for other orders
// through a copy of each block to the host (the devices have no kernel
// for them). Either way the sums equal the host path's bit for bit: the
// same CPU code, or SumSquares's loop, which is localNorm's for p = 2.
func localNorms(params []*autograd.Value, p float64) ([]float64, error) {
	parts := make([]float64, len(params))
	first := deviceBlock(params[0].Grad())
	if first == nil || p != 2 {
		for i, v := range params {
			data := v.Grad().LocalData()
			if b, ok := data.(device.Buffer); ok {
				h, err := comm.NewHostBuffer(b.DType(), b.Len())
				if err == nil {
					err = b.Owner().CopyToHost(h, b)
				}
				if err != nil {
					return nil, fmt.Errorf("reading the gradient of %q off %s: %w", v.Name(), b.Device(), err)
				}
				if h.DType() == comm.Float64 {
					data = h.Float64s()
				} else {
					data = h.Float32s()
				}
			}
			switch d := data.(type) {
			case []float32:
				parts[i] = localNorm(d, p)
			case []float64:
				parts[i] = localNorm(d, p)
			}
		}
		return parts, nil
	}
	dev := first.Owner()
	buf, err := dev.Alloc(comm.Float64, len(params))
	if err != nil {
		return nil, fmt.Errorf("partial sums on %s: %w", dev.Name(), err)
	}
	for i, v := range params {
		if err := dev.Kernels().SumSquares(buf.Slice(i, i+1).(device.Buffer), deviceBlock(v.Grad())); err != nil {
			return nil, errors.Join(fmt.Errorf("the sum of squares of the gradient of %q on %s: %w", v.Name(), dev.Name(), err), buf.Free())
		}
	}
	h := comm.Host(parts)
	if err := dev.CopyToHost(h, buf); err != nil {
		return nil, errors.Join(fmt.Errorf("reading the partial sums off %s: %w", dev.Name(), err), buf.Free())
	}
	return parts, buf.Free()
}

// shardMask returns the set of mesh axes (size > 1) on which s is
// sharded, as a bit mask over axis indices. Partial and Routed placements
// on such axes are errors.
func shardMask(s *placement.Spec) (uint64, error) {
	sizes, names := s.Mesh().Shape(), s.Mesh().Names()
	if len(sizes) > 64 {
		return 0, fmt.Errorf("a mesh of %d axes (at most 64)", len(sizes))
	}
	var mask uint64
	for a, pl := range s.Placements() {
		if sizes[a] == 1 {
			continue
		}
		switch {
		case pl.IsShard():
			mask |= 1 << a
		case pl.IsPartial():
			return 0, fmt.Errorf("it is %v on mesh axis %q, so no rank's block determines its norm: reduce it (all-reduce or reduce-scatter) before clipping", pl, names[a])
		case pl.IsRouted():
			return 0, fmt.Errorf("it is %v on mesh axis %q; combine it first", pl, names[a])
		}
	}
	return mask, nil
}

// sameMesh checks that b is the same mesh layout as a.
func sameMesh(a, b *mesh.Mesh) error {
	if a.World() != b.World() || !slices.Equal(a.Names(), b.Names()) || !slices.Equal(a.Shape(), b.Shape()) || !slices.Equal(a.WorldRanks(), b.WorldRanks()) {
		return fmt.Errorf("it is on mesh %v, another gradient on %v: every gradient must be on one mesh layout", b, a)
	}
	return nil
}

// localNorm returns Σ|x|^p over d in float64, or max|x| for p = +Inf
// (NaN if any element is NaN: Go's max propagates NaN, like torch.max).
func localNorm[T Float](d []T, p float64) float64 {
	s := 0.0
	switch {
	case math.IsInf(p, 1):
		for _, x := range d {
			s = max(s, math.Abs(float64(x)))
		}
	case p == 2:
		// The devices' Kernels.SumSquares runs this very loop.
		s = kernels.SumSquares(d)
	case p == 1:
		for _, x := range d {
			s += math.Abs(float64(x))
		}
	default:
		for _, x := range d {
			s += math.Pow(math.Abs(float64(x)), p)
		}
	}
	return s
}

// scaleBy returns c·d.
func scaleBy[T Float](d []T, c T) []T {
	out := make([]T, len(d))
	for i, x := range d {
		out[i] = x * c
	}
	return out
}
