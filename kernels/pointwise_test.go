package kernels

import (
	"errors"
	"math"
	"testing"
)

// pwInput is n values spread over [-6, 6] with a few exact zeros.
func pwInput(n int) []float64 {
	x := make([]float64, n)
	for i := range x {
		x[i] = 12*float64((i*7919)%97)/96 - 6
		if i%11 == 5 {
			x[i] = 0
		}
	}
	return x
}

func TestPointwiseAgainstReference(t *testing.T) {
	sig := func(x float64) float64 { return 1 / (1 + math.Exp(-x)) }
	cases := []struct {
		name    string
		fwd     func(dst, x []float64) error
		bwd     func(dx, saved, dy []float64) error
		saveOut bool
		f, df   func(x float64) float64
	}{
		{"relu", ReLU[float64], ReLUBackward[float64], false,
			func(x float64) float64 { return math.Max(x, 0) },
			func(x float64) float64 {
				if x > 0 {
					return 1
				}
				return 0
			}},
		{"silu", SiLU[float64], SiLUBackward[float64], false,
			func(x float64) float64 { return x * sig(x) },
			func(x float64) float64 { return sig(x) + x*sig(x)*(1-sig(x)) }},
		{"tanh", Tanh[float64], TanhBackward[float64], true, math.Tanh,
			func(x float64) float64 { c := math.Cosh(x); return 1 / (c * c) }},
		{"sigmoid", Sigmoid[float64], SigmoidBackward[float64], true, sig,
			func(x float64) float64 { return sig(x) * (1 - sig(x)) }},
	}
	for _, c := range cases {
		for _, n := range []int{0, 1, 3, 17, 33} {
			x := pwInput(n)
			y := make([]float64, n)
			if err := c.fwd(y, x); err != nil {
				t.Fatalf("%s n=%d: %v", c.name, n, err)
			}
			dy, dx := pwInput(n), make([]float64, n)
			for i := range dy {
				dy[i] = 0.5 + dy[i]/7
			}
			saved := x
			if c.saveOut {
				saved = y
			}
			if err := c.bwd(dx, saved, dy); err != nil {
				t.Fatalf("%s backward n=%d: %v", c.name, n, err)
			}
			for i := range x {
				if w := c.f(x[i]); math.Abs(y[i]-w) > 1e-12*math.Max(1, math.Abs(w)) {
					t.Errorf("%s(%v) = %v, want %v", c.name, x[i], y[i], w)
				}
				if w := dy[i] * c.df(x[i]); math.Abs(dx[i]-w) > 1e-12*math.Max(1, math.Abs(w)) {
					t.Errorf("%s'(%v)·%v = %v, want %v", c.name, x[i], dy[i], dx[i], w)
				}
			}
		}
		if err := c.fwd(make([]float64, 2), make([]float64, 3)); !errors.Is(err, ErrInvalid) {
			t.Errorf("%s: lengths 2 and 3: %v, want ErrInvalid", c.name, err)
		}
		if err := c.bwd(make([]float64, 3), make([]float64, 3), make([]float64, 2)); !errors.Is(err, ErrInvalid) {
			t.Errorf("%s backward: lengths 3, 3 and 2: %v, want ErrInvalid", c.name, err)
		}
	}
	// float32 gets the float64 result rounded.
	x := []float32{-3.5, -0.25, 0, 0.75, 9}
	y := make([]float32, len(x))
	if err := SiLU(y, x); err != nil {
		t.Fatal(err)
	}
	for i, v := range x {
		f := float64(v)
		if w := float32(f * sig(f)); y[i] != w {
			t.Errorf("float32 SiLU(%v) = %v, want %v", v, y[i], w)
		}
	}
}

// TestDropoutMaskBlocks checks that a block's mask is the matching slice
// of the whole tensor's, for blocks of odd shapes and offsets, that the
// kept fraction is near 1−p, and that seed and step change the mask.
func TestDropoutMaskBlocks(t *testing.T) {
	global := []int{5, 7, 3}
	const p = 0.3
	full := make([]float64, 5*7*3)
	if err := DropoutMask(full, []int{0, 0, 0}, global, global, p, 42, 9); err != nil {
		t.Fatal(err)
	}
	kept := 0
	for _, v := range full {
		switch v {
		case 0:
		case 1 / (1 - p):
			kept++
		default:
			t.Fatalf("mask value %v", v)
		}
	}
	if f := float64(kept) / float64(len(full)); math.Abs(f-(1-p)) > 0.12 {
		t.Errorf("kept %d of %d (%.2f), want about %.2f", kept, len(full), f, 1-p)
	}
	for _, b := range []struct{ off, box []int }{
		{[]int{1, 2, 0}, []int{3, 4, 3}},
		{[]int{4, 0, 2}, []int{1, 7, 1}},
		{[]int{0, 6, 1}, []int{5, 1, 2}},
		{[]int{2, 3, 1}, []int{0, 2, 2}},
	} {
		n := b.box[0] * b.box[1] * b.box[2]
		m := make([]float32, n)
		if err := DropoutMask(m, b.off, b.box, global, p, 42, 9); err != nil {
			t.Fatal(err)
		}
		i := 0
		for a := range b.box[0] {
			for c := range b.box[1] {
				for d := range b.box[2] {
					w := full[((b.off[0]+a)*7+b.off[1]+c)*3+b.off[2]+d]
					if float64(m[i]) != float64(float32(w)) {
						t.Fatalf("block at %v: element %d is %v, whole mask has %v", b.off, i, m[i], w)
					}
					i++
				}
			}
		}
	}
	for _, k := range [][2]uint64{{43, 9}, {42, 10}} {
		other := make([]float64, len(full))
		if err := DropoutMask(other, []int{0, 0, 0}, global, global, p, k[0], k[1]); err != nil {
			t.Fatal(err)
		}
		same := true
		for i := range full {
			same = same && full[i] == other[i]
		}
		if same {
			t.Errorf("seed %d step %d draws the same mask as seed 42 step 9", k[0], k[1])
		}
	}
	bad := []struct {
		name          string
		n             int
		off, box, glb []int
		p             float64
	}{
		{"p=1", 6, []int{0}, []int{6}, []int{6}, 1},
		{"p<0", 6, []int{0}, []int{6}, []int{6}, -0.1},
		{"p NaN", 6, []int{0}, []int{6}, []int{6}, math.NaN()},
		{"outside", 4, []int{3}, []int{4}, []int{6}, 0.5},
		{"rank", 6, []int{0, 0}, []int{6}, []int{6}, 0.5},
		{"length", 5, []int{0}, []int{6}, []int{6}, 0.5},
		{"negative", 0, []int{0}, []int{-1}, []int{6}, 0.5},
	}
	for _, c := range bad {
		m := make([]float64, c.n)
		for i := range m {
			m[i] = 7
		}
		err := DropoutMask(m, c.off, c.box, c.glb, c.p, 1, 1)
		if !errors.Is(err, ErrInvalid) {
			t.Errorf("%s: %v, want ErrInvalid", c.name, err)
		}
		for _, v := range m {
			if v != 7 {
				t.Errorf("%s: wrote before rejecting", c.name)
				break
			}
		}
	}
}

func TestArgmaxRows(t *testing.T) {
	nan := math.NaN()
	cases := []struct {
		name string
		x    []float64
		n    int
		want []int64
	}{
		{"one column", []float64{3, -1, 2}, 1, []int64{0, 0, 0}},
		{"ties first", []float64{1, 5, 5, 0, 2, 2, 2, 2}, 4, []int64{1, 0}},
		{"odd width", []float64{-1, -3, -0.5, 7, 1, 2, 9, 3, 0, 0, 1, -9, -8, -7, 6}, 5, []int64{3, 1, 4}},
		{"nan wins", []float64{1, nan, 9, nan, 2, 3}, 3, []int64{1, 0}},
		{"no rows", nil, 3, []int64{}},
	}
	for _, c := range cases {
		got := make([]int64, len(c.want))
		if err := ArgmaxRows(got, c.x, c.n); err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		for i := range got {
			if got[i] != c.want[i] {
				t.Errorf("%s: row %d: %d, want %d", c.name, i, got[i], c.want[i])
			}
		}
	}
	if err := ArgmaxRows(make([]int64, 2), make([]float32, 5), 3); !errors.Is(err, ErrInvalid) {
		t.Errorf("5 values for 2 rows of 3: %v, want ErrInvalid", err)
	}
	if err := ArgmaxRows(make([]int64, 0), make([]float32, 0), 0); !errors.Is(err, ErrInvalid) {
		t.Errorf("width 0: %v, want ErrInvalid", err)
	}
}
