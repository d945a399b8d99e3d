package tests

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/b7ea7098/loom"
	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/local"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/parallel/ddp"
	"github.com/b7ea7098/loom/placement"
)

// The fault-injection table: in-process worlds of p = 2, 3, 4 ranks where
// one rank (the last) misbehaves. Every case must end on every rank within
// twice the communicator's timeout, with an error that matches the
// case's sentinel and names the faulty rank, or, for the cases that must
// succeed, with the right data. A watchdog turns a case that does not end
// into a counted hang instead of a hung test.

// faultTimeout is the communicator timeout of every case.
const faultTimeout = 300 * time.Millisecond

// hangAfter is when the watchdog declares a case hung: twice the timeout
// and a margin for a machine shared with other work.
const hangAfter = 2*faultTimeout + 2*time.Second

// errInjected is what a faulty rank returns.
var errInjected = errors.New("injected fault")

// faultCase is one row of the table. body runs on every rank of a world
// of p ranks whose faulty rank is f; check judges rank r's result.
type faultCase struct {
	name  string
	body  func(ctx context.Context, c comm.Communicator, f int) error
	check func(r, f int, err error) error
	// dependsOn names work of another branch the case needs to pass.
	dependsOn string
}

// expect returns a check: every rank's error matches target and names the
// faulty rank. self, when set, is the faulty rank's own target.
func expect(target, self error) func(r, f int, err error) error {
	return func(r, f int, err error) error {
		want := target
		if r == f && self != nil {
			want = self
		}
		switch {
		case err == nil:
			return fmt.Errorf("no error, want %v", want)
		case !errors.Is(err, want):
			return fmt.Errorf("%v, want an error matching %v", err, want)
		case r != f && !strings.Contains(err.Error(), fmt.Sprintf("rank %d", f)):
			return fmt.Errorf("%v does not name the faulty rank %d", err, f)
		}
		return nil
	}
}

// succeed is the check of a case that must succeed (its body checks data).
func succeed(_, _ int, err error) error { return err }

// floats is rank r's input of n float32s: r+1 at every index i, plus i.
func floats(r, n int) []float32 {
	x := make([]float32, n)
	for i := range x {
		x[i] = float32(r + 1 + i)
	}
	return x
}

// sumCheck all-reduces floats(rank, n) under ctx and checks the sum.
func sumCheck(ctx context.Context, c comm.Communicator, n int) error {
	x := floats(c.Rank(), n)
	if err := comm.AllReduce(ctx, c, comm.Host(x), comm.Host(x), comm.Sum); err != nil {
		return err
	}
	p := c.Size()
	for i, v := range x {
		if want := float32(p*(p+1)/2 + p*i); v != want {
			return fmt.Errorf("%w: allreduce element %d = %v, want %v", errWrong, i, v, want)
		}
	}
	return nil
}

// errWrong marks a wrong result found by a case's own check.
var errWrong = errors.New("wrong result")

// steps runs three different collectives, so that a rank that skips or
// changes one is out of step with its peers: allreduce(4), broadcast(3)
// from root 0, allreduce(8). fault, when it returns true for step i,
// replaces that step on the faulty rank.
func steps(ctx context.Context, c comm.Communicator, f int, fault func(i int) (bool, error)) error {
	for i := range 3 {
		if c.Rank() == f && fault != nil {
			if done, err := fault(i); done {
				if err != nil {
					return err
				}
				continue
			}
		}
		var err error
		switch i {
		case 0:
			err = sumCheck(ctx, c, 4)
		case 1:
			err = comm.Broadcast(ctx, c, comm.Host(floats(c.Rank(), 3)), 0)
		case 2:
			err = sumCheck(ctx, c, 8)
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// at replaces step want by do on the faulty rank.
func at(want int, do func() error) func(i int) (bool, error) {
	return func(i int) (bool, error) {
		if i != want {
			return false, nil
		}
		return true, do()
	}
}

func faultCases() []faultCase {
	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	return []faultCase{
		{name: "no fault", check: succeed, body: func(ctx context.Context, c comm.Communicator, f int) error {
			return steps(ctx, c, f, nil)
		}},
		{name: "rank errors", check: expect(comm.ErrAborted, errInjected), body: func(ctx context.Context, c comm.Communicator, f int) error {
			return steps(ctx, c, f, at(1, func() error { return errInjected }))
		}},
		{name: "rank panics", check: expect(comm.ErrAborted, errPanicked), body: func(ctx context.Context, c comm.Communicator, f int) error {
			return steps(ctx, c, f, at(1, func() error { panic("injected panic") }))
		}},
		{name: "skips a collective", check: expect(comm.ErrMismatch, nil), body: func(ctx context.Context, c comm.Communicator, f int) error {
			return steps(ctx, c, f, at(1, func() error { return nil }))
		}},
		{name: "different op", check: expect(comm.ErrMismatch, nil), body: func(ctx context.Context, c comm.Communicator, f int) error {
			return steps(ctx, c, f, at(0, func() error { return comm.Broadcast(ctx, c, comm.Host(floats(f, 4)), 0) }))
		}},
		{name: "different dtype", check: expect(comm.ErrMismatch, nil), body: func(ctx context.Context, c comm.Communicator, f int) error {
			return steps(ctx, c, f, at(0, func() error {
				x := comm.Host(make([]float64, 4))
				return comm.AllReduce(ctx, c, x, x, comm.Sum)
			}))
		}},
		{name: "different count", check: expect(comm.ErrMismatch, nil), body: func(ctx context.Context, c comm.Communicator, f int) error {
			return steps(ctx, c, f, at(0, func() error { return sumCheck(ctx, c, 5) }))
		}},
		{name: "different root", check: expect(comm.ErrMismatch, nil), body: func(ctx context.Context, c comm.Communicator, f int) error {
			return steps(ctx, c, f, at(1, func() error { return comm.Broadcast(ctx, c, comm.Host(floats(f, 3)), 1) }))
		}},
		{name: "bad alltoallv split", check: expect(comm.ErrInvalid, nil), body: alltoallvBody(true)},
		{name: "alltoallv", check: succeed, body: alltoallvBody(false)},
		{name: "cancelled context, arrives first", check: expect(comm.ErrAborted, context.Canceled), body: func(ctx context.Context, c comm.Communicator, f int) error {
			if c.Rank() != f {
				time.Sleep(50 * time.Millisecond)
				return sumCheck(ctx, c, 4)
			}
			return sumCheck(cancelled, c, 4)
		}},
		{name: "cancelled context, arrives last", check: expect(comm.ErrAborted, context.Canceled), body: func(ctx context.Context, c comm.Communicator, f int) error {
			if c.Rank() != f {
				return sumCheck(ctx, c, 4)
			}
			time.Sleep(50 * time.Millisecond) // the peers wait in the allreduce
			return sumCheck(cancelled, c, 4)
		}},
		{name: "context cancelled during the call", check: expect(comm.ErrAborted, context.Canceled), body: func(ctx context.Context, c comm.Communicator, f int) error {
			if c.Rank() != f {
				time.Sleep(150 * time.Millisecond)
				return sumCheck(ctx, c, 4)
			}
			ctx, cancel := context.WithCancel(ctx)
			defer time.AfterFunc(50*time.Millisecond, cancel).Stop()
			return sumCheck(ctx, c, 4)
		}},
		{name: "context cancelled during async work", check: expect(comm.ErrAborted, context.Canceled), body: func(ctx context.Context, c comm.Communicator, f int) error {
			if c.Rank() != f {
				time.Sleep(150 * time.Millisecond)
				return sumCheck(ctx, c, 4)
			}
			x := comm.Host(floats(f, 4))
			w, err := comm.AllReduceAsync(ctx, c, x, x, comm.Sum)
			if err != nil {
				return err
			}
			ctx, cancel := context.WithCancel(ctx)
			defer time.AfterFunc(50*time.Millisecond, cancel).Stop()
			return w.Wait(ctx)
		}},
		{name: "context cancelled after the call", check: succeed, body: func(ctx context.Context, c comm.Communicator, f int) error {
			ctx, cancel := context.WithCancel(ctx)
			err := sumCheck(ctx, c, 4)
			cancel() // a completed call stays completed
			return err
		}},
		{name: "timeout (rank alive, never joins)", check: expect(comm.ErrTimeout, nil), body: func(ctx context.Context, c comm.Communicator, f int) error {
			return steps(ctx, c, f, at(1, func() error {
				<-ctx.Done() // Run cancels it once a peer has failed
				return c.Err()
			}))
		}},
		{name: "async barrier timeout", check: expect(comm.ErrTimeout, nil), body: func(ctx context.Context, c comm.Communicator, f int) error {
			if c.Rank() == f {
				<-ctx.Done()
				return c.Err()
			}
			w, err := comm.BarrierAsync(ctx, c)
			if err != nil {
				return err
			}
			return w.Wait(ctx)
		}},
		{name: "rank returns early", check: expect(local.ErrRankLeft, errInjected), body: func(ctx context.Context, c comm.Communicator, f int) error {
			return steps(ctx, c, f, at(1, func() error { return errEarly }))
		}},
		{name: "DDP parameter lists agree", check: succeed, body: ddpBody(nil)},
		{name: "DDP parameter lists differ in order", check: expect(loom.ErrMismatch, nil), dependsOn: "h19-agree", body: ddpBody(func(w, b *autograd.Value) []*autograd.Value {
			return []*autograd.Value{b, w}
		})},
		// Until New checks that the lists agree, a shape or dtype that
		// differs is caught by the bucket all-reduces, whose counts or
		// dtypes differ; a different order is not caught at all.
		{name: "DDP parameter lists differ in shape", check: expect(loom.ErrMismatch, nil), body: ddpShapeBody([]int{2, 4}, comm.Float64)},
		{name: "DDP parameter lists differ in dtype", check: expect(loom.ErrMismatch, nil), body: ddpShapeBody([]int{2, 3}, comm.Float32)},
	}
}

// errPanicked matches the error local.Run makes of a rank's panic.
var errPanicked = errors.New("panic")

// errEarly is returned by a rank that leaves for good before its peers
// are done; Run reports no error for it, so that the peers see only that
// it left. The case's body returns nil in its place (see run).
var errEarly = errors.New("left early")

// alltoallvBody exchanges r+1+j elements from rank r to rank j; with
// bad, the faulty rank expects one element too many from rank 0.
func alltoallvBody(bad bool) func(ctx context.Context, c comm.Communicator, f int) error {
	return func(ctx context.Context, c comm.Communicator, f int) error {
		p, r := c.Size(), c.Rank()
		send, recv := make([]int, p), make([]int, p)
		var sendData []float32
		for j := range p {
			send[j], recv[j] = r+1+j, j+1+r
			for k := range send[j] {
				sendData = append(sendData, float32(100*r+10*j+k))
			}
		}
		if bad && r == f {
			recv[0]++
		}
		n := 0
		for _, v := range recv {
			n += v
		}
		got := make([]float32, n)
		if err := comm.AllToAllV(ctx, c, comm.Host(sendData), comm.Host(got), send, recv); err != nil {
			return err
		}
		at := 0
		for q := range p {
			for k := range recv[q] {
				if want := float32(100*q + 10*r + k); got[at] != want {
					return fmt.Errorf("%w: alltoallv from rank %d element %d = %v, want %v", errWrong, q, k, got[at], want)
				}
				at++
			}
		}
		return nil
	}
}

// ddpParams makes w (shape, dtype) and b [2] (float64) on a "dp" mesh of
// c's ranks, and rank-dependent constants x and y of their shapes.
func ddpParams(c comm.Communicator, wShape []int, wType comm.DType) (tape *autograd.Tape, m *mesh.Mesh, w, b, x, y *autograd.Value, err error) {
	m, err = mesh.New(c, []int{c.Size()}, []string{"dp"})
	if err != nil {
		return
	}
	tape = autograd.NewTape()
	value := func(shape []int, dt comm.DType, fill func(i int) float64, name string) (*autograd.Value, error) {
		spec, err := placement.NewSpec(m, shape, dt, []placement.Placement{placement.Replicate()})
		if err != nil {
			return nil, err
		}
		n := 1
		for _, d := range shape {
			n *= d
		}
		var data any
		if dt == comm.Float32 {
			v := make([]float32, n)
			for i := range v {
				v[i] = float32(fill(i))
			}
			data = v
		} else {
			v := make([]float64, n)
			for i := range v {
				v[i] = fill(i)
			}
			data = v
		}
		dt2, err := placement.NewLocal(spec, data)
		if err != nil {
			return nil, err
		}
		if name == "" {
			return tape.Constant(dt2)
		}
		return tape.Param(name, dt2)
	}
	r := float64(c.Rank())
	if w, err = value(wShape, wType, func(i int) float64 { return 0.5 }, "w"); err != nil {
		return
	}
	if b, err = value([]int{2}, comm.Float64, func(i int) float64 { return 0.25 }, "b"); err != nil {
		return
	}
	if x, err = value(wShape, wType, func(i int) float64 { return r + float64(i) }, ""); err != nil {
		return
	}
	y, err = value([]int{2}, comm.Float64, func(i int) float64 { return 10*r + float64(i) }, "")
	return
}

// ddpStep builds a DDP over params, runs ddpLoss backward and Finish, and returns the reduced gradients of w and b.
func ddpStep(ctx context.Context, tape *autograd.Tape, params []*autograd.Value, w, b, x, y *autograd.Value) (gw, gb []float64, err error) {
	d, err := ddp.New(ctx, params)
	if err != nil {
		return nil, nil, err
	}
	loss, err := ddpLoss(w, b, x, y)
	if err != nil {
		return nil, nil, err
	}
	if err := tape.Backward(ctx, loss); err != nil {
		return nil, nil, err
	}
	if err := d.Finish(ctx); err != nil {
		return nil, nil, err
	}
	return asFloat64(w.Grad()), asFloat64(b.Grad()), nil
}

// ddpLoss is sum(w·x) + sum(b·y); when w and b differ in dtype (Add
// needs one) it is sum(b·y) alone: that case is about New, not the loss.
func ddpLoss(w, b, x, y *autograd.Value) (*autograd.Value, error) {
	by, err := autograd.Mul(b, y)
	if err != nil {
		return nil, err
	}
	s2, err := autograd.Sum(by)
	if err != nil || w.Spec().DType() != b.Spec().DType() {
		return s2, err
	}
	wx, err := autograd.Mul(w, x)
	if err != nil {
		return nil, err
	}
	s1, err := autograd.Sum(wx)
	if err != nil {
		return nil, err
	}
	return autograd.Add(s1, s2)
}

func asFloat64(g *placement.DTensor) []float64 {
	if g == nil {
		return nil
	}
	switch v := g.LocalData().(type) {
	case []float64:
		return slices.Clone(v)
	case []float32:
		out := make([]float64, len(v))
		for i, f := range v {
			out[i] = float64(f)
		}
		return out
	}
	return nil
}

// ddpBody runs one DDP step; the faulty rank lists its parameters by
// reorder (nil: in the same order). It checks the reduced gradients.
func ddpBody(reorder func(w, b *autograd.Value) []*autograd.Value) func(ctx context.Context, c comm.Communicator, f int) error {
	return func(ctx context.Context, c comm.Communicator, f int) error {
		tape, _, w, b, x, y, err := ddpParams(c, []int{2, 3}, comm.Float64)
		if err != nil {
			return err
		}
		params := []*autograd.Value{w, b}
		if c.Rank() == f && reorder != nil {
			params = reorder(w, b)
		}
		gw, gb, err := ddpStep(ctx, tape, params, w, b, x, y)
		if err != nil {
			return err
		}
		// Every value is Replicate, so each rank's gradient is the whole
		// gradient of a replicated loss: DDP keeps rank 0's (x and y at
		// r = 0, which are i) and zeroes the others' before the sum. A
		// rank whose buckets hold another order reads them mixed.
		for i, g := range gw {
			if want := float64(i); g != want {
				return fmt.Errorf("%w: DDP gradient of w[%d] = %v, want %v (all: %v)", errWrong, i, g, want, gw)
			}
		}
		for i, g := range gb {
			if want := float64(i); g != want {
				return fmt.Errorf("%w: DDP gradient of b[%d] = %v, want %v (all: %v)", errWrong, i, g, want, gb)
			}
		}
		if len(gw) != 6 || len(gb) != 2 {
			return fmt.Errorf("%w: DDP gradients %v and %v, want 6 and 2 elements", errWrong, gw, gb)
		}
		return nil
	}
}

// ddpShapeBody runs one DDP step where the faulty rank's w has shape and
// dtype in place of [2 3] float64.
func ddpShapeBody(shape []int, dt comm.DType) func(ctx context.Context, c comm.Communicator, f int) error {
	return func(ctx context.Context, c comm.Communicator, f int) error {
		wShape, wType := []int{2, 3}, comm.Float64
		if c.Rank() == f {
			wShape, wType = shape, dt
		}
		tape, _, w, b, x, y, err := ddpParams(c, wShape, wType)
		if err != nil {
			return err
		}
		_, _, err = ddpStep(ctx, tape, []*autograd.Value{w, b}, w, b, x, y)
		return err
	}
}

// faultCounts are the table's totals.
type faultCounts struct {
	cases, errors, successes, hangs, panics, wrong int
}

func (n faultCounts) String() string {
	return fmt.Sprintf("cases %d, errors %d, successes %d, hangs %d, panics %d, wrong results %d",
		n.cases, n.errors, n.successes, n.hangs, n.panics, n.wrong)
}

// faultFamilies are the row families counted apart: rows named with the
// prefix "FSDP " or "DDP ", and the communicator's rows (the rest).
func faultFamilies() []string { return []string{"FSDP", "DDP", "comm"} }

// familyOf is the family of a row's name.
func familyOf(name string) string {
	for _, f := range []string{"FSDP", "DDP"} {
		if strings.HasPrefix(name, f+" ") {
			return f
		}
	}
	return "comm"
}

// faultOutcome is what one case did on each rank.
type faultOutcome struct {
	errs   []error
	ends   []time.Duration // when each rank's body returned, from the start
	runErr error
	panic  any // a panic that escaped local.Run
}

// runFault runs fc on p ranks.
func runFault(fc faultCase, p int) (o faultOutcome) {
	defer func() {
		if v := recover(); v != nil {
			o.panic = v
		}
	}()
	f := p - 1
	o.errs = make([]error, p)
	o.ends = make([]time.Duration, p)
	start := time.Now()
	o.runErr = local.Run(context.Background(), p, func(ctx context.Context, c comm.Communicator) (err error) {
		r := c.Rank()
		defer func() {
			o.ends[r] = time.Since(start)
			if v := recover(); v != nil {
				o.errs[r] = fmt.Errorf("%w: %v", errPanicked, v)
				panic(v) // for local.Run to recover, as it must
			}
		}()
		err = fc.body(ctx, c, f)
		o.errs[r] = err
		if errors.Is(err, errEarly) {
			o.errs[r] = errInjected
			return nil // leaves without error; peers must see that it left
		}
		return err
	}, local.WithOptions(comm.Options{Timeout: faultTimeout}))
	return o
}

// judge returns what is wrong with o, or nil; panicked reports a panic
// that loom let through or raised itself.
func judge(fc faultCase, p int, o faultOutcome) (problems []string, panicked bool) {
	f := p - 1
	if o.panic != nil {
		return []string{fmt.Sprintf("panic escaped local.Run: %v", o.panic)}, true
	}
	for r, err := range o.errs {
		if e := fc.check(r, f, err); e != nil {
			problems = append(problems, fmt.Sprintf("rank %d: %v", r, e))
		}
		if err != nil && strings.Contains(err.Error(), "panic") && !errors.Is(err, errPanicked) &&
			!strings.Contains(fc.name, "panic") {
			panicked = true
			problems = append(problems, fmt.Sprintf("rank %d: loom panicked: %v", r, err))
		}
		if o.ends[r] > 2*faultTimeout {
			problems = append(problems, fmt.Sprintf("rank %d ended after %v, more than twice the %v timeout", r, o.ends[r].Round(time.Millisecond), faultTimeout))
		}
	}
	if strings.Contains(fc.name, "panic") && (o.runErr == nil || !strings.Contains(o.runErr.Error(), fmt.Sprintf("rank %d: panic", f))) {
		problems = append(problems, fmt.Sprintf("local.Run returned %v, want the panic of rank %d", o.runErr, f))
	}
	return problems, panicked
}

// TestFaultTable runs the fault-injection table at p = 2, 3, 4 and
// fails unless no case hangs, panics or ends with a wrong result (a
// missing or wrong error counts as a wrong result).
func TestFaultTable(t *testing.T) {
	t.Setenv(comm.CostModelEnv, comm.CostModelOff) // worlds need no calibration
	var n faultCounts
	family := map[string]*faultCounts{}
	for _, f := range faultFamilies() {
		family[f] = &faultCounts{}
	}
	for _, fc := range append(faultCases(), fsdpFaultCases()...) {
		fam := family[familyOf(fc.name)]
		for _, p := range []int{2, 3, 4} {
			n.cases++
			fam.cases++
			name := fmt.Sprintf("%s/p=%d", fc.name, p)
			done := make(chan faultOutcome, 1)
			go func() { done <- runFault(fc, p) }()
			var o faultOutcome
			select {
			case o = <-done:
			case <-time.After(hangAfter):
				// The case's goroutines stay behind; the table goes on.
				n.hangs++
				fam.hangs++
				t.Errorf("%s: HANG: not ended after %v", name, hangAfter)
				continue
			}
			problems, panicked := judge(fc, p, o)
			for _, c := range []*faultCounts{&n, fam} {
				switch {
				case panicked:
					c.panics++
				case problems != nil:
					c.wrong++
				case slices.ContainsFunc(o.errs, func(e error) bool { return e != nil }):
					c.errors++
				default:
					c.successes++
				}
			}
			for _, pr := range problems {
				note := ""
				if fc.dependsOn != "" {
					note = fmt.Sprintf(" (needs %s)", fc.dependsOn)
				}
				t.Errorf("%s%s: %s", name, note, pr)
			}
		}
	}
	t.Logf("fault table: %v", n)
	for _, f := range faultFamilies() {
		t.Logf("  %s rows: %v", f, *family[f])
	}
	if n.hangs+n.panics+n.wrong > 0 {
		t.Errorf("fault table: %v; hangs, panics and wrong results must all be 0", n)
	}
}

// TestFaultDDPFinishMismatchEveryRank: a collective mismatch under DDP's
// async bucket all-reduces reaches every rank's step. The faulty rank
// issues a barrier on the dp communicator that its peers do not, so its
// barrier meets their first bucket all-reduce: both fail with a
// MismatchError, the peers' Finish returns it, and the faulty rank's next
// all-reduce (launched by Backward's hook, waited for by Finish) gets
// their abort, which carries it. Finish used to return "cancelled while
// waiting" on every rank but the first to return.
func TestFaultDDPFinishMismatchEveryRank(t *testing.T) {
	t.Setenv(comm.CostModelEnv, comm.CostModelOff)
	for _, p := range []int{2, 3, 4} {
		t.Run(fmt.Sprint("p=", p), func(t *testing.T) {
			f := p - 1
			for run := range 10 {
				errs := make([]error, p)
				err := local.Run(context.Background(), p, func(ctx context.Context, c comm.Communicator) error {
					tape, _, w, b, x, y, err := ddpParams(c, []int{2, 3}, comm.Float64)
					if err != nil {
						return err
					}
					d, err := ddp.New(ctx, []*autograd.Value{w, b})
					if err != nil {
						return err
					}
					if c.Rank() == f {
						var mm *comm.MismatchError
						if err := comm.Barrier(ctx, d.Comm()); !errors.As(err, &mm) {
							return fmt.Errorf("the extra barrier: %v, want a MismatchError", err)
						}
					}
					loss, err := ddpLoss(w, b, x, y)
					if err != nil {
						return err
					}
					// The faulty rank's hook may launch its all-reduce after
					// the abort, and Backward then fails with it.
					if err = tape.Backward(ctx, loss); err == nil {
						err = d.Finish(ctx)
					}
					errs[c.Rank()] = err
					return err
				}, local.WithOptions(comm.Options{Timeout: 5 * time.Second}))
				if err == nil {
					t.Fatalf("run %d: Run returned nil", run)
				}
				for r, e := range errs {
					var mm *comm.MismatchError
					if !errors.As(e, &mm) {
						t.Fatalf("run %d: rank %d: the step returned %v, want the MismatchError (Run: %v)", run, r, e, err)
					}
				}
			}
		})
	}
}
