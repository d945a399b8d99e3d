package comm_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/b7ea7098/loom"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/local"
)

// agreeOn runs Agree on p in-process ranks, rank r passing items(r), and
// returns every rank's error.
func agreeOn(t *testing.T, p int, items func(r int) []string) []error {
	t.Helper()
	errs := make([]error, p)
	err := local.Run(context.Background(), p, func(ctx context.Context, c comm.Communicator) error {
		errs[c.Rank()] = comm.Agree(ctx, c, "the parameter list", items(c.Rank()))
		return nil
	}, local.WithCostModel(comm.BuiltinCostModel()))
	if err != nil {
		t.Fatalf("p=%d: Run: %v", p, err)
	}
	return errs
}

func TestAgree(t *testing.T) {
	w, b := "w [2 3] float64", "b [2] float64"
	base := []string{w, b}
	// odd returns a list function where rank k passes l and the others base.
	odd := func(k int, l []string) func(r int) []string {
		return func(r int) []string {
			if r == k {
				return l
			}
			return base
		}
	}
	// others names the ranks of a p-rank world but k, as rankList does.
	others := func(p, k int) string {
		var rs []int
		for r := range p {
			if r != k {
				rs = append(rs, r)
			}
		}
		switch {
		case len(rs) == 1:
			return fmt.Sprintf("rank %d has", rs[0])
		case p == 4 && k == 0:
			return "ranks 1-3 have"
		}
		s := "ranks "
		for i, r := range rs {
			if i > 0 {
				s += ", "
			}
			s += fmt.Sprint(r)
		}
		return s + " have"
	}
	const head = "ranks disagree on the parameter list: "
	for _, tc := range []struct {
		name  string
		items func(r int) []string
		want  func(p int) string // "" for agreement
	}{
		{name: "agree", items: odd(-1, nil), want: func(int) string { return "" }},
		{name: "all empty", items: func(int) []string { return nil }, want: func(int) string { return "" }},
		{name: "order", items: odd(1, []string{b, w}), want: func(p int) string {
			return head + fmt.Sprintf(`rank 1 has %q at position 0 where %s %q`, b, others(p, 1), w)
		}},
		{name: "shape", items: odd(1, []string{"w [3 2] float64", b}), want: func(p int) string {
			return head + fmt.Sprintf(`rank 1 has "w [3 2] float64" at position 0 where %s %q`, others(p, 1), w)
		}},
		{name: "dtype", items: odd(1, []string{w, "b [2] float32"}), want: func(p int) string {
			return head + fmt.Sprintf(`rank 1 has "b [2] float32" at position 1 where %s %q`, others(p, 1), b)
		}},
		{name: "longer", items: odd(1, []string{w, b, "c [4] float64"}), want: func(p int) string {
			return head + fmt.Sprintf(`rank 1 has "c [4] float64" at position 2 where %s nothing (3 entries against 2)`, others(p, 1))
		}},
		{name: "shorter", items: odd(1, []string{w}), want: func(p int) string {
			return head + fmt.Sprintf(`rank 1 has nothing at position 1 where %s %q (1 entry against 2)`, others(p, 1), b)
		}},
		{name: "one empty", items: odd(1, nil), want: func(p int) string {
			return head + fmt.Sprintf(`rank 1 has nothing at position 0 where %s %q (0 entries against 2)`, others(p, 1), w)
		}},
		{name: "rank 2", items: odd(2, []string{b, w}), want: func(p int) string {
			if p < 3 {
				return ""
			}
			return head + fmt.Sprintf(`rank 2 has %q at position 0 where %s %q`, b, others(p, 2), w)
		}},
		{
			// The reference is the list most ranks passed, so rank 0 is
			// the one named when it is alone; at p=2 the tie goes to rank 0.
			name: "rank 0 alone", items: odd(0, []string{b, w}), want: func(p int) string {
				if p == 2 {
					return head + fmt.Sprintf(`rank 1 has %q at position 0 where rank 0 has %q`, w, b)
				}
				return head + fmt.Sprintf(`rank 0 has %q at position 0 where %s %q`, b, others(p, 0), w)
			},
		},
		{
			name: "every rank its own", items: func(r int) []string { return []string{w, fmt.Sprintf("x%d", r)} },
			want: func(p int) string {
				s := head
				for r := 1; r < p; r++ {
					if r > 1 {
						s += "; "
					}
					s += fmt.Sprintf(`rank %d has "x%d" at position 1 where rank 0 has "x0"`, r, r)
				}
				return s
			},
		},
	} {
		for _, p := range []int{2, 3, 4} {
			errs := agreeOn(t, p, tc.items)
			want := tc.want(p)
			for r, err := range errs {
				switch {
				case want == "" && err != nil:
					t.Errorf("%s, p=%d: rank %d: %v, want nil", tc.name, p, r, err)
				case want == "":
				case err == nil:
					t.Errorf("%s, p=%d: rank %d: nil error, want %q", tc.name, p, r, want)
				case err.Error() != want:
					t.Errorf("%s, p=%d: rank %d:\n got %s\nwant %s", tc.name, p, r, err, want)
				case !errors.Is(err, comm.ErrMismatch) || !errors.Is(err, loom.ErrMismatch):
					t.Errorf("%s, p=%d: rank %d: %v does not match comm.ErrMismatch and loom.ErrMismatch", tc.name, p, r, err)
				}
				var de *comm.DisagreementError
				if err != nil && (!errors.As(err, &de) || len(de.Lists) != p || !slices.Equal(de.Lists[r], tc.items(r))) {
					t.Errorf("%s, p=%d: rank %d: %v is not a DisagreementError holding every rank's list", tc.name, p, r, err)
				}
			}
		}
	}
}

// TestAgreeOneRank: with one rank there is nothing to compare and nothing
// is communicated; a nil communicator is invalid.
func TestAgreeOneRank(t *testing.T) {
	errs := agreeOn(t, 1, func(int) []string { return []string{"anything"} })
	if errs[0] != nil {
		t.Errorf("p=1: %v", errs[0])
	}
	if err := comm.Agree(context.Background(), nil, "the list", nil); !errors.Is(err, comm.ErrInvalid) {
		t.Errorf("nil communicator: %v, want ErrInvalid", err)
	}
}

// TestAgreeAborted: a peer that fails instead of joining makes Agree fail
// with the abort, wrapped with what was being agreed on.
func TestAgreeAborted(t *testing.T) {
	var got error
	boom := errors.New("boom")
	err := local.Run(context.Background(), 3, func(ctx context.Context, c comm.Communicator) error {
		if c.Rank() == 1 {
			return boom
		}
		if err := comm.Agree(ctx, c, "the parameter list", []string{"w"}); c.Rank() == 0 {
			got = err
		}
		return nil
	}, local.WithCostModel(comm.BuiltinCostModel()))
	if !errors.Is(err, boom) {
		t.Fatalf("Run: %v, want rank 1's error", err)
	}
	if !errors.Is(got, comm.ErrAborted) {
		t.Fatalf("rank 0: %v, want the abort", got)
	}
	if want := "comm: Agree on the parameter list: exchanging fingerprints: "; !strings.HasPrefix(got.Error(), want) {
		t.Errorf("rank 0: %q does not start with %q", got, want)
	}
}

// TestDisagreementErrorMessage checks the message's compression of many
// ranks: ranges of ranks, and groups beyond the first three summarized.
func TestDisagreementErrorMessage(t *testing.T) {
	a, b := []string{"a"}, []string{"b"}
	for _, tc := range []struct {
		lists [][]string
		want  string
	}{
		{
			lists: [][]string{a, a, a, a, a, a, b, b},
			want:  `ranks disagree on L: ranks 6, 7 have "b" at position 0 where ranks 0-5 have "a"`,
		},
		{
			lists: [][]string{b, a, a, a, b, a, a, a},
			want:  `ranks disagree on L: ranks 0, 4 have "b" at position 0 where ranks 1-3, 5-7 have "a"`,
		},
		{
			lists: [][]string{a, {"1"}, {"2"}, {"3"}, {"4"}, {"5"}},
			want: `ranks disagree on L: rank 1 has "1" at position 0 where rank 0 has "a"; rank 2 has "2" at position 0 where rank 0 has "a"; ` +
				`rank 3 has "3" at position 0 where rank 0 has "a"; ranks 4, 5 also differ`,
		},
		{
			lists: [][]string{{`q"uote`}, {"new\nline"}},
			want:  `ranks disagree on L: rank 1 has "new\nline" at position 0 where rank 0 has "q\"uote"`,
		},
	} {
		err := &comm.DisagreementError{What: "L", Lists: tc.lists}
		if got := err.Error(); got != tc.want {
			t.Errorf("lists %q:\n got %s\nwant %s", tc.lists, got, tc.want)
		}
	}
}

// BenchmarkAgree times Agree on a list of 100 parameter descriptions that
// every rank shares: the cost DDP's construction pays. The differ variant
// times the failing path (three all-gathers and the error); allgather8B is
// the one all-gather of 8 bytes per rank that agreement costs, alone.
func BenchmarkAgree(b *testing.B) {
	items := make([]string, 100)
	for i := range items {
		items[i] = fmt.Sprintf("h.%d.mlp.fc.weight [768 3072] float32", i)
	}
	other := slices.Clone(items)
	other[50] = "h.50.mlp.fc.weight [3072 768] float32"
	for _, p := range []int{2, 4} {
		for _, variant := range []string{"", "/differ", "/allgather8B"} {
			differ := variant == "/differ"
			name := fmt.Sprintf("p=%d%s", p, variant)
			b.Run(name, func(b *testing.B) {
				wd, err := local.NewWorld(p, local.WithCostModel(comm.BuiltinCostModel()))
				if err != nil {
					b.Fatal(err)
				}
				ctx := context.Background()
				errs := make([]error, p)
				var wg sync.WaitGroup
				b.ResetTimer()
				for r := range p {
					wg.Add(1)
					go func() {
						defer wg.Done()
						mine := items
						if differ && r == p-1 {
							mine = other
						}
						hash, all := make([]int64, 1), make([]int64, p)
						for range b.N {
							if variant == "/allgather8B" {
								if err := comm.AllGather(ctx, wd.Comm(r), comm.Host(hash), comm.Host(all)); err != nil {
									errs[r] = err
									return
								}
								continue
							}
							err := comm.Agree(ctx, wd.Comm(r), "the parameter list", mine)
							if differ != (err != nil) {
								errs[r] = fmt.Errorf("rank %d: %v", r, err)
								return
							}
						}
					}()
				}
				wg.Wait()
				b.StopTimer()
				if err := errors.Join(errs...); err != nil {
					b.Fatal(err)
				}
			})
		}
	}
}
