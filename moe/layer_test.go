package moe_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"testing"

	"github.com/b7ea7098/loom"
	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/local"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/moe"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// Meshes of the parity tests: the fixture's 64 tokens sharded over 1, 2, 4
// and 8 expert-parallel ranks (one expert per rank at 8), over a
// data-parallel axis as well, and replicated over a tensor-parallel axis.
var epParityMeshes = []epMesh{
	{"ep=1", []int{1}, []string{"ep"}},
	{"ep=2", []int{2}, []string{"ep"}},
	{"ep=4", []int{4}, []string{"ep"}},
	{"ep=8", []int{8}, []string{"ep"}},
	{"dp=2,ep=4", []int{2, 4}, []string{"dp", "ep"}},
	{"ep=2,tp=2", []int{2, 2}, []string{"ep", "tp"}},
}

// epTol are reference/MOE_LAYER.md §8's tolerances.
const (
	tolGate = 1e-6 // gate_w, max abs
	tolY    = 1e-5 // y, relative L2
	tolLoss = 1e-5 // aux, zloss, L, relative
	tolGrad = 1e-4 // every gradient, relative L2
)

// TestLayerParity is reference/MOE_LAYER.md §8 end to end: the Router, Dispatch,
// the Experts and Combine, on every mesh of epParityMeshes, against the
// PyTorch fixture: routing (exactly), gates, y, aux, zloss, L, and the
// gradients of x, Wr, W1, b1, W2 and b2.
func TestLayerParity(t *testing.T) {
	fx := epLoadFixture(t)
	for _, mc := range epParityMeshes {
		t.Run(mc.name, func(t *testing.T) {
			placementtest.Run(t, mc.shape, mc.names, func(ctx context.Context, m *mesh.Mesh) error {
				tape := autograd.NewTape()
				tok := mc.tokenPlaces()
				x, err := epValue(tape, m, "x", []int{fx.n, fx.d}, tok, fx.x, true)
				if err != nil {
					return err
				}
				wr, err := epValue(tape, m, "Wr", []int{fx.e, fx.d}, replicated(m), fx.wr, true)
				if err != nil {
					return err
				}
				router, err := moe.NewRouter(wr, moe.RouterConfig{K: fx.k, Renormalize: true, AuxCoef: fx.alpha, ZCoef: fx.beta})
				if err != nil {
					return err
				}
				experts, err := moe.ShardExperts(tape, m, "ep", fx.e, fx.hd, fx.d, fx.w1, fx.b1, fx.w2, fx.b2)
				if err != nil {
					return err
				}
				layer := &moe.Layer{Router: router, Experts: experts}
				out, err := layer.Forward(ctx, x)
				if err != nil {
					return err
				}
				// Routing, exactly, on this rank's tokens.
				off, size, err := x.Spec().Box(m.Rank())
				if err != nil {
					return err
				}
				for i, ex := range out.Routing.Experts {
					if want := fx.topk[off[0]*fx.k+i]; int64(ex) != want {
						return fmt.Errorf("token %d slot %d: expert %d, want %d", off[0]+i/fx.k, i%fx.k, ex, want)
					}
				}
				if len(out.Routing.Experts) != size[0]*fx.k {
					return fmt.Errorf("%d slots for %d tokens", len(out.Routing.Experts), size[0])
				}
				gates, err := epFull(ctx, out.Routing.Gates.Data())
				if err != nil {
					return err
				}
				if d := maxAbs(gates, f64(fx.gate)); d > tolGate {
					return fmt.Errorf("gate_w: max abs difference %.3g > %.3g", d, tolGate)
				}
				y, err := epFull(ctx, out.Y.Data())
				if err != nil {
					return err
				}
				yErr := relL2(y, f64(fx.y))
				if yErr > tolY {
					return fmt.Errorf("y: relative L2 error %.3g > %.3g", yErr, tolY)
				}
				// L = Σ y·G + α·aux + β·zloss.
				g, err := epValue(tape, m, "G", []int{fx.n, fx.d}, tok, fx.g, false)
				if err != nil {
					return err
				}
				yg, err := autograd.Mul(out.Y, g)
				if err != nil {
					return err
				}
				task, err := autograd.Sum(yg)
				if err != nil {
					return err
				}
				loss, err := out.AddLosses(task)
				if err != nil {
					return err
				}
				for _, s := range []struct {
					name  string
					v     *autograd.Value
					scale float64
					want  float64
				}{{"aux", out.Routing.Aux, fx.alpha, fx.aux}, {"zloss", out.Routing.Z, fx.beta, fx.zloss}, {"L", loss, 1, fx.l}} {
					v, err := epFull(ctx, s.v.Data())
					if err != nil {
						return err
					}
					if e := math.Abs(v[0]/s.scale-s.want) / math.Abs(s.want); e > tolLoss {
						return fmt.Errorf("%s = %v, want %v (relative error %.3g > %.3g)", s.name, v[0]/s.scale, s.want, e, tolLoss)
					}
				}
				if err := tape.Backward(ctx, loss); err != nil {
					return err
				}
				w := experts.OwnParams()
				worst := 0.0
				for _, gc := range []struct {
					name string
					v    *autograd.Value
					want []float32
				}{{"x", x, fx.dx}, {"Wr", wr, fx.dwr}, {"W1", w[0], fx.dw1}, {"b1", w[1], fx.db1}, {"W2", w[2], fx.dw2}, {"b2", w[3], fx.db2}} {
					got, err := epFull(ctx, gc.v.Grad())
					if err != nil {
						return fmt.Errorf("grad %s: %w", gc.name, err)
					}
					e := relL2(got, f64(gc.want))
					if e > tolGrad {
						return fmt.Errorf("grad %s: relative L2 error %.3g > %.3g", gc.name, e, tolGrad)
					}
					worst = max(worst, e)
				}
				// Diagnostics: with every token shard in one expert-parallel
				// group, the group's tokens per expert are the global counts.
				st := out.Handle.Stats()
				if !slices.Contains(mc.names, "dp") && !slices.Equal(st.TokensPerExpert, out.Routing.Counts) {
					return fmt.Errorf("stats: tokens per expert %v, routing counts %v", st.TokensPerExpert, out.Routing.Counts)
				}
				if st.Ranks > 1 && (st.Forward.PayloadExchange+st.Forward.Fused <= 0 || st.Backward.PayloadExchange+st.Backward.Fused <= 0 || st.Backward.Experts <= 0) {
					return fmt.Errorf("stats: timings not recorded: %v", st)
				}
				for _, tm := range []moe.Timings{st.Forward, st.Backward} {
					if tm.Fused > 0 && tm.Permute+tm.PayloadExchange+tm.Combine > 0 {
						return fmt.Errorf("stats: a fused pass also counted separate parts: %+v", tm)
					}
				}
				if m.Rank() == 0 {
					t.Logf("y relative L2 error %.3g, largest gradient relative L2 error %.3g", yErr, worst)
				}
				return nil
			})
		})
	}
}

// float32Experts makes the fixture's experts as float32 parameters.
func float32Experts(tape *autograd.Tape, m *mesh.Mesh, fx *epFixture) (*moe.Experts, error) {
	ep := make([]placement.Placement, m.NDim())
	for a, n := range m.Names() {
		ep[a] = placement.Replicate()
		if n == "ep" {
			ep[a] = placement.Shard(0)
		}
	}
	w1, err := epValue(tape, m, "W1", []int{fx.e, fx.hd, fx.d}, ep, fx.w1, true)
	if err != nil {
		return nil, err
	}
	b1, err := epValue(tape, m, "b1", []int{fx.e, fx.hd}, ep, fx.b1, true)
	if err != nil {
		return nil, err
	}
	w2, err := epValue(tape, m, "W2", []int{fx.e, fx.d, fx.hd}, ep, fx.w2, true)
	if err != nil {
		return nil, err
	}
	b2, err := epValue(tape, m, "b2", []int{fx.e, fx.d}, ep, fx.b2, true)
	if err != nil {
		return nil, err
	}
	return moe.NewExperts("ep", w1, b1, w2, b2)
}

// TestFixtureRoutingParity checks dispatch, experts and combine alone
// against the fixture, routing by its topk_idx and weighting by its gate_w
// (a constant): y and the experts' gradients of Σ y·G do not depend on the
// router, so they must match reference/MOE_LAYER.md §8 whoever routes.
func TestFixtureRoutingParity(t *testing.T) {
	fx := epLoadFixture(t)
	for _, mc := range epParityMeshes {
		for _, capacity := range []int{0, 64} {
			t.Run(fmt.Sprintf("%s/capacity=%d", mc.name, capacity), func(t *testing.T) {
				placementtest.Run(t, mc.shape, mc.names, func(ctx context.Context, m *mesh.Mesh) error {
					tape := autograd.NewTape()
					tok := mc.tokenPlaces()
					x, err := epValue(tape, m, "x", []int{fx.n, fx.d}, tok, fx.x, false)
					if err != nil {
						return err
					}
					gates, err := epValue(tape, m, "gates", []int{fx.n, fx.k}, tok, fx.gate, false)
					if err != nil {
						return err
					}
					experts, err := float32Experts(tape, m, fx)
					if err != nil {
						return err
					}
					slots := make([]int32, len(fx.topk))
					for i, v := range fx.topk {
						slots[i] = int32(v)
					}
					r, err := epLocalRouting(epCase{n: fx.n, e: fx.e, k: fx.k, experts: slots}, x.Spec(), m, gates)
					if err != nil {
						return err
					}
					rows, h, err := moe.Dispatch(ctx, x, r, moe.DispatchConfig{Axis: "ep", Capacity: capacity})
					if err != nil {
						return err
					}
					o, err := experts.Forward(ctx, rows, h)
					if err != nil {
						return err
					}
					y, err := moe.Combine(ctx, o, h, gates)
					if err != nil {
						return err
					}
					yf, err := epFull(ctx, y.Data())
					if err != nil {
						return err
					}
					if e := relL2(yf, f64(fx.y)); e > tolY {
						return fmt.Errorf("y: relative L2 error %.3g > %.3g", e, tolY)
					}
					g, err := epValue(tape, m, "G", []int{fx.n, fx.d}, tok, fx.g, false)
					if err != nil {
						return err
					}
					yg, err := autograd.Mul(y, g)
					if err != nil {
						return err
					}
					loss, err := autograd.Sum(yg)
					if err != nil {
						return err
					}
					if err := tape.Backward(ctx, loss); err != nil {
						return err
					}
					w := experts.OwnParams()
					for i, want := range [][]float32{fx.dw1, fx.db1, fx.dw2, fx.db2} {
						got, err := epFull(ctx, w[i].Grad())
						if err != nil {
							return err
						}
						if e := relL2(got, f64(want)); e > tolGrad {
							return fmt.Errorf("grad %s: relative L2 error %.3g > %.3g", w[i].Name(), e, tolGrad)
						}
					}
					return nil
				})
			})
		}
	}
}

// TestLayerErrors: a layer whose parts do not fit is rejected before
// anything runs.
func TestLayerErrors(t *testing.T) {
	fx := epLoadFixture(t)
	placementtest.Run(t, []int{2}, []string{"ep"}, func(ctx context.Context, m *mesh.Mesh) error {
		tape := autograd.NewTape()
		x, err := epValue(tape, m, "x", []int{fx.n, fx.d}, []placement.Placement{placement.Shard(0)}, fx.x, true)
		if err != nil {
			return err
		}
		wr, err := epValue(tape, m, "Wr", []int{4, fx.d}, replicated(m), fx.wr[:4*fx.d], true)
		if err != nil {
			return err
		}
		router, err := moe.NewRouter(wr, moe.RouterConfig{K: 2})
		if err != nil {
			return err
		}
		experts, err := float32Experts(tape, m, fx)
		if err != nil {
			return err
		}
		for _, tc := range []struct {
			name  string
			layer *moe.Layer
			text  string
		}{
			{"nil experts", &moe.Layer{Router: router}, "nil layer"},
			{"other axis", &moe.Layer{Router: router, Experts: experts, Dispatch: moe.DispatchConfig{Axis: "dp"}}, `dispatch over axis "dp"`},
			{"expert counts differ", &moe.Layer{Router: router, Experts: experts}, "4 experts, the experts module 8"},
		} {
			if _, err := tc.layer.Forward(ctx, x); !errors.Is(err, moe.ErrInvalid) || !strings.Contains(err.Error(), tc.text) {
				t.Errorf("%s: error %v, want ErrInvalid containing %q", tc.name, err, tc.text)
			}
		}
		if ps := (&moe.Layer{Router: router, Experts: experts}).OwnParams(); len(ps) != 5 || ps[0] != wr {
			t.Errorf("OwnParams: %d params", len(ps))
		}
		return nil
	})
}

// TestShardExpertsInput: each rank keeps its experts' rows of the full
// weights, in float32 and float64, and a weight whose length does not
// match its shape is refused on every rank before anything is built.
func TestShardExpertsInput(t *testing.T) {
	const e, hd, d = 4, 3, 2
	ramp := func(n int) []float64 {
		out := make([]float64, n)
		for i := range out {
			out[i] = float64(i)
		}
		return out
	}
	for _, tc := range []struct {
		name string
		w1   []float64
		ok   bool
	}{
		{"whole", ramp(e * hd * d), true},
		{"short W1", ramp(e*hd*d - 1), false},
		{"long W1", ramp(e*hd*d + 1), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := local.Run(context.Background(), 2, func(ctx context.Context, c comm.Communicator) error {
				m, err := mesh.New(c, []int{2}, []string{"ep"})
				if err != nil {
					return err
				}
				x, err := moe.ShardExperts(autograd.NewTape(), m, "ep", e, hd, d, tc.w1, ramp(e*hd), ramp(e*d*hd), ramp(e*d))
				if !tc.ok {
					if !errors.Is(err, loom.ErrInvalid) || !strings.Contains(err.Error(), "moe.W1") {
						return fmt.Errorf("rank %d: error %v, want ErrInvalid naming moe.W1", c.Rank(), err)
					}
					return nil
				}
				if err != nil {
					return err
				}
				// Rank r holds experts 2r and 2r+1: W1's rows from 2r·hd·d on.
				got := x.W1.Data().LocalData().([]float64)
				if want := ramp(e * hd * d)[c.Rank()*2*hd*d : (c.Rank()+1)*2*hd*d]; !slices.Equal(got, want) {
					return fmt.Errorf("rank %d: W1 block %v, want %v", c.Rank(), got, want)
				}
				return nil
			})
			if err != nil {
				t.Fatal(err)
			}
		})
	}
}

// TestLayerCapacity runs the layer with the router's capacity limit and
// padding to capacity (RouterConfig.CapacityFactor, PadToCapacity), which
// selects the static-capacity dispatch: every rank's y must equal the
// serial computation over its tokens with the router's surviving slots
// and gates, and the dispatch's diagnostics must report the router's
// dropped slots and the padding, as Routing.Dropped and Routing.Padded
// count them over the global batch.
func TestLayerCapacity(t *testing.T) {
	fx := epLoadFixture(t)
	for _, mc := range []epMesh{{"ep=2", []int{2}, []string{"ep"}}, {"ep=4", []int{4}, []string{"ep"}}, {"dp=2,ep=2", []int{2, 2}, []string{"dp", "ep"}}} {
		for _, factor := range []float64{0.5, 1, 2} {
			t.Run(fmt.Sprintf("%s/factor=%g", mc.name, factor), func(t *testing.T) {
				placementtest.Run(t, mc.shape, mc.names, func(ctx context.Context, m *mesh.Mesh) error {
					tape := autograd.NewTape()
					tok := mc.tokenPlaces()
					x, err := epValue(tape, m, "x", []int{fx.n, fx.d}, tok, fx.x, true)
					if err != nil {
						return err
					}
					wr, err := epValue(tape, m, "Wr", []int{fx.e, fx.d}, replicated(m), fx.wr, true)
					if err != nil {
						return err
					}
					router, err := moe.NewRouter(wr, moe.RouterConfig{K: fx.k, Renormalize: true, AuxCoef: fx.alpha, CapacityFactor: factor, PadToCapacity: true})
					if err != nil {
						return err
					}
					experts, err := float32Experts(tape, m, fx)
					if err != nil {
						return err
					}
					out, err := (&moe.Layer{Router: router, Experts: experts}).Forward(ctx, x)
					if err != nil {
						return err
					}
					rt, h := out.Routing, out.Handle
					if h.Capacity() != rt.Capacity || rt.Capacity == 0 {
						return fmt.Errorf("dispatch capacity %d, routing capacity %d", h.Capacity(), rt.Capacity)
					}
					// y on this rank's tokens against the serial formula.
					off, size, err := x.Spec().Box(m.Rank())
					if err != nil {
						return err
					}
					n := size[0]
					xl := f64(fx.x[off[0]*fx.d : (off[0]+n)*fx.d])
					gl := f64(out.Routing.Gates.Data().LocalData().([]float32))
					want := epReference(n, fx.d, fx.e, fx.k, fx.hd, xl, rt.Experts, gl,
						f64(fx.w1), f64(fx.b1), f64(fx.w2), f64(fx.b2), make([]float64, n*fx.d))
					if e := relL2(f64(out.Y.Data().LocalData().([]float32)), want.y); e > tolY {
						return fmt.Errorf("y: relative L2 error %.3g > %.3g", e, tolY)
					}
					st := h.Stats()
					unrouted, err := sumOverShards(ctx, m, x.Spec(), st.Unrouted)
					if err != nil {
						return err
					}
					padded, err := sumOverShards(ctx, m, x.Spec(), st.Padded)
					if err != nil {
						return err
					}
					if unrouted != rt.Dropped || padded != rt.Padded || st.Dropped != 0 {
						return fmt.Errorf("stats: %d unrouted, %d padded, %d dropped by dispatch; routing: %d dropped, %d padded", unrouted, padded, st.Dropped, rt.Dropped, rt.Padded)
					}
					if factor < 1 && rt.Dropped == 0 {
						return fmt.Errorf("capacity factor %g dropped nothing", factor)
					}
					if want := float64(st.Unrouted) / float64(st.Slots); math.Abs(st.DroppedFraction-want) > 1e-12 {
						return fmt.Errorf("dropped fraction %v, want %v", st.DroppedFraction, want)
					}
					// The backward runs through the static layout too.
					s, err := autograd.Sum(out.Y)
					if err != nil {
						return err
					}
					loss, err := out.AddLosses(s)
					if err != nil {
						return err
					}
					return tape.Backward(ctx, loss)
				})
			})
		}
	}
}
