package moe

import (
	"errors"
	"math"
	"strings"
	"testing"

	"github.com/b7ea7098/loom/kernels"
)

// TestCheckViewsBuffers: a view whose buffers do not hold what its plan
// says fails the fused pass's check, identically for every rank, before
// any kernel runs: in the combine's backward one rank writes into another's
// gate gradient, so a kernel failing on one rank only would leave a peer's
// result silently short.
func TestCheckViewsBuffers(t *testing.T) {
	// Two ranks, one expert each; rank q routes its 2 tokens (K = 2) to
	// both experts, so every rank sends one row per token to each rank.
	const w = 3
	plans := make([]kernels.Routing, 2)
	for q := range plans {
		if err := kernels.PlanRouting(&plans[q], []int32{0, 1, 1, 0}, 2, 2, 0); err != nil {
			t.Fatal(err)
		}
	}
	chunks, at := []int{2, 2}, []int{0, 2}
	views := func() []*fusedView[float32] {
		v := make([]*fusedView[float32], 2)
		for q := range v {
			v[q] = &fusedView[float32]{plan: &plans[q], chunks: chunks, at: at, width: w,
				tokens: make([]float32, 2*w), gates: make([]float32, 4), dgates: make([]float32, 4), routed: make([]float32, 4*w)}
		}
		return v
	}
	h := &Handle{ranks: 2, local: 1, e: 2, axis: "ep"}
	if err := checkViews(h, views()); err != nil {
		t.Fatalf("consistent views: %v", err)
	}
	for _, c := range []struct {
		name string
		mod  func(v []*fusedView[float32])
		want string
	}{
		{"short-tokens", func(v []*fusedView[float32]) { v[1].tokens = v[1].tokens[:5] }, "rank 1 shares 5 values of token rows, want 6"},
		{"long-gates", func(v []*fusedView[float32]) { v[0].gates = make([]float32, 5) }, "rank 0 shares 5 values of gates, want 4"},
		{"short-dgates", func(v []*fusedView[float32]) { v[1].dgates = v[1].dgates[:3] }, "rank 1 shares 3 values of gate gradient, want 4"},
		{"empty-dgates", func(v []*fusedView[float32]) { v[0].dgates = []float32{} }, "rank 0 shares 0 values of gate gradient, want 4"},
		{"short-routed", func(v []*fusedView[float32]) { v[1].routed = v[1].routed[:9] }, "rank 1 shares 9 values of routed rows, want 12"},
	} {
		t.Run(c.name, func(t *testing.T) {
			v := views()
			c.mod(v)
			err := checkViews(h, v)
			if !errors.Is(err, ErrMismatch) || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("err = %v, want ErrMismatch mentioning %q", err, c.want)
			}
		})
	}
}

// chunk refuses rows outside its buffer, including rows whose end
// (at+n)·w wraps: 2^62 rows at 2^62 of width 4 end at 2^65, which used to
// wrap to 0 and pass as an empty chunk.
func TestChunkBounds(t *testing.T) {
	buf := make([]float32, 12)
	for _, tc := range []struct {
		at, n, w int
		want     int // values, -1: error
	}{
		{0, 3, 4, 12},
		{1, 2, 4, 8},
		{3, 0, 4, 0},
		{2, 2, 4, -1},
		{-1, 1, 4, -1},
		{1, -1, 4, -1},
		{0, 1, -4, -1},
		{1 << 62, 1 << 62, 4, -1},
		{0, 1 << 62, 4, -1},
		{math.MaxInt, 1, 1, -1},
	} {
		got, err := chunk(buf, tc.at, tc.n, tc.w)
		if (err != nil) != (tc.want < 0) || (err == nil && len(got) != tc.want) {
			t.Errorf("chunk(buf[12], %d, %d, %d) = %d values, %v; want %d (-1: an error)", tc.at, tc.n, tc.w, len(got), err, tc.want)
		}
	}
}
