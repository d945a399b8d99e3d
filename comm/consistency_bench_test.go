package comm_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/local"
)

// BenchmarkConsistencyCheck times an AllReduce of 1 KiB (256 float32) on
// comm/local with and without Options.ConsistencyCheck, to price the
// check. comm/local compares every call's fingerprint in shared memory
// either way; the option adds the caller's file:line to it
// (runtime.Callers), which is what this measures. MPI and NCCL
// communicators add one all-gather of the encoded fingerprint per call on
// top.
//
//	go test ./comm -run XXX -bench ConsistencyCheck
func BenchmarkConsistencyCheck(b *testing.B) {
	for _, p := range []int{2, 4} {
		for _, check := range []bool{false, true} {
			b.Run(fmt.Sprintf("p=%d/check=%v", p, check), func(b *testing.B) {
				wd, err := local.NewWorld(p, local.WithOptions(comm.Options{ConsistencyCheck: check}), local.WithCostModel(comm.BuiltinCostModel()))
				if err != nil {
					b.Fatal(err)
				}
				ctx := context.Background()
				errs := make([]error, p)
				b.SetBytes(1 << 10)
				b.ResetTimer()
				var wg sync.WaitGroup
				for r := range p {
					wg.Go(func() {
						x := make([]float32, 256)
						for range b.N {
							if err := comm.AllReduce(ctx, wd.Comm(r), comm.Host(x), comm.Host(x), comm.Sum); err != nil {
								errs[r] = err
								return
							}
						}
					})
				}
				wg.Wait()
				b.StopTimer()
				if err := errors.Join(errs...); err != nil {
					b.Fatal(err)
				}
			})
		}
	}
}
