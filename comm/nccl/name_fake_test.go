//go:build linux && (amd64 || arm64)

package nccl

import "testing"

// TestWithName checks that a communicator's name, which errors and
// flight-recorder dumps carry, is WithName's, or "nccl" by default for a
// communicator made from a unique id.
func TestWithName(t *testing.T) {
	f := useFake(t)
	l := f.load(t)
	tests := []struct {
		name string
		opts []Option
		want string
	}{
		{"default", nil, "nccl"},
		{"named", []Option{WithName("grads")}, "grads"},
		{"last wins", []Option{WithName("a"), WithName("tp")}, "tp"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			w := newWorld(t, l, 2, tc.opts...)
			defer func() {
				if err := w.close(); err != nil {
					t.Error(err)
				}
			}()
			for r, c := range w.comms {
				if got := c.Name(); got != tc.want {
					t.Errorf("rank %d: Name() = %q, want %q", r, got, tc.want)
				}
				if got := c.Recorder().Snapshot().Communicator; got != tc.want {
					t.Errorf("rank %d: recorder names %q, want %q", r, got, tc.want)
				}
			}
		})
	}
}
