package local_test

import (
	"context"
	"testing"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/commtest"
	"github.com/b7ea7098/loom/comm/local"
)

// TestConformance runs the backend-independent conformance suite: every
// collective for every rank count, size, dtype, reduce op, root and
// algorithm against a serial reference (a reduced matrix with -short).
func TestConformance(t *testing.T) {
	launch := func(ctx context.Context, p int, fn func(ctx context.Context, c comm.Communicator) error) error {
		return local.Run(ctx, p, fn)
	}
	commtest.Run(t, launch, commtest.Config{
		Algorithms: local.Algorithms,
		Short:      testing.Short(),
	})
}
