package autograd

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/b7ea7098/loom/placement"
)

func TestLinearRule(t *testing.T) {
	sp := specs(t)
	S2 := placement.Shard(2)
	x := func(p ...placement.Placement) *placement.Spec { return sp([]int{2, 4, 6}, p) }
	w := func(p ...placement.Placement) *placement.Spec { return sp([]int{8, 6}, p) }
	b := func(p ...placement.Placement) *placement.Spec { return sp([]int{8}, p) }
	lin := func(x, w, b *placement.Spec) func() (*placement.Spec, error) {
		return func() (*placement.Spec, error) { return LinearRule(x, w, b) }
	}
	checkRules(t, []ruleCase{
		{name: "R", rule: lin(x(R, R), w(R, R), b(R, R)), out: "[R R]", shape: "[2 4 8]"},
		{name: "no bias", rule: lin(x(R, R), w(R, R), nil), out: "[R R]"},
		{name: "dp", rule: lin(x(S0, R), w(R, R), b(R, R)), out: "[S(0) R]"},
		{name: "dp dim1", rule: lin(x(S1, R), w(R, R), b(R, R)), out: "[S(1) R]"},
		{name: "colwise", rule: lin(x(S0, R), w(R, S0), b(R, S0)), out: "[S(0) S(2)]"},
		{name: "rowwise", rule: lin(x(S0, S2), w(R, S1), b(R, R)), out: "[S(0) P(sum)]"},
		{name: "rowwise both", rule: lin(x(S2, S2), w(S1, S1), b(R, R)), out: "[P(sum) P(sum)]"},
		{name: "partial x", rule: lin(x(Psum, R), w(R, S0), b(R, S0)), out: "[P(sum) S(2)]"},
		{name: "colwise bias R", rule: lin(x(R, R), w(R, S0), b(R, R)), err: ErrRule, text: `b is R on mesh axis "tp" but must be S(0): w is S(0) (colwise) there`},
		{name: "rowwise bias S", rule: lin(x(R, S2), w(R, S1), b(R, S0)), err: ErrRule, text: `b is S(0) on mesh axis "tp" but must be R`},
		{name: "rowwise x R", rule: lin(x(R, R), w(R, S1), nil), err: ErrRule, text: `w is S(1) (rowwise) on mesh axis "tp", so x must be S(2) (its last dim) there, but it is R`},
		{name: "x last w R", rule: lin(x(R, S2), w(R, R), nil), err: ErrRule, text: `x is sharded on its last dim (S(2)) on mesh axis "tp", so w must be S(1) (rowwise) there, but it is R`},
		{name: "colwise x sharded", rule: lin(x(S0, R), w(S0, R), nil), err: ErrRule, text: `w is S(0) (colwise) on mesh axis "dp", so x must be R there, but it is S(0)`},
		{name: "w partial", rule: lin(x(R, R), w(Psum, R), nil), err: ErrRule, text: `w is P(sum) on mesh axis "dp": redistribute the weight`},
		{name: "b partial", rule: lin(x(R, R), w(R, R), b(R, Psum)), err: ErrRule, text: `b is P(sum) on mesh axis "tp"`},
		{name: "x avg", rule: lin(x(Pavg, R), w(R, R), nil), err: ErrRule, text: `x is P(avg)`},
		{name: "partial x w sharded", rule: lin(x(Psum, R), w(S1, R), nil), err: ErrRule, text: `so x must be S(2)`},
		{name: "order", rule: lin(sp([]int{2, 4, 6}, pl{S2, S2}, placement.WithOrder(2, "tp", "dp")), w(S1, S1), nil), err: ErrRule, text: "contraction dim is sharded over mesh axes [tp dp] in x (last dim) but [dp tp] in w"},
		{name: "in mismatch", rule: lin(x(R, R), sp([]int{8, 5}, pl{R, R}), nil), err: ErrInvalid, text: "has 6 input features but w [8 5]"},
		{name: "bias shape", rule: lin(x(R, R), w(R, R), sp([]int{6}, pl{R, R})), err: ErrInvalid, text: "want [8]"},
		{name: "w 1-d", rule: lin(x(R, R), sp([]int{6}, pl{R, R}), nil), err: ErrInvalid, text: "w [out, in]"},
		{name: "nil", rule: lin(nil, w(R, R), nil), err: ErrInvalid, text: "nil"},
	})
}

func TestShapeRules(t *testing.T) {
	sp := specs(t)
	x := func(p ...placement.Placement) *placement.Spec { return sp([]int{4, 6, 2}, p) }
	S2 := placement.Shard(2)
	perm := func(s *placement.Spec, p ...int) func() (*placement.Spec, error) {
		return func() (*placement.Spec, error) { return PermuteRule(s, p...) }
	}
	tr := func(s *placement.Spec, a, b int) func() (*placement.Spec, error) {
		return func() (*placement.Spec, error) { return TransposeRule(s, a, b) }
	}
	rs := func(s *placement.Spec, shape ...int) func() (*placement.Spec, error) {
		return func() (*placement.Spec, error) { return ReshapeRule(s, shape...) }
	}
	checkRules(t, []ruleCase{
		{name: "perm", rule: perm(x(S0, S2), 2, 0, 1), out: "[S(1) S(0)]", shape: "[2 4 6]"},
		{name: "perm partial", rule: perm(x(Psum, S1), 1, 0, 2), out: "[P(sum) S(0)]"},
		{name: "perm bad", rule: perm(x(R, R), 0, 0, 1), err: ErrInvalid, text: "not a permutation"},
		{name: "perm len", rule: perm(x(R, R), 0, 1), err: ErrInvalid, text: "2 entries for a 3-d tensor"},
		{name: "transpose", rule: tr(x(S1, R), -1, 1), out: "[S(2) R]", shape: "[4 2 6]"},
		{name: "transpose range", rule: tr(x(R, R), 0, 3), err: ErrInvalid, text: "dim 3 out of range"},
		{name: "split leading", rule: rs(sp([]int{8, 6}, pl{S0, R}), 2, 4, 6), out: "[S(0) R]", shape: "[2 4 6]"},
		{name: "merge leading", rule: rs(x(S0, R), 24, 2), out: "[S(0) R]", shape: "[24 2]"},
		{name: "keep trailing", rule: rs(x(R, S2), 24, 2), out: "[R S(1)]"},
		{name: "infer", rule: rs(x(R, S2), -1, 2), out: "[R S(1)]", shape: "[24 2]"},
		{name: "unit dims", rule: rs(x(S0, R), 1, 4, 12, 1), out: "[S(1) R]", shape: "[1 4 12 1]"},
		{name: "heads split", rule: rs(x(S0, S1), 4, 6, 2), out: "[S(0) S(1)]"},
		{name: "split last sharded", rule: rs(x(R, S1), 4, 2, 3, 2), out: "[R S(1)]", shape: "[4 2 3 2]"},
		{name: "partial", rule: rs(x(Psum, R), 48), out: "[P(sum) R]"},
		{name: "inner merge", rule: rs(x(R, S1), 24, 2), err: ErrRule, text: "dim 1 of [4 6 2] is sharded but merges with the outer dim 0 (size 4)"},
		{name: "two sharded", rule: rs(x(S0, S1), 24, 2), err: ErrRule, text: "dims 0 and 1 of [4 6 2] are both sharded"},
		{name: "uneven", rule: rs(sp([]int{6, 2}, pl{S0, S0}), 3, 4), err: ErrRule, text: "compatible only when both sizes are divisible by 4"},
		{name: "uneven split", rule: rs(sp([]int{6, 2}, pl{S0, R}), 3, 2, 2), err: ErrRule, text: "dim 0 of [6 2] (size 6) is sharded 2 ways"},
		{name: "count", rule: rs(x(R, R), 5, 5), err: ErrInvalid, text: "cannot reshape"},
		{name: "bad dim", rule: rs(x(R, R), 0, 48), err: ErrInvalid, text: "must be positive"},
	})
}

func TestNonlinearRules(t *testing.T) {
	sp := specs(t)
	x := func(p ...placement.Placement) *placement.Spec { return sp([]int{4, 6}, p) }
	v := func(p ...placement.Placement) *placement.Spec { return sp([]int{6}, p) }
	gelu := func(s *placement.Spec) func() (*placement.Spec, error) {
		return func() (*placement.Spec, error) { return GELURule(s) }
	}
	sm := func(s *placement.Spec, d int) func() (*placement.Spec, error) {
		return func() (*placement.Spec, error) { return SoftmaxRule(s, d) }
	}
	lsm := func(s *placement.Spec, d int) func() (*placement.Spec, error) {
		return func() (*placement.Spec, error) { return LogSoftmaxRule(s, d) }
	}
	ln := func(s, w, b *placement.Spec) func() (*placement.Spec, error) {
		return func() (*placement.Spec, error) { return LayerNormRule(s, w, b) }
	}
	checkRules(t, []ruleCase{
		{name: "gelu", rule: gelu(x(S0, S1)), out: "[S(0) S(1)]"},
		{name: "gelu partial", rule: gelu(x(R, Psum)), err: ErrRule, text: `x is P(sum) on mesh axis "tp": GELU is nonlinear`},
		{name: "softmax", rule: sm(x(S0, R), -1), out: "[S(0) R]"},
		{name: "softmax sharded", rule: sm(x(S0, S1), 1), err: ErrRule, text: "softmax over a sharded dim: x is sharded on dim 1 by mesh axes [tp]"},
		{name: "softmax partial", rule: sm(x(Psum, R), 1), err: ErrRule, text: "Softmax is nonlinear"},
		{name: "softmax range", rule: sm(x(R, R), 2), err: ErrInvalid, text: "out of range"},
		{name: "logsoftmax", rule: lsm(x(R, S0), 1), out: "[R S(0)]"},
		{name: "logsoftmax sharded", rule: lsm(x(S0, R), 0), err: ErrRule, text: "softmax over a sharded dim"},
		{name: "ln", rule: ln(x(S0, S0), v(R, R), v(R, R)), out: "[S(0) S(0)]"},
		{name: "ln sharded", rule: ln(x(S1, R), v(R, R), v(R, R)), err: ErrRule, text: "layer norm over a sharded dim"},
		{name: "ln partial", rule: ln(x(Psum, R), v(R, R), v(R, R)), err: ErrRule, text: "LayerNorm is nonlinear"},
		{name: "ln w sharded", rule: ln(x(R, R), v(S0, R), v(R, R)), err: ErrRule, text: `w is S(0) on mesh axis "dp"; it must be R on every axis`},
		{name: "ln b partial", rule: ln(x(R, R), v(R, R), v(R, Psum)), err: ErrRule, text: `b is P(sum)`},
		{name: "ln shape", rule: ln(x(R, R), sp([]int{4}, pl{R, R}), v(R, R)), err: ErrInvalid, text: "must both have shape [6]"},
	})
}

func TestIndexRules(t *testing.T) {
	sp := specs(t)
	m := sp([]int{1}, pl{R, R}).Mesh()
	ids := func(shape []int, p ...placement.Placement) *Indices {
		ix, err := IndicesFromFull(m, shape, p, make([]int64, prod(shape)))
		if err != nil {
			t.Fatal(err)
		}
		return ix
	}
	emb := func(tab *placement.Spec, ix *Indices) func() (*placement.Spec, error) {
		return func() (*placement.Spec, error) { return EmbeddingRule(tab, ix) }
	}
	ce := func(l *placement.Spec, ix *Indices) func() (*placement.Spec, error) {
		return func() (*placement.Spec, error) { return CrossEntropyRule(l, ix) }
	}
	tab := func(p ...placement.Placement) *placement.Spec { return sp([]int{10, 3}, p) }
	lg := func(p ...placement.Placement) *placement.Spec { return sp([]int{8, 10}, p) }
	checkRules(t, []ruleCase{
		{name: "emb R", rule: emb(tab(R, R), ids([]int{2, 4}, R, R)), out: "[R R]", shape: "[2 4 3]"},
		{name: "emb sharded ids", rule: emb(tab(R, R), ids([]int{2, 4}, S0, S1)), out: "[S(0) S(1)]"},
		{name: "emb vocab", rule: emb(tab(R, S0), ids([]int{2, 4}, S0, R)), out: "[S(0) P(sum)]", shape: "[2 4 3]"},
		{name: "emb vocab both", rule: emb(tab(S0, S0), ids([]int{2, 4}, R, R)), out: "[P(sum) P(sum)]"},
		{name: "emb dim", rule: emb(tab(R, S1), ids([]int{2, 4}, S1, R)), out: "[S(1) S(2)]", shape: "[2 4 3]"},
		{name: "emb vocab dim", rule: emb(tab(S0, S1), ids([]int{5}, R, R)), out: "[P(sum) S(1)]", shape: "[5 3]"},
		{name: "emb dim both", rule: emb(tab(S1, S1), ids([]int{5}, R, R)), out: "[S(1) S(1)]"},
		{name: "emb same axis", rule: emb(tab(R, S0), ids([]int{2, 4}, R, S1)), err: ErrRule, text: `the table is S(0) and the ids are S(1) on mesh axis "tp": ids sharded on the same axis as the table; make the ids R there`},
		{name: "emb dim same axis", rule: emb(tab(S1, R), ids([]int{2, 4}, S0, R)), err: ErrRule, text: `the table is S(1) and the ids are S(0) on mesh axis "dp": ids sharded on the same axis as the table`},
		{name: "emb partial", rule: emb(tab(R, Psum), ids([]int{2, 4}, R, R)), err: ErrRule, text: `the table is P(sum) on mesh axis "tp"; it must be R, S(0) (vocab parallel) or S(1) (embedding dim sharded) there`},
		{name: "emb 1-d", rule: emb(sp([]int{10}, pl{R, R}), ids([]int{2}, R, R)), err: ErrInvalid, text: "[V, D]"},
		{name: "ce R", rule: ce(lg(R, R), ids([]int{8}, R, R)), out: "[R R]", shape: "[]"},
		{name: "ce rows", rule: ce(lg(S0, R), ids([]int{8}, S0, R)), out: "[P(sum) R]"},
		{name: "ce rows both", rule: ce(lg(S0, S0), ids([]int{8}, S0, S0)), out: "[P(sum) P(sum)]"},
		{name: "ce vocab", rule: ce(lg(R, S1), ids([]int{8}, R, R)), err: ErrRule, text: "cross entropy over a sharded vocab dim"},
		{name: "ce partial", rule: ce(lg(Psum, R), ids([]int{8}, R, R)), err: ErrRule, text: "CrossEntropy is nonlinear"},
		{name: "ce mismatch", rule: ce(lg(S0, R), ids([]int{8}, R, R)), err: ErrRule, text: `the logits are S(0) but the targets are R on mesh axis "dp"`},
		{name: "ce shape", rule: ce(lg(R, R), ids([]int{7}, R, R)), err: ErrInvalid, text: "want logits [N, V] and targets [N]"},
	})
	if _, err := NewIndices(m, []int{4}, pl{Psum, R}, nil); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "Replicate or Shard only") {
		t.Errorf("partial indices: %v", err)
	}
	if _, err := NewIndices(m, []int{4}, pl{S0, R}, []int64{1}); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "gives this rank [2]") {
		t.Errorf("wrong local block: %v", err)
	}
	ix := ids([]int{5}, S0, R)
	if got := fmt.Sprint(ix.LocalShape()); got != "[3]" {
		t.Errorf("local shape %s", got)
	}
}
