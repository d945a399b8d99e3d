package moe

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"testing"

	"github.com/b7ea7098/loom"
	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// TestRouterNumericOptions: every numeric RouterConfig option, given NaN,
// ±Inf, 0 and a negative value, is rejected by NewRouter with ErrInvalid
// naming it, except 0, which each documents (1, off, the default rate,
// dropless); K, a count, rejects 0 and negatives.
func TestRouterNumericOptions(t *testing.T) {
	nan, inf := math.NaN(), math.Inf(1)
	set := map[string]func(c *RouterConfig, v float64){
		"GateScale":      func(c *RouterConfig, v float64) { c.GateScale = v },
		"AuxCoef":        func(c *RouterConfig, v float64) { c.AuxCoef = v },
		"ZCoef":          func(c *RouterConfig, v float64) { c.ZCoef = v },
		"BiasRate":       func(c *RouterConfig, v float64) { c.BiasRate = v },
		"CapacityFactor": func(c *RouterConfig, v float64) { c.CapacityFactor = v },
	}
	placementtest.Run(t, []int{1}, []string{"ep"}, func(ctx context.Context, m *mesh.Mesh) error {
		w, err := newValue(autograd.NewTape(), m, "Wr", []int{8, 3}, pl{pR}, make([]float64, 24))
		if err != nil {
			return err
		}
		for name, f := range set {
			for _, v := range []float64{nan, inf, -inf, 0, -1} {
				cfg := RouterConfig{K: 2}
				f(&cfg, v)
				_, err := NewRouter(w, cfg)
				if v == 0 {
					if err != nil {
						t.Errorf("%s = 0: %v, want it accepted", name, err)
					}
					continue
				}
				if want := fmt.Sprintf("%s %v: must", name, v); !errors.Is(err, ErrInvalid) || !errors.Is(err, loom.ErrInvalid) || !strings.Contains(err.Error(), want) {
					t.Errorf("%s = %v: %v, want ErrInvalid containing %q", name, v, err, want)
				}
			}
		}
		for _, k := range []int{0, -1} {
			if _, err := NewRouter(w, RouterConfig{K: k}); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), fmt.Sprintf("K %d: must be at least 1", k)) {
				t.Errorf("K = %d: %v, want ErrInvalid naming K", k, err)
			}
		}
		return nil
	})
}
