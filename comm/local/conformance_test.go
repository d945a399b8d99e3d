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
	opts, err := comm.OptionsFromEnv()
	if err != nil {
		t.Fatal(err)
	}
	// A fixed model, so that Auto makes the same choices on every machine.
	opts.CostModel = fixedModel()
	// A case issues a handful of calls, and the default recorder of 2000
	// entries per rank, allocated by each of the suite's ~20000 worlds,
	// was a third of the time of the small cases (in the garbage
	// collector).
	opts.RecorderSize = 64
	launch := func(ctx context.Context, p int, fn func(ctx context.Context, c comm.Communicator) error) error {
		return local.Run(ctx, p, fn, local.WithOptions(opts))
	}
	commtest.Run(t, launch, commtest.Config{
		Algorithms: local.Algorithms,
		Short:      testing.Short(),
	})
}

// fixedModel is a cost model measured by local.Calibrate on a 2-core Xeon
// server, with the last-level cache set to a common 32 MiB: the suite's
// large size then runs both within the cache (p = 2, float32) and beyond it
// (more ranks, wider types), where the backend streams its results, on
// every machine, whatever its own cache.
func fixedModel() *comm.CostModel {
	return &comm.CostModel{
		Alpha: 4.7e-7, Switch: 6.9e-7,
		Beta: 1.7e-10, Gamma: 1.3e-10, GammaStream: 9.2e-11,
		BetaCache: 3.2e-11, GammaCache: 1.9e-11,
		CacheBytes: 32 << 20, Bandwidth: 7.7e9, Cores: 2,
		Machine: "fixed test model",
	}
}
