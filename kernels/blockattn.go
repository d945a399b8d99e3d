package kernels

import (
	"fmt"
	"math"

	"github.com/b7ea7098/loom/internal/checked"
)

// Block attention with log-sum-exp: the pieces context parallelism builds
// exact attention from when the sequence is split over ranks. A rank
// holds a Q block (rows at global positions q0, q0+1, …) and, one after
// another, K/V blocks (positions k0, k0+1, …); for each pair it computes
// the block's output and the log-sum-exp of every row's scores, and
// merges the partial results by the LSE rule. The backward of a block
// needs only dO, the merged O's row dots D = rowsum(dO∘O) and the merged
// LSE (FlashAttention-2's recomputation), so no probabilities are kept.
//
// Every kernel is generic over float32 and float64: sums and exponentials
// run in float64 and are rounded to T once, so a float64 result is exact
// to float64 rounding and a float32 one to float32 rounding.

// BlockAttnShape is the shape of one block pair: Batch independent heads
// (batch and heads flattened), a Q block of TQ rows at global positions
// Q0…Q0+TQ−1, a K/V block of TK rows at K0…K0+TK−1, DH columns of q and
// k and DV of v. With Causal set, row i of Q sees row j of K only when
// K0+j <= Q0+i (the causal mask by global position); a row that sees
// nothing gets output 0 and LSE −Inf. Scale multiplies q·kᵀ. QPos and
// KPos, when not nil, give the global position of every Q row (TQ values)
// and K row (TK values) instead of Q0 and K0: a block whose rows are not
// one run (a load-balanced sequence shard holds two).
type BlockAttnShape struct {
	Batch, TQ, TK, DH, DV int
	Q0, K0                int
	QPos, KPos            []int
	Scale                 float64
	Causal                bool
}

// check validates the shape and the lengths of named blocks against it.
func (s BlockAttnShape) check(op string, lens map[string][2]int) error {
	if s.Batch < 0 || s.TQ < 0 || s.TK < 0 || s.DH < 0 || s.DV < 0 {
		return fmt.Errorf("kernels: %s: %w: negative size in %+v", op, ErrInvalid, s)
	}
	if math.IsNaN(s.Scale) || math.IsInf(s.Scale, 0) {
		return fmt.Errorf("kernels: %s: %w: scale %v is not finite", op, ErrInvalid, s.Scale)
	}
	if _, ok := checked.Product([]int{s.Batch, max(s.TQ, s.TK), max(s.DH, s.DV, 1)}); !ok {
		return fmt.Errorf("kernels: %s: %w: batch %d × rows %d × width %d overflows int", op, ErrInvalid, s.Batch, max(s.TQ, s.TK), max(s.DH, s.DV))
	}
	if s.QPos != nil && len(s.QPos) != s.TQ || s.KPos != nil && len(s.KPos) != s.TK {
		return fmt.Errorf("kernels: %s: %w: %d Q positions and %d K positions for blocks of %d and %d rows", op, ErrInvalid, len(s.QPos), len(s.KPos), s.TQ, s.TK)
	}
	for name, l := range lens {
		if l[0] != l[1] {
			return fmt.Errorf("kernels: %s: %w: %s has %d values, want %d for batch %d, rows %d and %d, widths %d and %d", op, ErrInvalid, name, l[0], l[1], s.Batch, s.TQ, s.TK, s.DH, s.DV)
		}
	}
	return nil
}

// keys sets buf (TK long) to the K rows row i of Q sees, in order, and
// returns it: all of them without the mask, else those whose position is
// at most row i's.
func (s BlockAttnShape) keys(i int, buf []int) []int {
	buf = buf[:0]
	qp := s.Q0 + i
	if s.QPos != nil {
		qp = s.QPos[i]
	}
	for j := range s.TK {
		kp := s.K0 + j
		if s.KPos != nil {
			kp = s.KPos[j]
		}
		if !s.Causal || kp <= qp {
			buf = append(buf, j)
		}
	}
	return buf
}

// BlockAttentionForward sets out ([Batch, TQ, DV]) to the attention of the
// Q block q ([Batch, TQ, DH]) over the K/V block k ([Batch, TK, DH]) and v
// ([Batch, TK, DV]), softmax over the visible keys of Scale·q·kᵀ, and lse
// ([Batch, TQ]) to each row's log Σ_j exp(Scale·q_i·k_j) over the visible
// keys (−Inf and a zero row of out where none is visible). Errors wrap
// ErrInvalid (negative sizes, lengths that do not fit the shape).
func BlockAttentionForward[T Float](w Workers, out, lse, q, k, v []T, s BlockAttnShape) error {
	const op = "BlockAttentionForward"
	if err := s.check(op, map[string][2]int{
		"out": {len(out), s.Batch * s.TQ * s.DV}, "lse": {len(lse), s.Batch * s.TQ},
		"q": {len(q), s.Batch * s.TQ * s.DH}, "k": {len(k), s.Batch * s.TK * s.DH}, "v": {len(v), s.Batch * s.TK * s.DV},
	}); err != nil {
		return err
	}
	forRows(w, s.Batch*s.TQ, s.TK*(s.DH+s.DV), func(lo, hi int) {
		p := make([]float64, s.TK)
		acc := make([]float64, s.DV)
		js := make([]int, 0, s.TK)
		for r := lo; r < hi; r++ {
			b, i := r/s.TQ, r%s.TQ
			qi := q[r*s.DH : (r+1)*s.DH]
			js = s.keys(i, js)
			oi := out[r*s.DV : (r+1)*s.DV]
			if len(js) == 0 {
				clear(oi)
				lse[r] = T(math.Inf(-1))
				continue
			}
			m := math.Inf(-1)
			for _, j := range js {
				kj := k[(b*s.TK+j)*s.DH : (b*s.TK+j+1)*s.DH]
				d := 0.0
				for c, x := range qi {
					d += float64(x) * float64(kj[c])
				}
				p[j] = d * s.Scale
				m = max(m, p[j])
			}
			sum := 0.0
			for _, j := range js {
				p[j] = math.Exp(p[j] - m)
				sum += p[j]
			}
			clear(acc)
			for _, j := range js {
				vj := v[(b*s.TK+j)*s.DV : (b*s.TK+j+1)*s.DV]
				pj := p[j] / sum
				for c, x := range vj {
					acc[c] += pj * float64(x)
				}
			}
			for c, x := range acc {
				oi[c] = T(x)
			}
			lse[r] = T(m + math.Log(sum))
		}
	})
	return nil
}

// MergeAttention merges a partial attention result (o2, lse2) of rows of
// dv columns into (out, lse) in place by the LSE rule: with
// l = log(exp(lse)+exp(lse2)), out = exp(lse−l)·out + exp(lse2−l)·o2 and
// lse = l. A row whose two LSEs are −Inf (no visible key yet) stays 0 and
// −Inf. The coefficients are computed in float64 and each result rounded
// to T once. out and lse must not overlap o2 and lse2. Errors wrap
// ErrInvalid (lengths that do not agree).
func MergeAttention[T Float](out, lse, o2, lse2 []T, dv int) error {
	const op = "MergeAttention"
	rows := len(lse)
	if dv < 0 || len(lse2) != rows || len(out) != rows*dv || len(o2) != rows*dv {
		return fmt.Errorf("kernels: %s: %w: out %d, lse %d, o2 %d, lse2 %d values for rows of %d", op, ErrInvalid, len(out), rows, len(o2), len(lse2), dv)
	}
	for r := range rows {
		l1, l2 := float64(lse[r]), float64(lse2[r])
		m := max(l1, l2)
		if math.IsInf(m, -1) {
			continue
		}
		l := m + math.Log(math.Exp(l1-m)+math.Exp(l2-m))
		a, b := math.Exp(l1-l), math.Exp(l2-l)
		oi, pi := out[r*dv:(r+1)*dv], o2[r*dv:(r+1)*dv]
		for c := range oi {
			oi[c] = T(a*float64(oi[c]) + b*float64(pi[c]))
		}
		lse[r] = T(l)
	}
	return nil
}

// AttentionRowDots sets delta[r] = Σ_c dout[r,c]·out[r,c] for rows of dv
// columns: the D of the attention backward (rowsum(dO∘O), over the merged
// output). Errors wrap ErrInvalid (lengths that do not agree).
func AttentionRowDots[T Float](delta, dout, out []T, dv int) error {
	const op = "AttentionRowDots"
	rows := len(delta)
	if dv < 0 || len(dout) != rows*dv || len(out) != rows*dv {
		return fmt.Errorf("kernels: %s: %w: delta %d, dout %d and out %d values for rows of %d", op, ErrInvalid, rows, len(dout), len(out), dv)
	}
	for r := range rows {
		d := 0.0
		for c, x := range dout[r*dv : (r+1)*dv] {
			d += float64(x) * float64(out[r*dv+c])
		}
		delta[r] = T(d)
	}
	return nil
}

// BlockAttentionBackward adds the gradients of one block pair of
// BlockAttentionForward to dq ([Batch, TQ, DH]), dk ([Batch, TK, DH]) and
// dv ([Batch, TK, DV]), from dout (the gradient of the merged output),
// the merged lse and delta (AttentionRowDots of dout and the merged
// output): with p_ij = exp(Scale·q_i·k_j − lse_i) over the visible keys,
// dv_j += Σ_i p_ij·dout_i, ds_ij = p_ij·(dout_i·v_j − delta_i),
// dq_i += Scale·Σ_j ds_ij·k_j and dk_j += Scale·Σ_i ds_ij·q_i. Any of dq,
// dk and dv may be nil when not wanted. The block's sums run in float64
// and are added to the accumulators once, rounded to T. Errors wrap
// ErrInvalid (negative sizes, lengths that do not fit the shape).
func BlockAttentionBackward[T Float](w Workers, dq, dk, dv, dout, q, k, v, lse, delta []T, s BlockAttnShape) error {
	const op = "BlockAttentionBackward"
	lens := map[string][2]int{
		"dout": {len(dout), s.Batch * s.TQ * s.DV}, "lse": {len(lse), s.Batch * s.TQ}, "delta": {len(delta), s.Batch * s.TQ},
		"q": {len(q), s.Batch * s.TQ * s.DH}, "k": {len(k), s.Batch * s.TK * s.DH}, "v": {len(v), s.Batch * s.TK * s.DV},
	}
	if dq != nil {
		lens["dq"] = [2]int{len(dq), s.Batch * s.TQ * s.DH}
	}
	if dk != nil {
		lens["dk"] = [2]int{len(dk), s.Batch * s.TK * s.DH}
	}
	if dv != nil {
		lens["dv"] = [2]int{len(dv), s.Batch * s.TK * s.DV}
	}
	if err := s.check(op, lens); err != nil {
		return err
	}
	// Heads are independent: split over them, so each goroutine owns its
	// heads' rows of dk and dv.
	forRows(w, s.Batch, s.TQ*s.TK*(s.DH+s.DV), func(lo, hi int) {
		gk := make([]float64, s.TK*s.DH)
		gv := make([]float64, s.TK*s.DV)
		gq := make([]float64, s.DH)
		js := make([]int, 0, s.TK)
		for b := lo; b < hi; b++ {
			clear(gk)
			clear(gv)
			for i := range s.TQ {
				js = s.keys(i, js)
				if len(js) == 0 {
					continue
				}
				r := b*s.TQ + i
				qi, gi := q[r*s.DH:(r+1)*s.DH], dout[r*s.DV:(r+1)*s.DV]
				l, dl := float64(lse[r]), float64(delta[r])
				clear(gq)
				for _, j := range js {
					kj := k[(b*s.TK+j)*s.DH : (b*s.TK+j+1)*s.DH]
					vj := v[(b*s.TK+j)*s.DV : (b*s.TK+j+1)*s.DV]
					d := 0.0
					for c, x := range qi {
						d += float64(x) * float64(kj[c])
					}
					p := math.Exp(d*s.Scale - l)
					dp := 0.0
					for c, x := range gi {
						dp += float64(x) * float64(vj[c])
						gv[j*s.DV+c] += p * float64(x)
					}
					ds := p * (dp - dl) * s.Scale
					for c, x := range kj {
						gq[c] += ds * float64(x)
					}
					for c, x := range qi {
						gk[j*s.DH+c] += ds * float64(x)
					}
				}
				if dq != nil {
					for c, x := range gq {
						dq[r*s.DH+c] += T(x)
					}
				}
			}
			if dk != nil {
				for c, x := range gk {
					dk[b*s.TK*s.DH+c] += T(x)
				}
			}
			if dv != nil {
				for c, x := range gv {
					dv[b*s.TK*s.DV+c] += T(x)
				}
			}
		}
	})
	return nil
}
