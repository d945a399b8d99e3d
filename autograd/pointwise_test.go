package autograd

import (
	"context"
	"errors"
	"fmt"
	"math"
	"testing"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/kernels"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

var S2 = placement.Shard(2)

func TestGradPointwise(t *testing.T) {
	one := func(f func(*Value) (*Value, error)) func(context.Context, []*Value) (*Value, error) {
		return func(_ context.Context, ps []*Value) (*Value, error) { return f(ps[0]) }
	}
	drop := one(func(x *Value) (*Value, error) { return Dropout(x, 0.4, 7, 3) })
	mean := one(func(x *Value) (*Value, error) { return Mean(x) })
	mean1 := one(func(x *Value) (*Value, error) { return Mean(x, 1) })
	mean02 := one(func(x *Value) (*Value, error) { return Mean(x, 0, 2) })
	mse := binary(MSE)
	sh := [][]int{{5, 4}}
	var cases []fdCase
	for _, f := range []func(*Value) (*Value, error){ReLU, SiLU, Tanh, Sigmoid} {
		cases = append(cases, nnCases([]int{1}, sh, one(f), []pl{{R}})...)
		// 5 rows and 4 columns over 3 ranks: uneven shards.
		cases = append(cases, nnCases([]int{3}, sh, one(f), []pl{{R}}, []pl{{S0}}, []pl{{S1}})...)
		cases = append(cases, nnCases([]int{2, 3}, [][]int{{3, 5, 4}}, one(f), []pl{{S0, S1}}, []pl{{S2, S0}})...)
	}
	cases = append(cases, nnCases([]int{3}, sh, drop, []pl{{R}}, []pl{{S0}}, []pl{{S1}}, []pl{{Psum}})...)
	cases = append(cases, nnCases([]int{2, 3}, [][]int{{3, 5, 4}}, drop, []pl{{S0, S1}}, []pl{{Psum, S2}})...)
	cases = append(cases, nnCases([]int{3}, [][]int{{5, 3, 4}}, mean, []pl{{R}}, []pl{{S0}}, []pl{{Psum}})...)
	cases = append(cases, nnCases([]int{3}, [][]int{{5, 3, 4}}, mean1, []pl{{S0}}, []pl{{S1}})...)
	cases = append(cases, nnCases([]int{2, 3}, [][]int{{5, 3, 4}}, mean02, []pl{{S0, S2}}, []pl{{S1, S0}})...)
	cases = append(cases, fdCase{mesh: []int{3}, shapes: [][]int{{5, 4}, {5, 4}}, places: []pl{{S0}, {S0}}, op: mse},
		fdCase{mesh: []int{2, 3}, shapes: [][]int{{3, 5, 4}, {3, 5, 4}}, places: []pl{{S1, S2}, {S1, S2}}, op: mse},
		fdCase{mesh: []int{1}, shapes: [][]int{{7}, {7}}, places: []pl{{R}, {R}}, op: mse})
	runFD(t, cases)
}

// TestPointwiseParallelEqualsSerial lays one input out several ways on
// meshes of 3 and 2×3 ranks (uneven shards) and checks each op's full
// result against the serial one: the op's formula on the whole tensor
// (float64 to 1e-12), and for Dropout the whole tensor's mask exactly.
func TestPointwiseParallelEqualsSerial(t *testing.T) {
	sig := func(x float64) float64 { return 1 / (1 + math.Exp(-x)) }
	type elem = func(float64) float64
	ops := []struct {
		name string
		f    func(*Value) (*Value, error)
		ref  elem
	}{
		{"ReLU", ReLU, func(x float64) float64 { return math.Max(x, 0) }},
		{"SiLU", SiLU, func(x float64) float64 { return x * sig(x) }},
		{"Tanh", Tanh, math.Tanh},
		{"Sigmoid", Sigmoid, sig},
		{"Dropout", func(x *Value) (*Value, error) { return Dropout(x, 0.5, 11, 2) }, nil},
	}
	shape := []int{5, 7, 3}
	full := placementtest.Random(shape, comm.Float64, 5).([]float64)
	mask := make([]float64, len(full))
	if err := kernels.DropoutMask(mask, []int{0, 0, 0}, shape, shape, 0.5, 11, 2); err != nil {
		t.Fatal(err)
	}
	layouts := []struct {
		mesh   []int
		places pl
	}{
		{[]int{3}, pl{R}}, {[]int{3}, pl{S0}}, {[]int{3}, pl{S1}}, {[]int{3}, pl{S2}},
		{[]int{2, 3}, pl{S0, S1}}, {[]int{2, 3}, pl{S2, S0}}, {[]int{2, 3}, pl{R, S1}},
	}
	for _, l := range layouts {
		t.Run(fmt.Sprintf("mesh%v/%v", l.mesh, l.places), func(t *testing.T) {
			simulate(t, l.mesh, func(ctx context.Context, m *mesh.Mesh) error {
				spec, err := placement.NewSpec(m, shape, comm.Float64, l.places)
				if err != nil {
					return err
				}
				xd, err := placement.FromFull(spec, full)
				if err != nil {
					return err
				}
				for _, o := range ops {
					tp := NewTape()
					x, err := tp.Param("x", xd)
					if err != nil {
						return err
					}
					y, err := o.f(x)
					if err != nil {
						return fmt.Errorf("%s: %w", o.name, err)
					}
					got, err := y.Data().Full(ctx)
					if err != nil {
						return err
					}
					for i, v := range got.([]float64) {
						want := full[i] * mask[i]
						if o.ref != nil {
							want = o.ref(full[i])
						}
						if o.ref == nil && v != want || math.Abs(v-want) > 1e-12 {
							return fmt.Errorf("%s: element %d: %v, serial %v", o.name, i, v, want)
						}
					}
				}
				return checkMeanMSE(ctx, spec, full)
			})
		})
	}
}

// checkMeanMSE compares Mean over dims 0 and 2 of x (laid out by spec,
// whole tensor full [5, 7, 3]) and MSE(x, 2x − 1) with serial sums.
func checkMeanMSE(ctx context.Context, spec *placement.Spec, full []float64) error {
	tp := NewTape()
	xd, err := placement.FromFull(spec, full)
	if err != nil {
		return err
	}
	x, err := tp.Param("x", xd)
	if err != nil {
		return err
	}
	tgt := make([]float64, len(full))
	want := 0.0
	for i, v := range full {
		tgt[i] = 2*v - 1
		want += (v - tgt[i]) * (v - tgt[i]) / float64(len(full))
	}
	td, err := placement.FromFull(spec, tgt)
	if err != nil {
		return err
	}
	tv, err := tp.Constant(td)
	if err != nil {
		return err
	}
	l, err := MSE(x, tv)
	if err != nil {
		return err
	}
	got, err := l.Data().Full(ctx)
	if err != nil {
		return err
	}
	if g := got.([]float64)[0]; math.Abs(g-want) > 1e-12*want {
		return fmt.Errorf("MSE %v, serial %v", g, want)
	}
	mn, err := Mean(x, 0, 2)
	if err != nil {
		return err
	}
	gm, err := mn.Data().Full(ctx)
	if err != nil {
		return err
	}
	for j, g := range gm.([]float64) {
		w := 0.0
		for a := range 5 {
			for c := range 3 {
				w += full[(a*7+j)*3+c] / 15
			}
		}
		if math.Abs(g-w) > 1e-12 {
			return fmt.Errorf("Mean over dims 0, 2: column %d: %v, serial %v", j, g, w)
		}
	}
	return nil
}

func TestPointwiseRejects(t *testing.T) {
	m := rank0Mesh(t, []int{2})
	mk := func(shape []int, p pl) *Value {
		dt, err := random(m, shape, p, 3)
		if err != nil {
			t.Fatal(err)
		}
		v, err := NewTape().Param("v", dt)
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	part, sharded := mk([]int{4, 3}, pl{Psum}), mk([]int{4, 3}, pl{S0})
	lastSharded := mk([]int{4, 3}, pl{S1})
	tp := NewTape()
	a, _ := placementtest.Distribute(sharded.Spec(), placementtest.Random([]int{4, 3}, comm.Float64, 1), 1)
	pa, _ := tp.Param("a", a)
	rowsR, _ := placement.NewSpec(m, []int{4, 3}, comm.Float64, pl{R})
	cr, _ := placementtest.Distribute(rowsR, placementtest.Random([]int{4, 3}, comm.Float64, 2), 2)
	pr, _ := tp.Param("r", cr)
	ix := func(shape []int, p pl) *Indices {
		v, err := IndicesFromFull(m, shape, p, make([]int64, prod(shape)))
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	cases := []struct {
		name string
		f    func() error
		want error
	}{
		{"ReLU nil", func() error { _, err := ReLU(nil); return err }, ErrInvalid},
		{"ReLU partial", func() error { _, err := ReLU(part); return err }, ErrRule},
		{"SiLU partial", func() error { _, err := SiLU(part); return err }, ErrRule},
		{"Tanh partial", func() error { _, err := Tanh(part); return err }, ErrRule},
		{"Sigmoid partial", func() error { _, err := Sigmoid(part); return err }, ErrRule},
		{"Dropout p=1", func() error { _, err := Dropout(sharded, 1, 0, 0); return err }, ErrInvalid},
		{"Dropout p<0", func() error { _, err := Dropout(sharded, -0.5, 0, 0); return err }, ErrInvalid},
		{"Dropout nil", func() error { _, err := Dropout(nil, 0.5, 0, 0); return err }, ErrInvalid},
		{"Mean dim out of range", func() error { _, err := Mean(sharded, 2); return err }, ErrInvalid},
		{"Mean dim twice", func() error { _, err := Mean(sharded, 1, 1); return err }, ErrInvalid},
		{"MSE nil", func() error { _, err := MSE(pa, nil); return err }, ErrInvalid},
		{"MSE other tapes", func() error { _, err := MSE(pa, sharded); return err }, ErrInvalid},
		{"MSE layouts", func() error { _, err := MSE(pa, pr); return err }, ErrRule},
		{"MSE partial", func() error { _, err := MSE(part, part); return err }, ErrRule},
		{"Argmax partial", func() error { _, err := Argmax(part); return err }, ErrRule},
		{"Argmax last dim sharded", func() error { _, err := Argmax(lastSharded); return err }, ErrRule},
		{"Argmax scalar", func() error { _, err := Argmax(mk([]int{}, pl{R})); return err }, ErrInvalid},
		{"Argmax empty row", func() error { _, err := Argmax(mk([]int{3, 0}, pl{R})); return err }, ErrInvalid},
		{"Accuracy nil", func() error { _, err := Accuracy(context.Background(), nil, nil); return err }, ErrInvalid},
		{"Accuracy shapes", func() error {
			_, err := Accuracy(context.Background(), ix([]int{4}, pl{S0}), ix([]int{5}, pl{S0}))
			return err
		}, ErrInvalid},
		{"Accuracy layouts", func() error {
			_, err := Accuracy(context.Background(), ix([]int{4}, pl{S0}), ix([]int{4}, pl{R}))
			return err
		}, ErrInvalid},
		{"Accuracy empty", func() error {
			_, err := Accuracy(context.Background(), ix([]int{0}, pl{R}), ix([]int{0}, pl{R}))
			return err
		}, ErrInvalid},
	}
	for _, c := range cases {
		if err := c.f(); !errors.Is(err, c.want) {
			t.Errorf("%s: %v, want %v", c.name, err, c.want)
		}
	}
	// Nothing was recorded by the rejected MSE calls.
	if n := tp.Len(); n != 0 {
		t.Errorf("rejected ops recorded %d nodes", n)
	}
}

// TestArgmaxAccuracy checks Argmax against a serial scan and Accuracy's
// collective count on meshes with uneven row shards.
func TestArgmaxAccuracy(t *testing.T) {
	shape := []int{7, 5}
	full := placementtest.Random(shape, comm.Float64, 9).([]float64)
	want := make([]int64, 7)
	for r := range want {
		for j := 1; j < 5; j++ {
			if full[r*5+j] > full[r*5+int(want[r])] {
				want[r] = int64(j)
			}
		}
	}
	target := append([]int64(nil), want...)
	target[1], target[4], target[6] = (want[1]+1)%5, (want[4]+2)%5, (want[6]+1)%5
	for _, l := range []struct {
		mesh   []int
		places pl
	}{{[]int{1}, pl{R}}, {[]int{3}, pl{S0}}, {[]int{3}, pl{R}}, {[]int{2, 3}, pl{S0, S0}}, {[]int{2, 3}, pl{R, S0}}} {
		t.Run(fmt.Sprintf("mesh%v/%v", l.mesh, l.places), func(t *testing.T) {
			simulate(t, l.mesh, func(ctx context.Context, m *mesh.Mesh) error {
				spec, err := placement.NewSpec(m, shape, comm.Float64, l.places)
				if err != nil {
					return err
				}
				xd, err := placement.FromFull(spec, full)
				if err != nil {
					return err
				}
				x, err := NewTape().Param("x", xd)
				if err != nil {
					return err
				}
				got, err := Argmax(x)
				if err != nil {
					return err
				}
				wantIx, err := IndicesFromFull(m, []int{7}, l.places, want)
				if err != nil {
					return err
				}
				if fmt.Sprint(got.Local()) != fmt.Sprint(wantIx.Local()) || got.String() != wantIx.String() {
					return fmt.Errorf("argmax %v (%v), want %v (%v)", got.Local(), got, wantIx.Local(), wantIx)
				}
				tg, err := IndicesFromFull(m, []int{7}, l.places, target)
				if err != nil {
					return err
				}
				acc, err := Accuracy(ctx, got, tg)
				if err != nil {
					return err
				}
				if acc != 4.0/7 {
					return fmt.Errorf("accuracy %v, want 4/7", acc)
				}
				return nil
			})
		})
	}
}

// TestPointwiseFloat32 runs each op in float32 and float64 on 3 ranks
// (uneven shards) and checks that results and gradients agree to float32
// precision: the float32 paths call the same kernels instantiated at
// float32.
func TestPointwiseFloat32(t *testing.T) {
	ops := []struct {
		name string
		f    func(*Value) (*Value, error)
	}{
		{"ReLU", ReLU}, {"SiLU", SiLU}, {"Tanh", Tanh}, {"Sigmoid", Sigmoid},
		{"Dropout", func(x *Value) (*Value, error) { return Dropout(x, 0.3, 5, 1) }},
		{"Mean", func(x *Value) (*Value, error) { return Mean(x, 1) }},
	}
	shape := []int{4, 7}
	full := placementtest.Random(shape, comm.Float64, 8).([]float64)
	simulate(t, []int{3}, func(ctx context.Context, m *mesh.Mesh) error {
		for _, o := range ops {
			var outs, grads [2][]float64
			for k, dt := range []comm.DType{comm.Float64, comm.Float32} {
				spec, err := placement.NewSpec(m, shape, dt, pl{S1})
				if err != nil {
					return err
				}
				var data any = full
				if dt == comm.Float32 {
					f32 := make([]float32, len(full))
					for i, v := range full {
						f32[i] = float32(v)
					}
					data = f32
				}
				xd, err := placement.FromFull(spec, data)
				if err != nil {
					return err
				}
				tp := NewTape()
				x, err := tp.Param("x", xd)
				if err != nil {
					return err
				}
				y, err := o.f(x)
				if err != nil {
					return fmt.Errorf("%s %v: %w", o.name, dt, err)
				}
				if outs[k], err = fullData(ctx, y.Data()); err != nil {
					return err
				}
				l, err := probe(ctx, y)
				if err != nil {
					return err
				}
				if err := tp.Backward(ctx, l); err != nil {
					return err
				}
				if grads[k], err = fullData(ctx, x.Grad()); err != nil {
					return err
				}
			}
			for i := range outs[0] {
				if math.Abs(outs[0][i]-outs[1][i]) > 1e-6*math.Max(1, math.Abs(outs[0][i])) {
					return fmt.Errorf("%s: element %d: float32 %v, float64 %v", o.name, i, outs[1][i], outs[0][i])
				}
			}
			for i := range grads[0] {
				if math.Abs(grads[0][i]-grads[1][i]) > 1e-5*math.Max(1, math.Abs(grads[0][i])) {
					return fmt.Errorf("%s: gradient %d: float32 %v, float64 %v", o.name, i, grads[1][i], grads[0][i])
				}
			}
		}
		return nil
	})
}
