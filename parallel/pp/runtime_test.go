package pp_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"sync"
	"testing"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/parallel"
	"github.com/b7ea7098/loom/parallel/pp"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/trace"
)

// linearStages returns, for the stages a rank holds, a StageFunc each: a
// Linear 4→4 on a [2, 4] micro-batch (the first stage makes it from mb),
// the last stage summing its output into the loss.
func linearStages(t *tape, s *pp.Schedule, rank int) (map[int]pp.StageFunc, error) {
	funcs := map[int]pp.StageFunc{}
	for _, k := range s.StagesOf(rank) {
		l, err := parallel.NewLinear(t.tape, t.mesh, 4, 4, parallel.WithName(fmt.Sprintf("s%d", k)))
		if err != nil {
			return nil, err
		}
		last := k == s.Stages()-1
		funcs[k] = func(ctx context.Context, mb int, x *autograd.Value) (*autograd.Value, error) {
			if x == nil {
				sp, err := placement.NewSpec(t.mesh, []int{2, 4}, comm.Float32, []placement.Placement{placement.Replicate()})
				if err != nil {
					return nil, err
				}
				d := make([]float32, 8)
				for i := range d {
					d[i] = float32(mb+i) / 8
				}
				dt, err := placement.NewLocal(sp, d)
				if err != nil {
					return nil, err
				}
				if x, err = t.tape.Constant(dt); err != nil {
					return nil, err
				}
			}
			y, err := l.Forward(ctx, x)
			if err != nil || !last {
				return y, err
			}
			return autograd.Sum(y)
		}
	}
	return funcs, nil
}

type tape struct {
	tape *autograd.Tape
	mesh *mesh.Mesh
}

// runSchedule runs one step of s on in-process ranks, with fn's options,
// and returns each rank's stats.
func runSchedule(t *testing.T, s *pp.Schedule, opts func(rank int) []pp.Option) ([]*pp.StepStats, error) {
	return runScheduleOn(t, "local", s, opts)
}

// runScheduleOn is runSchedule on backend's ranks (pp.RunOn).
func runScheduleOn(t *testing.T, backend string, s *pp.Schedule, opts func(rank int) []pp.Option) ([]*pp.StepStats, error) {
	t.Helper()
	stats := make([]*pp.StepStats, s.Ranks)
	var mu sync.Mutex
	err := pp.RunOn(t, backend, s.Ranks, func(ctx context.Context, c comm.Communicator) error {
		m, err := mesh.New(c, []int{s.Ranks, 1}, []string{"pp", "dp"})
		if err != nil {
			return err
		}
		tr, err := pp.NewTransport(ctx, m, "pp")
		if err != nil {
			return err
		}
		tp := &tape{tape: autograd.NewTape(), mesh: tr.Mesh()}
		funcs, err := linearStages(tp, s, tr.Rank())
		if err != nil {
			return err
		}
		var o []pp.Option
		if opts != nil {
			o = opts(tr.Rank())
		}
		rt, err := pp.NewRuntime(s, tp.tape, tr, funcs, o...)
		if err != nil {
			return err
		}
		st, err := rt.Step(ctx)
		if err != nil {
			return err
		}
		mu.Lock()
		defer mu.Unlock()
		stats[tr.Rank()] = st
		return nil
	})
	return stats, err
}

// TestRuntimeTraceAndMemory: every action becomes a span named by kind,
// stage and micro-batch on its rank's row; the bubble is an idle fraction
// in (0, 1); each stage's peak of micro-batches held is the validator's
// prediction, at most pp for 1F1B and M for GPipe.
func TestRuntimeTraceAndMemory(t *testing.T) {
	const ranks, m = 2, 4
	for _, c := range []struct {
		name string
		max  int
	}{{"gpipe", m}, {"1f1b", ranks}, {"zb1", ranks}} {
		t.Run(c.name, func(t *testing.T) {
			s, err := pp.Build(c.name, ranks, m, 0)
			if err != nil {
				t.Fatal(err)
			}
			tl := trace.NewTimeline()
			stats, err := runSchedule(t, s, func(rank int) []pp.Option { return []pp.Option{pp.WithTimeline(tl, rank)} })
			if err != nil {
				t.Fatal(err)
			}
			low, err := pp.Lower(s)
			if err != nil {
				t.Fatal(err)
			}
			peaks, err := low.PeakActivations()
			if err != nil {
				t.Fatal(err)
			}
			names := map[int][]string{}
			for _, e := range tl.Events() {
				names[e.Rank] = append(names[e.Rank], e.Name)
			}
			for r, st := range stats {
				if len(names[r]) != len(low.Actions[r]) {
					t.Errorf("rank %d: %d spans for %d actions", r, len(names[r]), len(low.Actions[r]))
				}
				if !(st.Bubble > 0 && st.Bubble < 1) || st.Busy <= 0 || st.Wall < st.Busy {
					t.Errorf("rank %d: bubble %v (busy %v of %v)", r, st.Bubble, st.Busy, st.Wall)
				}
				for stage, held := range st.PeakHeld {
					if held != peaks[stage] || held > c.max {
						t.Errorf("rank %d stage %d: peak %d micro-batches held; predicted %d, at most %d", r, stage, held, peaks[stage], c.max)
					}
				}
				if st.PeakActivationBytes <= 0 {
					t.Errorf("rank %d: no activation bytes counted", r)
				}
			}
			if !strings.Contains(strings.Join(names[0], ","), "F s0 mb0") {
				t.Errorf("rank 0's spans: %v", names[0])
			}
		})
	}
}

// TestRuntimeRefuses: NewRuntime refuses what it cannot run, before any
// data moves.
func TestRuntimeRefuses(t *testing.T) {
	s, err := pp.Build("1f1b", 2, 2, 0)
	if err != nil {
		t.Fatal(err)
	}
	fsdp, err := pp.Lower(s, pp.WithFSDP())
	if err != nil {
		t.Fatal(err)
	}
	reduce, err := pp.Lower(s, pp.WithReduceGrad())
	if err != nil {
		t.Fatal(err)
	}
	unshard := func(context.Context, int) (func(context.Context) error, error) { return nil, nil }
	for _, c := range []struct {
		name string
		s    *pp.Schedule
		opts []pp.Option
		want string
	}{
		{"FSDP actions without functions", fsdp, nil, "WithSharding"},
		{"ReduceGrad without a function", reduce, nil, "WithGradReduction"},
		{"WithSharding without reshard", s, []pp.Option{pp.WithSharding(unshard, nil)}, "WithSharding needs both"},
	} {
		_, err := runSchedule(t, c.s, func(int) []pp.Option { return c.opts })
		if !errors.Is(err, pp.ErrInvalid) || !strings.Contains(fmt.Sprint(err), c.want) {
			t.Errorf("%s: %v, want ErrInvalid containing %q", c.name, err, c.want)
		}
	}
}

// TestRuntimeBackends: a step over comm/tcp's ranks (real connections)
// gives the loss of the step over comm/local's, bit for bit, for a
// schedule with split backwards and one with stages sharing a rank.
func TestRuntimeBackends(t *testing.T) {
	for _, name := range []string{"zb1", "zbv"} {
		s, err := pp.Build(name, 2, 3, 0)
		if err != nil {
			t.Fatal(err)
		}
		var loss [2]float64
		for i, backend := range []string{"local", "tcp"} {
			stats, err := runScheduleOn(t, backend, s, nil)
			if err != nil {
				t.Fatalf("%s on %s: %v", name, backend, err)
			}
			loss[i] = stats[s.RankOf(s.Stages()-1)].Loss
		}
		if math.Float64bits(loss[0]) != math.Float64bits(loss[1]) || math.IsNaN(loss[0]) {
			t.Errorf("%s: loss %v on local, %v on tcp", name, loss[0], loss[1])
		}
	}
}

// TestRuntimeSharding: with WithSharding the runtime runs each stage's
// UNSHARD (starting the all-gather), waits for it just before the
// stage's first compute action and no earlier, and runs its RESHARD after
// its last, once per step each, for every stage of the rank (interleaved:
// two per rank); the three are spans of the comm lane. A failed wait
// fails the step naming the compute action that waited.
func TestRuntimeSharding(t *testing.T) {
	s, err := pp.Build("interleaved", 2, 2, 2)
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	log := map[int][]string{} // per pp rank
	note := func(rank int, what string) {
		mu.Lock()
		defer mu.Unlock()
		log[rank] = append(log[rank], what)
	}
	tl := trace.NewTimeline()
	opts := func(rank int) []pp.Option {
		return []pp.Option{pp.WithTimeline(tl, rank), pp.WithSharding(
			func(ctx context.Context, stage int) (func(context.Context) error, error) {
				note(rank, fmt.Sprintf("unshard %d", stage))
				return func(context.Context) error { note(rank, fmt.Sprintf("wait %d", stage)); return nil }, nil
			},
			func(ctx context.Context, stage int) error { note(rank, fmt.Sprintf("reshard %d", stage)); return nil },
		)}
	}
	if _, err := runSchedule(t, s, opts); err != nil {
		t.Fatal(err)
	}
	low, err := pp.Lower(s, pp.WithFSDP())
	if err != nil {
		t.Fatal(err)
	}
	for r, acts := range low.Actions {
		// What the log must be: per stage, unshard at UNSHARD, wait at
		// the stage's first compute action, reshard at RESHARD.
		var want []string
		waited := map[int]bool{}
		for _, a := range acts {
			switch {
			case a.Kind == pp.Unshard:
				want = append(want, fmt.Sprintf("unshard %d", a.Stage))
			case a.Kind == pp.Reshard:
				want = append(want, fmt.Sprintf("reshard %d", a.Stage))
			case a.Kind.Compute() && !waited[a.Stage]:
				waited[a.Stage] = true
				want = append(want, fmt.Sprintf("wait %d", a.Stage))
			}
		}
		if got := strings.Join(log[r], ", "); got != strings.Join(want, ", ") {
			t.Errorf("rank %d: %s\nwant %s", r, got, strings.Join(want, ", "))
		}
	}
	comm := map[string]bool{}
	for _, e := range tl.Events() {
		if e.Lane == trace.LaneComm {
			comm[e.Name] = true
		}
	}
	for _, n := range []string{"UNSHARD s0", "UNSHARD s0 wait", "RESHARD s0", "UNSHARD s3 wait"} {
		if !comm[n] {
			t.Errorf("no span %q on the comm lane", n)
		}
	}

	broken := errors.New("all-gather failed")
	_, err = runSchedule(t, s, func(rank int) []pp.Option {
		return []pp.Option{pp.WithSharding(
			func(ctx context.Context, stage int) (func(context.Context) error, error) {
				return func(context.Context) error { return broken }, nil
			},
			func(ctx context.Context, stage int) error { return nil },
		)}
	})
	if !errors.Is(err, broken) || !strings.Contains(fmt.Sprint(err), "(0F0): stage 0's all-gather") {
		t.Errorf("a failed all-gather: %v", err)
	}
}
