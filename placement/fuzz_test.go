package placement_test

import (
	"context"
	"errors"
	"math/rand/v2"
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
