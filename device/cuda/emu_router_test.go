//go:build linux && (amd64 || arm64)

package cuda

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/local"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/moe"
	"github.com/b7ea7098/loom/placement"
)

// cpuRoute routes the n tokens whose logits are z [n, e] with moe.Router
// on one rank: x = z and an identity router weight, so the logits the
// router computes are z exactly (each is one product by 1 plus zeros). It
// returns the chosen experts and the gates, and the router's configuration
// with its defaults filled in.
func cpuRoute(t *testing.T, z []float32, n, e int, cfg moe.RouterConfig, bias []float64) ([]int32, []float32, moe.RouterConfig) {
	t.Helper()
	var sel []int32
	var gates []float32
	var full moe.RouterConfig
	err := local.Run(context.Background(), 1, func(ctx context.Context, c comm.Communicator) error {
		m, err := mesh.New(c, []int{1}, []string{"ep"})
		if err != nil {
			return err
		}
		tape := autograd.NewTape()
		xs, err := placement.NewSpec(m, []int{n, e}, comm.Float32, []placement.Placement{placement.Shard(0)})
		if err != nil {
			return err
		}
		xd, err := placement.NewLocal(xs, slices.Clone(z))
		if err != nil {
			return err
		}
		x, err := tape.Constant(xd)
		if err != nil {
			return err
		}
		ws, err := placement.NewSpec(m, []int{e, e}, comm.Float32, []placement.Placement{placement.Replicate()})
		if err != nil {
			return err
		}
		eye := make([]float32, e*e)
		for i := range e {
			eye[i*e+i] = 1
		}
		wd, err := placement.NewLocal(ws, eye)
		if err != nil {
			return err
		}
		w, err := tape.Param("router", wd)
		if err != nil {
			return err
		}
		r, err := moe.NewRouter(w, cfg)
		if err != nil {
			return err
		}
		if bias != nil {
			if err := r.SetExpertBias(bias); err != nil {
				return err
			}
		}
		full = r.Config()
		rt, err := r.Route(ctx, x)
		if err != nil {
			return err
		}
		sel = slices.Clone(rt.Experts)
		gates = slices.Clone(rt.Gates.Data().LocalData().([]float32))
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return sel, gates, full
}

// The router kernel against moe.Router.Route on one rank: the scores are
// double in the CPU's order on both sides, rounded to float32, so the
// chosen experts are exact (ties by index included: logits drawn from a
// few values make many equal scores) and the gates agree within 1e-6
// relative (exp in double on the host and on the device may differ in the
// last bit, which can move a float32 rounding by one ulp, then divided by
// a renormalising sum). Softmax and sigmoid scores, renormalised or not,
// a gate scale, the expert bias and group-limited choice; a row with a
// non-finite logit gets the CPU's placeholder slots and is counted.
func testRouter(t *testing.T, e *emuLib) {
	r := rand.New(rand.NewPCG(27, 28))
	for _, c := range []struct {
		e    int
		cfg  moe.RouterConfig
		bias bool
	}{
		{1, moe.RouterConfig{K: 1}, false},
		{7, moe.RouterConfig{K: 2, Renormalize: true}, false},
		{8, moe.RouterConfig{K: 3, Score: moe.Sigmoid, Renormalize: true, GateScale: 2.5}, false},
		{33, moe.RouterConfig{K: 4}, true},
		{64, moe.RouterConfig{K: 8, Score: moe.Sigmoid, Renormalize: true, GateScale: 2.5, NumGroups: 8, TopGroups: 4, ExpertBias: true}, true},
		{12, moe.RouterConfig{K: 2, NumGroups: 4, TopGroups: 2, GroupScoreTop: 3, Renormalize: true}, false},
	} {
		for _, n := range []int{0, 1, 3, 17} {
			for _, ties := range []bool{false, true} {
				z := randF32(r, n*c.e, 3)
				if ties {
					for i := range z {
						z[i] = float32(r.IntN(3)) - 1
					}
				}
				var bias []float64
				var bias32 []float32
				if c.bias {
					bias, bias32 = make([]float64, c.e), make([]float32, c.e)
					for i := range bias {
						bias[i] = float64(r.IntN(5)-2) * 0.01
						bias32[i] = float32(bias[i])
					}
				}
				cfg := c.cfg
				cfg.ExpertBias = c.bias
				wantSel, wantGates, full := cpuRoute(t, z, n, c.e, cfg, bias)
				sigmoid, renorm := int32(0), int32(0)
				if full.Score == moe.Sigmoid {
					sigmoid = 1
				}
				if full.Renormalize {
					renorm = 1
				}
				for _, g := range []geometry{{1, 32}, {3, 64}, {9, 128}} {
					what := fmt.Sprintf("e %d, %+v, n %d, ties %v, grid %d×%d", c.e, full, n, ties, g.grid, g.block)
					k := full.K
					sel, gates, lse, bad := make([]int32, n*k), garbage(n*k), make([]float64, n), make([]int64, n)
					for i := range sel {
						sel[i] = -7
					}
					for i := range bad {
						bad[i] = -1
					}
					if err := e.run("loom_router_topk_f32", d1(g.grid), d1(g.block), 0, sel, gates, lse, bad, z, bias32,
						int64(n), int32(c.e), int32(k), sigmoid, renorm, full.GateScale,
						int32(full.NumGroups), int32(full.TopGroups), int32(full.GroupScoreTop)); err != nil {
						t.Fatal(err)
					}
					if !slices.Equal(sel, wantSel) {
						t.Errorf("%s: experts %v, want %v (moe.Router.Route)", what, sel, wantSel)
					}
					checkClose(t, what+": gates vs moe.Router.Route", gates, wantGates, 1e-6, 0)
					for i := range n {
						row := z[i*c.e : (i+1)*c.e]
						mx := float64(slices.Max(row))
						s := 0.0
						for _, v := range row {
							s += math.Exp(float64(v) - mx)
						}
						if want := mx + math.Log(s); math.Abs(lse[i]-want) > 1e-14*math.Abs(want)+1e-15 || bad[i] != 0 {
							t.Errorf("%s: token %d: lse %v, bad %d; want %v, 0", what, i, lse[i], bad[i], want)
						}
					}
				}
			}
		}
	}

	// Near-ties that only the float32 rounding of the CPU makes ties (then
	// the lower index wins): two softmax scores within half an ulp of 0.5,
	// and two sigmoid scores a few ulps apart that the expert bias 100
	// rounds to the same key.
	for _, c := range []struct {
		z    []float32
		cfg  moe.RouterConfig
		bias []float64
	}{
		{[]float32{0, 4e-8}, moe.RouterConfig{K: 1}, nil},
		{[]float32{0, 1e-6}, moe.RouterConfig{K: 1, Score: moe.Sigmoid, ExpertBias: true}, []float64{100, 100}},
	} {
		want, _, _ := cpuRoute(t, c.z, 1, 2, c.cfg, c.bias)
		var bias32 []float32
		for _, b := range c.bias {
			bias32 = append(bias32, float32(b))
		}
		sel, gates, bad := []int32{-7}, garbage(1), []int64{-1}
		if err := e.run("loom_router_topk_f32", d1(1), d1(32), 0, sel, gates, []float64(nil), bad, c.z, bias32,
			int64(1), int32(2), int32(1), int32(c.cfg.Score), int32(0), float64(1), int32(0), int32(0), int32(0)); err != nil {
			t.Fatal(err)
		}
		if sel[0] != want[0] {
			t.Errorf("near-tie %v, %+v: expert %d, want %d (moe.Router.Route)", c.z, c.cfg, sel[0], want[0])
		}
	}

	// Tokens with a NaN or an infinite logit: the CPU's placeholder slots
	// 0..K−1, gates 0, and the count of bad logits.
	z := []float32{1, float32(math.NaN()), float32(math.Inf(1)), 2, 0.5, 0.25, 3, 2, 1}
	sel, gates, bad := make([]int32, 6), garbage(6), make([]int64, 3)
	if err := e.run("loom_router_topk_f32", d1(1), d1(96), 0, sel, gates, []float64(nil), bad, z, []float32(nil),
		int64(3), int32(3), int32(2), int32(0), int32(1), float64(1), int32(0), int32(0), int32(0)); err != nil {
		t.Fatal(err)
	}
	if want := []int32{0, 1, 0, 1, 0, 1}; !slices.Equal(sel, want) || !slices.Equal(bad, []int64{2, 0, 0}) || gates[0] != 0 || gates[1] != 0 {
		t.Errorf("non-finite logits: experts %v, bad %v, gates %v; want %v, [2 0 0], 0 for the first token", sel, bad, gates, want)
	}
}
