//go:build linux && (amd64 || arm64)

package nccl

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/b7ea7098/loom/comm"
)

// TestCancelledAtCall: a call given a context that has already ended is
// refused and aborts the communicator, although NCCL could have completed
// it: otherwise it would fail or succeed by when its peers arrive.
func TestCancelledAtCall(t *testing.T) {
	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	cases := []struct {
		name, op string
		call     func(c *Comm) error
	}{
		{"Do", "allreduce #1", func(c *Comm) error {
			buf := comm.Host([]float32{1})
			return comm.AllReduce(cancelled, c, buf, buf, comm.Sum)
		}},
		{"Start", "broadcast #1", func(c *Comm) error {
			_, err := comm.BroadcastAsync(cancelled, c, comm.Host([]int64{5}), 0)
			return err
		}},
		{"Send", "send #1", func(c *Comm) error {
			return comm.Send(cancelled, c, comm.Host([]float32{1}), 1, 0)
		}},
	}
	// A nonblocking communicator polls NCCL under the call's context while
	// enqueuing; a blocking one returns from NCCL without looking at it.
	for _, blocking := range []bool{false, true} {
		for _, tc := range cases {
			t.Run(fmt.Sprintf("blocking=%v/%s", blocking, tc.name), func(t *testing.T) {
				f := useFake(t)
				w := newWorld(t, f.load(t), 2, WithConfig(Config{Blocking: blocking}))
				t.Cleanup(func() { _ = w.close() })
				c0 := w.comms[0]
				err := tc.call(c0)
				if !errors.Is(err, context.Canceled) || !strings.Contains(err.Error(), tc.op) {
					t.Errorf("err = %v, want the context's cancellation naming %s", err, tc.op)
				}
				aborted(t, f, c0)
			})
		}
	}
}
