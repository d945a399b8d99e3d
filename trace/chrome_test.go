package trace_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/local"
	"github.com/b7ea7098/loom/trace"
)

// chromeFile is the part of the Chrome trace format the tests read.
type chromeFile struct {
	TraceEvents []struct {
		Name string         `json:"name"`
		Cat  string         `json:"cat"`
		Ph   string         `json:"ph"`
		Ts   *float64       `json:"ts"`
		Dur  *float64       `json:"dur"`
		Pid  *int           `json:"pid"`
		Tid  *int           `json:"tid"`
		Args map[string]any `json:"args"`
	} `json:"traceEvents"`
	DisplayTimeUnit string         `json:"displayTimeUnit"`
	OtherData       map[string]any `json:"otherData"`
}

type span struct {
	name     string
	ts, end  float64
	pid, tid int
}

// parseChrome decodes a trace, checks its structure and returns its
// complete events and its thread names by (pid, tid).
func parseChrome(t *testing.T, data []byte) ([]span, map[[2]int]string) {
	t.Helper()
	if !json.Valid(data) {
		t.Fatalf("invalid JSON:\n%s", data)
	}
	var f chromeFile
	if err := json.Unmarshal(data, &f); err != nil {
		t.Fatal(err)
	}
	threads := map[[2]int]string{}
	procs := map[int]string{}
	var spans []span
	for _, e := range f.TraceEvents {
		if e.Pid == nil || e.Tid == nil || e.Ts == nil {
			t.Fatalf("event %+v lacks pid, tid or ts", e)
		}
		switch e.Ph {
		case "M":
			switch e.Name {
			case "process_name":
				procs[*e.Pid] = e.Args["name"].(string)
			case "thread_name":
				threads[[2]int{*e.Pid, *e.Tid}] = e.Args["name"].(string)
			}
		case "X":
			if e.Dur == nil || *e.Dur < 0 {
				t.Fatalf("complete event %+v has no or a negative dur", e)
			}
			spans = append(spans, span{e.Name, *e.Ts, *e.Ts + *e.Dur, *e.Pid, *e.Tid})
		default:
			t.Fatalf("event %+v has phase %q", e, e.Ph)
		}
	}
	for _, s := range spans {
		if procs[s.pid] != fmt.Sprintf("rank %d", s.pid) {
			t.Errorf("pid %d is named %q", s.pid, procs[s.pid])
		}
		if threads[[2]int{s.pid, s.tid}] == "" {
			t.Errorf("span %+v is on an unnamed thread", s)
		}
	}
	checkNested(t, spans)
	return spans, threads
}

// checkNested fails unless the spans of every thread nest properly: two
// spans are disjoint or one contains the other.
func checkNested(t *testing.T, spans []span) {
	t.Helper()
	byThread := map[[2]int][]span{}
	for _, s := range spans {
		k := [2]int{s.pid, s.tid}
		byThread[k] = append(byThread[k], s)
	}
	const eps = 1e-3 // one nanosecond, in microseconds
	for k, ss := range byThread {
		for i, a := range ss {
			for _, b := range ss[i+1:] {
				disjoint := a.end <= b.ts+eps || b.end <= a.ts+eps
				aInB := b.ts <= a.ts+eps && a.end <= b.end+eps
				bInA := a.ts <= b.ts+eps && b.end <= a.end+eps
				if !disjoint && !aInB && !bInA {
					t.Errorf("thread %v: %+v and %+v overlap without nesting", k, a, b)
				}
			}
		}
	}
}

// TestChromeRows checks the thread layout: overlapping compute spans that
// do not nest go to separate threads, nested ones share one, and comm
// events are split by group.
func TestChromeRows(t *testing.T) {
	tl := trace.NewTimeline()
	at := func(us int) time.Time { return tl.Epoch().Add(time.Duration(us) * time.Microsecond) }
	for _, r := range []struct {
		rank     int
		lane     trace.Lane
		name     string
		from, to int
	}{
		{0, trace.LaneCompute, "a", 0, 10},
		{0, trace.LaneCompute, "a-child", 2, 3},
		{0, trace.LaneCompute, "b", 5, 15}, // overlaps a, not nested
		{0, trace.LaneCompute, "c", 16, 20},
		{0, trace.LaneWait, "w", 12, 13},
		{1, trace.LaneCompute, "d", 1, 2},
	} {
		if err := tl.Record(r.rank, r.lane, r.name, at(r.from), at(r.to)); err != nil {
			t.Fatal(err)
		}
	}
	var buf bytes.Buffer
	if err := tl.WriteChrome(&buf); err != nil {
		t.Fatal(err)
	}
	spans, threads := parseChrome(t, buf.Bytes())
	where := map[string]string{}
	for _, s := range spans {
		where[s.name] = threads[[2]int{s.pid, s.tid}]
		if s.name == "a-child" && (s.ts != 2 || s.end != 3) {
			t.Errorf("a-child at %v..%v µs, want 2..3", s.ts, s.end)
		}
	}
	// Wait events are named "wait <name>".
	want := map[string]string{"a": "compute", "a-child": "compute", "b": "compute #2", "c": "compute", "wait w": "wait", "d": "compute"}
	for name, th := range want {
		if where[name] != th {
			t.Errorf("%s on thread %q, want %q", name, where[name], th)
		}
	}
}

// TestChromeFromRun writes the trace of a traced local run to a file and
// checks it: valid JSON, nested threads, one comm thread per group.
func TestChromeFromRun(t *testing.T) {
	tl := trace.NewTimeline()
	err := local.Run(context.Background(), 4, func(ctx context.Context, world comm.Communicator) error {
		r := world.Rank()
		c := trace.Comm(world, tl, r)
		half, err := c.Split(ctx, r/2, r)
		if err != nil {
			return err
		}
		x := comm.Host(make([]float32, 1<<14))
		var ws []comm.Work
		for range 3 {
			span := tl.Begin(r, "compute")
			w, err := comm.AllReduceAsync(ctx, half, x, x, comm.Sum)
			if err != nil {
				return err
			}
			ws = append(ws, w)
			time.Sleep(time.Millisecond)
			span.End()
		}
		if err := comm.WaitAll(ctx, ws...); err != nil {
			return err
		}
		return comm.Barrier(ctx, c)
	})
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "trace.json")
	if err := tl.WriteChromeFile(path); err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	spans, threads := parseChrome(t, data)
	names := map[int][]string{}
	for k, v := range threads {
		names[k[0]] = append(names[k[0]], v)
	}
	for r := range 4 {
		group := "[0,1]"
		if r >= 2 {
			group = "[2,3]"
		}
		got := names[r]
		slices.Sort(got)
		got = slices.DeleteFunc(got, func(s string) bool { return s == "wait" || s == "wait #2" })
		want := []string{"comm " + group, "comm [0,1,2,3]", "compute"}
		slices.Sort(want)
		if !slices.Equal(got, want) {
			t.Errorf("rank %d threads %q, want %q (and wait)", r, got, want)
		}
	}
	count := 0
	for _, s := range spans {
		if s.name == "allreduce [0,1]" || s.name == "allreduce [2,3]" {
			count++
		}
	}
	if count != 12 {
		t.Errorf("%d all-reduce spans, want 12", count)
	}
	if err := tl.WriteChromeFile(filepath.Join(t.TempDir(), "missing", "trace.json")); err == nil {
		t.Error("WriteChromeFile into a missing folder: no error")
	}
}
