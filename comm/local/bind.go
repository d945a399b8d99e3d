package local

import (
	"fmt"
	"os"
	"strings"
)

// BindEnv turns CPU binding on for Run when no WithCPUBinding option is
// given: "1", "true" or "cores" binds, "", "0", "false" or "none" does not.
const BindEnv = "LOOM_BIND"

// WithCPUBinding makes Run bind each rank to CPUs of its own, as mpirun's
// --bind-to core does for processes: the rank's goroutine is locked to an
// OS thread whose affinity is a disjoint, contiguous share of the CPUs the
// process may use (rank r of p on c CPUs gets CPUs r·c/p to (r+1)·c/p − 1).
// Otherwise the Go scheduler moves a rank's goroutine between threads and
// the kernel moves threads between cores, so a rank keeps losing its
// caches; bound, each rank keeps its core. A dp=2 training step of the
// tiny GPT on two cores runs about 6% faster bound (BenchmarkLayouts).
// Goroutines a rank starts are not bound, and a rank that blocks often
// (many small collectives, as tensor parallelism has) can lose more in
// thread hand-offs than it gains.
//
// Binding needs at least as many CPUs as ranks and thread affinity (Linux):
// otherwise Run fails before any rank starts. NewWorld ignores the option.
// Without it Run reads BindEnv.
func WithCPUBinding(on bool) Option {
	return func(c *config) { c.bind, c.bindSet = on, true }
}

// bindingFromEnv parses BindEnv.
func bindingFromEnv() (bool, error) {
	switch v := strings.ToLower(strings.TrimSpace(os.Getenv(BindEnv))); v {
	case "", "0", "false", "none":
		return false, nil
	case "1", "true", "cores":
		return true, nil
	default:
		return false, fmt.Errorf("local: %s=%q: want 1, true or cores to bind ranks to CPUs, or 0, false or none", BindEnv, v)
	}
}

// cpuShares splits the CPUs the process may use into p disjoint shares,
// one per rank, or explains why it cannot.
func cpuShares(p int) ([][]int, error) {
	cpus, err := usableCPUs()
	if err != nil {
		return nil, fmt.Errorf("local: binding ranks to CPUs: %w", err)
	}
	if len(cpus) < p {
		return nil, fmt.Errorf("local: cannot bind %d ranks to CPUs of their own: the process may use %d CPUs (%v)", p, len(cpus), cpus)
	}
	shares := make([][]int, p)
	for r := range shares {
		shares[r] = cpus[r*len(cpus)/p : (r+1)*len(cpus)/p]
	}
	return shares, nil
}
