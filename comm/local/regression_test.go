package local_test

import (
	"context"
	"errors"
	"math"
	"testing"
	"time"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/local"
)

// Split right after waiting for async work always succeeds, and Split
// issued while async work is pending runs after it.
func TestSplitAfterAsyncWork(t *testing.T) {
	noLeaks(t)
	err := local.Run(context.Background(), 2, func(ctx context.Context, c comm.Communicator) error {
		x := []float32{1}
		for i := 0; i < 300; i++ {
			w, err := comm.AllReduceAsync(ctx, c, comm.Host(x), comm.Host(x), comm.Sum)
			if err != nil {
				return err
			}
			if i%2 == 0 { // sometimes Split with the work still pending
				if err := w.Wait(ctx); err != nil {
					return err
				}
			}
			sub, err := c.Split(ctx, 0, c.Rank())
			if err != nil {
				return err
			}
			if err := w.Wait(ctx); err != nil {
				return err
			}
			if sub.Size() != 2 {
				return errors.New("wrong split")
			}
		}
		return nil
	}, withTimeout(20*time.Second))
	if err != nil {
		t.Fatal(err)
	}
}

// Bad handles are errors, never panics: a typed nil buffer, and the Work of
// a rejected SendAsync is nil so WaitAll skips it.
func TestNilBuffersAndFailedAsyncPointToPoint(t *testing.T) {
	noLeaks(t)
	err := local.Run(context.Background(), 2, func(ctx context.Context, c comm.Communicator) error {
		var nb *comm.HostBuffer
		if err := comm.AllReduce(ctx, c, nb, nb, comm.Sum); !errors.Is(err, comm.ErrInvalid) {
			return errors.New("typed nil buffer: " + errString(err))
		}
		w, err := comm.SendAsync(ctx, c, comm.Host([]float32{1}), 5, 0)
		if err == nil || w != nil {
			return errors.New("SendAsync to rank 5 of 2 accepted")
		}
		return comm.WaitAll(ctx, w)
	}, withTimeout(5*time.Second))
	if err != nil {
		t.Fatal(err)
	}
}

func errString(err error) string {
	if err == nil {
		return "no error"
	}
	return err.Error()
}

// A single LOOM_ALGO algorithm applies to the ops it can serve; the others
// stay automatic.
func TestAlgorithmEnvAppliesWhereItCan(t *testing.T) {
	t.Setenv(comm.AlgorithmEnv, "ring")
	err := local.Run(context.Background(), 3, func(ctx context.Context, c comm.Communicator) error {
		x := []float32{1}
		if err := comm.AllReduce(ctx, c, comm.Host(x), comm.Host(x), comm.Sum); err != nil {
			return err
		}
		if got := c.Recorder().Entries()[0].Algorithm; got != "ring" {
			return errors.New("allreduce ran " + got)
		}
		return comm.Barrier(ctx, c)
	})
	if err != nil {
		t.Fatal(err)
	}
}

// Avg of 16-bit floats divides before summing, so a sum beyond the type's
// range still averages correctly.
func TestHalfAverageDoesNotOverflow(t *testing.T) {
	err := local.Run(context.Background(), 2, func(ctx context.Context, c comm.Communicator) error {
		h := []comm.Float16Bits{comm.ToFloat16(40000), comm.ToFloat16(-40000)}
		b := []comm.BFloat16Bits{comm.ToBFloat16(3e38), comm.ToBFloat16(1)}
		if err := comm.AllReduce(ctx, c, comm.Host(h), comm.Host(h), comm.Avg); err != nil {
			return err
		}
		if err := comm.AllReduce(ctx, c, comm.Host(b), comm.Host(b), comm.Avg); err != nil {
			return err
		}
		if h[0].Float32() != 40000 || h[1].Float32() != -40000 {
			return errors.New("float16 average overflowed")
		}
		if v := b[0].Float32(); math.IsInf(float64(v), 0) || math.Abs(float64(v)-3e38)/3e38 > 1e-2 || b[1].Float32() != 1 {
			return errors.New("bfloat16 average overflowed")
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// A rank whose function returns without joining a collective fails the
// peers waiting for it at once, not after the timeout.
func TestRankThatReturnsEarlyFailsPeersAtOnce(t *testing.T) {
	noLeaks(t)
	start := time.Now()
	err := local.Run(context.Background(), 3, func(ctx context.Context, c comm.Communicator) error {
		if c.Rank() == 1 {
			return nil
		}
		err := comm.Barrier(ctx, c)
		if !errors.Is(err, local.ErrRankLeft) && !errors.Is(err, comm.ErrAborted) {
			return errors.New("barrier without rank 1: " + errString(err))
		}
		// Point-to-point too.
		if err := comm.Recv(ctx, c, comm.Host([]float32{0}), 1, 0); err == nil {
			return errors.New("receive from a rank that left succeeded")
		}
		return nil
	}, withTimeout(time.Minute))
	if err != nil {
		t.Fatal(err)
	}
	if el := time.Since(start); el > 5*time.Second {
		t.Fatalf("peers waited %v for a rank that had returned", el)
	}
}

// Split orders by key without overflow, and buffers an op ignores on a
// rank are not checked there.
func TestSplitKeysAndIgnoredBuffers(t *testing.T) {
	keys := []int{math.MinInt, 1, 0}
	want := []int{0, 2, 1} // new rank of each old rank
	err := local.Run(context.Background(), 3, func(ctx context.Context, c comm.Communicator) error {
		sub, err := c.Split(ctx, 0, keys[c.Rank()])
		if err != nil {
			return err
		}
		if sub.Rank() != want[c.Rank()] {
			return errors.New("split ordered keys wrongly")
		}
		// Rank 1's recv has another dtype; Reduce to root 0 ignores it.
		send := comm.Host([]float32{1})
		var recv comm.Buffer = comm.Host([]float32{0})
		if c.Rank() == 1 {
			recv = comm.Host([]int32{7})
		}
		return comm.Reduce(ctx, c, send, recv, comm.Sum, 0)
	}, withTimeout(5*time.Second))
	if err != nil {
		t.Fatal(err)
	}
}
