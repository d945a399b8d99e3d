package local

import (
	"fmt"
	"os"
	"strings"

	"github.com/b7ea7098/loom/comm"
)

// BindEnv turns CPU binding on for every Run given no WithCPUBinding
// option: "1", "true" or "auto" binds the ranks of each Run whose ranks fit
// on the CPUs and leaves larger runs unbound; unset, "", "0", "false" or
// "none" binds nothing. Case and surrounding blanks do not matter; any
// other value makes Run fail with an error wrapping comm.ErrInvalid.
const BindEnv = "LOOM_BIND"

// WithCPUBinding makes Run bind each rank to CPUs of its own, as mpirun's
// --bind-to core does for processes: the rank's goroutine is locked to an
// OS thread whose affinity is a disjoint, contiguous share of the CPUs the
// process may use (rank r of p on c CPUs gets CPUs r·c/p to (r+1)·c/p − 1).
// Otherwise the Go scheduler moves a rank's goroutine between threads and
// the kernel moves threads between cores, so a rank keeps losing its
// caches; bound, each rank keeps its core. Goroutines a rank starts are
// not bound. A bound rank waiting for a peer polls instead of yielding
// (a locked goroutine's yield hands its thread's P to another thread and
// back), then parks.
//
// On the tiny GPT with two ranks on two cores (BenchmarkLayouts), binding
// made data-parallel steps 3-6% faster and tensor-parallel ones, which
// block on many small collectives, no faster or slower by as much; hence
// it is off by default.
//
// WithCPUBinding(true) needs at least as many CPUs as ranks and thread
// affinity (Linux): otherwise Run fails before any rank starts.
// WithCPUBinding(false) turns binding off whatever BindEnv says. NewWorld
// ignores the option.
func WithCPUBinding(on bool) Option {
	return func(c *config) { c.bind, c.bindSet = on, true }
}

// binding is whether Run binds its p ranks: as WithCPUBinding says, else
// as BindEnv says (then only where they fit).
func (c *config) binding(p int) (bool, error) {
	if c.bindSet {
		return c.bind, nil
	}
	on, err := parseBind(os.Getenv(BindEnv))
	if err != nil || !on {
		return false, err
	}
	cpus, err := usableCPUs()
	return err == nil && p <= len(cpus), nil
}

// parseBind parses a BindEnv value: whether it asks for binding where the
// ranks fit.
func parseBind(v string) (bool, error) {
	switch strings.ToLower(strings.TrimSpace(v)) {
	case "", "0", "false", "none":
		return false, nil
	case "1", "true", "auto":
		return true, nil
	}
	return false, fmt.Errorf("local: %s=%q: %w: want 1, true or auto to bind ranks to CPUs where they fit, or 0, false or none", BindEnv, v, comm.ErrInvalid)
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
