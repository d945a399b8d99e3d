package tcp_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/tcp"
)

// segElems is the number of int32 elements in one segment of 256 KiB.
const segElems = 256 << 10 / 4

// TestAllToAllSegments runs AllToAll and AllToAllV with messages of one
// element, just under a segment and several segments with a remainder,
// including empty ones, and with one rank late so that some segments come
// before their receive is posted (read into pooled buffers) and the rest
// after (read in place). Element values name sender, receiver and index,
// so a segment landing in the wrong place or a missing one shows.
func TestAllToAllSegments(t *testing.T) {
	val := func(from, to, i int) int32 { return int32(from<<28 | to<<24 | i) }
	cases := []struct {
		name string
		p    int
		// count of the message from rank i to rank j
		count func(i, j int) int
		v     bool // AllToAllV (else every count must be equal)
		late  bool // rank 0 issues its call 100 ms after the others
	}{
		{"one", 3, func(int, int) int { return 1 }, false, false},
		{"under-a-segment", 2, func(int, int) int { return segElems - 1 }, false, false},
		{"segments", 4, func(int, int) int { return 3*segElems + 5 }, false, false},
		{"segments/late", 3, func(int, int) int { return 3*segElems + 5 }, false, true},
		{"v/uneven", 3, func(i, j int) int { return (i + 2*j) * segElems / 2 }, true, false},
		{"v/uneven/late", 4, func(i, j int) int { return (i*j + 1) * (segElems + 3) / 2 }, true, true},
	}
	for _, tc := range cases {
		t.Run(fmt.Sprintf("%s/p=%d", tc.name, tc.p), func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			var inPlace atomic.Int64
			err := world(ctx, t, tc.p, func(ctx context.Context, c *tcp.Comm) error {
				r, p := c.Rank(), tc.p
				sc, rc := make([]int, p), make([]int, p)
				var send, want []int32
				for q := range p {
					sc[q], rc[q] = tc.count(r, q), tc.count(q, r)
					for i := range sc[q] {
						send = append(send, val(r, q, i))
					}
					for i := range rc[q] {
						want = append(want, val(q, r, i))
					}
				}
				recv := make([]int32, len(want))
				for round := range 2 {
					if tc.late && r == 0 {
						time.Sleep(100 * time.Millisecond)
					}
					clear(recv)
					var err error
					if tc.v {
						err = comm.AllToAllV(ctx, c, comm.Host(send), comm.Host(recv), sc, rc)
					} else {
						err = comm.AllToAll(ctx, c, comm.Host(send), comm.Host(recv))
					}
					if err != nil {
						return err
					}
					for i := range recv {
						if recv[i] != want[i] {
							return fmt.Errorf("rank %d, call %d: element %d of %d is %#x, want %#x", r, round, i, len(recv), recv[i], want[i])
						}
					}
				}
				_, _, n := tcp.PathCounts(c)
				inPlace.Add(n)
				return nil
			}, withTimeout(20*time.Second))
			if err != nil {
				t.Fatal(err)
			}
			if tc.count(0, 1) >= segElems && inPlace.Load() == 0 {
				t.Error("no segment was received in place")
			}
		})
	}
}

// An AllToAllV whose sender and receiver disagree on a message's length
// fails with ErrMismatch on the receiver, also when the lengths agree on
// every segment the receiver expects (the sender's message is longer by
// whole segments, or shorter), instead of taking a prefix or waiting.
func TestAllToAllVLengthMismatch(t *testing.T) {
	for _, tc := range []struct {
		name       string
		sent, want int // elements rank 0 sends rank 1; rank 1 expects
	}{
		{"longer", 2 * segElems, segElems},
		{"shorter", segElems, 2 * segElems},
		{"uneven", segElems + 7, segElems + 9},
	} {
		t.Run(tc.name, func(t *testing.T) {
			errs := make([]error, 2)
			world(context.Background(), t, 2, func(ctx context.Context, c *tcp.Comm) error {
				sc, rc := []int{1, 1}, []int{1, 1}
				if c.Rank() == 0 {
					sc[1] = tc.sent
				} else {
					rc[0] = tc.want
				}
				send, recv := make([]int32, sc[0]+sc[1]), make([]int32, rc[0]+rc[1])
				errs[c.Rank()] = comm.AllToAllV(ctx, c, comm.Host(send), comm.Host(recv), sc, rc)
				return nil
			}, withTimeout(3*time.Second))
			if !errors.Is(errs[1], comm.ErrMismatch) {
				t.Errorf("rank 1: error %v does not match ErrMismatch", errs[1])
			}
			// Rank 0's own receive and sends complete: it may end before
			// rank 1's abort comes, but not with another error.
			if errs[0] != nil && !errors.Is(errs[0], comm.ErrAborted) {
				t.Errorf("rank 0: error %v is not rank 1's abort", errs[0])
			}
		})
	}
}

// TestDirectWrites sends from two goroutines at once, each on its own
// communicator over the same connections, to a peer that is not reading
// yet: large messages that fill the socket (the sender begins them on the
// direct path and the writer finishes them) between small ones. Every
// message must arrive whole and in order: a partly written frame's rest
// goes before the frames queued while it was being written.
func TestDirectWrites(t *testing.T) {
	sizes := []int{5, 4 << 20, 3, 8 << 20, 1, 1 << 20, 7}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var direct, partial int64
	err := world(ctx, t, 2, func(ctx context.Context, c *tcp.Comm) error {
		var subs [2]comm.Communicator
		for i := range subs {
			s, err := c.Split(ctx, 0, c.Rank())
			if err != nil {
				return err
			}
			subs[i] = s
		}
		msg := func(sub, k, n int) []int32 {
			b := make([]int32, n)
			for i := range b {
				b[i] = int32(sub<<28 | k<<24 | i)
			}
			return b
		}
		var errs [2]error
		var wg sync.WaitGroup
		for i, s := range subs {
			wg.Go(func() {
				for k, n := range sizes {
					if c.Rank() == 0 {
						if errs[i] = s.Do(ctx, comm.Call{Op: comm.OpSend, Send: comm.Host(msg(i, k, n)), Peer: 1}); errs[i] != nil {
							return
						}
						continue
					}
					if k == 0 {
						time.Sleep(200 * time.Millisecond)
					}
					got := make([]int32, n)
					if errs[i] = s.Do(ctx, comm.Call{Op: comm.OpRecv, Recv: comm.Host(got), Peer: 0}); errs[i] != nil {
						return
					}
					if !slices.Equal(got, msg(i, k, n)) {
						errs[i] = fmt.Errorf("communicator %d: message %d (%d elements) arrived changed", i, k, n)
						return
					}
				}
			})
		}
		wg.Wait()
		if err := errors.Join(errs[:]...); err != nil {
			return err
		}
		if c.Rank() == 0 {
			direct, partial, _ = tcp.PathCounts(c)
		}
		return comm.Barrier(ctx, c)
	}, withTimeout(20*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	if direct == 0 || partial == 0 {
		t.Errorf("frames written whole by their sender: %d, begun by it: %d; want both", direct, partial)
	}
}

// A peer that stalls in the middle of a frame whose receive was posted (the
// reader fills the destination in place) still ends the receiver's call
// within twice the timeout, naming it: the receive gives up the
// destination only once the reader no longer writes to it, and the reader,
// stuck mid-frame, is cut off.
func TestStallMidFrame(t *testing.T) {
	const timeout = time.Second
	const n = 1 << 20
	errs := errsOf(t, 2, timeout, func(ctx context.Context, c *tcp.Comm) error {
		buf := make([]byte, n)
		if c.Rank() == 1 {
			time.Sleep(100 * time.Millisecond) // rank 0 posts its receive first
			tcp.SendPartialFrame(c, 0, 0, n, make([]byte, n/2))
			time.Sleep(timeout * 3 / 2)
			return nil
		}
		err := comm.Broadcast(ctx, c, comm.Host(buf), 1)
		// The destination is this rank's again: the race detector sees a
		// reader still writing to it.
		clear(buf)
		return err
	})
	if err := errs[0]; !errors.Is(err, comm.ErrTimeout) || !slices.Equal(comm.LateRanks(err), []int{1}) || !strings.Contains(err.Error(), "broadcast #0") {
		t.Errorf("rank 0: error %v: want a timeout in broadcast #0 blaming rank 1", err)
	}
}
