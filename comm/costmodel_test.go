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
		{"eight sources 50x slow", func(m *comm.CostModel) { m.GammaStream8 *= 50 }, []string{"gamma_stream8_s_per_byte"},
			func(m *comm.CostModel) bool { return m.GammaStream8 == b.GammaStream8 }},
		{"three sources cheaper than two", func(m *comm.CostModel) { m.GammaStream3 = m.GammaStream / 2 }, []string{"gamma_stream3_s_per_byte"},
			func(m *comm.CostModel) bool { return m.GammaStream3 == m.GammaStream }},
		{"eight sources cheaper than three", func(m *comm.CostModel) { m.GammaStream8 = m.GammaStream3 / 1.2 }, []string{"gamma_stream8_s_per_byte"},
			func(m *comm.CostModel) bool { return m.GammaStream8 == m.GammaStream3 }},
		{"fan-in not measured", func(m *comm.CostModel) { m.GammaStream3, m.GammaStream8 = 0, 0 }, nil,
			func(m *comm.CostModel) bool { return m.GammaStream3 == 0 && m.GammaStream8 == 0 }},
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

// TestFanIn: one or two sources cost GammaStream per byte; more lie on the
// line through the three- and eight-source measurements, never below
// GammaStream; an unmeasured or half-measured fan-in charges nothing extra
// (half-measured is also invalid).
func TestFanIn(t *testing.T) {
	m := comm.BuiltinCostModel()
	m.GammaStream, m.GammaStream3, m.GammaStream8 = 2e-11, 3e-11, 4e-11
	for _, tc := range []struct {
		sources int
		want    float64
	}{{0, 1}, {1, 1}, {2, 1}, {3, 1.5}, {4, 1.6}, {8, 2}, {13, 2.5}} {
		if got := m.FanIn(tc.sources); math.Abs(got-tc.want) > 1e-12 {
			t.Errorf("FanIn(%d) = %v, want %v", tc.sources, got, tc.want)
		}
	}
	flat := *m
	flat.GammaStream3, flat.GammaStream8 = 3e-11, 2.5e-11 // falling: clamped, never below GammaStream
	if got := flat.FanIn(30); got != 1 {
		t.Errorf("falling fan-in: FanIn(30) = %v, want 1", got)
	}
	unmeasured := *m
	unmeasured.GammaStream3, unmeasured.GammaStream8 = 0, 0
	if got := unmeasured.FanIn(8); got != 1 || !unmeasured.Valid() {
		t.Errorf("unmeasured fan-in: FanIn(8) = %v, valid %v; want 1, true", got, unmeasured.Valid())
	}
	half := *m
	half.GammaStream8 = 0
	if got := half.FanIn(8); got != 1 || half.Valid() {
		t.Errorf("half-measured fan-in: FanIn(8) = %v, valid %v; want 1, false", got, half.Valid())
	}
}
