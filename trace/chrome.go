package trace

import (
	"bufio"
	"cmp"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"time"
)

// chromeEvent is one entry of the Chrome trace format's traceEvents array:
// ph "X" is a complete event (ts and dur in microseconds), ph "M" metadata.
type chromeEvent struct {
	Name string         `json:"name"`
	Cat  string         `json:"cat,omitempty"`
	Ph   string         `json:"ph"`
	Ts   json.Number    `json:"ts"`
	Dur  json.Number    `json:"dur,omitempty"`
	Pid  int            `json:"pid"`
	Tid  int            `json:"tid"`
	Args map[string]any `json:"args,omitempty"`
}

// row is one thread of the trace: a lane, the group for comm events, and
// the index among the rows the lane's events were spread over to keep
// every row properly nested.
type row struct {
	lane  Lane
	group string
	track int
}

func (r row) name() string {
	s := r.lane.String()
	if r.lane == LaneComm && r.group != "" {
		s += " " + r.group
	}
	if r.track > 0 {
		s += " #" + strconv.Itoa(r.track+1)
	}
	return s
}

func compareRows(a, b row) int {
	return cmp.Or(cmp.Compare(a.lane, b.lane), cmp.Compare(a.group, b.group), cmp.Compare(a.track, b.track))
}

// WriteChrome writes the timeline as Chrome trace JSON (the object form,
// {"traceEvents": [...]}), which Perfetto and chrome://tracing open: one
// process per rank named "rank N", one thread per lane ("compute",
// "wait", and on a device "stream compute" and "stream comm", the spans
// its streams executed: Streams) and per group on the comm lane ("comm
// [0,1]"), and a complete
// event (ph "X", ts and dur in microseconds since the timeline's epoch) per
// span. Communication events carry op, group, bytes, dtype, seq, peer and
// queued_us arguments. Calls still running are left out (see Pending).
func (tl *Timeline) WriteChrome(w io.Writer) error {
	evs := tl.Events()
	rows := assignRows(evs)

	// Thread ids per rank, in row order.
	type prow struct {
		rank int
		row  row
	}
	var all []prow
	for i, e := range evs {
		all = append(all, prow{e.Rank, rows[i]})
	}
	slices.SortFunc(all, func(a, b prow) int { return cmp.Or(cmp.Compare(a.rank, b.rank), compareRows(a.row, b.row)) })
	all = slices.Compact(all)
	tids := make(map[prow]int, len(all))

	// bufio.Writer's errors are sticky: after the first failed write every
	// later write and Flush return it, so the writes below that do not
	// check their error lose nothing; Flush is checked at the end.
	bw := bufio.NewWriter(w)
	first := true
	emit := func(ce *chromeEvent) error {
		b, err := json.Marshal(ce)
		if err != nil {
			return err
		}
		if !first {
			bw.WriteString(",\n")
		}
		first = false
		_, err = bw.Write(b)
		return err
	}
	fail := func(err error) error { return fmt.Errorf("trace: writing Chrome trace JSON: %w", err) }

	bw.WriteString(`{"traceEvents":[` + "\n")
	lastRank, tid := -1, 0
	for _, pr := range all {
		if pr.rank != lastRank {
			lastRank, tid = pr.rank, 0
			for _, m := range []chromeEvent{
				{Name: "process_name", Ph: "M", Ts: "0", Pid: pr.rank, Args: map[string]any{"name": "rank " + strconv.Itoa(pr.rank)}},
				{Name: "process_sort_index", Ph: "M", Ts: "0", Pid: pr.rank, Args: map[string]any{"sort_index": pr.rank}},
			} {
				if err := emit(&m); err != nil {
					return fail(err)
				}
			}
		}
		tid++
		tids[pr] = tid
		for _, m := range []chromeEvent{
			{Name: "thread_name", Ph: "M", Ts: "0", Pid: pr.rank, Tid: tid, Args: map[string]any{"name": pr.row.name()}},
			{Name: "thread_sort_index", Ph: "M", Ts: "0", Pid: pr.rank, Tid: tid, Args: map[string]any{"sort_index": tid}},
		} {
			if err := emit(&m); err != nil {
				return fail(err)
			}
		}
	}
	for i := range evs {
		e := &evs[i]
		ce := chromeEvent{
			Name: e.Name, Cat: e.Cat, Ph: "X", Ts: micros(e.Start), Dur: micros(e.End - e.Start),
			Pid: e.Rank, Tid: tids[prow{e.Rank, rows[i]}],
		}
		switch e.Lane {
		case LaneCompute, LaneStreamCompute:
			if e.Cat != "" && e.Cat != e.Lane.String() {
				ce.Name = e.Cat + " " + e.Name
			}
		case LaneComm, LaneWait, LaneStreamComm:
			ce.Name = e.Name
			if e.Group != "" {
				ce.Name += " " + e.Group
			}
			if e.Lane == LaneWait {
				ce.Name = "wait " + ce.Name
			}
			ce.Args = commArgs(e)
		}
		if e.Note != "" {
			if ce.Args == nil {
				ce.Args = map[string]any{}
			}
			ce.Args["note"] = e.Note
		}
		if err := emit(&ce); err != nil {
			return fail(err)
		}
	}
	other, err := json.Marshal(map[string]any{
		"epoch":   tl.Epoch().Format(time.RFC3339Nano),
		"dropped": tl.Dropped(),
		"pending": tl.Pending(),
	})
	if err != nil {
		return fail(err)
	}
	bw.WriteString("\n],\"displayTimeUnit\":\"ns\",\"otherData\":")
	bw.Write(other)
	bw.WriteString("}\n")
	if err := bw.Flush(); err != nil {
		return fail(err)
	}
	return nil
}

// commArgs are the arguments of a comm or wait event.
func commArgs(e *Event) map[string]any {
	a := map[string]any{"op": e.Op.String(), "bytes": e.Bytes}
	if e.Group != "" {
		a["group"] = e.Group
	}
	if e.DType.Valid() {
		a["dtype"] = e.DType.String()
	}
	if e.Peer >= 0 {
		a["peer"] = e.Peer
	}
	if e.Failed {
		a["failed"] = true
	}
	if e.Lane == LaneComm {
		if e.Seq != 0 {
			a["seq"] = e.Seq
		}
		a["queued_us"] = json.Number(micros(e.Start - e.Issued))
	}
	return a
}

// micros formats a duration in microseconds with nanosecond digits.
func micros(d time.Duration) json.Number {
	return json.Number(strconv.FormatFloat(float64(d)/1e3, 'f', -1, 64))
}

// assignRows gives every event (ordered by rank, start, longest first) a
// row: its lane, its group on the comm lane, and the first track of that
// lane and group on which it nests within or follows the spans already
// there. The format draws a thread's complete events as a stack, so spans
// that overlap without nesting must be on different threads.
func assignRows(evs []Event) []row {
	type key struct {
		rank  int
		lane  Lane
		group string
	}
	tracks := map[key][][]time.Duration{} // per track, the ends of the open spans
	out := make([]row, len(evs))
	for i, e := range evs {
		k := key{e.Rank, e.Lane, ""}
		if e.Lane == LaneComm {
			k.group = e.Group
		}
		ts := tracks[k]
		t := 0
		for ; t < len(ts); t++ {
			open := ts[t]
			for len(open) > 0 && open[len(open)-1] <= e.Start {
				open = open[:len(open)-1]
			}
			ts[t] = open
			if len(open) == 0 || e.End <= open[len(open)-1] {
				break
			}
		}
		if t == len(ts) {
			ts = append(ts, nil)
		}
		ts[t] = append(ts[t], e.End)
		tracks[k] = ts
		out[i] = row{lane: e.Lane, group: k.group, track: t}
	}
	return out
}

// WriteChromeFile writes the Chrome trace JSON to path, atomically (a
// temporary file in the same folder, then a rename).
func (tl *Timeline) WriteChromeFile(path string) error {
	f, err := os.CreateTemp(filepath.Dir(path), filepath.Base(path)+".tmp*")
	if err != nil {
		return fmt.Errorf("trace: writing %s: %w", path, err)
	}
	tmp := f.Name()
	// Cleanup after a failure drops its own errors: the first error is
	// the one to report, and a temporary file left behind is harmless.
	fail := func(err error) error {
		_ = f.Close()
		_ = os.Remove(tmp)
		return fmt.Errorf("trace: writing %s: %w", path, err)
	}
	if err := tl.WriteChrome(f); err != nil {
		return fail(err)
	}
	if err := f.Chmod(0o644); err != nil { // CreateTemp makes files private
		return fail(err)
	}
	if err := f.Close(); err != nil {
		_ = os.Remove(tmp) // cleanup, as in fail
		return fmt.Errorf("trace: writing %s: %w", path, err)
	}
	if err := os.Rename(tmp, path); err != nil {
		_ = os.Remove(tmp) // cleanup, as in fail
		return fmt.Errorf("trace: writing %s: %w", path, err)
	}
	return nil
}
