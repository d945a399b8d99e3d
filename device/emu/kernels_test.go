package emu_test

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"sort"
	"testing"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/device/emu"
	"github.com/b7ea7098/loom/internal/half"
	"github.com/b7ea7098/loom/kernels"
)

// arrays are a kernel's arguments by name: []float32, []float64, []int64,
// []comm.BFloat16Bits or []comm.Float16Bits.
type arrays map[string]any

// kernelCase is one Kernels method on odd shapes: setup makes the
// arguments (inputs and outputs), cpu runs the CPU kernel the host path
// calls on them, dev the Kernels method on device copies. Every array is
// then compared bit for bit, inputs included.
type kernelCase struct {
	name  string
	setup func(r *rand.Rand, w kernels.Workers) arrays
	cpu   func(b *kernels.BLAS, w kernels.Workers, a arrays) error
	dev   func(k device.Kernels, b map[string]device.Buffer) error
}

func randF32(r *rand.Rand, n int) []float32 {
	s := make([]float32, n)
	for i := range s {
		s[i] = float32(r.Float64()*4 - 2)
	}
	return s
}

func randTargets(r *rand.Rand, n, v int) []int64 {
	s := make([]int64, n)
	for i := range s {
		s[i] = int64(r.IntN(v))
	}
	return s
}

// odd shapes, shared by the cases.
const (
	rows  = 7
	cols  = 13
	vocab = 11
)

var attn = device.AttnShape{Batch: 3, T: 5, DH: 7, DV: 3, Scale: 0.37}

func f32s(a any) []float32 { return a.([]float32) }
func f64s(a any) []float64 { return a.([]float64) }
func i64s(a any) []int64   { return a.([]int64) }

func kernelCases() []kernelCase {
	gemm := func(name string, transA, transB bool, batch int, dt comm.DType, beta float64, prec device.GemmPrecision) kernelCase {
		const m, n, k = 7, 5, 9
		lda, ldb, ldc := k+2, n+1, n+3
		if transA {
			lda = m + 1
		}
		if transB {
			ldb = k + 3
		}
		aRows, bRows := m, k
		if transA {
			aRows = k
		}
		if transB {
			bRows = n
		}
		sa, sb, sc := aRows*lda+1, bRows*ldb+2, m*ldc+3
		alpha := 0.75
		return kernelCase{
			name: name,
			setup: func(r *rand.Rand, _ kernels.Workers) arrays {
				a, b, c := randF32(r, batch*sa), randF32(r, batch*sb), randF32(r, batch*sc)
				if dt == comm.Float64 {
					return arrays{"a": widen(a), "b": widen(b), "c": widen(c)}
				}
				return arrays{"a": a, "b": b, "c": c}
			},
			cpu: func(bl *kernels.BLAS, _ kernels.Workers, x arrays) error {
				for i := range batch {
					var err error
					if dt == comm.Float64 {
						a, b, c := f64s(x["a"]), f64s(x["b"]), f64s(x["c"])
						err = bl.Dgemm(transA, transB, m, n, k, alpha, a[i*sa:(i+1)*sa], lda, b[i*sb:(i+1)*sb], ldb, beta, c[i*sc:(i+1)*sc], ldc)
					} else {
						a, b, c := f32s(x["a"]), f32s(x["b"]), f32s(x["c"])
						if prec == device.GemmBF16 { // autocast: rounded copies, inputs unchanged
							a, b = slices.Clone(a), slices.Clone(b)
							half.RoundBFloat16s(a, a)
							half.RoundBFloat16s(b, b)
						}
						err = bl.Sgemm(transA, transB, m, n, k, float32(alpha), a[i*sa:(i+1)*sa], lda, b[i*sb:(i+1)*sb], ldb, float32(beta), c[i*sc:(i+1)*sc], ldc)
					}
					if err != nil {
						return err
					}
				}
				return nil
			},
			dev: func(kk device.Kernels, b map[string]device.Buffer) error {
				return kk.Gemm(device.Gemm{TransA: transA, TransB: transB, M: m, N: n, K: k, A: b["a"], B: b["b"], C: b["c"],
					LDA: lda, LDB: ldb, LDC: ldc, Alpha: alpha, Beta: beta, Batch: batch, StrideA: sa, StrideB: sb, StrideC: sc, Precision: prec})
			},
		}
	}
	return append([]kernelCase{
		gemm("Gemm/f32/NN", false, false, 1, comm.Float32, 0, device.GemmF32),
		gemm("Gemm/f32/TN/beta", true, false, 1, comm.Float32, 1, device.GemmF32),
		gemm("Gemm/f32/NT/batch3", false, true, 3, comm.Float32, 0.5, device.GemmF32),
		gemm("Gemm/f64/TT/batch2", true, true, 2, comm.Float64, 1, device.GemmF32),
		gemm("Gemm/bf16/NN", false, false, 1, comm.Float32, 0, device.GemmBF16),
		gemm("Gemm/bf16/TT/batch2/beta", true, true, 2, comm.Float32, 0.5, device.GemmBF16),
		{
			name:  "Fill/f32",
			setup: func(r *rand.Rand, _ kernels.Workers) arrays { return arrays{"x": randF32(r, 37)} },
			cpu: func(_ *kernels.BLAS, _ kernels.Workers, a arrays) error {
				for i := range f32s(a["x"]) {
					f32s(a["x"])[i] = float32(0.1)
				}
				return nil
			},
			dev: func(k device.Kernels, b map[string]device.Buffer) error { return k.Fill(b["x"], 0.1) },
		},
		{
			name: "Fill/bf16",
			setup: func(r *rand.Rand, _ kernels.Workers) arrays {
				return arrays{"x": make([]comm.BFloat16Bits, 29)}
			},
			cpu: func(_ *kernels.BLAS, _ kernels.Workers, a arrays) error {
				x := a["x"].([]comm.BFloat16Bits)
				for i := range x {
					x[i] = comm.BFloat16Bits(half.ToBFloat16(float32(0.1)))
				}
				return nil
			},
			dev: func(k device.Kernels, b map[string]device.Buffer) error { return k.Fill(b["x"], 0.1) },
		},
		{
			name: "Cast/f32-bf16-f32",
			setup: func(r *rand.Rand, _ kernels.Workers) arrays {
				return arrays{"x": randF32(r, 31), "h": make([]comm.BFloat16Bits, 31), "y": make([]float32, 31)}
			},
			cpu: func(_ *kernels.BLAS, _ kernels.Workers, a arrays) error {
				x, h, y := f32s(a["x"]), a["h"].([]comm.BFloat16Bits), f32s(a["y"])
				for i := range x {
					h[i] = comm.BFloat16Bits(half.ToBFloat16(x[i]))
					y[i] = half.BFloat16ToFloat32(uint16(h[i]))
				}
				return nil
			},
			dev: func(k device.Kernels, b map[string]device.Buffer) error {
				if err := k.Cast(b["h"], b["x"]); err != nil {
					return err
				}
				return k.Cast(b["y"], b["h"])
			},
		},
		{
			name: "Cast/f32-f16-f64",
			setup: func(r *rand.Rand, _ kernels.Workers) arrays {
				return arrays{"x": randF32(r, 31), "h": make([]comm.Float16Bits, 31), "y": make([]float32, 31), "z": make([]float64, 31)}
			},
			cpu: func(_ *kernels.BLAS, _ kernels.Workers, a arrays) error {
				x, h, y, z := f32s(a["x"]), a["h"].([]comm.Float16Bits), f32s(a["y"]), f64s(a["z"])
				for i := range x {
					h[i] = comm.Float16Bits(half.ToFloat16(x[i]))
					y[i] = half.Float16ToFloat32(uint16(h[i]))
					z[i] = float64(y[i])
				}
				return nil
			},
			dev: func(k device.Kernels, b map[string]device.Buffer) error {
				if err := k.Cast(b["h"], b["x"]); err != nil {
					return err
				}
				if err := k.Cast(b["y"], b["h"]); err != nil {
					return err
				}
				return k.Cast(b["z"], b["y"])
			},
		},
		{
			name: "Add",
			setup: func(r *rand.Rand, _ kernels.Workers) arrays {
				return arrays{"d": make([]float32, 37), "a": randF32(r, 37), "b": randF32(r, 37)}
			},
			cpu: func(_ *kernels.BLAS, _ kernels.Workers, a arrays) error {
				return kernels.Add(f32s(a["d"]), f32s(a["a"]), f32s(a["b"]))
			},
			dev: func(k device.Kernels, b map[string]device.Buffer) error { return k.Add(b["d"], b["a"], b["b"]) },
		},
		{
			name: "Mul/in-place",
			setup: func(r *rand.Rand, _ kernels.Workers) arrays {
				return arrays{"a": randF32(r, 37), "b": randF32(r, 37)}
			},
			cpu: func(_ *kernels.BLAS, _ kernels.Workers, a arrays) error {
				return kernels.Mul(f32s(a["a"]), f32s(a["a"]), f32s(a["b"]))
			},
			dev: func(k device.Kernels, b map[string]device.Buffer) error { return k.Mul(b["a"], b["a"], b["b"]) },
		},
		{
			name: "ColumnSums",
			setup: func(r *rand.Rand, _ kernels.Workers) arrays {
				return arrays{"o": make([]float32, cols), "x": randF32(r, rows*cols)}
			},
			cpu: func(_ *kernels.BLAS, _ kernels.Workers, a arrays) error {
				return kernels.ColumnSums(f32s(a["o"]), f32s(a["x"]), cols)
			},
			dev: func(k device.Kernels, b map[string]device.Buffer) error { return k.ColumnSums(b["o"], b["x"], cols) },
		},
		softmaxCase(false),
		softmaxCase(true),
		{
			name: "CausalSoftmax+Backward",
			setup: func(r *rand.Rand, _ kernels.Workers) arrays {
				n := 3 * 6 * 6
				return arrays{"y": make([]float32, n), "x": randF32(r, n), "dy": randF32(r, n), "dx": make([]float32, n)}
			},
			cpu: func(_ *kernels.BLAS, w kernels.Workers, a arrays) error {
				if err := kernels.CausalSoftmax(w, f32s(a["y"]), f32s(a["x"]), 6, 0.7); err != nil {
					return err
				}
				return kernels.CausalSoftmaxBackward(f32s(a["dx"]), f32s(a["y"]), f32s(a["dy"]), 6, 0.7)
			},
			dev: func(k device.Kernels, b map[string]device.Buffer) error {
				if err := k.CausalSoftmax(b["y"], b["x"], 6, 0.7); err != nil {
					return err
				}
				return k.CausalSoftmaxBackward(b["dx"], b["y"], b["dy"], 6, 0.7)
			},
		},
		{
			name: "LayerNorm+Backward",
			setup: func(r *rand.Rand, _ kernels.Workers) arrays {
				n := rows * cols
				x := randF32(r, n)
				for i := range x {
					x[i] += 3 // a mean away from 0
				}
				return arrays{"y": make([]float32, n), "mean": make([]float64, rows), "rstd": make([]float64, rows), "x": x,
					"w": randF32(r, cols), "b": randF32(r, cols), "dy": randF32(r, n),
					"dx": make([]float32, n), "dw": make([]float32, cols), "db": make([]float32, cols)}
			},
			cpu: func(_ *kernels.BLAS, _ kernels.Workers, a arrays) error {
				if err := kernels.LayerNorm(f32s(a["y"]), f64s(a["mean"]), f64s(a["rstd"]), f32s(a["x"]), f32s(a["w"]), f32s(a["b"]), cols, 1e-5); err != nil {
					return err
				}
				return kernels.LayerNormBackward(f32s(a["dx"]), f32s(a["dw"]), f32s(a["db"]), f32s(a["dy"]), f32s(a["x"]), f32s(a["w"]),
					f64s(a["mean"]), f64s(a["rstd"]), cols)
			},
			dev: func(k device.Kernels, b map[string]device.Buffer) error {
				if err := k.LayerNorm(b["y"], b["mean"], b["rstd"], b["x"], b["w"], b["b"], cols, 1e-5); err != nil {
					return err
				}
				return k.LayerNormBackward(b["dx"], b["dw"], b["db"], b["dy"], b["x"], b["w"], b["mean"], b["rstd"], cols)
			},
		},
		{
			name: "LayerNorm/no-affine",
			setup: func(r *rand.Rand, _ kernels.Workers) arrays {
				return arrays{"y": make([]float32, rows*cols), "x": randF32(r, rows*cols)}
			},
			cpu: func(_ *kernels.BLAS, _ kernels.Workers, a arrays) error {
				return kernels.LayerNorm(f32s(a["y"]), nil, nil, f32s(a["x"]), nil, nil, cols, 1e-5)
			},
			dev: func(k device.Kernels, b map[string]device.Buffer) error {
				return k.LayerNorm(b["y"], nil, nil, b["x"], nil, nil, cols, 1e-5)
			},
		},
		{
			name: "BiasGELU+Backward",
			setup: func(r *rand.Rand, _ kernels.Workers) arrays {
				n := rows * cols
				return arrays{"y": make([]float32, n), "deriv": make([]float32, n), "x": randF32(r, n), "bias": randF32(r, cols),
					"dy": randF32(r, n), "dx": make([]float32, n), "dbias": make([]float32, cols)}
			},
			cpu: func(_ *kernels.BLAS, w kernels.Workers, a arrays) error {
				if err := kernels.BiasGELU(w, f32s(a["y"]), f32s(a["deriv"]), f32s(a["x"]), f32s(a["bias"]), cols); err != nil {
					return err
				}
				return kernels.BiasGELUBackward(f32s(a["dx"]), f32s(a["dbias"]), f32s(a["dy"]), f32s(a["deriv"]), cols)
			},
			dev: func(k device.Kernels, b map[string]device.Buffer) error {
				if err := k.BiasGELU(b["y"], b["deriv"], b["x"], b["bias"], cols); err != nil {
					return err
				}
				return k.BiasGELUBackward(b["dx"], b["dbias"], b["dy"], b["deriv"], cols)
			},
		},
		{
			name: "Attention+Backward",
			setup: func(r *rand.Rand, _ kernels.Workers) arrays {
				s := attn
				qk, vv, pp := s.Batch*s.T*s.DH, s.Batch*s.T*s.DV, s.Batch*s.T*s.T
				return arrays{"out": make([]float32, vv), "probs": make([]float32, pp), "q": randF32(r, qk), "k": randF32(r, qk), "v": randF32(r, vv),
					"g": randF32(r, vv), "dq": make([]float32, qk), "dk": make([]float32, qk), "dv": make([]float32, vv)}
			},
			cpu: func(_ *kernels.BLAS, w kernels.Workers, a arrays) error {
				s := attn
				if err := kernels.CausalAttentionForward(w, f32s(a["out"]), f32s(a["probs"]), f32s(a["q"]), f32s(a["k"]), f32s(a["v"]), s.Batch, s.T, s.DH, s.DV, s.Scale); err != nil {
					return err
				}
				return kernels.CausalAttentionBackward(w, f32s(a["dq"]), f32s(a["dk"]), f32s(a["dv"]), f32s(a["g"]), f32s(a["probs"]),
					f32s(a["q"]), f32s(a["k"]), f32s(a["v"]), s.Batch, s.T, s.DH, s.DV, s.Scale)
			},
			dev: func(k device.Kernels, b map[string]device.Buffer) error {
				if err := k.Attention(b["out"], b["probs"], b["q"], b["k"], b["v"], attn); err != nil {
					return err
				}
				return k.AttentionBackward(b["dq"], b["dk"], b["dv"], b["g"], b["probs"], b["q"], b["k"], b["v"], attn)
			},
		},
		{
			name: "CrossEntropy+Backward",
			setup: func(r *rand.Rand, _ kernels.Workers) arrays {
				return arrays{"loss": make([]float64, 1), "lse": make([]float64, rows), "logits": randF32(r, rows*vocab),
					"targets": randTargets(r, rows, vocab), "dx": make([]float32, rows*vocab)}
			},
			cpu: func(_ *kernels.BLAS, w kernels.Workers, a arrays) error {
				total, err := kernels.CrossEntropyRows(w, f64s(a["lse"]), f32s(a["logits"]), i64s(a["targets"]), vocab)
				if err != nil {
					return err
				}
				f64s(a["loss"])[0] = total
				return kernels.CrossEntropyRowsBackward(w, f32s(a["dx"]), f32s(a["logits"]), i64s(a["targets"]), f64s(a["lse"]), vocab, 1.0/rows)
			},
			dev: func(k device.Kernels, b map[string]device.Buffer) error {
				if err := k.CrossEntropy(b["loss"], b["lse"], b["logits"], b["targets"], vocab); err != nil {
					return err
				}
				return k.CrossEntropyBackward(b["dx"], b["logits"], b["targets"], b["lse"], vocab, 1.0/rows)
			},
		},
		adamwCase(comm.Float32),
		adamwCase(comm.Float64),
	}, slices.Concat(autogradCases(), followupCases(), moeCases(), blockAttnCases())...)
}

// followupCases are the kernels of A6's follow-ups: the softmax over a
// dim other than the last, and the cross entropy whose mean and
// backward scale stay on the device.
func followupCases() []kernelCase {
	var cases []kernelCase
	for _, log := range []bool{false, true} {
		cases = append(cases, kernelCase{
			name: fmt.Sprintf("SoftmaxDim+Backward/log=%v", log),
			setup: func(r *rand.Rand, _ kernels.Workers) arrays {
				return arrays{"x": randF32(r, 60), "y": make([]float32, 60), "dy": randF32(r, 60), "dx": make([]float32, 60)}
			},
			cpu: func(_ *kernels.BLAS, _ kernels.Workers, a arrays) error {
				if err := kernels.Softmax64(f32s(a["y"]), f32s(a["x"]), 3, 5, 4, log); err != nil {
					return err
				}
				return kernels.Softmax64Backward(f32s(a["dx"]), f32s(a["y"]), f32s(a["dy"]), 3, 5, 4, log)
			},
			dev: func(k device.Kernels, b map[string]device.Buffer) error {
				if err := k.SoftmaxDim(b["y"], b["x"], 3, 5, 4, log); err != nil {
					return err
				}
				return k.SoftmaxDimBackward(b["dx"], b["y"], b["dy"], 3, 5, 4, log)
			},
		})
	}
	cases = append(cases, float64Cases()...)
	const count = 3 * rows // the global rows: this rank holds a third
	return append(cases, kernelCase{
		name: "CrossEntropyMean+Backward",
		setup: func(r *rand.Rand, _ kernels.Workers) arrays {
			return arrays{"loss": make([]float32, 1), "lse": make([]float64, rows), "logits": randF32(r, rows*vocab),
				"targets": randTargets(r, rows, vocab), "dx": make([]float32, rows*vocab), "g": []float32{0.37}}
		},
		cpu: func(_ *kernels.BLAS, w kernels.Workers, a arrays) error {
			total, err := kernels.CrossEntropyRows(w, f64s(a["lse"]), f32s(a["logits"]), i64s(a["targets"]), vocab)
			if err != nil {
				return err
			}
			f32s(a["loss"])[0] = float32(total / count)
			scale := float64(f32s(a["g"])[0]) / count
			return kernels.CrossEntropyRowsBackward(w, f32s(a["dx"]), f32s(a["logits"]), i64s(a["targets"]), f64s(a["lse"]), vocab, scale)
		},
		dev: func(k device.Kernels, b map[string]device.Buffer) error {
			if err := k.CrossEntropyMean(b["loss"], b["lse"], b["logits"], b["targets"], vocab, count); err != nil {
				return err
			}
			return k.CrossEntropyMeanBackward(b["dx"], b["logits"], b["targets"], b["lse"], b["g"], vocab, count)
		},
	})
}

// autogradCases are the kernels autograd's ops on devices use (step A6).
func autogradCases() []kernelCase {
	shape, reduce := []int{3, 5, 4}, []bool{true, false, true}
	return []kernelCase{
		{
			name: "Scale",
			setup: func(r *rand.Rand, _ kernels.Workers) arrays {
				return arrays{"d": make([]float32, 37), "x": randF32(r, 37)}
			},
			cpu: func(_ *kernels.BLAS, _ kernels.Workers, a arrays) error {
				return kernels.Scale(f32s(a["d"]), f32s(a["x"]), float32(-0.3))
			},
			dev: func(k device.Kernels, b map[string]device.Buffer) error { return k.Scale(b["d"], b["x"], -0.3) },
		},
		{
			name: "FillRows",
			setup: func(r *rand.Rand, _ kernels.Workers) arrays {
				return arrays{"d": randF32(r, rows*cols), "row": randF32(r, cols)}
			},
			cpu: func(_ *kernels.BLAS, _ kernels.Workers, a arrays) error {
				return kernels.FillRows(f32s(a["d"]), f32s(a["row"]))
			},
			dev: func(k device.Kernels, b map[string]device.Buffer) error { return k.FillRows(b["d"], b["row"]) },
		},
		{
			name: "SumDims+BroadcastDims",
			setup: func(r *rand.Rand, _ kernels.Workers) arrays {
				return arrays{"x": randF32(r, 60), "s": make([]float32, 5), "g": randF32(r, 5), "out": make([]float32, 60)}
			},
			cpu: func(_ *kernels.BLAS, _ kernels.Workers, a arrays) error {
				if err := kernels.SumDims(f32s(a["s"]), f32s(a["x"]), shape, reduce); err != nil {
					return err
				}
				return kernels.BroadcastDims(f32s(a["out"]), f32s(a["g"]), shape, reduce)
			},
			dev: func(k device.Kernels, b map[string]device.Buffer) error {
				if err := k.SumDims(b["s"], b["x"], shape, reduce); err != nil {
					return err
				}
				return k.BroadcastDims(b["out"], b["g"], shape, reduce)
			},
		},
		{
			name: "PermuteDims",
			setup: func(r *rand.Rand, _ kernels.Workers) arrays {
				return arrays{"x": randF32(r, 60), "out": make([]float32, 60)}
			},
			cpu: func(_ *kernels.BLAS, _ kernels.Workers, a arrays) error {
				return kernels.PermuteDims(f32s(a["out"]), f32s(a["x"]), shape, []int{2, 0, 1})
			},
			dev: func(k device.Kernels, b map[string]device.Buffer) error {
				return k.PermuteDims(b["out"], b["x"], shape, []int{2, 0, 1})
			},
		},
		{
			name: "NarrowDim+PadDim+ConcatDim",
			setup: func(r *rand.Rand, _ kernels.Workers) arrays {
				return arrays{"x": randF32(r, 60), "n": make([]float32, 24), "g": randF32(r, 24), "p": randF32(r, 60),
					"y": randF32(r, 12), "c": make([]float32, 72)}
			},
			cpu: func(_ *kernels.BLAS, _ kernels.Workers, a arrays) error {
				if err := kernels.NarrowDim(f32s(a["n"]), f32s(a["x"]), 3, 5, 4, 1, 2); err != nil {
					return err
				}
				if err := kernels.PadDim(f32s(a["p"]), f32s(a["g"]), 3, 2, 4, 3, 5); err != nil {
					return err
				}
				return kernels.ConcatDim(f32s(a["c"]), [][]float32{f32s(a["x"]), f32s(a["y"])}, []int{5, 1}, 3, 4)
			},
			dev: func(k device.Kernels, b map[string]device.Buffer) error {
				if err := k.NarrowDim(b["n"], b["x"], 3, 5, 4, 1, 2); err != nil {
					return err
				}
				if err := k.PadDim(b["p"], b["g"], 3, 2, 4, 3, 5); err != nil {
					return err
				}
				return k.ConcatDim(b["c"], []device.Buffer{b["x"], b["y"]}, []int{5, 1}, 3, 4)
			},
		},
		{
			name: "Embedding+Backward",
			setup: func(r *rand.Rand, _ kernels.Workers) arrays {
				ids := randTargets(r, rows, vocab+4) // some outside the block [2, 2+vocab)
				return arrays{"out": make([]float32, rows*cols), "table": randF32(r, vocab*cols), "ids": ids,
					"dt": make([]float32, vocab*cols), "acc": make([]float64, vocab*cols), "g": randF32(r, rows*cols)}
			},
			cpu: func(_ *kernels.BLAS, _ kernels.Workers, a arrays) error {
				if err := kernels.EmbeddingForward(f32s(a["out"]), f32s(a["table"]), i64s(a["ids"]), 2, cols); err != nil {
					return err
				}
				return kernels.EmbeddingBackward(f32s(a["dt"]), f64s(a["acc"]), f32s(a["g"]), i64s(a["ids"]), 2, cols)
			},
			dev: func(k device.Kernels, b map[string]device.Buffer) error {
				if err := k.Embedding(b["out"], b["table"], b["ids"], 2, cols); err != nil {
					return err
				}
				return k.EmbeddingBackward(b["dt"], b["acc"], b["g"], b["ids"], 2, cols)
			},
		},
		pointwiseCase(device.ReLU, kernels.ReLU[float32], kernels.ReLUBackward[float32], false),
		pointwiseCase(device.SiLU, kernels.SiLU[float32], kernels.SiLUBackward[float32], false),
		pointwiseCase(device.Tanh, kernels.Tanh[float32], kernels.TanhBackward[float32], true),
		pointwiseCase(device.Sigmoid, kernels.Sigmoid[float32], kernels.SigmoidBackward[float32], true),
		{
			name: "DropoutMask+ArgmaxRows",
			setup: func(r *rand.Rand, _ kernels.Workers) arrays {
				return arrays{"mask": make([]float32, 2*3*4), "x": randF32(r, rows*cols), "ix": make([]int64, rows)}
			},
			cpu: func(_ *kernels.BLAS, _ kernels.Workers, a arrays) error {
				if err := kernels.DropoutMask(f32s(a["mask"]), []int{1, 0, 2}, []int{2, 3, 4}, []int{3, 3, 7}, 0.3, 11, 5); err != nil {
					return err
				}
				return kernels.ArgmaxRows(i64s(a["ix"]), f32s(a["x"]), cols)
			},
			dev: func(k device.Kernels, b map[string]device.Buffer) error {
				if err := k.DropoutMask(b["mask"], []int{1, 0, 2}, []int{2, 3, 4}, []int{3, 3, 7}, 0.3, 11, 5); err != nil {
					return err
				}
				return k.ArgmaxRows(b["ix"], b["x"], cols)
			},
		},
		sgdCase(comm.Float32, "plain", kernels.SGDStep{LR: 0.1}),
		sgdCase(comm.Float32, "momentum/first", kernels.SGDStep{LR: 0.05, Momentum: 0.9, WeightDecay: 0.01, First: true}),
		sgdCase(comm.Float32, "momentum", kernels.SGDStep{LR: 0.05, Momentum: 0.9, Dampening: 0.1, WeightDecay: 0.01, Maximize: true}),
		sgdCase(comm.Float64, "nesterov", kernels.SGDStep{LR: 0.05, Momentum: 0.8, Nesterov: true, WeightDecay: 0.02}),
		sumSquaresCase(comm.Float32),
		sumSquaresCase(comm.Float64),
		scaleCase(comm.Float32),
		scaleCase(comm.Float64),
		copyBoxCase("CopyBox/f32/3d", comm.Float32, []int{4, 5, 6}, []int{1, 2, 3}, []int{3, 7, 4}, []int{0, 3, 1}, []int{2, 3, 3}),
		copyBoxCase("CopyBox/f64/2d-into-offset", comm.Float64, []int{5, 3}, []int{2, 1}, []int{3, 2}, []int{0, 0}, []int{3, 2}),
		copyBoxCase("CopyBox/bf16/1d", comm.BFloat16, []int{9}, []int{4}, []int{7}, []int{2}, []int{5}),
		copyBoxCase("CopyBox/f32/scalar", comm.Float32, nil, nil, nil, nil, nil),
		copyBoxCase("CopyBox/f32/empty-box", comm.Float32, []int{3, 4}, []int{1, 0}, []int{2, 4}, []int{0, 0}, []int{2, 0}),
		copyBoxCase("CopyBox/f64/zero-length", comm.Float64, []int{0, 3}, []int{0, 0}, []int{0, 3}, []int{0, 0}, []int{0, 3}),
	}
}

// copyBoxCase copies a box of size at soff in a random array of shape
// sshape to doff in a random array of shape dshape, of dtype dt.
func copyBoxCase(name string, dt comm.DType, dshape, doff, sshape, soff, size []int) kernelCase {
	n := func(shape []int) int {
		p := 1
		for _, v := range shape {
			p *= v
		}
		return p
	}
	return kernelCase{
		name: name,
		setup: func(r *rand.Rand, _ kernels.Workers) arrays {
			d, s := randF32(r, n(dshape)), randF32(r, n(sshape))
			switch dt {
			case comm.Float64:
				return arrays{"d": widen(d), "s": widen(s)}
			case comm.BFloat16:
				return arrays{"d": toBF16(d), "s": toBF16(s)}
			}
			return arrays{"d": d, "s": s}
		},
		cpu: func(_ *kernels.BLAS, _ kernels.Workers, a arrays) error {
			switch d := a["d"].(type) {
			case []float64:
				kernels.CopyBox(d, dshape, doff, f64s(a["s"]), sshape, soff, size)
			case []comm.BFloat16Bits:
				kernels.CopyBox(d, dshape, doff, a["s"].([]comm.BFloat16Bits), sshape, soff, size)
			default:
				kernels.CopyBox(f32s(d), dshape, doff, f32s(a["s"]), sshape, soff, size)
			}
			return nil
		},
		dev: func(k device.Kernels, b map[string]device.Buffer) error {
			return k.CopyBox(b["d"], dshape, doff, b["s"], sshape, soff, size)
		},
	}
}

// pointwiseCase checks one activation forward and backward; saveOut says
// its backward takes the forward's result rather than x.
func pointwiseCase(f device.Pointwise, fwd func(dst, x []float32) error, bwd func(dx, saved, dy []float32) error, saveOut bool) kernelCase {
	saved := "x"
	if saveOut {
		saved = "y"
	}
	return kernelCase{
		name: "Pointwise/" + f.String(),
		setup: func(r *rand.Rand, _ kernels.Workers) arrays {
			return arrays{"x": randF32(r, 37), "y": make([]float32, 37), "dy": randF32(r, 37), "dx": make([]float32, 37)}
		},
		cpu: func(_ *kernels.BLAS, _ kernels.Workers, a arrays) error {
			if err := fwd(f32s(a["y"]), f32s(a["x"])); err != nil {
				return err
			}
			return bwd(f32s(a["dx"]), f32s(a[saved]), f32s(a["dy"]))
		},
		dev: func(k device.Kernels, b map[string]device.Buffer) error {
			if err := k.Pointwise(f, b["y"], b["x"]); err != nil {
				return err
			}
			return k.PointwiseBackward(f, b["dx"], b[saved], b["dy"])
		},
	}
}

func toBF16(s []float32) []comm.BFloat16Bits {
	out := make([]comm.BFloat16Bits, len(s))
	for i, v := range s {
		out[i] = comm.BFloat16Bits(half.ToBFloat16(v))
	}
	return out
}

// optimLen is the length of the optimizer kernels' vectors: two vectors
// of eight and a tail.
const optimLen = 21

// floatArray returns n random values as dt's slice, []float32 or
// []float64.
func floatArray(r *rand.Rand, dt comm.DType, n int) any {
	x := randF32(r, n)
	if dt == comm.Float64 {
		return widen(x)
	}
	return x
}

func sgdCase(dt comm.DType, name string, s kernels.SGDStep) kernelCase {
	return kernelCase{
		name: "SGD/" + dt.String() + "/" + name,
		setup: func(r *rand.Rand, _ kernels.Workers) arrays {
			a := arrays{"p": floatArray(r, dt, optimLen), "g": floatArray(r, dt, optimLen)}
			if s.Momentum != 0 {
				a["buf"] = floatArray(r, dt, optimLen)
			}
			return a
		},
		cpu: func(_ *kernels.BLAS, _ kernels.Workers, a arrays) error {
			if dt == comm.Float64 {
				buf, _ := a["buf"].([]float64)
				return kernels.SGD(f64s(a["p"]), f64s(a["g"]), buf, s)
			}
			buf, _ := a["buf"].([]float32)
			return kernels.SGD(f32s(a["p"]), f32s(a["g"]), buf, s)
		},
		dev: func(k device.Kernels, b map[string]device.Buffer) error { return k.SGD(b["p"], b["g"], b["buf"], s) },
	}
}

func sumSquaresCase(dt comm.DType) kernelCase {
	return kernelCase{
		name: "SumSquares/" + dt.String(),
		setup: func(r *rand.Rand, _ kernels.Workers) arrays {
			return arrays{"x": floatArray(r, dt, optimLen), "out": []float64{7}}
		},
		cpu: func(_ *kernels.BLAS, _ kernels.Workers, a arrays) error {
			if dt == comm.Float64 {
				f64s(a["out"])[0] = kernels.SumSquares(f64s(a["x"]))
			} else {
				f64s(a["out"])[0] = kernels.SumSquares(f32s(a["x"]))
			}
			return nil
		},
		dev: func(k device.Kernels, b map[string]device.Buffer) error { return k.SumSquares(b["out"], b["x"]) },
	}
}

func scaleCase(dt comm.DType) kernelCase {
	const c = 0.3
	return kernelCase{
		name: "Scale/" + dt.String(),
		setup: func(r *rand.Rand, _ kernels.Workers) arrays {
			return arrays{"x": floatArray(r, dt, optimLen), "dst": floatArray(r, dt, optimLen), "y": floatArray(r, dt, optimLen)}
		},
		cpu: func(_ *kernels.BLAS, _ kernels.Workers, a arrays) error {
			// Out of place into dst, then in place on y.
			if dt == comm.Float64 {
				if err := kernels.Scale(f64s(a["dst"]), f64s(a["x"]), c); err != nil {
					return err
				}
				return kernels.Scale(f64s(a["y"]), f64s(a["y"]), c)
			}
			if err := kernels.Scale(f32s(a["dst"]), f32s(a["x"]), float32(c)); err != nil {
				return err
			}
			return kernels.Scale(f32s(a["y"]), f32s(a["y"]), float32(c))
		},
		dev: func(k device.Kernels, b map[string]device.Buffer) error {
			if err := k.Scale(b["dst"], b["x"], c); err != nil {
				return err
			}
			return k.Scale(b["y"], b["y"], c)
		},
	}
}

func softmaxCase(log bool) kernelCase {
	name := "Softmax+Backward"
	f, fb := kernels.SoftmaxRows, func(w kernels.Workers, dx, y, dy []float32, n int) error {
		return kernels.SoftmaxRowsBackward(dx, y, dy, n)
	}
	if log {
		name = "LogSoftmax+Backward"
		f, fb = kernels.LogSoftmaxRows, kernels.LogSoftmaxRowsBackward
	}
	return kernelCase{
		name: name,
		setup: func(r *rand.Rand, _ kernels.Workers) arrays {
			n := rows * cols
			return arrays{"y": make([]float32, n), "x": randF32(r, n), "dy": randF32(r, n), "dx": make([]float32, n)}
		},
		cpu: func(_ *kernels.BLAS, w kernels.Workers, a arrays) error {
			if err := f(w, f32s(a["y"]), f32s(a["x"]), cols); err != nil {
				return err
			}
			return fb(w, f32s(a["dx"]), f32s(a["y"]), f32s(a["dy"]), cols)
		},
		dev: func(k device.Kernels, b map[string]device.Buffer) error {
			if err := k.Softmax(b["y"], b["x"], cols, log); err != nil {
				return err
			}
			return k.SoftmaxBackward(b["dx"], b["y"], b["dy"], cols, log)
		},
	}
}

func adamwCase(dt comm.DType) kernelCase {
	c := [8]float64{1 - 1e-3*0.1, 0.9, 0.1, 0.999, 0.001, math.Sqrt(1 - math.Pow(0.999, 3)), -1e-3 / (1 - math.Pow(0.9, 3)), 1e-8}
	const n = 21 // two vectors of eight and a tail
	return kernelCase{
		name: "AdamW/" + dt.String(),
		setup: func(r *rand.Rand, _ kernels.Workers) arrays {
			p, g, m, v := randF32(r, n), randF32(r, n), randF32(r, n), randF32(r, n)
			for i := range v {
				v[i] = v[i] * v[i]
			}
			if dt == comm.Float64 {
				return arrays{"p": widen(p), "g": widen(g), "m": widen(m), "v": widen(v)}
			}
			return arrays{"p": p, "g": g, "m": m, "v": v}
		},
		cpu: func(_ *kernels.BLAS, _ kernels.Workers, a arrays) error {
			if dt == comm.Float64 {
				return kernels.AdamW(f64s(a["p"]), f64s(a["g"]), f64s(a["m"]), f64s(a["v"]), &c)
			}
			var c32 [8]float32
			for i, x := range c {
				c32[i] = float32(x)
			}
			return kernels.AdamW(f32s(a["p"]), f32s(a["g"]), f32s(a["m"]), f32s(a["v"]), &c32)
		},
		dev: func(k device.Kernels, b map[string]device.Buffer) error {
			return k.AdamW(b["p"], b["g"], b["m"], b["v"], c)
		},
	}
}

func widen(s []float32) []float64 {
	out := make([]float64, len(s))
	for i, v := range s {
		out[i] = float64(v)
	}
	return out
}

// hostOf wraps a test array as a host buffer.
func hostOf(t *testing.T, a any) *comm.HostBuffer {
	t.Helper()
	switch s := a.(type) {
	case []float32:
		return comm.Host(s)
	case []float64:
		return comm.Host(s)
	case []int64:
		return comm.Host(s)
	case []comm.BFloat16Bits:
		return comm.Host(s)
	case []comm.Float16Bits:
		return comm.Host(s)
	}
	t.Fatalf("array of type %T", a)
	return nil
}

// cloneArray copies a test array.
func cloneArray(a any) any {
	switch s := a.(type) {
	case []float32:
		return append([]float32(nil), s...)
	case []float64:
		return append([]float64(nil), s...)
	case []int64:
		return append([]int64(nil), s...)
	case []comm.BFloat16Bits:
		return append([]comm.BFloat16Bits(nil), s...)
	case []comm.Float16Bits:
		return append([]comm.Float16Bits(nil), s...)
	}
	panic("unreachable")
}

// TestKernelsMatchCPU checks every Kernels method against the CPU kernel
// the host path calls, on odd shapes, bit for bit (the device runs that
// very function on the same data), on the asynchronous streams and under
// Synchronous; inputs must come back unchanged too.
func TestKernelsMatchCPU(t *testing.T) {
	bl, err := kernels.Default()
	if err != nil {
		t.Fatal(err)
	}
	w := kernels.Workers(bl.Threads())
	for _, mode := range []struct {
		name string
		opts []emu.Option
	}{{"async", nil}, {"sync", []emu.Option{emu.WithSynchronous()}}} {
		d, err := emu.New(0, append(mode.opts, emu.WithBLAS(bl))...)
		if err != nil {
			t.Fatal(err)
		}
		defer d.Close()
		for i, kc := range kernelCases() {
			t.Run(mode.name+"/"+kc.name, func(t *testing.T) {
				r := rand.New(rand.NewPCG(uint64(i), 27))
				want := kc.setup(r, w)
				names := make([]string, 0, len(want))
				for name := range want {
					names = append(names, name)
				}
				sort.Strings(names)
				bufs := map[string]device.Buffer{}
				for _, name := range names {
					h := hostOf(t, want[name])
					b, err := d.Alloc(h.DType(), h.Len())
					if err != nil {
						t.Fatal(err)
					}
					defer b.Free()
					if err := d.CopyFromHost(b, h); err != nil {
						t.Fatal(err)
					}
					bufs[name] = b
				}
				if err := kc.cpu(bl, w, want); err != nil {
					t.Fatalf("CPU kernel: %v", err)
				}
				if err := kc.dev(d.Kernels(), bufs); err != nil {
					t.Fatalf("device kernel: %v", err)
				}
				for _, name := range names {
					got := cloneArray(want[name])
					if err := d.CopyToHost(hostOf(t, got), bufs[name]); err != nil {
						t.Fatalf("%s: %v", name, err)
					}
					gb, wb := hostOf(t, got).Bytes(), hostOf(t, want[name]).Bytes()
					for j := range wb {
						if gb[j] != wb[j] {
							t.Fatalf("%s differs from the CPU kernel's at byte %d (element %d of %v)", name, j, j/hostOf(t, got).DType().Size(), hostOf(t, got).DType())
						}
					}
				}
			})
		}
	}
}

// TestCopyBoxErrors: a box outside either buffer and buffers of two
// dtypes are refused at the call, before anything is queued.
func TestCopyBoxErrors(t *testing.T) {
	d, err := emu.New(0)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	a32, _ := d.Alloc(comm.Float32, 6)
	b32, _ := d.Alloc(comm.Float32, 6)
	a64, _ := d.Alloc(comm.Float64, 6)
	k := d.Kernels()
	for _, tc := range []struct {
		name string
		dst  device.Buffer
		dsh  []int
		doff []int
		src  device.Buffer
		size []int
	}{
		{"past the destination", a32, []int{2, 3}, []int{1, 1}, b32, []int{1, 3}},
		{"short destination", a32, []int{7}, []int{0}, b32, []int{1}},
		{"dtypes differ", a64, []int{2, 3}, []int{0, 0}, b32, []int{1, 1}},
	} {
		sshape := []int{2, 3}
		soff := make([]int, len(tc.size))
		if len(tc.size) == 1 {
			sshape = []int{6}
		}
		if err := k.CopyBox(tc.dst, tc.dsh, tc.doff, tc.src, sshape, soff, tc.size); !errors.Is(err, device.ErrInvalid) {
			t.Errorf("%s: %v, want ErrInvalid", tc.name, err)
		}
	}
	if err := d.Synchronize(); err != nil {
		t.Fatal(err)
	}
}

func randF64(r *rand.Rand, n int) []float64 {
	s := make([]float64, n)
	for i := range s {
		s[i] = r.Float64()*4 - 2
	}
	return s
}

// float64Cases run the dtype-generic kernels on Float64 buffers (autograd's
// float64 ops on devices).
func float64Cases() []kernelCase {
	shape, reduce := []int{3, 5, 4}, []bool{true, false, true}
	return []kernelCase{
		{
			name: "Float64/Add+Mul+ColumnSums+FillRows",
			setup: func(r *rand.Rand, _ kernels.Workers) arrays {
				return arrays{"a": randF64(r, 60), "b": randF64(r, 60), "s": make([]float64, 60), "p": make([]float64, 60),
					"c": make([]float64, 4), "f": randF64(r, 60), "row": randF64(r, 4)}
			},
			cpu: func(_ *kernels.BLAS, _ kernels.Workers, a arrays) error {
				return errors.Join(kernels.Add(f64s(a["s"]), f64s(a["a"]), f64s(a["b"])), kernels.Mul(f64s(a["p"]), f64s(a["a"]), f64s(a["b"])),
					kernels.ColumnSums(f64s(a["c"]), f64s(a["a"]), 4), kernels.FillRows(f64s(a["f"]), f64s(a["row"])))
			},
			dev: func(k device.Kernels, b map[string]device.Buffer) error {
				return errors.Join(k.Add(b["s"], b["a"], b["b"]), k.Mul(b["p"], b["a"], b["b"]), k.ColumnSums(b["c"], b["a"], 4), k.FillRows(b["f"], b["row"]))
			},
		},
		{
			name: "Float64/SumDims+BroadcastDims+PermuteDims",
			setup: func(r *rand.Rand, _ kernels.Workers) arrays {
				return arrays{"x": randF64(r, 60), "s": make([]float64, 5), "g": randF64(r, 5), "out": make([]float64, 60), "perm": make([]float64, 60)}
			},
			cpu: func(_ *kernels.BLAS, _ kernels.Workers, a arrays) error {
				return errors.Join(kernels.SumDims(f64s(a["s"]), f64s(a["x"]), shape, reduce), kernels.BroadcastDims(f64s(a["out"]), f64s(a["g"]), shape, reduce),
					kernels.PermuteDims(f64s(a["perm"]), f64s(a["x"]), shape, []int{2, 0, 1}))
			},
			dev: func(k device.Kernels, b map[string]device.Buffer) error {
				return errors.Join(k.SumDims(b["s"], b["x"], shape, reduce), k.BroadcastDims(b["out"], b["g"], shape, reduce),
					k.PermuteDims(b["perm"], b["x"], shape, []int{2, 0, 1}))
			},
		},
		{
			name: "Float64/NarrowDim+PadDim+ConcatDim",
			setup: func(r *rand.Rand, _ kernels.Workers) arrays {
				return arrays{"x": randF64(r, 60), "n": make([]float64, 24), "g": randF64(r, 24), "p": randF64(r, 60),
					"y": randF64(r, 12), "c": make([]float64, 72)}
			},
			cpu: func(_ *kernels.BLAS, _ kernels.Workers, a arrays) error {
				return errors.Join(kernels.NarrowDim(f64s(a["n"]), f64s(a["x"]), 3, 5, 4, 1, 2), kernels.PadDim(f64s(a["p"]), f64s(a["g"]), 3, 2, 4, 3, 5),
					kernels.ConcatDim(f64s(a["c"]), [][]float64{f64s(a["x"]), f64s(a["y"])}, []int{5, 1}, 3, 4))
			},
			dev: func(k device.Kernels, b map[string]device.Buffer) error {
				return errors.Join(k.NarrowDim(b["n"], b["x"], 3, 5, 4, 1, 2), k.PadDim(b["p"], b["g"], 3, 2, 4, 3, 5),
					k.ConcatDim(b["c"], []device.Buffer{b["x"], b["y"]}, []int{5, 1}, 3, 4))
			},
		},
	}
}
