package trace_test

import (
	"context"
	"errors"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/local"
	"github.com/b7ea7098/loom/trace"
)

// TestGather traces each of 4 in-process ranks on a timeline of its own,
// as one process per rank would, and merges them on rank 0: every rank's
// compute spans and collectives arrive, the groups get their full labels
// although each timeline saw one member, and the times stay on rank 0's
// clock.
func TestGather(t *testing.T) {
	const n = 4
	var root *trace.Timeline
	var mu sync.Mutex
	start := time.Now()
	err := local.Run(context.Background(), n, func(ctx context.Context, c comm.Communicator) error {
		tl := trace.NewTimeline()
		if c.Rank() == 0 {
			mu.Lock()
			root = tl
			mu.Unlock()
		}
		tc := trace.Comm(c, tl, c.Rank())
		span := tl.Begin(c.Rank(), "work")
		x := []float32{float32(c.Rank())}
		if err := comm.AllReduce(ctx, tc, comm.Host(x), comm.Host(x), comm.Sum); err != nil {
			return err
		}
		pair, err := tc.Split(ctx, c.Rank()%2, c.Rank()) // {0,2} and {1,3}
		if err != nil {
			return err
		}
		if err := comm.AllReduce(ctx, pair, comm.Host(x), comm.Host(x), comm.Sum); err != nil {
			return err
		}
		span.End()
		return trace.Gather(ctx, c, tl, 0)
	})
	if err != nil {
		t.Fatal(err)
	}
	elapsed := time.Since(start)
	evs := root.Events()
	groups := map[int][]string{}
	work := map[int]bool{}
	for _, e := range evs {
		if e.Start < -time.Second || e.End > elapsed+time.Second || e.End < e.Start {
			t.Errorf("event %+v outside rank 0's clock (run took %v)", e, elapsed)
		}
		switch e.Lane {
		case trace.LaneComm:
			groups[e.Rank] = append(groups[e.Rank], e.Group)
		case trace.LaneCompute:
			work[e.Rank] = work[e.Rank] || e.Name == "work"
		}
	}
	for r := range n {
		if !work[r] {
			t.Errorf("rank %d's compute span is missing from the merged timeline", r)
		}
		pair := "[0,2]"
		if r%2 == 1 {
			pair = "[1,3]"
		}
		got := slices.Compact(slices.Sorted(slices.Values(groups[r]))) // Split is a collective on the world too
		want := slices.Sorted(slices.Values([]string{"[0,1,2,3]", pair}))
		if !slices.Equal(got, want) {
			t.Errorf("rank %d's collectives are on groups %v, want %v", r, got, want)
		}
	}
}

func TestImportInvalid(t *testing.T) {
	tl := trace.NewTimeline()
	for _, b := range []string{"", "{", `{"Groups":[{"Key":"g","Size":0}]}`, `{"Events":[{"Lane":99}]}`} {
		if err := tl.Import([]byte(b)); !errors.Is(err, trace.ErrInvalid) {
			t.Errorf("Import(%q) = %v, want ErrInvalid", b, err)
		}
	}
	var nilTL *trace.Timeline
	if _, err := nilTL.Export(); !errors.Is(err, trace.ErrInvalid) {
		t.Errorf("nil Export = %v, want ErrInvalid", err)
	}
	if err := trace.Gather(context.Background(), nil, tl, 0); !errors.Is(err, trace.ErrInvalid) {
		t.Errorf("Gather(nil comm) = %v, want ErrInvalid", err)
	}
}
