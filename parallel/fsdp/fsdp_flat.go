package fsdp

import (
	"context"
	"fmt"
	"slices"
	"strings"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/parallel/internal/blocks"
	"github.com/b7ea7098/loom/placement"
)

// WithShardAxes shards over several mesh axes at once, flattened in the
// order given (outer first) into one shard group of their sizes' product,
// instead of WithShardAxis's one axis: each rank holds 1/(n₁·n₂·…) of every
// parameter, and the gradients are reduce-scattered over the whole group.
// This is torchtitan's FSDP over dp_shard×cp: with the sequence sharded
// over a context-parallel axis the gradients are Partial(sum) there as
// well, and the one reduce-scatter sums them, so no separate sum over cp
// is needed. The axes need not be adjacent in the mesh. A parameter's
// shard is Shard(dim) on every named axis, in that order after any axis
// that already shards the dim (placement.WithOrder), so its blocks follow
// the nested chunk rule of the placement package. Of it and WithShardAxis
// the last given applies. New fails with ErrInvalid when no axis is named, an axis
// is not the mesh's or is named twice, or the replicate axis is one of
// them.
func WithShardAxes(names ...string) Option {
	return func(c *config) { c.axes, c.axesSet = slices.Clone(names), true }
}

// flatAxes is the shard axes: their names (WithShardAxes's, or
// WithShardAxis's one), mesh indices, sizes and this rank's coordinates.
type flatAxes struct {
	names               []string
	axes, sizes, coords []int
}

// initShard resolves the shard axes on m (WithShardAxes's, or
// WithShardAxis's one) and this rank's place on them: f.flat.axes, f.flat.sizes,
// f.flat.coords, f.axis (the first), f.p and f.rank (the flattened
// coordinate, row-major over the axes as given). It communicates nothing.
// Errors wrap ErrInvalid.
func (f *FSDP) initShard(m *mesh.Mesh) error {
	names := f.cfg.axes
	if !f.cfg.axesSet {
		names = []string{f.cfg.axis}
	} else if len(names) == 0 {
		return fmt.Errorf("%w: New: WithShardAxes names no axis", ErrInvalid)
	}
	f.flat.names = names
	f.flat.axes, f.flat.sizes, f.flat.coords = nil, nil, nil
	f.p, f.rank = 1, 0
	for i, n := range names {
		a := slices.Index(m.Names(), n)
		if a < 0 {
			return fmt.Errorf("%w: New: mesh %v has no shard axis %q", ErrInvalid, m, n)
		}
		if slices.Contains(names[:i], n) {
			return fmt.Errorf("%w: New: WithShardAxes names axis %q twice", ErrInvalid, n)
		}
		c, err := m.Local(n)
		if err != nil {
			return err
		}
		f.flat.axes, f.flat.sizes, f.flat.coords = append(f.flat.axes, a), append(f.flat.sizes, m.Shape()[a]), append(f.flat.coords, c)
		f.p *= m.Shape()[a]
		f.rank = f.rank*m.Shape()[a] + c
	}
	f.axis = f.flat.axes[0]
	return nil
}

// shardComm returns the shard group's communicator: the axis's, or the
// flattened axes' group (ranks row-major over them, as f.rank counts).
func (f *FSDP) shardComm(ctx context.Context, m *mesh.Mesh) (comm.Communicator, error) {
	if len(f.flat.names) == 1 {
		return m.Comm(ctx, f.flat.names[0])
	}
	return m.Group(ctx, f.flat.names...)
}

// shardLabel names the shard axes for messages: "fsdp", or "fsdp×cp"
// when flattened.
func (f *FSDP) shardLabel() string { return strings.Join(f.flat.names, "×") }

// isShardAxis reports whether mesh axis a is one of the shard axes.
func (f *FSDP) isShardAxis(a int) bool { return slices.Contains(f.flat.axes, a) }

// chunkOf returns the offset and size of shard rank r's rows of a dim of
// n: the nested chunk rule over the shard axes, outer first (the rule of
// one axis when there is one), so that the blocks are the ones the
// sharded spec's placements give.
func (f *FSDP) chunkOf(n, r int) (off, size int) {
	c := make([]int, len(f.flat.sizes))
	for i := len(f.flat.sizes) - 1; i >= 0; i-- {
		c[i], r = r%f.flat.sizes[i], r/f.flat.sizes[i]
	}
	for i, k := range f.flat.sizes {
		o, s := chunkOf(n, k, c[i])
		off, n = off+o, s
	}
	return off, n
}

// shardedSpec is s laid out as places with Shard(dim) on every shard
// axis, after any axis that already shards dim (s's shard orders kept).
func (f *FSDP) shardedSpec(s *placement.Spec, places []placement.Placement, dim int) (*placement.Spec, error) {
	places = slices.Clone(places)
	for _, a := range f.flat.axes {
		places[a] = placement.Shard(dim)
	}
	return s.With(places, blocks.Orders(s, dim, f.flat.names...)...)
}
