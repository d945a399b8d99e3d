package kernels

import (
	"fmt"
	"math"

	"github.com/b7ea7098/loom/internal/checked"
)

// Causal attention on small per-head blocks. Each product is a small GEMM
// (T×T×Dh for the tiny GPT: 64×64×32) that a BLAS call handles poorly
// (packing and thread start-up dominate), and half of every T×T block is
// masked. The kernels here run a register-tiled 4×16 micro-kernel
// (AVX2+FMA; a plain loop elsewhere) directly on the row-major blocks,
// skip the tiles above the diagonal, and shorten the k-loops to the
// unmasked range.

// kRange selects the k-range of smallGemm for the 4-row tile starting at
// row i0: all of [0, k), the prefix [0, i0+4) (A is lower triangular: row
// i is 0 past column i) or the suffix [i0, k) (A is the transpose of a
// lower-triangular matrix: row i is 0 before column i).
type kRange uint8

const (
	kAll kRange = iota
	kPrefix
	kSuffix
)

// smallGemm sets C[i][j] = alpha·Σ_p A(i,p)·B[p][j] (the sum rounded to
// float32 before the multiply) for i < m, j < n, over the
// k-range kr of each 4-row tile, where A(i,p) = a[i·sai + p·sap] (row-major
// A with sai = lda, sap = 1; its transpose with sai = 1, sap = lda),
// B[p][j] = b[p·ldb + j] and C[i][j] = c[i·ldc + j]. With lower set, tiles
// entirely above the diagonal (every j > i) are not written.
func smallGemm(c []float32, ldc int, a []float32, sai, sap int, b []float32, ldb int, m, n, k int, kr kRange, lower bool, alpha float32) {
	for i0 := 0; i0 < m; i0 += 4 {
		lo, hi := 0, k
		switch kr {
		case kPrefix:
			hi = min(k, i0+4)
		case kSuffix:
			lo = min(i0, k)
		}
		rows := min(4, m-i0)
		for j0 := 0; j0 < n; j0 += 16 {
			if lower && j0 > i0+rows-1 {
				break
			}
			cols := min(16, n-j0)
			if haveVec && rows == 4 && cols == 16 && hi > lo {
				gemm4x16AVX2(&c[i0*ldc+j0], ldc, &a[i0*sai+lo*sap], sai, sap, &b[lo*ldb+j0], ldb, hi-lo, alpha)
				continue
			}
			for i := i0; i < i0+rows; i++ {
				cr := c[i*ldc+j0 : i*ldc+j0+cols]
				for j := range cr {
					s := float32(0)
					for p := lo; p < hi; p++ {
						s += a[i*sai+p*sap] * b[p*ldb+j0+j]
					}
					cr[j] = s * alpha
				}
			}
		}
	}
}

// transposeInto sets dst (cols×rows) to the transpose of src (rows×cols),
// in 8×8 tiles where the CPU has AVX2.
func transposeInto(dst, src []float32, rows, cols int) {
	r8, c8 := 0, 0
	if haveVec {
		r8, c8 = rows&^7, cols&^7
		for i := 0; i < r8; i += 8 {
			for j := 0; j < c8; j += 8 {
				transpose8x8AVX2(&dst[j*rows+i], rows, &src[i*cols+j], cols)
			}
		}
	}
	for i := range rows {
		row := src[i*cols : (i+1)*cols]
		j0 := 0
		if i < r8 {
			j0 = c8 // the tiles did columns [0, c8) of these rows
		}
		for j := j0; j < cols; j++ {
			dst[j*rows+i] = row[j]
		}
	}
}

// attnCheck validates the block sizes of the attention kernels.
func attnCheck(op string, batch, t, dh, dv int, lens map[string][2]int) error {
	if batch < 0 || t < 0 || dh < 0 || dv < 0 {
		return fmt.Errorf("kernels: %s: %w: negative size (batch %d, t %d, dh %d, dv %d)", op, ErrInvalid, batch, t, dh, dv)
	}
	// Every wanted length is batch·t·x for x in t, dh, dv: if the largest
	// fits, none of them wrapped.
	if _, ok := checked.Product([]int{batch, t, max(t, dh, dv)}); !ok {
		return fmt.Errorf("kernels: %s: %w: batch %d × t %d × %d overflows int", op, ErrInvalid, batch, t, max(t, dh, dv))
	}
	for name, l := range lens {
		if l[0] != l[1] {
			return fmt.Errorf("kernels: %s: %w: %s has %d values, want %d for batch %d, t %d, dh %d, dv %d", op, ErrInvalid, name, l[0], l[1], batch, t, dh, dv)
		}
	}
	return nil
}

// CausalAttentionForward computes causal scaled-dot-product attention for
// batch independent blocks (batch and heads flattened): with q and k
// [t, dh] and v [t, dv] per block (row-major, blocks back to back),
// probs = softmax over j <= i of scale·q·kᵀ (t×t per block, exactly 0 for
// j > i; scale·q·kᵀ is rounded to float32 before the softmax) and
// out = probs·v ([t, dv] per block). probs is what
// CausalAttentionBackward takes. The softmax is CausalSoftmax's, in
// float64; the products accumulate in float32, like a GEMM.
func CausalAttentionForward(w Workers, out, probs, q, k, v []float32, batch, t, dh, dv int, scale float32) error {
	const op = "CausalAttentionForward"
	if err := attnCheck(op, batch, t, dh, dv, map[string][2]int{
		"out": {len(out), batch * t * dv}, "probs": {len(probs), batch * t * t},
		"q": {len(q), batch * t * dh}, "k": {len(k), batch * t * dh}, "v": {len(v), batch * t * dv},
	}); err != nil {
		return err
	}
	if t == 0 {
		return nil
	}
	forRows(w, batch, t*t, func(lo, hi int) {
		kt := make([]float32, dh*t)
		for b := lo; b < hi; b++ {
			qb, kb, vb := q[b*t*dh:(b+1)*t*dh], k[b*t*dh:(b+1)*t*dh], v[b*t*dv:(b+1)*t*dv]
			pb, ob := probs[b*t*t:(b+1)*t*t], out[b*t*dv:(b+1)*t*dv]
			// Scores on and below the diagonal, scaled: q·kᵀ with kᵀ [dh, t].
			transposeInto(kt, kb, t, dh)
			smallGemm(pb, t, qb, dh, 1, kt, t, t, t, dh, kAll, true, scale)
			causalRows(pb, t)
			// out = P·v; row i of P is 0 past column i.
			smallGemm(ob, dv, pb, t, 1, vb, dv, t, dv, t, kPrefix, false, 1)
		}
	})
	return nil
}

// causalRows is CausalSoftmax (of already scaled scores) in place on one
// t×t block whose entries past the diagonal are scratch. Each row's
// softmax runs over a whole number of vectors where the row has room: the
// padding is set to −Inf first, so it adds exp(−708), nothing at float32
// precision, to the row's sum, and is cleared afterwards.
func causalRows(p []float32, t int) {
	for i := range t {
		row := p[i*t : (i+1)*t]
		n := i + 1
		np := min(t, (n+3)&^3)
		x := row[:np]
		for j := n; j < np; j++ {
			x[j] = float32(math.Inf(-1))
		}
		m := float64(maxOf(row[:n]))
		expShift(x, x, m+math.Log(expShift(nil, x, m)))
		clear(row[n:])
	}
}

// CausalAttentionBackward maps the gradient g of out =
// CausalAttentionForward(q, k, v) ([t, dv] per block) to the gradients of
// q, k and v, from the probs the forward returned: dv = Pᵀ·g, dS =
// scale·P⊙(g·vᵀ − rowsum(P⊙g·vᵀ)) (CausalSoftmaxBackward's), dq = dS·k and
// dk = dSᵀ·q. Any of dq, dk and dv may be nil when not wanted; the others
// are overwritten.
func CausalAttentionBackward(w Workers, dq, dk, dv, g, probs, q, k, v []float32, batch, t, dh, dvw int, scale float32) error {
	const op = "CausalAttentionBackward"
	lens := map[string][2]int{
		"g": {len(g), batch * t * dvw}, "probs": {len(probs), batch * t * t},
		"q": {len(q), batch * t * dh}, "k": {len(k), batch * t * dh}, "v": {len(v), batch * t * dvw},
	}
	if dq != nil {
		lens["dq"] = [2]int{len(dq), batch * t * dh}
	}
	if dk != nil {
		lens["dk"] = [2]int{len(dk), batch * t * dh}
	}
	if dv != nil {
		lens["dv"] = [2]int{len(dv), batch * t * dvw}
	}
	if err := attnCheck(op, batch, t, dh, dvw, lens); err != nil {
		return err
	}
	if t == 0 {
		return nil
	}
	forRows(w, batch, t*t, func(lo, hi int) { attnBackBlocks(dq, dk, dv, g, probs, q, k, v, lo, hi, t, dh, dvw, scale) })
	return nil
}

// attnBackBlocks is CausalAttentionBackward on blocks lo..hi−1.
func attnBackBlocks(dq, dk, dv, g, probs, q, k, v []float32, lo, hi, t, dh, dvw int, scale float32) {
	vt := make([]float32, dvw*t)
	ds := make([]float32, t*t)
	for b := lo; b < hi; b++ {
		gb, pb := g[b*t*dvw:(b+1)*t*dvw], probs[b*t*t:(b+1)*t*t]
		if dv != nil {
			// dv = Pᵀ·g; row i of Pᵀ is 0 before column i.
			smallGemm(dv[b*t*dvw:(b+1)*t*dvw], dvw, pb, 1, t, gb, dvw, t, dvw, t, kSuffix, false, 1)
		}
		if dq == nil && dk == nil {
			continue
		}
		// dP = g·vᵀ on and below the diagonal, then the softmax backward.
		transposeInto(vt, v[b*t*dvw:(b+1)*t*dvw], t, dvw)
		smallGemm(ds, t, gb, dvw, 1, vt, t, t, t, dvw, kAll, true, 1)
		for i := range t {
			// Padded to whole vectors as in causalRows: P is 0 there, and
			// dP holds finite products (the tile computed covers them).
			row := ds[i*t : (i+1)*t]
			np := min(t, (i+4)&^3)
			softmaxBackRow(row[:np], pb[i*t:i*t+np], row[:np], float64(scale))
			clear(row[i+1:])
		}
		if dq != nil {
			// dq = dS·k; row i of dS is 0 past column i.
			smallGemm(dq[b*t*dh:(b+1)*t*dh], dh, ds, t, 1, k[b*t*dh:(b+1)*t*dh], dh, t, dh, t, kPrefix, false, 1)
		}
		if dk != nil {
			// dk = dSᵀ·q; row i of dSᵀ is 0 before column i.
			smallGemm(dk[b*t*dh:(b+1)*t*dh], dh, ds, 1, t, q[b*t*dh:(b+1)*t*dh], dh, t, dh, t, kSuffix, false, 1)
		}
	}
}
