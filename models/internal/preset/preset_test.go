package preset

import (
	"slices"
	"testing"
)

func TestPreset(t *testing.T) {
	es := []Entry[int]{{"one", func() int { return 1 }}, {"two", func() int { return 2 }}}
	if got := Names(es); !slices.Equal(got, []string{"one", "two"}) {
		t.Errorf("Names = %v", got)
	}
	for _, tc := range []struct {
		name string
		want int
		ok   bool
	}{{"one", 1, true}, {"two", 2, true}, {"three", 0, false}, {"", 0, false}} {
		if got, ok := Find(es, tc.name); got != tc.want || ok != tc.ok {
			t.Errorf("Find(%q) = %v, %v; want %v, %v", tc.name, got, ok, tc.want, tc.ok)
		}
	}
}
