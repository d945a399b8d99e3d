package main

import (
	"fmt"
	"strconv"
	"strings"
)

// Binding policies of --bind.
const (
	bindCore = "core" // each local rank on cores of its own
	bindNone = "none" // no pinning
)

// bindEnv sets --bind's default, in the words comm/local reads it with
// (local.BindEnv), since the ranks inherit it.
const bindEnv = "LOOM_BIND"

// bindDefault returns --bind's default for a bindEnv value: core when it
// is unset or empty, or says 1, true or auto; none for 0, false or none.
// Any other value is an error (and the default core), which --bind given
// on the command line overrides.
func bindDefault(v string) (string, error) {
	switch strings.ToLower(strings.TrimSpace(v)) {
	case "", "1", "true", "auto":
		return bindCore, nil
	case "0", "false", "none":
		return bindNone, nil
	}
	return bindCore, fmt.Errorf("%s=%q: want 1, true or auto to bind each rank to cores of its own, or 0, false or none", bindEnv, v)
}

// cpusEnv carries a rank's CPU list ("0,1") from the launcher to its
// supervisor, which pins the thread that starts the rank so that the rank
// inherits the mask from its first instruction. Internal, like
// supervisorEnv: the supervisor removes it from the rank's environment.
const cpusEnv = "LOOMRUN_CPUS"

// planCPUs cuts the CPUs loomrun may use into nproc equal runs of
// consecutive CPUs, one per local rank (the leftover CPUs unused), or
// returns nil and why not when there are fewer CPUs than ranks.
func planCPUs(allowed []int, nproc int) ([][]int, string) {
	if nproc < 1 || len(allowed) < nproc {
		return nil, fmt.Sprintf("%d process(es) on %d CPU(s): more processes than CPUs, not binding", nproc, len(allowed))
	}
	per := len(allowed) / nproc
	plan := make([][]int, nproc)
	for i := range plan {
		plan[i] = allowed[i*per : (i+1)*per]
	}
	return plan, ""
}

// formatCPUs writes a CPU list for cpusEnv.
func formatCPUs(cpus []int) string {
	s := make([]string, len(cpus))
	for i, c := range cpus {
		s[i] = strconv.Itoa(c)
	}
	return strings.Join(s, ",")
}

// parseCPUs reads a CPU list written by formatCPUs.
func parseCPUs(s string) ([]int, error) {
	var cpus []int
	for f := range strings.SplitSeq(s, ",") {
		c, err := strconv.Atoi(f)
		if err != nil || c < 0 || c >= 1<<16 {
			return nil, fmt.Errorf("CPU list %q: %q is not a CPU number", s, f)
		}
		cpus = append(cpus, c)
	}
	return cpus, nil
}
