package kernels

import (
	"errors"
	"math"
	"math/rand/v2"
	"slices"
	"testing"
)

// refBlockAttention is causal attention over whole sequences in float64 by the
// textbook formulas: out = softmax(scale·q·kᵀ + mask)·v and its gradients
// for the output gradient g.
func refBlockAttention(q, k, v, g []float64, batch, t, dh, dv int, scale float64) (out, dq, dk, dvv []float64) {
	out = make([]float64, batch*t*dv)
	dq = make([]float64, batch*t*dh)
	dk = make([]float64, batch*t*dh)
	dvv = make([]float64, batch*t*dv)
	for b := range batch {
		p := make([]float64, t*t)
		for i := range t {
			m := math.Inf(-1)
			for j := 0; j <= i; j++ {
				s := 0.0
				for c := range dh {
					s += q[(b*t+i)*dh+c] * k[(b*t+j)*dh+c]
				}
				p[i*t+j] = s * scale
				m = max(m, p[i*t+j])
			}
			sum := 0.0
			for j := 0; j <= i; j++ {
				p[i*t+j] = math.Exp(p[i*t+j] - m)
				sum += p[i*t+j]
			}
			for j := 0; j <= i; j++ {
				p[i*t+j] /= sum
				for c := range dv {
					out[(b*t+i)*dv+c] += p[i*t+j] * v[(b*t+j)*dv+c]
				}
			}
		}
		for i := range t {
			dp := make([]float64, t)
			rs := 0.0
			for j := 0; j <= i; j++ {
				for c := range dv {
					dp[j] += g[(b*t+i)*dv+c] * v[(b*t+j)*dv+c]
					dvv[(b*t+j)*dv+c] += p[i*t+j] * g[(b*t+i)*dv+c]
				}
				rs += p[i*t+j] * dp[j]
			}
			for j := 0; j <= i; j++ {
				ds := p[i*t+j] * (dp[j] - rs) * scale
				for c := range dh {
					dq[(b*t+i)*dh+c] += ds * k[(b*t+j)*dh+c]
					dk[(b*t+j)*dh+c] += ds * q[(b*t+i)*dh+c]
				}
			}
		}
	}
	return out, dq, dk, dvv
}

func randBlock(r *rand.Rand, n int) []float64 {
	s := make([]float64, n)
	for i := range s {
		s[i] = r.NormFloat64()
	}
	return s
}

// rows returns rows lo..hi−1 of each of batch blocks of t rows of w.
func rowsOf(x []float64, batch, t, w, lo, hi int) []float64 {
	var out []float64
	for b := range batch {
		out = append(out, x[(b*t+lo)*w:(b*t+hi)*w]...)
	}
	return out
}

// putRows adds y (batch blocks of hi−lo rows) into rows lo..hi−1 of x.
func putRows(x, y []float64, batch, t, w, lo, hi int) {
	n := (hi - lo) * w
	for b := range batch {
		for i := range n {
			x[(b*t+lo)*w+i] += y[b*n+i]
		}
	}
}

func maxRel(got, want []float64) float64 {
	num, den := 0.0, 0.0
	for i := range want {
		num = max(num, math.Abs(got[i]-want[i]))
		den = max(den, math.Abs(want[i]))
	}
	if den == 0 {
		return num
	}
	return num / den
}

// TestBlockAttentionMatchesWhole splits a causal attention into Q and K/V
// blocks at uneven cuts, in an order that visits blocks wholly masked and
// wholly visible, merges the forward partials by LSE and accumulates the
// block backwards, and compares with the textbook attention in float64.
func TestBlockAttentionMatchesWhole(t *testing.T) {
	for _, tc := range []struct {
		name          string
		batch, t, dh  int
		dv            int
		cuts          []int
		reverseBlocks bool
	}{
		{"two-even", 2, 8, 4, 3, []int{0, 4, 8}, false},
		{"three-uneven", 3, 11, 5, 4, []int{0, 2, 7, 11}, true},
		{"single", 1, 6, 3, 3, []int{0, 6}, false},
		{"many", 2, 9, 2, 5, []int{0, 1, 2, 4, 5, 9}, true},
		// Blocks of over 256 keys: the kernels cut Q into several row
		// tiles (blockRows), each seeing its own prefix of the keys.
		{"tiled", 2, 1200, 4, 3, []int{0, 150, 1200}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := rand.New(rand.NewPCG(1, uint64(tc.t)))
			b, tt, dh, dv := tc.batch, tc.t, tc.dh, tc.dv
			scale := 1 / math.Sqrt(float64(dh))
			q, k, v, g := randBlock(r, b*tt*dh), randBlock(r, b*tt*dh), randBlock(r, b*tt*dv), randBlock(r, b*tt*dv)
			wantO, wantDQ, wantDK, wantDV := refBlockAttention(q, k, v, g, b, tt, dh, dv, scale)
			gotO := make([]float64, len(wantO))
			gotDQ, gotDK, gotDV := make([]float64, len(wantDQ)), make([]float64, len(wantDK)), make([]float64, len(wantDV))
			nb := len(tc.cuts) - 1
			lses := make([][]float64, nb)
			outs := make([][]float64, nb)
			for qi := range nb {
				q0, q1 := tc.cuts[qi], tc.cuts[qi+1]
				qb := rowsOf(q, b, tt, dh, q0, q1)
				var out, lse []float64
				for s := range nb {
					ki := s
					if tc.reverseBlocks {
						ki = nb - 1 - s
					}
					k0, k1 := tc.cuts[ki], tc.cuts[ki+1]
					sh := BlockAttnShape{Batch: b, TQ: q1 - q0, TK: k1 - k0, DH: dh, DV: dv, Q0: q0, K0: k0, Scale: scale, Causal: true}
					o := make([]float64, b*(q1-q0)*dv)
					l := make([]float64, b*(q1-q0))
					if err := BlockAttentionForward(nil, 0, o, l, qb, rowsOf(k, b, tt, dh, k0, k1), rowsOf(v, b, tt, dv, k0, k1), sh); err != nil {
						t.Fatal(err)
					}
					if out == nil {
						out, lse = o, l
						continue
					}
					if err := MergeAttention(out, lse, o, l, dv); err != nil {
						t.Fatal(err)
					}
				}
				putRows(gotO, out, b, tt, dv, q0, q1)
				outs[qi], lses[qi] = out, lse
			}
			if e := maxRel(gotO, wantO); e > 1e-13 {
				t.Fatalf("forward: relative error %.3g", e)
			}
			for qi := range nb {
				q0, q1 := tc.cuts[qi], tc.cuts[qi+1]
				gb := rowsOf(g, b, tt, dv, q0, q1)
				delta := make([]float64, b*(q1-q0))
				if err := AttentionRowDots(delta, gb, outs[qi], dv); err != nil {
					t.Fatal(err)
				}
				dqb := make([]float64, b*(q1-q0)*dh)
				for ki := range nb {
					k0, k1 := tc.cuts[ki], tc.cuts[ki+1]
					sh := BlockAttnShape{Batch: b, TQ: q1 - q0, TK: k1 - k0, DH: dh, DV: dv, Q0: q0, K0: k0, Scale: scale, Causal: true}
					dkb, dvb := make([]float64, b*(k1-k0)*dh), make([]float64, b*(k1-k0)*dv)
					if err := BlockAttentionBackward(nil, 0, dqb, dkb, dvb, gb, rowsOf(q, b, tt, dh, q0, q1), rowsOf(k, b, tt, dh, k0, k1), rowsOf(v, b, tt, dv, k0, k1), lses[qi], delta, sh); err != nil {
						t.Fatal(err)
					}
					putRows(gotDK, dkb, b, tt, dh, k0, k1)
					putRows(gotDV, dvb, b, tt, dv, k0, k1)
				}
				putRows(gotDQ, dqb, b, tt, dh, q0, q1)
			}
			for _, c := range []struct {
				name      string
				got, want []float64
			}{{"dq", gotDQ, wantDQ}, {"dk", gotDK, wantDK}, {"dv", gotDV, wantDV}} {
				if e := maxRel(c.got, c.want); e > 1e-12 {
					t.Errorf("%s: relative error %.3g", c.name, e)
				}
			}
		})
	}
}

// TestBlockAttentionFloat32 checks the float32 instantiation (its small
// products on the register-tiled path) against the float64 one within
// float32 rounding, forward and backward, a fully masked block included.
func TestBlockAttentionFloat32(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	sh := BlockAttnShape{Batch: 2, TQ: 5, TK: 7, DH: 4, DV: 3, Q0: 3, K0: 2, Scale: 0.5, Causal: true}
	q, k, v := randBlock(r, 2*5*4), randBlock(r, 2*7*4), randBlock(r, 2*7*3)
	o64, l64 := make([]float64, 2*5*3), make([]float64, 10)
	if err := BlockAttentionForward(nil, 0, o64, l64, q, k, v, sh); err != nil {
		t.Fatal(err)
	}
	f := func(x []float64) []float32 {
		y := make([]float32, len(x))
		for i, e := range x {
			y[i] = float32(e)
		}
		return y
	}
	o32, l32 := make([]float32, len(o64)), make([]float32, len(l64))
	if err := BlockAttentionForward(nil, 0, o32, l32, f(q), f(k), f(v), sh); err != nil {
		t.Fatal(err)
	}
	for i := range o64 {
		if math.Abs(float64(o32[i])-o64[i]) > 1e-5 {
			t.Fatalf("out[%d] = %v, float64 %v", i, o32[i], o64[i])
		}
	}
	// The backward, into gradients that hold values already (it adds).
	g := randBlock(r, 2*5*3)
	d64, d32 := make([]float64, 10), make([]float32, 10)
	if err := AttentionRowDots(d64, g, o64, 3); err != nil {
		t.Fatal(err)
	}
	if err := AttentionRowDots(d32, f(g), o32, 3); err != nil {
		t.Fatal(err)
	}
	dq, dk, dv := randBlock(r, 2*5*4), randBlock(r, 2*7*4), randBlock(r, 2*7*3)
	dq32, dk32, dv32 := f(dq), f(dk), f(dv)
	if err := BlockAttentionBackward(nil, 0, dq, dk, dv, g, q, k, v, l64, d64, sh); err != nil {
		t.Fatal(err)
	}
	if err := BlockAttentionBackward(nil, 0, dq32, dk32, dv32, f(g), f(q), f(k), f(v), l32, d32, sh); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name string
		got  []float32
		want []float64
	}{{"dq", dq32, dq}, {"dk", dk32, dk}, {"dv", dv32, dv}} {
		for i, w := range c.want {
			if math.Abs(float64(c.got[i])-w) > 1e-5 {
				t.Fatalf("%s[%d] = %v, float64 %v", c.name, i, c.got[i], w)
			}
		}
	}
	// Row 0 of the masked shape below sees nothing: zero output, LSE −Inf.
	sh.K0 = 6
	o, l := make([]float32, len(o32)), make([]float32, len(l32))
	if err := BlockAttentionForward(nil, 0, o, l, f(q), f(k), f(v), sh); err != nil {
		t.Fatal(err)
	}
	if !math.IsInf(float64(l[0]), -1) || o[0] != 0 || math.IsInf(float64(l[3]), 0) {
		t.Fatalf("masked row: lse %v out %v; row 3 lse %v", l[0], o[:3], l[3])
	}
}

func TestBlockAttentionInvalid(t *testing.T) {
	sh := BlockAttnShape{Batch: 1, TQ: 2, TK: 2, DH: 2, DV: 2, Scale: 1}
	x := make([]float32, 4)
	l := make([]float32, 2)
	for name, err := range map[string]error{
		"short out":   BlockAttentionForward(nil, 0, x[:3], l, x, x, x, sh),
		"nan scale":   BlockAttentionForward(nil, 0, x, l, x, x, x, BlockAttnShape{Batch: 1, TQ: 2, TK: 2, DH: 2, DV: 2, Scale: math.NaN()}),
		"negative":    BlockAttentionForward(nil, 0, x, l, x, x, x, BlockAttnShape{Batch: -1}),
		"merge":       MergeAttention(x, l, x[:2], l, 2),
		"dots":        AttentionRowDots(l, x, x[:3], 2),
		"backward dk": BlockAttentionBackward(nil, 0, nil, x[:1], nil, x, x, x, x, l, l, sh),
	} {
		if !errors.Is(err, ErrInvalid) {
			t.Errorf("%s: %v, want ErrInvalid", name, err)
		}
	}
}

// TestBlockAttentionPositions runs a whole sequence stored in zigzag
// order (the load-balanced layout: rows of chunks 0, 3, 1, 2) through one
// block with explicit positions and compares with the textbook attention
// in natural order.
func TestBlockAttentionPositions(t *testing.T) {
	r := rand.New(rand.NewPCG(5, 6))
	const b, tt, dh, dv = 2, 8, 3, 4
	scale := 1 / math.Sqrt(dh)
	q, k, v, g := randBlock(r, b*tt*dh), randBlock(r, b*tt*dh), randBlock(r, b*tt*dv), randBlock(r, b*tt*dv)
	wantO, wantDQ, wantDK, wantDV := refBlockAttention(q, k, v, g, b, tt, dh, dv, scale)
	pos := []int{0, 1, 6, 7, 2, 3, 4, 5}
	perm := func(x []float64, w int) []float64 {
		y := make([]float64, len(x))
		for bb := range b {
			for i, p := range pos {
				copy(y[(bb*tt+i)*w:(bb*tt+i+1)*w], x[(bb*tt+p)*w:(bb*tt+p+1)*w])
			}
		}
		return y
	}
	sh := BlockAttnShape{Batch: b, TQ: tt, TK: tt, DH: dh, DV: dv, QPos: pos, KPos: pos, Scale: scale, Causal: true}
	pq, pk, pv, pg := perm(q, dh), perm(k, dh), perm(v, dv), perm(g, dv)
	o, l := make([]float64, b*tt*dv), make([]float64, b*tt)
	if err := BlockAttentionForward(nil, 0, o, l, pq, pk, pv, sh); err != nil {
		t.Fatal(err)
	}
	delta := make([]float64, b*tt)
	if err := AttentionRowDots(delta, pg, o, dv); err != nil {
		t.Fatal(err)
	}
	dq, dk, dvv := make([]float64, len(pq)), make([]float64, len(pk)), make([]float64, len(pv))
	if err := BlockAttentionBackward(nil, 0, dq, dk, dvv, pg, pq, pk, pv, l, delta, sh); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name      string
		got, want []float64
	}{{"out", o, perm(wantO, dv)}, {"dq", dq, perm(wantDQ, dh)}, {"dk", dk, perm(wantDK, dh)}, {"dv", dvv, perm(wantDV, dv)}} {
		if e := maxRel(c.got, c.want); e > 1e-12 {
			t.Errorf("%s: relative error %.3g", c.name, e)
		}
	}
	sh.QPos = pos[:3]
	if err := BlockAttentionForward(nil, 0, o, l, pq, pk, pv, sh); !errors.Is(err, ErrInvalid) {
		t.Errorf("3 positions for 8 rows: %v, want ErrInvalid", err)
	}
}

// TestRowTiles: the block kernels' row tiles hold at most bq rows and
// never span two runs of positions (a load-balanced shard's early and late
// chunks), so an early row's tile does not compute scores against the
// late run's keys.
func TestRowTiles(t *testing.T) {
	for _, c := range []struct {
		qp   []int
		bq   int
		want []int
	}{
		{[]int{0, 1, 2, 3, 4}, 2, []int{0, 2, 4, 5}},
		{[]int{0, 1, 2, 6, 7}, 4, []int{0, 3, 5}},
		{[]int{0, 1, 6, 7, 2, 3}, 8, []int{0, 2, 4, 6}},
		{[]int{5}, 8, []int{0, 1}},
	} {
		if got := rowTiles(c.qp, c.bq); !slices.Equal(got, c.want) {
			t.Errorf("rowTiles(%v, %d) = %v, want %v", c.qp, c.bq, got, c.want)
		}
	}
}
