package moe

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"sort"
	"strings"
	"testing"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// combos calls fn with every r-subset of 0..n-1 in lexicographic order.
func combos(n, r int, fn func([]int)) {
	idx := make([]int, r)
	var rec func(start, depth int)
	rec = func(start, depth int) {
		if depth == r {
			fn(idx)
			return
		}
		for i := start; i < n; i++ {
			idx[depth] = i
			rec(i+1, depth+1)
		}
	}
	rec(0, 0)
}

// bruteBest returns the r-subset of allowed indices (nil: all) of keys with
// the largest sum, ordered by descending key (the reference's selection
// when no two sums or keys tie).
func bruteBest(keys []float64, allowed []bool, r int) []int32 {
	bestSum := math.Inf(-1)
	var best []int
	combos(len(keys), r, func(c []int) {
		s := 0.0
		for _, i := range c {
			if allowed != nil && !allowed[i] {
				return
			}
			s += keys[i]
		}
		if s > bestSum {
			bestSum, best = s, slices.Clone(c)
		}
	})
	sort.SliceStable(best, func(a, b int) bool { return keys[best[a]] > keys[best[b]] })
	out := make([]int32, r)
	for i, v := range best {
		out[i] = int32(v)
	}
	return out
}

// bruteGroupSelect is group-limited top-K by exhaustive search: each
// group's score is its best sumTop-subset sum, the chosen groups the best
// top-subset of groups, the experts the best K-subset inside them.
func bruteGroupSelect(keys []float64, groups, top, sumTop, k int) []int32 {
	size := len(keys) / groups
	gs := make([]float64, groups)
	for g := range groups {
		s := 0.0
		for _, i := range bruteBest(keys[g*size:(g+1)*size], nil, sumTop) {
			s += keys[g*size+int(i)]
		}
		gs[g] = s
	}
	allowed := make([]bool, len(keys))
	for _, g := range bruteBest(gs, nil, top) {
		for e := int(g) * size; e < int(g+1)*size; e++ {
			allowed[e] = true
		}
	}
	return bruteBest(keys, allowed, k)
}

func TestSelectExpertsMatchesBruteForce(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for _, c := range []struct{ e, groups, top, sumTop, k int }{
		{6, 0, 0, 0, 1}, {6, 0, 0, 0, 3}, {6, 0, 0, 0, 6},
		{8, 4, 2, 1, 2}, {8, 4, 2, 2, 3}, {12, 4, 2, 2, 3}, {12, 3, 1, 3, 4},
		{12, 6, 3, 1, 5}, {16, 4, 4, 2, 6}, {9, 3, 2, 3, 6},
	} {
		t.Run(fmt.Sprintf("E%d_G%d_top%d_sum%d_K%d", c.e, c.groups, c.top, c.sumTop, c.k), func(t *testing.T) {
			var g *groupLimit
			if c.groups > 0 {
				g = &groupLimit{groups: c.groups, top: c.top, sumTop: c.sumTop}
			}
			for trial := range 200 {
				keys := make([]float64, c.e)
				for i := range keys {
					keys[i] = rng.Float64()
				}
				got := make([]int32, c.k)
				selectExperts(keys, g, got)
				var want []int32
				if g == nil {
					want = bruteBest(keys, nil, c.k)
				} else {
					want = bruteGroupSelect(keys, c.groups, c.top, c.sumTop, c.k)
				}
				if !slices.Equal(got, want) {
					t.Fatalf("trial %d, keys %v: selected %v, brute force %v", trial, keys, got, want)
				}
			}
		})
	}
}

func TestSelectExpertsTies(t *testing.T) {
	for _, c := range []struct {
		keys []float64
		g    *groupLimit
		k    int
		want []int32
	}{
		{[]float64{1, 1, 1, 1}, nil, 2, []int32{0, 1}},
		{[]float64{0.1, 0.5, 0.2, 0.5}, nil, 3, []int32{1, 3, 2}},
		{[]float64{math.NaN(), 0.1, math.NaN(), 0.2}, nil, 3, []int32{3, 1, 0}},
		// Equal group scores: the lower group.
		{[]float64{0.5, 0.25, 0.25, 0.5, 0.375, 0.375}, &groupLimit{groups: 3, top: 1, sumTop: 2}, 2, []int32{0, 1}},
		{[]float64{0.25, 0.5, 0.5, 0.25, 0.375, 0.375}, &groupLimit{groups: 3, top: 2, sumTop: 1}, 3, []int32{1, 2, 0}},
		{[]float64{0.3, 0.1, 0.1, 0.3, 0.9, 0.0}, &groupLimit{groups: 3, top: 1, sumTop: 1}, 2, []int32{4, 5}},
	} {
		got := make([]int32, c.k)
		selectExperts(c.keys, c.g, got)
		if !slices.Equal(got, c.want) {
			t.Errorf("keys %v (groups %+v): selected %v, want %v", c.keys, c.g, got, c.want)
		}
	}
}

func TestCapacityAndDropping(t *testing.T) {
	for _, c := range []struct {
		n, k, e int
		f       float64
		want    int
	}{
		{64, 2, 8, 1, 16}, {5, 2, 8, 1, 2}, {0, 2, 8, 1, 0}, {10, 1, 4, 1.25, 4}, {7, 3, 4, 0.5, 3},
	} {
		if got := capacityOf(c.n, c.k, c.e, c.f); got != c.want {
			t.Errorf("capacity of %d tokens, K %d, E %d, factor %v = %d, want %d", c.n, c.k, c.e, c.f, got, c.want)
		}
	}
	// Four tokens, K = 1, all on expert 0 with these gates; capacity 2.
	sel := []int32{0, 0, 0, 0}
	gates := []float64{0.5, 0.9, 0.5, 0.7}
	for _, c := range []struct {
		policy DropPolicy
		want   []bool
	}{
		{DropByProb, []bool{false, true, false, true}},
		{DropByPosition, []bool{true, true, false, false}},
	} {
		kept := []bool{true, true, true, true}
		dropOverCapacity(sel, gates, 2, 2, c.policy, kept)
		if !slices.Equal(kept, c.want) {
			t.Errorf("%v: kept %v, want %v", c.policy, kept, c.want)
		}
	}
	// Equal gates keep the earlier token.
	kept := []bool{true, true, true, true}
	dropOverCapacity(sel, []float64{0.5, 0.5, 0.5, 0.9}, 1, 2, DropByProb, kept)
	if want := []bool{true, false, false, true}; !slices.Equal(kept, want) {
		t.Errorf("equal gates: kept %v, want %v", kept, want)
	}
}

// refResult is the float64 reference routing of a global batch.
type refResult struct {
	experts         []int32
	gates           []float64
	counts          []int64
	dropped, padded int64
	aux, z          float64 // NaN when off
}

// refRoute routes N tokens x [N, D] with w [E, D] the obvious way, in
// float64, applying the capacity limit per shard (offset, size) of tokens.
func refRoute(cfg RouterConfig, bias, x, w []float64, n, d int, shards [][2]int) refResult {
	e := len(w) / d
	k := cfg.K
	res := refResult{experts: make([]int32, n*k), gates: make([]float64, n*k), counts: make([]int64, e), aux: math.NaN(), z: math.NaN()}
	p := make([]float64, n*e)
	pAux := make([]float64, n*e)
	lse := make([]float64, n)
	for t := range n {
		z := make([]float64, e)
		mx := math.Inf(-1)
		for a := range e {
			for b := range d {
				z[a] += x[t*d+b] * w[a*d+b]
			}
			mx = max(mx, z[a])
		}
		s := 0.0
		for a := range e {
			s += math.Exp(z[a] - mx)
		}
		lse[t] = mx + math.Log(s)
		sig := 0.0
		for a := range e {
			if cfg.Score == Softmax {
				p[t*e+a] = math.Exp(z[a]-mx) / s
			} else {
				p[t*e+a] = 1 / (1 + math.Exp(-z[a]))
				sig += p[t*e+a]
			}
		}
		for a := range e {
			pAux[t*e+a] = p[t*e+a]
			if cfg.Score == Sigmoid {
				pAux[t*e+a] /= sig
			}
		}
		keys := slices.Clone(p[t*e : (t+1)*e])
		if cfg.ExpertBias {
			for a := range keys {
				keys[a] += bias[a]
			}
		}
		var sel []int32
		if cfg.NumGroups > 0 {
			sel = bruteGroupSelect(keys, cfg.NumGroups, cfg.TopGroups, cfg.GroupScoreTop, k)
		} else {
			sel = bruteBest(keys, nil, k)
		}
		den := 1.0
		if cfg.Renormalize {
			den = 0
			for _, a := range sel {
				den += p[t*e+int(a)]
			}
		}
		for j, a := range sel {
			res.experts[t*k+j] = a
			res.gates[t*k+j] = cfg.GateScale * p[t*e+int(a)] / den
		}
	}
	selected := make([]int64, e)
	for _, a := range res.experts {
		selected[a]++
	}
	var slots int64
	if cfg.CapacityFactor > 0 {
		for _, sh := range shards {
			c := int(math.Ceil(float64(sh[1]*k) / float64(e) * cfg.CapacityFactor))
			slots += int64(e * c)
			for a := range e {
				var idx []int
				for s := sh[0] * k; s < (sh[0]+sh[1])*k; s++ {
					if res.experts[s] == int32(a) {
						idx = append(idx, s)
					}
				}
				if cfg.DropPolicy == DropByProb {
					sort.SliceStable(idx, func(i, j int) bool { return res.gates[idx[i]] > res.gates[idx[j]] })
				}
				if len(idx) > c {
					for _, s := range idx[c:] {
						res.experts[s], res.gates[s] = -1, 0
						res.dropped++
					}
				}
			}
		}
	}
	for _, a := range res.experts {
		if a >= 0 {
			res.counts[a]++
		}
	}
	if cfg.PadToCapacity {
		res.padded = slots - int64(n*k) + res.dropped
	}
	if cfg.AuxCoef != 0 {
		aux := 0.0
		for a := range e {
			pe := 0.0
			for t := range n {
				pe += pAux[t*e+a]
			}
			aux += float64(selected[a]) / float64(n*k) * pe / float64(n)
		}
		res.aux = cfg.AuxCoef * float64(e) * aux
	}
	if cfg.ZCoef != 0 {
		s := 0.0
		for _, l := range lse {
			s += l * l
		}
		res.z = cfg.ZCoef * s / float64(n)
	}
	return res
}

// chunks returns the torch.chunk shards of n rows over p ranks.
func chunks(n, p int) [][2]int {
	c := (n + p - 1) / p
	var out [][2]int
	for r := range p {
		lo := min(r*c, n)
		out = append(out, [2]int{lo, min(c, n-lo)})
	}
	return out
}

func randomSlice(rng *rand.Rand, n int, scale float64) []float64 {
	v := make([]float64, n)
	for i := range v {
		v[i] = scale * rng.NormFloat64()
	}
	return v
}

// routerCase is one configuration of the edge-case and gradient tables.
type routerCase struct {
	name    string
	cfg     RouterConfig
	n, d, e int
	bias    []float64
	x, w    func(x, w []float64) // adjust the random inputs
	check   func(t *testing.T, got *routerRun)
}

func routerCases() []routerCase {
	base := RouterConfig{K: 2, Renormalize: true, AuxCoef: 0.01, ZCoef: 0.001}
	with := func(f func(c *RouterConfig)) RouterConfig {
		c := base
		f(&c)
		return c
	}
	return []routerCase{
		{name: "softmax", cfg: base, n: 12, d: 5, e: 6},
		{name: "softmax_no_renormalize_scaled", cfg: with(func(c *RouterConfig) { c.Renormalize = false; c.GateScale = 2.5 }), n: 12, d: 5, e: 6},
		{name: "k_equals_e", cfg: with(func(c *RouterConfig) { c.K = 4 }), n: 10, d: 5, e: 4,
			check: func(t *testing.T, got *routerRun) {
				for i := range 10 {
					s := 0.0
					for j := range 4 {
						s += got.gates[i*4+j]
					}
					if math.Abs(s-1) > 1e-12 {
						t.Errorf("token %d: K = E gates sum to %v", i, s)
					}
				}
				if !slices.Equal(got.counts, []int64{10, 10, 10, 10}) {
					t.Errorf("K = E counts %v", got.counts)
				}
			}},
		{name: "all_to_one_expert", cfg: with(func(c *RouterConfig) { c.K = 1; c.Renormalize = false }), n: 9, d: 4, e: 5,
			x: func(x, w []float64) {
				for t := 0; t*4 < len(x); t++ {
					x[t*4] = 1
				}
				w[3*4] = 30
			},
			check: func(t *testing.T, got *routerRun) {
				if !slices.Equal(got.counts, []int64{0, 0, 0, int64(len(got.experts)), 0}) {
					t.Errorf("counts %v, want every token on expert 3", got.counts)
				}
			}},
		{name: "zero_weight_ties", cfg: base, n: 7, d: 3, e: 4,
			w: func(_, w []float64) { clear(w) },
			check: func(t *testing.T, got *routerRun) {
				for i := range 7 {
					if got.experts[2*i] != 0 || got.experts[2*i+1] != 1 || got.gates[2*i] != 0.5 {
						t.Errorf("token %d with equal logits: experts %v, gates %v; want [0 1], 0.5 each", i, got.experts[2*i:2*i+2], got.gates[2*i:2*i+2])
					}
				}
			}},
		{name: "sigmoid", cfg: with(func(c *RouterConfig) { c.Score = Sigmoid }), n: 12, d: 5, e: 6},
		{name: "sigmoid_raw_scaled", cfg: with(func(c *RouterConfig) { c.Score = Sigmoid; c.Renormalize = false; c.GateScale = 2.5 }), n: 12, d: 5, e: 6},
		{name: "groups", cfg: with(func(c *RouterConfig) { c.K = 3; c.NumGroups = 4; c.TopGroups = 2 }), n: 12, d: 5, e: 12},
		{name: "groups_top2_sigmoid", cfg: with(func(c *RouterConfig) {
			c.K = 4
			c.NumGroups = 4
			c.TopGroups = 2
			c.GroupScoreTop = 2
			c.Score = Sigmoid
		}), n: 12, d: 5, e: 12},
		{name: "expert_bias", cfg: with(func(c *RouterConfig) { c.ExpertBias = true }), n: 12, d: 5, e: 6,
			bias: []float64{0, 0, 0.8, 0, -0.8, 0},
			check: func(t *testing.T, got *routerRun) {
				for i := range 12 {
					if got.experts[2*i] != 2 {
						t.Errorf("token %d: slots %v; the bias should put expert 2 first", i, got.experts[2*i:2*i+2])
					}
				}
				if got.counts[4] != 0 {
					t.Errorf("expert 4 (bias −0.8) got %d tokens", got.counts[4])
				}
			}},
		{name: "groups_expert_bias", cfg: with(func(c *RouterConfig) {
			c.K = 3
			c.NumGroups = 3
			c.TopGroups = 2
			c.ExpertBias = true
			c.Score = Sigmoid
		}), n: 12, d: 5, e: 9, bias: []float64{0.3, -0.1, 0, 0, 0.05, 0, -0.2, 0, 0.1}},
		{name: "capacity_probs", cfg: with(func(c *RouterConfig) { c.CapacityFactor = 0.5 }), n: 16, d: 4, e: 4,
			check: func(t *testing.T, got *routerRun) {
				if got.dropped == 0 {
					t.Errorf("capacity factor 0.5 dropped nothing")
				}
			}},
		{name: "capacity_position_padded", cfg: with(func(c *RouterConfig) {
			c.CapacityFactor = 1
			c.DropPolicy = DropByPosition
			c.PadToCapacity = true
		}), n: 16, d: 4, e: 4,
			check: func(t *testing.T, got *routerRun) {
				if got.dropped == 0 || got.padded == 0 {
					t.Errorf("dropped %d, padded %d; want both > 0", got.dropped, got.padded)
				}
			}},
		{name: "capacity_generous", cfg: with(func(c *RouterConfig) { c.CapacityFactor = 4 }), n: 10, d: 4, e: 4,
			check: func(t *testing.T, got *routerRun) {
				if got.dropped != 0 {
					t.Errorf("capacity factor 4 dropped %d", got.dropped)
				}
			}},
		{name: "losses_off", cfg: with(func(c *RouterConfig) { c.AuxCoef = 0; c.ZCoef = 0 }), n: 8, d: 4, e: 4,
			check: func(t *testing.T, got *routerRun) {
				if !math.IsNaN(got.aux) || !math.IsNaN(got.z) {
					t.Errorf("aux %v, z %v with both coefficients 0; want nil", got.aux, got.z)
				}
			}},
		{name: "aux_only", cfg: with(func(c *RouterConfig) { c.ZCoef = 0 }), n: 8, d: 4, e: 4},
		{name: "five_tokens", cfg: base, n: 5, d: 4, e: 4},
	}
}

// inputs returns a case's x, w and c (the gates' upstream weights).
func (c routerCase) inputs(seed uint64) (x, w, up []float64) {
	rng := rand.New(rand.NewPCG(seed, 7))
	x = randomSlice(rng, c.n*c.d, 1)
	w = randomSlice(rng, c.e*c.d, 0.5)
	up = randomSlice(rng, c.n*c.cfg.K, 1)
	if c.x != nil {
		c.x(x, w)
	}
	if c.w != nil {
		c.w(x, w)
	}
	return x, w, up
}

// TestRouterCases routes every case on one rank and sharded over 2, 3 and
// 8 ranks (5 tokens on 8 ranks leave ranks empty) and on a 2-D mesh, and
// compares with the float64 reference; dropless cases must also give one
// rank's gradients.
func TestRouterCases(t *testing.T) {
	meshes := []struct {
		shape  []int
		names  []string
		places pl
		shards int // ranks that split the tokens
	}{
		{[]int{1}, []string{"ep"}, pl{pR}, 1},
		{[]int{2}, []string{"ep"}, pl{pS0}, 2},
		{[]int{3}, []string{"ep"}, pl{pS0}, 3},
		{[]int{8}, []string{"ep"}, pl{pS0}, 8},
		{[]int{2, 2}, []string{"dp", "tp"}, pl{pS0, pR}, 2},
	}
	for _, c := range routerCases() {
		t.Run(c.name, func(t *testing.T) {
			x, w, up := c.inputs(3)
			cfg, err := c.cfg.normalized(c.e)
			if err != nil {
				t.Fatal(err)
			}
			var one *routerRun
			for _, m := range meshes {
				if m.shards == 8 && c.n != 5 && c.name != "softmax" {
					continue // keep the run short: 8 ranks for two cases
				}
				got := runRouter[float64](t, runConfig{
					mesh: m.shape, names: m.names, places: m.places, cfg: c.cfg, bias: c.bias,
					n: c.n, d: c.d, x: x, w: w, c: up,
				})
				if t.Failed() {
					return
				}
				want := refRoute(cfg, c.bias, x, w, c.n, c.d, chunks(c.n, m.shards))
				where := fmt.Sprintf("%v%v", m.names, m.shape)
				if !slices.Equal(got.experts, want.experts) {
					t.Errorf("%s: experts %v, reference %v", where, got.experts, want.experts)
				}
				if d := maxAbsDiff(got.gates, want.gates); d > 1e-12 {
					t.Errorf("%s: gates differ from the reference by %.3g", where, d)
				}
				if !slices.Equal(got.counts, want.counts) || got.dropped != want.dropped || got.padded != want.padded {
					t.Errorf("%s: counts %v, dropped %d, padded %d; reference %v, %d, %d", where, got.counts, got.dropped, got.padded, want.counts, want.dropped, want.padded)
				}
				for _, l := range []struct {
					name      string
					got, want float64
				}{{"aux", got.aux, want.aux}, {"z-loss", got.z, want.z}} {
					if math.IsNaN(l.got) != math.IsNaN(l.want) || (!math.IsNaN(l.want) && math.Abs(l.got-l.want) > 1e-12*max(1, math.Abs(l.want))) {
						t.Errorf("%s: %s %v, reference %v", where, l.name, l.got, l.want)
					}
				}
				if cfg.CapacityFactor > 0 {
					for _, sh := range chunks(c.n, m.shards) {
						if sh[1] > 0 && got.capacity[sh[0]] != capacityOf(sh[1], cfg.K, c.e, cfg.CapacityFactor) {
							t.Errorf("%s: shard at %d reports capacity %d", where, sh[0], got.capacity[sh[0]])
						}
					}
				}
				if c.check != nil {
					c.check(t, got)
				}
				if one == nil {
					one = got
				} else if cfg.CapacityFactor == 0 {
					if d := maxAbsDiff(got.dW, one.dW); d > 1e-12 {
						t.Errorf("%s: ∂/∂Wr differs from one rank's by %.3g", where, d)
					}
					if d := maxAbsDiff(got.dx, one.dx); d > 1e-12 {
						t.Errorf("%s: ∂/∂x differs from one rank's by %.3g", where, d)
					}
				}
			}
		})
	}
}

// TestRouterGradCheck compares ∂(Σ g·c + α·aux + β·zloss)/∂Wr and ∂/∂x with
// float64 central differences, on one rank and with sharded tokens.
func TestRouterGradCheck(t *testing.T) {
	meshes := []struct {
		shape  []int
		names  []string
		places pl
	}{
		{[]int{1}, []string{"ep"}, pl{pR}},
		{[]int{2}, []string{"ep"}, pl{pS0}},
		{[]int{2, 2}, []string{"ep", "tp"}, pl{pS0, pR}},
	}
	for _, c := range routerCases() {
		if c.name == "zero_weight_ties" {
			continue // a tie: the choice of experts changes under any perturbation
		}
		c.n = min(c.n, 6)
		if c.name == "all_to_one_expert" {
			c.n = 5
		}
		t.Run(c.name, func(t *testing.T) {
			x, w, up := c.inputs(11)
			for i, m := range meshes {
				if i == 2 && c.name != "softmax" && c.name != "capacity_probs" {
					continue
				}
				placementtest.Run(t, m.shape, m.names, func(ctx context.Context, msh *mesh.Mesh) error {
					wd, err := fullTensor(msh, []int{c.e, c.d}, slices.Repeat(pl{pR}, len(m.shape)), w)
					if err != nil {
						return err
					}
					xd, err := fullTensor(msh, []int{c.n, c.d}, m.places, x)
					if err != nil {
						return err
					}
					f := func(tape *autograd.Tape, params []*autograd.Value) (*autograd.Value, error) {
						r, err := NewRouter(params[0], c.cfg)
						if err != nil {
							return nil, err
						}
						if c.bias != nil {
							if err := r.SetExpertBias(c.bias); err != nil {
								return nil, err
							}
						}
						rt, err := r.Route(ctx, params[1])
						if err != nil {
							return nil, err
						}
						return routerLoss(tape, rt, up)
					}
					if err := (autograd.Checker{Tol: 1e-6}).Check(ctx, f, wd, xd); err != nil {
						return fmt.Errorf("%v%v: %w", m.names, m.shape, err)
					}
					return nil
				})
			}
		})
	}
}

func fullTensor(m *mesh.Mesh, shape []int, places pl, full []float64) (*placement.DTensor, error) {
	spec, err := placement.NewSpec(m, shape, comm.Float64, places)
	if err != nil {
		return nil, err
	}
	return placement.FromFull(spec, full)
}

func TestUpdateExpertBias(t *testing.T) {
	placementtest.Run(t, []int{1}, []string{"ep"}, func(ctx context.Context, m *mesh.Mesh) error {
		tape := autograd.NewTape()
		w, err := newValue(tape, m, "Wr", []int{4, 3}, pl{pR}, make([]float64, 12))
		if err != nil {
			return err
		}
		off, err := NewRouter(w, RouterConfig{K: 1})
		if err != nil {
			return err
		}
		if err := off.UpdateExpertBias([]int64{1, 2, 3, 4}); !errors.Is(err, ErrInvalid) {
			return fmt.Errorf("update with the bias off: %v, want ErrInvalid", err)
		}
		if err := off.SetExpertBias([]float64{1, 2, 3, 4}); !errors.Is(err, ErrInvalid) {
			return fmt.Errorf("set with the bias off: %v, want ErrInvalid", err)
		}
		r, err := NewRouter(w, RouterConfig{K: 1, ExpertBias: true, BiasRate: 0.25})
		if err != nil {
			return err
		}
		// Over two micro-batches: counts 10, 2, 6, 6 (mean 6).
		if err := r.UpdateExpertBias([]int64{6, 1, 3, 2}, []int64{4, 1, 3, 4}); err != nil {
			return err
		}
		if got, want := r.ExpertBias(), []float64{-0.25, 0.25, 0, 0}; !slices.Equal(got, want) {
			return fmt.Errorf("bias after one update %v, want %v", got, want)
		}
		// Counts 0, 0, 9, 3 (mean 3): expert 3 is balanced and keeps its bias.
		if err := r.UpdateExpertBias([]int64{0, 0, 9, 3}); err != nil {
			return err
		}
		if got, want := r.ExpertBias(), []float64{0, 0.5, -0.25, 0}; !slices.Equal(got, want) {
			return fmt.Errorf("bias after two updates %v, want %v", got, want)
		}
		def, err := NewRouter(w, RouterConfig{K: 1, ExpertBias: true})
		if err != nil {
			return err
		}
		if err := def.UpdateExpertBias([]int64{5, 1, 1, 1}); err != nil {
			return err
		}
		if got := def.ExpertBias(); got[0] != -DefaultBiasRate || got[1] != DefaultBiasRate {
			return fmt.Errorf("bias with the default rate %v", got)
		}
		for _, bad := range [][][]int64{nil, {{1, 2, 3}}, {{1, 2, 3, -1}}, {{1, 2, 3, 4}, {1}}} {
			before := r.ExpertBias()
			if err := r.UpdateExpertBias(bad...); !errors.Is(err, ErrInvalid) {
				return fmt.Errorf("update with %v: %v, want ErrInvalid", bad, err)
			}
			if !slices.Equal(r.ExpertBias(), before) {
				return fmt.Errorf("a failed update changed the bias")
			}
		}
		if err := r.SetExpertBias([]float64{0, math.NaN(), 0, 0}); !errors.Is(err, ErrInvalid) {
			return fmt.Errorf("set NaN bias: %v, want ErrInvalid", err)
		}
		if err := r.SetExpertBias([]float64{1, 2}); !errors.Is(err, ErrInvalid) {
			return fmt.Errorf("set 2 values for 4 experts: %v, want ErrInvalid", err)
		}
		var nilRouter *Router
		if err := nilRouter.UpdateExpertBias([]int64{1}); !errors.Is(err, ErrInvalid) {
			return fmt.Errorf("nil router: %v", err)
		}
		if err := nilRouter.SetExpertBias([]float64{1}); !errors.Is(err, ErrInvalid) {
			return fmt.Errorf("nil router: %v", err)
		}
		if nilRouter.NumExperts() != 0 || nilRouter.ExpertBias() != nil || nilRouter.OwnParams() != nil || nilRouter.Config().K != 0 {
			return fmt.Errorf("nil router getters")
		}
		if r.NumExperts() != 4 || r.Config().BiasRate != 0.25 || r.Config().GateScale != 1 || len(r.OwnParams()) != 1 {
			return fmt.Errorf("router getters: %d experts, config %+v", r.NumExperts(), r.Config())
		}
		return nil
	})
}

// TestExpertBiasBalances runs the aux-loss-free loop: with a skewed router
// and the bias updated from each routing's counts, the load evens out.
func TestExpertBiasBalances(t *testing.T) {
	placementtest.Run(t, []int{2}, []string{"ep"}, func(ctx context.Context, m *mesh.Mesh) error {
		rng := rand.New(rand.NewPCG(5, 5))
		const n, d, e = 64, 4, 4
		x := randomSlice(rng, n*d, 1)
		w := randomSlice(rng, e*d, 0.2)
		for c := range d {
			w[c] += 0.5 // expert 0 preferred by tokens with positive features
		}
		tape := autograd.NewTape()
		wv, err := newValue(tape, m, "Wr", []int{e, d}, pl{pR}, w)
		if err != nil {
			return err
		}
		xv, err := newValue(tape, m, "x", []int{n, d}, pl{pS0}, x)
		if err != nil {
			return err
		}
		r, err := NewRouter(wv, RouterConfig{K: 1, Score: Sigmoid, ExpertBias: true, BiasRate: 0.01})
		if err != nil {
			return err
		}
		spread := func(c []int64) int64 { return slices.Max(c) - slices.Min(c) }
		var first, last []int64
		for range 60 {
			rt, err := r.Route(ctx, xv)
			if err != nil {
				return err
			}
			tape.Reset()
			if first == nil {
				first = rt.Counts
			}
			last = rt.Counts
			if err := r.UpdateExpertBias(rt.Counts); err != nil {
				return err
			}
		}
		if 2*spread(last) > spread(first) {
			return fmt.Errorf("counts %v at first, %v after 60 updates: not balancing", first, last)
		}
		return nil
	})
}

func TestRouterConfigErrors(t *testing.T) {
	for _, c := range []struct {
		name string
		cfg  RouterConfig
	}{
		{"K0", RouterConfig{}},
		{"K_over_E", RouterConfig{K: 9}},
		{"score", RouterConfig{K: 2, Score: 7}},
		{"negative_aux", RouterConfig{K: 2, AuxCoef: -1}},
		{"nan_z", RouterConfig{K: 2, ZCoef: math.NaN()}},
		{"inf_scale", RouterConfig{K: 2, GateScale: math.Inf(1)}},
		{"negative_rate", RouterConfig{K: 2, BiasRate: -1}},
		{"negative_capacity", RouterConfig{K: 2, CapacityFactor: -0.5}},
		{"groups_not_dividing", RouterConfig{K: 2, NumGroups: 3, TopGroups: 1}},
		{"top_groups_zero", RouterConfig{K: 2, NumGroups: 4}},
		{"top_groups_over", RouterConfig{K: 2, NumGroups: 4, TopGroups: 5}},
		{"groups_too_few_experts", RouterConfig{K: 5, NumGroups: 4, TopGroups: 2}},
		{"group_score_top_over", RouterConfig{K: 2, NumGroups: 4, TopGroups: 2, GroupScoreTop: 3}},
		{"group_score_top_alone", RouterConfig{K: 2, GroupScoreTop: 1}},
		{"drop_policy", RouterConfig{K: 2, CapacityFactor: 1, DropPolicy: 5}},
		{"pad_without_capacity", RouterConfig{K: 2, PadToCapacity: true}},
	} {
		t.Run(c.name, func(t *testing.T) {
			placementtest.Run(t, []int{1}, []string{"ep"}, func(ctx context.Context, m *mesh.Mesh) error {
				w, err := newValue(autograd.NewTape(), m, "Wr", []int{8, 3}, pl{pR}, make([]float64, 24))
				if err != nil {
					return err
				}
				if _, err := NewRouter(w, c.cfg); !errors.Is(err, ErrInvalid) {
					return fmt.Errorf("NewRouter(%+v): %v, want ErrInvalid", c.cfg, err)
				}
				return nil
			})
		})
	}
	if _, err := NewRouter(nil, RouterConfig{K: 1}); !errors.Is(err, ErrInvalid) {
		t.Errorf("NewRouter(nil): %v", err)
	}
}

// TestRouteErrors feeds Route bad inputs: every one is ErrInvalid on every
// rank, before any communication, and nothing panics.
func TestRouteErrors(t *testing.T) {
	f32 := make([]float32, 4*3)
	for _, c := range []struct {
		name   string
		xShape []int
		x      pl
		w      pl
		x32    bool
		order  bool
		mutate func(r *Router) *Router
		nilX   bool
	}{
		{name: "nil_router", xShape: []int{4, 3}, x: pl{pS0, pR}, w: pl{pR, pR}, mutate: func(*Router) *Router { return nil }},
		{name: "nil_weight", xShape: []int{4, 3}, x: pl{pS0, pR}, w: pl{pR, pR}, mutate: func(r *Router) *Router { r.Weight = nil; return r }},
		{name: "zero_router", xShape: []int{4, 3}, x: pl{pS0, pR}, w: pl{pR, pR}, mutate: func(r *Router) *Router { return &Router{Weight: r.Weight} }},
		{name: "nil_x", xShape: []int{4, 3}, x: pl{pS0, pR}, w: pl{pR, pR}, nilX: true},
		{name: "x_3d", xShape: []int{2, 2, 3}, x: pl{pS0, pR}, w: pl{pR, pR}},
		{name: "x_width", xShape: []int{4, 2}, x: pl{pS0, pR}, w: pl{pR, pR}},
		{name: "x_partial", xShape: []int{4, 3}, x: pl{pS0, placement.Partial(comm.Sum)}, w: pl{pR, pR}},
		{name: "x_shard1", xShape: []int{4, 3}, x: pl{pS0, placement.Shard(1)}, w: pl{pR, pR}},
		{name: "w_sharded", xShape: []int{4, 3}, x: pl{pS0, pR}, w: pl{pR, pS0}},
		{name: "dtype", xShape: []int{4, 3}, x: pl{pS0, pR}, w: pl{pR, pR}, x32: true},
		{name: "shard_order", xShape: []int{4, 3}, x: pl{pS0, pS0}, w: pl{pR, pR}, order: true},
	} {
		t.Run(c.name, func(t *testing.T) {
			placementtest.Run(t, []int{2, 2}, []string{"dp", "tp"}, func(ctx context.Context, m *mesh.Mesh) error {
				tape := autograd.NewTape()
				w, err := newValue(tape, m, "Wr", []int{4, 3}, c.w, make([]float64, 12))
				if err != nil {
					return err
				}
				r, err := NewRouter(w, RouterConfig{K: 2, AuxCoef: 0.1})
				if err != nil {
					return err
				}
				var x *autograd.Value
				switch {
				case c.nilX:
				case c.x32:
					x, err = newValue(tape, m, "x", c.xShape, c.x, f32)
				case c.order:
					spec, e1 := placement.NewSpec(m, c.xShape, comm.Float64, c.x, placement.WithOrder(0, "tp", "dp"))
					if e1 != nil {
						return e1
					}
					dt, e2 := placement.FromFull(spec, make([]float64, 12))
					if e2 != nil {
						return e2
					}
					x, err = tape.Param("x", dt)
				default:
					size := 1
					for _, v := range c.xShape {
						size *= v
					}
					x, err = newValue(tape, m, "x", c.xShape, c.x, make([]float64, size))
				}
				if err != nil {
					return err
				}
				if c.mutate != nil {
					r = c.mutate(r)
				}
				world := m.World().Recorder().Snapshot().Total
				rt, err := r.Route(ctx, x)
				if !errors.Is(err, ErrInvalid) {
					return fmt.Errorf("Route: %v (routing %v), want ErrInvalid", err, rt)
				}
				if m.World().Recorder().Snapshot().Total != world {
					return fmt.Errorf("Route communicated before rejecting its input")
				}
				return nil
			})
		})
	}
}

// TestRouteNonFiniteLogits: a NaN token on one rank fails Route on every
// rank, after the one all-reduce, instead of routing garbage.
func TestRouteNonFiniteLogits(t *testing.T) {
	placementtest.Run(t, []int{2}, []string{"ep"}, func(ctx context.Context, m *mesh.Mesh) error {
		x := make([]float64, 4*3)
		x[10] = math.NaN() // token 3: rank 1
		tape := autograd.NewTape()
		w, err := newValue(tape, m, "Wr", []int{4, 3}, pl{pR}, make([]float64, 12))
		if err != nil {
			return err
		}
		xv, err := newValue(tape, m, "x", []int{4, 3}, pl{pS0}, x)
		if err != nil {
			return err
		}
		r, err := NewRouter(w, RouterConfig{K: 2})
		if err != nil {
			return err
		}
		_, err = r.Route(ctx, xv)
		if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "NaN") {
			return fmt.Errorf("Route with a NaN token: %v, want ErrInvalid naming NaN", err)
		}
		return nil
	})
}

// TestRouteNoGrad routes under NoGrad (inference) with float32 inputs.
func TestRouteNoGrad(t *testing.T) {
	placementtest.Run(t, []int{2}, []string{"ep"}, func(ctx context.Context, m *mesh.Mesh) error {
		rng := rand.New(rand.NewPCG(9, 9))
		conv := func(v []float64) []float32 {
			r := make([]float32, len(v))
			for i, x := range v {
				r[i] = float32(x)
			}
			return r
		}
		tape := autograd.NewTape()
		w, err := newValue(tape, m, "Wr", []int{4, 3}, pl{pR}, conv(randomSlice(rng, 12, 1)))
		if err != nil {
			return err
		}
		x, err := newValue(tape, m, "x", []int{6, 3}, pl{pS0}, conv(randomSlice(rng, 18, 1)))
		if err != nil {
			return err
		}
		r, err := NewRouter(w, RouterConfig{K: 2, Renormalize: true, AuxCoef: 0.1, ZCoef: 0.1})
		if err != nil {
			return err
		}
		var rt *Routing
		if err := tape.NoGrad(func() error {
			rt, err = r.Route(ctx, x)
			return err
		}); err != nil {
			return err
		}
		if tape.Len() != 0 || rt.Gates.RequiresGrad() || rt.Aux.RequiresGrad() {
			return fmt.Errorf("NoGrad routing recorded %d ops", tape.Len())
		}
		if rt.Gates.Spec().DType() != comm.Float32 {
			return fmt.Errorf("gates are %v for float32 tokens", rt.Gates.Spec().DType())
		}
		return nil
	})
}

func TestEnumStrings(t *testing.T) {
	for _, c := range []struct{ got, want string }{
		{Softmax.String(), "softmax"}, {Sigmoid.String(), "sigmoid"}, {ScoreFunc(9).String(), "ScoreFunc(9)"},
		{DropByProb.String(), "probs"}, {DropByPosition.String(), "position"}, {DropPolicy(-1).String(), "DropPolicy(-1)"},
	} {
		if c.got != c.want {
			t.Errorf("String() = %q, want %q", c.got, c.want)
		}
	}
}
