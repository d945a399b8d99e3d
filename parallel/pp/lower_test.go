package pp

import (
	"errors"
	"strings"
	"testing"
)

// TestLowerHandWritten compares lowered lists with hand-written ones.
func TestLowerHandWritten(t *testing.T) {
	cases := []struct {
		what string
		s    func() (*Schedule, error)
		opts []LowerOption
		want []string
	}{
		{"1f1b pp=2 M=2", func() (*Schedule, error) { return OneFOneB(2, 2) }, nil, []string{
			"0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
			"1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1",
		}},
		{"1f1b pp=2 M=2 with FSDP and reduction", func() (*Schedule, error) { return OneFOneB(2, 2) },
			[]LowerOption{WithFSDP(), WithReduceGrad()}, []string{
				"0UNSHARD 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1 0REDUCE_GRAD 0RESHARD",
				"1UNSHARD 1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1 1REDUCE_GRAD 1RESHARD",
			}},
		// Each stage's UNSHARD comes one compute action before its
		// first, so the all-gather of stage 2 can overlap 0F1.
		{"interleaved pp=2 M=2 with FSDP", func() (*Schedule, error) { return Interleaved1F1B(2, 2, 2) }, []LowerOption{WithFSDP()}, []string{
			"0UNSHARD 0F0 0SEND_F0 2UNSHARD 0F1 0SEND_F1 2RECV_F0 2F0 2SEND_F0 2RECV_F1 2F1 2SEND_F1 " +
				"2RECV_B0 2B0 2SEND_B0 2RECV_B1 2B1 2SEND_B1 2RESHARD 0RECV_B0 0B0 0RECV_B1 0B1 0RESHARD",
			"1UNSHARD 1RECV_F0 1F0 1SEND_F0 3UNSHARD 1RECV_F1 1F1 1SEND_F1 3RECV_F0 3F0 3B0 3SEND_B0 3RECV_F1 3F1 3B1 3SEND_B1 3RESHARD " +
				"1RECV_B0 1B0 1SEND_B0 1RECV_B1 1B1 1SEND_B1 1RESHARD",
		}},
		// The V's turn (stages 1 and 2) is on rank 1 and its ends
		// (stages 0 and 3) on rank 0: those pass by memory, without
		// sends; the reduction follows each stage's last W.
		{"zbv pp=2 M=3 with reduction", func() (*Schedule, error) { return ZBV(2, 3) }, []LowerOption{WithReduceGrad()}, []string{
			"0F0 0SEND_F0 0F1 0SEND_F1 0F2 0SEND_F2 3RECV_F0 3F0 3I0 3SEND_B0 3W0 3RECV_F1 3F1 3I1 3SEND_B1 3W1 " +
				"0RECV_B0 0I0 0W0 3RECV_F2 3F2 3I2 3SEND_B2 3W2 3REDUCE_GRAD 0RECV_B1 0I1 0W1 0RECV_B2 0I2 0W2 0REDUCE_GRAD",
			"1RECV_F0 1F0 2F0 2SEND_F0 1RECV_F1 1F1 2F1 2SEND_F1 2RECV_B0 2I0 2W0 1RECV_F2 1F2 1I0 1SEND_B0 1W0 " +
				"2F2 2SEND_F2 2RECV_B1 2I1 2W1 1I1 1SEND_B1 2RECV_B2 2I2 1I2 1SEND_B2 1W1 2W2 2REDUCE_GRAD 1W2 1REDUCE_GRAD",
		}},
	}
	for _, c := range cases {
		s, err := c.s()
		if err != nil {
			t.Fatal(err)
		}
		l, err := Lower(s, c.opts...)
		if err != nil {
			t.Fatalf("%s: %v", c.what, err)
		}
		if got, want := lists(l), strings.Join(c.want, "\n"); got != want {
			t.Errorf("%s:\ngot\n%s\nwant\n%s", c.what, got, want)
		}
		if !l.Lowered() || s.Lowered() {
			t.Errorf("%s: Lowered() %v for the result, %v for the input", c.what, l.Lowered(), s.Lowered())
		}
		for _, acts := range l.Actions {
			for _, a := range acts {
				if a.Kind.Comm() && l.RankOf(a.Peer) == l.RankOf(a.Stage) {
					t.Errorf("%s: %v sends within rank %d", c.what, a, l.RankOf(a.Stage))
				}
			}
		}
	}
}

// TestLowerCounts: a lowered schedule holds one send and one receive per
// micro-batch for each stage boundary that crosses ranks, in each
// direction, and none for boundaries within a rank; it keeps the compute
// order and simulates to the same makespan with a transfer cost.
func TestLowerCounts(t *testing.T) {
	for _, name := range []string{"gpipe", "1f1b", "interleaved", "zb1", "zbv"} {
		for pp := 1; pp <= 4; pp++ {
			s, err := Build(name, pp, 2*pp, 0)
			if err != nil {
				t.Fatal(err)
			}
			l, err := Lower(s)
			if err != nil {
				t.Fatal(err)
			}
			crossing := 0
			for st := 0; st+1 < s.Stages(); st++ {
				if s.RankOf(st) != s.RankOf(st+1) {
					crossing++
				}
			}
			count := map[Kind]int{}
			for _, acts := range l.Actions {
				for _, a := range acts {
					count[a.Kind]++
				}
			}
			for _, k := range []Kind{SendF, RecvF, SendB, RecvB} {
				if want := crossing * s.MicroBatches; count[k] != want {
					t.Errorf("%s pp=%d: %d %v, want %d", name, pp, count[k], k, want)
				}
			}
			// The compute actions keep their order, and the explicit
			// transfers time out as the implicit ones do.
			for r := range l.Actions {
				var compute []Action
				for _, a := range l.Actions[r] {
					if a.Kind.Compute() {
						compute = append(compute, a)
					}
				}
				if len(compute) != len(s.Actions[r]) {
					t.Fatalf("%s pp=%d rank %d: %d compute actions, want %d", name, pp, r, len(compute), len(s.Actions[r]))
				}
				for i := range compute {
					if compute[i] != s.Actions[r][i] {
						t.Errorf("%s pp=%d rank %d: compute action %d is %v, want %v", name, pp, r, i, compute[i], s.Actions[r][i])
						break
					}
				}
			}
			c := Costs{F: 1, B: 2, I: 1, W: 1, Comm: 0.25}
			a, err := Simulate(s, c)
			if err != nil {
				t.Fatal(err)
			}
			b, err := Simulate(l, c)
			if err != nil {
				t.Fatal(err)
			}
			if a.Makespan != b.Makespan {
				t.Errorf("%s pp=%d: lowered makespan %v, compute-only %v", name, pp, b.Makespan, a.Makespan)
			}
		}
	}
}

// TestLowerRejects: Lower takes valid compute-only schedules only.
func TestLowerRejects(t *testing.T) {
	s, _ := OneFOneB(2, 2)
	l, err := Lower(s)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := Lower(l); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "already holds communication") {
		t.Errorf("lowering twice: %v", err)
	}
	bad := *s
	bad.Actions = [][]Action{s.Actions[0], s.Actions[1][:3]}
	if _, err := Lower(&bad); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "no backward") {
		t.Errorf("invalid input: %v", err)
	}
}
