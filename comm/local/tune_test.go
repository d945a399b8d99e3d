package local

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/b7ea7098/loom/comm"
)

// busyCalibration is a model as a calibration taken while other work ran
// could measure it: every parameter within the plausible range, but
// copies from memory and reductions slowed ten- and fivefold. Under it
// direct and double tree cost the same for an AllReduce of 1 MiB on two
// ranks, and rounding gave the tie to double tree, which runs about six
// times slower there (issue 26, point 8).
func busyCalibration() *comm.CostModel {
	m := comm.BuiltinCostModel()
	m.Alpha, m.Beta, m.Gamma, m.GammaStream = 5.963456942763212e-07, 1.4028861133463856e-09, 6.075120166507765e-10, 4.6143674102731486e-11
	m.BetaCache, m.GammaCache, m.Bandwidth = 6.308231400680875e-11, 1.6333198827510975e-10, 8.357002808404752e+09
	m.Cores, m.CacheBytes = 2, 32<<20
	return m
}

// algorithms runs calls AllReduces of count float32 on p ranks of wd and
// returns the algorithm each rank's recorder shows for each call.
func algorithms(t *testing.T, wd *World, calls, count int) [][]string {
	t.Helper()
	p := wd.Size()
	out := make([][]string, p)
	errs := make([]error, p)
	var wg sync.WaitGroup
	for r := 0; r < p; r++ {
		wg.Add(1)
		go func(r int) {
			defer wg.Done()
			c := wd.Comm(r)
			send, recv := make([]float32, count), make([]float32, count)
			for i := range send {
				send[i] = float32(r + 1)
			}
			for range calls {
				if err := comm.AllReduce(context.Background(), c, comm.Host(send), comm.Host(recv), comm.Sum); err != nil {
					errs[r] = err
					return
				}
				if want := float32(p * (p + 1) / 2); recv[0] != want || recv[count-1] != want {
					errs[r] = errors.New("wrong sum")
					return
				}
			}
			for _, e := range c.Recorder().Entries() {
				out[r] = append(out[r], e.Algorithm)
			}
		}(r)
	}
	wg.Wait()
	for r, err := range errs {
		if err != nil {
			t.Fatalf("rank %d: %v", r, err)
		}
	}
	return out
}

// TestSkewedCalibrationRecovers: a calibration taken on a busy machine,
// read from the cache, must not make the automatic choice pick an
// algorithm far slower than the one the built-in model picks (on the code
// before the fix, the busy one picked double tree: a rounding tie with
// direct), and a parameter far outside the plausible range is replaced by
// the built-in value (before the fix it was used as measured).
func TestSkewedCalibrationRecovers(t *testing.T) {
	isolate(t)
	builtin := comm.BuiltinCostModel()
	tests := []struct {
		name  string
		skew  func(m *comm.CostModel)
		check func(t *testing.T, m *comm.CostModel)
	}{
		{"busy, within bounds", func(m *comm.CostModel) { *m = *busyCalibration() }, nil},
		{"cache copies 100x slow", func(m *comm.CostModel) { m.BetaCache *= 100 }, func(t *testing.T, m *comm.CostModel) {
			if m.BetaCache != builtin.BetaCache {
				t.Errorf("BetaCache %g, want the built-in %g", m.BetaCache, builtin.BetaCache)
			}
		}},
		{"handoffs 1000x fast", func(m *comm.CostModel) { m.Alpha /= 1000 }, func(t *testing.T, m *comm.CostModel) {
			if m.Alpha != builtin.Alpha {
				t.Errorf("Alpha %g, want the built-in %g", m.Alpha, builtin.Alpha)
			}
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "model.json")
			t.Setenv(comm.CostModelEnv, path)
			skewed := comm.BuiltinCostModel()
			tt.skew(skewed)
			skewed.Machine = machineID()
			if err := comm.SaveCostModel(path, skewed); err != nil {
				t.Fatal(err)
			}
			c := &modelCache{byPath: map[string]*comm.CostModel{}}
			m := c.get(func() *comm.CostModel { t.Error("measured despite a cached model"); return fakeModel() })
			if tt.check != nil {
				tt.check(t, m)
			}
			wd, err := NewWorld(2, WithCostModel(m), WithTuning(TuneOff))
			if err != nil {
				t.Fatal(err)
			}
			got := algorithms(t, wd, 1, 1<<18) // 1 MiB
			if got[0][0] != comm.Direct.String() {
				t.Errorf("AllReduce of 1 MiB on 2 ranks chose %s under the skewed calibration, want direct", got[0][0])
			}
		})
	}
}

// TestNoisyCalibrationNotSaved: a calibration whose samples varied much
// (another program ran) is used by this process but not cached.
func TestNoisyCalibrationNotSaved(t *testing.T) {
	isolate(t)
	path := filepath.Join(t.TempDir(), "model.json")
	t.Setenv(comm.CostModelEnv, path)
	c := &modelCache{byPath: map[string]*comm.CostModel{}}
	m := c.get(func() *comm.CostModel { m := fakeModel(); m.Spread = 3; return m })
	if !m.Valid() || m.Spread != 3 {
		t.Fatalf("model %+v, want the noisy measurement", *m)
	}
	if _, err := os.Stat(path); !os.IsNotExist(err) {
		t.Errorf("a noisy calibration was saved: %v", err)
	}
}

// TestFastest: the smallest sample another confirms, not a lone outlier
// below the rest, nor the mean of samples inflated by load.
func TestFastest(t *testing.T) {
	tests := []struct {
		name     string
		samples  []float64
		want     float64
		noisyish bool
	}{
		{"quiet", []float64{1.0, 1.02, 1.01, 1.03, 1.0, 1.05, 1.01}, 1.0, false},
		{"busy", []float64{9, 1.0, 1.1, 7, 8, 6, 10}, 1.0, true},
		{"lone low outlier", []float64{0.1, 1.0, 1.05, 1.1, 1.0, 1.2, 1.1}, 1.0, false},
		{"no pair", []float64{1, 2, 4, 8, 16, 32, 64}, 8, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			i := 0
			got, spread := fastest(len(tt.samples), func() float64 { i++; return tt.samples[i-1] })
			if got != tt.want {
				t.Errorf("fastest = %g, want %g", got, tt.want)
			}
			if noisy := spread > comm.NoisySpread; noisy != tt.noisyish {
				t.Errorf("spread %g: noisy %v, want %v", spread, noisy, tt.noisyish)
			}
		})
	}
}

// TestMachineID: a cached model is measured over when the CPU count, the
// Go version or loom's algorithm set changes, not only the CPU model.
func TestMachineID(t *testing.T) {
	id := machineID()
	for _, part := range []string{fmt.Sprintf("cpus=%d", runtime.NumCPU()), fmt.Sprintf("procs=%d", runtime.GOMAXPROCS(0)), runtime.Version(), algorithmSet} {
		if !strings.Contains(id, part) {
			t.Errorf("machineID %q lacks %q", id, part)
		}
	}
}

// TestBuiltinCrossover: with measuring off, AllReduce on two ranks from 1
// to 4 MiB is direct, which is fastest there; double tree and ring cost
// the same in the model and take more steps.
func TestBuiltinCrossover(t *testing.T) {
	wd, err := NewWorld(2, WithCostModel(comm.BuiltinCostModel()), WithTuning(TuneOff))
	if err != nil {
		t.Fatal(err)
	}
	g := wd.comms[0].g
	for _, bytes := range []int{1 << 20, 2 << 20, 4 << 20} {
		pl := plan{op: comm.OpAllReduce, p: 2, n: bytes / 4, stream: int64(bytes)*4 > g.w.model.CacheBytes/2}
		pl.piece = pieceElems(comm.Float32, pl.stream)
		if a := g.chooseBy(g.w.model, pl, make([]byte, 2), comm.Float32); a != comm.Direct {
			t.Errorf("%d bytes: chose %v, want direct", bytes, a)
		}
	}
}

// TestTuningPicksFaster: where the model finds candidates close, the
// first calls time them and every later call runs the fastest, the same
// algorithm on every rank for every call. The trial times are injected:
// the candidate the model ranks last takes 50 µs, every other 300 µs.
func TestTuningPicksFaster(t *testing.T) {
	// Without the price of overwriting peers' cached lines the model finds
	// several AllReduce algorithms close at 1 MiB; with it direct is far
	// ahead and there is nothing to tune.
	m := comm.BuiltinCostModel()
	m.Invalidate = 0
	for _, p := range []int{2, 3, 4} {
		wd, err := NewWorld(p, WithCostModel(m), WithTuning(TuneAll))
		if err != nil {
			t.Fatal(err)
		}
		pl := plan{op: comm.OpAllReduce, p: p, n: 1 << 18, piece: pieceElems(comm.Float32, false)}
		cands := wd.comms[0].g.candidates(pl, make([]byte, p), comm.Float32)
		if len(cands) < 2 {
			t.Fatalf("p=%d: candidates %v, want several close ones", p, cands)
		}
		fast := cands[len(cands)-1]
		wd.w.trialTime = func(a comm.Algorithm, _ time.Duration) time.Duration {
			if a == fast {
				return 50 * time.Microsecond
			}
			return 300 * time.Microsecond
		}
		const calls = 30
		got := algorithms(t, wd, calls, 1<<18)
		for r := 1; r < p; r++ {
			if strings.Join(got[r], ",") != strings.Join(got[0], ",") {
				t.Fatalf("p=%d: ranks chose differently:\nrank 0: %v\nrank %d: %v", p, got[0], r, got[r])
			}
		}
		if last := got[0][calls-1]; last != fast.String() {
			t.Errorf("p=%d: after tuning the calls run %s, want %v (the fastest trial); all: %v", p, last, fast, got[0])
		}
		tried := map[string]bool{}
		for _, a := range got[0][:calls/2] {
			tried[a] = true
		}
		if len(tried) < 2 {
			t.Errorf("p=%d: the first calls ran only %v, want several candidates timed", p, got[0][:calls/2])
		}
	}
}

// TestTuningRealClock: tuned with measured times on a machine that may be
// busy, every rank still runs the same algorithm on every call, and the
// results are right, for several size classes at once.
func TestTuningRealClock(t *testing.T) {
	for _, p := range []int{2, 3} {
		wd, err := NewWorld(p, WithCostModel(comm.BuiltinCostModel()), WithTuning(TuneAll))
		if err != nil {
			t.Fatal(err)
		}
		for _, count := range []int{1 << 10, 1 << 15, 3 << 15, 1 << 18} {
			got := algorithms(t, wd, 20, count)
			for r := 1; r < p; r++ {
				if strings.Join(got[r], ",") != strings.Join(got[0], ",") {
					t.Fatalf("p=%d count=%d: ranks chose differently:\nrank 0: %v\nrank %d: %v", p, count, got[0], r, got[r])
				}
			}
		}
	}
}

func TestTuneEnv(t *testing.T) {
	tests := []struct {
		v    string
		want Tuning
		bad  bool
	}{
		{"", TuneExact, false}, {" exact ", TuneExact, false}, {"ALL", TuneAll, false},
		{"off", TuneOff, false}, {"0", TuneOff, false}, {"False", TuneOff, false}, {"none", TuneOff, false},
		{"on", 0, true}, {"1", 0, true}, {"maybe", 0, true},
	}
	for _, tt := range tests {
		t.Run(tt.v, func(t *testing.T) {
			t.Setenv(TuneEnv, tt.v)
			wd, err := NewWorld(2, WithCostModel(comm.BuiltinCostModel()))
			if tt.bad {
				if !errors.Is(err, comm.ErrInvalid) || !strings.Contains(err.Error(), TuneEnv) {
					t.Errorf("NewWorld with %s=%q: %v, want an ErrInvalid naming the variable", TuneEnv, tt.v, err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if wd.w.tune != tt.want {
				t.Errorf("%s=%q: tune %v, want %v", TuneEnv, tt.v, wd.w.tune, tt.want)
			}
			// WithTuning wins over the variable.
			other := (tt.want + 1) % 3
			if wd, err = NewWorld(2, WithCostModel(comm.BuiltinCostModel()), WithTuning(other)); err != nil || wd.w.tune != other {
				t.Errorf("WithTuning(%v) under %s=%q: %v", other, TuneEnv, tt.v, err)
			}
		})
	}
	if _, err := NewWorld(2, WithCostModel(comm.BuiltinCostModel()), WithTuning(Tuning(9))); !errors.Is(err, comm.ErrInvalid) {
		t.Errorf("WithTuning(9): %v, want ErrInvalid", err)
	}
}

// TestTuneExact: by default only calls whose result no algorithm can
// change are tuned, so float sums over more than two ranks keep the
// model's algorithm from the first call on, and a program gives the same
// bits every run.
func TestTuneExact(t *testing.T) {
	tests := []struct {
		op    comm.Op
		red   comm.ReduceOp
		dt    comm.DType
		p     int
		exact bool
	}{
		{comm.OpAllGather, comm.Sum, comm.Float32, 4, true},
		{comm.OpBroadcast, comm.Sum, comm.BFloat16, 8, true},
		{comm.OpAllReduce, comm.Sum, comm.Int32, 4, true},
		{comm.OpAllReduce, comm.Max, comm.Int64, 3, true},
		{comm.OpAllReduce, comm.Sum, comm.Float32, 2, true},
		{comm.OpAllReduce, comm.Avg, comm.BFloat16, 2, true},
		{comm.OpReduceScatter, comm.Prod, comm.Float64, 2, true},
		{comm.OpAllReduce, comm.Min, comm.Float32, 2, false}, // min(+0, -0) depends on the order
		{comm.OpAllReduce, comm.Sum, comm.Float32, 3, false},
		{comm.OpReduceScatter, comm.Sum, comm.Float16, 4, false},
	}
	for _, tt := range tests {
		if got := exact(tt.op, tt.red, tt.dt, tt.p); got != tt.exact {
			t.Errorf("exact(%v, %v, %v, p=%d) = %v, want %v", tt.op, tt.red, tt.dt, tt.p, got, tt.exact)
		}
	}
	// A float sum over three ranks, timed under TuneExact: no trials.
	wd, err := NewWorld(3, WithCostModel(comm.BuiltinCostModel()), WithTuning(TuneExact))
	if err != nil {
		t.Fatal(err)
	}
	wd.w.trialTime = func(comm.Algorithm, time.Duration) time.Duration { t.Error("a trial was timed"); return time.Second }
	got := algorithms(t, wd, 20, 1<<18)
	for _, a := range got[0] {
		if a != got[0][0] {
			t.Fatalf("the calls ran %v, want one algorithm", got[0])
		}
	}
}
