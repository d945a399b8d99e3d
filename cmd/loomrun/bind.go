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

// bindEnv sets --bind's default.
const bindEnv = "LOOM_BIND"

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
