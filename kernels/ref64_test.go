package kernels

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"testing"
)

// The float64-computed kernels against independent references: other
// formulas (erfc for Φ, softmax without the max shift, full Jacobians for
// the backwards), in float64, on 0, 1, 3 and 17 rows of widths 1, 7 and
// 33. Tolerance: tol64 (a few hundred float64 ulps, for the different
// summation orders and formulas) times the largest reference magnitude
// for float64 results, and tol32 (a few float32 ulps: one rounding of an
// accurate value) for float32 results.

const (
	tol64 = 1e-13
	tol32 = 4 * ulp32
)

func tolOf[T Float]() float64 {
	var z T
	if _, ok := any(z).(float32); ok {
		return tol32
	}
	return tol64
}

// near fails t when some got[i] differs from want[i] by more than
// tol·max(1, max|want|).
func near[T Float](t *testing.T, name string, got []T, want []float64) {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("%s: %d values, want %d", name, len(got), len(want))
	}
	scale := 1.0
	for _, w := range want {
		scale = max(scale, math.Abs(w))
	}
	tol := tolOf[T]() * scale
	for i, g := range got {
		if d := math.Abs(float64(g) - want[i]); !(d <= tol) {
			t.Fatalf("%s: [%d] = %v, want %v (|Δ| %.3g > %.3g)", name, i, g, want[i], d, tol)
		}
	}
}

func near64(t *testing.T, name string, got, want []float64) {
	t.Helper()
	near(t, name, got, want)
}

func TestGELU64(t *testing.T) {
	t.Run("float32", testGELU64[float32])
	t.Run("float64", testGELU64[float64])
}

func testGELU64[T Float](t *testing.T) {
	rng := rand.New(rand.NewPCG(21, 22))
	for _, r := range tensorRows {
		for _, w := range tensorWidths {
			x, g := randT[T](rng, r*w), randT[T](rng, r*w)
			y, erfs, dx := make([]T, len(x)), make([]float64, len(x)), make([]T, len(x))
			if err := GELU64(Workers(2), y, erfs, x); err != nil {
				t.Fatal(err)
			}
			if err := GELU64Backward(Workers(2), dx, x, erfs, g); err != nil {
				t.Fatal(err)
			}
			wy, wd := make([]float64, len(x)), make([]float64, len(x))
			for i, v := range x {
				f := float64(v)
				phi := 0.5 * math.Erfc(-f/math.Sqrt2)
				wy[i] = f * phi
				wd[i] = float64(g[i]) * (phi + f*math.Exp(-f*f/2)/math.Sqrt(2*math.Pi))
			}
			name := fmt.Sprintf("%d×%d", r, w)
			near(t, "GELU64 "+name, y, wy)
			near(t, "GELU64Backward "+name, dx, wd)
		}
	}
}

// lines calls f with the element indices of every line along the middle
// dim of [outer, n, inner].
func lines(outer, n, inner int, f func(idx []int)) {
	for o := range outer {
		for in := range inner {
			idx := make([]int, n)
			for k := range idx {
				idx[k] = (o*n+k)*inner + in
			}
			f(idx)
		}
	}
}

// softmaxRef is exp(x)/Σ exp(x), unshifted (the inputs are small).
func softmaxRef(x []float64) []float64 {
	s := 0.0
	for _, v := range x {
		s += math.Exp(v)
	}
	p := make([]float64, len(x))
	for i, v := range x {
		p[i] = math.Exp(v) / s
	}
	return p
}

func TestSoftmax64(t *testing.T) {
	t.Run("float32", testSoftmax64[float32])
	t.Run("float64", testSoftmax64[float64])
}

func testSoftmax64[T Float](t *testing.T) {
	rng := rand.New(rand.NewPCG(23, 24))
	for _, outer := range tensorRows {
		for _, inner := range []int{1, 3} {
			for _, n := range tensorWidths {
				for _, logOut := range []bool{false, true} {
					name := fmt.Sprintf("[%d,%d,%d] log %v", outer, n, inner, logOut)
					x, g := randT[T](rng, outer*n*inner), randT[T](rng, outer*n*inner)
					y, dx := make([]T, len(x)), make([]T, len(x))
					if err := Softmax64(y, x, outer, n, inner, logOut); err != nil {
						t.Fatal(err)
					}
					if err := Softmax64Backward(dx, y, g, outer, n, inner, logOut); err != nil {
						t.Fatal(err)
					}
					wy, wd := make([]float64, len(x)), make([]float64, len(x))
					lines(outer, n, inner, func(idx []int) {
						xs := make([]float64, n)
						for k, i := range idx {
							xs[k] = float64(x[i])
						}
						p := softmaxRef(xs)
						// dx_k = Σ_j g_j ∂y_j/∂x_k, the Jacobian written out.
						for k, i := range idx {
							if logOut {
								wy[i] = math.Log(p[k])
							} else {
								wy[i] = p[k]
							}
							for j, ij := range idx {
								var jac float64
								switch {
								case logOut && j == k:
									jac = 1 - p[k]
								case logOut:
									jac = -p[k]
								case j == k:
									jac = p[j] * (1 - p[k])
								default:
									jac = -p[j] * p[k]
								}
								wd[i] += float64(g[ij]) * jac
							}
						}
					})
					near(t, "Softmax64 "+name, y, wy)
					near(t, "Softmax64Backward "+name, dx, wd)
				}
			}
		}
	}
}

func TestCausalSoftmax64(t *testing.T) {
	t.Run("float32", testCausalSoftmax64[float32])
	t.Run("float64", testCausalSoftmax64[float64])
}

func testCausalSoftmax64[T Float](t *testing.T) {
	rng := rand.New(rand.NewPCG(25, 26))
	for _, blocks := range []int{0, 1, 3} {
		for _, tt := range []int{1, 7, 17} {
			x := randT[T](rng, blocks*tt*tt)
			y := sentinel[T](len(x))
			if err := CausalSoftmax64(y, x, tt); err != nil {
				t.Fatal(err)
			}
			want := make([]float64, len(x))
			for b := range blocks {
				for i := range tt {
					row := make([]float64, i+1)
					for j := range row {
						row[j] = float64(x[(b*tt+i)*tt+j])
					}
					copy(want[(b*tt+i)*tt:], softmaxRef(row))
				}
			}
			near(t, fmt.Sprintf("CausalSoftmax64 %d blocks of %d", blocks, tt), y, want)
		}
	}
}

func TestCrossEntropy64(t *testing.T) {
	t.Run("float32", testCrossEntropy64[float32])
	t.Run("float64", testCrossEntropy64[float64])
}

func testCrossEntropy64[T Float](t *testing.T) {
	rng := rand.New(rand.NewPCG(27, 28))
	for _, rows := range tensorRows {
		for _, v := range tensorWidths {
			name := fmt.Sprintf("%d rows of %d", rows, v)
			x := randT[T](rng, rows*v)
			tg := make([]int64, rows)
			for i := range tg {
				tg[i] = rng.Int64N(int64(v))
			}
			sm := make([]float64, len(x))
			total, err := CrossEntropy64(sm, x, tg, v)
			if err != nil {
				t.Fatal(err)
			}
			const scale = 0.3
			dx := make([]T, len(x))
			if err := CrossEntropy64Backward(dx, sm, tg, v, scale); err != nil {
				t.Fatal(err)
			}
			wantTotal := 0.0
			wsm, wd := make([]float64, len(x)), make([]float64, len(x))
			for r := range rows {
				row := make([]float64, v)
				for k := range row {
					row[k] = float64(x[r*v+k])
				}
				p := softmaxRef(row)
				wantTotal -= math.Log(p[tg[r]])
				copy(wsm[r*v:], p)
				for k := range p {
					wd[r*v+k] = scale * p[k]
				}
				wd[r*v+int(tg[r])] -= scale
			}
			near64(t, "CrossEntropy64 total "+name, []float64{total}, []float64{wantTotal})
			near64(t, "CrossEntropy64 softmax "+name, sm, wsm)
			near(t, "CrossEntropy64Backward "+name, dx, wd)
		}
	}
}

func TestLayerNorm64(t *testing.T) {
	t.Run("float32", testLayerNorm64[float32])
	t.Run("float64", testLayerNorm64[float64])
}

func testLayerNorm64[T Float](t *testing.T) {
	rng := rand.New(rand.NewPCG(29, 30))
	const eps = 1e-5
	for _, rows := range tensorRows {
		for _, n := range tensorWidths {
			name := fmt.Sprintf("%d rows of %d", rows, n)
			x, g := randT[T](rng, rows*n), randT[T](rng, rows*n)
			w, b := randT[T](rng, n), randT[T](rng, n)
			y, xhat, rstd := make([]T, len(x)), make([]float64, len(x)), make([]float64, rows)
			if err := LayerNorm64(y, xhat, rstd, x, w, b, n, eps); err != nil {
				t.Fatal(err)
			}
			dx, dw, db := make([]T, len(x)), make([]T, n), make([]T, n)
			if err := LayerNorm64Backward(dx, dw, db, g, w, xhat, rstd, n); err != nil {
				t.Fatal(err)
			}
			wy, wh, wd := make([]float64, len(x)), make([]float64, len(x)), make([]float64, len(x))
			wdw, wdb := make([]float64, n), make([]float64, n)
			for r := range rows {
				mu, sq := 0.0, 0.0
				for k := range n {
					mu += float64(x[r*n+k])
					sq += float64(x[r*n+k]) * float64(x[r*n+k])
				}
				mu /= float64(n)
				rs := 1 / math.Sqrt(sq/float64(n)-mu*mu+eps)
				h := make([]float64, n)
				for k := range n {
					h[k] = (float64(x[r*n+k]) - mu) * rs
					wh[r*n+k] = h[k]
					wy[r*n+k] = h[k]*float64(w[k]) + float64(b[k])
					wdw[k] += float64(g[r*n+k]) * h[k]
					wdb[k] += float64(g[r*n+k])
				}
				// ∂y_k/∂x_j = w_k·rs·(δ_jk − 1/n − x̂_j·x̂_k/n).
				for j := range n {
					for k := range n {
						jac := -1/float64(n) - h[j]*h[k]/float64(n)
						if j == k {
							jac++
						}
						wd[r*n+j] += float64(g[r*n+k]) * float64(w[k]) * rs * jac
					}
				}
			}
			near(t, "LayerNorm64 "+name, y, wy)
			near64(t, "LayerNorm64 xhat "+name, xhat, wh)
			near(t, "LayerNorm64Backward dx "+name, dx, wd)
			near(t, "LayerNorm64Backward dw "+name, dw, wdw)
			near(t, "LayerNorm64Backward db "+name, db, wdb)
			// Only some gradients: the others are not computed.
			dw2 := make([]T, n)
			if err := LayerNorm64Backward(nil, dw2, nil, g, w, xhat, rstd, n); err != nil {
				t.Fatal(err)
			}
			near(t, "LayerNorm64Backward dw alone "+name, dw2, wdw)
		}
	}
}

func TestRef64Invalid(t *testing.T) {
	x := make([]float64, 6)
	for _, c := range []struct {
		name string
		err  error
	}{
		{"GELU64 erfs", GELU64(Workers(1), x, x[:5], x)},
		{"GELU64Backward g", GELU64Backward(Workers(1), x, x, x, x[:5])},
		{"Softmax64 shape", Softmax64(x, x, 2, 2, 2, false)},
		{"Softmax64 negative", Softmax64(x, x, -1, 2, 3, false)},
		{"Softmax64Backward dx", Softmax64Backward(x[:5], x, x, 2, 3, 1, true)},
		{"CausalSoftmax64 blocks", CausalSoftmax64(x, x, 2)},
		{"CausalSoftmax64 dst", CausalSoftmax64(x[:3], x[:4], 2)},
		{"CrossEntropy64 target", errOf(CrossEntropy64(x, x, []int64{0, 3}, 3))},
		{"CrossEntropy64 rows", errOf(CrossEntropy64(x, x, []int64{0}, 3))},
		{"CrossEntropy64 sm", errOf(CrossEntropy64(x[:5], x, []int64{0, 1}, 3))},
		{"CrossEntropy64Backward target", CrossEntropy64Backward(x, x, []int64{-1, 0}, 3, 1)},
		{"LayerNorm64 eps", LayerNorm64(x, x, x[:2], x, x[:3], x[:3], 3, -1)},
		{"LayerNorm64 rstd", LayerNorm64(x, x, x[:1], x, x[:3], x[:3], 3, 0)},
		{"LayerNorm64Backward dw", LayerNorm64Backward(nil, x[:2], nil, x, x[:3], x, x[:2], 3)},
	} {
		if !errors.Is(c.err, ErrInvalid) {
			t.Errorf("%s: %v, want ErrInvalid", c.name, c.err)
		}
	}
}

func errOf(_ float64, err error) error { return err }
