// Package randtok draws the random-token batches the models train on when
// throughput, not learning, is measured: a model of any vocabulary and
// sequence length needs no corpus.
package randtok

import (
	"fmt"
	"math/rand/v2"

	"github.com/b7ea7098/loom/reference/tinygpt"
)

// Sampler draws step after step of random global batches: B rows of T+1
// token ids, each uniform in [0, V), the inputs the first T and the
// targets the last T (so the targets are the inputs shifted by one, as in
// a corpus). Step s's batch depends only on the seed and s, so every rank
// draws the same global batch and keeps its own rows, and any layout
// trains on the batches one rank would.
type Sampler struct {
	seed    uint64
	b, t, v int
	step    int
}

// New returns a sampler of b×t batches over a vocabulary of v tokens,
// drawing step 1 next; b, t and v must be at least 1 (the models check
// them before).
func New(seed uint64, b, t, v int) *Sampler { return &Sampler{seed: seed, b: b, t: t, v: v} }

// Next draws the next step's batch; its Offsets are nil (there is no
// corpus).
func (s *Sampler) Next() tinygpt.Batch {
	s.step++
	// One stream per step, keyed like parallel.Normal's PCG but on the
	// step, so that a step's batch does not depend on the ones before.
	rng := rand.New(rand.NewPCG(s.seed, uint64(s.step)))
	x := make([]int64, s.b*s.t)
	y := make([]int64, s.b*s.t)
	row := make([]int64, s.t+1)
	for r := range s.b {
		for i := range row {
			row[i] = int64(rng.IntN(s.v))
		}
		copy(x[r*s.t:], row[:s.t])
		copy(y[r*s.t:], row[1:])
	}
	return tinygpt.Batch{Step: s.step, B: s.b, T: s.t, X: x, Y: y}
}

// Step is the number of batches drawn (or sought to).
func (s *Sampler) Step() int { return s.step }

// Seek makes Next draw step+1's batch next: a step's batch depends only
// on the seed and the step, so nothing is replayed. A negative step is an
// error.
func (s *Sampler) Seek(step int) error {
	if step < 0 {
		return fmt.Errorf("randtok: seek to step %d", step)
	}
	s.step = step
	return nil
}
