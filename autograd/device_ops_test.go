package autograd_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/b7ea7098/loom"
	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/device/emu"
	"github.com/b7ea7098/loom/kernels"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// devCase is a computation on named float32 inputs of given shapes; it
// returns the value whose data is compared and from which the loss
// (Sum(out ⊙ c), c a fixed random constant) is built.
type devCase struct {
	name   string
	shapes [][]int
	f      func(in []*autograd.Value) (*autograd.Value, error)
	// fm, when set, replaces f for computations that need the mesh (for
	// indices).
	fm func(m *mesh.Mesh, in []*autograd.Value) (*autograd.Value, error)
	// copies: the device form also holds host copies of its blocks, so
	// its activation bytes exceed the host's.
	copies bool
	// f64 runs the case on float64 tensors.
	f64 bool
}

// ids is a replicated index tensor of shape with entries in [0, n).
func ids(m *mesh.Mesh, shape []int, n int, seed uint64) (*autograd.Indices, error) {
	r := rand.New(rand.NewPCG(seed, 5))
	total := 1
	for _, s := range shape {
		total *= s
	}
	full := make([]int64, total)
	for i := range full {
		full[i] = int64(r.IntN(n))
	}
	places := []placement.Placement{placement.Replicate()}
	return autograd.IndicesFromFull(m, shape, places, full)
}

// customScale is a Custom op computing 3·x and backward 3·g with the
// host kernel or, on a device, its Kernels (ResultBuffer, ScratchBuffer).
func customScale(x *autograd.Value) (*autograd.Value, error) {
	t := x.Tape()
	scale := func(in *placement.DTensor, result bool) (*placement.DTensor, error) {
		if h, ok := in.LocalData().([]float32); ok {
			out := autograd.ScratchBlock[float32](t, len(h))
			if result {
				out = autograd.ResultBlock[float32](t, len(h))
			}
			if err := kernels.Scale(out, h, 3); err != nil {
				return nil, err
			}
			return placement.NewLocal(in.Spec(), out)
		}
		b := in.LocalData().(device.Buffer)
		get := autograd.ScratchBuffer
		if result {
			get = autograd.ResultBuffer
		}
		out, err := get(t, b.Owner(), b.DType(), b.Len())
		if err != nil {
			return nil, err
		}
		if err := b.Owner().Kernels().Scale(out, b, 3); err != nil {
			return nil, err
		}
		return placement.NewLocalOn(in.Spec(), out)
	}
	return autograd.Custom("scale3", []*autograd.Value{x},
		func() (*placement.DTensor, error) { return scale(x.Data(), true) },
		func(ctx context.Context, g *placement.DTensor) ([]*placement.DTensor, error) {
			gx, err := scale(g, false)
			return []*placement.DTensor{gx}, err
		})
}

// composedAttention is CausalAttention's composition, which the
// unfused path records.
func composedAttention(q, k, v *autograd.Value) (*autograd.Value, error) {
	kt, err := autograd.Transpose(k, -2, -1)
	if err != nil {
		return nil, err
	}
	s, err := autograd.BatchedMatMul(q, kt)
	if err != nil {
		return nil, err
	}
	if s, err = autograd.Scale(s, 0.5); err != nil {
		return nil, err
	}
	if s, err = autograd.CausalSoftmax(s); err != nil {
		return nil, err
	}
	return autograd.BatchedMatMul(s, v)
}

// checkpointed runs f inside autograd.Checkpoint with opts.
func checkpointed(f func(m *mesh.Mesh, in []*autograd.Value) (*autograd.Value, error), opts ...autograd.CheckpointOption) func(m *mesh.Mesh, in []*autograd.Value) (*autograd.Value, error) {
	return func(m *mesh.Mesh, in []*autograd.Value) (*autograd.Value, error) {
		out, err := autograd.Checkpoint(context.Background(), in, func(ctx context.Context, in []*autograd.Value) ([]*autograd.Value, error) {
			v, err := f(m, in)
			return []*autograd.Value{v}, err
		}, opts...)
		if err != nil {
			return nil, err
		}
		return out[0], nil
	}
}

// tinyGPT is one pre-norm transformer block with an embedding and a
// cross-entropy head: B=2, T=5, D=8, H=2, V=11. Inputs: the token table
// [11, 8], ln w, b [8], qkv w [24, 8], b [24], proj w [8, 8], mlp w1
// [16, 8], b1 [16], w2 [8, 16], head w [11, 8].
func tinyGPT(m *mesh.Mesh, in []*autograd.Value) (*autograd.Value, error) {
	const B, T, D, H, V = 2, 5, 8, 2, 11
	tok, err := ids(m, []int{B, T}, V, 7)
	if err != nil {
		return nil, err
	}
	tg, err := ids(m, []int{B * T}, V, 8)
	if err != nil {
		return nil, err
	}
	x, err := autograd.Embedding(in[0], tok)
	if err != nil {
		return nil, err
	}
	h, err := autograd.LayerNorm(x, in[1], in[2], 1e-5)
	if err != nil {
		return nil, err
	}
	qkv, err := autograd.Linear(h, in[3], in[4])
	if err != nil {
		return nil, err
	}
	parts, err := autograd.SplitLast(qkv, 3)
	if err != nil {
		return nil, err
	}
	for i, p := range parts {
		if p, err = autograd.Reshape(p, B, T, H, D/H); err != nil {
			return nil, err
		}
		if parts[i], err = autograd.Permute(p, 0, 2, 1, 3); err != nil {
			return nil, err
		}
	}
	a, err := autograd.CausalAttention(parts[0], parts[1], parts[2])
	if err != nil {
		return nil, err
	}
	if a, err = autograd.Transpose(a, 1, 2); err != nil {
		return nil, err
	}
	if a, err = autograd.Reshape(a, B, T, D); err != nil {
		return nil, err
	}
	if a, err = autograd.Linear(a, in[5], nil); err != nil {
		return nil, err
	}
	if x, err = autograd.Add(x, a); err != nil {
		return nil, err
	}
	f, err := autograd.Linear(x, in[6], in[7])
	if err != nil {
		return nil, err
	}
	if f, err = autograd.GELU(f); err != nil {
		return nil, err
	}
	if f, err = autograd.Linear(f, in[8], nil); err != nil {
		return nil, err
	}
	if x, err = autograd.Add(x, f); err != nil {
		return nil, err
	}
	logits, err := autograd.Linear(x, in[9], nil)
	if err != nil {
		return nil, err
	}
	if logits, err = autograd.Reshape(logits, B*T, V); err != nil {
		return nil, err
	}
	return autograd.CrossEntropy(logits, tg)
}

// localMulAdd is x·x + b (b over the last dim) as a LocalFunc, whose
// functions take host slices: on a device they get host copies.
func localMulAdd(x, b *autograd.Value) (*autograd.Value, error) {
	r := []placement.Placement{placement.Replicate()}
	f := autograd.LocalFunc[float32]{Name: "mul_add", In: [][]placement.Placement{r, r}, GradIn: [][]placement.Placement{r, r},
		Out: r, GradOut: r,
		Forward: func(in []autograd.Block[float32]) (autograd.Block[float32], error) {
			x, b := in[0].Data, in[1].Data
			y := make([]float32, len(x))
			for i, v := range x {
				y[i] = v*v + b[i%len(b)]
			}
			return autograd.Block[float32]{Shape: in[0].Shape, Data: y}, nil
		},
		Backward: func(g autograd.Block[float32], in []autograd.Block[float32], _ autograd.Block[float32]) ([]autograd.Block[float32], error) {
			x := in[0].Data
			dx, db := make([]float32, len(x)), make([]float32, len(in[1].Data))
			for i, v := range x {
				dx[i] = 2 * v * g.Data[i]
				db[i%len(db)] += g.Data[i]
			}
			return []autograd.Block[float32]{{Shape: in[0].Shape, Data: dx}, {Shape: in[1].Shape, Data: db}}, nil
		},
	}
	return f.Apply(x, b)
}

func (c devCase) run(m *mesh.Mesh, in []*autograd.Value) (*autograd.Value, error) {
	if c.fm != nil {
		return c.fm(m, in)
	}
	return c.f(in)
}

func devCases() []devCase {
	one := func(f func(x *autograd.Value) (*autograd.Value, error)) func([]*autograd.Value) (*autograd.Value, error) {
		return func(in []*autograd.Value) (*autograd.Value, error) { return f(in[0]) }
	}
	return []devCase{
		{name: "Add", shapes: [][]int{{3, 5}, {3, 5}}, f: func(in []*autograd.Value) (*autograd.Value, error) { return autograd.Add(in[0], in[1]) }},
		{name: "Add/same-input", shapes: [][]int{{7}}, f: func(in []*autograd.Value) (*autograd.Value, error) { return autograd.Add(in[0], in[0]) }},
		{name: "Mul", shapes: [][]int{{3, 5}, {3, 5}}, f: func(in []*autograd.Value) (*autograd.Value, error) { return autograd.Mul(in[0], in[1]) }},
		{name: "Scale", shapes: [][]int{{4, 3}}, f: one(func(x *autograd.Value) (*autograd.Value, error) { return autograd.Scale(x, -0.7) })},
		{name: "MatMul", shapes: [][]int{{5, 7}, {7, 3}}, f: func(in []*autograd.Value) (*autograd.Value, error) { return autograd.MatMul(in[0], in[1]) }},
		{name: "MatMul/k=0", shapes: [][]int{{2, 0}, {0, 3}}, f: func(in []*autograd.Value) (*autograd.Value, error) { return autograd.MatMul(in[0], in[1]) }},
		{name: "Linear", shapes: [][]int{{2, 3, 5}, {4, 5}, {4}}, f: func(in []*autograd.Value) (*autograd.Value, error) {
			return autograd.Linear(in[0], in[1], in[2])
		}},
		{name: "Linear/no-bias", shapes: [][]int{{6, 5}, {4, 5}}, f: func(in []*autograd.Value) (*autograd.Value, error) {
			return autograd.Linear(in[0], in[1], nil)
		}},
		{name: "Sum/dim", shapes: [][]int{{3, 4, 5}}, f: one(func(x *autograd.Value) (*autograd.Value, error) { return autograd.Sum(x, 1) })},
		{name: "Sum/all", shapes: [][]int{{3, 4}}, f: one(func(x *autograd.Value) (*autograd.Value, error) { return autograd.Sum(x) })},
		{name: "Mean", shapes: [][]int{{3, 4}}, f: one(func(x *autograd.Value) (*autograd.Value, error) { return autograd.Mean(x, 0) })},
		{name: "MSE", shapes: [][]int{{3, 4}, {3, 4}}, f: func(in []*autograd.Value) (*autograd.Value, error) { return autograd.MSE(in[0], in[1]) }},
		{name: "LayerNorm", shapes: [][]int{{2, 3, 9}, {9}, {9}}, f: func(in []*autograd.Value) (*autograd.Value, error) {
			return autograd.LayerNorm(in[0], in[1], in[2], 1e-5)
		}},
		{name: "GELU", shapes: [][]int{{3, 11}}, f: one(autograd.GELU)},
		{name: "Narrow", shapes: [][]int{{3, 5, 4}}, f: one(func(x *autograd.Value) (*autograd.Value, error) { return autograd.Narrow(x, 1, 1, 3) })},
		{name: "SplitLast+Concat", shapes: [][]int{{3, 6}}, f: one(func(x *autograd.Value) (*autograd.Value, error) {
			p, err := autograd.SplitLast(x, 3)
			if err != nil {
				return nil, err
			}
			return autograd.Concat(-1, p[2], p[0])
		})},
		{name: "Permute", shapes: [][]int{{3, 5, 4}}, f: one(func(x *autograd.Value) (*autograd.Value, error) { return autograd.Permute(x, 2, 0, 1) })},
		{name: "Transpose+Reshape", shapes: [][]int{{3, 4}}, f: one(func(x *autograd.Value) (*autograd.Value, error) {
			y, err := autograd.Transpose(x, 0, 1)
			if err != nil {
				return nil, err
			}
			return autograd.Reshape(y, 2, 6)
		})},
		{name: "CausalAttention", shapes: [][]int{{2, 3, 5, 4}, {2, 3, 5, 4}, {2, 3, 5, 3}}, f: func(in []*autograd.Value) (*autograd.Value, error) {
			return autograd.CausalAttention(in[0], in[1], in[2])
		}},
		{name: "CausalAttention/composed", shapes: [][]int{{2, 3, 5, 4}, {2, 3, 5, 4}, {2, 3, 5, 3}}, f: func(in []*autograd.Value) (*autograd.Value, error) {
			return composedAttention(in[0], in[1], in[2])
		}},
		{name: "ReLU", shapes: [][]int{{3, 7}}, f: one(autograd.ReLU)},
		{name: "SiLU", shapes: [][]int{{3, 7}}, f: one(autograd.SiLU)},
		{name: "Tanh", shapes: [][]int{{3, 7}}, f: one(autograd.Tanh)},
		{name: "Sigmoid", shapes: [][]int{{3, 7}}, f: one(autograd.Sigmoid)},
		{name: "Dropout", shapes: [][]int{{5, 9}}, f: one(func(x *autograd.Value) (*autograd.Value, error) { return autograd.Dropout(x, 0.4, 3, 2) })},
		{name: "Custom", shapes: [][]int{{3, 5}}, f: one(customScale)},
		{name: "LocalMap", shapes: [][]int{{3, 5}, {5}}, copies: true,
			f: func(in []*autograd.Value) (*autograd.Value, error) { return localMulAdd(in[0], in[1]) }},
		{name: "Softmax", shapes: [][]int{{3, 7}}, f: one(func(x *autograd.Value) (*autograd.Value, error) { return autograd.Softmax(x, -1) })},
		{name: "LogSoftmax", shapes: [][]int{{3, 7}}, f: one(func(x *autograd.Value) (*autograd.Value, error) { return autograd.LogSoftmax(x, 1) })},
		{name: "Softmax/middle-dim", shapes: [][]int{{3, 5, 4}}, f: one(func(x *autograd.Value) (*autograd.Value, error) { return autograd.Softmax(x, 1) })},
		{name: "LogSoftmax/first-dim", shapes: [][]int{{4, 3}}, f: one(func(x *autograd.Value) (*autograd.Value, error) { return autograd.LogSoftmax(x, 0) })},
		{name: "Embedding", shapes: [][]int{{11, 6}}, fm: func(m *mesh.Mesh, in []*autograd.Value) (*autograd.Value, error) {
			id, err := ids(m, []int{2, 5}, 11, 3)
			if err != nil {
				return nil, err
			}
			return autograd.Embedding(in[0], id)
		}},
		{name: "CrossEntropy", shapes: [][]int{{7, 11}}, fm: func(m *mesh.Mesh, in []*autograd.Value) (*autograd.Value, error) {
			tg, err := ids(m, []int{7}, 11, 4)
			if err != nil {
				return nil, err
			}
			return autograd.CrossEntropy(in[0], tg)
		}},
		{name: "Checkpoint/KeepMatrixProducts", shapes: [][]int{{11, 8}, {8}, {8}, {24, 8}, {24}, {8, 8}, {16, 8}, {16}, {8, 16}, {11, 8}},
			fm: checkpointed(tinyGPT, autograd.WithKeepMatrixProducts())},
		{name: "Checkpoint/KeepOps", shapes: [][]int{{11, 8}, {8}, {8}, {24, 8}, {24}, {8, 8}, {16, 8}, {16}, {8, 16}, {11, 8}},
			fm: checkpointed(tinyGPT, autograd.WithKeepOps("CausalAttention", "LayerNorm"))},
		{name: "TinyGPT", shapes: [][]int{{11, 8}, {8}, {8}, {24, 8}, {24}, {8, 8}, {16, 8}, {16}, {8, 16}, {11, 8}}, fm: tinyGPT},
		{name: "MLP", shapes: [][]int{{4, 6}, {8, 6}, {8}, {6, 8}, {6}, {6}, {6}}, f: func(in []*autograd.Value) (*autograd.Value, error) {
			h, err := autograd.Linear(in[0], in[1], in[2])
			if err != nil {
				return nil, err
			}
			if h, err = autograd.GELU(h); err != nil {
				return nil, err
			}
			if h, err = autograd.Linear(h, in[3], in[4]); err != nil {
				return nil, err
			}
			if h, err = autograd.Add(h, in[0]); err != nil {
				return nil, err
			}
			return autograd.LayerNorm(h, in[5], in[6], 1e-5)
		}},
	}
}

// float64Cases are the cases whose ops run on float64 data on devices
// that take it (device.Float64Kernels: emu), in float64.
func float64Cases() []devCase {
	var out []devCase
	for _, c := range devCases() {
		switch c.name {
		case "Add", "Add/same-input", "Mul", "Scale", "MatMul", "MatMul/k=0", "Linear", "Linear/no-bias", "Sum/dim", "Sum/all",
			"Mean", "MSE", "Narrow", "SplitLast+Concat", "Permute", "Transpose+Reshape":
			c.name, c.f64 = "float64/"+c.name, true
			out = append(out, c)
		}
	}
	return out
}

// devRun runs c on tape with its inputs (host tensors) moved to d, builds
// the loss, runs Backward and returns the output's data and the inputs'
// gradients, copied to the host.
func devRun(ctx context.Context, m *mesh.Mesh, c devCase, d device.Device, opts ...autograd.Option) ([][]float32, error) {
	tape := autograd.NewTape(append(opts, autograd.WithDevice(d))...)
	var in []*autograd.Value
	for i, sh := range c.shapes {
		dt, err := randTensorOf(m, sh, uint64(i+1), c.f64)
		if err != nil {
			return nil, err
		}
		if dt, err = dt.To(d); err != nil {
			return nil, err
		}
		v, err := tape.Param(fmt.Sprint("in", i), dt)
		if err != nil {
			return nil, err
		}
		in = append(in, v)
	}
	out, err := c.run(m, in)
	if err != nil {
		return nil, err
	}
	cdt, err := randTensorOf(m, out.Spec().Shape(), 99, c.f64)
	if err != nil {
		return nil, err
	}
	if cdt, err = cdt.To(d); err != nil {
		return nil, err
	}
	cv, err := tape.Constant(cdt)
	if err != nil {
		return nil, err
	}
	p, err := autograd.Mul(out, cv)
	if err != nil {
		return nil, err
	}
	loss, err := autograd.Sum(p)
	if err != nil {
		return nil, err
	}
	got := [][]float32{}
	for _, dt := range []*placement.DTensor{out.Data(), loss.Data()} {
		h, err := hostBits(dt)
		if err != nil {
			return nil, err
		}
		got = append(got, h)
	}
	// Activation accounting counts device blocks as host ones.
	acts := []float32{float32(tape.ActivationBytes())}
	if err := tape.Backward(ctx, loss); err != nil {
		return nil, err
	}
	acts = append(acts, float32(tape.PeakActivationBytes()))
	if c.copies {
		acts = nil
	}
	got = append(got, acts)
	for _, v := range in {
		if v.Grad() == nil {
			got = append(got, nil)
			continue
		}
		if dev := v.Grad().Device(); dev != d {
			return nil, fmt.Errorf("gradient of %s on %s, want %s", v.Name(), dev.Name(), d.Name())
		}
		h, err := hostBits(v.Grad())
		if err != nil {
			return nil, err
		}
		got = append(got, h)
	}
	return got, nil
}

// randTensor is a replicated float32 tensor of random values in [-2, 2).
func randTensor(m *mesh.Mesh, shape []int, seed uint64) (*placement.DTensor, error) {
	spec, err := placement.NewSpec(m, shape, comm.Float32, []placement.Placement{placement.Replicate()})
	if err != nil {
		return nil, err
	}
	r := rand.New(rand.NewPCG(seed, 27))
	n := 1
	for _, s := range shape {
		n *= s
	}
	data := make([]float32, n)
	for i := range data {
		data[i] = float32(r.Float64()*4 - 2)
	}
	return placement.NewLocal(spec, data)
}

// randTensorOf is randTensor, in float64 when f64 is set (the same
// values, widened).
func randTensorOf(m *mesh.Mesh, shape []int, seed uint64, f64 bool) (*placement.DTensor, error) {
	x, err := randTensor(m, shape, seed)
	if err != nil || !f64 {
		return x, err
	}
	spec, err := placement.NewSpec(m, shape, comm.Float64, []placement.Placement{placement.Replicate()})
	if err != nil {
		return nil, err
	}
	f := x.LocalData().([]float32)
	d := make([]float64, len(f))
	for i, v := range f {
		d[i] = float64(v)
	}
	return placement.NewLocal(spec, d)
}

// hostBits is hostData for float32 or float64 blocks: a float64 element
// becomes two float32s holding its low and high 32 bits, so that sameBits
// compares float64 results bit for bit too.
func hostBits(dt *placement.DTensor) ([]float32, error) {
	if dt.Spec().DType() != comm.Float64 {
		return hostData(dt)
	}
	h, err := dt.To(device.Host())
	if err != nil {
		return nil, err
	}
	var out []float32
	for _, v := range h.LocalData().([]float64) {
		b := math.Float64bits(v)
		out = append(out, math.Float32frombits(uint32(b)), math.Float32frombits(uint32(b>>32)))
	}
	return out, nil
}

// hostData copies dt's local block to the host.
func hostData(dt *placement.DTensor) ([]float32, error) {
	h, err := dt.To(device.Host())
	if err != nil {
		return nil, err
	}
	return h.LocalData().([]float32), nil
}

// sameBits compares two runs bit for bit: the emulated device runs the
// CPU kernels the host path runs on the same data, so any difference
// means the device path reordered or dropped work.
func sameBits(host, dev [][]float32) error {
	if len(host) != len(dev) {
		return fmt.Errorf("%d arrays on the host, %d on the device", len(host), len(dev))
	}
	what := func(i int) string {
		switch i {
		case 0:
			return "output"
		case 1:
			return "loss"
		case 2:
			return "activation bytes (held, peak)"
		}
		return fmt.Sprintf("gradient of input %d", i-3)
	}
	for i := range host {
		if len(host[i]) != len(dev[i]) {
			return fmt.Errorf("%s: %d elements on the host, %d on the device", what(i), len(host[i]), len(dev[i]))
		}
		for j := range host[i] {
			if math.Float32bits(host[i][j]) != math.Float32bits(dev[i][j]) {
				return fmt.Errorf("%s: element %d is %v on the host, %v on the device", what(i), j, host[i][j], dev[i][j])
			}
		}
	}
	return nil
}

// forEachDevice runs fn on the host and on an emulated device (both
// stream modes) and compares each device run with the host's bit for bit.
func forEachDevice(t *testing.T, fn func(ctx context.Context, m *mesh.Mesh, d device.Device) ([][]float32, error)) {
	t.Helper()
	placementtest.Run(t, []int{1}, []string{"x"}, func(ctx context.Context, m *mesh.Mesh) error {
		want, err := fn(ctx, m, device.Host())
		if err != nil {
			return fmt.Errorf("host: %w", err)
		}
		for _, mode := range []struct {
			name string
			opts []emu.Option
		}{{"async", nil}, {"sync", []emu.Option{emu.WithSynchronous()}}} {
			d, err := emu.New(0, mode.opts...)
			if err != nil {
				return err
			}
			got, err := fn(ctx, m, d)
			if err == nil {
				err = d.Synchronize()
			}
			if err == nil {
				err = sameBits(want, got)
			}
			if cerr := d.Close(); err == nil {
				err = cerr
			}
			if err != nil {
				return fmt.Errorf("emu (%s): %w", mode.name, err)
			}
		}
		return nil
	})
}

// TestDeviceOpsMatchHost: each op (and a small MLP) on the emulated device
// gives the host's results and gradients bit for bit, with and without
// recycling.
func TestDeviceOpsMatchHost(t *testing.T) {
	for _, c := range append(devCases(), float64Cases()...) {
		for _, rec := range []bool{false, true} {
			var opts []autograd.Option
			name := c.name
			if rec {
				opts, name = []autograd.Option{autograd.WithRecycling()}, name+"/recycling"
			}
			t.Run(name, func(t *testing.T) {
				forEachDevice(t, func(ctx context.Context, m *mesh.Mesh, d device.Device) ([][]float32, error) {
					return devRun(ctx, m, c, d, opts...)
				})
			})
		}
	}
}

// TestToIsDifferentiable: a host parameter copied to the device with
// autograd.To gets its gradient on the host, equal to the one computed
// on the host alone; To to the tensor's own device is the value itself.
func TestToIsDifferentiable(t *testing.T) {
	c := devCases()[len(devCases())-1] // the MLP
	forEachDevice(t, func(ctx context.Context, m *mesh.Mesh, d device.Device) ([][]float32, error) {
		tape := autograd.NewTape()
		var in, moved []*autograd.Value
		for i, sh := range c.shapes {
			dt, err := randTensor(m, sh, uint64(i+1))
			if err != nil {
				return nil, err
			}
			v, err := tape.Param(fmt.Sprint("in", i), dt)
			if err != nil {
				return nil, err
			}
			mv, err := autograd.To(v, d)
			if err != nil {
				return nil, err
			}
			if d.Kind() == device.KindHost && mv != v {
				return nil, fmt.Errorf("To(host value, host) made a copy")
			}
			in, moved = append(in, v), append(moved, mv)
		}
		out, err := c.f(moved)
		if err != nil {
			return nil, err
		}
		back, err := autograd.To(out, device.Host())
		if err != nil {
			return nil, err
		}
		loss, err := autograd.Sum(back)
		if err != nil {
			return nil, err
		}
		if err := tape.Backward(ctx, loss); err != nil {
			return nil, err
		}
		var got [][]float32
		for _, v := range in {
			g, ok := v.Grad().LocalData().([]float32)
			if !ok {
				return nil, fmt.Errorf("gradient of %s is %T, want a host block", v.Name(), v.Grad().LocalData())
			}
			got = append(got, g)
		}
		return append([][]float32{nil, nil}, got...), nil
	})
}

// TestDeviceArgmax: Argmax of a device tensor gives the host's indices.
func TestDeviceArgmax(t *testing.T) {
	forEachDevice(t, func(ctx context.Context, m *mesh.Mesh, d device.Device) ([][]float32, error) {
		x, err := randTensor(m, []int{4, 3, 9}, 5)
		if err != nil {
			return nil, err
		}
		if x, err = x.To(d); err != nil {
			return nil, err
		}
		v, err := autograd.NewTape().Constant(x)
		if err != nil {
			return nil, err
		}
		ix, err := autograd.Argmax(v)
		if err != nil {
			return nil, err
		}
		full := ix.Local()
		out := make([]float32, len(full))
		for i, j := range full {
			out[i] = float32(j)
		}
		return [][]float32{out}, nil
	})
}

// TestDeviceFloat64Unsupported: float64 tensors on a device are refused
// by name, matching loom.ErrUnsupported, by ops whose kernels are float32
// only; the dtype-generic ones run (float64Cases compares them with the
// host).
func TestDeviceFloat64Unsupported(t *testing.T) {
	placementtest.Run(t, []int{1}, []string{"x"}, func(ctx context.Context, m *mesh.Mesh) error {
		d, err := emu.New(0)
		if err != nil {
			return err
		}
		defer d.Close()
		spec, err := placement.NewSpec(m, []int{2, 3}, comm.Float64, []placement.Placement{placement.Replicate()})
		if err != nil {
			return err
		}
		h, err := placement.NewLocal(spec, make([]float64, 6))
		if err != nil {
			return err
		}
		on, err := h.To(d)
		if err != nil {
			return err
		}
		tape := autograd.NewTape()
		x, err := tape.Param("x", on)
		if err != nil {
			return err
		}
		_, err = autograd.GELU(x)
		if !errors.Is(err, loom.ErrUnsupported) || !errors.Is(err, autograd.ErrUnsupported) || !strings.Contains(err.Error(), "float64 on emu:0") {
			t.Errorf("GELU(float64 on emu) = %v, want ErrUnsupported naming the dtype and device", err)
		}
		// Scale's kernel is generic, and emu takes float64 there.
		if _, err := autograd.Scale(x, 2); err != nil {
			t.Errorf("Scale(float64 on emu) = %v", err)
		}
		return nil
	})
}

// TestDeviceMemoryReturns: on a recycling tape, a training step's device
// memory goes back to the allocator: after Recycle only the parameters
// and their gradients stay allocated, the same bytes every step, and the
// allocator asks the driver for nothing after the first step.
func TestDeviceMemoryReturns(t *testing.T) {
	for _, c := range devCases() {
		if c.name == "MLP" || c.name == "TinyGPT" || c.name == "Checkpoint/KeepOps" {
			t.Run(c.name, func(t *testing.T) { testMemoryReturns(t, c) })
		}
	}
}

func testMemoryReturns(t *testing.T, c devCase) {
	placementtest.Run(t, []int{1}, []string{"x"}, func(ctx context.Context, m *mesh.Mesh) error {
		d, err := emu.New(0)
		if err != nil {
			return err
		}
		defer d.Close()
		tape := autograd.NewTape(autograd.WithDevice(d), autograd.WithRecycling())
		var in []*autograd.Value
		for i, sh := range c.shapes {
			dt, err := randTensor(m, sh, uint64(i+1))
			if err != nil {
				return err
			}
			if dt, err = dt.To(d); err != nil {
				return err
			}
			v, err := tape.Param(fmt.Sprint("in", i), dt)
			if err != nil {
				return err
			}
			in = append(in, v)
		}
		base := d.Memory().Stats()
		var after []device.Stats
		for step := range 4 {
			for _, v := range in {
				v.ZeroGrad()
			}
			out, err := c.run(m, in)
			if err != nil {
				return err
			}
			loss, err := autograd.Sum(out)
			if err != nil {
				return err
			}
			if err := tape.Backward(ctx, loss); err != nil {
				return err
			}
			tape.Recycle()
			if err := d.Synchronize(); err != nil {
				return err
			}
			s := d.Memory().Stats()
			after = append(after, s)
			if step > 0 && (s.Allocated != after[0].Allocated || s.DriverAllocs != after[0].DriverAllocs) {
				t.Errorf("step %d: %d bytes allocated, %d driver allocations; after step 0: %d, %d", step, s.Allocated, s.DriverAllocs, after[0].Allocated, after[0].DriverAllocs)
			}
		}
		// What stays is the gradients: one rounded block per parameter.
		var grads int64
		for _, v := range in {
			grads += (v.GradBytes() + 511) / 512 * 512
		}
		if got := after[0].Allocated - base.Allocated; got != grads {
			t.Errorf("after a step %d bytes more are allocated than before it, want %d (the gradients)", got, grads)
		}
		return nil
	})
}

// TestDeviceScratchFreedByBackward: Backward (which clears the tape)
// frees the device scratch (saved values, intermediate gradients, the
// seed): what stays allocated is the op results, which the caller owns or
// Recycle frees, and the parameters' gradients; Recycle then frees the
// results.
func TestDeviceScratchFreedByBackward(t *testing.T) {
	placementtest.Run(t, []int{1}, []string{"x"}, func(ctx context.Context, m *mesh.Mesh) error {
		d, err := emu.New(0)
		if err != nil {
			return err
		}
		defer d.Close()
		rounded := func(bytes int64) int64 { return (bytes + 511) / 512 * 512 }
		for _, recycling := range []bool{false, true} {
			var opts []autograd.Option
			if recycling {
				opts = append(opts, autograd.WithRecycling())
			}
			tape := autograd.NewTape(append(opts, autograd.WithDevice(d))...)
			var params []*autograd.Value
			for i, sh := range [][]int{{4, 6}, {8, 6}, {8}, {8}, {8}} {
				dt, err := randTensor(m, sh, uint64(i+1))
				if err != nil {
					return err
				}
				if dt, err = dt.To(d); err != nil {
					return err
				}
				v, err := tape.Param(fmt.Sprint("p", i), dt)
				if err != nil {
					return err
				}
				params = append(params, v)
			}
			base := d.Memory().Stats().Allocated
			h, err := autograd.Linear(params[0], params[1], params[2])
			if err != nil {
				return err
			}
			g, err := autograd.GELU(h)
			if err != nil {
				return err
			}
			y, err := autograd.LayerNorm(g, params[3], params[4], 1e-5)
			if err != nil {
				return err
			}
			loss, err := autograd.Sum(y)
			if err != nil {
				return err
			}
			var results, grads int64
			for _, v := range []*autograd.Value{h, g, y, loss} {
				results += rounded(int64(4 * v.Data().LocalBuffer().Len()))
			}
			if err := tape.Backward(ctx, loss); err != nil {
				return err
			}
			for _, v := range params {
				grads += rounded(v.GradBytes())
			}
			if got := d.Memory().Stats().Allocated - base; got != results+grads {
				t.Errorf("recycling %v: after Backward %d bytes more are allocated, want %d (results %d, gradients %d)", recycling, got, results+grads, results, grads)
			}
			if !recycling {
				for _, v := range []*autograd.Value{h, g, y, loss} {
					if err := v.Data().LocalBuffer().(device.Buffer).Free(); err != nil {
						return err
					}
				}
			} else {
				tape.Recycle()
			}
			if got := d.Memory().Stats().Allocated - base; got != grads {
				t.Errorf("recycling %v: with the results freed %d bytes more are allocated, want %d (the gradients)", recycling, got, grads)
			}
		}
		return nil
	})
}

// TestDeviceFiniteDifferences checks gradients computed on the emulated
// device against central differences of the loss, also computed there,
// for a few ops. autograd's CheckGrad takes float64 parameters and the
// device ops float32, so this is a float32 check: with step h = 1e-2 the
// difference quotient's truncation error is O(h²) ≈ 1e-4 and its rounding
// error about 6e-8·|L|/h ≈ 1e-5·|L|, so a tolerance of 2e-2·max(1, |g|)
// passes correct gradients while a wrong one is off by O(1).
func TestDeviceFiniteDifferences(t *testing.T) {
	const h, tol = 1e-2, 2e-2
	for _, c := range devCases() {
		switch c.name {
		case "Linear", "LayerNorm", "GELU", "CausalAttention", "CrossEntropy", "Embedding", "Softmax":
		default:
			continue
		}
		t.Run(c.name, func(t *testing.T) {
			placementtest.Run(t, []int{1}, []string{"x"}, func(ctx context.Context, m *mesh.Mesh) error {
				d, err := emu.New(0)
				if err != nil {
					return err
				}
				defer d.Close()
				var inputs [][]float32
				for i, sh := range c.shapes {
					dt, err := randTensor(m, sh, uint64(i+1))
					if err != nil {
						return err
					}
					inputs = append(inputs, dt.LocalData().([]float32))
				}
				// loss builds the loss on d from inputs; with grads set it
				// also runs Backward and returns the inputs' gradients.
				loss := func(grads bool) (float64, [][]float32, error) {
					tape := autograd.NewTape(autograd.WithDevice(d))
					var in []*autograd.Value
					for i, sh := range c.shapes {
						spec, err := placement.NewSpec(m, sh, comm.Float32, []placement.Placement{placement.Replicate()})
						if err != nil {
							return 0, nil, err
						}
						dt, err := placement.NewLocal(spec, append([]float32(nil), inputs[i]...))
						if err != nil {
							return 0, nil, err
						}
						if dt, err = dt.To(d); err != nil {
							return 0, nil, err
						}
						v, err := tape.Param(fmt.Sprint("in", i), dt)
						if err != nil {
							return 0, nil, err
						}
						in = append(in, v)
					}
					out, err := c.run(m, in)
					if err != nil {
						return 0, nil, err
					}
					l, err := autograd.Sum(out)
					if err != nil {
						return 0, nil, err
					}
					lv, err := hostData(l.Data())
					if err != nil {
						return 0, nil, err
					}
					if !grads {
						return float64(lv[0]), nil, nil
					}
					if err := tape.Backward(ctx, l); err != nil {
						return 0, nil, err
					}
					var gs [][]float32
					for _, v := range in {
						g, err := hostData(v.Grad())
						if err != nil {
							return 0, nil, err
						}
						gs = append(gs, g)
					}
					return float64(lv[0]), gs, nil
				}
				_, grads, err := loss(true)
				if err != nil {
					return err
				}
				for i := range inputs {
					// A few elements of each input, spread over it.
					for _, j := range []int{0, len(inputs[i]) / 3, len(inputs[i]) - 1} {
						x := inputs[i][j]
						inputs[i][j] = x + h
						up, _, err := loss(false)
						if err != nil {
							return err
						}
						inputs[i][j] = x - h
						down, _, err := loss(false)
						if err != nil {
							return err
						}
						inputs[i][j] = x
						num, got := (up-down)/(2*h), float64(grads[i][j])
						if math.Abs(num-got) > tol*max(1, math.Abs(got)) {
							t.Errorf("input %d element %d: gradient %v on emu, central difference %v", i, j, got, num)
						}
					}
				}
				return nil
			})
		})
	}
}

// TestDeviceZeroGradFrees: without recycling, ZeroGrad frees a device
// gradient Backward allocated, so a loop that frees its results holds no
// device memory between steps.
func TestDeviceZeroGradFrees(t *testing.T) {
	placementtest.Run(t, []int{1}, []string{"x"}, func(ctx context.Context, m *mesh.Mesh) error {
		d, err := emu.New(0)
		if err != nil {
			return err
		}
		defer d.Close()
		x, err := randTensor(m, []int{4, 5}, 1)
		if err != nil {
			return err
		}
		if x, err = x.To(d); err != nil {
			return err
		}
		tape := autograd.NewTape()
		p, err := tape.Param("p", x)
		if err != nil {
			return err
		}
		base := d.Memory().Stats().Allocated
		for step := range 3 {
			y, err := autograd.Scale(p, 2)
			if err != nil {
				return err
			}
			loss, err := autograd.Sum(y)
			if err != nil {
				return err
			}
			if err := tape.Backward(ctx, loss); err != nil {
				return err
			}
			for _, v := range []*autograd.Value{y, loss} {
				if err := v.Data().LocalBuffer().(device.Buffer).Free(); err != nil {
					return err
				}
			}
			p.ZeroGrad()
			if got := d.Memory().Stats().Allocated; got != base {
				t.Errorf("step %d: %d bytes allocated after ZeroGrad, %d before the step", step, got, base)
			}
		}
		return nil
	})
}

// TestDeviceAccumulatedGradFrees: a device gradient that Backward
// replaces by a new sum (accumulating over steps without ZeroGrad) is
// freed, so the device holds one gradient per leaf, not one per step.
func TestDeviceAccumulatedGradFrees(t *testing.T) {
	placementtest.Run(t, []int{1}, []string{"x"}, func(ctx context.Context, m *mesh.Mesh) error {
		d, err := emu.New(0)
		if err != nil {
			return err
		}
		defer d.Close()
		x, err := randTensor(m, []int{4, 5}, 1)
		if err != nil {
			return err
		}
		if x, err = x.To(d); err != nil {
			return err
		}
		tape := autograd.NewTape()
		p, err := tape.Param("p", x)
		if err != nil {
			return err
		}
		var after0 int64
		var grads []*placement.DTensor // keeps every gradient reachable, so no cleanup frees it
		for step := range 3 {
			y, err := autograd.Scale(p, 2)
			if err != nil {
				return err
			}
			loss, err := autograd.Sum(y)
			if err != nil {
				return err
			}
			if err := tape.Backward(ctx, loss); err != nil {
				return err
			}
			for _, v := range []*autograd.Value{y, loss} {
				if err := v.Data().LocalBuffer().(device.Buffer).Free(); err != nil {
					return err
				}
			}
			grads = append(grads, p.Grad())
			got := d.Memory().Stats().Allocated
			if step == 0 {
				after0 = got
			} else if got != after0 {
				t.Errorf("step %d: %d bytes allocated, %d after the first step", step, got, after0)
			}
		}
		g, err := hostData(p.Grad())
		if err != nil {
			return err
		}
		if g[0] != 6 {
			t.Errorf("gradient after 3 steps is %v, want 6", g[0])
		}
		runtime.KeepAlive(grads)
		return nil
	})
}

// TestDeviceCrossEntropyDoesNotWait: CrossEntropy's forward and backward
// on a device queue their work without waiting for it (the mean and the
// backward's scale are computed on the device): with the compute stream
// held, both return; the results then match the host's bit for bit
// (TestDeviceOpsMatchHost).
func TestDeviceCrossEntropyDoesNotWait(t *testing.T) {
	placementtest.Run(t, []int{1}, []string{"x"}, func(ctx context.Context, m *mesh.Mesh) error {
		d, err := emu.New(0)
		if err != nil {
			return err
		}
		defer d.Close()
		x, err := randTensor(m, []int{7, 11}, 1)
		if err != nil {
			return err
		}
		if x, err = x.To(d); err != nil {
			return err
		}
		tg, err := ids(m, []int{7}, 11, 4)
		if err != nil {
			return err
		}
		tape := autograd.NewTape(autograd.WithDevice(d))
		p, err := tape.Param("logits", x)
		if err != nil {
			return err
		}
		gate := make(chan struct{})
		var once sync.Once
		open := func() { once.Do(func() { close(gate) }) }
		defer open()
		if err := d.Compute().(*emu.Stream).Launch(func() error { <-gate; return nil }); err != nil {
			return err
		}
		done := make(chan error, 1)
		go func() {
			loss, err := autograd.CrossEntropy(p, tg)
			if err == nil {
				err = tape.Backward(ctx, loss)
			}
			done <- err
		}()
		select {
		case err := <-done:
			if err != nil {
				return err
			}
		case <-time.After(5 * time.Second):
			open()
			<-done
			return fmt.Errorf("CrossEntropy and its backward waited for the device's compute stream")
		}
		open()
		return d.Synchronize()
	})
}

// gradsOf returns the gradients of vs.
func gradsOf(vs []*autograd.Value) []*placement.DTensor {
	var out []*placement.DTensor
	for _, v := range vs {
		out = append(out, v.Grad())
	}
	return out
}

// parallelCase is a computation on a 2-rank mesh: inputs of the given
// shapes and placements (full values random, the same on every rank).
type parallelCase struct {
	name   string
	shapes [][]int
	places [][]placement.Placement
	f      func(ctx context.Context, in []*autograd.Value) (*autograd.Value, error)
}

// TestDeviceParallel: tensor- and data-parallel layouts on two ranks, each
// with its own emulated device, give every rank the host's local results
// and gradients bit for bit; Redistribute (an all-reduce of the rowwise
// output) runs on the device buffers through placement.
func TestDeviceParallel(t *testing.T) {
	R, S0, S1 := placement.Replicate(), placement.Shard(0), placement.Shard(1)
	pl := func(p placement.Placement) []placement.Placement { return []placement.Placement{p} }
	cases := []parallelCase{
		{"Megatron MLP", [][]int{{4, 6}, {8, 6}, {8}, {6, 8}, {6}}, [][]placement.Placement{pl(R), pl(S0), pl(S0), pl(S1), pl(R)},
			func(ctx context.Context, in []*autograd.Value) (*autograd.Value, error) {
				h, err := autograd.Linear(in[0], in[1], in[2])
				if err != nil {
					return nil, err
				}
				if h, err = autograd.GELU(h); err != nil {
					return nil, err
				}
				y, err := autograd.Linear(h, in[3], in[4])
				if err != nil {
					return nil, err
				}
				rs, err := y.Spec().With(pl(R))
				if err != nil {
					return nil, err
				}
				return autograd.Redistribute(ctx, y, rs)
			}},
		{"data parallel", [][]int{{6, 5}, {3, 5}, {3}}, [][]placement.Placement{pl(S0), pl(R), pl(R)},
			func(ctx context.Context, in []*autograd.Value) (*autograd.Value, error) {
				y, err := autograd.Linear(in[0], in[1], in[2])
				if err != nil {
					return nil, err
				}
				return autograd.Tanh(y)
			}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			run := func(opts ...placementtest.Option) [][][]float32 {
				var mu sync.Mutex
				got := make([][][]float32, 2)
				placementtest.Run(t, []int{2}, []string{"x"}, func(ctx context.Context, m *mesh.Mesh) error {
					d := placementtest.Device(ctx)
					tape := autograd.NewTape(autograd.WithDevice(d))
					var in []*autograd.Value
					for i, sh := range c.shapes {
						spec, err := placement.NewSpec(m, sh, comm.Float32, c.places[i])
						if err != nil {
							return err
						}
						dt, err := placement.FromFull(spec, placementtest.Random(sh, comm.Float32, uint64(i+1)))
						if err != nil {
							return err
						}
						if dt, err = dt.To(d); err != nil {
							return err
						}
						v, err := tape.Param(fmt.Sprint("in", i), dt)
						if err != nil {
							return err
						}
						in = append(in, v)
					}
					out, err := c.f(ctx, in)
					if err != nil {
						return err
					}
					loss, err := autograd.Sum(out)
					if err != nil {
						return err
					}
					res := [][]float32{}
					for _, dt := range []*placement.DTensor{out.Data(), loss.Data()} {
						h, err := hostData(dt)
						if err != nil {
							return err
						}
						res = append(res, h)
					}
					if err := tape.Backward(ctx, loss); err != nil {
						return err
					}
					for _, dt := range append([]*placement.DTensor{out.Data()}, gradsOf(in)...) {
						if dt.Device() != d {
							return fmt.Errorf("a result or gradient on %s, want %s", dt.Device().Name(), d.Name())
						}
					}
					for _, v := range in {
						h, err := hostData(v.Grad())
						if err != nil {
							return err
						}
						res = append(res, h)
					}
					mu.Lock()
					got[m.Rank()] = res
					mu.Unlock()
					return nil
				}, opts...)
				return got
			}
			want := run()
			got := run(placementtest.WithDevice(func(rank int) (device.Device, error) { return emu.New(rank) }))
			for r := range want {
				if err := sameBits(want[r], got[r]); err != nil {
					t.Errorf("rank %d: %v", r, err)
				}
			}
		})
	}
}

// TestDeviceParallelMemory: on two ranks with their own emulated
// devices, recycling steps of the Megatron MLP (whose Redistribute
// allocates its result in placement) hold the same device memory after
// every step, and no driver allocation follows the first.
func TestDeviceParallelMemory(t *testing.T) {
	R, S0, S1 := placement.Replicate(), placement.Shard(0), placement.Shard(1)
	pl := func(p placement.Placement) []placement.Placement { return []placement.Placement{p} }
	shapes := [][]int{{4, 6}, {8, 6}, {8}, {6, 8}, {6}}
	places := [][]placement.Placement{pl(R), pl(S0), pl(S0), pl(S1), pl(R)}
	placementtest.Run(t, []int{2}, []string{"x"}, func(ctx context.Context, m *mesh.Mesh) error {
		d := placementtest.Device(ctx)
		tape := autograd.NewTape(autograd.WithDevice(d), autograd.WithRecycling())
		var in []*autograd.Value
		for i, sh := range shapes {
			spec, err := placement.NewSpec(m, sh, comm.Float32, places[i])
			if err != nil {
				return err
			}
			dt, err := placement.FromFull(spec, placementtest.Random(sh, comm.Float32, uint64(i+1)))
			if err != nil {
				return err
			}
			if dt, err = dt.To(d); err != nil {
				return err
			}
			v, err := tape.Param(fmt.Sprint("in", i), dt)
			if err != nil {
				return err
			}
			in = append(in, v)
		}
		var first device.Stats
		for step := range 4 {
			for _, v := range in {
				v.ZeroGrad()
			}
			h, err := autograd.Linear(in[0], in[1], in[2])
			if err != nil {
				return err
			}
			y, err := autograd.Linear(h, in[3], in[4])
			if err != nil {
				return err
			}
			rs, err := y.Spec().With(pl(R))
			if err != nil {
				return err
			}
			if y, err = autograd.Redistribute(ctx, y, rs); err != nil {
				return err
			}
			loss, err := autograd.Sum(y)
			if err != nil {
				return err
			}
			if err := tape.Backward(ctx, loss); err != nil {
				return err
			}
			tape.Recycle()
			if err := d.Synchronize(); err != nil {
				return err
			}
			s := d.Memory().Stats()
			if step == 0 {
				first = s
			} else if s.Allocated != first.Allocated || s.DriverAllocs != first.DriverAllocs {
				return fmt.Errorf("step %d: %d bytes allocated, %d driver allocations; after step 0: %d, %d", step, s.Allocated, s.DriverAllocs, first.Allocated, first.DriverAllocs)
			}
		}
		return nil
	}, placementtest.WithDevice(func(rank int) (device.Device, error) { return emu.New(rank) }))
}

// TestDeviceAutocastMatchesHost runs every device case under
// WithAutocast on the host and on emu (async and synchronous) and
// compares outputs and gradients bit for bit: both round every float32
// GEMM's operands to bfloat16 and sum in float32 on the same BLAS. The
// matrix-product cases (MatMul, Linear, BatchedMatMul in the composed
// attention) must differ from their float32 results in every output and
// gradient: the rounding happened, forward and backward.
func TestDeviceAutocastMatchesHost(t *testing.T) {
	gemms := map[string]bool{"MatMul": true, "Linear": true, "Linear/no-bias": true, "CausalAttention/composed": true}
	for _, c := range append(devCases(), float64Cases()...) {
		t.Run(c.name, func(t *testing.T) {
			forEachDevice(t, func(ctx context.Context, m *mesh.Mesh, d device.Device) ([][]float32, error) {
				return devRun(ctx, m, c, d, autograd.WithAutocast())
			})
			if !gemms[c.name] {
				return
			}
			placementtest.Run(t, []int{1}, []string{"x"}, func(ctx context.Context, m *mesh.Mesh) error {
				f32, err := devRun(ctx, m, c, device.Host())
				if err != nil {
					return err
				}
				bf16, err := devRun(ctx, m, c, device.Host(), autograd.WithAutocast())
				if err != nil {
					return err
				}
				for i := range f32 {
					// devRun's results: output, loss, activation bytes
					// (alike), then the gradients (a Linear's bias
					// gradient is a sum of g alone: no GEMM).
					if i == 2 || (i == 5 && c.name == "Linear") {
						continue
					}
					if slices.Equal(f32[i], bf16[i]) {
						return fmt.Errorf("result %d is float32's under WithAutocast", i)
					}
				}
				return nil
			})
		})
	}
}
