package local_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/local"
)

// blameTimeout is the communicator timeout of the blame cases; stagger
// (a fraction of it) orders which rank's timeout fires first.
const blameTimeout = 300 * time.Millisecond

// blameRank is one rank's part in a blame case: the communicators it
// holds (the world's "w" and the splits of the case by name; a split
// that excludes the rank is nil), and its rank.
type blameRank struct {
	ctx   context.Context
	r     int
	comms map[string]comm.Communicator
}

// after sleeps k quarters of the timeout, so that ranks start waiting in
// a known order.
func after(k int) { time.Sleep(time.Duration(k) * blameTimeout / 4) }

func (b blameRank) allReduce(name string) error {
	x := comm.Host([]float32{float32(b.r), 1, 2, 3})
	return comm.AllReduce(b.ctx, b.comms[name], x, x, comm.Sum)
}

func (b blameRank) reduceScatterRing(name string) error {
	c := b.comms[name]
	send := comm.Host(make([]float32, 2*c.Size()))
	return c.Do(b.ctx, comm.Call{Op: comm.OpReduceScatter, Send: send, Recv: comm.Host(make([]float32, 2)), Reduce: comm.Sum, Algorithm: comm.Ring})
}

// TestTimeoutNamesLateRank: a call that times out names the rank that
// never joined, on every rank, also when the ranks it waits for are
// themselves blocked in another communicator's call waiting for the late
// rank (a cascade, as under FSDP's WithReshardTo), whichever rank's timeout
// fires first; ranks that wait for each other are named as such.
func TestTimeoutNamesLateRank(t *testing.T) {
	noLeaks(t)
	t.Setenv(comm.CostModelEnv, comm.CostModelOff)
	cases := []struct {
		name string
		p    int
		// splits: name -> color of each world rank (-1: not a member).
		splits map[string][]int
		body   func(b blameRank) error
		// late: the ranks every checked rank must blame (nil: none, the
		// ranks wait for each other); check: the ranks whose errors are
		// checked (all when nil).
		late  []int
		check []int
		// says: what the error of rank r must contain, when set.
		says func(r int) []string
	}{
		{name: "one late rank, allreduce", p: 4, late: []int{2},
			body: func(b blameRank) error {
				if b.r == 2 {
					after(6)
				}
				return b.allReduce("w")
			},
			says: func(r int) []string { return []string{"rank 2, which has not joined"} }},
		{name: "one late rank, ring reducescatter", p: 4, late: []int{0},
			body: func(b blameRank) error {
				if b.r == 0 {
					after(6)
				}
				return b.reduceScatterRing("w")
			}},
		{name: "cascade through a split, the waiting ranks time out first", p: 4, late: []int{1},
			splits: map[string][]int{"pair": {0, 0, 1, 1}},
			body: func(b blameRank) error {
				switch b.r {
				case 0:
					after(2) // times out after ranks 2 and 3
					return b.allReduce("pair")
				case 1:
					after(12)
					return b.allReduce("pair")
				}
				if err := b.allReduce("pair"); err != nil {
					return err
				}
				return b.reduceScatterRing("w")
			},
			says: func(r int) []string {
				switch r {
				case 0:
					return []string{"[unit h.1 all-gather]", "waiting for rank 1, which has not joined this call"}
				case 2, 3:
					return []string{"waiting for rank 1, which has not joined this call (rank 0 waits in world/split1.c0 allreduce #1 [unit h.1 all-gather] for rank 1)"}
				}
				return nil
			}},
		{name: "cascade through a split, the blocked rank times out first", p: 4, late: []int{1},
			splits: map[string][]int{"pair": {0, 0, 1, 1}},
			body: func(b blameRank) error {
				switch b.r {
				case 0:
					return b.allReduce("pair")
				case 1:
					after(12)
					return b.allReduce("pair")
				}
				if err := b.allReduce("pair"); err != nil {
					return err
				}
				after(2)
				return b.reduceScatterRing("w")
			}},
		{name: "chain of three communicators", p: 4, late: []int{0},
			// Rank 3 waits in w for 0, 1, 2; rank 2 waits in "mid" for
			// world rank 1; rank 1 waits in "low" for world rank 0.
			splits: map[string][]int{"low": {0, 0, -1, -1}, "mid": {-1, 0, 0, -1}},
			body: func(b blameRank) error {
				switch b.r {
				case 0:
					after(12)
					return b.allReduce("low")
				case 1: // blocked before rank 2 times out, times out after it
					time.Sleep(2 * blameTimeout / 3)
					return b.allReduce("low")
				case 2: // blocked before rank 3 times out, times out after it
					time.Sleep(blameTimeout / 3)
					return b.allReduce("mid")
				}
				return b.allReduce("w")
			},
			says: func(r int) []string {
				switch r {
				case 2: // a communicator whose ranks are not the world's
					return []string{"world/split2.c0: rank 1 (world rank 2): allreduce #1", "timed out after 300ms waiting for world rank 0, which has not joined (",
						"rank 0 (world rank 1) waits in world/split1.c0 allreduce #1 [unit h.1 all-gather] for world rank 0"}
				case 3:
					return []string{"waiting for rank 0, which has not joined this call (",
						"rank 2 waits in world/split2.c0 allreduce #1 [unit h.1 all-gather] for rank 1",
						"rank 1 waits in world/split1.c0 allreduce #1 [unit h.1 all-gather] for rank 0"}
				}
				return nil
			}},
		{name: "a receive from a rank blocked in a collective", p: 3, late: []int{2}, check: []int{0, 1, 2},
			splits: map[string][]int{"pair": {-1, 0, 0}},
			body: func(b blameRank) error {
				switch b.r {
				case 0:
					after(2)
					return b.comms["w"].Do(b.ctx, comm.Call{Op: comm.OpRecv, Recv: comm.Host(make([]float32, 1)), Peer: 1})
				case 1:
					return b.allReduce("pair")
				}
				after(12)
				return b.allReduce("pair")
			}},
		{name: "ranks that wait for each other", p: 2, late: nil,
			splits: map[string][]int{"a": {0, 0}, "b": {0, 0}},
			body: func(b blameRank) error {
				if b.r == 0 {
					return b.allReduce("a")
				}
				return b.allReduce("b")
			},
			says: func(r int) []string { return []string{"wait for each other"} }},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			wd, err := local.NewWorld(tc.p, withTimeout(blameTimeout))
			if err != nil {
				t.Fatal(err)
			}
			names := make([]string, 0, len(tc.splits))
			for name := range tc.splits {
				names = append(names, name)
			}
			slices.Sort(names) // every rank splits in the same order
			errs := make([]error, tc.p)
			var wg sync.WaitGroup
			for r := 0; r < tc.p; r++ {
				wg.Add(1)
				go func(r int) {
					defer wg.Done()
					ctx := context.Background()
					b := blameRank{ctx: comm.WithLabel(ctx, "unit h.1 all-gather"), r: r, comms: map[string]comm.Communicator{"w": wd.Comm(r)}}
					for _, name := range names {
						s, err := wd.Comm(r).Split(ctx, tc.splits[name][r], r)
						if err != nil {
							errs[r] = fmt.Errorf("split %s: %w", name, err)
							return
						}
						b.comms[name] = s
					}
					errs[r] = tc.body(b)
				}(r)
			}
			wg.Wait()
			check := tc.check
			if check == nil {
				for r := 0; r < tc.p; r++ {
					check = append(check, r)
				}
			}
			for _, r := range check {
				err := errs[r]
				if !errors.Is(err, comm.ErrTimeout) {
					t.Errorf("rank %d: %v, want a timeout", r, err)
					continue
				}
				if got := comm.LateRanks(err); !slices.Equal(got, tc.late) {
					t.Errorf("rank %d blames %v, want %v: %v", r, got, tc.late, err)
				}
				if tc.says == nil {
					continue
				}
				for _, s := range tc.says(r) {
					if !strings.Contains(err.Error(), s) {
						t.Errorf("rank %d: %v\ndoes not say %q", r, err, s)
					}
				}
			}
		})
	}
}

// TestLabelRecordedAndReported: a label attached with comm.WithLabel is in
// the flight recorder's entry and in the error of the call.
func TestLabelRecordedAndReported(t *testing.T) {
	wd, err := local.NewWorld(2, withTimeout(time.Minute))
	if err != nil {
		t.Fatal(err)
	}
	ctx := comm.WithLabel(comm.WithLabel(context.Background(), "step 3"), "unit h.1 reduce-scatter")
	c := wd.Comm(0)
	// A bad call fails before any data moves, on this rank alone.
	err = c.Do(ctx, comm.Call{Op: comm.OpSend, Send: comm.Host([]float32{1}), Peer: 7})
	var ce *comm.Error
	if !errors.As(err, &ce) || ce.Label != "step 3 / unit h.1 reduce-scatter" || !strings.Contains(err.Error(), "send #1 [step 3 / unit h.1 reduce-scatter]") {
		t.Errorf("error %v, want the label", err)
	}
	es := c.Recorder().Entries()
	if len(es) != 1 || es[0].Label != "step 3 / unit h.1 reduce-scatter" {
		t.Errorf("recorder entries %+v, want one with the label", es)
	}
}
