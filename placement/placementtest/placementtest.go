// Package placementtest runs placement code on a simulated mesh inside an
// ordinary go test and compares distributed tensors with serial references.
// It is how a user unit-tests placement transitions on a laptop: every rank
// is a goroutine, collectives move data through shared memory (comm/local).
// Tensors are placement's dense representation: a []float32 or []float64 in
// row-major order over the global shape.
package placementtest

import (
	"context"
	"errors"
	"fmt"
	"math"
	"runtime/debug"
	"slices"
	"strings"
	"testing"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/local"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/internal/checked"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
)

// Simulate runs fn on every rank of an in-process mesh with the given axis
// sizes and names (one goroutine per rank, mesh rank = world rank). When
// one rank fails, the others' pending collectives fail at once instead of
// hanging. The error names every failing rank and its mesh coordinate and
// says each distinct message once: ranks that failed alike are listed
// together, and ranks that only stopped because another rank aborted the
// mesh are summed up in one line. A panic in fn is an error of its rank.
// errors.Is and errors.As see every rank's error.
//
// WithDevice gives every rank a device, which fn reads with Device(ctx).
func Simulate(ctx context.Context, shape []int, names []string, fn func(ctx context.Context, m *mesh.Mesh) error, opts ...Option) error {
	var cfg config
	for i, o := range opts {
		if o == nil {
			return fmt.Errorf("placementtest: Simulate: %w: option %d is nil", placement.ErrInvalid, i)
		}
		o(&cfg)
	}
	for _, s := range shape {
		if s <= 0 {
			return fmt.Errorf("placementtest: Simulate: %w: mesh shape %v: sizes must be positive", placement.ErrInvalid, shape)
		}
	}
	p, ok := checked.Product(shape)
	if !ok {
		return fmt.Errorf("placementtest: Simulate: %w: mesh shape %v: the number of ranks overflows int", placement.ErrInvalid, shape)
	}
	errs := make([]error, p)
	err := local.Run(ctx, p, func(ctx context.Context, world comm.Communicator) (err error) {
		r := world.Rank()
		defer func() {
			if v := recover(); v != nil {
				err = fmt.Errorf("panic: %v\n%s", v, debug.Stack())
			}
			errs[r] = err
		}()
		m, err := mesh.New(world, shape, names)
		if err != nil {
			return err
		}
		if cfg.device == nil {
			return fn(ctx, m)
		}
		d, err := cfg.device(r)
		if err != nil {
			return fmt.Errorf("placementtest: the device of rank %d: %w", r, err)
		}
		if d == nil {
			return fmt.Errorf("placementtest: %w: OnDevice gave rank %d a nil device", placement.ErrInvalid, r)
		}
		defer func() {
			if cerr := d.Close(); err == nil && cerr != nil {
				err = fmt.Errorf("placementtest: closing %s: %w", d.Name(), cerr)
			}
		}()
		return fn(context.WithValue(ctx, deviceKey{}, d), m)
	})
	if err == nil {
		return nil
	}
	re := &rankErrors{shape: shape, names: names, errs: errs}
	if !slices.ContainsFunc(errs, func(e error) bool { return e != nil }) {
		return err // the world did not start: no rank ran
	}
	return re
}

// Option configures Simulate and Run.
type Option func(*config)

type config struct {
	device func(rank int) (device.Device, error)
}

// WithDevice makes Simulate and Run give each rank the device that newDevice
// returns for its world rank (an emu.New(rank), say), made on the rank's
// goroutine before fn runs and closed after it returns; fn reads it with
// Device(ctx). An error of newDevice, or of closing the device, is the
// rank's error.
func WithDevice(newDevice func(rank int) (device.Device, error)) Option {
	return func(c *config) { c.device = newDevice }
}

// deviceKey is the context key of a rank's device.
type deviceKey struct{}

// Device returns the device Simulate gave the rank whose ctx this is
// (WithDevice), or device.Host() without one.
func Device(ctx context.Context) device.Device {
	if d, ok := ctx.Value(deviceKey{}).(device.Device); ok {
		return d
	}
	return device.Host()
}

// rankErrors is Simulate's error: every rank's error, nil for ranks that
// succeeded.
type rankErrors struct {
	shape []int
	names []string
	errs  []error
}

// knockOn reports whether rank r's error only says that another rank
// failed: an abort by another rank, or the cancellation local.Run sends
// every rank when one fails.
func (e *rankErrors) knockOn(r int) bool {
	var ab *comm.AbortError
	if errors.As(e.errs[r], &ab) {
		return ab.Rank != r
	}
	return errors.Is(e.errs[r], context.Canceled)
}

// Error lists the failing ranks' errors, each distinct message once.
func (e *rankErrors) Error() string {
	var primary, stopped []int
	for r, err := range e.errs {
		switch {
		case err == nil:
		case e.knockOn(r):
			stopped = append(stopped, r)
		default:
			primary = append(primary, r)
		}
	}
	if len(primary) == 0 { // nobody failed first (say, the caller's context ended)
		primary, stopped = stopped, nil
	}
	var msgs []string
	byMsg := map[string][]int{}
	for _, r := range primary {
		msg := e.errs[r].Error()
		if _, ok := byMsg[msg]; !ok {
			msgs = append(msgs, msg)
		}
		byMsg[msg] = append(byMsg[msg], r)
	}
	var b strings.Builder
	for i, msg := range msgs {
		if i > 0 {
			b.WriteString("\n")
		}
		fmt.Fprintf(&b, "%s: %s", e.ranks(byMsg[msg]), msg)
	}
	if len(stopped) > 0 {
		fmt.Fprintf(&b, "\n%s: stopped because a failing rank aborted the mesh", e.ranks(stopped))
	}
	return b.String()
}

// ranks names a set of ranks: "rank 4 (dp=1 tp=1)" or "ranks 0, 2, 3".
func (e *rankErrors) ranks(rs []int) string {
	if len(rs) == 1 {
		r := rs[0]
		c := unravel(r, e.shape)
		parts := make([]string, len(c))
		for a, v := range c {
			name := fmt.Sprint(a)
			if a < len(e.names) {
				name = e.names[a]
			}
			parts[a] = fmt.Sprintf("%s=%d", name, v)
		}
		return fmt.Sprintf("rank %d (%s)", r, strings.Join(parts, " "))
	}
	parts := make([]string, len(rs))
	for i, r := range rs {
		parts[i] = fmt.Sprint(r)
	}
	return "ranks " + strings.Join(parts, ", ")
}

// Unwrap returns every rank's error, so errors.Is and errors.As see them.
func (e *rankErrors) Unwrap() []error {
	var out []error
	for _, err := range e.errs {
		if err != nil {
			out = append(out, err)
		}
	}
	return out
}

// Run is Simulate inside a test: an error from any rank fails t, reported
// once from the calling goroutine.
func Run(t testing.TB, shape []int, names []string, fn func(ctx context.Context, m *mesh.Mesh) error, opts ...Option) {
	t.Helper()
	if err := Simulate(context.Background(), shape, names, fn, opts...); err != nil {
		t.Errorf("mesh %v %v:\n%v", names, shape, err)
	}
}

// CheckFull materialises dt's global tensor (a collective: every rank of
// the mesh must call it; a tensor on a device is copied to the host at
// the end) and compares it element-wise with want, a
// []float32 or []float64 in row-major order over dt's global shape.
// Elements match when |got-want| <= tol*max(1, |want|). The error names
// the first differing index.
func CheckFull(ctx context.Context, dt *placement.DTensor, want any, tol float64) error {
	got, err := dt.Full(ctx)
	if err != nil {
		return err
	}
	return compare(dt.Spec().Shape(), got, want, tol)
}

// Compare compares two []float32 or []float64 slices (either type,
// mixed allowed) element-wise within tol (see CheckFull).
func Compare(got, want any, tol float64) error {
	return compare(nil, got, want, tol)
}

// compare is Compare; a non-nil shape names the differing element's index.
func compare(shape []int, got, want any, tol float64) error {
	g, err := values(got)
	if err != nil {
		return fmt.Errorf("placementtest: got: %w", err)
	}
	w, err := values(want)
	if err != nil {
		return fmt.Errorf("placementtest: want: %w", err)
	}
	if len(g) != len(w) {
		return fmt.Errorf("placementtest: %d elements, want %d", len(g), len(w))
	}
	for i := range g {
		if math.Abs(g[i]-w[i]) > tol*math.Max(1, math.Abs(w[i])) || math.IsNaN(g[i]) != math.IsNaN(w[i]) {
			at := ""
			if shape != nil {
				at = fmt.Sprintf(" (index %v of %v)", unravel(i, shape), shape)
			}
			return fmt.Errorf("placementtest: element %d%s is %g, want %g", i, at, g[i], w[i])
		}
	}
	return nil
}

// values returns a []float32 or []float64 as float64s.
func values(d any) ([]float64, error) {
	switch d := d.(type) {
	case []float32:
		out := make([]float64, len(d))
		for i, v := range d {
			out[i] = float64(v)
		}
		return out, nil
	case []float64:
		return d, nil
	}
	return nil, fmt.Errorf("data is %T, want []float32 or []float64", d)
}

func unravel(p int, shape []int) []int {
	c := make([]int, len(shape))
	for i := len(shape) - 1; i >= 0; i-- {
		c[i] = p % shape[i]
		p /= shape[i]
	}
	return c
}

// Random returns a tensor of the given shape, a []float32 for Float32 and
// a []float64 otherwise, filled in row-major order with deterministic
// values in [-1, 1) from seed; every rank calling it with the same
// arguments gets the same tensor. A shape with a 0 dim gives an empty
// slice, a scalar (no dims) one element. A shape with a negative dim or
// an element count that overflows int (counting the non-zero dims, as
// placement.NewSpec does) gives nil, which FromFull and Distribute reject.
func Random(shape []int, dtype comm.DType, seed uint64) any {
	n, ok := checked.Product(shape)
	if !ok {
		return nil
	}
	if dtype == comm.Float32 {
		d := make([]float32, n)
		for i := range d {
			d[i] = float32(uniform(seed, uint64(i)))
		}
		return d
	}
	d := make([]float64, n)
	for i := range d {
		d[i] = uniform(seed, uint64(i))
	}
	return d
}

// mix is splitmix64 over a sequence of words.
func mix(words ...uint64) uint64 {
	var h uint64 = 0x9e3779b97f4a7c15
	for _, w := range words {
		h ^= w + 0x9e3779b97f4a7c15 + (h << 6) + (h >> 2)
		z := h
		z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
		z = (z ^ (z >> 27)) * 0x94d049bb133111eb
		h = z ^ (z >> 31)
	}
	return h
}

// uniform returns a deterministic value in [-1, 1).
func uniform(words ...uint64) float64 {
	return float64(mix(words...)>>11)/float64(1<<53)*2 - 1
}

// Distribute is placement.FromFull (full is a []float32 or []float64 in
// row-major order over spec's global shape) with genuinely partial values:
// on every Partial axis of size k the ranks hold k different tensors whose
// reduction is the value (for sum, pieces plus noise that cancels; for avg,
// the value plus noise that cancels; for max and min, the value on one
// random rank per element and strictly smaller or larger values
// elsewhere). Every rank must pass the same full tensor and seed; no
// communication happens. It is the input of choice for testing transitions
// out of Partial.
func Distribute(spec *placement.Spec, full any, seed uint64) (*placement.DTensor, error) {
	places := spec.Placements()
	rep := slices.Clone(places)
	for i, p := range rep {
		if p.IsPartial() {
			rep[i] = placement.Replicate()
		}
	}
	opts := make([]placement.SpecOption, 0)
	for d := range spec.Shape() {
		if o := spec.Order(d); len(o) > 1 {
			opts = append(opts, placement.WithOrder(d, o...))
		}
	}
	rspec, err := spec.With(rep, opts...)
	if err != nil {
		return nil, err
	}
	r, err := placement.FromFull(rspec, full)
	if err != nil {
		return nil, err
	}
	m := spec.Mesh()
	// The global index along every dim of each local position (a
	// load-balanced dim's block is two runs, not a box).
	pos := make([][]int, len(spec.Shape()))
	for d := range pos {
		if pos[d], err = spec.Positions(d, m.Rank()); err != nil {
			return nil, err
		}
	}
	shape := r.LocalShape()
	gshape := spec.Shape()
	coord := m.Coord()
	msh := m.Shape()
	// Global flat index of every local element.
	gidx := func(i int) uint64 {
		c := unravel(i, shape)
		g := 0
		for d := range c {
			g = g*gshape[d] + pos[d][c[d]]
		}
		return uint64(g)
	}
	split := func(v float64, i int) float64 {
		g := gidx(i)
		var prefix []uint64
		for a, p := range places {
			k := msh[a]
			if !p.IsPartial() || k == 1 {
				continue
			}
			words := append([]uint64{seed, uint64(a), g}, prefix...)
			me := coord[a]
			switch p.Op() {
			case comm.Sum, comm.Avg:
				noise := 0.0
				total := 0.0
				for c := 0; c < k-1; c++ {
					n := uniform(append(words, uint64(c))...)
					total += n
					if c == me {
						noise = n
					}
				}
				if me == k-1 {
					noise = -total
				}
				if p.Op() == comm.Sum {
					v = v/float64(k) + noise
				} else {
					v += noise
				}
			case comm.Max, comm.Min:
				win := int(mix(append(words, 1<<40)...) % uint64(k))
				if me != win {
					d := 0.25 + math.Abs(uniform(append(words, uint64(me))...))
					if p.Op() == comm.Max {
						v -= d
					} else {
						v += d
					}
				}
			}
			prefix = append(prefix, uint64(me))
		}
		return v
	}
	switch d := r.LocalData().(type) {
	case []float32:
		for i := range d {
			d[i] = float32(split(float64(d[i]), i))
		}
	case []float64:
		for i := range d {
			d[i] = split(d[i], i)
		}
	}
	return placement.NewLocal(spec, r.LocalData())
}
