package kernels

import (
	"fmt"
	"math"
	"slices"
	"unsafe"

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
// Every kernel is generic over float32 and float64. The products (q·kᵀ,
// p·v and the backward's four) are GEMMs that accumulate in T, like a
// matmul; maxima, exponentials, row sums, LSEs and the merge run in
// float64 and are rounded to T once. A float64 result is thus exact to
// float64 rounding and a float32 one to float32 GEMM rounding.

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

// positions returns the global positions of the Q rows and K rows.
func (s BlockAttnShape) positions() (qp, kp []int) {
	qp, kp = s.QPos, s.KPos
	if qp == nil {
		qp = make([]int, s.TQ)
		for i := range qp {
			qp[i] = s.Q0 + i
		}
	}
	if kp == nil {
		kp = make([]int, s.TK)
		for j := range kp {
			kp[j] = s.K0 + j
		}
	}
	return qp, kp
}

// blockRows is the most Q rows per tile of the block kernels: a tile's
// scores (rows × TK) stay within 64 Ki elements (L2), and at most 64 rows,
// so that tiles on the causal diagonal compute few masked scores.
func blockRows(tk int) int { return max(8, min(64, (1<<16)/max(tk, 1))) }

// rowTiles cuts the TQ rows at positions qp into tiles of at most bq rows
// that never span two runs of positions (a load-balanced shard holds an
// early and a late run: a tile of both would see the late run's keys
// from its early rows); it returns the tiles' first rows followed by TQ.
func rowTiles(qp []int, bq int) []int {
	cuts := []int{0}
	for i := 1; i < len(qp); i++ {
		if i-cuts[len(cuts)-1] == bq || qp[i] != qp[i-1]+1 {
			cuts = append(cuts, i)
		}
	}
	return append(cuts, len(qp))
}

// visible returns how many keys, from the first, the rows of a tile whose
// largest position is qmax may see: a prefix of the K block when its
// positions ascend (one run, or a load-balanced shard's two), else all of
// it (the mask is then applied key by key).
func (s BlockAttnShape) visible(kp []int, sorted bool, qmax int) int {
	if !s.Causal || !sorted {
		return s.TK
	}
	n, _ := slices.BinarySearch(kp, qmax+1)
	return n
}

// maskRow sets the scores of row (at position qp) to −Inf where a key is
// masked and returns how many keys, from the first, it needs: with
// ascending K positions the visible keys are a prefix and the rest of the
// row is left alone.
func maskRow[T Float](s BlockAttnShape, row []T, kp []int, sorted bool, qp int) int {
	if !s.Causal {
		return len(row)
	}
	if sorted {
		n, _ := slices.BinarySearch(kp[:len(row)], qp+1)
		return n
	}
	for j := range row {
		if kp[j] > qp {
			row[j] = T(math.Inf(-1))
		}
	}
	return len(row)
}

// rowMax is the largest of x (−Inf for none), as float64.
func rowMax[T Float](x []T) float64 {
	if unsafe.Sizeof(*new(T)) == 4 && len(x) > 0 {
		return float64(maxOf(asFloat32(x)))
	}
	m := math.Inf(-1)
	for _, e := range x {
		m = max(m, float64(e))
	}
	return m
}

// blockGEMM is one goroutine's GEMM in the block kernels: the loaded
// library's (b's, when it has one) or loom's pure-Go GEMM on the calling
// goroutine alone, the kernel having spread its tiles over the workers.
// Small float32 products skip the Go GEMM's packing: they run on the
// fused attention's register tiles (smallGemm), with bt and ct as scratch
// for a transposed B and a product to add.
type blockGEMM struct {
	b       *BLAS
	g       *goGEMM
	smallOK bool // the call's float32 products take the small path
	bt, ct  []float32
}

// newBlockGEMM returns a goroutine's GEMM for a call of shape s cut into
// tiles of bq rows. Whether float32 products take the small path is
// decided once for the call, from its largest tile (bq rows against all
// TK keys), not tile by tile: the ranks of a load-balanced layout, whose
// tiles see different numbers of keys, then run the same code for the
// same work.
func newBlockGEMM(b *BLAS, s BlockAttnShape, bq int) *blockGEMM {
	return &blockGEMM{b: b, g: newGoGEMM(1), smallOK: haveVec && bq*s.TK*max(s.DH, s.DV) <= smallProduct}
}

// smallProduct is the largest tile product the small path takes: up to tiles of
// 64 rows against 512 keys of 32 channels the Go GEMM's packing costs
// more than it saves (thread CPU time per (query, key) pair, forward and
// backward, 8 heads of 32: 31.7 against 46.4 ns at T = 32, 20.9 against
// 30.0 at T = 64, 12.3 against 14.6 at T = 256; even at T = 1024).
const smallProduct = 1 << 20

// blockGemm computes C = alpha·op(A)·op(B) + beta·C (Sgemm's contract) on
// g, for T of 4 or 8 bytes; m or n of 0 does nothing.
func blockGemm[T Float](g *blockGEMM, transA, transB bool, m, n, k int, alpha T, a []T, lda int, b []T, ldb int, beta T, c []T, ldc int) {
	if m == 0 || n == 0 {
		return
	}
	var lib *cblasLib
	if g.b != nil && fitsInt32(m, n, k, lda, ldb, ldc) {
		lib = g.b.lib
	}
	if unsafe.Sizeof(alpha) == 4 {
		switch {
		case lib != nil:
			lib.sgemm(transA, transB, m, n, k, float32(alpha), asFloat32(a), lda, asFloat32(b), ldb, float32(beta), asFloat32(c), ldc)
		case g.smallOK:
			g.small(transA, transB, m, n, k, float32(alpha), asFloat32(a), lda, asFloat32(b), ldb, float32(beta), asFloat32(c), ldc)
		default:
			gemmGo(g.g, &g.g.pool32, g.g.blk32, transA, transB, m, n, k, float32(alpha), asFloat32(a), lda, asFloat32(b), ldb, float32(beta), asFloat32(c), ldc)
		}
		return
	}
	if lib != nil {
		lib.dgemm(transA, transB, m, n, k, float64(alpha), asFloat64(a), lda, asFloat64(b), ldb, float64(beta), asFloat64(c), ldc)
		return
	}
	gemmGo(g.g, &g.g.pool64, g.g.blk64, transA, transB, m, n, k, float64(alpha), asFloat64(a), lda, asFloat64(b), ldb, float64(beta), asFloat64(c), ldc)
}

// small is blockGemm's float32 path for small products: smallGemm on A
// as it is (its strides express the transpose), B made row-major k×n, and
// the product added to C for beta ≠ 0.
func (g *blockGEMM) small(transA, transB bool, m, n, k int, alpha float32, a []float32, lda int, b []float32, ldb int, beta float32, c []float32, ldc int) {
	sai, sap := lda, 1
	if transA {
		sai, sap = 1, lda
	}
	if transB {
		if cap(g.bt) < k*n {
			g.bt = make([]float32, k*n)
		}
		bt := g.bt[:k*n]
		for j := range n {
			for p, x := range b[j*ldb : j*ldb+k] {
				bt[p*n+j] = x
			}
		}
		b, ldb = bt, n
	}
	dst, ldd := c, ldc
	if beta != 0 {
		if cap(g.ct) < m*n {
			g.ct = make([]float32, m*n)
		}
		dst, ldd = g.ct[:m*n], n
	}
	smallGemm(dst, ldd, a, sai, sap, b, ldb, m, n, k, kAll, false, alpha)
	if beta != 0 {
		for i := range m {
			ci := c[i*ldc : i*ldc+n]
			for j, x := range dst[i*n : (i+1)*n] {
				ci[j] = beta*ci[j] + x
			}
		}
	}
}

// expRow sets x[j] = exp(x[j] − shift) and returns Σ x[j], the sum in
// float64: float32 rows through the vector exp (float64 inside, about
// 1e-11 relative), float64 rows through math.Exp.
func expRow[T Float](x []T, shift float64) float64 {
	if unsafe.Sizeof(x[0]) == 4 {
		return expShift(asFloat32(x), asFloat32(x), shift)
	}
	sum := 0.0
	for j, v := range x {
		e := math.Exp(float64(v) - shift)
		x[j] = T(e)
		sum += e
	}
	return sum
}

// BlockAttentionForward sets out ([Batch, TQ, DV]) to the attention of the
// Q block q ([Batch, TQ, DH]) over the K/V block k ([Batch, TK, DH]) and v
// ([Batch, TK, DV]), softmax over the visible keys of Scale·q·kᵀ, and lse
// ([Batch, TQ]) to each row's log Σ_j exp(Scale·q_i·k_j) over the visible
// keys (−Inf and a zero row of out where none is visible).
//
// The products run as GEMMs on tiles of Q rows against the keys they may
// see (b's library when it loaded one, else loom's GEMM; nil b is loom's
// GEMM), so they accumulate in T; the row maxima, exponentials, sums and
// LSEs are float64, each result rounded to T. The tiles are shared out to
// up to w goroutines. Errors wrap ErrInvalid (negative sizes, lengths that
// do not fit the shape).
func BlockAttentionForward[T Float](b *BLAS, w Workers, out, lse, q, k, v []T, s BlockAttnShape) error {
	const op = "BlockAttentionForward"
	if err := s.check(op, map[string][2]int{
		"out": {len(out), s.Batch * s.TQ * s.DV}, "lse": {len(lse), s.Batch * s.TQ},
		"q": {len(q), s.Batch * s.TQ * s.DH}, "k": {len(k), s.Batch * s.TK * s.DH}, "v": {len(v), s.Batch * s.TK * s.DV},
	}); err != nil {
		return err
	}
	if s.Batch == 0 || s.TQ == 0 {
		return nil
	}
	qp, kp := s.positions()
	sorted := slices.IsSorted(kp)
	bq := min(blockRows(s.TK), s.TQ)
	cuts := rowTiles(qp, bq)
	tiles := len(cuts) - 1
	forRows(w, s.Batch*tiles, bq*s.TK*(s.DH+s.DV), func(lo, hi int) {
		g := newBlockGEMM(b, s, bq)
		sc := make([]T, bq*s.TK)
		inv := make([]float64, bq)
		for t := lo; t < hi; t++ {
			h, i0 := t/tiles, cuts[t%tiles]
			rows := cuts[t%tiles+1] - i0
			r0 := h*s.TQ + i0
			ot := out[r0*s.DV : (r0+rows)*s.DV]
			n := s.visible(kp, sorted, slices.Max(qp[i0:i0+rows]))
			if n == 0 {
				clear(ot)
				for i := range rows {
					lse[r0+i] = T(math.Inf(-1))
				}
				continue
			}
			st := sc[:rows*n]
			blockGemm(g, false, true, rows, n, s.DH, T(s.Scale), q[r0*s.DH:], s.DH, k[h*s.TK*s.DH:], s.DH, 0, st, n)
			for i := range rows {
				x := st[i*n : (i+1)*n]
				nv := maskRow(s, x, kp, sorted, qp[i0+i])
				m := rowMax(x[:nv])
				if math.IsInf(m, -1) {
					clear(x)
					inv[i] = 0
					lse[r0+i] = T(m)
					continue
				}
				sum := expRow(x[:nv], m)
				clear(x[nv:])
				inv[i] = 1 / sum
				lse[r0+i] = T(m + math.Log(sum))
			}
			blockGemm(g, false, false, rows, s.DV, n, 1, st, n, v[h*s.TK*s.DV:], s.DV, 0, ot, s.DV)
			for i := range rows {
				oi := ot[i*s.DV : (i+1)*s.DV]
				for c, x := range oi {
					oi[c] = T(float64(x) * inv[i])
				}
			}
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
// dk and dv may be nil when not wanted. The products run as GEMMs (b's, as
// for BlockAttentionForward) on tiles of Q rows, accumulating in T into
// the gradients; p and ds are computed in float64 and rounded to T. The
// heads are shared out to up to w goroutines. Errors wrap ErrInvalid
// (negative sizes, lengths that do not fit the shape).
func BlockAttentionBackward[T Float](b *BLAS, w Workers, dq, dk, dv, dout, q, k, v, lse, delta []T, s BlockAttnShape) error {
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
	if s.Batch == 0 || s.TQ == 0 || s.TK == 0 || dq == nil && dk == nil && dv == nil {
		return nil
	}
	qp, kp := s.positions()
	sorted := slices.IsSorted(kp)
	bq := min(blockRows(s.TK), s.TQ)
	cuts := rowTiles(qp, bq)
	// Heads are independent: split over them, so each goroutine owns its
	// heads' rows of dk and dv.
	forRows(w, s.Batch, s.TQ*s.TK*(s.DH+s.DV), func(lo, hi int) {
		g := newBlockGEMM(b, s, bq)
		pb, db := make([]T, bq*s.TK), make([]T, bq*s.TK)
		for h := lo; h < hi; h++ {
			kh, vh := k[h*s.TK*s.DH:(h+1)*s.TK*s.DH], v[h*s.TK*s.DV:(h+1)*s.TK*s.DV]
			for ti := range len(cuts) - 1 {
				i0, rows := cuts[ti], cuts[ti+1]-cuts[ti]
				r0 := h*s.TQ + i0
				n := s.visible(kp, sorted, slices.Max(qp[i0:i0+rows]))
				if n == 0 {
					continue
				}
				p, ds := pb[:rows*n], db[:rows*n]
				qt, gt := q[r0*s.DH:(r0+rows)*s.DH], dout[r0*s.DV:(r0+rows)*s.DV]
				blockGemm(g, false, true, rows, n, s.DH, T(s.Scale), qt, s.DH, kh, s.DH, 0, p, n)
				for i := range rows {
					x := p[i*n : (i+1)*n]
					l := float64(lse[r0+i])
					if math.IsInf(l, -1) {
						clear(x) // the row sees no key anywhere
						continue
					}
					nv := maskRow(s, x, kp, sorted, qp[i0+i])
					expRow(x[:nv], l)
					clear(x[nv:])
				}
				if dv != nil {
					blockGemm(g, true, false, n, s.DV, rows, 1, p, n, gt, s.DV, 1, dv[h*s.TK*s.DV:], s.DV)
				}
				if dq == nil && dk == nil {
					continue
				}
				// dP = dout·vᵀ, then ds = p·(dP − delta)·Scale.
				blockGemm(g, false, true, rows, n, s.DV, 1, gt, s.DV, vh, s.DV, 0, ds, n)
				for i := range rows {
					dl := float64(delta[r0+i])
					pi, di := p[i*n:(i+1)*n], ds[i*n:(i+1)*n]
					for j, e := range pi {
						di[j] = T(float64(e) * (float64(di[j]) - dl) * s.Scale)
					}
				}
				if dq != nil {
					blockGemm(g, false, false, rows, s.DH, n, 1, ds, n, kh, s.DH, 1, dq[r0*s.DH:], s.DH)
				}
				if dk != nil {
					blockGemm(g, true, false, n, s.DH, rows, 1, ds, n, qt, s.DH, 1, dk[h*s.TK*s.DH:], s.DH)
				}
			}
		}
	})
	return nil
}
