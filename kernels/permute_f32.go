package kernels

// Float32 copies of the row loops of Unpermute and UnpermuteBackward (and
// their segmented and per-expert forms), which call the AVX2 kernels of
// vec_amd64.s directly. The generic loops of permute.go, compiled once for
// every element type, reached them only through type assertions and a
// wrapper call per row: at 512 tokens of 256 float32 in cache, one worker,
// Unpermute took 45–51 µs that way and takes 40–42 µs here (the two timed
// in turn in one process). The vector kernels run the same unfused IEEE
// operations in the same order as the portable loops, which take the last
// len mod 8 elements of a row and whole rows on CPUs without AVX2, so
// Unpermute gives the same bits either way
// (TestFloat32LoopsMatchPortable); the gate gradient's sums take the order
// of scaleDotF32AVX2 over the first multiple of 8 (TestScaleDotOrder).

// vecLen returns how many leading elements of a row of n the vector
// kernels take: a multiple of 8, or 0 without AVX2.
func vecLen(n int) int {
	if !haveVec || n < 8 {
		return 0
	}
	return n &^ 7
}

// scaleF32 is permScale for float32.
func scaleF32(o, x []float32, g float32) {
	x = x[:len(o)]
	n := vecLen(len(o))
	if n > 0 {
		scaleF32AVX2(&o[0], &x[0], n, g)
	}
	permScale(o[n:], x[n:], g)
}

// axpyF32 is permAxpy for float32.
func axpyF32(o, x []float32, g float32) {
	x = x[:len(o)]
	n := vecLen(len(o))
	if n > 0 {
		axpyF32AVX2(&o[0], &x[0], n, g)
	}
	permAxpy(o[n:], x[n:], g)
}

// unpermuteF32 is unpermute's loop for float32.
func unpermuteF32(out []float32, src packedRows[float32], gates []float32, d int, r *Routing) {
	permForRows(r.Workers, r.Tokens, (r.TopK+1)*d*4, func(lo, hi int) {
		unpermuteF32Tokens(out, src, gates, d, r, lo, hi)
	})
}

// unpermuteF32Tokens runs unpermuteF32 over tokens [lo, hi), pairing live
// slots as unpermuteGo does.
func unpermuteF32Tokens(out []float32, src packedRows[float32], gates []float32, d int, r *Routing, lo, hi int) {
	k, n := r.TopK, vecLen(d)
	for t := lo; t < hi; t++ {
		o := out[t*d : t*d+d]
		first := true
		var x0 []float32
		var g0 float32
		for s := t * k; s < t*k+k; s++ {
			p := int(r.SlotRow[s])
			if p < 0 {
				continue
			}
			g := float32(1)
			if gates != nil {
				g = gates[s]
			}
			if x0 == nil {
				x0, g0 = src.row(p, r.Offsets), g
				continue
			}
			x1 := src.row(p, r.Offsets)
			if n > 0 {
				pairF32AVX2(&o[0], &x0[0], &x1[0], n, g0, g, first)
			}
			if n < d {
				permPair(o[n:], x0[n:], x1[n:], g0, g, first)
			}
			x0, first = nil, false
		}
		switch {
		case x0 != nil && first && gates == nil:
			copy(o, x0)
		case x0 != nil && first:
			scaleF32(o, x0, g0)
		case x0 != nil:
			axpyF32(o, x0, g0)
		case first:
			clear(o)
		}
	}
}

// unpermuteBackwardF32 is unpermuteBackwardRows's loop for float32.
func unpermuteBackwardF32(w Workers, dpacked, dgates, dout, packed, gates []float32, idx []int32, k, d int) {
	permForRows(w, len(idx), 3*d*4, func(lo, hi int) {
		unpermuteBackwardF32Rows(dpacked, dgates, dout, packed, gates, idx, k, d, lo, hi)
	})
}

// unpermuteBackwardF32Rows runs unpermuteBackwardF32 over rows [lo, hi).
func unpermuteBackwardF32Rows(dpacked, dgates, dout, packed, gates []float32, idx []int32, k, d, lo, hi int) {
	n := vecLen(d)
	var o, y []float32
	for i := lo; i < hi; i++ {
		if dpacked != nil {
			o = dpacked[i*d : i*d+d]
		}
		s := int(idx[i])
		if s < 0 {
			clear(o)
			continue
		}
		g := float32(1)
		if gates != nil {
			g = gates[s]
		}
		t := s / k
		x := dout[t*d : t*d+d]
		if dgates == nil { // o is not nil: the caller asked for something
			scaleF32(o, x, g)
			continue
		}
		y = packed[i*d : i*d+d]
		dot := 0.0
		var rest []float32
		if n > 0 {
			var dst *float32
			if o != nil {
				dst = &o[0]
			}
			dot = scaleDotF32AVX2(dst, &x[0], &y[0], n, g, o != nil)
		}
		if o != nil {
			rest = o[n:]
		}
		dgates[s] = float32(permScaleDot(rest, x[n:], y[n:], g, dot))
	}
}
