package checkwire

import (
	"errors"
	"reflect"
	"strings"
	"testing"

	"github.com/b7ea7098/loom/comm"
)

func allReduce(seq uint64, count int) comm.Fingerprint {
	return comm.Fingerprint{Seq: seq, Op: comm.OpAllReduce, DType: comm.Float32, Count: count, Root: -1, Reduce: comm.Sum, Algorithm: comm.Ring}
}

func TestFingerprintRoundTrip(t *testing.T) {
	long := strings.Repeat("x", 1000)
	cases := []struct {
		name       string
		size       int
		fp         comm.Fingerprint
		invalid    error
		color, key int
		want       Entry
	}{
		{
			name: "allreduce", size: 4, fp: allReduce(7, 1<<40),
			want: Entry{Fingerprint: allReduce(7, 1<<40)},
		},
		{
			name: "site", size: 2,
			fp:   comm.Fingerprint{Seq: 1, Op: comm.OpBroadcast, DType: comm.Float64, Count: 3, Root: 1, Site: "train.go:42"},
			want: Entry{Fingerprint: comm.Fingerprint{Seq: 1, Op: comm.OpBroadcast, DType: comm.Float64, Count: 3, Root: 1, Site: "train.go:42"}},
		},
		{
			name: "long site and reason are cut", size: 1,
			fp:      comm.Fingerprint{Seq: 2, Op: comm.OpBarrier, Root: -1, Site: long},
			invalid: errors.New(long),
			want: Entry{
				Fingerprint: comm.Fingerprint{Seq: 2, Op: comm.OpBarrier, Root: -1, Site: long[:siteBytes-1]},
				Invalid:     long[:reasonBytes-1],
			},
		},
		{
			name: "rejected without a reason", size: 2, fp: allReduce(3, 8), invalid: errors.New(""),
			want: Entry{Fingerprint: allReduce(3, 8), Invalid: "rejected"},
		},
		{
			name: "alltoallv send counts", size: 3,
			fp:   comm.Fingerprint{Seq: 4, Op: comm.OpAllToAllV, DType: comm.Int64, Root: -1, SendCounts: []int{1, 0, 5}},
			want: Entry{Fingerprint: comm.Fingerprint{Seq: 4, Op: comm.OpAllToAllV, DType: comm.Int64, Root: -1, SendCounts: []int{1, 0, 5}}},
		},
		{
			name: "send counts of the wrong length are left out", size: 3,
			fp:   comm.Fingerprint{Seq: 5, Op: comm.OpAllToAllV, Root: -1, SendCounts: []int{1, 2}},
			want: Entry{Fingerprint: comm.Fingerprint{Seq: 5, Op: comm.OpAllToAllV, Root: -1}},
		},
		{
			name: "split", size: 2, fp: comm.Fingerprint{Seq: 6, Op: comm.OpSplit, Root: -1}, color: -1, key: 9,
			want: Entry{Fingerprint: comm.Fingerprint{Seq: 6, Op: comm.OpSplit, Root: -1}, Color: -1, Key: 9},
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			b := make([]byte, FingerprintSize(tc.size))
			PutFingerprint(b, tc.size, tc.fp, tc.invalid, tc.color, tc.key)
			if got := ParseFingerprint(b, tc.size); !reflect.DeepEqual(got, tc.want) {
				t.Errorf("round trip:\n got %+v\nwant %+v", got, tc.want)
			}
		})
	}
}

func TestCheckFingerprints(t *testing.T) {
	const size = 3
	cases := []struct {
		name     string
		fps      [size]comm.Fingerprint
		invalid  [size]error
		wantErr  error  // matched with errors.Is; nil for no error
		mismatch bool   // want a *comm.MismatchError
		mention  string // a substring of the error
	}{
		{name: "agree", fps: [size]comm.Fingerprint{allReduce(1, 8), allReduce(1, 8), allReduce(1, 8)}},
		{
			name: "sites and send counts are per rank",
			fps: [size]comm.Fingerprint{
				{Seq: 2, Op: comm.OpAllToAllV, Root: -1, SendCounts: []int{1, 2, 3}, Site: "a.go:1"},
				{Seq: 2, Op: comm.OpAllToAllV, Root: -1, SendCounts: []int{4, 5, 6}, Site: "b.go:2"},
				{Seq: 2, Op: comm.OpAllToAllV, Root: -1},
			},
		},
		{
			name: "count mismatch", fps: [size]comm.Fingerprint{allReduce(3, 8), allReduce(3, 8), allReduce(3, 9)},
			mismatch: true, mention: "count=9",
		},
		{
			name:    "rejected on two ranks",
			fps:     [size]comm.Fingerprint{allReduce(4, 8), allReduce(4, 9), allReduce(4, 8)},
			invalid: [size]error{nil, errors.New("bad buffer"), errors.New("")},
			wantErr: comm.ErrInvalid, mention: "call rejected before any data moved: rank 1: bad buffer; rank 2: rejected",
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			n := FingerprintSize(size)
			all := make([]byte, size*n)
			for q := range size {
				PutFingerprint(all[q*n:(q+1)*n], size, tc.fps[q], tc.invalid[q], 0, 0)
			}
			err := CheckFingerprints(all, size)
			var me *comm.MismatchError
			switch {
			case tc.mismatch:
				if !errors.As(err, &me) || len(me.Calls) != size || me.Calls[2].Count != 9 {
					t.Fatalf("err = %v, want a *comm.MismatchError", err)
				}
			case tc.wantErr != nil:
				if !errors.Is(err, tc.wantErr) || errors.As(err, &me) {
					t.Fatalf("err = %v, want %v", err, tc.wantErr)
				}
			case err != nil:
				t.Fatalf("err = %v, want none", err)
			}
			if tc.mention != "" && !strings.Contains(err.Error(), tc.mention) {
				t.Errorf("err = %q, want it to mention %q", err, tc.mention)
			}
		})
	}
}

func TestCheckCounts(t *testing.T) {
	const size = 2
	cases := []struct {
		name       string
		send, recv [size][]int
		invalid    [size]error
		wantErr    error  // matched with errors.Is; nil for no error
		mention    string // a substring of the error
	}{
		{
			name: "agree",
			send: [size][]int{{1, 2}, {3, 4}},
			recv: [size][]int{{1, 3}, {2, 4}},
		},
		{
			name:    "disagree",
			send:    [size][]int{{1, 2}, {3, 4}},
			recv:    [size][]int{{1, 3}, {7, 4}},
			wantErr: comm.ErrInvalid,
		},
		{
			name:    "rejected, with malformed counts",
			send:    [size][]int{{1, 2}, {3}},
			recv:    [size][]int{{1, 3}, nil},
			invalid: [size]error{nil, errors.New("")},
			wantErr: comm.ErrInvalid, mention: "call rejected before any data moved: rank 1: ?",
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			n := CountsSize(size)
			all := make([]byte, size*n)
			for q := range size {
				PutCounts(all[q*n:(q+1)*n], size, tc.send[q], tc.recv[q], tc.invalid[q])
			}
			err := CheckCounts(all, size)
			if tc.wantErr == nil {
				if err != nil {
					t.Fatalf("err = %v, want none", err)
				}
				return
			}
			if !errors.Is(err, tc.wantErr) {
				t.Fatalf("err = %v, want %v", err, tc.wantErr)
			}
			if tc.mention == "" {
				// The disagreement is comm.CheckCounts's own verdict.
				want := comm.CheckCounts(tc.send[:], tc.recv[:])
				if want == nil || err.Error() != want.Error() {
					t.Errorf("err = %v, want comm.CheckCounts's %v", err, want)
				}
			} else if !strings.Contains(err.Error(), tc.mention) {
				t.Errorf("err = %q, want it to mention %q", err, tc.mention)
			}
		})
	}
}

// TestLayout pins the offsets that the package documentation gives.
func TestLayout(t *testing.T) {
	const size = 2
	b := make([]byte, FingerprintSize(size))
	fp := comm.Fingerprint{Seq: 0x0102, Op: comm.OpAllToAllV, DType: comm.Int32, Count: 5, Root: -1, Reduce: comm.Sum,
		Algorithm: comm.Ring, SendCounts: []int{7, 8}, Site: "s.go:1"}
	PutFingerprint(b, size, fp, errors.New("no"), 3, 4)
	if len(b) != 464+8*size || b[0] != 0x02 || b[1] != 0x01 || b[8] != byte(comm.OpAllToAllV) || b[9] != byte(comm.Int32) ||
		b[10] != byte(comm.Sum) || b[11] != byte(comm.Ring) || b[12] != 1 || b[13] != 1 || b[16] != 5 || b[24] != 0xff ||
		b[32] != 3 || b[40] != 4 || string(b[64:70]) != "s.go:1" || string(b[224:226]) != "no" || b[464] != 7 || b[472] != 8 {
		t.Errorf("fingerprint record % x", b)
	}
	c := make([]byte, CountsSize(size))
	PutCounts(c, size, []int{1, 2}, []int{3, 4}, nil)
	if len(c) != 32+240 || c[0] != 1 || c[8] != 2 || c[16] != 3 || c[24] != 4 || c[32] != 0 {
		t.Errorf("counts record % x", c)
	}
}
