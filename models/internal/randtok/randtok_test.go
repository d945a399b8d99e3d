package randtok

import (
	"slices"
	"testing"
)

// TestSampler: tokens lie in [0, V), targets are the inputs shifted by
// one, a step's batch depends on the seed and the step only, and steps
// and seeds differ.
func TestSampler(t *testing.T) {
	for _, tc := range []struct{ b, t, v int }{{1, 1, 1}, {2, 5, 3}, {4, 16, 128}} {
		s := New(7, tc.b, tc.t, tc.v)
		b1, b2 := s.Next(), s.Next()
		if b1.Step != 1 || b2.Step != 2 || b1.B != tc.b || b1.T != tc.t || len(b1.X) != tc.b*tc.t || len(b1.Y) != tc.b*tc.t {
			t.Fatalf("%+v: batch %+v", tc, b1)
		}
		for i, x := range append(slices.Clone(b1.X), b1.Y...) {
			if x < 0 || x >= int64(tc.v) {
				t.Fatalf("%+v: token %d = %d outside [0, %d)", tc, i, x, tc.v)
			}
		}
		for r := range tc.b {
			x, y := b1.Row(r)
			if !slices.Equal(x[1:], y[:tc.t-1]) {
				t.Errorf("%+v row %d: targets %v are not the inputs %v shifted by one", tc, r, y, x)
			}
		}
		// Replayed from a fresh sampler: the same batches.
		again := New(7, tc.b, tc.t, tc.v)
		if a := again.Next(); !slices.Equal(a.X, b1.X) || !slices.Equal(a.Y, b1.Y) {
			t.Errorf("%+v: step 1 differs on a second sampler", tc)
		}
		if tc.v > 1 && tc.b*tc.t >= 16 {
			if slices.Equal(b1.X, b2.X) {
				t.Errorf("%+v: steps 1 and 2 drew the same tokens", tc)
			}
			if o := New(8, tc.b, tc.t, tc.v).Next(); slices.Equal(o.X, b1.X) {
				t.Errorf("%+v: seeds 7 and 8 drew the same tokens", tc)
			}
		}
	}
}
