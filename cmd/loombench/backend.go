package main

import (
	"context"
	"fmt"
	"slices"
	"sort"
	"strings"

	"github.com/b7ea7098/loom/comm"
)

// backend is a communication backend loombench can drive.
type backend struct {
	// run starts p ranks with communicator options opts, calls fn on each
	// with its communicator, and returns the ranks' errors joined.
	run func(ctx context.Context, p int, opts comm.Options, fn func(ctx context.Context, c comm.Communicator) error) error
	// algorithms lists the algorithms the backend offers for op.
	algorithms func(op comm.Op) []comm.Algorithm
	// world, for backends with one rank per process (MPI), returns the
	// job's size and this process's rank; nil for in-process backends.
	world func() (size, rank int, err error)
	// finish, if set, runs once after the last measurement (MPI_Finalize).
	finish func() error
	// tuningCalls is how many calls of one size class the backend's
	// automatic choice may spend timing candidates before it settles
	// (local.MaxTuningCalls); auto's warmup is longer by as many, so that
	// it is measured in its steady state.
	tuningCalls int
}

// backends holds the registered backends by name; each backend_*.go file
// adds its own.
var backends = map[string]backend{}

// lookupBackend returns the named backend or an error listing the known ones.
func lookupBackend(name string) (backend, error) {
	if be, ok := backends[name]; ok {
		return be, nil
	}
	known := make([]string, 0, len(backends))
	for n := range backends {
		known = append(known, n)
	}
	sort.Strings(known)
	if len(known) == 0 {
		return backend{}, fmt.Errorf("backend %q is not available (this build has no backends)", name)
	}
	return backend{}, fmt.Errorf("backend %q is not available (want one of: %s)", name, strings.Join(known, ", "))
}

// resolveAlgorithms turns the -algo names into the algorithms to measure for
// op: "auto", one or more algorithm names, or "all" (auto, then every
// algorithm the backend offers for op). A forced algorithm the backend does
// not offer for op is an error.
func resolveAlgorithms(names []string, op benchOp, be backend) ([]comm.Algorithm, error) {
	offered := be.algorithms(op.op)
	var out []comm.Algorithm
	add := func(a comm.Algorithm) {
		if !slices.Contains(out, a) {
			out = append(out, a)
		}
	}
	for _, name := range names {
		if strings.EqualFold(name, "all") {
			add(comm.Auto)
			for _, a := range offered {
				add(a)
			}
			continue
		}
		a, err := comm.ParseAlgorithm(name)
		if err != nil {
			return nil, err
		}
		if a != comm.Auto && !slices.Contains(offered, a) {
			return nil, fmt.Errorf("%v: algorithm %v does not apply (offered: %s)", op, a, algoList(offered))
		}
		add(a)
	}
	return out, nil
}

func algoList(as []comm.Algorithm) string {
	if len(as) == 0 {
		return "none, only auto"
	}
	s := make([]string, len(as))
	for i, a := range as {
		s[i] = a.String()
	}
	return strings.Join(s, ", ")
}
