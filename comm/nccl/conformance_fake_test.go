//go:build linux && (amd64 || arm64)

package nccl

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/commtest"
)

// fakeLauncher runs the conformance suite's ranks as communicators on the
// fake, one device per rank, all in this process.
func fakeLauncher(l *Library, opts ...Option) commtest.Launcher {
	return func(ctx context.Context, p int, fn func(ctx context.Context, c comm.Communicator) error) error {
		var mu sync.Mutex
		var splits []*Comm
		hook := func(c *commConfig) {
			c.onSplit = func(s *Comm) {
				mu.Lock()
				splits = append(splits, s)
				mu.Unlock()
			}
		}
		w, err := startWorld(ctx, l, p, append(opts, hook)...)
		if err != nil {
			return err
		}
		err = w.run(func(r int, c *Comm) error {
			if err := fn(ctx, c); err != nil {
				return fmt.Errorf("rank %d: %w", r, err)
			}
			return nil
		})
		var cerrs []error
		for _, s := range splits { // children first: they share the devices
			cerrs = append(cerrs, s.Close())
		}
		cerrs = append(cerrs, w.close())
		return errors.Join(append([]error{err}, cerrs...)...)
	}
}

// TestConformanceFake runs the backend-independent conformance suite on
// the fake: every collective, dtype, reduce op, root and size, in place
// and not, send/recv with tags, barrier, split and async work, through
// host staging, grouping, batching and nonblocking settling, for several
// NCCL versions (native AllToAll/Gather/Scatter from 2.28, grouped
// send/recv before).
func TestConformanceFake(t *testing.T) {
	cases := []struct {
		name    string
		version int32
		settle  int32
		cfg     Config
		ranks   []int
		short   []int // with -short (CI runs the race detector so)
	}{
		{"nccl2.28_nonblocking", 22803, 2, Config{}, []int{1, 2, 3, 5}, []int{1, 3}},
		{"nccl2.21_grouped", 22105, 3, Config{}, []int{1, 2, 4}, []int{2}},
		{"nccl2.28_blocking", 22803, 1, Config{Blocking: true}, []int{1, 3}, []int{2}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			f := useFake(t)
			f.setVersion(tc.version)
			f.setSettle(tc.settle)
			l := f.load(t)
			if got := l.HasNativeAllToAll(); got != (tc.version >= 22800) {
				t.Fatalf("HasNativeAllToAll = %v for version %d", got, tc.version)
			}
			before := f.snapshot()
			ranks := tc.ranks
			if testing.Short() {
				ranks = tc.short
			}
			commtest.Run(t, fakeLauncher(l, WithConfig(tc.cfg)), commtest.Config{Ranks: ranks, Short: true, Large: 1031})
			f.clean(t)
			f.noLeaks(t, before)
		})
	}
}
