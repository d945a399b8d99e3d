package trace_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/local"
	"github.com/b7ea7098/loom/trace"
)

// Two ranks start an all-reduce, compute while it runs, then wait for it.
// The timeline shows each rank's compute span, the all-reduce on the
// group's comm row, and measures how much of the all-reduce was hidden;
// WriteChromeFile(path) would save it for Perfetto.
func Example() {
	tl := trace.NewTimeline()
	err := local.Run(context.Background(), 2, func(ctx context.Context, world comm.Communicator) error {
		rank := world.Rank()
		c := trace.Comm(world, tl, rank) // wrap before building a mesh on it
		grads := comm.Host(make([]float32, 1<<16))
		w, err := comm.AllReduceAsync(ctx, c, grads, grads, comm.Sum)
		if err != nil {
			return err
		}
		span := tl.Begin(rank, "backward")
		time.Sleep(5 * time.Millisecond) // stands for compute
		span.End()
		return w.Wait(ctx)
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	for _, e := range tl.Events() {
		if e.Rank == 0 && e.Lane != trace.LaneWait { // a wait shows only if the Wait blocked
			fmt.Println(e.Lane, e.Name, e.Group, e.Bytes, e.Seq)
		}
	}
	st := tl.Overlap(0, trace.Window{}, nil)
	fmt.Println("measured:", st.Comm > 0, st.Hidden <= st.Comm)
	var buf bytes.Buffer
	if err := tl.WriteChrome(&buf); err != nil {
		fmt.Println(err)
	}
	fmt.Println("valid JSON:", json.Valid(buf.Bytes()))
	// Unordered output:
	// compute backward  0 0
	// comm allreduce [0,1] 262144 1
	// measured: true true
	// valid JSON: true
}
