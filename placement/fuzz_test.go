package placement_test

import (
	"context"
	"errors"
	"fmt"
	"math/big"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// FuzzRedistribute decodes (mesh, shape, source, destination, shard
// orders) from the fuzzer's numbers, plans the redistribution with and
// without a cost model and its backward (linear cases), and runs the round
// trip Full(Redistribute(Distribute(x, src), dst)) == x on a simulated mesh.
// Run: go test -fuzz FuzzRedistribute ./placement
func FuzzRedistribute(f *testing.F) {
	f.Add(uint16(0x0009), uint32(0x00a1), uint32(0x21), uint32(0x12), uint64(1))
	f.Add(uint16(0x0092), uint32(0x0e2e), uint32(0x111), uint32(0x050), uint64(2))
	f.Add(uint16(0x01b5), uint32(0x3ffa), uint32(0x777), uint32(0x132), uint64(3))
	f.Add(uint16(0x0000), uint32(0x0000), uint32(0x0), uint32(0x0), uint64(4))
	f.Fuzz(func(t *testing.T, meshBits uint16, shapeBits, srcBits, dstBits uint32, seed uint64) {
		naxes := 1 + int(meshBits%3)
		msh := make([]int, naxes)
		total := 1
		for i := range msh {
			msh[i] = 1 + int(meshBits>>(2+3*i))&7
			for total*msh[i] > 8 {
				msh[i]--
			}
			total *= msh[i]
		}
		ndim := 1 + int(shapeBits%3)
		shape := make([]int, ndim)
		for d := range shape {
			shape[d] = int(shapeBits>>(2+3*d)) & 7 // 0 included: empty tensors
		}
		pick := func(bits uint32) []placement.Placement {
			opts := perAxis(ndim)
			ps := make([]placement.Placement, naxes)
			for a := range ps {
				ps[a] = opts[int(bits>>(4*a)&15)%len(opts)]
			}
			return ps
		}
		sp, dp := pick(srcBits), pick(dstBits)
		if !validMix(sp) || !validMix(dp) {
			return
		}
		placementtest.Run(t, msh, names(naxes), func(ctx context.Context, m *mesh.Mesh) error {
			rng := rand.New(rand.NewPCG(seed, 0))
			src, err := placement.NewSpec(m, shape, comm.Float64, sp, orderOpts(m, sp, ndim, rng)...)
			if err != nil {
				return err
			}
			dst, err := placement.NewSpec(m, shape, comm.Float64, dp, orderOpts(m, dp, ndim, rng)...)
			if err != nil {
				return err
			}
			for _, p := range []*placement.Planner{placement.NewPlanner(nil), placement.NewPlanner(testModel)} {
				pl, err := p.Plan(src, dst)
				if err != nil {
					return err
				}
				if _, err := p.Backward(pl, nil); err != nil && !errors.Is(err, placement.ErrUnsupported) {
					return err
				}
			}
			return roundTrip(ctx, placement.NewPlanner(nil), src, dst, seed, 1e-9)
		})
	})
}

// FuzzSpec builds specs from random global dims, huge ones included
// (powers of two, MaxInt64 and its neighbours, arbitrary 62-bit values),
// with random placements, shard orders and Routed row counts, on meshes of
// up to 8 ranks. NewSpec must either reject the spec with ErrInvalid (it
// must when the element or byte count overflows int) or give every rank a
// non-negative local shape whose size fits, with blocks that tile every
// global dim exactly. Run: go test -fuzz FuzzSpec -fuzztime 20s ./placement
func FuzzSpec(f *testing.F) {
	f.Add(uint16(0x0009), uint64(0x21), uint64(1<<33|2), uint64(0x80|3), uint32(0x21), uint64(1))
	f.Add(uint16(0x0092), uint64(1)<<63|1, uint64(2), uint64(0), uint32(0x10), uint64(2))
	f.Add(uint16(0x0001), uint64(31<<2|3), uint64(31<<2|3), uint64(31<<2|3), uint32(0x1), uint64(3))
	f.Add(uint16(0x0000), uint64(32<<2|3), uint64(32<<2|3), uint64(0), uint32(0x1), uint64(4))
	f.Add(uint16(0x0005), uint64(0), uint64(3<<2), uint64(0), uint32(0x6), uint64(0xffffffff))
	f.Fuzz(func(t *testing.T, meshBits uint16, d0, d1, d2 uint64, placeBits uint32, seed uint64) {
		naxes := 1 + int(meshBits%3)
		msh := make([]int, naxes)
		total := 1
		for i := range msh {
			msh[i] = 1 + int(meshBits>>(2+3*i))&7
			for total*msh[i] > 8 {
				msh[i]--
			}
			total *= msh[i]
		}
		raw := []uint64{d0, d1, d2}
		shape := make([]int, 1+int(meshBits>>11)%3)
		for d := range shape {
			shape[d] = fuzzDim(raw[d])
		}
		opts := append(perAxis(len(shape)), placement.Routed())
		places := make([]placement.Placement, naxes)
		groups := 1
		for a := range places {
			places[a] = opts[int(placeBits>>(4*a)&15)%len(opts)]
			if places[a].IsRouted() {
				groups *= msh[a]
			}
		}
		rng := rand.New(rand.NewPCG(seed, 1))
		routed := slices.ContainsFunc(places, placement.Placement.IsRouted)
		var rows []int
		if routed && seed&1 == 0 {
			// Random counts, huge ones included, the last making up the
			// global dim 0 (which may wrap: NewSpec must see through it).
			rows = make([]int, groups)
			rest := 0
			if len(shape) > 0 {
				rest = shape[0]
			}
			for g := range rows[:groups-1] {
				rows[g] = fuzzDim(rng.Uint64())
				rest -= rows[g]
			}
			rows[groups-1] = rest
		}
		es := big.NewInt(8)
		overflows := !fitsBytes(shape, es)
		placementtest.Run(t, msh, names(naxes), func(ctx context.Context, m *mesh.Mesh) error {
			specOpts := orderOpts(m, places, len(shape), rand.New(rand.NewPCG(seed, 2)))
			if rows != nil {
				specOpts = append(specOpts, placement.WithRoutedRows(rows))
			}
			spec, err := placement.NewSpec(m, shape, comm.Float64, places, specOpts...)
			if err != nil {
				if !errors.Is(err, placement.ErrInvalid) {
					return fmt.Errorf("NewSpec(%v, %v, rows %v): %w, want ErrInvalid", shape, places, rows, err)
				}
				return nil
			}
			if overflows {
				return fmt.Errorf("NewSpec(%v float64) = %v, want ErrInvalid: its byte count overflows", shape, spec)
			}
			if routed && rows == nil {
				return nil // a Routed spec without rows has no layout
			}
			return checkBoxes(spec)
		})
	})
}

// fuzzDim decodes a dim: small (0..63), a power of two or one of its
// neighbours (2^63 wraps: MaxInt64, and negative dims NewSpec rejects), or
// an arbitrary 62-bit value.
func fuzzDim(v uint64) int {
	switch v & 3 {
	case 0, 1:
		return int(v>>2) & 63
	case 2:
		return int(v >> 2)
	default:
		return (1 << ((v >> 2) % 64)) + int((v>>8)%3) - 1
	}
}
