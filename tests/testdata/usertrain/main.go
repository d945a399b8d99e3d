// Command usertrain is a user's program, built by the tests in a module
// of its own (example.com/user, requiring loom through a replace
// directive) from the public API only: a classifier Sequential(Linear,
// ReLU, Dropout, Linear, MoE layer, Linear) trained with train's loop on
// -dp × -fsdp × -ep × -tp ranks. launch.Auto picks the ranks from the
// environment: in-process when run by hand, one per process under
// loomrun (TCP without GPUs). World rank 0 prints one loss per step, in
// full precision, and the job's description on stderr.
package main

import (
	"context"
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/launch"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/moe"
	"github.com/b7ea7098/loom/optim"
	"github.com/b7ea7098/loom/parallel"
	"github.com/b7ea7098/loom/parallel/ddp"
	"github.com/b7ea7098/loom/parallel/fsdp"
	"github.com/b7ea7098/loom/parallel/tp"
	"github.com/b7ea7098/loom/train"
)

const features, hidden, width, experts, ffn, classes = 8, 16, 8, 4, 12, 3

func main() {
	dp := flag.Int("dp", 1, "")
	fsdp := flag.Int("fsdp", 1, "")
	ep := flag.Int("ep", 1, "")
	tp := flag.Int("tp", 1, "")
	steps := flag.Int("steps", 8, "")
	flag.Parse()
	if err := run(*dp, *fsdp, *ep, *tp, *steps); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}

func normal(n int, std float64, seed uint64) []float32 {
	r := rand.New(rand.NewPCG(seed, 0))
	out := make([]float32, n)
	for i := range out {
		out[i] = float32(std * r.NormFloat64())
	}
	return out
}

func model(tape *autograd.Tape, m *mesh.Mesh) (*parallel.Sequential, *moe.SeqLayer, error) {
	l0, err := parallel.NewLinear(tape, m, features, hidden, parallel.WithName("0"), parallel.WithInit(parallel.Normal(0.3, 1)))
	if err != nil {
		return nil, nil, err
	}
	drop, err := parallel.NewDropout(0.2, 5)
	if err != nil {
		return nil, nil, err
	}
	l3, err := parallel.NewLinear(tape, m, hidden, width, parallel.WithName("3"), parallel.WithInit(parallel.Normal(0.3, 2)))
	if err != nil {
		return nil, nil, err
	}
	gate, err := parallel.NewLinear(tape, m, width, experts, parallel.WithName("4.router"), parallel.WithBias(false), parallel.WithInit(parallel.Normal(0.5, 3)))
	if err != nil {
		return nil, nil, err
	}
	router, err := moe.NewRouter(gate.Weight, moe.RouterConfig{K: 2, Renormalize: true, AuxCoef: 0.01, ZCoef: 0.001})
	if err != nil {
		return nil, nil, err
	}
	ex, err := moe.ShardExperts(tape, m, "ep", experts, ffn, width, normal(experts*ffn*width, 0.3, 4), make([]float32, experts*ffn),
		normal(experts*width*ffn, 0.3, 5), make([]float32, experts*width), moe.WithPrefix("4"))
	if err != nil {
		return nil, nil, err
	}
	mo := &moe.SeqLayer{Layer: &moe.Layer{Router: router, Experts: ex}}
	l5, err := parallel.NewLinear(tape, m, width, classes, parallel.WithName("5"), parallel.WithInit(parallel.Normal(0.3, 6)))
	if err != nil {
		return nil, nil, err
	}
	seq, err := parallel.NewSequential(l0, parallel.NewReLU(), drop, l3, mo, l5)
	return seq, mo, err
}

func run(ndp, nfsdp, nep, ntp, steps int) error {
	// In-process ranks when run by hand, one rank per process under
	// loomrun, torchrun or mpirun.
	job, err := launch.Auto(ndp * nfsdp * nep * ntp)
	if err != nil {
		return err
	}
	if job.Root() {
		fmt.Fprintln(os.Stderr, job)
	}
	x, y, err := train.Blobs(512, features, classes, 11)
	if err != nil {
		return err
	}
	return job.Run(context.Background(), func(ctx context.Context, c comm.Communicator) error {
		m, err := mesh.New(c, []int{ndp, nfsdp, nep, ntp}, []string{"dp", "fsdp", "ep", "tp"})
		if err != nil {
			return err
		}
		tape := autograd.NewTape()
		seq, mo, err := model(tape, m)
		if err != nil {
			return err
		}
		plan := tp.Plan{{Pattern: "0", Style: tp.ColwiseParallel{}}, {Pattern: "3", Style: tp.RowwiseParallel{}}}
		if err := tp.Parallelize(ctx, seq, "tp", plan); err != nil {
			return err
		}
		var opts []train.Option
		if nfsdp > 1 {
			f, err := fsdp.FullyShard(ctx, seq, []string{"0", "3", "4"})
			if err != nil {
				return err
			}
			opts = append(opts, train.WithReducer(f))
		}
		params, err := parallel.Params(seq)
		if err != nil {
			return err
		}
		if ndp > 1 {
			d, err := ddp.New(ctx, params)
			if err != nil {
				return err
			}
			opts = append(opts, train.WithReducer(d))
		}
		opts = append(opts, train.WithReducer(train.SyncGrads(params)), train.WithClip(1))
		opt, err := optim.NewAdamW(params, optim.WithLR(1e-2))
		if err != nil {
			return err
		}
		data := &train.InMemory{X: x, Features: features, Y: y, Tape: tape, Mesh: m, Axes: []string{"dp", "fsdp", "ep"}}
		s, err := data.Sampler(32, train.WithShuffle(2))
		if err != nil {
			return err
		}
		loss := func(ctx context.Context, b train.Classification) (*autograd.Value, error) {
			logits, err := seq.Forward(ctx, b.X)
			if err != nil {
				return nil, err
			}
			ce, err := autograd.CrossEntropy(logits, b.Y)
			if err != nil {
				return nil, err
			}
			return mo.AddLosses(ce)
		}
		tr, err := train.NewTrainer(seq, tape, opt, loss, opts...)
		if err != nil {
			return err
		}
		h, err := tr.Fit(ctx, data, s, steps)
		if err != nil {
			return err
		}
		if c.Rank() == 0 {
			for _, r := range h.Steps {
				fmt.Println(strconv.FormatFloat(r.Loss, 'g', -1, 64))
			}
		}
		return nil
	})
}
