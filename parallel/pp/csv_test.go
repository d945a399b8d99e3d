package pp

import (
	"bytes"
	"errors"
	"strings"
	"testing"
)

// TestCSVRoundTrip: every builder's schedule, compute-only and lowered,
// reads back from its CSV as the same schedule.
func TestCSVRoundTrip(t *testing.T) {
	for _, name := range []string{"gpipe", "1f1b", "interleaved", "zb1", "zbv"} {
		for pp := 1; pp <= 4; pp++ {
			s, err := Build(name, pp, 2*pp, 0)
			if err != nil {
				t.Fatal(err)
			}
			l, err := Lower(s, WithFSDP(), WithReduceGrad())
			if err != nil {
				t.Fatal(err)
			}
			for _, in := range []*Schedule{s, l} {
				var buf bytes.Buffer
				if err := in.WriteCSV(&buf); err != nil {
					t.Fatal(err)
				}
				out, err := ReadCSV(&buf, name)
				if err != nil {
					t.Fatalf("%s pp=%d lowered=%v: %v", name, pp, in.Lowered(), err)
				}
				if lists(out) != lists(in) || out.Ranks != in.Ranks || out.StagesPerRank != in.StagesPerRank ||
					out.MicroBatches != in.MicroBatches || out.Name != name {
					t.Errorf("%s pp=%d lowered=%v: read back\n%s\nwant\n%s", name, pp, in.Lowered(), lists(out), lists(in))
				}
				// V-shaped placement is inferred where it differs from a
				// loop (from 2 ranks on).
				if pp > 1 && out.Placement != in.Placement {
					t.Errorf("%s pp=%d: placement %v, want %v", name, pp, out.Placement, in.Placement)
				}
			}
		}
	}
}

// TestCSVText: the CSV layout is PyTorch's (one row per rank, no header)
// and a hand-written file with spaces and empty cells reads.
func TestCSVText(t *testing.T) {
	s, _ := OneFOneB(2, 2)
	var buf bytes.Buffer
	if err := s.WriteCSV(&buf); err != nil {
		t.Fatal(err)
	}
	if got, want := buf.String(), "0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n"; got != want {
		t.Errorf("csv %q, want %q", got, want)
	}
	mine := "# my schedule\n0F0, 0F1,,0B0, 0B1\n,1F0,1B0,1F1,1B1\n"
	u, err := ReadCSV(strings.NewReader(mine), "mine")
	if err != nil {
		t.Fatal(err)
	}
	if lists(u) != lists(s) {
		t.Errorf("read %s", lists(u))
	}
}

// TestCSVErrors: a cell that does not parse, or a schedule that does not
// validate, is ErrInvalid naming the place.
func TestCSVErrors(t *testing.T) {
	cases := []struct{ text, want string }{
		{"0F0,0X0\n", `pp: invalid argument: csv row 1 (rank 0) column 2: action "0X0": unknown kind "X"`},
		{"0F0,F1\n", `action "F1": no stage`},
		{"0F0,0B\n", `action "0B": no micro-batch`},
		{"0UNSHARD1\n", `UNSHARD takes no micro-batch`},
		{"0F0,0B0\n1B0,1F0\n", "rank 1 position 0: 1B0: backward before its forward 1F0"},
		{"0F0,\"0B0\n", "read csv"},
		// A far stage number is refused at the first gap, without
		// walking a billion stages.
		{"0F0,0B0,999999999F0\n", "stage 1 micro-batch 0 has no forward 1F0"},
	}
	for _, c := range cases {
		_, err := ReadCSV(strings.NewReader(c.text), "bad")
		if err == nil || !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%q: got %v, want ErrInvalid saying %q", c.text, err, c.want)
		} else if msg := err.Error(); !strings.HasPrefix(msg, "pp: ") || strings.Count(msg, "pp: ") != 1 {
			t.Errorf("%q: %v: want the prefix \"pp: \" once, in front", c.text, err)
		}
	}
}

// TestParseAction: PyTorch's notation for every kind.
func TestParseAction(t *testing.T) {
	cases := []struct {
		text string
		want Action
	}{
		{"0F1", Action{Stage: 0, Kind: F, MicroBatch: 1}},
		{"12B10", Action{Stage: 12, Kind: B, MicroBatch: 10}},
		{"2I3", Action{Stage: 2, Kind: I, MicroBatch: 3}},
		{"0W1", Action{Stage: 0, Kind: W, MicroBatch: 1}},
		{"1SEND_F2", Action{Stage: 1, Kind: SendF, MicroBatch: 2, Peer: 2}},
		{"1RECV_F2", Action{Stage: 1, Kind: RecvF, MicroBatch: 2, Peer: 0}},
		{"3SEND_B0", Action{Stage: 3, Kind: SendB, MicroBatch: 0, Peer: 2}},
		{"3RECV_B0", Action{Stage: 3, Kind: RecvB, MicroBatch: 0, Peer: 4}},
		{" 0UNSHARD", Action{Stage: 0, Kind: Unshard, MicroBatch: NoMicroBatch}},
		{"0RESHARD ", Action{Stage: 0, Kind: Reshard, MicroBatch: NoMicroBatch}},
		{"5REDUCE_GRAD", Action{Stage: 5, Kind: ReduceGrad, MicroBatch: NoMicroBatch}},
	}
	for _, c := range cases {
		got, err := ParseAction(c.text)
		if err != nil || got != c.want {
			t.Errorf("%q: got %+v, %v, want %+v", c.text, got, err, c.want)
		}
		if strings.TrimSpace(c.text) != got.String() {
			t.Errorf("%q prints as %q", c.text, got)
		}
	}
	if k := Kind(42); k.String() != "Kind(42)" {
		t.Errorf("unknown kind prints %q", k)
	}
}

// TestTableLowered: a lowered schedule's table lists each rank's actions
// by position.
func TestTableLowered(t *testing.T) {
	s, _ := GPipe(2, 1)
	l, err := Lower(s)
	if err != nil {
		t.Fatal(err)
	}
	want := "        Rank 0   Rank 1\n" +
		"Step 0: 0F0      1RECV_F0\n" +
		"Step 1: 0SEND_F0 1F0\n" +
		"Step 2: 0RECV_B0 1B0\n" +
		"Step 3: 0B0      1SEND_B0\n"
	if got := l.Table(); got != want {
		t.Errorf("table\n%s\nwant\n%s", got, want)
	}
}
