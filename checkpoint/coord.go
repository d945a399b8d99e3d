package checkpoint

import (
	"context"
	"errors"
	"fmt"
	"slices"

	"github.com/b7ea7098/loom/comm"
)

// exchange all-gathers one message per rank: payload when err is nil,
// else err's kind and text. When any rank failed, every rank returns an
// error (its own, or one naming the first failed rank with that rank's
// kind), so the ranks leave a phase together and none goes on alone.
// Otherwise it returns every rank's payload. With one rank it
// communicates nothing.
func exchange(ctx context.Context, c comm.Communicator, op string, payload []byte, err error) ([][]byte, error) {
	msg := append([]byte{0}, payload...)
	if err != nil {
		msg = append([]byte{kindCode(err)}, err.Error()...)
	}
	var all [][]byte
	if c.Size() == 1 {
		all = [][]byte{msg}
	} else {
		var gerr error
		if all, gerr = gatherBytes(ctx, c, msg); gerr != nil {
			if err != nil {
				return nil, errors.Join(err, gerr)
			}
			return nil, wrapf(op, gerr, "exchanging with the other ranks")
		}
	}
	if err != nil {
		return nil, err
	}
	for r, m := range all {
		if m[0] == 0 {
			continue
		}
		return nil, &rankError{op: op, rank: r, msg: string(m[1:]), kind: kindOf(m[0])}
	}
	out := make([][]byte, len(all))
	for r, m := range all {
		out[r] = m[1:]
	}
	return out, nil
}

// gatherBytes all-gathers byte strings of any lengths: the lengths, then
// the strings padded to the longest.
func gatherBytes(ctx context.Context, c comm.Communicator, b []byte) ([][]byte, error) {
	p := c.Size()
	lens := make([]int64, p)
	if err := comm.AllGather(ctx, c, comm.Host([]int64{int64(len(b))}), comm.Host(lens)); err != nil {
		return nil, err
	}
	width := int(slices.Max(lens))
	send := make([]uint8, width)
	copy(send, b)
	all := make([]uint8, p*width)
	if width > 0 {
		if err := comm.AllGather(ctx, c, comm.Host(send), comm.Host(all)); err != nil {
			return nil, err
		}
	}
	out := make([][]byte, p)
	for r := range out {
		out[r] = all[r*width : r*width+int(lens[r])]
	}
	return out, nil
}

// rankError is another rank's failure as this rank reports it: that
// rank's message, and its kind for errors.Is.
type rankError struct {
	op   string
	rank int
	msg  string
	kind error // nil for an error of no sentinel's kind
}

func (e *rankError) Error() string {
	return fmt.Sprintf("checkpoint: %s: rank %d failed: %s", e.op, e.rank, e.msg)
}

func (e *rankError) Unwrap() error { return e.kind }
