package moe

import (
	"context"
	"errors"
	"fmt"
	"math"
	"testing"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/kernels"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// The routed layout sums per-rank, per-expert row counts; a sum that
// overflows int is an error, on every rank, before the Routed spec is
// built: a static capacity of 2^62+1 over 4 experts used to wrap to 4
// rows a group, and a count of MaxInt64 from a peer to a negative total.
// (PlanRouting bounds both on its side; layout does not rely on it.)
func TestLayoutRejectsOverflowingRows(t *testing.T) {
	for _, tc := range []struct {
		name     string
		capacity int     // > 0: static layout
		counts   []int64 // per expert, the same from every rank (ragged)
		want     error
	}{
		{"static capacity wraps", 1<<62 + 1, nil, ErrInvalid},
		{"peer count past int32", 0, []int64{math.MaxInt64, 1, 1, 1}, ErrMismatch},
		{"negative peer count", 0, []int64{-1, 1, 1, 1}, ErrMismatch},
	} {
		t.Run(tc.name, func(t *testing.T) {
			placementtest.Run(t, []int{2}, []string{"ep"}, func(ctx context.Context, m *mesh.Mesh) error {
				xs, err := placement.NewSpec(m, []int{4, 3}, comm.Float32, []placement.Placement{placement.Shard(0)})
				if err != nil {
					return err
				}
				h := &Handle{axis: "ep", xs: xs, tokenAxes: []string{"ep"}, n: 2, k: 1, e: 4, d: 3,
					ranks: 2, rank: m.Rank(), local: 2, capacity: tc.capacity, static: tc.capacity > 0}
				experts := []int32{0, 1}
				if err := kernels.PlanRouting(&h.plan, experts, h.k, h.e, 0); err != nil {
					return err
				}
				var gathered [][]int64
				if tc.counts != nil {
					for range 2 {
						msg := make([]int64, hdrLen+h.e+3)
						copy(msg[hdrLen:], tc.counts)
						gathered = append(gathered, msg)
					}
				}
				err = h.layout("moe: Dispatch", experts, gathered, 0, m.Shape(), m.Names())
				if !errors.Is(err, tc.want) {
					return fmt.Errorf("layout: %v (rows %v); want %v", err, h.routed, tc.want)
				}
				return nil
			})
		})
	}
}
