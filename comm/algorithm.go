package comm

import (
	"fmt"
	"os"
	"strings"
)

// Algorithm selects how a backend moves the data of a collective.
type Algorithm uint8

// The algorithms. Not every one applies to every op; a backend rejects a
// forced algorithm that does not apply with an error naming those that do.
const (
	// Auto lets the backend choose, from its cost model.
	Auto Algorithm = iota
	// Direct: each rank reads every peer's block itself (one copy per element).
	Direct
	// Ring: p-1 steps around a ring (bandwidth-optimal, latency grows with p).
	Ring
	// RecursiveDoubling: log2(p) exchanges of the whole vector (latency-optimal).
	RecursiveDoubling
	// HalvingDoubling: Rabenseifner's recursive-halving reduce-scatter then
	// recursive-doubling all-gather.
	HalvingDoubling
	// Tree: a pipelined binary tree (reduce up, broadcast down).
	Tree
	// DoubleTree: two complementary binary trees, each carrying half the data.
	DoubleTree
	// Hierarchical: within groups of neighbouring ranks, then across groups.
	Hierarchical
)

// AllAlgorithms returns every algorithm except Auto, in declaration order, in a
// new slice the caller may keep or modify.
func AllAlgorithms() []Algorithm {
	return []Algorithm{Direct, Ring, RecursiveDoubling, HalvingDoubling, Tree, DoubleTree, Hierarchical}
}

var algoNames = []string{"auto", "direct", "ring", "recursive_doubling", "halving_doubling", "tree", "double_tree", "hierarchical"}

// Valid reports whether a is a known algorithm.
func (a Algorithm) Valid() bool { return int(a) < len(algoNames) }

// String returns the algorithm's name as accepted by ParseAlgorithm.
func (a Algorithm) String() string {
	if a.Valid() {
		return algoNames[a]
	}
	return fmt.Sprintf("algorithm(%d)", uint8(a))
}

// ParseAlgorithm parses a name as printed by String; "rd", "rabenseifner",
// "dbtree" and "hier" are accepted too.
func ParseAlgorithm(s string) (Algorithm, error) {
	s = strings.ToLower(strings.ReplaceAll(s, "-", "_"))
	switch s {
	case "rd":
		return RecursiveDoubling, nil
	case "rabenseifner", "hd":
		return HalvingDoubling, nil
	case "dbtree":
		return DoubleTree, nil
	case "hier":
		return Hierarchical, nil
	}
	for i, n := range algoNames {
		if s == n {
			return Algorithm(i), nil
		}
	}
	return 0, fmt.Errorf("comm: unknown algorithm %q (want one of %s)", s, strings.Join(algoNames, ", "))
}

// AlgorithmEnv is the environment variable that forces an algorithm for
// every call that does not force one itself, as NCCL_ALGO does. Its value is
// one algorithm name, which applies to every op it can serve (the others
// stay automatic), or a comma list of op=algorithm pairs
// ("allreduce=ring,allgather=direct"), which are strict.
const AlgorithmEnv = "LOOM_ALGO"

// AlgorithmOverrides maps ops to forced algorithms; the zero Op key applies
// to every op not listed.
type AlgorithmOverrides map[Op]Algorithm

// ParseAlgorithmOverrides parses the syntax of AlgorithmEnv.
func ParseAlgorithmOverrides(s string) (AlgorithmOverrides, error) {
	out := AlgorithmOverrides{}
	if strings.TrimSpace(s) == "" {
		return out, nil
	}
	for _, part := range strings.Split(s, ",") {
		part = strings.TrimSpace(part)
		opName, algoName, hasOp := strings.Cut(part, "=")
		if !hasOp {
			a, err := ParseAlgorithm(part)
			if err != nil {
				return nil, err
			}
			out[0] = a
			continue
		}
		op, err := ParseOp(strings.TrimSpace(opName))
		if err != nil {
			return nil, err
		}
		a, err := ParseAlgorithm(strings.TrimSpace(algoName))
		if err != nil {
			return nil, err
		}
		out[op] = a
	}
	return out, nil
}

// AlgorithmOverridesFromEnv reads AlgorithmEnv.
func AlgorithmOverridesFromEnv() (AlgorithmOverrides, error) {
	o, err := ParseAlgorithmOverrides(os.Getenv(AlgorithmEnv))
	if err != nil {
		return nil, fmt.Errorf("%s: %w", AlgorithmEnv, err)
	}
	return o, nil
}

// For returns the algorithm forced for op, or Auto. An op=algorithm entry
// is returned as is; the default entry only if applies reports that the
// backend can run it for op.
func (o AlgorithmOverrides) For(op Op, applies func(Op, Algorithm) bool) Algorithm {
	if a, ok := o[op]; ok {
		return a
	}
	if a := o[0]; a != Auto && (applies == nil || applies(op, a)) {
		return a
	}
	return Auto
}
