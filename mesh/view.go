package mesh

import (
	"slices"
	"strings"
)

// Sub returns the sub-mesh over the named axes, in the order given: the ranks
// that share this rank's coordinate on every other axis, laid out row-major
// over the named axes. Sub("tp") of a ("dp","tp") mesh is this rank's tp
// group; Sub("tp","dp") is the whole mesh transposed. The view shares this
// mesh's communicator registry. Sub is local: it calls no collective.
func (m *Mesh) Sub(names ...string) (*Mesh, error) {
	const op = "Sub"
	if len(names) == 0 {
		return nil, invalidf(op, "no axis names (mesh axes: %s)", strings.Join(m.names, ", "))
	}
	axes, err := m.axes(op, names)
	if err != nil {
		return nil, err
	}
	shape := make([]int, len(axes))
	for k, a := range axes {
		shape[k] = m.shape[a]
	}
	return newView(m.reg, slices.Clone(names), shape, m.group(axes), m.groupPos(axes)), nil
}

// Flatten merges contiguous axes into one axis named newName, which takes
// their place: names must be adjacent in the mesh and given in mesh order,
// and the new axis's size is the product of theirs. The result is a view
// over the same ranks in the same order, so Comm(newName) groups the ranks
// that Group(names...) does. An empty newName means the names joined by "_"
// (("dp","cp") -> "dp_cp"); it must not clash with an axis that remains.
// Flatten is local: it calls no collective.
func (m *Mesh) Flatten(names []string, newName string) (*Mesh, error) {
	const op = "Flatten"
	if len(names) == 0 {
		return nil, invalidf(op, "no axis names (mesh axes: %s)", strings.Join(m.names, ", "))
	}
	axes, err := m.axes(op, names)
	if err != nil {
		return nil, err
	}
	first := axes[0]
	for k, a := range axes {
		if a != first+k {
			return nil, invalidf(op, "axes %q are not contiguous and in mesh order (mesh axes: %s)",
				names, strings.Join(m.names, ", "))
		}
	}
	if newName == "" {
		newName = strings.Join(names, "_")
	}
	last := first + len(axes)
	for i, n := range m.names {
		if (i < first || i >= last) && n == newName {
			return nil, invalidf(op, "flattened axis name %q clashes with axis %d of the mesh (mesh axes: %s)",
				newName, i, strings.Join(m.names, ", "))
		}
	}
	size := 1
	for _, a := range axes {
		size *= m.shape[a]
	}
	newNames := slices.Concat(m.names[:first], []string{newName}, m.names[last:])
	newShape := slices.Concat(m.shape[:first], []int{size}, m.shape[last:])
	return newView(m.reg, newNames, newShape, m.ranks, m.pos), nil
}
