package autograd

import (
	"context"
	"testing"

	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
)

func TestGradNarrowConcat(t *testing.T) {
	S2 := placement.Shard(2)
	split := func(_ context.Context, ps []*Value) (*Value, error) {
		parts, err := SplitLast(ps[0], 3)
		if err != nil {
			return nil, err
		}
		// Use the parts unevenly so that each gets its own gradient.
		a, err := Mul(parts[0], parts[2])
		if err != nil {
			return nil, err
		}
		return Concat(-1, a, parts[1], parts[0])
	}
	cat := func(_ context.Context, ps []*Value) (*Value, error) { return Concat(1, ps[0], ps[1]) }
	var cases []fdCase
	cases = append(cases, nnCases([]int{2}, [][]int{{2, 3, 6}}, split, []pl{{R}}, []pl{{S0}}, []pl{{S1}})...)
	cases = append(cases, nnCases([]int{4}, [][]int{{4, 3, 6}}, split, []pl{{S0}})...)
	cases = append(cases, nnCases([]int{2, 2}, [][]int{{2, 3, 6}}, split, []pl{{S0, S1}})...)
	cases = append(cases, nnCases([]int{2}, [][]int{{3, 2, 4}, {3, 1, 4}}, cat, []pl{{S0}, {S0}}, []pl{{S2}, {S2}}, []pl{{Psum}, {Psum}})...)
	cases = append(cases, nnCases([]int{2, 2}, [][]int{{3, 2, 4}, {3, 1, 4}}, cat, []pl{{S0, S2}, {S0, S2}})...)
	runFD(t, cases)
}

func TestGradBatchedMatMul(t *testing.T) {
	op := binary(BatchedMatMul)
	S2 := placement.Shard(2)
	a, b := []int{2, 3, 4}, []int{2, 4, 5}
	var cases []fdCase
	cases = append(cases, pairs([]int{2}, a, b, op,
		[2]pl{{S0}, {S0}}, [2]pl{{S1}, {R}}, [2]pl{{R}, {S2}}, [2]pl{{S2}, {S1}}, [2]pl{{R}, {R}}, [2]pl{{Psum}, {R}}, [2]pl{{R}, {Psum}})...)
	cases = append(cases, pairs([]int{4}, a, b, op, [2]pl{{S2}, {S1}}, [2]pl{{S1}, {R}})...)
	cases = append(cases, pairs([]int{2, 2}, a, b, op, [2]pl{{S0, S2}, {S0, S1}}, [2]pl{{S0, R}, {S0, S2}})...)
	runFD(t, cases)
}

func TestGradCausalAttention(t *testing.T) {
	sm := func(_ context.Context, ps []*Value) (*Value, error) { return CausalSoftmax(ps[0]) }
	att := func(_ context.Context, ps []*Value) (*Value, error) { return CausalAttention(ps[0], ps[1], ps[2]) }
	var cases []fdCase
	cases = append(cases, nnCases([]int{2}, [][]int{{2, 4, 4}}, sm, []pl{{R}}, []pl{{S0}})...)
	qkv := [][]int{{2, 2, 4, 3}, {2, 2, 4, 3}, {2, 2, 4, 3}}
	cases = append(cases, nnCases([]int{2}, qkv, att, []pl{{R}, {R}, {R}}, []pl{{S1}, {S1}, {S1}})...)
	cases = append(cases, nnCases([]int{2, 2}, qkv, att, []pl{{S0, S1}, {S0, S1}, {S0, S1}})...)
	runFD(t, cases)
	// Masked entries are exactly 0 and rows sum to 1.
	simulate(t, []int{2}, func(ctx context.Context, m *mesh.Mesh) error {
		x, err := random(m, []int{3, 3}, pl{R}, 5)
		if err != nil {
			return err
		}
		tp := NewTape()
		v, _ := tp.Param("x", x)
		y, err := CausalSoftmax(v)
		if err != nil {
			return err
		}
		d := y.Data().LocalData().([]float64)
		for i := range 3 {
			s := 0.0
			for j := range 3 {
				if j > i && d[i*3+j] != 0 {
					t.Errorf("masked entry (%d, %d) = %v", i, j, d[i*3+j])
				}
				s += d[i*3+j]
			}
			if s < 1-1e-12 || s > 1+1e-12 {
				t.Errorf("row %d sums to %v", i, s)
			}
		}
		return nil
	})
}

func TestAttnRules(t *testing.T) {
	sp := specs(t)
	S2 := placement.Shard(2)
	x := func(p ...placement.Placement) *placement.Spec { return sp([]int{2, 4, 6}, p) }
	narrow := func(s *placement.Spec, d, st, n int) func() (*placement.Spec, error) {
		return func() (*placement.Spec, error) { return NarrowRule(s, d, st, n) }
	}
	cat := func(d int, xs ...*placement.Spec) func() (*placement.Spec, error) {
		return func() (*placement.Spec, error) { return ConcatRule(d, xs...) }
	}
	bmm := func(a, b *placement.Spec) func() (*placement.Spec, error) {
		return func() (*placement.Spec, error) { return BatchedMatMulRule(a, b) }
	}
	a := func(p ...placement.Placement) *placement.Spec { return sp([]int{2, 4, 6}, p) }
	b := func(p ...placement.Placement) *placement.Spec { return sp([]int{2, 6, 8}, p) }
	cs := func(s *placement.Spec) func() (*placement.Spec, error) {
		return func() (*placement.Spec, error) { return CausalSoftmaxRule(s) }
	}
	checkRules(t, []ruleCase{
		{name: "narrow", rule: narrow(x(S0, S1), -1, 2, 2), out: "[S(0) S(1)]", shape: "[2 4 2]"},
		{name: "narrow partial", rule: narrow(x(Psum, R), 2, 0, 6), out: "[P(sum) R]"},
		{name: "narrow sharded", rule: narrow(x(R, S2), 2, 0, 3), err: ErrRule, text: "narrow over a sharded dim: x is sharded on dim 2 by mesh axes [tp]"},
		{name: "narrow range", rule: narrow(x(R, R), 2, 4, 3), err: ErrInvalid, text: "range [4, 7) does not fit dim 2 of size 6"},
		{name: "concat", rule: cat(2, x(S0, R), x(S0, R)), out: "[S(0) R]", shape: "[2 4 12]"},
		{name: "concat sharded", rule: cat(0, x(S0, R), x(S0, R)), err: ErrRule, text: "concat along a sharded dim"},
		{name: "concat mismatch", rule: cat(2, x(S0, R), x(R, R)), err: ErrRule, text: `input 0 is S(0) but input 1 is R on mesh axis "dp"`},
		{name: "concat shapes", rule: cat(2, x(R, R), sp([]int{2, 3, 6}, pl{R, R})), err: ErrInvalid, text: "may differ only along dim 2"},
		{name: "bmm batch", rule: bmm(a(S0, R), b(S0, R)), out: "[S(0) R]", shape: "[2 4 8]"},
		{name: "bmm rows cols", rule: bmm(a(S1, R), b(R, S2)), out: "[S(1) S(2)]"},
		{name: "bmm inner", rule: bmm(a(S2, S0), b(S1, S0)), out: "[P(sum) S(0)]"},
		{name: "bmm partial", rule: bmm(a(Psum, R), b(R, R)), out: "[P(sum) R]"},
		{name: "bmm batch mismatch", rule: bmm(a(S0, R), b(R, R)), err: ErrRule, text: `a is S(0) and b is R on mesh axis "dp"; valid pairs per axis`},
		{name: "bmm both partial", rule: bmm(a(Psum, R), b(Psum, R)), err: ErrRule, text: "the product of two sums"},
		{name: "bmm shapes", rule: bmm(a(R, R), sp([]int{3, 6, 8}, pl{R, R})), err: ErrInvalid, text: "equal batch dims"},
		{name: "causal", rule: cs(sp([]int{2, 4, 4}, pl{S0, R})), out: "[S(0) R]"},
		{name: "causal rows", rule: cs(sp([]int{2, 4, 4}, pl{S1, R})), err: ErrRule, text: "softmax over a sharded dim: x is sharded on dim 1"},
		{name: "causal partial", rule: cs(sp([]int{2, 4, 4}, pl{Psum, R})), err: ErrRule, text: "CausalSoftmax is nonlinear"},
		{name: "causal shape", rule: cs(sp([]int{2, 4, 3}, pl{R, R})), err: ErrInvalid, text: "[..., T, T]"},
	})
}
