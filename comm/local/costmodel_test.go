package local

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/b7ea7098/loom/comm"
)

// fakeModel is a valid model that calibrate functions below return instead
// of measuring, so these tests take no second and use no timings.
func fakeModel() *comm.CostModel {
	m := comm.BuiltinCostModel()
	m.Alpha, m.Machine = 1.25e-6, ""
	return m
}

// counter returns a calibrate function that counts its calls.
func counter(calls *int) func() *comm.CostModel {
	return func() *comm.CostModel { *calls++; return fakeModel() }
}

// isolate points the user cache folder at an empty temporary one and
// returns it, so that no test reads or writes the real cache.
func isolate(t *testing.T) string {
	t.Helper()
	cache := t.TempDir()
	t.Setenv("XDG_CACHE_HOME", cache)
	t.Setenv("HOME", cache)
	return cache
}

func assertEmpty(t *testing.T, dir string) {
	t.Helper()
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	if len(entries) != 0 {
		t.Errorf("%s holds %d entries (first %q), want none", dir, len(entries), entries[0].Name())
	}
}

func TestCostModelOff(t *testing.T) {
	for _, v := range []string{comm.CostModelOff, "none"} {
		t.Run(v, func(t *testing.T) {
			cache := isolate(t)
			t.Setenv(comm.CostModelEnv, v)
			c := &modelCache{byPath: map[string]*comm.CostModel{}}
			m := c.get(func() *comm.CostModel { t.Error("calibrated with measuring off"); return fakeModel() })
			if *m != *comm.BuiltinCostModel() {
				t.Errorf("model %+v, want the built-in one", *m)
			}
			if len(c.byPath) != 0 {
				t.Errorf("remembered %d models with measuring off", len(c.byPath))
			}
			assertEmpty(t, cache)

			// The whole path: a world made with measuring off uses the
			// built-in model and writes nothing.
			wd, err := NewWorld(2)
			if err != nil {
				t.Fatal(err)
			}
			if *wd.w.model != *comm.BuiltinCostModel() {
				t.Errorf("NewWorld used %+v, want the built-in model", *wd.w.model)
			}
			assertEmpty(t, cache)
		})
	}
}

func TestCostModelPath(t *testing.T) {
	cache := isolate(t)
	path := filepath.Join(t.TempDir(), "sub", "model.json")
	t.Setenv(comm.CostModelEnv, path)

	calls := 0
	c := &modelCache{byPath: map[string]*comm.CostModel{}}
	m := c.get(counter(&calls))
	if calls != 1 || m.Alpha != 1.25e-6 || m.Machine != machineID() {
		t.Fatalf("first get: %d calibrations, Alpha %g, Machine %q", calls, m.Alpha, m.Machine)
	}
	saved, err := comm.LoadCostModel(path, machineID())
	if err != nil {
		t.Fatalf("the model was not saved at %s: %v", path, err)
	}
	if *saved != *m {
		t.Errorf("saved %+v, returned %+v", *saved, *m)
	}
	assertEmpty(t, cache)

	// The same process does not measure again, and hands out copies.
	m.Alpha = 99
	if again := c.get(counter(&calls)); calls != 1 || again.Alpha != 1.25e-6 {
		t.Errorf("second get: %d calibrations, Alpha %g", calls, again.Alpha)
	}
	// A new process (a fresh cache) reads the file instead of measuring.
	fresh := &modelCache{byPath: map[string]*comm.CostModel{}}
	if got := fresh.get(counter(&calls)); calls != 1 || *got != *saved {
		t.Errorf("new process: %d calibrations, model %+v", calls, *got)
	}

	// A file measured on another machine is measured over.
	other := *saved
	other.Machine = "another box"
	if err := comm.SaveCostModel(path, &other); err != nil {
		t.Fatal(err)
	}
	fresh = &modelCache{byPath: map[string]*comm.CostModel{}}
	if got := fresh.get(counter(&calls)); calls != 2 || got.Machine != machineID() {
		t.Errorf("other machine's file: %d calibrations, Machine %q", calls, got.Machine)
	}
}

func TestCostModelDefaultFile(t *testing.T) {
	cache := isolate(t)
	t.Setenv(comm.CostModelEnv, "")
	calls := 0
	c := &modelCache{byPath: map[string]*comm.CostModel{}}
	c.get(counter(&calls))
	if _, err := comm.LoadCostModel(filepath.Join(cache, "loom", "costmodel.json"), machineID()); err != nil || calls != 1 {
		t.Errorf("default file after %d calibrations: %v", calls, err)
	}
}

func TestCostModelUnwritable(t *testing.T) {
	isolate(t)
	file := filepath.Join(t.TempDir(), "a-file")
	if err := os.WriteFile(file, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	// The folder of the cache file cannot be made: the model is still
	// measured and used, and remembered for the process.
	t.Setenv(comm.CostModelEnv, filepath.Join(file, "model.json"))
	calls := 0
	c := &modelCache{byPath: map[string]*comm.CostModel{}}
	if m := c.get(counter(&calls)); calls != 1 || !m.Valid() {
		t.Fatalf("%d calibrations, model %+v", calls, *m)
	}
	c.get(counter(&calls))
	if calls != 1 {
		t.Errorf("%d calibrations, want 1", calls)
	}

	// An invalid measurement is used (NewWorld then reports it) but never
	// saved, so that it cannot poison later processes.
	path := filepath.Join(t.TempDir(), "model.json")
	t.Setenv(comm.CostModelEnv, path)
	m := c.get(func() *comm.CostModel { bad := fakeModel(); bad.Beta = 0; return bad })
	if m.Valid() {
		t.Error("the invalid measurement came back valid")
	}
	if _, err := os.Stat(path); !os.IsNotExist(err) {
		t.Errorf("an invalid model was saved: %v", err)
	}
}

func TestWithCostModel(t *testing.T) {
	cache := isolate(t)
	t.Setenv(comm.CostModelEnv, "")
	m := fakeModel()
	wd, err := NewWorld(3, WithCostModel(m))
	if err != nil {
		t.Fatal(err)
	}
	if wd.w.model != m {
		t.Errorf("NewWorld used %+v, want the given model", *wd.w.model)
	}
	assertEmpty(t, cache) // nothing measured, nothing written

	// WithCostModel wins over Options.CostModel.
	o := comm.Options{CostModel: comm.BuiltinCostModel()}
	if wd, err = NewWorld(2, WithOptions(o), WithCostModel(m)); err != nil || wd.w.model != m {
		t.Errorf("with both: %v, model %p, want %p", err, wd.w.model, m)
	}
	bad := fakeModel()
	bad.Gamma = -1
	if _, err := NewWorld(2, WithCostModel(bad)); err == nil {
		t.Error("NewWorld accepted an invalid model")
	}
}

// measuredModel is the model calibrated on the 2-core AMD EPYC machine
// whose loombench -compare runs TestChoiceMatchesMeasurements quotes.
func measuredModel() *comm.CostModel {
	return &comm.CostModel{
		Alpha: 6.87e-8, Switch: 9.83e-8,
		Beta: 3.53e-11, Gamma: 3.76e-11, GammaStream: 2.14e-11,
		BetaCache: 1.15e-11, GammaCache: 8.2e-12, Invalidate: 1.35e-10,
		CacheBytes: 32 << 20, Bandwidth: 5.17e10, Cores: 2, Machine: "test",
	}
}

// TestChoiceMatchesMeasurements: under that machine's model the automatic
// choice within the cache is the algorithm loombench measured fastest
// there (µs per call in the comments, the choice against the runner-up).
// Ring and tree Reduce overwrite, on every call, partial sums a peer core
// read in the previous one, and each of those stores first takes the line
// from the peer's cache: priced without it they cost a fifth of what they
// take, and were chosen where direct is 2-3x faster.
func TestChoiceMatchesMeasurements(t *testing.T) {
	m := measuredModel()
	for _, c := range []struct {
		p     int
		bytes int // per rank
		want  comm.Algorithm
	}{
		{3, 1 << 20, comm.Direct},   // 50 against tree 51, ring 178
		{3, 2 << 20, comm.Direct},   // 125 against tree 125, ring 330
		{4, 256 << 10, comm.Direct}, // 28 against tree 57
		{4, 1 << 20, comm.Direct},   // 103 against tree 178, ring 206
		{4, 2 << 20, comm.Direct},   // 180 against tree 336, ring 419
		{8, 512 << 10, comm.Direct}, // 101 against tree 213
		{8, 1 << 20, comm.Direct},   // 183 against tree 327
	} {
		wd, err := NewWorld(c.p, WithCostModel(m), WithTuning(TuneOff))
		if err != nil {
			t.Fatal(err)
		}
		g := wd.comms[0].g
		footprint := int64(2 * c.p * c.bytes) // every rank posts send and recv
		pl := plan{op: comm.OpReduce, p: c.p, n: c.bytes / 4, stream: footprint > m.CacheBytes/2}
		pl.piece = pieceElems(comm.Float32, pl.stream)
		if a := g.chooseBy(m, pl, make([]byte, c.p), comm.Float32); a != c.want {
			t.Errorf("Reduce on %d ranks, %d bytes: chose %v, want %v", c.p, c.bytes, a, c.want)
		}
	}
}

// TestContended: a step is marked contended for each destination another
// rank reads or writes in the same collective: a chain's partial sums,
// not the root's result or direct Reduce's.
func TestContended(t *testing.T) {
	for _, tc := range []struct {
		algo comm.Algorithm
		want []int // contended steps of ranks 0..3
	}{
		{comm.Direct, []int{0, 0, 0, 0}},
		{comm.Ring, []int{0, 1, 1, 0}}, // 3 -> 2 -> 1 -> 0: ranks 2 and 1 write partials
	} {
		s, err := generate(plan{op: comm.OpReduce, algo: tc.algo, p: 4, n: 16, piece: 16, inPlace: make([]bool, 4)})
		if err != nil {
			t.Fatal(err)
		}
		for r, steps := range s.steps {
			n := 0
			for _, st := range steps {
				n += st.contended
			}
			if n != tc.want[r] {
				t.Errorf("%v: rank %d has %d contended destinations, want %d\n%v", tc.algo, r, n, tc.want[r], s)
			}
		}
	}
}
