package tinygpt

// LCG is the 32-bit linear congruential generator of reference/TINY_GPT.md §2.1. Its
// state starts at the seed; the zero value is a generator seeded with 0.
type LCG struct {
	s uint32
}

// LCG constants: s ← (LCGMul·s + LCGAdd) mod 2³².
const (
	LCGMul uint32 = 1664525
	LCGAdd uint32 = 1013904223
)

// NewLCG returns a generator whose state is seed.
func NewLCG(seed uint32) *LCG { return &LCG{s: seed} }

// State returns the current state (the last value Next returned, or the seed).
func (g *LCG) State() uint32 { return g.s }

// Next advances the state, s = (1664525·s + 1013904223) mod 2³², and returns
// the new state.
func (g *LCG) Next() uint32 {
	g.s = LCGMul*g.s + LCGAdd // uint32 arithmetic wraps mod 2³²
	return g.s
}

// Randint returns (Next() >> 8) mod m, in [0, m). It consumes exactly one
// draw. It panics unless 1 ≤ m ≤ 2³²−1.
func (g *LCG) Randint(m int) int {
	if m < 1 || uint64(m) > 1<<32-1 {
		panic("tinygpt: Randint modulus out of range [1, 2³²−1]")
	}
	return int((g.Next() >> 8) % uint32(m))
}
