package pp_test

import (
	"fmt"
	"strings"

	"github.com/b7ea7098/loom/parallel/pp"
)

// Example prints the 1F1B schedule for 4 ranks and 8 micro-batches: rows
// are time steps (every compute action one step), columns ranks, a cell
// "sXm" is kind X (F forward, B backward) of micro-batch m on stage s,
// and an empty cell is the rank idle (the bubble).
func Example() {
	s, err := pp.OneFOneB(4, 8)
	if err != nil {
		panic(err)
	}
	fmt.Print(s.Table())
	sim, err := pp.Simulate(s, pp.UnitCosts()) // F=1, B=2
	if err != nil {
		panic(err)
	}
	fmt.Printf("bubble %.3f, activations held at most %v\n", sim.Bubble, sim.PeakActivations)
	// Output:
	//          Rank 0 Rank 1 Rank 2 Rank 3
	// Step 00: 0F0
	// Step 01: 0F1    1F0
	// Step 02: 0F2    1F1    2F0
	// Step 03: 0F3    1F2    2F1    3F0
	// Step 04:                      3B0
	// Step 05:               2B0    3F1
	// Step 06:        1B0    2F2    3B1
	// Step 07: 0B0    1F3    2B1    3F2
	// Step 08: 0F4    1B1    2F3    3B2
	// Step 09: 0B1    1F4    2B2    3F3
	// Step 10: 0F5    1B2    2F4    3B3
	// Step 11: 0B2    1F5    2B3    3F4
	// Step 12: 0F6    1B3    2F5    3B4
	// Step 13: 0B3    1F6    2B4    3F5
	// Step 14: 0F7    1B4    2F6    3B5
	// Step 15: 0B4    1F7    2B5    3F6
	// Step 16:        1B5    2F7    3B6
	// Step 17: 0B5           2B6    3F7
	// Step 18:        1B6           3B7
	// Step 19: 0B6           2B7
	// Step 20:        1B7
	// Step 21: 0B7
	// bubble 0.273, activations held at most [4 3 2 1]
}

// ExampleReadCSV checks a user's own schedule, one CSV row a rank, before
// anything runs (Infer does the same for action lists built in Go): here
// rank 0 waits for stage 1's backward of micro-batch 0 before it sends
// micro-batch 1 forward, which rank 1 needs first.
func ExampleReadCSV() {
	mine := "0F0,0B0,0F1,0B1\n1F0,1F1,1B0,1B1\n"
	_, err := pp.ReadCSV(strings.NewReader(mine), "mine")
	fmt.Println(err)
	// Output:
	// pp: schedule deadlocks: rank 0 position 1: 0B0 waits for 1B0 (rank 1 position 2); rank 1 position 1: 1F1 waits for 0F1 (rank 0 position 2)
}

// ExampleLower inserts the sends and receives of a 2-rank GPipe schedule
// and the FSDP and gradient-reduction actions.
func ExampleLower() {
	s, err := pp.GPipe(2, 2)
	if err != nil {
		panic(err)
	}
	l, err := pp.Lower(s, pp.WithFSDP(), pp.WithReduceGrad())
	if err != nil {
		panic(err)
	}
	for r, acts := range l.Actions {
		fmt.Println("rank", r, acts)
	}
	// Output:
	// rank 0 [0UNSHARD 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1 0REDUCE_GRAD 0RESHARD]
	// rank 1 [1UNSHARD 1RECV_F0 1F0 1RECV_F1 1F1 1B0 1SEND_B0 1B1 1SEND_B1 1REDUCE_GRAD 1RESHARD]
}
