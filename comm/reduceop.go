package comm

import (
	"fmt"
	"strings"
)

// ReduceOp combines elements across ranks.
type ReduceOp uint8

// The reduction operators. Avg is the sum divided by the number of ranks
// (truncated toward zero for integer types).
const (
	Sum ReduceOp = iota + 1
	Avg
	Prod
	Min
	Max
)

// AllReduceOps returns every ReduceOp, in declaration order, in a new slice
// the caller may keep or modify.
func AllReduceOps() []ReduceOp { return []ReduceOp{Sum, Avg, Prod, Min, Max} }

// Valid reports whether r is a known operator.
func (r ReduceOp) Valid() bool { return r >= Sum && r <= Max }

// String returns the lower-case name used by flags and errors ("sum").
func (r ReduceOp) String() string {
	switch r {
	case Sum:
		return "sum"
	case Avg:
		return "avg"
	case Prod:
		return "prod"
	case Min:
		return "min"
	case Max:
		return "max"
	}
	return fmt.Sprintf("reduceop(%d)", uint8(r))
}

// ParseReduceOp parses an operator name as printed by String.
func ParseReduceOp(s string) (ReduceOp, error) {
	for _, r := range AllReduceOps() {
		if strings.EqualFold(s, r.String()) {
			return r, nil
		}
	}
	return 0, fmt.Errorf("comm: unknown reduce op %q (want sum, avg, prod, min or max)", s)
}
