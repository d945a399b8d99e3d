package moe_test

import (
	"context"
	"fmt"
	"log"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/local"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/moe"
	"github.com/b7ea7098/loom/placement"
)

// wave returns n deterministic values in [-0.5, 0.5) (a stand-in for an
// initialiser, so that the example's output is reproducible).
func wave(n, seed int) []float32 {
	out := make([]float32, n)
	for i := range out {
		out[i] = float32((i*7+seed*13)%17)/17 - 0.5
	}
	return out
}

// A mixture-of-experts layer on two expert-parallel ranks: 8 tokens of
// width 4, sharded over "ep" (4 per rank), routed top-2 among 4 experts
// (2 per rank). Forward routes each token, dispatches its two copies to
// the ranks owning their experts, runs the experts and combines the
// results; the output has the tokens' layout. Rank 0 prints the layer's
// sizes, the tokens each expert received and a checksum of the output.
func ExampleLayer() {
	const n, d, e, hd = 8, 4, 4, 3
	err := local.Run(context.Background(), 2, func(ctx context.Context, c comm.Communicator) error {
		m, err := mesh.New(c, []int{2}, []string{"ep"})
		if err != nil {
			return err
		}
		tape := autograd.NewTape()
		// This rank's 4 tokens: the rows [4·rank, 4·rank+4) of x [8, 4].
		xs, err := placement.NewSpec(m, []int{n, d}, comm.Float32, []placement.Placement{placement.Shard(0)})
		if err != nil {
			return err
		}
		xd, err := placement.NewLocal(xs, wave(n*d, 1)[m.Rank()*n/2*d:][:n/2*d])
		if err != nil {
			return err
		}
		x, err := tape.Constant(xd)
		if err != nil {
			return err
		}
		// The router weight [E, D], replicated.
		ws, err := placement.NewSpec(m, []int{e, d}, comm.Float32, []placement.Placement{placement.Replicate()})
		if err != nil {
			return err
		}
		wd, err := placement.NewLocal(ws, wave(e*d, 2))
		if err != nil {
			return err
		}
		wr, err := tape.Param("router", wd)
		if err != nil {
			return err
		}
		router, err := moe.NewRouter(wr, moe.RouterConfig{K: 2, Renormalize: true})
		if err != nil {
			return err
		}
		// Every rank holds the full expert weights; ShardExperts keeps its
		// own experts' slices.
		experts, err := moe.ShardExperts(tape, m, "ep", e, hd, d, wave(e*hd*d, 3), wave(e*hd, 4), wave(e*d*hd, 5), wave(e*d, 6))
		if err != nil {
			return err
		}
		layer := &moe.Layer{Router: router, Experts: experts}
		out, err := layer.Forward(ctx, x)
		if err != nil {
			return err
		}
		// A checksum of the whole output: each rank sums its tokens, and
		// the Partial(sum) scalar is all-reduced.
		sum, err := autograd.Sum(out.Y)
		if err != nil {
			return err
		}
		rs, err := placement.NewSpec(m, nil, comm.Float32, []placement.Placement{placement.Replicate()})
		if err != nil {
			return err
		}
		total, err := placement.Redistribute(ctx, sum.Data(), rs)
		if err != nil {
			return err
		}
		if m.Rank() == 0 {
			experts, hidden, width := layer.Experts.Sizes()
			fmt.Printf("%d experts of hidden width %d and width %d over axis %q\n", experts, hidden, width, layer.Experts.Axis())
			fmt.Println("output:", out.Y.Spec())
			fmt.Println("tokens per expert:", out.Handle.Stats().TokensPerExpert)
			fmt.Printf("sum of the output: %.4f\n", total.LocalData().([]float32)[0])
		}
		return nil
	})
	if err != nil {
		log.Fatal(err)
	}
	// Output:
	// 4 experts of hidden width 3 and width 4 over axis "ep"
	// output: [8 4] float32 on (ep=2): [S(0)]
	// tokens per expert: [3 5 5 3]
	// sum of the output: -0.4382
}
