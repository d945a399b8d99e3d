package comm_test

import (
	"math"
	"slices"
	"testing"

	"github.com/b7ea7098/loom/comm"
)

// TestPlausible: a parameter more than ten times off the built-in one, or
// contradicting another, is replaced by the built-in value and named; a
// plausible measurement is kept as it is.
func TestPlausible(t *testing.T) {
	b := comm.BuiltinCostModel()
	tests := []struct {
		name     string
		skew     func(m *comm.CostModel)
		replaced []string
		check    func(m *comm.CostModel) bool
	}{
		{"plausible", func(m *comm.CostModel) { m.Alpha *= 5; m.Beta /= 2 }, nil,
			func(m *comm.CostModel) bool { return m.Alpha == 5*b.Alpha && m.Beta == b.Beta/2 }},
		{"handoff 20x slow", func(m *comm.CostModel) { m.Alpha *= 20 }, []string{"alpha_s"},
			func(m *comm.CostModel) bool { return m.Alpha == b.Alpha }},
		{"switch 20x fast", func(m *comm.CostModel) { m.Switch /= 20 }, []string{"switch_s"},
			func(m *comm.CostModel) bool { return m.Switch == b.Switch }},
		{"copies 50x slow", func(m *comm.CostModel) { m.Beta *= 50 }, []string{"beta_s_per_byte"},
			func(m *comm.CostModel) bool { return m.Beta == b.Beta }},
		{"reductions 50x slow", func(m *comm.CostModel) { m.Gamma *= 50; m.GammaStream *= 50 }, []string{"gamma_s_per_byte", "gamma_stream_s_per_byte"},
			func(m *comm.CostModel) bool { return m.Gamma == b.Gamma && m.GammaStream == b.GammaStream }},
		{"cache slower than memory", func(m *comm.CostModel) { m.BetaCache = 2 * m.Beta }, []string{"beta_cache_s_per_byte"},
			func(m *comm.CostModel) bool { return m.BetaCache <= m.Beta }},
		{"cached reduction slower than from memory", func(m *comm.CostModel) { m.GammaCache = 1.2 * m.Gamma }, []string{"gamma_cache_s_per_byte"},
			func(m *comm.CostModel) bool { return m.GammaCache <= m.Gamma }},
		{"all cores slower than one", func(m *comm.CostModel) { m.Bandwidth = 0.5 / m.Beta }, []string{"bandwidth_Bps"},
			func(m *comm.CostModel) bool { return m.Bandwidth*m.Beta >= 1 }},
		{"bandwidth 100x high", func(m *comm.CostModel) { m.Bandwidth *= 100 }, []string{"bandwidth_Bps"},
			func(m *comm.CostModel) bool { return m.Bandwidth == b.Bandwidth }},
		{"invalidation 50x slow", func(m *comm.CostModel) { m.Invalidate *= 50 }, []string{"invalidate_s_per_byte"},
			func(m *comm.CostModel) bool { return m.Invalidate == b.Invalidate }},
		{"invalidation not measured", func(m *comm.CostModel) { m.Invalidate = 0 }, nil,
			func(m *comm.CostModel) bool { return m.Invalidate == 0 }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			m := comm.BuiltinCostModel()
			m.Machine, m.Spread, m.Cores = "box", 1.2, 7
			tt.skew(m)
			before := *m
			got, replaced := m.Plausible()
			if *m != before {
				t.Error("Plausible modified its receiver")
			}
			if !slices.Equal(replaced, tt.replaced) {
				t.Errorf("replaced %v, want %v", replaced, tt.replaced)
			}
			if !tt.check(got) {
				t.Errorf("result %+v", *got)
			}
			if !got.Valid() || got.Machine != "box" || got.Spread != 1.2 || got.Cores != 7 {
				t.Errorf("result %+v lost its identity or validity", *got)
			}
		})
	}
}

// TestInvalidateValid: Invalidate may be 0 (not measured, as in models
// cached before it existed) but not negative, infinite or NaN.
func TestInvalidateValid(t *testing.T) {
	for _, tc := range []struct {
		v     float64
		valid bool
	}{{0, true}, {1e-10, true}, {-1e-10, false}, {math.Inf(1), false}, {math.NaN(), false}} {
		m := comm.BuiltinCostModel()
		m.Invalidate = tc.v
		if got := m.Valid(); got != tc.valid {
			t.Errorf("Invalidate %v: Valid = %v, want %v", tc.v, got, tc.valid)
		}
	}
}
