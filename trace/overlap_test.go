package trace

import (
	"slices"
	"testing"
	"time"
)

// ms builds intervals from pairs of milliseconds.
func ms(pairs ...int) []interval {
	var out []interval
	for i := 0; i+1 < len(pairs); i += 2 {
		out = append(out, interval{time.Duration(pairs[i]) * time.Millisecond, time.Duration(pairs[i+1]) * time.Millisecond})
	}
	return out
}

func TestUnion(t *testing.T) {
	for _, tc := range []struct {
		name string
		in   []interval
		want []interval
	}{
		{"empty", nil, nil},
		{"disjoint, unsorted", ms(5, 6, 0, 1), ms(0, 1, 5, 6)},
		{"overlapping", ms(0, 6, 4, 10), ms(0, 10)},
		{"nested", ms(0, 10, 2, 4, 3, 9), ms(0, 10)},
		{"touching merge", ms(0, 5, 5, 10), ms(0, 10)},
		{"empty intervals dropped", ms(3, 3, 7, 5, 1, 2), ms(1, 2)},
		{"chain", ms(0, 2, 1, 3, 2, 4, 8, 9), ms(0, 4, 8, 9)},
	} {
		if got := union(slices.Clone(tc.in)); !slices.Equal(got, tc.want) {
			t.Errorf("%s: union %v, want %v", tc.name, got, tc.want)
		}
	}
}

func TestOverlapArithmetic(t *testing.T) {
	w := func(from, to int) Window {
		return Window{time.Duration(from) * time.Millisecond, time.Duration(to) * time.Millisecond}
	}
	for _, tc := range []struct {
		name           string
		comm, compute  []interval
		win            Window
		wantComm, want int // milliseconds: union of comm, hidden part
	}{
		{"no compute", ms(0, 10), nil, Window{}, 10, 0},
		{"fully hidden", ms(2, 8), ms(0, 10), Window{}, 6, 6},
		{"half hidden", ms(5, 15), ms(0, 10), Window{}, 10, 5},
		// Compute [0,10] with [2,4] and [3,9] nested inside: counted once.
		{"nested compute", ms(8, 12), ms(0, 10, 2, 4, 3, 9), Window{}, 4, 2},
		// Comm [0,6] and [4,10] overlap: their union is 10, not 12.
		{"overlapping comm", ms(0, 6, 4, 10), ms(5, 7), Window{}, 10, 2},
		// Compute with gaps under one long collective: 1 + 2 + 1.
		{"gaps", ms(1, 9), ms(0, 2, 4, 6, 8, 10), Window{}, 8, 4},
		{"window", ms(0, 10), ms(0, 5), w(3, 8), 5, 2},
		{"open-ended window", ms(0, 10), ms(4, 6), w(5, 0), 5, 1},
		{"touching comm, empty compute", ms(0, 5, 5, 10), ms(5, 5), Window{}, 10, 0},
		{"no comm", nil, ms(0, 10), Window{}, 0, 0},
		{"comm outside window", ms(0, 2), ms(0, 10), w(5, 9), 0, 0},
		{"unsorted", ms(8, 9, 0, 1), ms(0, 10), Window{}, 2, 2},
		// Overlapping compute spans (two goroutines) partly covering two
		// overlapping collectives: comm [0,10], compute [1,3]∪[2,6] = [1,6].
		{"overlaps on both sides", ms(0, 4, 3, 10), ms(2, 6, 1, 3), Window{}, 10, 5},
	} {
		got := overlap(slices.Clone(tc.comm), slices.Clone(tc.compute), tc.win)
		want := OverlapStats{Comm: time.Duration(tc.wantComm) * time.Millisecond, Hidden: time.Duration(tc.want) * time.Millisecond}
		if got != want {
			t.Errorf("%s: %+v, want %+v", tc.name, got, want)
		}
		if got.Exposed() != want.Comm-want.Hidden {
			t.Errorf("%s: Exposed %v, want %v", tc.name, got.Exposed(), want.Comm-want.Hidden)
		}
	}
}

func TestFraction(t *testing.T) {
	for _, tc := range []struct {
		s    OverlapStats
		want float64
	}{
		{OverlapStats{}, 0},
		{OverlapStats{Comm: 4 * time.Second, Hidden: 3 * time.Second}, 0.75},
		{OverlapStats{Comm: time.Second, Hidden: time.Second}, 1},
	} {
		if got := tc.s.Fraction(); got != tc.want {
			t.Errorf("%+v: Fraction %v, want %v", tc.s, got, tc.want)
		}
	}
}

// TestTimelineOverlap checks Overlap on recorded events: only the chosen
// rank, only comm events the filter accepts, wait events ignored.
func TestTimelineOverlap(t *testing.T) {
	tl := NewTimeline()
	at := func(m int) time.Time { return tl.Epoch().Add(time.Duration(m) * time.Millisecond) }
	rec := func(rank int, lane Lane, name string, from, to int) {
		if err := tl.Record(rank, lane, name, at(from), at(to)); err != nil {
			t.Fatal(err)
		}
	}
	rec(0, LaneCompute, "backward", 0, 10)
	rec(0, LaneCompute, "Linear", 2, 5) // nested
	rec(0, LaneComm, "allreduce", 6, 14)
	rec(0, LaneComm, "allgather", 0, 4)
	rec(0, LaneWait, "allreduce", 10, 14) // not communication for Overlap
	rec(1, LaneCompute, "backward", 0, 20)
	rec(1, LaneComm, "allreduce", 6, 14)

	isAllReduce := func(e Event) bool { return e.Name == "allreduce" }
	msd := func(m int) time.Duration { return time.Duration(m) * time.Millisecond }
	for _, tc := range []struct {
		name   string
		rank   int
		win    Window
		filter func(Event) bool
		want   OverlapStats
	}{
		{"rank 0 allreduce", 0, Window{}, isAllReduce, OverlapStats{Comm: msd(8), Hidden: msd(4)}},
		{"rank 0 all comm", 0, Window{}, nil, OverlapStats{Comm: msd(12), Hidden: msd(8)}},
		{"rank 0 window", 0, Window{From: msd(8), To: msd(12)}, isAllReduce, OverlapStats{Comm: msd(4), Hidden: msd(2)}},
		{"rank 1", 1, Window{}, isAllReduce, OverlapStats{Comm: msd(8), Hidden: msd(8)}},
		{"rank 2 (none)", 2, Window{}, nil, OverlapStats{}},
	} {
		if got := tl.Overlap(tc.rank, tc.win, tc.filter); got != tc.want {
			t.Errorf("%s: %+v, want %+v", tc.name, got, tc.want)
		}
	}
}
