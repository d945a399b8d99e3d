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
			if m%pp != 0 {
				continue
			}
			for v := 2; v <= 4; v++ {
				s, err := Interleaved1F1B(pp, m, v)
				if err != nil {
					t.Fatal(err)
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
		for m := pp; m <= 3*pp; m++ {
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
			if m >= ZBVMinMicroBatches(pp) {
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
			}
			sim, err := Simulate(o, UnitCosts())
			if err != nil {
				t.Fatal(err)
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
	for _, c := range []Costs{{F: -1, B: 2}, {F: 1, B: math.NaN()}, {F: 1, B: 1, Comm: math.Inf(1)}} {
		if _, err := Simulate(s, c); !errors.Is(err, ErrInvalid) {
			t.Errorf("costs %+v: %v, want ErrInvalid", c, err)
		}
	}
}
