package layout

import "testing"

func TestDivisors(t *testing.T) {
	for _, tc := range []struct {
		n    int
		want string
	}{{0, ""}, {-4, ""}, {1, "1"}, {2, "1 or 2"}, {4, "1, 2 or 4"}, {7, "1 or 7"}, {12, "1, 2, 3, 4, 6 or 12"}} {
		if got := Divisors(tc.n); got != tc.want {
			t.Errorf("Divisors(%d) = %q, want %q", tc.n, got, tc.want)
		}
	}
}
