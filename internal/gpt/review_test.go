package gpt_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/internal/gpt"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// The batch dim sharded over both mesh axes in (b, a) order reaches
// CrossEntropy with the targets in the same order as the logits.
func TestForwardKeepsANestedBatchOrder(t *testing.T) {
	c := small()
	b := randomBatch(c, 5)
	placementtest.Run(t, []int{2, 2}, []string{"a", "b"}, func(ctx context.Context, m *mesh.Mesh) error {
		tape := autograd.NewTape()
		md, err := gpt.New(tape, m, c, gpt.RandomInit(c, 1))
		if err != nil {
			return err
		}
		s0 := placement.Shard(0)
		places := []placement.Placement{s0, s0}
		x, err := autograd.IndicesFromFull(m, []int{b.B, b.T}, places, b.X, placement.WithOrder(0, "b", "a"))
		if err != nil {
			return err
		}
		y, err := autograd.IndicesFromFull(m, []int{b.B, b.T}, places, b.Y, placement.WithOrder(0, "b", "a"))
		if err != nil {
			return err
		}
		if _, err := md.Forward(ctx, tape, x, y); err != nil {
			return fmt.Errorf("Forward with x and y laid out alike: %v", err)
		}
		return nil
	})
}

func TestNilIndicesDoNotPanic(t *testing.T) {
	defer func() {
		if r := recover(); r != nil {
			t.Fatalf("panic: %v", r)
		}
	}()
	var ix *autograd.Indices
	if ix.Shape() != nil || ix.Placements() != nil || ix.String() != "indices (invalid)" {
		t.Error("nil Indices accessors")
	}
	zero := &autograd.Indices{}
	if zero.LocalShape() != nil || zero.Order(0) != nil {
		t.Error("zero Indices accessors")
	}
}
