//go:build mpi

package mpi_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/mpi"
)

// fresh returns a new communicator over the whole world with options o.
func fresh(t *testing.T, o comm.Options) *mpi.Comm {
	t.Helper()
	c, err := mpi.World(mpi.WithOptions(o))
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func needRanks(t *testing.T, p int) {
	t.Helper()
	if world.Size() < p {
		t.Skipf("needs %d processes (mpirun -np %d), have %d", p, p, world.Size())
	}
}

// sync waits until every process reaches the same point of a test.
func sync(t *testing.T) {
	t.Helper()
	if err := comm.Barrier(context.Background(), world); err != nil {
		t.Fatal(err)
	}
}

// expectNoOrphans checks that every operation c abandoned completes once all
// ranks have joined it. Completion can trail the barrier: a peer may still be
// forwarding its part of the collective, so each poll drives MPI progress
// until a deadline.
func expectNoOrphans(t *testing.T, c *mpi.Comm) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		n := mpi.OrphanCount(c)
		if n == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Errorf("rank %d: %d abandoned operations still posted after 5s", c.Rank(), n)
			return
		}
		time.Sleep(time.Millisecond)
	}
}

// With the consistency check, ranks issuing different calls all get a
// MismatchError listing every rank's call, and the communicator stays usable.
func TestConsistencyCheckMismatch(t *testing.T) {
	needRanks(t, 2)
	c := fresh(t, comm.Options{ConsistencyCheck: true, Timeout: 20 * time.Second})
	defer sync(t)
	defer c.Free()
	ctx := context.Background()
	n := 4 + c.Rank()%2 // rank 1 disagrees on the count
	x := make([]float32, n)
	err := comm.AllReduce(ctx, c, comm.Host(x), comm.Host(x), comm.Sum)
	var me *comm.MismatchError
	if !errors.As(err, &me) || !errors.Is(err, comm.ErrMismatch) {
		t.Fatalf("rank %d: got %v, want a MismatchError", c.Rank(), err)
	}
	if len(me.Calls) != c.Size() || me.Calls[1].Count != 5 || me.Calls[0].Count != 4 {
		t.Errorf("rank %d: mismatch lists %v", c.Rank(), me.Calls)
	}
	if !strings.Contains(err.Error(), "failure_test.go:") {
		t.Errorf("rank %d: error does not show the call sites: %v", c.Rank(), err)
	}
	// An invalid call on one rank is rejected on every rank.
	y := make([]float32, 4)
	recv := make([]float32, 4+c.Rank()%2)
	err = comm.AllReduce(ctx, c, comm.Host(y), comm.Host(recv), comm.Sum)
	if !errors.Is(err, comm.ErrInvalid) || !strings.Contains(err.Error(), "rank 1:") {
		t.Errorf("rank %d: got %v, want ErrInvalid naming rank 1", c.Rank(), err)
	}
	// Still usable.
	z := []float32{1}
	if err := comm.AllReduce(ctx, c, comm.Host(z), comm.Host(z), comm.Sum); err != nil || z[0] != float32(c.Size()) {
		t.Errorf("rank %d: after the mismatch: %v, %v", c.Rank(), err, z)
	}
}

// AllToAllV counts that disagree are an error on every rank before any
// data moves, naming the pair; the communicator stays usable.
func TestAllToAllVCountsRejected(t *testing.T) {
	needRanks(t, 2)
	c := fresh(t, comm.Options{Timeout: 20 * time.Second})
	defer sync(t)
	defer c.Free()
	ctx := context.Background()
	p, r := c.Size(), c.Rank()
	send, recv := make([]int32, 4*p), make([]int32, 4*p)
	for i := range recv {
		recv[i] = -7
	}
	sc, rc := make([]int, p), make([]int, p)
	for j := range p {
		sc[j], rc[j] = 2, 2
	}
	if r == 1 {
		rc[0] = 3 // rank 0 sends 2
	}
	err := comm.AllToAllV(ctx, c, comm.Host(send), comm.Host(recv), sc, rc)
	if !errors.Is(err, comm.ErrInvalid) || !strings.Contains(err.Error(), "rank 0 sends 2 elements to rank 1, which expects 3") {
		t.Fatalf("rank %d: got %v", r, err)
	}
	for i, v := range recv {
		if v != -7 {
			t.Fatalf("rank %d: recv[%d] written before the counts were agreed", r, i)
		}
	}
	// A bad count vector on one rank fails every rank too.
	bad := sc
	if r == 0 {
		bad = sc[:p-1]
	}
	err = comm.AllToAllV(ctx, c, comm.Host(send), comm.Host(recv), bad, sc)
	if !errors.Is(err, comm.ErrInvalid) || !strings.Contains(err.Error(), "rank 0:") {
		t.Fatalf("rank %d: got %v", r, err)
	}
	if err := comm.AllToAllV(ctx, c, comm.Host(send), comm.Host(recv), sc, sc); err != nil {
		t.Fatalf("rank %d: good counts after bad ones: %v", r, err)
	}
}

// A rank that never joins makes the waiting rank time out with an error
// naming rank, op and sequence number; the communicator is aborted there and
// the notice reaches the late rank, whose call fails fast naming rank 0.
func TestTimeoutAbortsAndNotifies(t *testing.T) {
	needRanks(t, 2)
	const timeout = 300 * time.Millisecond
	c := fresh(t, comm.Options{Timeout: timeout})
	defer sync(t)
	ctx := context.Background()
	x := []float32{1}
	if err := comm.AllReduce(ctx, c, comm.Host(x), comm.Host(x), comm.Sum); err != nil {
		t.Fatal(err)
	}
	if c.Rank() == 0 {
		start := time.Now()
		err := comm.AllReduce(ctx, c, comm.Host(x), comm.Host(x), comm.Sum)
		if el := time.Since(start); el > 5*timeout {
			t.Errorf("timed out after %v, want about %v", el, timeout)
		}
		if !errors.Is(err, comm.ErrTimeout) || !strings.Contains(err.Error(), "rank 0: allreduce #2") {
			t.Fatalf("got %v, want a timeout naming rank 0, allreduce #2", err)
		}
		err = comm.Barrier(ctx, c)
		var ae *comm.AbortError
		if !errors.As(err, &ae) || ae.Rank != 0 {
			t.Fatalf("call after the timeout: got %v, want an AbortError", err)
		}
		if e := c.Recorder().Entries(); len(e) < 2 || e[1].State != comm.Failed {
			t.Errorf("flight recorder: %+v", e)
		}
	} else {
		time.Sleep(10 * timeout)
		err := comm.AllReduce(ctx, c, comm.Host(x), comm.Host(x), comm.Sum)
		var ae *comm.AbortError
		if !errors.As(err, &ae) || ae.Rank != 0 || !strings.Contains(err.Error(), "timed out") {
			t.Fatalf("late rank: got %v, want an AbortError from rank 0 about its timeout", err)
		}
	}
	// Complete the collective rank 0 left posted, so the job can finalize.
	if c.Rank() == 1 {
		if err := mpi.RawAllReduceSum(c, []float32{0}); err != nil {
			t.Fatal(err)
		}
	}
	if c.Rank() > 1 {
		// Ranks beyond 1 joined the first allreduce only; they must join
		// the one rank 0 left posted too.
		if err := mpi.RawAllReduceSum(c, []float32{0}); err != nil {
			t.Fatal(err)
		}
	}
	sync(t)
	expectNoOrphans(t, c)
	c.Free()
}

// Abort on one rank fails a peer's pending call with an AbortError naming
// the rank and the cause.
func TestAbortReachesPeers(t *testing.T) {
	needRanks(t, 2)
	c := fresh(t, comm.Options{Timeout: 20 * time.Second})
	defer sync(t)
	ctx := context.Background()
	boom := errors.New("boom")
	x := []float32{1}
	if c.Rank() == 0 {
		time.Sleep(200 * time.Millisecond)
		c.Abort(boom)
		if err := comm.AllReduce(ctx, c, comm.Host(x), comm.Host(x), comm.Sum); !errors.Is(err, boom) || !errors.Is(err, comm.ErrAborted) {
			t.Fatalf("after Abort: got %v", err)
		}
		if !errors.Is(c.Err(), boom) {
			t.Fatalf("Err() = %v", c.Err())
		}
		if err := mpi.RawAllReduceSum(c, []float32{0}); err != nil {
			t.Fatal(err)
		}
	} else {
		start := time.Now()
		err := comm.AllReduce(ctx, c, comm.Host(x), comm.Host(x), comm.Sum)
		var ae *comm.AbortError
		if !errors.As(err, &ae) || ae.Rank != 0 || !strings.Contains(err.Error(), "boom") || !strings.Contains(err.Error(), fmt.Sprintf("rank %d: allreduce #1", c.Rank())) {
			t.Fatalf("got %v, want an AbortError from rank 0 with its cause", err)
		}
		if el := time.Since(start); el > 5*time.Second {
			t.Errorf("took %v to notice the abort", el)
		}
	}
	sync(t)
	expectNoOrphans(t, c)
	c.Free()
}

// A cancelled context ends a wait promptly and aborts the communicator.
func TestCancelledContext(t *testing.T) {
	needRanks(t, 2)
	c := fresh(t, comm.Options{Timeout: 20 * time.Second})
	defer sync(t)
	x := []float32{1}
	if c.Rank() == 0 {
		ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
		defer cancel()
		err := comm.AllReduce(ctx, c, comm.Host(x), comm.Host(x), comm.Sum)
		if err == nil || !strings.Contains(err.Error(), "cancelled") || c.Err() == nil {
			t.Fatalf("got %v (Err %v), want a cancellation that aborts", err, c.Err())
		}
	}
	sync(t)
	if c.Rank() != 0 {
		if err := mpi.RawAllReduceSum(c, []float32{0}); err != nil {
			t.Fatal(err)
		}
	}
	sync(t)
	expectNoOrphans(t, c)
	c.Free()
}

// Async collectives are posted in issue order even when an earlier one
// still runs its count exchange, and complete whatever order they are
// waited in.
func TestAsyncOrderWithPrechecks(t *testing.T) {
	c := fresh(t, comm.Options{ConsistencyCheck: true, Timeout: 20 * time.Second})
	defer c.Free()
	ctx := context.Background()
	p, r := c.Size(), c.Rank()
	counts := make([]int, p)
	for j := range counts {
		counts[j] = j + 1
	}
	send := make([]int64, r+1)
	for i := range send {
		send[i] = int64(100*r + i)
	}
	rc := make([]int, p)
	tot := 0
	for j := range p {
		rc[j] = r + 1
		tot += r + 1
	}
	sc := make([]int, p)
	for j := range p {
		sc[j] = j + 1
	}
	sendAll := make([]int64, 0)
	for j := range p {
		for i := 0; i < j+1; i++ {
			sendAll = append(sendAll, int64(1000*r+10*j+i))
		}
	}
	recv := make([]int64, tot)
	w1, err := comm.AllToAllVAsync(ctx, c, comm.Host(sendAll), comm.Host(recv), sc, rc)
	if err != nil {
		t.Fatal(err)
	}
	y := []int64{int64(r)}
	w2, err := comm.AllReduceAsync(ctx, c, comm.Host(y), comm.Host(y), comm.Sum)
	if err != nil {
		t.Fatal(err)
	}
	if err := w2.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	if err := w1.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	if y[0] != int64(p*(p-1)/2) {
		t.Errorf("allreduce: %d", y[0])
	}
	for j := range p {
		for i := 0; i < r+1; i++ {
			if got, want := recv[j*(r+1)+i], int64(1000*j+10*r+i); got != want {
				t.Fatalf("alltoallv: from rank %d element %d: %d, want %d", j, i, got, want)
			}
		}
	}
	// Done closes without a Wait: the background driver progresses it.
	w3, err := comm.BarrierAsync(ctx, c)
	if err != nil {
		t.Fatal(err)
	}
	select {
	case <-w3.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("Done not closed")
	}
}

// Large messages are split into pieces of at most the MPI count limit
// (lowered here); block collectives above it are rejected on every rank.
func TestSplitsLargeMessages(t *testing.T) {
	restore := mpi.SetMaxCount(1000)
	defer restore()
	c := fresh(t, comm.Options{Timeout: 20 * time.Second})
	defer c.Free()
	ctx := context.Background()
	p, r := c.Size(), c.Rank()
	// 11 pieces: more requests in one step than loom_testall_ctl keeps on
	// its stack.
	const n = 10500
	x := make([]float64, n)
	for i := range x {
		x[i] = float64(r*n + i)
	}
	if err := comm.AllReduce(ctx, c, comm.Host(x), comm.Host(x), comm.Avg); err != nil {
		t.Fatal(err)
	}
	for i, v := range x {
		want := 0.0
		for q := range p {
			want += float64(q*n + i)
		}
		if want /= float64(p); v != want {
			t.Fatalf("allreduce avg [%d] = %v, want %v", i, v, want)
		}
	}
	b := make([]int32, n)
	if r == p-1 {
		for i := range b {
			b[i] = int32(i)
		}
	}
	if err := comm.Broadcast(ctx, c, comm.Host(b), p-1); err != nil {
		t.Fatal(err)
	}
	for i, v := range b {
		if v != int32(i) {
			t.Fatalf("broadcast [%d] = %d", i, v)
		}
	}
	if p > 1 {
		msg := make([]uint8, n)
		if r == 0 {
			for i := range msg {
				msg[i] = uint8(i)
			}
			if err := comm.Send(ctx, c, comm.Host(msg), 1, 5); err != nil {
				t.Fatal(err)
			}
		} else if r == 1 {
			if err := comm.Recv(ctx, c, comm.Host(msg), 0, 5); err != nil {
				t.Fatal(err)
			}
			for i, v := range msg {
				if v != uint8(i) {
					t.Fatalf("recv [%d] = %d", i, v)
				}
			}
		}
	}
	ag := make([]float32, p*n)
	err := comm.AllGather(ctx, c, comm.Host(make([]float32, n)), comm.Host(ag))
	if !errors.Is(err, comm.ErrUnsupported) || !strings.Contains(err.Error(), "count limit") {
		t.Fatalf("allgather above the limit: got %v", err)
	}
	if err := comm.Barrier(ctx, c); err != nil {
		t.Fatalf("after the rejected call: %v", err)
	}
}

// Send and Recv lengths must agree; tags out of range are rejected.
func TestSendRecvChecks(t *testing.T) {
	needRanks(t, 2)
	c := fresh(t, comm.Options{Timeout: 20 * time.Second})
	defer c.Free()
	ctx := context.Background()
	switch c.Rank() {
	case 0:
		if err := comm.Send(ctx, c, comm.Host(make([]float32, 3)), 1, 1); err != nil {
			t.Fatal(err)
		}
		if err := comm.Send(ctx, c, comm.Host(make([]float32, 3)), 1, -1); !errors.Is(err, comm.ErrInvalid) {
			t.Fatalf("negative tag: %v", err)
		}
	case 1:
		err := comm.Recv(ctx, c, comm.Host(make([]float32, 4)), 0, 1)
		if !errors.Is(err, comm.ErrInvalid) || !strings.Contains(err.Error(), "received 3 elements from rank 0, want 4") {
			t.Fatalf("short message: %v", err)
		}
	}
	if err := comm.Barrier(ctx, c); err != nil {
		t.Fatal(err)
	}
}

// The C conversions of the 16-bit float reduction operators round exactly
// like package comm's.
func TestHalfConversionsMatchComm(t *testing.T) {
	for h := range 1 << 16 {
		f := comm.Float16Bits(h).Float32()
		g := mpi.CF16ToF32(uint16(h))
		if math.Float32bits(f) != math.Float32bits(g) && !(f != f && g != g) {
			t.Fatalf("f16 %#04x widens to %v in C, %v in Go", h, g, f)
		}
	}
	rng := rand.New(rand.NewPCG(1, 2))
	for i := range 2_000_000 {
		bits := rng.Uint32()
		if i < 1<<16 {
			bits = uint32(i) << 16 // every bfloat16 and its neighbours
			bits |= rng.Uint32() & 0xffff
		}
		f := math.Float32frombits(bits)
		if a, b := uint16(comm.ToBFloat16(f)), mpi.CF32ToBF16(f); a != b {
			t.Fatalf("bf16(%v = %#08x): Go %#04x, C %#04x", f, bits, a, b)
		}
		if a, b := uint16(comm.ToFloat16(f)), mpi.CF32ToF16(f); a != b {
			t.Fatalf("f16(%v = %#08x): Go %#04x, C %#04x", f, bits, a, b)
		}
	}
}

// The flight recorder sees every call with its state.
func TestRecorder(t *testing.T) {
	c := fresh(t, comm.Options{RecorderSize: 4})
	defer c.Free()
	ctx := context.Background()
	for range 6 {
		if err := comm.Barrier(ctx, c); err != nil {
			t.Fatal(err)
		}
	}
	e := c.Recorder().Entries()
	if len(e) != 4 || e[3].Seq != 6 || e[3].Op != "barrier" || e[3].State != comm.Completed {
		t.Fatalf("entries %+v", e)
	}
	if c.Backend() != "mpi" || c.Recorder().Snapshot().Communicator != c.Name() {
		t.Fatalf("backend %q, name %q", c.Backend(), c.Name())
	}
}
