package pp

import (
	"errors"
	"strings"
	"testing"

	"github.com/b7ea7098/loom"
)

// lists formats a schedule's action lists, one line per rank.
func lists(s *Schedule) string {
	var b strings.Builder
	for r, acts := range s.Actions {
		if r > 0 {
			b.WriteString("\n")
		}
		for i, a := range acts {
			if i > 0 {
				b.WriteString(" ")
			}
			b.WriteString(a.String())
		}
	}
	return b.String()
}

// TestBuildersMatchHandWritten compares each builder's lists for small
// (pp, M, V) with lists worked out by hand from the schedules' rules.
func TestBuildersMatchHandWritten(t *testing.T) {
	cases := []struct {
		name      string
		pp, m, v  int
		placement Placement
		want      []string // one line per rank
	}{
		{"gpipe", 2, 2, 0, Loop, []string{
			"0F0 0F1 0B0 0B1",
			"1F0 1F1 1B0 1B1",
		}},
		{"1f1b", 2, 3, 0, Loop, []string{
			"0F0 0F1 0B0 0F2 0B1 0B2",
			"1F0 1B0 1F1 1B1 1F2 1B2",
		}},
		{"1f1b", 3, 3, 0, Loop, []string{
			"0F0 0F1 0F2 0B0 0B1 0B2",
			"1F0 1F1 1B0 1F2 1B1 1B2",
			"2F0 2B0 2F1 2B1 2F2 2B2",
		}},
		{"interleaved", 2, 2, 2, Loop, []string{
			"0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1",
			"1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1",
		}},
		{"interleaved", 2, 4, 2, Loop, []string{
			"0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3",
			"1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3",
		}},
		// 3 micro-batches on 2 ranks: one round of 3 (PyTorch's rule).
		{"interleaved", 2, 3, 2, Loop, []string{
			"0F0 0F1 0F2 2F0 2F1 2F2 2B0 2B1 2B2 0B0 0B1 0B2",
			"1F0 1F1 1F2 3F0 3B0 3F1 3B1 3F2 3B2 1B0 1B1 1B2",
		}},
		{"zb1", 2, 3, 0, Loop, []string{
			"0F0 0F1 0I0 0W0 0F2 0I1 0W1 0I2 0W2",
			"1F0 1I0 1F1 1I1 1W0 1F2 1I2 1W1 1W2",
		}},
		{"zbv", 2, 3, 0, VShape, []string{
			"0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0I0 0W0 3F2 3I2 3W2 0I1 0W1 0I2 0W2",
			"1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1I1 2I2 1I2 1W1 2W2 1W2",
		}},
		// Fewer micro-batches than the warm-up: the lists above without
		// micro-batch 2.
		{"zbv", 2, 2, 0, VShape, []string{
			"0F0 0F1 3F0 3I0 3W0 3F1 3I1 3W1 0I0 0W0 0I1 0W1",
			"1F0 2F0 1F1 2F1 2I0 2W0 1I0 1W0 2I1 2W1 1I1 1W1",
		}},
	}
	for _, c := range cases {
		s, err := Build(c.name, c.pp, c.m, c.v)
		if err != nil {
			t.Fatalf("%s pp=%d M=%d V=%d: %v", c.name, c.pp, c.m, c.v, err)
		}
		if got, want := lists(s), strings.Join(c.want, "\n"); got != want {
			t.Errorf("%s pp=%d M=%d V=%d:\ngot\n%s\nwant\n%s", c.name, c.pp, c.m, c.v, got, want)
		}
		if s.Placement != c.placement || s.Ranks != c.pp || s.MicroBatches != c.m {
			t.Errorf("%s: placement %v ranks %d M %d, want %v %d %d", c.name, s.Placement, s.Ranks, s.MicroBatches, c.placement, c.pp, c.m)
		}
		if err := s.Validate(); err != nil {
			t.Errorf("%s pp=%d M=%d: %v", c.name, c.pp, c.m, err)
		}
	}
}

// TestBuildersValid: every schedule each builder accepts over a grid of
// (pp, M, V) validates, lowered or not, and covers each (stage,
// micro-batch) with the right kinds.
func TestBuildersValid(t *testing.T) {
	for _, name := range []string{"gpipe", "1f1b", "interleaved", "zb1", "zbv"} {
		for pp := 1; pp <= 6; pp++ {
			for m := 1; m <= 13; m++ {
				vs := []int{0}
				if name == "interleaved" {
					vs = []int{2, 3, 4}
				}
				for _, v := range vs {
					s, err := Build(name, pp, m, v)
					if err != nil {
						if !errors.Is(err, ErrInvalid) {
							t.Errorf("%s pp=%d M=%d V=%d: %v is not ErrInvalid", name, pp, m, v, err)
						}
						continue
					}
					if err := s.Validate(); err != nil {
						t.Errorf("%s pp=%d M=%d V=%d: %v", name, pp, m, v, err)
					}
					if _, err := Lower(s, WithFSDP(), WithReduceGrad()); err != nil {
						t.Errorf("lower %s pp=%d M=%d V=%d: %v", name, pp, m, v, err)
					}
					n := 0
					for _, acts := range s.Actions {
						n += len(acts)
					}
					per := 2 // F and B
					if name == "zb1" || name == "zbv" {
						per = 3 // F, I and W
					}
					if want := per * s.Stages() * m; n != want {
						t.Errorf("%s pp=%d M=%d V=%d: %d actions, want %d", name, pp, m, v, n, want)
					}
				}
			}
		}
	}
}

// TestBuildErrors: counts a schedule refuses are ErrInvalid (and
// loom.ErrInvalid) naming the minimum or the rule.
func TestBuildErrors(t *testing.T) {
	cases := []struct {
		name     string
		pp, m, v int
		want     string
	}{
		{"1f1b", 4, 3, 0, "1f1b: 3 micro-batches: needs at least 4"},
		{"zb1", 4, 2, 0, "zb1: 2 micro-batches: needs at least 4"},
		{"zbv", 0, 6, 0, "zbv: ranks 0: must be at least 1"},
		{"interleaved", 4, 2, 2, "interleaved: 2 micro-batches: needs at least 4"},
		{"interleaved", 4, 9, 2, "interleaved: 9 micro-batches on 4 ranks: must be a multiple of the 2 rounds of at least 4 (8 or 10 would do)"},
		{"interleaved", 4, 13, 2, "(12 or 15 would do)"},
		{"interleaved", 4, 8, 1, "needs at least 2"},
		{"gpipe", 0, 4, 0, "ranks 0: must be at least 1"},
		{"gpipe", 2, 0, 0, "micro-batches 0: must be at least 1"},
		{"gpipe", 2, 2, 2, "gpipe: 2 stages per rank: the schedule has 1"},
		{"zbv", 2, 4, 3, "zbv: 3 stages per rank: the schedule has 2"},
		{"looped", 2, 2, 0, `schedule "looped": want gpipe`},
	}
	for _, c := range cases {
		_, err := Build(c.name, c.pp, c.m, c.v)
		if err == nil {
			t.Errorf("%s pp=%d M=%d V=%d: no error", c.name, c.pp, c.m, c.v)
			continue
		}
		if !errors.Is(err, ErrInvalid) || !errors.Is(err, loom.ErrInvalid) {
			t.Errorf("%s: %v is not ErrInvalid", c.name, err)
		}
		if !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s pp=%d M=%d V=%d: %q does not say %q", c.name, c.pp, c.m, c.v, err, c.want)
		}
		if strings.Count(err.Error(), "pp:") != 1 {
			t.Errorf("%q: want the prefix once", err)
		}
	}
}

// TestBuildDefaults: stagesPerRank 0 means the schedule's own.
func TestBuildDefaults(t *testing.T) {
	for name, v := range map[string]int{"gpipe": 1, "1f1b": 1, "interleaved": 2, "zb1": 1, "zbh1": 1, "zbv": 2} {
		s, err := Build(name, 2, 4, 0)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if s.StagesPerRank != v {
			t.Errorf("%s: %d stages per rank, want %d", name, s.StagesPerRank, v)
		}
	}
}

// TestPlacement: loop and V placements put each stage on the rank the
// schedules assume.
func TestPlacement(t *testing.T) {
	loop := &Schedule{Ranks: 3, StagesPerRank: 3, Placement: Loop}
	v := &Schedule{Ranks: 3, StagesPerRank: 3, Placement: VShape}
	wantLoop := []int{0, 1, 2, 0, 1, 2, 0, 1, 2}
	wantV := []int{0, 1, 2, 2, 1, 0, 0, 1, 2}
	for st := range 9 {
		if got := loop.RankOf(st); got != wantLoop[st] {
			t.Errorf("loop: stage %d on rank %d, want %d", st, got, wantLoop[st])
		}
		if got := v.RankOf(st); got != wantV[st] {
			t.Errorf("v: stage %d on rank %d, want %d", st, got, wantV[st])
		}
	}
	for _, st := range []int{-1, 9} {
		if got := v.RankOf(st); got != -1 {
			t.Errorf("stage %d on rank %d, want -1", st, got)
		}
	}
	if got := (&Schedule{}).RankOf(0); got != -1 {
		t.Errorf("no ranks: stage 0 on rank %d, want -1", got)
	}
	if got := v.StagesOf(0); len(got) != 3 || got[0] != 0 || got[1] != 5 || got[2] != 6 {
		t.Errorf("v: rank 0 holds %v, want [0 5 6]", got)
	}
}
