package autograd

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/placement"
)

// ruleCase is one sharding-rule check: either the result's placements
// (and shape) or an error wrapping want with text in its message.
type ruleCase struct {
	name  string
	rule  func() (*placement.Spec, error)
	out   string // placements of the result, e.g. "[S(0) P(sum)]"
	shape string // global shape of the result, if checked
	err   error
	text  string
}

func checkRules(t *testing.T, cases []ruleCase) {
	t.Helper()
	for _, c := range cases {
		got, err := c.rule()
		if c.err != nil {
			if !errors.Is(err, c.err) || !strings.Contains(err.Error(), c.text) {
				t.Errorf("%s: error %v, want %v containing %q", c.name, err, c.err, c.text)
			}
			continue
		}
		if err != nil {
			t.Errorf("%s: %v", c.name, err)
			continue
		}
		if p := fmt.Sprint(got.Placements()); p != c.out {
			t.Errorf("%s: placements %s, want %s", c.name, p, c.out)
		}
		if c.shape != "" && fmt.Sprint(got.Shape()) != c.shape {
			t.Errorf("%s: shape %v, want %s", c.name, got.Shape(), c.shape)
		}
	}
}

// specs returns a spec builder on a 2x2 ("dp","tp") mesh.
func specs(t *testing.T) func(shape []int, places pl, opts ...placement.SpecOption) *placement.Spec {
	m := rank0Mesh(t, []int{2, 2})
	return func(shape []int, places pl, opts ...placement.SpecOption) *placement.Spec {
		s, err := placement.NewSpec(m, shape, comm.Float32, places, opts...)
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
}

func TestElementwiseRules(t *testing.T) {
	sp := specs(t)
	sh := []int{4, 6}
	a := func(p ...placement.Placement) *placement.Spec { return sp(sh, p) }
	add := func(x, y *placement.Spec) func() (*placement.Spec, error) {
		return func() (*placement.Spec, error) { return AddRule(x, y) }
	}
	mul := func(x, y *placement.Spec) func() (*placement.Spec, error) {
		return func() (*placement.Spec, error) { return MulRule(x, y) }
	}
	scale := func(x *placement.Spec) func() (*placement.Spec, error) {
		return func() (*placement.Spec, error) { return ScaleRule(x) }
	}
	tpdp := sp(sh, pl{S0, S0}, placement.WithOrder(0, "tp", "dp"))
	other := rank0Mesh(t, []int{2, 2})
	onOther, err := placement.NewSpec(other, sh, comm.Float32, pl{R, R})
	if err != nil {
		t.Fatal(err)
	}
	f64, err := placement.NewSpec(a(R, R).Mesh(), sh, comm.Float64, pl{R, R})
	if err != nil {
		t.Fatal(err)
	}
	checkRules(t, []ruleCase{
		{name: "add R R", rule: add(a(R, R), a(R, R)), out: "[R R]"},
		{name: "add S0 S1", rule: add(a(S0, S1), a(S0, S1)), out: "[S(0) S(1)]"},
		{name: "add S1 S0", rule: add(a(S1, S0), a(S1, S0)), out: "[S(1) S(0)]"},
		{name: "add P+P", rule: add(a(Psum, R), a(Psum, R)), out: "[P(sum) R]"},
		{name: "add P+P sharded", rule: add(a(Psum, S1), a(Psum, S1)), out: "[P(sum) S(1)]"},
		{name: "add P+R", rule: add(a(Psum, R), a(R, R)), err: ErrRule, text: `a is P(sum) but b is R on mesh axis "dp": adding a replicated value to a partial one would count it once per rank; redistribute a to R (all-reduce), or b to P(sum) (local, no communication)`},
		{name: "add R+P", rule: add(a(R, R), a(R, Psum)), err: ErrRule, text: `redistribute b to R (all-reduce), or a to P(sum)`},
		{name: "add P+S", rule: add(a(Psum, R), a(S0, R)), err: ErrRule, text: "redistribute a to S(0) (reduce-scatter), or b to P(sum)"},
		{name: "add S0+S1", rule: add(a(S0, R), a(S1, R)), err: ErrRule, text: `a is S(0) but b is S(1) on mesh axis "dp": both inputs need the same placement`},
		{name: "add S+R", rule: add(a(R, S0), a(R, R)), err: ErrRule, text: `on mesh axis "tp"`},
		{name: "add avg", rule: add(a(Pavg, R), a(Pavg, R)), err: ErrRule, text: "a is P(avg) on mesh axis \"dp\": elementwise ops take only Partial(sum)"},
		{name: "add max", rule: add(a(R, R), a(R, Pmax)), err: ErrRule, text: "b is P(max)"},
		{name: "add order", rule: add(tpdp, a(S0, S0)), err: ErrRule, text: "different orders"},
		{name: "add shapes", rule: add(a(R, R), sp([]int{4, 5}, pl{R, R})), err: ErrInvalid, text: "no broadcasting"},
		{name: "add meshes", rule: add(a(R, R), onOther), err: ErrInvalid, text: "different meshes"},
		{name: "add dtypes", rule: add(a(R, R), f64), err: ErrInvalid, text: "dtypes differ"},
		{name: "add nil", rule: add(nil, a(R, R)), err: ErrInvalid, text: "nil"},
		{name: "mul R", rule: mul(a(R, R), a(R, R)), out: "[R R]"},
		{name: "mul S1 S0", rule: mul(a(S1, S0), a(S1, S0)), out: "[S(1) S(0)]"},
		{name: "mul order", rule: mul(tpdp, tpdp), out: "[S(0) S(0)]"},
		{name: "mul P", rule: mul(a(Psum, R), a(Psum, R)), err: ErrRule, text: `a is P(sum) on mesh axis "dp": nonlinear op on a Partial input: redistribute it first`},
		{name: "mul R P", rule: mul(a(R, R), a(R, Psum)), err: ErrRule, text: `b is P(sum) on mesh axis "tp": nonlinear op on a Partial input: redistribute it first`},
		{name: "mul S mismatch", rule: mul(a(S0, R), a(R, R)), err: ErrRule, text: "both inputs need the same placement"},
		{name: "scale R", rule: scale(a(R, R)), out: "[R R]"},
		{name: "scale S", rule: scale(a(S1, S0)), out: "[S(1) S(0)]"},
		{name: "scale P", rule: scale(a(Psum, S0)), out: "[P(sum) S(0)]"},
		{name: "scale avg", rule: scale(a(R, Pavg)), err: ErrRule, text: `the input is P(avg) on mesh axis "tp"`},
		{name: "scale min", rule: scale(a(Pmin, R)), err: ErrRule, text: "P(min)"},
	})
}

func TestSumRule(t *testing.T) {
	sp := specs(t)
	sh := []int{4, 6}
	sum := func(x *placement.Spec, dims ...int) func() (*placement.Spec, error) {
		return func() (*placement.Spec, error) { return SumRule(x, dims...) }
	}
	a := func(p ...placement.Placement) *placement.Spec { return sp(sh, p) }
	checkRules(t, []ruleCase{
		{name: "R dim0", rule: sum(a(R, R), 0), out: "[R R]", shape: "[6]"},
		{name: "S0 dim0", rule: sum(a(S0, R), 0), out: "[P(sum) R]", shape: "[6]"},
		{name: "S0 dim1", rule: sum(a(S0, R), 1), out: "[S(0) R]", shape: "[4]"},
		{name: "S1 dim0", rule: sum(a(S1, R), 0), out: "[S(0) R]", shape: "[6]"},
		{name: "S1 dim1", rule: sum(a(R, S1), 1), out: "[R P(sum)]", shape: "[4]"},
		{name: "S0 S1 dim0", rule: sum(a(S0, S1), 0), out: "[P(sum) S(0)]", shape: "[6]"},
		{name: "S0 S1 all", rule: sum(a(S0, S1)), out: "[P(sum) P(sum)]", shape: "[]"},
		{name: "S0 S1 both dims", rule: sum(a(S0, S1), 1, 0), out: "[P(sum) P(sum)]", shape: "[]"},
		{name: "P", rule: sum(a(Psum, S0), 1), out: "[P(sum) S(0)]", shape: "[4]"},
		{name: "P all", rule: sum(a(Psum, R)), out: "[P(sum) R]", shape: "[]"},
		{name: "avg", rule: sum(a(Pavg, R)), err: ErrRule, text: `the input is P(avg) on mesh axis "dp": a sum is linear only over Partial(sum)`},
		{name: "max", rule: sum(a(R, Pmax), 0), err: ErrRule, text: "P(max)"},
		{name: "dim range", rule: sum(a(R, R), 2), err: ErrInvalid, text: "dim 2 out of range"},
		{name: "dim twice", rule: sum(a(R, R), 1, 1), err: ErrInvalid, text: "dim 1 given twice"},
		{name: "nil", rule: sum(nil), err: ErrInvalid, text: "nil"},
	})
	// Nested shards keep their order on a kept dim.
	s, err := SumRule(sp([]int{4, 6}, pl{S1, S1}, placement.WithOrder(1, "tp", "dp")), 0)
	if err != nil {
		t.Fatal(err)
	}
	if o := s.Order(0); fmt.Sprint(o) != "[tp dp]" {
		t.Errorf("order of the kept dim: %v, want [tp dp]", o)
	}
}

func TestMatMulRule(t *testing.T) {
	sp := specs(t)
	a := func(p ...placement.Placement) *placement.Spec { return sp([]int{4, 6}, p) }
	b := func(p ...placement.Placement) *placement.Spec { return sp([]int{6, 8}, p) }
	mm := func(x, y *placement.Spec) func() (*placement.Spec, error) {
		return func() (*placement.Spec, error) { return MatMulRule(x, y) }
	}
	checkRules(t, []ruleCase{
		{name: "S0 R", rule: mm(a(S0, R), b(R, R)), out: "[S(0) R]", shape: "[4 8]"},
		{name: "R S1", rule: mm(a(R, R), b(R, S1)), out: "[R S(1)]"},
		{name: "S1 S0", rule: mm(a(S1, R), b(S0, R)), out: "[P(sum) R]"},
		{name: "R R", rule: mm(a(R, R), b(R, R)), out: "[R R]"},
		{name: "P R", rule: mm(a(Psum, R), b(R, R)), out: "[P(sum) R]"},
		{name: "R P", rule: mm(a(R, R), b(R, Psum)), out: "[R P(sum)]"},
		{name: "2d dp tp", rule: mm(a(S0, S1), b(R, S0)), out: "[S(0) P(sum)]"},
		{name: "2d S0 S1", rule: mm(a(S0, R), b(R, S1)), out: "[S(0) S(1)]"},
		{name: "2d both contraction", rule: mm(a(S1, S1), b(S0, S0)), out: "[P(sum) P(sum)]"},
		{name: "2d P S1", rule: mm(a(Psum, R), b(R, S1)), out: "[P(sum) S(1)]"},
		{name: "P P", rule: mm(a(Psum, R), b(Psum, R)), err: ErrRule, text: `a and b are both P(sum) on mesh axis "dp": the product of two sums is not the sum of the products`},
		{name: "S0 S0", rule: mm(a(S0, R), b(S0, R)), err: ErrRule, text: `a is S(0) and b is S(0) on mesh axis "dp"; with a S(0), b would need R`},
		{name: "S1 R", rule: mm(a(R, S1), b(R, R)), err: ErrRule, text: `with a S(1), b would need S(0)`},
		{name: "R S0", rule: mm(a(R, R), b(S0, R)), err: ErrRule, text: "with a R, b would need R, S(1) or P(sum)"},
		{name: "P S1", rule: mm(a(Psum, R), b(S1, R)), err: ErrRule, text: "with a P(sum), b would need R"},
		{name: "avg", rule: mm(a(Pavg, R), b(R, R)), err: ErrRule, text: "a is P(avg)"},
		{name: "max b", rule: mm(a(R, R), b(R, Pmax)), err: ErrRule, text: "b is P(max)"},
		{name: "order", rule: mm(sp([]int{4, 6}, pl{S1, S1}, placement.WithOrder(1, "tp", "dp")), b(S0, S0)), err: ErrRule, text: "contraction dim is sharded over mesh axes [tp dp] in a but [dp tp] in b"},
		{name: "inner", rule: mm(a(R, R), sp([]int{5, 8}, pl{R, R})), err: ErrInvalid, text: "inner dims differ"},
		{name: "1-d", rule: mm(sp([]int{6}, pl{R, R}), b(R, R)), err: ErrInvalid, text: "2-d"},
	})
}

func TestRedistributeRule(t *testing.T) {
	sp := specs(t)
	red := func(x, y *placement.Spec) func() (*placement.Spec, error) {
		return func() (*placement.Spec, error) { return RedistributeRule(x, y) }
	}
	checkRules(t, []ruleCase{
		{name: "S0 to R", rule: red(sp([]int{4, 6}, pl{S0, R}), sp([]int{4, 6}, pl{R, R})), out: "[R R]"},
		{name: "P to S", rule: red(sp([]int{4, 6}, pl{Pmax, R}), sp([]int{4, 6}, pl{S1, R})), out: "[S(1) R]"},
		{name: "shape", rule: red(sp([]int{4, 6}, pl{R, R}), sp([]int{4, 5}, pl{R, R})), err: ErrInvalid, text: "global shape"},
		{name: "routed", rule: red(sp([]int{4, 6}, pl{R, R}), sp([]int{4, 6}, pl{placement.Routed(), R})), err: ErrRule, text: "Routed"},
		{name: "nil", rule: red(nil, sp([]int{4, 6}, pl{R, R})), err: ErrInvalid, text: "nil"},
	})
}
