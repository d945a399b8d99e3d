package tinygpt

import (
	"strconv"
	"testing"
)

func TestLCGNext(t *testing.T) {
	// reference/TINY_GPT.md §2.1 checks.
	for _, tc := range []struct {
		name string
		seed uint32
		want [3]uint32
	}{
		{"CORPUS_SEED", 20240601, [3]uint32{2276813924, 4288236659, 3270027062}},
		{"BATCH_SEED", 12345, [3]uint32{87628868, 71072467, 2332836374}},
		{"zero", 0, [3]uint32{1013904223, 1196435762, 3519870697}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := NewLCG(tc.seed)
			if g.State() != tc.seed {
				t.Fatalf("State() = %d before any draw, want the seed %d", g.State(), tc.seed)
			}
			for i, want := range tc.want {
				if got := g.Next(); got != want {
					t.Fatalf("draw %d: Next() = %d, want %d", i, got, want)
				}
				if g.State() != tc.want[i] {
					t.Fatalf("State() = %d after draw %d, want the returned value", g.State(), i)
				}
			}
		})
	}
	var zero LCG
	if got := zero.Next(); got != 1013904223 {
		t.Errorf("zero LCG: Next() = %d, want 1013904223", got)
	}
}

func TestLCGRandint(t *testing.T) {
	for _, tc := range []struct {
		name string
		seed uint32
		m    int
		want int
	}{
		// §2.2: 2276813924 >> 8 = 8893804, mod 8 = 4, so n = 7.
		{"first corpus draw", 20240601, 8, 8893804 % 8},
		{"shift before mod", 20240601, 1000003, 8893804 % 1000003},
		{"m=1", 20240601, 1, 0},
		// §2.3: the first offset of batch 1.
		{"first offset", 12345, 131007, 80286},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := NewLCG(tc.seed).Randint(tc.m); got != tc.want {
				t.Errorf("Randint(%d) = %d, want %d", tc.m, got, tc.want)
			}
		})
	}
}

func TestLCGRandintMaxModulus(t *testing.T) {
	if strconv.IntSize < 64 {
		t.Skip("int cannot hold 2³²−1")
	}
	m := uint64(1)<<32 - 1
	if got := NewLCG(12345).Randint(int(m)); got != 87628868>>8 {
		t.Errorf("Randint(2³²−1) = %d, want %d", got, 87628868>>8)
	}
}

func TestLCGRandintPanics(t *testing.T) {
	ms := []int{0, -1}
	if strconv.IntSize == 64 {
		big := uint64(1) << 32
		ms = append(ms, int(big))
	}
	for _, m := range ms {
		func() {
			defer func() {
				if recover() == nil {
					t.Errorf("Randint(%d) did not panic", m)
				}
			}()
			NewLCG(1).Randint(m)
		}()
	}
}
