package pp

import (
	"errors"
	"math"
	"testing"
)

// TestBubbleFormulas: the simulated bubble with balanced stages equals
// the schedules' formulas: (pp−1)/(M+pp−1) for GPipe and 1F1B,
// (pp−1)/(V·M+pp−1) for interleaved 1F1B, (pp−1)/(3M+pp−1) for ZB-H1
// and (pp−1)/(6M+pp−1) for ZB-V with F=I=W=1.
func TestBubbleFormulas(t *testing.T) {
	for pp := 1; pp <= 6; pp++ {
		for m := pp; m <= 3*pp; m++ {
			want := float64(pp-1) / float64(m+pp-1)
			for _, name := range []string{"gpipe", "1f1b"} {
				s, err := Build(name, pp, m, 0)
				if err != nil {
					t.Fatal(err)
				}
				for _, c := range []Costs{UnitCosts(), {F: 1, B: 1}} {
					got, err := s.Bubble(c)
					if err != nil {
						t.Fatal(err)
					}
					if math.Abs(got-want) > 1e-12 {
						t.Errorf("%s pp=%d M=%d costs %+v: bubble %.4f, want (pp−1)/(M+pp−1) = %.4f", name, pp, m, c, got, want)
					}
				}
			}
			s, err := ZBH1(pp, m)
			if err != nil {
				t.Fatal(err)
			}
			got, err := s.Bubble(UnitCosts())
			if err != nil {
				t.Fatal(err)
			}
			if want := float64(pp-1) / float64(3*m+pp-1); math.Abs(got-want) > 1e-12 {
				t.Errorf("zb1 pp=%d M=%d: bubble %.4f, want (pp−1)/(3M+pp−1) = %.4f", pp, m, got, want)
			}
			if m >= ZBVMinMicroBatches(pp) {
				s, err := ZBV(pp, m)
				if err != nil {
					t.Fatal(err)
				}
				got, err := s.Bubble(UnitCosts())
				if err != nil {
					t.Fatal(err)
				}
				if want := float64(pp-1) / float64(6*m+pp-1); math.Abs(got-want) > 1e-12 {
					t.Errorf("zbv pp=%d M=%d: bubble %.4f, want (pp−1)/(6M+pp−1) = %.4f", pp, m, got, want)
				}
			}
			for v := 2; v <= 4; v++ {
				s, err := Interleaved1F1B(pp, m, v)
				if err != nil {
					if m%pp == 0 {
						t.Fatal(err)
					}
					continue
				}
				got, err := s.Bubble(UnitCosts())
				if err != nil {
					t.Fatal(err)
				}
				if want := float64(pp-1) / float64(v*m+pp-1); math.Abs(got-want) > 1e-12 {
					t.Errorf("interleaved pp=%d M=%d V=%d: bubble %.4f, want (pp−1)/(V·M+pp−1) = %.4f", pp, m, v, got, want)
				}
			}
		}
	}
}

// TestBubbleOrder: at pp=4 the theoretical bubbles fall in the order the
// issue expects: 1F1B, interleaved, ZB-H1, ZBV.
func TestBubbleOrder(t *testing.T) {
	for _, m := range []int{8, 16, 32} {
		var prev float64 = 1
		for _, name := range []string{"1f1b", "interleaved", "zb1", "zbv"} {
			s, err := Build(name, 4, m, 0)
			if err != nil {
				t.Fatal(err)
			}
			b, err := s.Bubble(UnitCosts())
			if err != nil {
				t.Fatal(err)
			}
			if !(b < prev) {
				t.Errorf("M=%d: %s bubble %.4f not below the previous schedule's %.4f", m, name, b, prev)
			}
			prev = b
		}
	}
}

// TestPeakActivations: 1F1B's stage r holds at most pp−r micro-batches
// (never more than pp), GPipe's every stage holds all M, ZB-H1's at most
// pp, ZB-V's stage s at most 2pp−s.
func TestPeakActivations(t *testing.T) {
	for pp := 1; pp <= 5; pp++ {
		for m := 1; m <= 3*pp; m++ {
			v, _ := ZBV(pp, m)
			vp, err := v.PeakActivations()
			if err != nil {
				t.Fatal(err)
			}
			for st := range 2 * pp {
				if want := min(2*pp-st, m); vp[st] != want {
					t.Errorf("zbv pp=%d M=%d stage %d: peak %d, want min(2pp−stage, M) = %d", pp, m, st, vp[st], want)
				}
			}
			if m < pp {
				continue
			}
			g, _ := GPipe(pp, m)
			o, _ := OneFOneB(pp, m)
			z, _ := ZBH1(pp, m)
			gp, err := g.PeakActivations()
			if err != nil {
				t.Fatal(err)
			}
			op, _ := o.PeakActivations()
			zp, _ := z.PeakActivations()
			for st := range pp {
				if gp[st] != m {
					t.Errorf("gpipe pp=%d M=%d stage %d: peak %d, want M", pp, m, st, gp[st])
				}
				if op[st] != pp-st {
					t.Errorf("1f1b pp=%d M=%d stage %d: peak %d, want pp−stage = %d", pp, m, st, op[st], pp-st)
				}
				if zp[st] > pp {
					t.Errorf("zb1 pp=%d M=%d stage %d: peak %d > pp", pp, m, st, zp[st])
				}
			}
			sim, err := Simulate(o, UnitCosts())
			if err != nil {
				t.Fatal(err)
			}
			if sim.RankPeakActivations[0] != pp {
				t.Errorf("1f1b pp=%d M=%d: rank 0 holds %d, want pp", pp, m, sim.RankPeakActivations[0])
			}
			for st := range pp {
				if sim.PeakActivations[st] != op[st] {
					t.Errorf("1f1b pp=%d M=%d: simulation peak %v, method %v", pp, m, sim.PeakActivations, op)
				}
			}
		}
	}
}

// TestSimulateTimes: the simulation's times for GPipe with a transfer
// cost: the makespan is (M+pp−1)(F+B) plus one transfer per hop each way.
func TestSimulateTimes(t *testing.T) {
	s, _ := GPipe(3, 2)
	sim, err := Simulate(s, Costs{F: 1, B: 2, Comm: 0.5})
	if err != nil {
		t.Fatal(err)
	}
	if want := 4*3 + 2*2*0.5; sim.Makespan != want {
		t.Errorf("makespan %v, want %v", sim.Makespan, want)
	}
	// Rank 1's first forward waits for rank 0's (ends at 1) and the
	// transfer.
	if sim.Start[1][0] != 1.5 || sim.End[1][0] != 2.5 {
		t.Errorf("rank 1's 1F0 runs [%v, %v], want [1.5, 2.5]", sim.Start[1][0], sim.End[1][0])
	}
	for r, b := range sim.Busy {
		if b != 6 {
			t.Errorf("rank %d busy %v, want 6", r, b)
		}
	}
	lowered, err := Lower(s)
	if err != nil {
		t.Fatal(err)
	}
	lsim, err := Simulate(lowered, Costs{F: 1, B: 2, Comm: 0.5})
	if err != nil {
		t.Fatal(err)
	}
	if lsim.Makespan != sim.Makespan || lsim.Bubble != sim.Bubble {
		t.Errorf("lowered: makespan %v bubble %v, compute-only %v %v", lsim.Makespan, lsim.Bubble, sim.Makespan, sim.Bubble)
	}
	for _, c := range []Costs{{F: -1, B: 2}, {F: 1, B: math.NaN()}, {F: 1, B: 1, Comm: math.Inf(1)},
		{F: 1, B: 2, Stage: []float64{1, 1}}, {F: 1, B: 2, Stage: []float64{1, -1, 1}}} {
		if _, err := Simulate(s, c); !errors.Is(err, ErrInvalid) {
			t.Errorf("costs %+v: %v, want ErrInvalid", c, err)
		}
	}
}

// TestRankPeakActivations: a rank's peak over all its stages, against
// numbers worked out from the lists by hand.
func TestRankPeakActivations(t *testing.T) {
	cases := []struct {
		name     string
		pp, m, v int
		want     []int
	}{
		// Rank 0 runs 0F0 0F1 2F0 2F1 0F2 before its first backward.
		{"interleaved", 2, 4, 2, []int{5, 3}},
		// Rank 0 runs all three forwards of stage 0 and two of stage 3
		// before 3W0 frees one: 0F0 0F1 0F2 3F0 (3I0 3W0) 3F1 …
		{"zbv", 2, 3, 0, []int{4, 4}},
		{"gpipe", 3, 5, 0, []int{5, 5, 5}},
	}
	for _, c := range cases {
		s, err := Build(c.name, c.pp, c.m, c.v)
		if err != nil {
			t.Fatal(err)
		}
		sim, err := Simulate(s, UnitCosts())
		if err != nil {
			t.Fatal(err)
		}
		for r, w := range c.want {
			if sim.RankPeakActivations[r] != w {
				t.Errorf("%s pp=%d M=%d: rank peaks %v, want %v", c.name, c.pp, c.m, sim.RankPeakActivations, c.want)
				break
			}
		}
	}
}

// TestSimulateUnbalanced: per-stage cost factors, against times worked
// out by hand for 1F1B on 2 ranks whose second stage is twice as slow:
// rank 1 runs 1F0 [1,3] 1B0 [3,7] 1F1 [7,9] 1B1 [9,13], rank 0 0F0 [0,1]
// 0F1 [1,2] 0B0 [7,9] 0B1 [13,15].
func TestSimulateUnbalanced(t *testing.T) {
	s, _ := OneFOneB(2, 2)
	sim, err := Simulate(s, Costs{F: 1, B: 2, Stage: []float64{1, 2}})
	if err != nil {
		t.Fatal(err)
	}
	if sim.Makespan != 15 || sim.Busy[0] != 6 || sim.Busy[1] != 12 || math.Abs(sim.Bubble-0.4) > 1e-12 {
		t.Errorf("makespan %v busy %v bubble %v, want 15 [6 12] 0.4", sim.Makespan, sim.Busy, sim.Bubble)
	}
	if sim.Start[0][3] != 13 {
		t.Errorf("0B1 starts at %v, want 13", sim.Start[0][3])
	}
}

// TestSimulateUnshard: a stage's compute starts no earlier than
// Costs.Unshard after its UNSHARD. In GPipe(3, 2) lowered with FSDP, rank
// 0's first forward waits for its all-gather, which delays every rank
// by it (rank 1's, started at the step's start too, is over by then).
func TestSimulateUnshard(t *testing.T) {
	s, _ := GPipe(3, 2)
	low, err := Lower(s, WithFSDP())
	if err != nil {
		t.Fatal(err)
	}
	base, err := Simulate(low, Costs{F: 1, B: 2})
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct{ unshard, want float64 }{{0.5, base.Makespan + 0.5}, {2.5, base.Makespan + 2.5}} {
		sim, err := Simulate(low, Costs{F: 1, B: 2, Unshard: c.unshard})
		if err != nil {
			t.Fatal(err)
		}
		if sim.Makespan != c.want {
			t.Errorf("Unshard %v: makespan %v, want %v", c.unshard, sim.Makespan, c.want)
		}
		// Rank 0's first compute (after its UNSHARD at position 0).
		if sim.Start[0][1] != c.unshard {
			t.Errorf("Unshard %v: rank 0's %v starts at %v", c.unshard, low.Actions[0][1], sim.Start[0][1])
		}
	}
	if _, err := Simulate(low, Costs{F: 1, B: 2, Unshard: -1}); !errors.Is(err, ErrInvalid) {
		t.Errorf("a negative Unshard cost: %v, want ErrInvalid", err)
	}
}
