package moe

import (
	"strings"
	"testing"
	"time"
)

// TestTimingsString: the fused path reports its passes as one figure and
// no zero permute, payload or combine times; the all-to-all path reports
// its parts; wait appears only when measured.
func TestTimingsString(t *testing.T) {
	ms := time.Millisecond
	cases := []struct {
		name     string
		t        Timings
		want     []string
		dontWant []string
	}{
		{"fused", Timings{Fused: 3 * ms, Experts: 2 * ms},
			[]string{"fused 3ms", "experts 2ms", "counts 0s"}, []string{"permute", "payload", "combine", "wait"}},
		{"all-to-all", Timings{Permute: ms, PayloadExchange: 4 * ms, Combine: ms, Experts: 2 * ms},
			[]string{"permute 1ms", "payload 4ms", "combine 1ms", "experts 2ms"}, []string{"fused", "wait"}},
		{"measured wait", Timings{Wait: 5 * ms, PayloadExchange: ms},
			[]string{"wait 5ms", "payload 1ms"}, []string{"fused"}},
	}
	for _, c := range cases {
		got := c.t.String()
		for _, w := range c.want {
			if !strings.Contains(got, w) {
				t.Errorf("%s: %q lacks %q", c.name, got, w)
			}
		}
		for _, w := range c.dontWant {
			if strings.Contains(got, w) {
				t.Errorf("%s: %q has %q", c.name, got, w)
			}
		}
	}
}

// TestTimingsAdd: Add sums every field, Fused included, and Total counts
// it.
func TestTimingsAdd(t *testing.T) {
	a := Timings{Wait: 1, Permute: 2, CountExchange: 3, PayloadExchange: 4, Fused: 5, Experts: 6, Combine: 7}
	s := a.Add(a)
	if s != (Timings{Wait: 2, Permute: 4, CountExchange: 6, PayloadExchange: 8, Fused: 10, Experts: 12, Combine: 14}) {
		t.Errorf("Add = %+v", s)
	}
	if a.Total() != 28 {
		t.Errorf("Total = %v, want 28ns", a.Total())
	}
}
