package kernels

import (
	"fmt"

	"github.com/b7ea7098/loom/internal/checked"
)

// CopyBox copies the box of the given size at soff in src, a row-major
// array of shape sshape, to doff in dst, a row-major array of shape
// dshape: placement's local copies (a shard cut out of a block, a block
// placed into a gathered tensor). All five index slices have one length,
// the number of dims; with none the box is one element. A box with a zero
// dim copies nothing. It does not check its arguments, so that the host
// path's redistributions pay nothing for it: the box must lie inside both
// arrays (CheckBox says whether it does), or it panics like an index out of
// range. It copies rows of size's last dim at a time, with no allocation
// beyond one index per dim.
func CopyBox[T any](dst []T, dshape, doff []int, src []T, sshape, soff, size []int) {
	nd := len(size)
	if nd == 0 {
		dst[0] = src[0]
		return
	}
	for _, v := range size {
		if v == 0 {
			return
		}
	}
	ds, ss := rowStrides(dshape), rowStrides(sshape)
	row := size[nd-1]
	idx := make([]int, nd-1)
	for {
		di, si := doff[nd-1], soff[nd-1]
		for k := 0; k < nd-1; k++ {
			di += (doff[k] + idx[k]) * ds[k]
			si += (soff[k] + idx[k]) * ss[k]
		}
		copy(dst[di:di+row], src[si:si+row])
		k := nd - 2
		for ; k >= 0; k-- {
			idx[k]++
			if idx[k] < size[k] {
				break
			}
			idx[k] = 0
		}
		if k < 0 {
			return
		}
	}
}

// rowStrides returns the row-major strides of shape, in elements.
func rowStrides(shape []int) []int {
	s := make([]int, len(shape))
	n := 1
	for i := len(shape) - 1; i >= 0; i-- {
		s[i] = n
		n *= shape[i]
	}
	return s
}

// CheckBox returns nil when CopyBox may copy the box of the given size at
// soff in an array of shape sshape, held in slen elements, to doff in an
// array of shape dshape held in dlen elements: the five index slices have
// one length, no size or offset is negative, the box lies inside both
// shapes, and each array holds at least prod(shape) elements (it may hold
// more). Otherwise the error wraps ErrInvalid and says what is wrong.
// Devices call it before queueing a copy, whose out-of-range indices
// would otherwise corrupt memory instead of panicking.
func CheckBox(dlen int, dshape, doff []int, slen int, sshape, soff, size []int) error {
	nd := len(size)
	if len(dshape) != nd || len(doff) != nd || len(sshape) != nd || len(soff) != nd {
		return fmt.Errorf("kernels: CopyBox: %w: dims differ: destination shape %v at %v, source shape %v at %v, size %v",
			ErrInvalid, dshape, doff, sshape, soff, size)
	}
	for _, a := range []struct {
		what       string
		n          int
		shape, off []int
	}{{"destination", dlen, dshape, doff}, {"source", slen, sshape, soff}} {
		for d := range nd {
			if a.shape[d] < 0 || a.off[d] < 0 || size[d] < 0 {
				return fmt.Errorf("kernels: CopyBox: %w: negative %s shape, offset or size (shape %v, offset %v, size %v)", ErrInvalid, a.what, a.shape, a.off, size)
			}
			if end, ok := checked.Add(a.off[d], size[d]); !ok || end > a.shape[d] {
				return fmt.Errorf("kernels: CopyBox: %w: box of size %v at %v passes the %s shape %v in dim %d", ErrInvalid, size, a.off, a.what, a.shape, d)
			}
		}
		total, ok := checked.Product(a.shape) // 1 for a scalar
		if !ok {
			return fmt.Errorf("kernels: CopyBox: %w: %s shape %v overflows int", ErrInvalid, a.what, a.shape)
		}
		if a.n < total {
			return fmt.Errorf("kernels: CopyBox: %w: %s of %d elements, shape %v holds %d", ErrInvalid, a.what, a.n, a.shape, total)
		}
	}
	return nil
}
