package emu_test

import (
	"errors"
	"math/rand/v2"
	"testing"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/device/emu"
	"github.com/b7ea7098/loom/kernels"
)

// moeCases are TestKernelsMatchCPU's rows for device.MoEKernels: a plan of
// 7 tokens, K = 2 of 4 experts with unrouted slots, dropless and at a
// capacity of 2 (dropped slots and pad rows), rows of 5.
func moeCases() []kernelCase {
	const n, k, e, d = 7, 2, 4, 5
	plan := func(capacity int) *kernels.Routing {
		r := rand.New(rand.NewPCG(uint64(capacity), 7))
		experts := make([]int32, n*k)
		for i := range experts {
			experts[i] = int32(r.IntN(e+1)) - 1
		}
		var p kernels.Routing
		if err := kernels.PlanRouting(&p, experts, k, e, capacity); err != nil {
			panic(err)
		}
		return &p
	}
	mk := func(k device.Kernels) device.MoEKernels { return k.(device.MoEKernels) }
	var cases []kernelCase
	for _, capacity := range []int{0, 2} {
		p := plan(capacity)
		rows := p.Rows()
		name := "MoE/dropless"
		if capacity > 0 {
			name = "MoE/capacity"
		}
		cases = append(cases, kernelCase{
			name: name + "/Permute+Unpermute",
			setup: func(r *rand.Rand, _ kernels.Workers) arrays {
				return arrays{"x": randF32(r, n*d), "packed": randF32(r, rows*d), "gates": randF32(r, n*k),
					"out": randF32(r, n*d), "sum": randF32(r, n*d)}
			},
			cpu: func(_ *kernels.BLAS, _ kernels.Workers, a arrays) error {
				if err := kernels.Permute(f32s(a["packed"]), f32s(a["x"]), d, p); err != nil {
					return err
				}
				if err := kernels.Unpermute(f32s(a["out"]), f32s(a["packed"]), f32s(a["gates"]), d, p); err != nil {
					return err
				}
				return kernels.Unpermute(f32s(a["sum"]), f32s(a["packed"]), nil, d, p)
			},
			dev: func(k device.Kernels, b map[string]device.Buffer) error {
				m := mk(k)
				if err := m.Permute(b["packed"], b["x"], d, p); err != nil {
					return err
				}
				if err := m.Unpermute(b["out"], b["packed"], b["gates"], d, p); err != nil {
					return err
				}
				return m.Unpermute(b["sum"], b["packed"], nil, d, p)
			},
		}, kernelCase{
			name: name + "/UnpermuteBackward",
			setup: func(r *rand.Rand, _ kernels.Workers) arrays {
				return arrays{"dout": randF32(r, n*d), "packed": randF32(r, rows*d), "gates": randF32(r, n*k),
					"dpacked": randF32(r, rows*d), "dgates": randF32(r, n*k), "dp1": randF32(r, rows*d)}
			},
			cpu: func(_ *kernels.BLAS, _ kernels.Workers, a arrays) error {
				if err := kernels.UnpermuteBackward(f32s(a["dpacked"]), f32s(a["dgates"]), f32s(a["dout"]), f32s(a["packed"]), f32s(a["gates"]), d, p); err != nil {
					return err
				}
				return kernels.UnpermuteBackward(f32s(a["dp1"]), nil, f32s(a["dout"]), nil, nil, d, p)
			},
			dev: func(k device.Kernels, b map[string]device.Buffer) error {
				m := mk(k)
				if err := m.UnpermuteBackward(b["dpacked"], b["dgates"], b["dout"], b["packed"], b["gates"], d, p); err != nil {
					return err
				}
				return m.UnpermuteBackward(b["dp1"], nil, b["dout"], nil, nil, d, p)
			},
		})
	}
	counts := []int{3, 0, 2, 4, 1, 5} // 3 ranks × 2 local experts
	const total = 15
	cases = append(cases, kernelCase{
		name: "MoE/GroupByExpert+GroupByRank",
		setup: func(r *rand.Rand, _ kernels.Workers) arrays {
			return arrays{"src": randF32(r, total*d), "byExpert": randF32(r, total*d), "byRank": randF32(r, total*d)}
		},
		cpu: func(_ *kernels.BLAS, _ kernels.Workers, a arrays) error {
			if err := kernels.GroupByExpert(f32s(a["byExpert"]), f32s(a["src"]), d, counts, 3, 2); err != nil {
				return err
			}
			return kernels.GroupByRank(f32s(a["byRank"]), f32s(a["src"]), d, counts, 3, 2)
		},
		dev: func(k device.Kernels, b map[string]device.Buffer) error {
			m := mk(k)
			if err := m.GroupByExpert(b["byExpert"], b["src"], d, counts, 3, 2); err != nil {
				return err
			}
			return m.GroupByRank(b["byRank"], b["src"], d, counts, 3, 2)
		},
	})
	return cases
}

// TestMoEKernelsPlanCopied: the plan and counts are read at the call, so
// changing them before the stream runs the work changes nothing; a nil
// plan and float64 buffers are refused at the call.
func TestMoEKernelsPlanCopied(t *testing.T) {
	d, err := emu.New(0)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	m := d.Kernels().(device.MoEKernels)
	var p kernels.Routing
	if err := kernels.PlanRouting(&p, []int32{1, 0, 0, 1}, 1, 2, 0); err != nil {
		t.Fatal(err)
	}
	x := []float32{1, 2, 3, 4}
	want := make([]float32, 4)
	if err := kernels.Permute(want, x, 1, &p); err != nil {
		t.Fatal(err)
	}
	xb, _ := d.Alloc(comm.Float32, 4)
	out, _ := d.Alloc(comm.Float32, 4)
	// Hold the stream so the Permute runs after the plan has changed.
	release := make(chan struct{})
	if err := d.Compute().(*emu.Stream).Launch(func() error { <-release; return nil }); err != nil {
		t.Fatal(err)
	}
	if err := d.CopyFromHost(xb, comm.Host(x)); err != nil {
		t.Fatal(err)
	}
	if err := m.Permute(out, xb, 1, &p); err != nil {
		t.Fatal(err)
	}
	if err := kernels.PlanRouting(&p, []int32{0, 1, 1, 0}, 1, 2, 0); err != nil {
		t.Fatal(err)
	}
	close(release)
	got := make([]float32, 4)
	if err := d.CopyToHost(comm.Host(got), out); err != nil {
		t.Fatal(err)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("Permute used the plan made after the call: got %v, want %v", got, want)
		}
	}
	if err := m.Permute(out, xb, 1, nil); !errors.Is(err, device.ErrInvalid) {
		t.Errorf("nil plan: %v, want ErrInvalid", err)
	}
	f64, _ := d.Alloc(comm.Float64, 4)
	if err := m.GroupByRank(f64, xb, 1, []int{4}, 1, 1); !errors.Is(err, device.ErrInvalid) {
		t.Errorf("float64 dst: %v, want ErrInvalid", err)
	}
}
