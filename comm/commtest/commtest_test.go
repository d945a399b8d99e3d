package commtest_test

import (
	"bytes"
	"math"
	"testing"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/commtest"
)

// TestConformance runs the suite against the fake backend, which checks
// the suite itself: its inputs, references and tolerances. The large size
// is smaller than the default (100003, still prime), since the fake copies
// everything and real backends run the default.
func TestConformance(t *testing.T) {
	cfg := commtest.Config{Short: testing.Short()}
	if !cfg.Short {
		cfg.Large = 100003
	}
	commtest.Run(t, fakeLaunch, cfg)
}

func TestFillDeterministicAndExact(t *testing.T) {
	for _, dt := range comm.AllDTypes() {
		for _, kind := range []commtest.ValueKind{commtest.Mixed, commtest.NearOne} {
			a := commtest.Fill(dt, 4096, 42, 3, kind)
			b := commtest.Fill(dt, 4096, 42, 3, kind)
			if !bytes.Equal(a.Bytes(), b.Bytes()) {
				t.Errorf("%v %v: Fill is not deterministic", dt, kind)
			}
			if c := commtest.Fill(dt, 4096, 42, 4, kind); bytes.Equal(a.Bytes(), c.Bytes()) {
				t.Errorf("%v %v: ranks 3 and 4 got the same data", dt, kind)
			}
			vals := commtest.ToFloat64(a)
			distinct := map[float64]bool{}
			for i, v := range vals {
				distinct[v] = true
				var lo, hi float64
				switch {
				case dt == comm.Uint8 && kind == commtest.Mixed:
					lo, hi = 0, 255
				case dt == comm.Uint8:
					lo, hi = 1, 3
				case dt.IsFloat() && kind == commtest.Mixed:
					lo, hi = -1, 1
				case dt.IsFloat():
					lo, hi = 0.5, 1.5
					v = math.Abs(v)
				case dt == comm.Int32 && kind == commtest.Mixed:
					lo, hi = -(1 << 20), 1<<20
				case dt == comm.Int64 && kind == commtest.Mixed:
					lo, hi = -(1 << 40), 1<<40
				case dt == comm.Int32:
					lo, hi = 1, 4
					v = math.Abs(v)
				default:
					lo, hi = 1, 64
					v = math.Abs(v)
				}
				if v < lo || v > hi {
					t.Fatalf("%v %v: element %d = %v outside [%v, %v]", dt, kind, i, v, lo, hi)
				}
				// The widening must agree with comm's own conversions.
				var want float64
				switch dt {
				case comm.BFloat16:
					want = float64(a.BFloat16s()[i].Float32())
				case comm.Float16:
					want = float64(a.Float16s()[i].Float32())
				default:
					continue
				}
				if vals[i] != want {
					t.Fatalf("%v: element %d widens to %v, comm says %v", dt, i, vals[i], want)
				}
			}
			if len(distinct) < 3 {
				t.Errorf("%v %v: only %d distinct values", dt, kind, len(distinct))
			}
		}
	}
}
