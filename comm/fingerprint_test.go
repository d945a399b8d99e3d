package comm_test

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/b7ea7098/loom/comm"
)

func TestFingerprintOf(t *testing.T) {
	counts := []int{1, 2, 3, 4}
	tests := []struct {
		name string
		c    comm.Call
		want comm.Fingerprint
	}{
		{"allreduce", comm.Call{Op: comm.OpAllReduce, Send: f32(8), Recv: f32(8), Reduce: comm.Avg, Root: 3, Peer: 2},
			comm.Fingerprint{Seq: 9, Op: comm.OpAllReduce, DType: comm.Float32, Count: 8, Root: -1, Reduce: comm.Avg}},
		{"broadcast keeps root, drops reduce", comm.Call{Op: comm.OpBroadcast, Send: f32(4), Recv: f32(4), Root: 2, Reduce: comm.Max},
			comm.Fingerprint{Seq: 9, Op: comm.OpBroadcast, DType: comm.Float32, Count: 4, Root: 2}},
		{"reduce keeps both", comm.Call{Op: comm.OpReduce, Send: comm.Host(make([]int64, 3)), Root: 1, Reduce: comm.Min, Algorithm: comm.Tree},
			comm.Fingerprint{Seq: 9, Op: comm.OpReduce, DType: comm.Int64, Count: 3, Root: 1, Reduce: comm.Min, Algorithm: comm.Tree}},
		{"scatter dtype from recv", comm.Call{Op: comm.OpScatter, Recv: comm.Host(make([]uint8, 5)), Root: 0},
			comm.Fingerprint{Seq: 9, Op: comm.OpScatter, DType: comm.Uint8, Count: 5, Root: 0}},
		{"alltoallv", comm.Call{Op: comm.OpAllToAllV, Send: f32(10), Recv: f32(10), SendCounts: counts, RecvCounts: []int{4, 3, 2, 1}},
			comm.Fingerprint{Seq: 9, Op: comm.OpAllToAllV, DType: comm.Float32, SendCounts: counts, Root: -1}},
		{"send", comm.Call{Op: comm.OpSend, Send: f32(2), Peer: 1, Root: 3},
			comm.Fingerprint{Seq: 9, Op: comm.OpSend, DType: comm.Float32, Count: 2, Root: -1}},
		{"barrier drops buffers", comm.Call{Op: comm.OpBarrier, Send: f32(2), Algorithm: comm.DoubleTree},
			comm.Fingerprint{Seq: 9, Op: comm.OpBarrier, Root: -1, Algorithm: comm.DoubleTree}},
		{"split", comm.Call{Op: comm.OpSplit, Recv: f32(2)},
			comm.Fingerprint{Seq: 9, Op: comm.OpSplit, Root: -1}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got := comm.FingerprintOf(9, &tc.c)
			if !reflect.DeepEqual(got, tc.want) {
				t.Errorf("FingerprintOf = %+v\nwant %+v", got, tc.want)
			}
		})
	}
}

func TestFingerprintMatches(t *testing.T) {
	base := comm.Fingerprint{Seq: 4, Op: comm.OpAllReduce, DType: comm.Float32, Count: 8, Root: -1,
		Reduce: comm.Sum, SendCounts: []int{1, 2}, Site: "a.go:1"}
	tests := []struct {
		name   string
		mutate func(*comm.Fingerprint)
		match  bool
	}{
		{"identical", func(*comm.Fingerprint) {}, true},
		{"site differs", func(f *comm.Fingerprint) { f.Site = "b.go:2" }, true},
		{"send counts differ", func(f *comm.Fingerprint) { f.SendCounts = []int{2, 1} }, true},
		{"send counts nil", func(f *comm.Fingerprint) { f.SendCounts = nil }, true},
		{"seq", func(f *comm.Fingerprint) { f.Seq++ }, false},
		{"op", func(f *comm.Fingerprint) { f.Op = comm.OpReduce }, false},
		{"dtype", func(f *comm.Fingerprint) { f.DType = comm.Float64 }, false},
		{"count", func(f *comm.Fingerprint) { f.Count = 7 }, false},
		{"root", func(f *comm.Fingerprint) { f.Root = 0 }, false},
		{"reduce", func(f *comm.Fingerprint) { f.Reduce = comm.Max }, false},
		{"algorithm", func(f *comm.Fingerprint) { f.Algorithm = comm.Ring }, false},
	}
	for _, tc := range tests {
		g := base
		tc.mutate(&g)
		if got := base.Matches(g); got != tc.match {
			t.Errorf("%s: Matches = %v, want %v", tc.name, got, tc.match)
		}
		if got := g.Matches(base); got != tc.match {
			t.Errorf("%s: reverse Matches = %v, want %v", tc.name, got, tc.match)
		}
	}
}

func TestFingerprintString(t *testing.T) {
	tests := []struct {
		f    comm.Fingerprint
		want string
	}{
		{comm.Fingerprint{Seq: 3, Op: comm.OpAllReduce, DType: comm.Float32, Count: 8, Root: -1, Reduce: comm.Sum},
			"allreduce #3 float32 count=8 op=sum"},
		{comm.Fingerprint{Seq: 1, Op: comm.OpBroadcast, DType: comm.Float64, Count: 4, Root: 2},
			"broadcast #1 float64 count=4 root=2"},
		{comm.Fingerprint{Seq: 1, Op: comm.OpBroadcast, DType: comm.Float64, Count: 4, Root: 0},
			"broadcast #1 float64 count=4 root=0"},
		{comm.Fingerprint{Seq: 5, Op: comm.OpAllToAllV, DType: comm.Int32, Root: -1, SendCounts: []int{1, 2, 3}},
			"alltoallv #5 int32 send_counts=[1 2 3]"},
		{comm.Fingerprint{Seq: 0, Op: comm.OpBarrier, Root: -1}, "barrier #0"},
		{comm.Fingerprint{Seq: 7, Op: comm.OpSplit, Root: -1, Site: "main.go:12"}, "split #7 at main.go:12"},
		{comm.Fingerprint{Seq: 2, Op: comm.OpAllGather, DType: comm.BFloat16, Count: 0, Root: -1, Algorithm: comm.Ring, Site: "x.go:10"},
			"allgather #2 bfloat16 count=0 algo=ring at x.go:10"},
	}
	for _, tc := range tests {
		if got := tc.f.String(); got != tc.want {
			t.Errorf("String() = %q, want %q", got, tc.want)
		}
	}
}

func TestCheckCounts(t *testing.T) {
	// transpose returns recv consistent with send.
	transpose := func(send [][]int) [][]int {
		recv := make([][]int, len(send))
		for j := range recv {
			recv[j] = make([]int, len(send))
			for i := range send {
				recv[j][i] = send[i][j]
			}
		}
		return recv
	}
	send3 := [][]int{{0, 2, 5}, {1, 0, 3}, {4, 4, 4}}
	if err := comm.CheckCounts(send3, transpose(send3)); err != nil {
		t.Errorf("consistent 3×3: %v", err)
	}
	if err := comm.CheckCounts(nil, nil); err != nil {
		t.Errorf("empty: %v", err)
	}
	if err := comm.CheckCounts([][]int{{7}}, [][]int{{7}}); err != nil {
		t.Errorf("1×1: %v", err)
	}

	recv := transpose(send3)
	recv[1][0] = 3 // rank 1 expects 3 from rank 0, which sends 2
	err := comm.CheckCounts(send3, recv)
	if err == nil {
		t.Fatal("one mismatch not found")
	}
	if !errors.Is(err, comm.ErrInvalid) {
		t.Errorf("%v does not wrap ErrInvalid", err)
	}
	want := "invalid call: alltoallv counts disagree: rank 0 sends 2 elements to rank 1, which expects 3"
	if err.Error() != want {
		t.Errorf("error %q, want %q", err, want)
	}

	recv = transpose(send3)
	recv[1][0], recv[2][2] = 9, 0
	err = comm.CheckCounts(send3, recv)
	if err == nil || !strings.Contains(err.Error(), "rank 0 sends 2 elements to rank 1, which expects 9; rank 2 sends 4 elements to rank 2, which expects 0") {
		t.Errorf("two mismatches: %v", err)
	}

	for _, tc := range []struct {
		bad      int
		wantMore string
	}{{8, ""}, {9, "and 1 more"}, {20, "and 12 more"}} {
		n := 5 // 25 pairs
		send := make([][]int, n)
		for i := range send {
			send[i] = make([]int, n)
		}
		recv := transpose(send)
		for k := 0; k < tc.bad; k++ {
			recv[k%n][k/n]++ // pair (i=k/n, j=k%n)
		}
		err := comm.CheckCounts(send, recv)
		if err == nil {
			t.Fatalf("%d mismatches not found", tc.bad)
		}
		msg := err.Error()
		if got := strings.Count(msg, "which expects"); got != min(tc.bad, 8) {
			t.Errorf("%d mismatches: %d listed, want %d: %s", tc.bad, got, min(tc.bad, 8), msg)
		}
		if tc.wantMore == "" {
			if strings.Contains(msg, "more") {
				t.Errorf("%d mismatches: unexpected truncation: %s", tc.bad, msg)
			}
		} else if !strings.HasSuffix(msg, "; "+tc.wantMore) {
			t.Errorf("%d mismatches: %q does not end with %q", tc.bad, msg, tc.wantMore)
		}
	}
}

func TestErrorFormatting(t *testing.T) {
	tests := []struct {
		name string
		e    *comm.Error
		want string
	}{
		{"no peer", &comm.Error{Backend: "local", Rank: 2, Op: comm.OpAllReduce, Seq: 7, Peer: -1, Err: comm.ErrTimeout},
			"loom/comm local: rank 2: allreduce #7: timed out"},
		{"peer 0", &comm.Error{Backend: "mpi", Rank: 1, Op: comm.OpRecv, Seq: 3, Peer: 0, Err: comm.ErrTimeout},
			"loom/comm mpi: rank 1: recv #3 (peer 0): timed out"},
		{"peer 5, wrapped cause", &comm.Error{Backend: "local", Rank: 0, Op: comm.OpSend, Seq: 12, Peer: 5, Err: fmt.Errorf("%w: boom", comm.ErrInvalid)},
			"loom/comm local: rank 0: send #12 (peer 5): invalid call: boom"},
		{"split, label", &comm.Error{Backend: "local", Comm: "world/split2.c0", Rank: 1, WorldRank: 3, Op: comm.OpAllGather, Seq: 4, Label: "unit h.1 all-gather", Peer: -1, Err: &comm.TimeoutError{After: time.Second, Late: []int{0}, Detail: "waiting for world rank 0, which has not joined"}},
			"loom/comm local world/split2.c0: rank 1 (world rank 3): allgather #4 [unit h.1 all-gather]: timed out after 1s waiting for world rank 0, which has not joined"},
	}
	for _, tc := range tests {
		if got := tc.e.Error(); got != tc.want {
			t.Errorf("%s: %q, want %q", tc.name, got, tc.want)
		}
	}
	if e := tests[2].e; !errors.Is(e, comm.ErrInvalid) || errors.Is(e, comm.ErrTimeout) {
		t.Error("Error does not unwrap to exactly its cause")
	}
	// A TimeoutError is an ErrTimeout, and LateRanks finds it through an abort.
	abort := &comm.Error{Backend: "local", Rank: 2, Op: comm.OpAllGather, Seq: 4, Peer: -1, Err: &comm.AbortError{Rank: 1, Cause: tests[3].e}}
	if !errors.Is(abort, comm.ErrTimeout) || !slices.Equal(comm.LateRanks(abort), []int{0}) || comm.LateRanks(tests[0].e) != nil {
		t.Errorf("LateRanks(%v) = %v, want [0]", abort, comm.LateRanks(abort))
	}
}

func TestAbortErrorChain(t *testing.T) {
	cause := fmt.Errorf("rank 3 watchdog: %w", context.DeadlineExceeded)
	abort := &comm.AbortError{Rank: 3, Cause: cause}
	e := &comm.Error{Backend: "local", Rank: 0, Op: comm.OpBarrier, Seq: 1, Peer: -1, Err: abort}
	wrapped := fmt.Errorf("training step: %w", e)

	for _, target := range []error{comm.ErrAborted, context.DeadlineExceeded, cause} {
		if !errors.Is(wrapped, target) {
			t.Errorf("errors.Is(..., %v) = false", target)
		}
	}
	for _, target := range []error{comm.ErrTimeout, comm.ErrInvalid, comm.ErrMismatch, context.Canceled} {
		if errors.Is(wrapped, target) {
			t.Errorf("errors.Is(..., %v) = true", target)
		}
	}
	var ae *comm.AbortError
	if !errors.As(wrapped, &ae) || ae.Rank != 3 {
		t.Errorf("errors.As found %v", ae)
	}
	var ce *comm.Error
	if !errors.As(wrapped, &ce) || ce.Op != comm.OpBarrier {
		t.Errorf("errors.As *Error found %v", ce)
	}
	if got, want := abort.Error(), "communicator aborted by rank 3: rank 3 watchdog: context deadline exceeded"; got != want {
		t.Errorf("AbortError = %q, want %q", got, want)
	}
	if got, want := (&comm.AbortError{Rank: -1, Cause: context.Canceled}).Error(), "communicator aborted: context canceled"; got != want {
		t.Errorf("AbortError unknown rank = %q, want %q", got, want)
	}
	if got := e.Error(); !strings.HasSuffix(got, "barrier #1: communicator aborted by rank 3: rank 3 watchdog: context deadline exceeded") {
		t.Errorf("Error = %q", got)
	}
	// A nil cause still matches ErrAborted.
	if !errors.Is(&comm.AbortError{Rank: 0}, comm.ErrAborted) {
		t.Error("AbortError without cause is not ErrAborted")
	}
}

func TestMismatchError(t *testing.T) {
	fp := func(op comm.Op, count int, site string) comm.Fingerprint {
		return comm.Fingerprint{Seq: 4, Op: op, DType: comm.Float32, Count: count, Root: -1, Reduce: comm.Sum, Site: site}
	}
	e := &comm.MismatchError{Calls: []comm.Fingerprint{
		fp(comm.OpAllReduce, 8, "a.go:1"),
		fp(comm.OpAllReduce, 9, "a.go:1"),
		fp(comm.OpAllReduce, 8, "b.go:2"), // only the site differs: same collective
		fp(comm.OpReduceScatter, 8, "c.go:3"),
	}}
	lines := strings.Split(e.Error(), "\n")
	if len(lines) != 5 || lines[0] != "ranks issued different collectives:" {
		t.Fatalf("Error() = %q", e.Error())
	}
	const mark = "<- differs from rank 0"
	for r, wantMark := range []bool{false, true, false, true} {
		line := lines[r+1]
		if !strings.HasPrefix(line, fmt.Sprintf("  rank %d: %v", r, e.Calls[r])) {
			t.Errorf("line %q does not describe rank %d", line, r)
		}
		if strings.Contains(line, mark) != wantMark {
			t.Errorf("rank %d line %q: marked=%v, want %v", r, line, !wantMark, wantMark)
		}
	}
	if !errors.Is(e, comm.ErrMismatch) || errors.Is(e, comm.ErrInvalid) {
		t.Error("MismatchError does not unwrap to ErrMismatch only")
	}
	wrapped := &comm.Error{Backend: "local", Op: comm.OpAllReduce, Peer: -1, Err: e}
	var me *comm.MismatchError
	if !errors.Is(wrapped, comm.ErrMismatch) || !errors.As(wrapped, &me) || len(me.Calls) != 4 {
		t.Error("MismatchError not found through *Error")
	}
}
