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
// "hd", "dbtree" and "hier" are accepted too, in any case, with '-' for
// '_'. An unknown name is an error wrapping ErrInvalid.
func ParseAlgorithm(s string) (Algorithm, error) {
	a, ok := lookupAlgorithm(s)
	if !ok {
		return 0, fmt.Errorf("comm: ParseAlgorithm: %w: %s", ErrInvalid, unknownAlgorithm(s))
	}
	return a, nil
}

// lookupAlgorithm is ParseAlgorithm without the error.
func lookupAlgorithm(s string) (Algorithm, bool) {
	s = strings.ToLower(strings.ReplaceAll(s, "-", "_"))
	switch s {
	case "rd":
		return RecursiveDoubling, true
	case "rabenseifner", "hd":
		return HalvingDoubling, true
	case "dbtree":
		return DoubleTree, true
	case "hier":
		return Hierarchical, true
	}
	for i, n := range algoNames {
		if s == n {
			return Algorithm(i), true
		}
	}
	return 0, false
}

func unknownAlgorithm(s string) string {
	return fmt.Sprintf("unknown algorithm %q (want one of %s)", s, strings.Join(algoNames, ", "))
}

// AlgorithmEnv is the environment variable that forces an algorithm for
// every call that does not force one itself, as NCCL_ALGO does; its syntax
// is ParseAlgorithmOverrides's. One algorithm name applies to every op it
// can serve (the others stay automatic); op=algorithm entries
// ("allreduce=ring,allgather=direct") are strict.
const AlgorithmEnv = "LOOM_ALGO"

// AlgorithmOverrides maps ops to forced algorithms; the zero Op key applies
// to every op not listed.
type AlgorithmOverrides map[Op]Algorithm

// ParseAlgorithmOverrides parses the syntax of AlgorithmEnv: empty or
// blank (nothing forced), or a comma list of entries, each either
// op=algorithm (force it for that op) or one algorithm name (the default
// for every op not listed), at most one of which may be a plain name.
// Names are those of ParseOp and ParseAlgorithm; white space around them is
// ignored. An empty entry, an unknown op or algorithm, an op listed twice
// (even with the same algorithm) and a second default are errors that wrap
// ErrInvalid and quote the entry. String formats the result back.
func ParseAlgorithmOverrides(s string) (AlgorithmOverrides, error) {
	o, err := parseOverrides(s)
	if err != nil {
		return nil, fmt.Errorf("comm: ParseAlgorithmOverrides(%q): %w", s, err)
	}
	return o, nil
}

// parseOverrides is ParseAlgorithmOverrides with errors that do not say
// where s came from.
func parseOverrides(s string) (AlgorithmOverrides, error) {
	out := AlgorithmOverrides{}
	if strings.TrimSpace(s) == "" {
		return out, nil
	}
	from := make(map[Op]string) // the entry that set each key
	for _, entry := range strings.Split(s, ",") {
		entry = strings.TrimSpace(entry)
		if entry == "" {
			return nil, fmt.Errorf("%w: empty entry (entries are separated by single commas)", ErrInvalid)
		}
		opName, algoName, hasOp := strings.Cut(entry, "=")
		var op Op // the default's key
		if hasOp {
			var ok bool
			if op, ok = lookupOp(strings.TrimSpace(opName)); !ok {
				return nil, fmt.Errorf("%w: entry %q: unknown op %q (want one of %s)", ErrInvalid, entry, strings.TrimSpace(opName), opList())
			}
		} else {
			algoName = entry
		}
		a, ok := lookupAlgorithm(strings.TrimSpace(algoName))
		if !ok {
			return nil, fmt.Errorf("%w: entry %q: %s", ErrInvalid, entry, unknownAlgorithm(strings.TrimSpace(algoName)))
		}
		if prev, dup := from[op]; dup {
			if hasOp {
				return nil, fmt.Errorf("%w: entry %q: %v is already forced by entry %q", ErrInvalid, entry, op, prev)
			}
			return nil, fmt.Errorf("%w: entry %q: a second default algorithm (the first is %q)", ErrInvalid, entry, prev)
		}
		from[op] = entry
		out[op] = a
	}
	return out, nil
}

// AlgorithmOverridesFromEnv reads AlgorithmEnv, with the syntax of
// ParseAlgorithmOverrides; an error names the variable and the entry.
func AlgorithmOverridesFromEnv() (AlgorithmOverrides, error) {
	return algorithmOverridesFrom(os.Getenv)
}

func algorithmOverridesFrom(getenv func(string) string) (AlgorithmOverrides, error) {
	s := getenv(AlgorithmEnv)
	o, err := parseOverrides(s)
	if err != nil {
		return nil, fmt.Errorf("comm: %s=%q: %w", AlgorithmEnv, s, err)
	}
	return o, nil
}

// String formats o in the syntax of ParseAlgorithmOverrides, the default
// first and then the ops in their declaration order
// ("ring,allreduce=tree"); "" when o forces nothing. Parsing the result
// gives o back whenever o holds only known ops and algorithms.
func (o AlgorithmOverrides) String() string {
	var parts []string
	if a, ok := o[0]; ok {
		parts = append(parts, a.String())
	}
	for op := Op(1); op != 0; op++ { // every op, in order, unknown ones too
		if a, ok := o[op]; ok {
			parts = append(parts, op.String()+"="+a.String())
		}
	}
	return strings.Join(parts, ",")
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
