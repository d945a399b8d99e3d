// Package preset looks up the named configurations (presets) of the model
// packages, so that each lists its own and shares the lookup.
package preset

// Entry is one named configuration; Config builds a fresh value each call.
type Entry[C any] struct {
	Name   string
	Config func() C
}

// Names returns the entries' names in order.
func Names[C any](es []Entry[C]) []string {
	out := make([]string, len(es))
	for i, e := range es {
		out[i] = e.Name
	}
	return out
}

// Find returns the configuration named name, and false when no entry has
// that name.
func Find[C any](es []Entry[C], name string) (C, bool) {
	for _, e := range es {
		if e.Name == name {
			return e.Config(), true
		}
	}
	var zero C
	return zero, false
}
