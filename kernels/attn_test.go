package kernels

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"
)

// refAttention is causal attention in float64, straight from the
// definition, with the gradients of Σ out⊙g; mags hold the magnitude of
// the terms of every element for the error bound.
func refAttention(q, k, v, g []float32, batch, t, dh, dv int, scale float32) (out, probs, dq, dk, dvv, mOut, mDq, mDk, mDv []float64) {
	out, probs = make([]float64, batch*t*dv), make([]float64, batch*t*t)
	dq, dk, dvv = make([]float64, batch*t*dh), make([]float64, batch*t*dh), make([]float64, batch*t*dv)
	mOut, mDq, mDk, mDv = make([]float64, len(out)), make([]float64, len(dq)), make([]float64, len(dk)), make([]float64, len(dvv))
	for b := range batch {
		Q := func(i, d int) float64 { return float64(q[(b*t+i)*dh+d]) }
		K := func(i, d int) float64 { return float64(k[(b*t+i)*dh+d]) }
		V := func(i, d int) float64 { return float64(v[(b*t+i)*dv+d]) }
		G := func(i, d int) float64 { return float64(g[(b*t+i)*dv+d]) }
		P := probs[b*t*t : (b+1)*t*t]
		for i := range t {
			m := math.Inf(-1)
			s := make([]float64, i+1)
			for j := 0; j <= i; j++ {
				for d := range dh {
					s[j] += Q(i, d) * K(j, d)
				}
				s[j] = float64(float32(s[j]) * scale)
				m = max(m, s[j])
			}
			z := 0.0
			for j := range s {
				z += math.Exp(s[j] - m)
			}
			for j := range s {
				P[i*t+j] = math.Exp(s[j]-m) / z
			}
		}
		for i := range t {
			for d := range dv {
				for j := 0; j <= i; j++ {
					out[(b*t+i)*dv+d] += P[i*t+j] * V(j, d)
					mOut[(b*t+i)*dv+d] += math.Abs(P[i*t+j] * V(j, d))
				}
			}
		}
		// dP = g·vᵀ, dS = scale·P(dP − Σ P dP), dq = dS k, dk = dSᵀ q, dv = Pᵀ g.
		dS, mS := make([]float64, t*t), make([]float64, t*t)
		for i := range t {
			dp, mp := make([]float64, i+1), make([]float64, i+1)
			sum, msum := 0.0, 0.0
			for j := 0; j <= i; j++ {
				for d := range dv {
					dp[j] += G(i, d) * V(j, d)
					mp[j] += math.Abs(G(i, d) * V(j, d))
				}
				sum += P[i*t+j] * dp[j]
				msum += P[i*t+j] * mp[j]
			}
			for j := 0; j <= i; j++ {
				dS[i*t+j] = float64(scale) * P[i*t+j] * (dp[j] - sum)
				mS[i*t+j] = float64(scale) * P[i*t+j] * (mp[j] + msum)
			}
		}
		for i := range t {
			for d := range dh {
				for j := 0; j <= i; j++ {
					dq[(b*t+i)*dh+d] += dS[i*t+j] * K(j, d)
					mDq[(b*t+i)*dh+d] += mS[i*t+j] * math.Abs(K(j, d))
					dk[(b*t+j)*dh+d] += dS[i*t+j] * Q(i, d)
					mDk[(b*t+j)*dh+d] += mS[i*t+j] * math.Abs(Q(i, d))
				}
			}
			for d := range dv {
				for j := 0; j <= i; j++ {
					dvv[(b*t+j)*dv+d] += P[i*t+j] * G(i, d)
					mDv[(b*t+j)*dv+d] += math.Abs(P[i*t+j] * G(i, d))
				}
			}
		}
	}
	return
}

func TestCausalAttentionKernels(t *testing.T) {
	rng := rand.New(rand.NewPCG(8, 1))
	for _, c := range []struct{ batch, t, dh, dv int }{
		{0, 4, 4, 4}, {2, 0, 3, 3}, {1, 1, 1, 1}, {2, 3, 5, 2}, {1, 4, 16, 16}, {2, 5, 17, 9},
		{1, 16, 32, 32}, {2, 17, 33, 15}, {3, 64, 32, 32}, {1, 20, 0, 4}, {1, 20, 4, 0},
	} {
		for _, scale := range []float32{1, 0.17677669} {
			name := fmt.Sprintf("b%d_t%d_dh%d_dv%d_scale%g", c.batch, c.t, c.dh, c.dv, scale)
			q := randRows(rng, c.batch*c.t*c.dh, 1)
			k := randRows(rng, c.batch*c.t*c.dh, 1)
			v := randRows(rng, c.batch*c.t*c.dv, 1)
			g := randRows(rng, c.batch*c.t*c.dv, 1)
			out, probs := make([]float32, len(v)), make([]float32, c.batch*c.t*c.t)
			for i := range probs {
				probs[i] = float32(math.NaN()) // every entry must be written
			}
			if err := CausalAttentionForward(0, out, probs, q, k, v, c.batch, c.t, c.dh, c.dv, scale); err != nil {
				t.Fatalf("%s: %v", name, err)
			}
			rOut, rP, rDq, rDk, rDv, mOut, mDq, mDk, mDv := refAttention(q, k, v, g, c.batch, c.t, c.dh, c.dv, scale)
			// The scores sum dh float32 products: their rounding moves
			// the probabilities by about dh·2^-24·|score| relative.
			pt := float64(c.dh+4) * ulp32 * 4
			check(t, name+"_probs", probs, rP, rP, pt)
			check(t, name+"_out", out, rOut, mOut, pt+float64(c.t+2)*ulp32)
			dq, dk, dv := make([]float32, len(q)), make([]float32, len(k)), make([]float32, len(v))
			if err := CausalAttentionBackward(0, dq, dk, dv, g, probs, q, k, v, c.batch, c.t, c.dh, c.dv, scale); err != nil {
				t.Fatalf("%s: backward: %v", name, err)
			}
			bt := pt + float64(c.t+c.dv+4)*ulp32*2
			check(t, name+"_dq", dq, rDq, mDq, bt)
			check(t, name+"_dk", dk, rDk, mDk, bt)
			check(t, name+"_dv", dv, rDv, mDv, bt)
			// Only some gradients.
			dq2 := make([]float32, len(q))
			if err := CausalAttentionBackward(0, dq2, nil, nil, g, probs, q, k, v, c.batch, c.t, c.dh, c.dv, scale); err != nil {
				t.Fatal(err)
			}
			for i := range dq2 {
				if dq2[i] != dq[i] {
					t.Fatalf("%s: dq alone differs at %d", name, i)
				}
			}
		}
	}
	// Bad sizes are errors.
	x := make([]float32, 8)
	if CausalAttentionForward(0, x, x, x, x, x, 1, 2, 2, 2, 1) == nil {
		t.Error("forward accepted probs of the wrong length")
	}
	if CausalAttentionBackward(0, x[:3], nil, nil, x, x[:4], x, x, x, 1, 2, 4, 4, 1) == nil {
		t.Error("backward accepted dq of the wrong length")
	}
	if CausalAttentionForward(0, x, x, x, x, x, -1, 2, 2, 2, 1) == nil {
		t.Error("forward accepted a negative batch")
	}
}

// TestSmallGemm checks the 4×16 tiles and the scalar edges against a
// float64 product, for both layouts of A and every k-range.
func TestSmallGemm(t *testing.T) {
	rng := rand.New(rand.NewPCG(9, 1))
	for _, sh := range [][3]int{{4, 16, 1}, {8, 32, 7}, {5, 17, 3}, {3, 15, 9}, {64, 64, 32}, {13, 40, 0}} {
		m, n, k := sh[0], sh[1], sh[2]
		for _, trans := range []bool{false, true} {
			for _, kr := range []kRange{kAll, kPrefix, kSuffix} {
				name := fmt.Sprintf("m%d_n%d_k%d_trans%v_kr%d", m, n, k, trans, kr)
				a := randRows(rng, m*max(k, 1), 1)
				b := randRows(rng, k*n, 1)
				sai, sap := k, 1
				if trans {
					sai, sap = 1, m
				}
				c := make([]float32, m*n)
				smallGemm(c, n, a, sai, sap, b, n, m, n, k, kr, false, 1)
				ref, mag := make([]float64, m*n), make([]float64, m*n)
				for i := range m {
					i0 := i &^ 3
					lo, hi := 0, k
					if kr == kPrefix {
						hi = min(k, i0+4)
					} else if kr == kSuffix {
						lo = min(i0, k)
					}
					for j := range n {
						for p := lo; p < hi; p++ {
							x := float64(a[i*sai+p*sap]) * float64(b[p*n+j])
							ref[i*n+j] += x
							mag[i*n+j] += math.Abs(x)
						}
					}
				}
				check(t, name, c, ref, mag, float64(k+2)*ulp32)
			}
		}
	}
}

func TestTransposeInto(t *testing.T) {
	for _, sh := range [][2]int{{0, 3}, {1, 1}, {8, 8}, {7, 9}, {16, 8}, {64, 32}, {17, 23}, {3, 40}} {
		rows, cols := sh[0], sh[1]
		src := make([]float32, rows*cols)
		for i := range src {
			src[i] = float32(i)
		}
		dst := make([]float32, rows*cols)
		transposeInto(dst, src, rows, cols)
		for i := range rows {
			for j := range cols {
				if dst[j*rows+i] != src[i*cols+j] {
					t.Fatalf("%dx%d: dst[%d][%d] = %g, want %g", rows, cols, j, i, dst[j*rows+i], src[i*cols+j])
				}
			}
		}
	}
}
