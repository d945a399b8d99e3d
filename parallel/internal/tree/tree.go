// Package tree holds the module-tree helpers that package parallel and the
// parallelism packages beside it (parallel/tp, parallel/fsdp) share:
// matching a module's dotted path against a pattern and telling modules
// apart by identity. It works on any value so that it need not import
// parallel (which imports it).
package tree

import (
	"reflect"
	"strings"
)

// MatchPath reports whether a module path ("h.0.mlp.fc"; "" is the root)
// matches pat, a pattern split at its dots: each segment a literal or "*"
// (any one segment).
func MatchPath(pat []string, path string) bool {
	segs := strings.Split(path, ".")
	if path == "" {
		segs = nil
	}
	if len(segs) != len(pat) {
		return false
	}
	for i, s := range pat {
		if s != "*" && s != segs[i] {
			return false
		}
	}
	return true
}

// Comparable reports whether m can be a map key and be compared by
// identity (pointer modules can; a module of a non-comparable value type
// is told apart by its path instead).
func Comparable(m any) bool { return reflect.ValueOf(m).Comparable() }

// IsNil reports whether m is nil or a nil pointer behind a non-nil
// interface (a *Linear field left unset), on which a module's methods
// would dereference nil.
func IsNil(m any) bool {
	if m == nil {
		return true
	}
	v := reflect.ValueOf(m)
	return v.Kind() == reflect.Pointer && v.IsNil()
}
