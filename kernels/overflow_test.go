package kernels_test

import (
	"errors"
	"math"
	"strings"
	"testing"

	"github.com/b7ea7098/loom/kernels"
)

// Sizes formed from dims are checked products and sums: a size that wraps
// is ErrInvalid naming it, where it used to match an empty slice and pass
// (or panic in the loop that followed).
func TestKernelSizesDoNotWrap(t *testing.T) {
	var r kernels.Routing
	if err := kernels.PlanRouting(&r, []int32{0, 1, 1, 0}, 1, 2, 0); err != nil {
		t.Fatal(err)
	}
	empty := []float32{}
	for _, tc := range []struct {
		name string
		run  func() error
		want string
	}{
		// t·t = 2^64 wrapped to 0: no blocks, nil.
		{"CausalSoftmax t=2^32", func() error { return kernels.CausalSoftmax(1, empty, empty, 1<<32, 1) }, "blocks of 4294967296×4294967296"},
		{"CausalSoftmaxBackward t=2^32", func() error { return kernels.CausalSoftmaxBackward(empty, empty, empty, 1<<32, 1) }, "overflows int"},
		// batch·t·t = 2^64 wrapped to 0: every length matched.
		{"CausalAttentionForward", func() error {
			return kernels.CausalAttentionForward(1, empty, empty, empty, empty, empty, 1<<32, 1<<16, 1<<16, 1<<16, 1)
		}, "batch 4294967296 × t 65536 × 65536 overflows int"},
		{"CausalAttentionBackward", func() error {
			return kernels.CausalAttentionBackward(1, nil, nil, nil, empty, empty, empty, empty, empty, 1<<32, 1<<16, 1<<16, 1<<16, 1)
		}, "overflows int"},
		// 4 tokens × 2^62 wrapped to 0.
		{"Permute d=2^62", func() error { return kernels.Permute(empty, empty, 1<<62, &r) }, "overflows int"},
		// ranks·local = 2^64 wrapped to 0 = len(counts).
		{"GroupByExpert ranks·local", func() error { return kernels.GroupByExpert(empty, empty, 1, nil, 1<<32, 1<<32) }, "0 counts for 4294967296 ranks"},
		// Σcounts = 2^64 wrapped to 0 = the empty buffers' rows.
		{"GroupByExpert Σcounts", func() error {
			return kernels.GroupByExpert(empty, empty, 1, []int{math.MaxInt, math.MaxInt, 1, 1}, 2, 2)
		}, "sum past the largest int"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.run()
			if !errors.Is(err, kernels.ErrInvalid) || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("%v; want ErrInvalid containing %q", err, tc.want)
			}
		})
	}
}
