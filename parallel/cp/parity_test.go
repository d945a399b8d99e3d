package cp_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"testing"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/device/emu"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/parallel/cp"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// parityCase is one layout of q, k, v [B, H, T, Dh] on a mesh: places per
// mesh axis, the cp axis (and the inner axis for Hybrid).
type parityCase struct {
	mshape []int
	names  []string
	places []placement.Placement
	axis   string
	inner  string
	method cp.Method
	b, h   int
	t, dh  int
	emu    bool // run cp on each rank's emulated device
}

func (c parityCase) String() string {
	s := fmt.Sprintf("%v%v/%v/%v/H%d/T%d", c.names, c.mshape, c.places, c.method, c.h, c.t)
	if c.emu {
		s += "/emu"
	}
	return s
}

// run checks cp.Attention against the one-rank attention (autograd's
// CausalAttention on replicated float64 tensors) on every rank: the
// result and the gradients of q, k and v for a random output gradient,
// within relative error tol of the largest element.
func (c parityCase) run(t *testing.T, tol float64) {
	t.Helper()
	shape := []int{c.b, c.h, c.t, c.dh}
	full := func(seed uint64) []float64 { return placementtest.Random(shape, comm.Float64, seed).([]float64) }
	qf, kf, vf, gf := full(1), full(2), full(3), full(4)
	var opts []placementtest.Option
	if c.emu {
		opts = append(opts, placementtest.WithDevice(func(r int) (device.Device, error) { return emu.New(r) }))
	}
	placementtest.Run(t, c.mshape, c.names, func(ctx context.Context, m *mesh.Mesh) error {
		rep := make([]placement.Placement, len(c.mshape))
		for i := range rep {
			rep[i] = placement.Replicate()
		}
		attn := func(places []placement.Placement, dev device.Device, f func(q, k, v *autograd.Value) (*autograd.Value, error)) (out []float64, grads [3][]float64, err error) {
			spec, err := placement.NewSpec(m, shape, comm.Float64, places)
			if err != nil {
				return nil, grads, err
			}
			tp := autograd.NewTape(autograd.WithDevice(dev))
			var vs [3]*autograd.Value
			for i, f := range [][]float64{qf, kf, vf} {
				d, err := placement.FromFull(spec, f, placement.WithDevice(dev))
				if err != nil {
					return nil, grads, err
				}
				if vs[i], err = tp.Param(fmt.Sprint("qkv"[i:i+1]), d); err != nil {
					return nil, grads, err
				}
			}
			y, err := f(vs[0], vs[1], vs[2])
			if err != nil {
				return nil, grads, err
			}
			gd, err := placement.FromFull(y.Spec(), gf, placement.WithDevice(dev))
			if err != nil {
				return nil, grads, err
			}
			g, err := tp.Constant(gd)
			if err != nil {
				return nil, grads, err
			}
			p, err := autograd.Mul(y, g)
			if err != nil {
				return nil, grads, err
			}
			loss, err := autograd.Sum(p)
			if err != nil {
				return nil, grads, err
			}
			if err := tp.Backward(ctx, loss); err != nil {
				return nil, grads, err
			}
			o, err := y.Data().Full(ctx)
			if err != nil {
				return nil, grads, err
			}
			for i, v := range vs {
				gf, err := v.Grad().Full(ctx)
				if err != nil {
					return nil, grads, err
				}
				grads[i] = gf.([]float64)
			}
			return o.([]float64), grads, nil
		}
		want, wantG, err := attn(rep, device.Host(), autograd.CausalAttention)
		if err != nil {
			return fmt.Errorf("reference: %w", err)
		}
		opts := []cp.Option{cp.WithMethod(c.method)}
		if c.inner != "" {
			opts = append(opts, cp.WithUlyssesAxis(c.inner))
		}
		got, gotG, err := attn(c.places, placementtest.Device(ctx), func(q, k, v *autograd.Value) (*autograd.Value, error) {
			return cp.Attention(ctx, q, k, v, c.axis, opts...)
		})
		if err != nil {
			return err
		}
		for i, p := range [][2][]float64{{got, want}, {gotG[0], wantG[0]}, {gotG[1], wantG[1]}, {gotG[2], wantG[2]}} {
			if e := relErr(p[0], p[1]); e > tol {
				return fmt.Errorf("%s: relative error %.3g > %.0g", []string{"out", "dq", "dk", "dv"}[i], e, tol)
			}
		}
		return nil
	}, opts...)
}

func relErr(got, want []float64) float64 {
	num, den := 0.0, 0.0
	for i := range want {
		num = max(num, math.Abs(got[i]-want[i]))
		den = max(den, math.Abs(want[i]))
	}
	return num / max(den, math.SmallestNonzeroFloat64)
}

// seqShard returns the placements of a mesh with the cp axis at index a
// sharding T (dim 2) by p and the others Replicate.
func seqShard(n, a int, p placement.Placement) []placement.Placement {
	out := make([]placement.Placement, n)
	for i := range out {
		out[i] = placement.Replicate()
	}
	out[a] = p
	return out
}

// TestAttentionParity: float64 parity with one rank (relative error
// <= 1e-12, the result and every gradient) for cp = 2, 3 and 4, each
// method, with and without causal load balancing (ShardBalanced),
// sequence lengths that divide 2·cp and that do not, heads divisible by
// cp and not (Ulysses refuses those: TestUlyssesHeads).
func TestAttentionParity(t *testing.T) {
	var cases []parityCase
	for _, n := range []int{2, 3, 4} {
		for _, m := range []cp.Method{cp.Ring, cp.AllGather, cp.Ulysses} {
			for _, tt := range []int{4 * n, 4*n + 1, n + 1} {
				for _, h := range []int{n, n + 1} {
					if m == cp.Ulysses && h%n != 0 {
						continue
					}
					for _, p := range []placement.Placement{placement.Shard(2), placement.ShardBalanced(2)} {
						cases = append(cases, parityCase{mshape: []int{n}, names: []string{"cp"}, places: seqShard(1, 0, p),
							axis: "cp", method: m, b: 2, h: h, t: tt, dh: 3})
					}
				}
			}
		}
	}
	cases = withEmu(cases)
	for _, c := range cases {
		t.Run(c.String(), func(t *testing.T) { c.run(t, 1e-12) })
	}
}

// withEmu returns cases followed by each of them on the emulated device.
func withEmu(cases []parityCase) []parityCase {
	out := slices.Clone(cases)
	for _, c := range cases {
		c.emu = true
		out = append(out, c)
	}
	return out
}

// TestAttentionParityComposed: cp beside tp (heads sharded over tp) and
// dp (batch sharded), and Hybrid on a 2-D cp mesh, balanced and not.
func TestAttentionParityComposed(t *testing.T) {
	S, B := placement.Shard, placement.ShardBalanced
	cases := []parityCase{
		{mshape: []int{2, 2}, names: []string{"cp", "tp"}, places: []placement.Placement{S(2), S(1)}, axis: "cp", method: cp.Ring, b: 2, h: 4, t: 9, dh: 2},
		{mshape: []int{2, 2}, names: []string{"dp", "cp"}, places: []placement.Placement{S(0), S(2)}, axis: "cp", method: cp.Ulysses, b: 2, h: 2, t: 8, dh: 2},
		{mshape: []int{2, 2}, names: []string{"cp", "tp"}, places: []placement.Placement{S(2), S(1)}, axis: "cp", method: cp.AllGather, b: 1, h: 2, t: 7, dh: 2},
		{mshape: []int{2, 2}, names: []string{"cpr", "cpu"}, places: []placement.Placement{S(2), S(2)}, axis: "cpr", inner: "cpu", method: cp.Hybrid, b: 2, h: 2, t: 11, dh: 3},
		{mshape: []int{3, 2}, names: []string{"cpr", "cpu"}, places: []placement.Placement{S(2), S(2)}, axis: "cpr", inner: "cpu", method: cp.Hybrid, b: 1, h: 4, t: 12, dh: 2},
		{mshape: []int{2, 2}, names: []string{"cpr", "cpu"}, places: []placement.Placement{B(2), S(2)}, axis: "cpr", inner: "cpu", method: cp.Hybrid, b: 2, h: 2, t: 11, dh: 3},
		{mshape: []int{2, 2}, names: []string{"cp", "tp"}, places: []placement.Placement{B(2), S(1)}, axis: "cp", method: cp.Ring, b: 1, h: 2, t: 16, dh: 2},
		{mshape: []int{2, 2}, names: []string{"dp", "cp"}, places: []placement.Placement{S(0), B(2)}, axis: "cp", method: cp.AllGather, b: 2, h: 2, t: 7, dh: 2},
	}
	cases = withEmu(cases)
	for _, c := range cases {
		t.Run(c.String(), func(t *testing.T) { c.run(t, 1e-12) })
	}
}

// TestUlyssesHeads: heads not divisible by cp are refused before any data
// moves, with an error naming both.
func TestUlyssesHeads(t *testing.T) {
	placementtest.Run(t, []int{2}, []string{"cp"}, func(ctx context.Context, m *mesh.Mesh) error {
		spec, err := placement.NewSpec(m, []int{1, 3, 4, 2}, comm.Float64, []placement.Placement{placement.Shard(2)})
		if err != nil {
			return err
		}
		tp := autograd.NewTape()
		d, err := placement.FromFull(spec, make([]float64, 24))
		if err != nil {
			return err
		}
		q, err := tp.Param("q", d)
		if err != nil {
			return err
		}
		_, err = cp.Attention(ctx, q, q, q, "cp", cp.WithMethod(cp.Ulysses))
		if !errors.Is(err, cp.ErrInvalid) || !contains(err.Error(), "3 local heads", "cp=2") {
			return fmt.Errorf("3 heads over cp=2: %v, want ErrInvalid naming both", err)
		}
		return nil
	})
}

func contains(s string, subs ...string) bool {
	return !slices.ContainsFunc(subs, func(x string) bool { return !stringsContains(s, x) })
}

func stringsContains(s, sub string) bool {
	for i := 0; i+len(sub) <= len(s); i++ {
		if s[i:i+len(sub)] == sub {
			return true
		}
	}
	return false
}
