package kernels_test

import (
	"errors"
	"slices"
	"testing"

	"github.com/b7ea7098/loom"
	"github.com/b7ea7098/loom/kernels"
)

// TestCopyBox copies boxes between small arrays and compares with an
// element-by-element reference; elements outside the box keep their
// values.
func TestCopyBox(t *testing.T) {
	cases := []struct {
		name                             string
		dshape, doff, sshape, soff, size []int
	}{
		{"scalar", nil, nil, nil, nil, nil},
		{"1d", []int{7}, []int{2}, []int{5}, []int{1}, []int{3}},
		{"2d", []int{4, 5}, []int{1, 2}, []int{3, 6}, []int{0, 3}, []int{2, 3}},
		{"3d", []int{3, 4, 5}, []int{1, 0, 2}, []int{2, 5, 3}, []int{0, 1, 0}, []int{2, 4, 3}},
		{"empty box", []int{3, 4}, []int{1, 0}, []int{2, 4}, []int{0, 0}, []int{2, 0}},
		{"empty arrays", []int{0, 3}, []int{0, 0}, []int{0, 3}, []int{0, 0}, []int{0, 3}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			n := func(s []int) int {
				p := 1
				for _, v := range s {
					p *= v
				}
				return p
			}
			src := make([]float64, n(tc.sshape))
			for i := range src {
				src[i] = float64(i + 1)
			}
			dst := make([]float64, n(tc.dshape))
			for i := range dst {
				dst[i] = -float64(i + 1)
			}
			if err := kernels.CheckBox(len(dst), tc.dshape, tc.doff, len(src), tc.sshape, tc.soff, tc.size); err != nil {
				t.Fatal(err)
			}
			want := slices.Clone(dst)
			idx := make([]int, len(tc.size))
			for k := range n(tc.size) {
				r := k
				for d := len(tc.size) - 1; d >= 0; d-- {
					idx[d] = r % tc.size[d]
					r /= tc.size[d]
				}
				di, si := 0, 0
				for d := range tc.size {
					di = di*tc.dshape[d] + tc.doff[d] + idx[d]
					si = si*tc.sshape[d] + tc.soff[d] + idx[d]
				}
				want[di] = src[si]
			}
			kernels.CopyBox(dst, tc.dshape, tc.doff, src, tc.sshape, tc.soff, tc.size)
			if !slices.Equal(dst, want) {
				t.Fatalf("got %v, want %v", dst, want)
			}
		})
	}
}

// TestCheckBox rejects boxes outside either array, short arrays, negative
// sizes and dims that differ, with ErrInvalid.
func TestCheckBox(t *testing.T) {
	cases := []struct {
		name               string
		dlen               int
		dshape, doff       []int
		slen               int
		sshape, soff, size []int
	}{
		{"dims differ", 6, []int{2, 3}, []int{0, 0}, 6, []int{6}, []int{0}, []int{1, 1}},
		{"past the destination", 6, []int{2, 3}, []int{1, 1}, 6, []int{2, 3}, []int{0, 0}, []int{1, 3}},
		{"past the source", 6, []int{2, 3}, []int{0, 0}, 6, []int{2, 3}, []int{1, 0}, []int{2, 1}},
		{"negative offset", 6, []int{6}, []int{-1}, 6, []int{6}, []int{0}, []int{1}},
		{"negative size", 6, []int{6}, []int{0}, 6, []int{6}, []int{0}, []int{-1}},
		{"short destination", 5, []int{2, 3}, []int{0, 0}, 6, []int{2, 3}, []int{0, 0}, []int{1, 1}},
		{"short source", 6, []int{2, 3}, []int{0, 0}, 0, []int{2, 3}, []int{0, 0}, []int{1, 1}},
		{"scalar from nothing", 1, nil, nil, 0, nil, nil, nil},
	}
	for _, tc := range cases {
		err := kernels.CheckBox(tc.dlen, tc.dshape, tc.doff, tc.slen, tc.sshape, tc.soff, tc.size)
		if !errors.Is(err, kernels.ErrInvalid) || !errors.Is(err, loom.ErrInvalid) {
			t.Errorf("%s: %v, want ErrInvalid", tc.name, err)
		}
	}
	if err := kernels.CheckBox(7, []int{7}, []int{6}, 7, []int{7}, []int{0}, []int{1}); err != nil {
		t.Errorf("a box at the end: %v", err)
	}
}
