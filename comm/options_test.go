package comm_test

import (
	"encoding/json"
	"errors"
	"io/fs"
	"math"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/b7ea7098/loom"
	"github.com/b7ea7098/loom/comm"
)

func TestOptionsFromEnv(t *testing.T) {
	tests := []struct {
		name                      string
		debug, timeout, dir, algo string
		wantCheck                 bool
		wantTimeout               time.Duration
		wantDir                   string
		wantAlgo                  comm.Algorithm // for allreduce
		wantErr                   string
	}{
		{name: "nothing set"},
		{name: "blank values", debug: "  ", timeout: " ", algo: "\t"},
		{name: "consistency", debug: "consistency", wantCheck: true},
		{name: "switch with blanks", debug: " consistency ", wantCheck: true},
		{name: "empty switch", debug: " consistency ,,", wantErr: `comm: LOOM_DEBUG=" consistency ,,": invalid call: empty switch`},
		{name: "trailing comma", debug: "consistency,", wantErr: `LOOM_DEBUG="consistency,": invalid call: empty switch`},
		{name: "repeated switch", debug: "consistency,consistency", wantErr: `LOOM_DEBUG="consistency,consistency": invalid call: switch "consistency" given twice`},
		{name: "unknown switch", debug: "trace", wantErr: `comm: LOOM_DEBUG="trace": invalid call: unknown switch "trace" (known: consistency)`},
		{name: "unknown switch after a good one", debug: "consistency,nccl", wantErr: `unknown switch "nccl"`},
		{name: "switch in another case", debug: "Consistency", wantErr: `unknown switch "Consistency"`},
		{name: "timeout", timeout: "30s", wantTimeout: 30 * time.Second},
		{name: "timeout with blanks", timeout: " 30s ", wantTimeout: 30 * time.Second},
		{name: "compound timeout", timeout: "1m30s", wantTimeout: 90 * time.Second},
		{name: "timeout without unit", timeout: "30", wantErr: `comm: LOOM_TIMEOUT="30": invalid call: want a positive duration such as 30s`},
		{name: "bad timeout", timeout: "soon", wantErr: `LOOM_TIMEOUT="soon"`},
		{name: "zero timeout", timeout: "0s", wantErr: `LOOM_TIMEOUT="0s"`},
		{name: "negative timeout", timeout: "-5s", wantErr: `LOOM_TIMEOUT="-5s"`},
		{name: "two timeouts", timeout: "5s,6s", wantErr: `LOOM_TIMEOUT="5s,6s"`},
		{name: "dump dir", dir: "/tmp/loom-dumps", wantDir: "/tmp/loom-dumps"},
		{name: "algorithm", algo: "ring", wantAlgo: comm.Ring},
		{name: "per-op algorithm", algo: "allgather=direct,allreduce=rd", wantAlgo: comm.RecursiveDoubling},
		{name: "bad algorithm", algo: "allreduce=warp", wantErr: `comm: LOOM_ALGO="allreduce=warp": invalid call: entry "allreduce=warp": unknown algorithm "warp"`},
		{name: "conflicting algorithms", algo: "allreduce=ring,allreduce=tree", wantErr: `comm: LOOM_ALGO="allreduce=ring,allreduce=tree": invalid call: entry "allreduce=tree": allreduce is already forced by entry "allreduce=ring"`},
		{name: "everything", debug: "consistency", timeout: "2h", dir: "d", algo: "tree",
			wantCheck: true, wantTimeout: 2 * time.Hour, wantDir: "d", wantAlgo: comm.Tree},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Setenv(comm.DebugEnv, tc.debug)
			t.Setenv(comm.TimeoutEnv, tc.timeout)
			t.Setenv(comm.DumpDirEnv, tc.dir)
			t.Setenv(comm.AlgorithmEnv, tc.algo)
			o, err := comm.OptionsFromEnv()
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("error = %v, want %q", err, tc.wantErr)
				}
				if !errors.Is(err, comm.ErrInvalid) || !errors.Is(err, loom.ErrInvalid) {
					t.Errorf("error %v does not wrap comm.ErrInvalid and loom.ErrInvalid", err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if o.ConsistencyCheck != tc.wantCheck || o.Timeout != tc.wantTimeout || o.DumpDir != tc.wantDir {
				t.Errorf("got check=%v timeout=%v dir=%q, want %v %v %q",
					o.ConsistencyCheck, o.Timeout, o.DumpDir, tc.wantCheck, tc.wantTimeout, tc.wantDir)
			}
			if o.Algorithms == nil {
				t.Fatal("Algorithms is nil")
			}
			if got := o.Algorithms.For(comm.OpAllReduce, nil); got != tc.wantAlgo {
				t.Errorf("allreduce algorithm %v, want %v", got, tc.wantAlgo)
			}
			if o.RecorderSize != 0 || o.CostModel != nil {
				t.Errorf("unexpected RecorderSize=%d CostModel=%v", o.RecorderSize, o.CostModel)
			}
		})
	}
	names := []string{comm.DebugEnv, comm.TimeoutEnv, comm.DumpDirEnv}
	if strings.Join(names, " ") != "LOOM_DEBUG LOOM_TIMEOUT LOOM_FLIGHT_RECORDER_DIR" {
		t.Errorf("environment variable names changed: %v", names)
	}
}

func TestOptionsWithDefaults(t *testing.T) {
	d := comm.Options{}.WithDefaults()
	if d.Timeout != comm.DefaultTimeout || d.RecorderSize != comm.DefaultRecorderSize || d.Algorithms == nil ||
		d.ConsistencyCheck || d.DumpDir != "" || d.CostModel != nil {
		t.Errorf("zero Options with defaults: %+v", d)
	}
	if comm.DefaultTimeout != 10*time.Minute || comm.DefaultRecorderSize != 2000 {
		t.Errorf("defaults changed: %v %d", comm.DefaultTimeout, comm.DefaultRecorderSize)
	}
	neg := comm.Options{Timeout: -time.Second, RecorderSize: -3}.WithDefaults()
	if neg.Timeout != comm.DefaultTimeout || neg.RecorderSize != comm.DefaultRecorderSize {
		t.Errorf("negative fields not defaulted: %+v", neg)
	}
	m := &comm.CostModel{Alpha: 1}
	set := comm.Options{Timeout: 5 * time.Second, RecorderSize: 7, ConsistencyCheck: true, DumpDir: "x",
		Algorithms: comm.AlgorithmOverrides{0: comm.Ring}, CostModel: m}
	got := set.WithDefaults()
	if got.Timeout != 5*time.Second || got.RecorderSize != 7 || !got.ConsistencyCheck || got.DumpDir != "x" ||
		got.Algorithms.For(comm.OpAllReduce, nil) != comm.Ring || got.CostModel != m {
		t.Errorf("set fields overridden: %+v", got)
	}
}

func validModel() comm.CostModel {
	return comm.CostModel{Alpha: 2e-6, Switch: 5e-7, Beta: 1e-10, Gamma: 5e-11, GammaStream: 4e-11, BetaCache: 5e-11,
		GammaCache: 3e-11, CacheBytes: 32 << 20, Bandwidth: 4e10, Cores: 8,
		Machine: "box-1", Measured: time.Date(2025, 3, 4, 5, 6, 7, 8, time.UTC)}
}

func TestCostModelValid(t *testing.T) {
	inf, nan := math.Inf(1), math.NaN()
	tests := []struct {
		name   string
		mutate func(*comm.CostModel)
		valid  bool
	}{
		{"valid", func(*comm.CostModel) {}, true},
		{"no machine is still valid", func(m *comm.CostModel) { m.Machine = "" }, true},
		{"alpha zero", func(m *comm.CostModel) { m.Alpha = 0 }, false},
		{"alpha negative", func(m *comm.CostModel) { m.Alpha = -1 }, false},
		{"beta inf", func(m *comm.CostModel) { m.Beta = inf }, false},
		{"beta nan", func(m *comm.CostModel) { m.Beta = nan }, false},
		{"gamma zero", func(m *comm.CostModel) { m.Gamma = 0 }, false},
		{"gamma -inf", func(m *comm.CostModel) { m.Gamma = -inf }, false},
		{"gamma stream zero", func(m *comm.CostModel) { m.GammaStream = 0 }, false},
		{"switch zero", func(m *comm.CostModel) { m.Switch = 0 }, false},
		{"beta cache nan", func(m *comm.CostModel) { m.BetaCache = nan }, false},
		{"gamma cache negative", func(m *comm.CostModel) { m.GammaCache = -1 }, false},
		{"no cache size", func(m *comm.CostModel) { m.CacheBytes = 0 }, false},
		{"bandwidth nan", func(m *comm.CostModel) { m.Bandwidth = nan }, false},
		{"bandwidth zero", func(m *comm.CostModel) { m.Bandwidth = 0 }, false},
		{"no cores", func(m *comm.CostModel) { m.Cores = 0 }, false},
		{"negative cores", func(m *comm.CostModel) { m.Cores = -2 }, false},
	}
	for _, tc := range tests {
		m := validModel()
		tc.mutate(&m)
		if got := m.Valid(); got != tc.valid {
			t.Errorf("%s: Valid = %v, want %v", tc.name, got, tc.valid)
		}
	}
	var nilModel *comm.CostModel
	if nilModel.Valid() {
		t.Error("nil model is valid")
	}
}

func TestCostModelEstimate(t *testing.T) {
	m := validModel()
	sizes := []int64{0, 1, 8, 1 << 10, 1 << 16, 1 << 20, 1 << 26, 1 << 30}
	for _, tc := range allOps {
		for _, p := range []int{2, 3, 4, 7, 8, 64} {
			prev := time.Duration(-1)
			for _, n := range sizes {
				d := m.Estimate(tc.op, p, n)
				if d < 0 {
					t.Errorf("%v p=%d n=%d: negative %v", tc.op, p, n, d)
				}
				if d < prev {
					t.Errorf("%v p=%d: %v for %d bytes is less than %v for fewer", tc.op, p, d, n, prev)
				}
				prev = d
			}
			small, large := m.Estimate(tc.op, p, 1<<10), m.Estimate(tc.op, p, 1<<30)
			data := tc.op != comm.OpBarrier && tc.op != comm.OpSplit
			if data && large <= small {
				t.Errorf("%v p=%d: 1 GiB (%v) not slower than 1 KiB (%v)", tc.op, p, large, small)
			}
			if !data && (large != small || small <= 0) {
				t.Errorf("%v p=%d: %v and %v, want one positive latency", tc.op, p, small, large)
			}
		}
		for _, p := range []int{1, 0, -3} {
			for _, n := range sizes {
				if d := m.Estimate(tc.op, p, n); d != 0 {
					t.Errorf("%v p=%d n=%d: %v, want 0", tc.op, p, n, d)
				}
			}
		}
		if d := m.Estimate(tc.op, 8, -1); d != 0 {
			t.Errorf("%v negative bytes: %v", tc.op, d)
		}
	}
	// Exact values of the simplest formulas.
	simple := comm.CostModel{Alpha: 1e-6, Beta: 1e-9, Gamma: 1e-9, Bandwidth: 1, Cores: 1}
	exact := []struct {
		op    comm.Op
		p     int
		bytes int64
		want  time.Duration
	}{
		{comm.OpSend, 2, 1000, 2 * time.Microsecond},                         // α + nβ
		{comm.OpBarrier, 8, 1 << 20, 6 * time.Microsecond},                   // 2·log2(8)·α
		{comm.OpAllGather, 4, 4000, 3*time.Microsecond + 3*time.Microsecond}, // 3α + ¾nβ
		{comm.OpBroadcast, 5, 0, 3 * time.Microsecond},                       // ⌈log2 5⌉α
	}
	for _, tc := range exact {
		got := simple.Estimate(tc.op, tc.p, tc.bytes)
		if diff := got - tc.want; diff < -time.Nanosecond || diff > time.Nanosecond {
			t.Errorf("%v p=%d n=%d: %v, want %v", tc.op, tc.p, tc.bytes, got, tc.want)
		}
	}
	if d := m.Estimate(comm.Op(99), 8, 1<<20); d != 0 {
		t.Errorf("unknown op priced at %v", d)
	}
}

func TestCostModelSaveLoad(t *testing.T) {
	path := filepath.Join(t.TempDir(), "cache", "x.json")
	if _, err := comm.LoadCostModel(path, "box-1"); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("loading before saving: %v", err)
	}
	m := validModel()
	if err := comm.SaveCostModel(path, &m); err != nil {
		t.Fatal(err)
	}
	got, err := comm.LoadCostModel(path, "box-1")
	if err != nil {
		t.Fatal(err)
	}
	if !got.Measured.Equal(m.Measured) {
		t.Errorf("Measured %v, want %v", got.Measured, m.Measured)
	}
	got.Measured = m.Measured
	if *got != m {
		t.Errorf("loaded %+v, want %+v", *got, m)
	}
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var raw map[string]any
	if err := json.Unmarshal(data, &raw); err != nil || raw["machine"] != "box-1" || raw["alpha_s"] != 2e-6 {
		t.Errorf("file content %s (%v)", data, err)
	}

	if _, err := comm.LoadCostModel(path, "box-2"); err == nil || !strings.Contains(err.Error(), `measured on "box-1", not "box-2"`) {
		t.Errorf("loading for another machine: %v", err)
	}

	bad := validModel()
	bad.Beta = 0
	if err := comm.SaveCostModel(path, &bad); err != nil {
		t.Fatal(err)
	}
	if _, err := comm.LoadCostModel(path, "box-1"); err == nil || !strings.Contains(err.Error(), "invalid model") {
		t.Errorf("an invalid cached model: %v", err)
	}

	if err := os.WriteFile(path, []byte("{not json"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := comm.LoadCostModel(path, "box-1"); err == nil || !strings.Contains(err.Error(), path) {
		t.Errorf("corrupt file: %v", err)
	}

	// A folder that cannot be created (its parent is a file) fails the save.
	if err := comm.SaveCostModel(filepath.Join(path, "sub", "y.json"), &m); err == nil {
		t.Error("saving under a file succeeded")
	}
}

func TestCostModelFile(t *testing.T) {
	cache := t.TempDir()
	t.Setenv("XDG_CACHE_HOME", cache)
	t.Setenv("HOME", cache)
	moved := filepath.Join(t.TempDir(), "model.json")
	tests := []struct {
		env  string
		want string
	}{
		{"", filepath.Join(cache, "loom", "costmodel.json")},
		{" \t", filepath.Join(cache, "loom", "costmodel.json")},
		{moved, moved},
		{" " + moved + "\n", moved},
		{comm.CostModelOff, ""},
		{"none", ""},
		{"OFF", ""},
		{" off ", ""},
	}
	for _, tc := range tests {
		t.Run(tc.env, func(t *testing.T) {
			t.Setenv(comm.CostModelEnv, tc.env)
			got, err := comm.CostModelFile()
			if err != nil || got != tc.want {
				t.Errorf("%s=%q: CostModelFile = %q, %v; want %q", comm.CostModelEnv, tc.env, got, err, tc.want)
			}
		})
	}
	if comm.CostModelEnv != "LOOM_COSTMODEL" {
		t.Errorf("CostModelEnv = %q: the documented name is LOOM_COSTMODEL", comm.CostModelEnv)
	}
}

func TestBuiltinCostModel(t *testing.T) {
	m := comm.BuiltinCostModel()
	if !m.Valid() {
		t.Fatalf("BuiltinCostModel is invalid: %+v", *m)
	}
	if m.Cores != runtime.GOMAXPROCS(0) || m.Machine != "builtin" {
		t.Errorf("Cores=%d Machine=%q, want %d, builtin", m.Cores, m.Machine, runtime.GOMAXPROCS(0))
	}
	m.Alpha = 0
	if comm.BuiltinCostModel().Alpha == 0 {
		t.Error("editing one BuiltinCostModel changed the next")
	}
}
