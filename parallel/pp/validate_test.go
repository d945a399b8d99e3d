package pp

import (
	"errors"
	"strings"
	"testing"

	"github.com/b7ea7098/loom"
)

// parseLists parses one line of actions per rank.
func parseLists(t *testing.T, lines ...string) [][]Action {
	t.Helper()
	out := make([][]Action, len(lines))
	for r, l := range lines {
		out[r] = []Action{}
		for _, f := range strings.Fields(l) {
			a, err := ParseAction(f)
			if err != nil {
				t.Fatal(err)
			}
			out[r] = append(out[r], a)
		}
	}
	return out
}

// TestValidateRejects: broken user schedules are refused by Infer (and
// so by ReadCSV) before anything runs, with an error naming the rank,
// the position and the action.
func TestValidateRejects(t *testing.T) {
	cases := []struct {
		what     string
		lines    []string
		deadlock bool
		want     []string
	}{
		{"send without receive", []string{
			"0F0 0SEND_F0 0RECV_B0 0B0",
			"1F0 1B0 1SEND_B0",
		}, false, []string{"rank 0 position 1: 0SEND_F0: no matching 1RECV_F0 on rank 1"}},
		{"receive without send", []string{
			"0F0 0RECV_B0 0B0",
			"1RECV_F0 1F0 1B0 1SEND_B0",
		}, false, []string{"rank 1 position 0: 1RECV_F0: no matching 0SEND_F0 on rank 0"}},
		{"backward before forward", []string{
			"0B0 0F0",
			"1F0 1B0",
		}, false, []string{"rank 0 position 0: 0B0: backward before its forward 0F0 (position 1)"}},
		{"I before forward", []string{
			"0F0 0I1 0F1 0W1 0B0",
			"1F0 1F1 1B0 1B1",
		}, false, []string{"rank 0 position 1: 0I1: backward before its forward 0F1 (position 2)"}},
		{"W before I", []string{
			"0F0 0W0 0I0",
			"1F0 1B0",
		}, false, []string{"rank 0 position 1: 0W0: before its backward for inputs 0I0 (position 2)"}},
		{"missing W", []string{
			"0F0 0F1 0I0 0W0 0I1",
			"1F0 1F1 1B0 1B1",
		}, false, []string{"rank 0 position 4: 0I1: no 0W1 follows"}},
		{"W without I", []string{
			"0F0 0B0 0W0",
			"1F0 1B0",
		}, false, []string{"rank 0 position 1: 0B0", "also split (0W0 at position 2)"}},
		{"missing backward", []string{
			"0F0 0F1 0B0",
			"1F0 1F1 1B0 1B1",
		}, false, []string{"rank 0 position 1: 0F1: stage 0 micro-batch 1 has no backward"}},
		{"missing forward", []string{
			"0F0 0B0 0B1",
			"1F0 1F1 1B0 1B1",
		}, false, []string{"stage 0 micro-batch 1 has no forward 0F1"}},
		{"stage on the wrong rank", []string{
			"0F0 0B0 1F0",
			"1B0",
		}, false, []string{"rank 0 position 2: 1F0: stage 1 is on rank 1"}},
		{"repeated action", []string{
			"0F0 0F0 0B0",
			"1F0 1B0",
		}, false, []string{"rank 0 position 1: 0F0: repeats the action of rank 0 position 0"}},
		{"send to the same rank", []string{
			"0F0 0SEND_F0 1F0 1B0 0B0",
		}, false, []string{"rank 0 position 1: 0SEND_F0: stage 1 is on the same rank"}},
		{"receive after its forward", []string{
			"0F0 0SEND_F0 0RECV_B0 0B0",
			"1F0 1RECV_F0 1B0 1SEND_B0",
		}, false, []string{"rank 1 position 0: 1F0: its receive 1RECV_F0 comes after it (position 1)"}},
		{"send before its data", []string{
			"0SEND_F0 0F0 0RECV_B0 0B0",
			"1RECV_F0 1F0 1B0 1SEND_B0",
		}, false, []string{"rank 0 position 0: 0SEND_F0: sends before the data exists (0F0 at position 1)"}},
		{"lowered without a send", []string{
			"0F0 0RECV_B0 0B0",
			"1F0 1B0 1SEND_B0",
		}, false, []string{"rank 0 position 0: 0F0: stage 1 is on rank 1 and no 0SEND_F0 carries the data"}},
		{"compute before unshard", []string{
			"0F0 0UNSHARD 0B0 0RESHARD",
		}, false, []string{"rank 0 position 0: 0F0: runs before its stage's 0UNSHARD (position 1)"}},
		{"unshard without reshard", []string{
			"0UNSHARD 0F0 0B0",
		}, false, []string{"rank 0 position 0: 0UNSHARD: UNSHARD and RESHARD of a stage come in pairs"}},
		{"compute after reshard", []string{
			"0UNSHARD 0F0 0RESHARD 0B0",
		}, false, []string{"rank 0 position 3: 0B0: runs after its stage's 0RESHARD (position 2)"}},
		{"backward after reduce", []string{
			"0F0 0F1 0B0 0REDUCE_GRAD 0B1",
		}, false, []string{"rank 0 position 4: 0B1: runs after its stage's 0REDUCE_GRAD (position 3)"}},
		// Rank 0 waits for 1B0 before it runs 0F1, which rank 1 needs
		// before it runs 1B0: a cycle across ranks.
		{"cycle across ranks", []string{
			"0F0 0B0 0F1 0B1",
			"1F0 1F1 1B0 1B1",
		}, true, []string{
			"rank 0 position 1: 0B0 waits for 1B0 (rank 1 position 2)",
			"rank 1 position 1: 1F1 waits for 0F1 (rank 0 position 2)",
		}},
		{"cycle across ranks, lowered", []string{
			"0F0 0SEND_F0 0RECV_B0 0B0 0F1 0SEND_F1 0RECV_B1 0B1",
			"1RECV_F0 1F0 1RECV_F1 1F1 1B0 1SEND_B0 1B1 1SEND_B1",
		}, true, []string{
			"rank 0 position 2: 0RECV_B0 waits for 1SEND_B0 (rank 1 position 5)",
			"rank 1 position 2: 1RECV_F1 waits for 0SEND_F1 (rank 0 position 5)",
		}},
		{"waits on itself", []string{
			"1F0 0F0 0B0 1B0",
		}, true, []string{"rank 0 position 0: 1F0 waits for 0F0 (rank 0 position 1)"}},
	}
	for _, c := range cases {
		_, err := Infer("custom", parseLists(t, c.lines...))
		if err == nil {
			t.Errorf("%s: accepted", c.what)
			continue
		}
		if !errors.Is(err, ErrInvalid) || !errors.Is(err, loom.ErrInvalid) {
			t.Errorf("%s: %v is not ErrInvalid", c.what, err)
		}
		if got := errors.Is(err, ErrDeadlock); got != c.deadlock {
			t.Errorf("%s: ErrDeadlock %v, want %v: %v", c.what, got, c.deadlock, err)
		}
		for _, w := range c.want {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("%s: %q does not say %q", c.what, err, w)
			}
		}
		if strings.Count(err.Error(), "pp:") != 1 {
			t.Errorf("%s: %q: want the prefix once", c.what, err)
		}
	}
}

// TestValidateFields: a schedule whose fields disagree with its lists is
// refused.
func TestValidateFields(t *testing.T) {
	good, err := OneFOneB(2, 2)
	if err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		what string
		edit func(s *Schedule)
		want string
	}{
		{"too few lists", func(s *Schedule) { s.Actions = s.Actions[:1] }, "1 action lists for 2 ranks"},
		{"micro-batch out of range", func(s *Schedule) { s.MicroBatches = 1 }, "rank 0 position 1: 0F1: micro-batch 1 out of range [0, 1)"},
		{"more micro-batches than covered", func(s *Schedule) { s.MicroBatches = 3 }, "stage 0 micro-batch 2 has no forward 0F2"},
		{"bad placement", func(s *Schedule) { s.Placement = 7 }, "placement Placement(7)"},
		{"zero ranks", func(s *Schedule) { s.Ranks = 0 }, "ranks 0: must be at least 1"},
		{"wrong peer", func(s *Schedule) {
			s.Actions[0] = append(s.Actions[0], Action{Stage: 0, Kind: SendF, MicroBatch: 0, Peer: 0})
		}, "0SEND_F0: peer stage 0, want 1"},
		{"unknown kind", func(s *Schedule) { s.Actions[1][0].Kind = 99 }, "rank 1 position 0: unknown kind 99"},
		{"per-stage action with a micro-batch", func(s *Schedule) {
			s.Actions[0] = append(s.Actions[0], Action{Stage: 0, Kind: ReduceGrad, MicroBatch: 0})
		}, "micro-batch 0 on a per-stage action"},
	}
	for _, c := range cases {
		s := *good
		s.Actions = [][]Action{append([]Action(nil), good.Actions[0]...), append([]Action(nil), good.Actions[1]...)}
		c.edit(&s)
		err := s.Validate()
		if err == nil || !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: got %v, want ErrInvalid saying %q", c.what, err, c.want)
		}
	}
	if err := good.Validate(); err != nil {
		t.Errorf("unchanged: %v", err)
	}
}

// TestInfer: a user's own lists get the ranks, stages, micro-batches and
// placement they imply.
func TestInfer(t *testing.T) {
	// A V-shaped hand-written schedule: rank 0 holds stages 0 and 3.
	s, err := Infer("mine", parseLists(t,
		"0F0 0F1 3F0 3B0 3F1 3B1 0B0 0B1",
		"1F0 2F0 1F1 2F1 2B0 1B0 2B1 1B1",
	))
	if err != nil {
		t.Fatal(err)
	}
	if s.Name != "mine" || s.Ranks != 2 || s.StagesPerRank != 2 || s.MicroBatches != 2 || s.Placement != VShape {
		t.Errorf("inferred %q ranks %d V %d M %d %v, want mine 2 2 2 v", s.Name, s.Ranks, s.StagesPerRank, s.MicroBatches, s.Placement)
	}
	for _, bad := range []struct {
		lines []string
		want  string
	}{
		{[]string{"0F0 0B0 2F0 2B0", "1F0 1B0"}, "3 stages on 2 ranks"},
		{[]string{"", ""}, "no actions"},
	} {
		if _, err := Infer("bad", parseLists(t, bad.lines...)); err == nil || !strings.Contains(err.Error(), bad.want) {
			t.Errorf("%v: got %v, want %q", bad.lines, err, bad.want)
		}
	}
	if _, err := Infer("none", nil); err == nil || !errors.Is(err, ErrInvalid) {
		t.Errorf("no ranks: %v", err)
	}
}

// TestNilSchedule: a nil schedule is an error, not a panic.
func TestNilSchedule(t *testing.T) {
	var s *Schedule
	if err := s.Validate(); !errors.Is(err, ErrInvalid) {
		t.Errorf("Validate: %v", err)
	}
	if _, err := Lower(s); !errors.Is(err, ErrInvalid) {
		t.Errorf("Lower: %v", err)
	}
	if _, err := Simulate(s, UnitCosts()); !errors.Is(err, ErrInvalid) {
		t.Errorf("Simulate: %v", err)
	}
	if _, err := s.PeakActivations(); !errors.Is(err, ErrInvalid) {
		t.Errorf("PeakActivations: %v", err)
	}
	if err := s.WriteCSV(&strings.Builder{}); !errors.Is(err, ErrInvalid) {
		t.Errorf("WriteCSV: %v", err)
	}
	if s.Table() != "" || s.Lowered() || s.RankOf(0) != -1 || s.StagesOf(0) != nil || s.Stages() != 0 {
		t.Error("Table or Lowered of nil")
	}
}
