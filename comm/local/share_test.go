package local_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/local"
)

var _ comm.SharedMemory = (*local.Comm)(nil)

// shareOf returns c as a comm.SharedMemory, which every communicator of
// the local backend is.
func shareOf(c comm.Communicator) (comm.SharedMemory, error) {
	sm, ok := c.(comm.SharedMemory)
	if !ok {
		return nil, fmt.Errorf("%T does not implement comm.SharedMemory", c)
	}
	return sm, nil
}

// shareValue is what rank r shares in round k of a test: a slice whose
// elements name the round, the rank and the index.
func shareValue(k, r, n int) []float64 {
	v := make([]float64, n)
	for i := range v {
		v[i] = float64(k*10000 + r*100 + i)
	}
	return v
}

// checkPeers verifies that peers holds, for every rank q, the slice
// shareValue(k, q, n), and that it is the memory of want[q] itself when want
// is given (a peer reads the owner's buffer, not a copy).
func checkPeers(peers []any, k, p, n int, want [][]float64) error {
	if len(peers) != p {
		return fmt.Errorf("use got %d peers, want %d", len(peers), p)
	}
	for q, pv := range peers {
		s, ok := pv.([]float64)
		if !ok {
			return fmt.Errorf("peers[%d] is %T, want []float64", q, pv)
		}
		ref := shareValue(k, q, n)
		if len(s) != n {
			return fmt.Errorf("peers[%d] has %d elements, want %d", q, len(s), n)
		}
		for i := range s {
			if s[i] != ref[i] {
				return fmt.Errorf("round %d: peers[%d][%d] = %v, want %v", k, q, i, s[i], ref[i])
			}
		}
		if want != nil && n > 0 && &s[0] != &want[q][0] {
			return fmt.Errorf("peers[%d] is a copy, not rank %d's own slice", q, q)
		}
	}
	return nil
}

// Every rank sees every rank's value at its index, its own at Rank(), and
// a fused gather that reads the peers' slices directly matches a serial
// reference; repeated rounds see fresh values, never a previous round's.
func TestShareGathersFromEveryRank(t *testing.T) {
	noLeaks(t)
	const n, rounds = 7, 4
	for _, p := range []int{1, 2, 3, 5} {
		t.Run(fmt.Sprint("p=", p), func(t *testing.T) {
			owned := make([][][]float64, rounds) // owned[k][r]: rank r's slice in round k
			for k := range owned {
				owned[k] = make([][]float64, p)
			}
			err := local.Run(context.Background(), p, func(ctx context.Context, c comm.Communicator) error {
				sm, err := shareOf(c)
				if err != nil {
					return err
				}
				r := c.Rank()
				for k := 0; k < rounds; k++ {
					mine := shareValue(k, r, n)
					owned[k][r] = mine // published to the peers by Share itself
					got := make([]float64, n)
					calls := 0
					err := sm.Share(ctx, mine, func(peers []any) error {
						calls++
						if err := checkPeers(peers, k, p, n, owned[k]); err != nil {
							return err
						}
						if s := peers[r].([]float64); &s[0] != &mine[0] {
							return errors.New("peers[Rank()] is not this rank's own slice")
						}
						// Fused gather: element i of the result sums, over all
						// peers, element (i+r) mod n of each peer's slice.
						for _, pv := range peers {
							s := pv.([]float64)
							for i := range got {
								got[i] += s[(i+r)%n]
							}
						}
						return nil
					})
					if err != nil {
						return fmt.Errorf("round %d: %w", k, err)
					}
					if calls != 1 {
						return fmt.Errorf("round %d: use ran %d times, want once", k, calls)
					}
					for i := range got {
						want := 0.0
						for q := 0; q < p; q++ {
							want += shareValue(k, q, n)[(i+r)%n]
						}
						if got[i] != want {
							return fmt.Errorf("round %d: gathered[%d] = %v, want %v", k, i, got[i], want)
						}
					}
				}
				return nil
			}, withTimeout(5*time.Second))
			if err != nil {
				t.Fatal(err)
			}
		})
	}
}

// The value is any value, nil included, and reaches the peers as it was
// passed.
func TestShareValuesOfAnyType(t *testing.T) {
	noLeaks(t)
	type box struct{ n int }
	b := &box{n: 3}
	values := []any{nil, 7, "two", b}
	err := local.Run(context.Background(), len(values), func(ctx context.Context, c comm.Communicator) error {
		sm, err := shareOf(c)
		if err != nil {
			return err
		}
		return sm.Share(ctx, values[c.Rank()], func(peers []any) error {
			for q, want := range values {
				if peers[q] != want {
					return fmt.Errorf("peers[%d] = %#v, want %#v", q, peers[q], want)
				}
			}
			if peers[3].(*box).n != 3 {
				return errors.New("the shared pointer does not lead to rank 3's box")
			}
			return nil
		})
	}, withTimeout(5*time.Second))
	if err != nil {
		t.Fatal(err)
	}
}

// Share returns on no rank before every rank's use has returned: a rank
// that overwrites its shared slice right after Share cannot change what a
// slow peer reads inside use (and the race detector would see the write).
func TestShareKeepsValuesValidUntilEveryUseReturns(t *testing.T) {
	noLeaks(t)
	const n = 16
	const slowFor = 30 * time.Millisecond
	for _, tc := range []struct{ p, slow int }{
		{2, 0}, {2, 1}, {3, 1}, {4, 3},
	} {
		t.Run(fmt.Sprintf("p=%d/slow=%d", tc.p, tc.slow), func(t *testing.T) {
			var slowDone atomic.Bool
			seen := make([][]float64, tc.p)
			err := local.Run(context.Background(), tc.p, func(ctx context.Context, c comm.Communicator) error {
				sm, err := shareOf(c)
				if err != nil {
					return err
				}
				r := c.Rank()
				mine := shareValue(0, r, n)
				err = sm.Share(ctx, mine, func(peers []any) error {
					if r != tc.slow {
						return nil
					}
					time.Sleep(slowFor) // the others are past use by now
					for q, pv := range peers {
						seen[q] = append([]float64(nil), pv.([]float64)...)
					}
					slowDone.Store(true)
					return nil
				})
				if err != nil {
					return err
				}
				if r != tc.slow {
					if !slowDone.Load() {
						return errors.New("Share returned while a peer's use was still running")
					}
					for i := range mine {
						mine[i] = -1 // reuse the buffer at once
					}
					return nil
				}
				for q := range seen {
					want := shareValue(0, q, n)
					for i := range want {
						if seen[q][i] != want[i] {
							return fmt.Errorf("slow rank read %v from rank %d, want %v", seen[q], q, want)
						}
					}
				}
				return nil
			}, withTimeout(5*time.Second))
			if err != nil {
				t.Fatal(err)
			}
		})
	}
}

// A Share issued behind async collectives runs after them, on every rank:
// use sees every peer's buffer already reduced. Both paths are covered,
// the Share queued behind pending work and the Share run inline after Wait.
func TestShareRunsAfterEarlierAsyncWork(t *testing.T) {
	noLeaks(t)
	for _, p := range []int{2, 3} {
		t.Run(fmt.Sprint("p=", p), func(t *testing.T) {
			const rounds = 40
			sumRanks := float64(p * (p + 1) / 2)
			err := local.Run(context.Background(), p, func(ctx context.Context, c comm.Communicator) error {
				sm, err := shareOf(c)
				if err != nil {
					return err
				}
				for k := 0; k < rounds; k++ {
					x := []float64{float64(c.Rank() + 1), float64(k)}
					y := []float64{float64(c.Rank())}
					w1, err := comm.AllReduceAsync(ctx, c, comm.Host(x), comm.Host(x), comm.Sum)
					if err != nil {
						return err
					}
					w2, err := comm.AllReduceAsync(ctx, c, comm.Host(y), comm.Host(y), comm.Max)
					if err != nil {
						return err
					}
					if k%3 == 0 { // sometimes the stream is idle again first
						if err := comm.WaitAll(ctx, w1, w2); err != nil {
							return err
						}
					}
					err = sm.Share(ctx, [][]float64{x, y}, func(peers []any) error {
						for q, pv := range peers {
							b := pv.([][]float64)
							if b[0][0] != sumRanks || b[0][1] != float64(p*k) || b[1][0] != float64(p-1) {
								return fmt.Errorf("round %d: rank %d's buffers %v are not reduced yet", k, q, b)
							}
						}
						return nil
					})
					if err != nil {
						return err
					}
					if err := comm.WaitAll(ctx, w1, w2); err != nil {
						return err
					}
				}
				ents := c.Recorder().Entries()
				if len(ents) != 3*rounds {
					return fmt.Errorf("flight recorder holds %d entries, want %d", len(ents), 3*rounds)
				}
				for i, e := range ents {
					want := comm.OpAllReduce.String()
					if i%3 == 2 {
						want = comm.OpBarrier.String()
					}
					if e.Seq != uint64(i+1) || e.Op != want || e.State != comm.Completed {
						return fmt.Errorf("entry %d: seq %d %s %v, want seq %d %s completed", i, e.Seq, e.Op, e.State, i+1, want)
					}
				}
				return nil
			}, withTimeout(5*time.Second))
			if err != nil {
				t.Fatal(err)
			}
		})
	}
}

// Share, Barrier and Share again, many times: the sequence numbers advance
// by one per call on every rank, and each Share sees its own round's
// values.
func TestShareBarrierShareSequence(t *testing.T) {
	noLeaks(t)
	const p, rounds, n = 3, 30, 3
	err := local.Run(context.Background(), p, func(ctx context.Context, c comm.Communicator) error {
		sm, err := shareOf(c)
		if err != nil {
			return err
		}
		share := func(k int) error {
			return sm.Share(ctx, shareValue(k, c.Rank(), n), func(peers []any) error {
				return checkPeers(peers, k, p, n, nil)
			})
		}
		for k := 0; k < rounds; k++ {
			if err := share(2 * k); err != nil {
				return err
			}
			if err := comm.Barrier(ctx, c); err != nil {
				return err
			}
			if err := share(2*k + 1); err != nil {
				return err
			}
		}
		if err := allReduceOnce(ctx, c); err != nil {
			return err
		}
		ents := c.Recorder().Entries()
		if len(ents) != 3*rounds+1 {
			return fmt.Errorf("flight recorder holds %d entries, want %d", len(ents), 3*rounds+1)
		}
		for i, e := range ents[:3*rounds] {
			if e.Seq != uint64(i+1) || e.Op != comm.OpBarrier.String() || e.State != comm.Completed {
				return fmt.Errorf("entry %d: seq %d %s %v, want seq %d barrier completed", i, e.Seq, e.Op, e.State, i+1)
			}
		}
		return nil
	}, withTimeout(5*time.Second))
	if err != nil {
		t.Fatal(err)
	}
}

// Share where other ranks issued a barrier (or another collective) at the
// same sequence number fails on every rank with ErrMismatch, before any
// use runs, and the communicator stays usable.
func TestShareMismatchFailsEveryRank(t *testing.T) {
	noLeaks(t)
	for _, tc := range []struct {
		name    string
		p       int
		sharers []int
		other   comm.Op // what the other ranks issue
		msg     string  // in every rank's error
	}{
		{"p=2/share-vs-barrier", 2, []int{0}, comm.OpBarrier, "rank(s) 0 called Share where rank(s) 1 called a barrier"},
		{"p=3/share-vs-barrier", 3, []int{0}, comm.OpBarrier, "rank(s) 0 called Share where rank(s) 1, 2 called a barrier"},
		{"p=4/last-shares", 4, []int{3}, comm.OpBarrier, "rank(s) 3 called Share where rank(s) 0, 1, 2 called a barrier"},
		{"p=3/two-share", 3, []int{0, 2}, comm.OpBarrier, "rank(s) 0, 2 called Share where rank(s) 1 called a barrier"},
		{"p=3/share-vs-allreduce", 3, []int{1}, comm.OpAllReduce, "ranks issued different collectives"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			errs := make([]error, tc.p)
			var uses atomic.Int32
			err := local.Run(context.Background(), tc.p, func(ctx context.Context, c comm.Communicator) error {
				sm, err := shareOf(c)
				if err != nil {
					return err
				}
				r := c.Rank()
				if err := allReduceOnce(ctx, c); err != nil { // the mismatch is at seq 2
					return err
				}
				shares := false
				for _, s := range tc.sharers {
					shares = shares || s == r
				}
				switch {
				case shares:
					errs[r] = sm.Share(ctx, []float64{1}, func([]any) error { uses.Add(1); return nil })
				case tc.other == comm.OpBarrier:
					errs[r] = comm.Barrier(ctx, c)
				default:
					errs[r] = allReduceOnce(ctx, c)
				}
				// Still usable: a barrier, a Share and a reduction all work.
				if err := comm.Barrier(ctx, c); err != nil {
					return fmt.Errorf("barrier after the mismatch: %w", err)
				}
				err = sm.Share(ctx, shareValue(1, r, 2), func(peers []any) error {
					return checkPeers(peers, 1, tc.p, 2, nil)
				})
				if err != nil {
					return fmt.Errorf("Share after the mismatch: %w", err)
				}
				x := []float64{1}
				if err := comm.AllReduce(ctx, c, comm.Host(x), comm.Host(x), comm.Sum); err != nil || x[0] != float64(tc.p) {
					return fmt.Errorf("allreduce after the mismatch: %v = %v", err, x)
				}
				return c.Err()
			}, withTimeout(5*time.Second))
			if err != nil {
				t.Fatalf("communicator unusable after the mismatch: %v", err)
			}
			if n := uses.Load(); n != 0 {
				t.Errorf("use ran %d times in a mismatched Share", n)
			}
			for r, e := range errs {
				if !errors.Is(e, comm.ErrMismatch) {
					t.Errorf("rank %d: %v does not wrap ErrMismatch", r, e)
					continue
				}
				if !strings.Contains(e.Error(), tc.msg) {
					t.Errorf("rank %d: %v lacks %q", r, e, tc.msg)
				}
				var ce *comm.Error
				if !errors.As(e, &ce) || ce.Rank != r || ce.Seq != 2 {
					t.Errorf("rank %d: %#v does not name rank %d at seq 2", r, ce, r)
				}
			}
		})
	}
}

// A nil use on any rank fails the call on every rank with ErrInvalid,
// before any use runs, without hanging or breaking the communicator.
func TestShareNilUseRejectedOnEveryRank(t *testing.T) {
	noLeaks(t)
	for _, tc := range []struct{ p, bad int }{{1, 0}, {2, 0}, {3, 2}, {5, 1}} {
		t.Run(fmt.Sprintf("p=%d/nil-on=%d", tc.p, tc.bad), func(t *testing.T) {
			errs := make([]error, tc.p)
			var uses atomic.Int32
			start := time.Now()
			err := local.Run(context.Background(), tc.p, func(ctx context.Context, c comm.Communicator) error {
				sm, err := shareOf(c)
				if err != nil {
					return err
				}
				use := func([]any) error { uses.Add(1); return nil }
				if c.Rank() == tc.bad {
					use = nil
				}
				errs[c.Rank()] = sm.Share(ctx, c.Rank(), use)
				return sm.Share(ctx, c.Rank(), func(peers []any) error {
					for q, v := range peers {
						if v != q {
							return fmt.Errorf("peers[%d] = %v after the rejected call", q, v)
						}
					}
					return nil
				})
			}, withTimeout(2*time.Second))
			if el := time.Since(start); el > time.Second {
				t.Errorf("took %v", el)
			}
			if err != nil {
				t.Fatalf("communicator unusable after a rejected Share: %v", err)
			}
			if n := uses.Load(); n != 0 {
				t.Errorf("use ran %d times in a rejected Share", n)
			}
			want := fmt.Sprintf("rank %d: ", tc.bad)
			for r, e := range errs {
				if !errors.Is(e, comm.ErrInvalid) || !strings.Contains(e.Error(), want) || !strings.Contains(e.Error(), "nil use") {
					t.Errorf("rank %d: %v, want ErrInvalid naming rank %d's nil use", r, e, tc.bad)
				}
			}
		})
	}
}

// An error returned by use, or a panic in it, is returned on that rank
// only, after every rank has left (so the peers' values stayed valid); the
// communicator is not aborted and stays usable. The queued path (Share
// behind async work, where use runs on the background stream) is covered.
func TestShareUseErrorStaysOnItsRank(t *testing.T) {
	noLeaks(t)
	errUse := errors.New("use failed")
	for _, tc := range []struct {
		name  string
		p     int
		bad   int
		panic bool
		async bool
	}{
		{"p=1/error", 1, 0, false, false},
		{"p=3/error", 3, 1, false, false},
		{"p=3/panic", 3, 0, true, false},
		{"p=2/error/queued", 2, 1, false, true},
		{"p=3/panic/queued", 3, 2, true, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			errs := make([]error, tc.p)
			var othersDone atomic.Int32
			err := local.Run(context.Background(), tc.p, func(ctx context.Context, c comm.Communicator) error {
				sm, err := shareOf(c)
				if err != nil {
					return err
				}
				r := c.Rank()
				var w comm.Work
				if tc.async {
					if w, err = comm.BarrierAsync(ctx, c); err != nil {
						return err
					}
				}
				errs[r] = sm.Share(ctx, r, func(peers []any) error {
					if r != tc.bad {
						othersDone.Add(1)
						return nil
					}
					time.Sleep(5 * time.Millisecond)
					if tc.panic {
						panic("kaboom")
					}
					return errUse
				})
				if r == tc.bad && int(othersDone.Load()) != tc.p-1 {
					return errors.New("the failing rank returned before the others' use returned")
				}
				if w != nil {
					if err := w.Wait(ctx); err != nil {
						return err
					}
				}
				if err := c.Err(); err != nil {
					return fmt.Errorf("communicator aborted: %w", err)
				}
				if err := comm.Barrier(ctx, c); err != nil {
					return err
				}
				return sm.Share(ctx, shareValue(2, r, 4), func(peers []any) error {
					return checkPeers(peers, 2, tc.p, 4, nil)
				})
			}, withTimeout(5*time.Second))
			if err != nil {
				t.Fatalf("communicator unusable after use failed: %v", err)
			}
			seq := uint64(1)
			if tc.async {
				seq = 2
			}
			for r, e := range errs {
				switch {
				case r != tc.bad:
					if e != nil {
						t.Errorf("rank %d: %v, want nil (the failing use was on rank %d)", r, e, tc.bad)
					}
				case tc.panic:
					var ce *comm.Error
					if !errors.As(e, &ce) || ce.Rank != r || ce.Op != comm.OpBarrier || ce.Seq != seq || !strings.Contains(e.Error(), "panic in use: kaboom") {
						t.Errorf("rank %d: %v, want the panic as a barrier #%d error", r, e, seq)
					}
				default:
					if !errors.Is(e, errUse) {
						t.Errorf("rank %d: %v, want %v", r, e, errUse)
					}
				}
			}
		})
	}
}

// With one rank never calling Share, the others fail within the timeout
// with ErrTimeout, naming themselves, the barrier and its sequence number,
// and use never runs.
func TestShareTimesOutNamingTheCall(t *testing.T) {
	noLeaks(t)
	const p, silent, timeout = 3, 2, 150 * time.Millisecond
	wd, err := local.NewWorld(p, withTimeout(timeout))
	if err != nil {
		t.Fatal(err)
	}
	var uses atomic.Int32
	errs := make([]error, p)
	var wg sync.WaitGroup
	var start time.Time
	var startOnce sync.Once
	for r := 0; r < p; r++ {
		wg.Add(1)
		go func(r int) {
			defer wg.Done()
			c := wd.Comm(r)
			if errs[r] = c.Share(context.Background(), r, func([]any) error { return nil }); errs[r] != nil {
				return
			}
			if r == silent {
				return // stays out of Share #2 without leaving the world
			}
			startOnce.Do(func() { start = time.Now() })
			errs[r] = c.Share(context.Background(), r, func([]any) error { uses.Add(1); return nil })
		}(r)
	}
	wg.Wait()
	if el := time.Since(start); el > 2*timeout+time.Second/2 {
		t.Errorf("took %v for a %v timeout", el, timeout)
	}
	if errs[silent] != nil {
		t.Fatalf("the first Share failed: %v", errs[silent])
	}
	if n := uses.Load(); n != 0 {
		t.Errorf("use ran %d times without rank %d", n, silent)
	}
	named := false
	for r := 0; r < p; r++ {
		if r == silent {
			continue
		}
		e := errs[r]
		var ce *comm.Error
		if !errors.Is(e, comm.ErrTimeout) || !errors.As(e, &ce) {
			t.Errorf("rank %d: %v, want a *comm.Error wrapping ErrTimeout", r, e)
			continue
		}
		if ce.Rank != r || ce.Op != comm.OpBarrier || ce.Seq != 2 || !strings.Contains(e.Error(), "barrier #2") {
			t.Errorf("rank %d: rank %d, %v #%d in %v; want rank %d, barrier #2", r, ce.Rank, ce.Op, ce.Seq, e, r)
		}
		if ce.Peer == silent && strings.Contains(e.Error(), fmt.Sprintf("waiting for rank %d", silent)) {
			named = true
		} else if ce.Peer != -1 {
			t.Errorf("rank %d: peer %d, want %d or -1", r, ce.Peer, silent)
		}
	}
	if !named {
		t.Error("no rank named the silent rank as the one it waited for")
	}
	// The timeout aborted the communicator: a late Share fails at once.
	err = wd.Comm(silent).Share(context.Background(), silent, func([]any) error { uses.Add(1); return nil })
	if !errors.Is(err, comm.ErrAborted) || uses.Load() != 0 {
		t.Errorf("late Share: %v", err)
	}
}

// A cancelled context ends a waiting Share promptly, inline or queued
// behind async work, and aborts the communicator for the late rank.
func TestShareCancelledContextReturnsPromptly(t *testing.T) {
	noLeaks(t)
	for _, queued := range []bool{false, true} {
		t.Run(fmt.Sprint("queued=", queued), func(t *testing.T) {
			const p, absent = 3, 2
			wd, err := local.NewWorld(p, withTimeout(time.Minute))
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			var uses atomic.Int32
			errs := make([]error, p)
			took := make([]time.Duration, p)
			var wg sync.WaitGroup
			for r := 0; r < p; r++ {
				if r == absent {
					continue
				}
				wg.Add(1)
				go func(r int) {
					defer wg.Done()
					c := wd.Comm(r)
					start := time.Now()
					var w comm.Work
					if queued {
						w, errs[r] = comm.BarrierAsync(ctx, c) // never completes: rank 2 is absent
						if errs[r] != nil {
							return
						}
					}
					errs[r] = c.Share(ctx, r, func([]any) error { uses.Add(1); return nil })
					took[r] = time.Since(start)
					if w != nil {
						if werr := w.Wait(context.Background()); werr == nil {
							errs[r] = errors.New("the pending barrier succeeded without rank 2")
						}
					}
				}(r)
			}
			time.Sleep(30 * time.Millisecond)
			cancel()
			wg.Wait()
			for r := 0; r < p; r++ {
				if r == absent {
					continue
				}
				if !errors.Is(errs[r], context.Canceled) && !errors.Is(errs[r], comm.ErrAborted) {
					t.Errorf("rank %d: %v", r, errs[r])
				}
				if took[r] > 30*time.Millisecond+time.Second {
					t.Errorf("rank %d took %v after cancel", r, took[r])
				}
			}
			if n := uses.Load(); n != 0 {
				t.Errorf("use ran %d times", n)
			}
			err = wd.Comm(absent).Share(context.Background(), absent, func([]any) error { return nil })
			if !errors.Is(err, comm.ErrAborted) {
				t.Errorf("late rank: %v", err)
			}
		})
	}
}

// Communicators made by Split share too: each part sees its own members'
// values in its own rank order, while the parts run at once.
func TestShareOnSplitCommunicators(t *testing.T) {
	noLeaks(t)
	const p = 4
	for _, tc := range []struct {
		name    string
		color   func(r int) int
		key     func(r int) int
		members map[int][]int // color -> world ranks in sub-rank order
	}{
		{"halves", func(r int) int { return r / 2 }, func(r int) int { return r }, map[int][]int{0: {0, 1}, 1: {2, 3}}},
		{"parity-reversed", func(r int) int { return r % 2 }, func(r int) int { return -r }, map[int][]int{0: {2, 0}, 1: {3, 1}}},
		{"uneven", func(r int) int { return min(r, 1) }, func(r int) int { return 0 }, map[int][]int{0: {0}, 1: {1, 2, 3}}},
		{"singletons", func(r int) int { return r }, func(r int) int { return 0 }, map[int][]int{0: {0}, 1: {1}, 2: {2}, 3: {3}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := local.Run(context.Background(), p, func(ctx context.Context, c comm.Communicator) error {
				var _ comm.SharedMemory = c.(comm.SharedMemory)
				r := c.Rank()
				sub, err := c.Split(ctx, tc.color(r), tc.key(r))
				if err != nil {
					return err
				}
				sm, err := shareOf(sub)
				if err != nil {
					return err
				}
				members := tc.members[tc.color(r)]
				if sub.Size() != len(members) || members[sub.Rank()] != r {
					return fmt.Errorf("split: rank %d of %d, want position of %d in %v", sub.Rank(), sub.Size(), r, members)
				}
				world, err := shareOf(c)
				if err != nil {
					return err
				}
				for k := 0; k < 5; k++ {
					err := sm.Share(ctx, [2]int{k, r}, func(peers []any) error {
						if len(peers) != len(members) {
							return fmt.Errorf("%d peers, want %d", len(peers), len(members))
						}
						for q, v := range peers {
							if v != [2]int{k, members[q]} {
								return fmt.Errorf("round %d: sub peers[%d] = %v, want world rank %d's", k, q, v, members[q])
							}
						}
						return nil
					})
					if err != nil {
						return err
					}
					// The parent still shares between the parts' calls.
					err = world.Share(ctx, -r, func(peers []any) error {
						for q, v := range peers {
							if v != -q {
								return fmt.Errorf("world peers[%d] = %v", q, v)
							}
						}
						return nil
					})
					if err != nil {
						return err
					}
				}
				return nil
			}, withTimeout(5*time.Second))
			if err != nil {
				t.Fatal(err)
			}
		})
	}
}
