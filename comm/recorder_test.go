package comm_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/b7ea7098/loom/comm"
)

func seqs(es []comm.Entry) []uint64 {
	var s []uint64
	for _, e := range es {
		s = append(s, e.Seq)
	}
	return s
}

func TestRecorderRing(t *testing.T) {
	tests := []struct {
		capacity, begin int
		wantSeqs        []uint64
	}{
		{3, 0, nil},
		{3, 1, []uint64{100}},
		{3, 3, []uint64{100, 101, 102}},
		{3, 4, []uint64{101, 102, 103}},
		{3, 7, []uint64{104, 105, 106}},
		{1, 5, []uint64{104}},
	}
	for _, tc := range tests {
		r := comm.NewRecorder("world", 0, tc.capacity)
		for i := 0; i < tc.begin; i++ {
			if id := r.Begin(uint64(100+i), &comm.Call{Op: comm.OpBarrier}, comm.Auto); id != uint64(i) {
				t.Fatalf("Begin #%d returned id %d", i, id)
			}
		}
		if got := seqs(r.Entries()); !slices.Equal(got, tc.wantSeqs) {
			t.Errorf("cap %d after %d: Entries seqs %v, want %v", tc.capacity, tc.begin, got, tc.wantSeqs)
		}
		if d := r.Snapshot(); d.Total != uint64(tc.begin) || d.Communicator != "world" {
			t.Errorf("Snapshot total=%d comm=%q", d.Total, d.Communicator)
		}
	}
	// A non-positive capacity means the default.
	for _, c := range []int{0, -1} {
		r := comm.NewRecorder("w", 0, c)
		for i := 0; i < comm.DefaultRecorderSize+5; i++ {
			r.Begin(uint64(i), &comm.Call{Op: comm.OpBarrier}, comm.Auto)
		}
		es := r.Entries()
		if len(es) != comm.DefaultRecorderSize || es[0].Seq != 5 {
			t.Errorf("capacity %d: kept %d entries starting at %d", c, len(es), es[0].Seq)
		}
	}
}

func TestRecorderUpdate(t *testing.T) {
	r := comm.NewRecorder("w", 1, 3)
	var ids []uint64
	for i := 0; i < 5; i++ {
		ids = append(ids, r.Begin(uint64(i), &comm.Call{Op: comm.OpBarrier}, comm.Auto))
	}
	// ids 0 and 1 are overwritten; 5 and beyond do not exist yet.
	before := r.Entries()
	r.Update(ids[0], comm.Failed, errors.New("stale"))
	r.Update(ids[1], comm.Completed, nil)
	r.Update(5, comm.Completed, nil)
	r.Update(1<<40, comm.Completed, nil)
	r.SetAlgorithm(ids[1], comm.Ring)
	r.SetAlgorithm(7, comm.Ring)
	if after := r.Entries(); !reflect.DeepEqual(before, after) {
		t.Fatalf("updates of overwritten or future ids changed entries:\n%+v\n%+v", before, after)
	}

	r.Update(ids[2], comm.Started, nil) // the oldest retained entry
	r.Update(ids[3], comm.Started, nil)
	r.Update(ids[3], comm.Completed, nil)
	r.Update(ids[4], comm.Failed, errors.New("boom"))
	r.SetAlgorithm(ids[2], comm.HalvingDoubling)
	es := r.Entries()
	if es[0].State != comm.Started || es[0].Start.IsZero() || !es[0].End.IsZero() || es[0].Algorithm != "halving_doubling" {
		t.Errorf("entry 2: %+v", es[0])
	}
	if es[1].State != comm.Completed || es[1].Start.IsZero() || es[1].End.Before(es[1].Start) || es[1].Err != "" {
		t.Errorf("entry 3: %+v", es[1])
	}
	if es[2].State != comm.Failed || es[2].Start.IsZero() || es[2].End.IsZero() || es[2].Err != "boom" {
		t.Errorf("entry 4 (failed without start): %+v", es[2])
	}

	// Entries is a copy.
	es[0].Op = "changed"
	if r.Entries()[0].Op != "barrier" {
		t.Error("Entries shares memory with the recorder")
	}
}

func TestRecorderBegin(t *testing.T) {
	counts := []int{1, 2, 3}
	tests := []struct {
		name string
		c    comm.Call
		algo comm.Algorithm
		want comm.Entry
	}{
		{"allreduce", comm.Call{Op: comm.OpAllReduce, Send: f32(8), Recv: f32(8), Root: 2}, comm.Auto,
			comm.Entry{Op: "allreduce", DType: "float32", Bytes: 32, Peer: -1, State: comm.Issued}},
		{"broadcast records root", comm.Call{Op: comm.OpBroadcast, Recv: comm.Host(make([]float64, 3)), Root: 2}, comm.Tree,
			comm.Entry{Op: "broadcast", DType: "float64", Bytes: 24, Algorithm: "tree", Peer: 2, State: comm.Issued}},
		{"recv records peer, dtype from recv", comm.Call{Op: comm.OpRecv, Recv: comm.Host(make([]comm.Float16Bits, 5)), Peer: 3}, comm.Auto,
			comm.Entry{Op: "recv", DType: "float16", Bytes: 10, Peer: 3, State: comm.Issued}},
		{"alltoallv records splits", comm.Call{Op: comm.OpAllToAllV, Send: comm.Host(make([]int32, 6)), Recv: comm.Host(make([]int32, 6)), SendCounts: counts}, comm.Direct,
			comm.Entry{Op: "alltoallv", DType: "int32", Bytes: 24, Algorithm: "direct", Peer: -1, Splits: []int{1, 2, 3}, State: comm.Issued}},
		{"barrier", comm.Call{Op: comm.OpBarrier}, comm.Auto,
			comm.Entry{Op: "barrier", Peer: -1, State: comm.Issued}},
	}
	r := comm.NewRecorder("w", 0, 10)
	for i, tc := range tests {
		before := time.Now()
		id := r.Begin(uint64(i), &tc.c, tc.algo)
		got := r.Entries()[id]
		if got.Issued.Before(before) || got.Issued.After(time.Now()) {
			t.Errorf("%s: Issued %v not now", tc.name, got.Issued)
		}
		got.Issued = time.Time{}
		tc.want.Seq = uint64(i)
		if !reflect.DeepEqual(got, tc.want) {
			t.Errorf("%s:\n got %+v\nwant %+v", tc.name, got, tc.want)
		}
	}
	counts[0] = 99 // the recorder copied the splits
	if s := r.Entries()[3].Splits; s[0] != 1 {
		t.Errorf("splits alias the call's counts: %v", s)
	}
}

func TestStateNames(t *testing.T) {
	for s, want := range map[comm.State]string{comm.Issued: "issued", comm.Started: "started",
		comm.Completed: "completed", comm.Failed: "failed", 0: "unknown", 9: "unknown"} {
		if s.String() != want {
			t.Errorf("State(%d).String() = %q, want %q", s, s.String(), want)
		}
		if b, err := s.MarshalText(); err != nil || string(b) != want {
			t.Errorf("State(%d).MarshalText() = %q, %v", s, b, err)
		}
	}
	var s comm.State
	if err := s.UnmarshalText([]byte("bogus")); err == nil {
		t.Error("UnmarshalText accepted bogus")
	}
}

// filledRecorder returns a recorder of capacity 3 that has seen 4
// operations, all finished, so its text dump does not depend on the clock.
func filledRecorder() *comm.Recorder {
	r := comm.NewRecorder("world/tp", 2, 3)
	r.Begin(0, &comm.Call{Op: comm.OpBarrier}, comm.Auto)
	id := r.Begin(1, &comm.Call{Op: comm.OpAllReduce, Send: f32(4), Recv: f32(4)}, comm.Auto)
	r.SetAlgorithm(id, comm.Ring)
	r.Update(id, comm.Completed, nil)
	id = r.Begin(2, &comm.Call{Op: comm.OpSend, Send: f32(2), Peer: 5}, comm.Auto)
	r.Update(id, comm.Failed, errors.New("peer vanished"))
	id = r.Begin(3, &comm.Call{Op: comm.OpAllToAllV, Send: f32(3), Recv: f32(3), SendCounts: []int{1, 2}}, comm.Direct)
	r.Update(id, comm.Completed, nil)
	return r
}

func TestRecorderWriteText(t *testing.T) {
	r := filledRecorder()
	var b bytes.Buffer
	if err := r.WriteText(&b); err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSuffix(b.String(), "\n"), "\n")
	if len(lines) != 4 {
		t.Fatalf("%d lines:\n%s", len(lines), b.String())
	}
	if want := "flight recorder: communicator world/tp, rank 2, 4 operations (3 kept)"; lines[0] != want {
		t.Errorf("header %q, want %q", lines[0], want)
	}
	wants := [][]string{
		{"#1 ", "allreduce", "float32", "16B", "ring", "completed"},
		{"#2 ", "send", "8B", "failed", "peer/root=5", "peer vanished"},
		{"#3 ", "alltoallv", "direct", "completed", "splits=[1 2]"},
	}
	for i, want := range wants {
		for _, w := range want {
			if !strings.Contains(lines[i+1], w) {
				t.Errorf("line %q lacks %q", lines[i+1], w)
			}
		}
	}
	if strings.Contains(b.String(), "barrier") {
		t.Error("overwritten entry still printed")
	}

	// A started, unfinished entry shows how long it has been running.
	r2 := comm.NewRecorder("w", 0, 2)
	r2.Update(r2.Begin(0, &comm.Call{Op: comm.OpBarrier}, comm.Auto), comm.Started, nil)
	b.Reset()
	if err := r2.WriteText(&b); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(b.String(), "running ") || !strings.Contains(b.String(), "started") {
		t.Errorf("running entry: %q", b.String())
	}

	if err := r.WriteText(failWriter{}); err == nil {
		t.Error("WriteText ignored a write error")
	}
}

type failWriter struct{}

func (failWriter) Write([]byte) (int, error) { return 0, errors.New("disk full") }

func checkDump(t *testing.T, r *comm.Recorder, data []byte) {
	t.Helper()
	var d comm.Dump
	if err := json.Unmarshal(data, &d); err != nil {
		t.Fatalf("decoding the dump: %v\n%s", err, data)
	}
	want := r.Snapshot()
	if d.Communicator != want.Communicator || d.Rank != want.Rank || d.Total != want.Total || len(d.Entries) != len(want.Entries) {
		t.Fatalf("dump header %+v, want %+v", d, want)
	}
	for i, e := range d.Entries {
		w := want.Entries[i]
		if !e.Issued.Equal(w.Issued) || !e.Start.Equal(w.Start) || !e.End.Equal(w.End) {
			t.Errorf("entry %d times differ: %+v vs %+v", i, e, w)
		}
		e.Issued, e.Start, e.End = w.Issued, w.Start, w.End
		if !reflect.DeepEqual(e, w) {
			t.Errorf("entry %d:\n got %+v\nwant %+v", i, e, w)
		}
	}
}

func TestRecorderMarshalJSON(t *testing.T) {
	r := filledRecorder()
	data, err := json.Marshal(r)
	if err != nil {
		t.Fatal(err)
	}
	checkDump(t, r, data)
	for _, want := range []string{`"communicator":"world/tp"`, `"state":"failed"`, `"error":"peer vanished"`, `"splits":[1,2]`, `"total":4`} {
		if !bytes.Contains(data, []byte(want)) {
			t.Errorf("JSON lacks %s: %s", want, data)
		}
	}
	// Zero times and empty fields are left out.
	r2 := comm.NewRecorder("w", 0, 1)
	r2.Begin(0, &comm.Call{Op: comm.OpBarrier}, comm.Auto)
	data, _ = json.Marshal(r2)
	for _, absent := range []string{`"start"`, `"end"`, `"error"`, `"dtype"`, `"algorithm"`, `"splits"`} {
		if bytes.Contains(data, []byte(absent)) {
			t.Errorf("JSON has %s: %s", absent, data)
		}
	}
}

func TestRecorderWriteFiles(t *testing.T) {
	r := filledRecorder()
	dir := filepath.Join(t.TempDir(), "dumps", "nested")
	paths, err := r.WriteFiles(dir, "rank2")
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(paths)
	want := []string{filepath.Join(dir, "rank2.json"), filepath.Join(dir, "rank2.txt")}
	if !slices.Equal(paths, want) {
		t.Fatalf("paths %v, want %v", paths, want)
	}
	js, err := os.ReadFile(want[0])
	if err != nil {
		t.Fatal(err)
	}
	checkDump(t, r, js)
	txt, err := os.ReadFile(want[1])
	if err != nil {
		t.Fatal(err)
	}
	var b bytes.Buffer
	r.WriteText(&b)
	if string(txt) != b.String() {
		t.Errorf("text dump:\n%s\nwant:\n%s", txt, b.String())
	}

	// A second dump replaces the first and leaves no temporary files.
	r.Begin(4, &comm.Call{Op: comm.OpBarrier}, comm.Auto)
	if _, err := r.WriteFiles(dir, "rank2"); err != nil {
		t.Fatal(err)
	}
	des, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, de := range des {
		names = append(names, de.Name())
	}
	if !slices.Equal(names, []string{"rank2.json", "rank2.txt"}) {
		t.Errorf("folder holds %v", names)
	}
	txt, _ = os.ReadFile(want[1])
	if !strings.Contains(string(txt), "5 operations") {
		t.Errorf("second dump did not replace the first:\n%s", txt)
	}

	// A folder that cannot be created is an error.
	file := filepath.Join(t.TempDir(), "file")
	if err := os.WriteFile(file, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := r.WriteFiles(filepath.Join(file, "sub"), "x"); err == nil || !strings.Contains(err.Error(), "flight recorder dump") {
		t.Errorf("WriteFiles under a file: %v", err)
	}
}

func TestRecorderConcurrent(t *testing.T) {
	r := comm.NewRecorder("w", 0, 16)
	var wg sync.WaitGroup
	for g := 0; g < 4; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 200; i++ {
				id := r.Begin(uint64(i), &comm.Call{Op: comm.OpAllReduce, Send: f32(1), Recv: f32(1)}, comm.Auto)
				r.SetAlgorithm(id, comm.Ring)
				r.Update(id, comm.Completed, nil)
				if i%50 == 0 {
					r.Entries()
					_, _ = json.Marshal(r)
				}
			}
		}()
	}
	wg.Wait()
	if d := r.Snapshot(); d.Total != 800 || len(d.Entries) != 16 {
		t.Errorf("total %d, kept %d", d.Total, len(d.Entries))
	}
	for _, e := range r.Entries() {
		if e.State != comm.Completed || e.Algorithm != "ring" {
			t.Errorf("entry %+v not completed with ring", e)
		}
	}
}

// TestRecorderFind: Find returns the newest retained entry of a sequence
// number, collectives and point-to-point apart, and nothing once the ring
// has dropped it.
func TestRecorderFind(t *testing.T) {
	r := comm.NewRecorder("world", 0, 4)
	x := comm.Host([]float32{1})
	r.BeginLabeled("old", 1, &comm.Call{Op: comm.OpAllReduce, Send: x, Recv: x}, comm.Auto)
	r.BeginLabeled("p2p", 1, &comm.Call{Op: comm.OpSend, Send: x, Peer: 1}, comm.Auto)
	r.BeginLabeled("unit a", 2, &comm.Call{Op: comm.OpBroadcast, Send: x, Recv: x}, comm.Auto)
	tests := []struct {
		seq       uint64
		p2p, ok   bool
		op, label string
	}{
		{1, false, true, "allreduce", "old"},
		{1, true, true, "send", "p2p"},
		{2, false, true, "broadcast", "unit a"},
		{2, true, false, "", ""},
		{3, false, false, "", ""},
	}
	for _, tc := range tests {
		e, ok := r.Find(tc.seq, tc.p2p)
		if ok != tc.ok || e.Op != tc.op || e.Label != tc.label {
			t.Errorf("Find(%d, %v) = %q %q %v, want %q %q %v", tc.seq, tc.p2p, e.Op, e.Label, ok, tc.op, tc.label, tc.ok)
		}
	}
	for seq := uint64(3); seq <= 6; seq++ { // push seq 1 and 2 out of the ring
		r.Begin(seq, &comm.Call{Op: comm.OpBarrier}, comm.Auto)
	}
	if e, ok := r.Find(1, false); ok {
		t.Errorf("Find(1) after the ring wrapped: %+v", e)
	}
}

// TestWithLabel: labels nest outer / inner, are recorded by
// BeginLabeled and shown in the text dump.
func TestWithLabel(t *testing.T) {
	ctx := context.Background()
	if got := comm.LabelOf(ctx); got != "" {
		t.Errorf("LabelOf(Background) = %q", got)
	}
	ctx = comm.WithLabel(ctx, "step 3")
	ctx = comm.WithLabel(ctx, "fsdp unit blocks.1 all-gather")
	const want = "step 3 / fsdp unit blocks.1 all-gather"
	if got := comm.LabelOf(ctx); got != want {
		t.Errorf("LabelOf = %q, want %q", got, want)
	}
	r := comm.NewRecorder("world", 0, 4)
	r.BeginLabeled(comm.LabelOf(ctx), 1, &comm.Call{Op: comm.OpBarrier}, comm.Auto)
	var b bytes.Buffer
	if err := r.WriteText(&b); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(b.String(), "["+want+"]") {
		t.Errorf("text dump without the label:\n%s", b.String())
	}
}
