package train

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/local"
	"github.com/b7ea7098/loom/device/emu"
	"github.com/b7ea7098/loom/kernels"
	"github.com/b7ea7098/loom/launch"
	"github.com/b7ea7098/loom/trace"
)

func TestThreads(t *testing.T) {
	for _, c := range []struct {
		override, ranks, cpus, want int
	}{
		{0, 4, 16, 4},
		{0, 3, 16, 5},
		{0, 32, 16, 1},
		{0, 1, 1, 1},
		{0, 0, 8, 8},
		{7, 4, 16, 7},
		{1, 1, 64, 1},
	} {
		if got := Threads(c.override, c.ranks, c.cpus); got != c.want {
			t.Errorf("Threads(%d, %d, %d) = %d, want %d", c.override, c.ranks, c.cpus, got, c.want)
		}
	}
}

// TestLoadBLAS checks the GEMM policy of in-process ranks as LoadBLAS
// applies and prints it: the thread count per rank, the backend, and the
// reason, forced by LOOM_BLAS or chosen by the number of ranks.
func TestLoadBLAS(t *testing.T) {
	for _, c := range []struct {
		name, env         string
		threads, ranks    int
		want              []string // substrings of the printed line
		wantErr, wantBLAS string   // an error's text; the line's backend ("" any)
	}{
		{"forced go", "go", 3, 2, []string{"3 thread(s) per rank", `forced by LOOM_BLAS="go"`}, "", "pure-go (loom's GEMM)"},
		{"forced go, threads shared", "go", 0, 1, []string{fmt.Sprintf("%d thread(s) per rank", runtime.NumCPU()), `forced by LOOM_BLAS="go"`}, "", "pure-go (loom's GEMM)"},
		{"auto, 2 ranks", "", 1, 2, []string{"1 thread(s) per rank", "(2 in-process ranks"}, "", ""},
		{"auto, 1 rank", "", 1, 1, []string{"1 thread(s) per rank", "one rank in this process"}, "", ""},
		{"misspelt", "openblass", 0, 2, nil, `unknown GEMM backend "openblass"`, ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Setenv(kernels.EnvVar, c.env)
			var out bytes.Buffer
			b, err := LoadBLAS(&out, c.threads, c.ranks)
			if c.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), c.wantErr) {
					t.Fatalf("err = %v, want one containing %q", err, c.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			line := out.String()
			if !strings.HasPrefix(line, "GEMM: "+c.wantBLAS) || !strings.HasSuffix(line, "("+b.Reason()+")\n") || strings.Count(line, "\n") != 1 {
				t.Errorf("printed %q; want one line \"GEMM: %s...\" ending with the reason %q", line, c.wantBLAS, b.Reason())
			}
			want := c.want
			if c.env == "" && c.ranks == 1 && (strings.Contains(b.Reason(), "no CBLAS library could be loaded") || strings.Contains(b.Reason(), "OpenBLAS runs its")) {
				// One rank keeps the CBLAS library where there is one; on a
				// machine without any, or whose OpenBLAS runs kernels
				// narrower than the CPU's, the policy takes loom's GEMM and
				// says why.
				want = []string{"1 thread(s) per rank", "pure-go (loom's GEMM)"}
			}
			for _, w := range want {
				if !strings.Contains(line, w) {
					t.Errorf("printed %q; want %q in it", line, w)
				}
			}
		})
	}
}

func TestMedianTokensPerS(t *testing.T) {
	ms := func(n ...int) []time.Duration {
		d := make([]time.Duration, len(n))
		for i, v := range n {
			d[i] = time.Duration(v) * time.Millisecond
		}
		return d
	}
	for _, c := range []struct {
		name   string
		tokens float64
		steps  []time.Duration
		want   float64
	}{
		{"none", 100, nil, 0},
		{"one", 100, ms(50), 2000},
		{"odd, outliers", 100, ms(900, 10, 20, 1, 10), 10000},
		{"even takes the upper middle", 100, ms(40, 10, 20, 30), 100 / 0.03},
	} {
		if got := MedianTokensPerS(c.tokens, c.steps); got != c.want {
			t.Errorf("%s: %v tokens/s, want %v", c.name, got, c.want)
		}
	}
}

func TestFlags(t *testing.T) {
	for _, c := range []struct {
		args []string
		want Flags
	}{
		{nil, Flags{TraceSteps: 3, Device: "cpu"}},
		{[]string{"-threads", "2", "-trace", "t.json", "-trace-steps", "1", "-json", "r.json"},
			Flags{Threads: 2, TracePath: "t.json", TraceSteps: 1, JSONPath: "r.json", Device: "cpu"}},
		{[]string{"-backend", "mpi", "-bind"}, Flags{TraceSteps: 3, Backend: "mpi", Bind: true, Device: "cpu"}},
		{[]string{"-device", "emu"}, Flags{TraceSteps: 3, Device: "emu"}},
	} {
		var f Flags
		fs := flag.NewFlagSet("test", flag.ContinueOnError)
		f.Register(fs)
		if err := fs.Parse(c.args); err != nil || f != c.want {
			t.Errorf("%q: %+v, %v; want %+v", c.args, f, err, c.want)
		}
	}
}

func TestWriteJSON(t *testing.T) {
	if err := WriteJSON("", map[string]int{"a": 1}); err != nil {
		t.Errorf("empty path: %v", err)
	}
	path := filepath.Join(t.TempDir(), "run.json")
	if err := WriteJSON(path, map[string]int{"a": 1}); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(path)
	if err != nil || string(b) != "{\n  \"a\": 1\n}\n" {
		t.Errorf("wrote %q, %v", b, err)
	}
	if err := WriteJSON(path, func() {}); err == nil {
		t.Error("a func was encoded")
	}
	if b, err := os.ReadFile(path); err != nil || string(b) != "{\n  \"a\": 1\n}\n" {
		t.Errorf("a failed write changed the file: %q, %v", b, err)
	}
	if left, _ := filepath.Glob(filepath.Join(filepath.Dir(path), ".*tmp*")); len(left) > 0 {
		t.Errorf("temporary files left: %v", left)
	}
}

// TestWriteJSONWhole: while one process rewrites -json, another reading it
// (a monitor, or a script started when the run ends) sees the old file or
// the new one whole, never a truncated one.
func TestWriteJSONWhole(t *testing.T) {
	path := filepath.Join(t.TempDir(), "run.json")
	losses := make([]float64, 20000) // about 200 KB of JSON
	for i := range losses {
		losses[i] = 1 / float64(i+3)
	}
	if err := WriteJSON(path, map[string]any{"losses": losses}); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		for i := range 30 {
			losses[0] = float64(i)
			if err := WriteJSON(path, map[string]any{"losses": losses}); err != nil {
				done <- err
				return
			}
		}
		done <- nil
	}()
	reads, partial := 0, 0
	for {
		select {
		case err := <-done:
			if err != nil {
				t.Fatal(err)
			}
			if partial > 0 {
				t.Errorf("%d of %d reads saw a partial file", partial, reads)
			}
			return
		default:
		}
		b, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		reads++
		if !json.Valid(b) {
			partial++
		}
	}
}

func TestOverlap(t *testing.T) {
	us := func(n int) time.Duration { return time.Duration(n) * time.Microsecond }
	ev := func(rank int, lane trace.Lane, name string, op comm.Op, lo, hi int) trace.Event {
		return trace.Event{Rank: rank, Lane: lane, Name: name, Op: op, Start: us(lo), End: us(hi)}
	}
	ar := func(e trace.Event) bool { return e.Op == comm.OpAllReduce }
	for _, c := range []struct {
		name         string
		events       []trace.Event
		comm, hidden time.Duration
	}{
		{"nothing", nil, 0, 0},
		{"exposed", []trace.Event{ev(0, trace.LaneComm, "allreduce", comm.OpAllReduce, 0, 10)}, us(10), 0},
		{"half hidden", []trace.Event{
			ev(0, trace.LaneComm, "allreduce", comm.OpAllReduce, 0, 10),
			ev(0, trace.LaneCompute, "Linear", 0, 5, 20),
		}, us(10), us(5)},
		{"step spans are not compute", []trace.Event{
			ev(0, trace.LaneCompute, StepSpan+"1", 0, 0, 100),
			ev(0, trace.LaneComm, "allreduce", comm.OpAllReduce, 10, 20),
		}, us(10), 0},
		{"overlapping spans count once", []trace.Event{
			ev(0, trace.LaneComm, "allreduce", comm.OpAllReduce, 0, 10),
			ev(0, trace.LaneComm, "allreduce", comm.OpAllReduce, 5, 15),
			ev(0, trace.LaneCompute, "Linear", 0, 2, 4),
			ev(0, trace.LaneCompute, "Linear", 0, 3, 8),
			ev(0, trace.LaneCompute, "Add", 0, 12, 30),
		}, us(15), us(9)},
		{"other ranks, ops and lanes", []trace.Event{
			ev(1, trace.LaneComm, "allreduce", comm.OpAllReduce, 0, 10),
			ev(0, trace.LaneComm, "alltoallv", comm.OpAllToAllV, 0, 10),
			ev(0, trace.LaneWait, "allreduce", comm.OpAllReduce, 0, 10),
			ev(0, trace.LaneComm, "allreduce", comm.OpAllReduce, 20, 30),
			ev(1, trace.LaneCompute, "Linear", 0, 20, 30),
		}, us(10), 0},
		// On a device the stream lanes (when the work ran) replace the
		// host lanes (when it was queued).
		{"device streams replace the host lanes", []trace.Event{
			ev(0, trace.LaneComm, "allreduce", comm.OpAllReduce, 0, 10),
			ev(0, trace.LaneCompute, "Linear", 0, 0, 2),
			ev(0, trace.LaneStreamComm, "allreduce", comm.OpAllReduce, 20, 40),
			ev(0, trace.LaneStreamCompute, "Linear", 0, 30, 50),
		}, us(20), us(10)},
		{"host collectives against stream compute", []trace.Event{
			ev(0, trace.LaneComm, "allreduce", comm.OpAllReduce, 0, 10),
			ev(0, trace.LaneCompute, "Linear", 0, 0, 1),
			ev(0, trace.LaneStreamCompute, "Linear", 0, 5, 20),
		}, us(10), us(5)},
		{"a stream collective left out still replaces the host comm", []trace.Event{
			ev(0, trace.LaneStreamComm, "alltoallv", comm.OpAllToAllV, 0, 10),
			ev(0, trace.LaneComm, "allreduce", comm.OpAllReduce, 0, 10),
			ev(0, trace.LaneStreamCompute, "Linear", 0, 0, 10),
		}, 0, 0},
	} {
		s := Overlap(c.events, 0, ar)
		if s.Comm != c.comm || s.Hidden != c.hidden {
			t.Errorf("%s: comm %v hidden %v, want %v and %v", c.name, s.Comm, s.Hidden, c.comm, c.hidden)
		}
	}
}

// TestTracer runs steps on an in-process mesh of two ranks, each step an
// all-reduce inside a tape op, and checks that only the last steps are
// kept, that the trace is written and that the all-reduces are hidden.
func TestTracer(t *testing.T) {
	const ranks, steps = 2, 4
	for _, c := range []struct {
		name  string
		trace bool
		last  int
		kept  int // steps kept in the trace
	}{
		{"off", false, 2, 0},
		{"last one", true, 1, 1},
		{"last two", true, 2, 2},
		{"all", true, steps, steps},
		{"more than run", true, steps + 3, steps},
	} {
		t.Run(c.name, func(t *testing.T) {
			path := ""
			if c.trace {
				path = filepath.Join(t.TempDir(), "trace.json")
			}
			tracer := NewTracer(path, steps, c.last, 0)
			if tracer.Enabled() != c.trace {
				t.Fatalf("Enabled() = %v", tracer.Enabled())
			}
			err := local.Run(context.Background(), ranks, func(ctx context.Context, cm comm.Communicator) error {
				rt := tracer.Rank(cm)
				observe := rt.Observer()
				if (observe != nil) != c.trace || (len(rt.Tape()) == 1) != c.trace {
					return fmt.Errorf("observer %v, %d tape options with tracing %v", observe != nil, len(rt.Tape()), c.trace)
				}
				for i := range steps {
					span, err := rt.BeginStep(ctx, i)
					if err != nil {
						return err
					}
					t0 := time.Now()
					buf := comm.Host([]float32{1, 2})
					if err := comm.AllReduce(ctx, rt.Comm(), buf, buf, comm.Sum); err != nil {
						return err
					}
					if observe != nil {
						observe(fmt.Sprintf("op%d", i+1), "forward", t0, time.Now())
					}
					span.End()
				}
				return nil
			})
			if err != nil {
				t.Fatal(err)
			}
			var out bytes.Buffer
			events, err := tracer.Write(&out)
			if err != nil {
				t.Fatal(err)
			}
			if !c.trace {
				if out.Len() != 0 || events != nil {
					t.Errorf("no trace asked for, wrote %q and %d events", out.String(), len(events))
				}
				return
			}
			if want := fmt.Sprintf("trace of the last %d step(s) written to %s", c.kept, path); !strings.Contains(out.String(), want) {
				t.Errorf("output %q lacks %q", out.String(), want)
			}
			b, err := os.ReadFile(path)
			if err != nil {
				t.Fatal(err)
			}
			var chrome struct {
				TraceEvents []json.RawMessage `json:"traceEvents"`
			}
			if err := json.Unmarshal(b, &chrome); err != nil || len(chrome.TraceEvents) == 0 {
				t.Errorf("trace file: %d events, %v", len(chrome.TraceEvents), err)
			}
			for rank := range ranks {
				var ops, stepSpans []string
				for _, e := range events {
					if e.Rank == rank && e.Lane == trace.LaneCompute {
						if e.Cat == "" {
							stepSpans = append(stepSpans, e.Name)
						} else {
							ops = append(ops, e.Name)
						}
					}
				}
				var wantOps, wantSpans []string
				for s := steps - c.kept + 1; s <= steps; s++ {
					wantOps = append(wantOps, fmt.Sprintf("op%d", s))
					wantSpans = append(wantSpans, fmt.Sprintf("%s%d", StepSpan, s))
				}
				if strings.Join(ops, ",") != strings.Join(wantOps, ",") || strings.Join(stepSpans, ",") != strings.Join(wantSpans, ",") {
					t.Errorf("rank %d: ops %v and step spans %v, want %v and %v", rank, ops, stepSpans, wantOps, wantSpans)
				}
				s := Overlap(events, rank, func(e trace.Event) bool { return e.Op == comm.OpAllReduce })
				if s.Comm <= 0 || s.Hidden != s.Comm {
					t.Errorf("rank %d: all-reduce %v, %v hidden; want all of it", rank, s.Comm, s.Hidden)
				}
			}
		})
	}
	if _, err := NewTracer(filepath.Join(t.TempDir(), "missing", "trace.json"), 1, 1, 0).Write(io.Discard); err == nil {
		t.Error("wrote into a missing folder")
	}
}

// TestTracerPerProcess traces each of 3 in-process ranks on a Tracer of
// its own, as one process per rank does, and merges them with Gather:
// rank 0's trace has every rank's last step, and every rank dropped its
// own earlier steps.
func TestTracerPerProcess(t *testing.T) {
	const ranks, steps, last = 3, 3, 1
	path := filepath.Join(t.TempDir(), "trace.json")
	var root *Tracer
	err := local.Run(context.Background(), ranks, func(ctx context.Context, cm comm.Communicator) error {
		tracer := NewTracer(path, steps, last, cm.Rank())
		rt := tracer.Rank(cm)
		for i := range steps {
			span, err := rt.BeginStep(ctx, i)
			if err != nil {
				return err
			}
			buf := comm.Host([]float32{1})
			if err := comm.AllReduce(ctx, rt.Comm(), buf, buf, comm.Sum); err != nil {
				return err
			}
			span.End()
		}
		if err := tracer.Gather(ctx, cm); err != nil {
			return err
		}
		if cm.Rank() == 0 {
			root = tracer
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	events, err := root.Write(io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	spans := map[int][]string{}
	for _, e := range events {
		if strings.HasPrefix(e.Name, StepSpan) {
			spans[e.Rank] = append(spans[e.Rank], e.Name)
		}
		if e.Lane == trace.LaneComm && e.Op == comm.OpAllReduce && e.Group != "[0,1,2]" {
			t.Errorf("rank %d's all-reduce is on group %q, want [0,1,2]", e.Rank, e.Group)
		}
	}
	for r := range ranks {
		if got := strings.Join(spans[r], ","); got != StepSpan+"3" {
			t.Errorf("rank %d: step spans %q, want only the last step's", r, got)
		}
	}
}

func TestRunJob(t *testing.T) {
	loop := Loop{Ranks: 2, Steps: 1, Every: 1, Flags: Flags{TraceSteps: 1}}
	setup := func(context.Context, Rank) (Stepper[int], error) { return nil, nil }
	three, err := launch.InProcess(3)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name string
		job  *launch.Job
		want string
	}{
		{"nil job", nil, "nil job"},
		{"world size", three, "the local job has 3 ranks, the layout needs 2"},
	} {
		_, err := Run(context.Background(), nil, c.job, loop, setup, nil)
		if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, want ErrInvalid with %q", c.name, err, c.want)
		}
	}
}

// TestTracerOnDevice traces steps of two ranks on emulated devices: each
// step queues a 5 ms sleep on the rank's compute stream inside an
// observed op, and EndStep reads the stream events, so the kept steps
// (and only those) have a "stream compute" span of the op lasting at
// least the sleep, while the host op span (the queueing) is shorter.
func TestTracerOnDevice(t *testing.T) {
	const ranks, steps, last, sleep = 2, 3, 2, 5 * time.Millisecond
	tracer := NewTracer(filepath.Join(t.TempDir(), "trace.json"), steps, last, 0)
	err := local.Run(context.Background(), ranks, func(ctx context.Context, cm comm.Communicator) (err error) {
		rt := tracer.Rank(cm)
		d, err := emu.New(cm.Rank())
		if err != nil {
			return err
		}
		defer d.Close()
		rt.OnDevice(d)
		defer func() {
			if cerr := rt.Close(); err == nil {
				err = cerr
			}
		}()
		observe := rt.Observer()
		for i := range steps {
			span, err := rt.BeginStep(ctx, i)
			if err != nil {
				return err
			}
			t0 := time.Now()
			if err := d.Compute().(*emu.Stream).Launch(func() error { time.Sleep(sleep); return nil }); err != nil {
				return err
			}
			observe(fmt.Sprintf("op%d", i+1), "forward", t0, time.Now())
			if err := rt.EndStep(span); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	events, err := tracer.Write(io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	for rank := range ranks {
		host, dev := map[string]time.Duration{}, map[string]time.Duration{}
		for _, e := range events {
			switch {
			case e.Rank != rank:
			case e.Lane == trace.LaneCompute && e.Cat == "forward":
				host[e.Name] = e.Duration()
			case e.Lane == trace.LaneStreamCompute:
				dev[e.Name] = e.Duration()
			}
		}
		if len(dev) != last {
			t.Errorf("rank %d: stream spans %v, want the last %d steps' ops", rank, dev, last)
		}
		for s := steps - last + 1; s <= steps; s++ {
			name := fmt.Sprintf("op%d", s)
			if dev[name] < sleep || host[name] >= dev[name] {
				t.Errorf("rank %d: %s ran %v on the stream (queued in %v), want at least %v", rank, name, dev[name], host[name], sleep)
			}
		}
	}
}
