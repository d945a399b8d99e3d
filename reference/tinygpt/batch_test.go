package tinygpt

import (
	"slices"
	"strings"
	"testing"
)

func newDefaultSampler(t *testing.T) *Sampler {
	t.Helper()
	s, err := NewSampler(Default(), defaultCorpus)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func TestBatchSpecOffsets(t *testing.T) {
	// §2.3: the first three offsets of batch 1.
	b := newDefaultSampler(t).Next()
	if want := []int{80286, 15612, 73159}; !slices.Equal(b.Offsets[:3], want) {
		t.Errorf("first offsets %v, want %v", b.Offsets[:3], want)
	}
}

func TestBatchFixtureOffsets(t *testing.T) {
	fx := loadFixture(t)
	cfg, err := fx.Cfg()
	if err != nil {
		t.Fatal(err)
	}
	s, err := NewSampler(cfg, Corpus(cfg))
	if err != nil {
		t.Fatal(err)
	}
	for _, step := range []int{1, 2} {
		b := s.Next()
		if b.Step != step {
			t.Errorf("Step = %d, want %d", b.Step, step)
		}
		if !slices.Equal(b.Offsets, fx.Offsets(step)) {
			t.Errorf("batch %d offsets\n got %v\nwant %v", step, b.Offsets, fx.Offsets(step))
		}
	}
}

func TestBatchContents(t *testing.T) {
	cfg := Default()
	b := newDefaultSampler(t).Next()
	if !slices.Equal(b.Shape(), []int{cfg.B, cfg.T}) || len(b.X) != cfg.B*cfg.T || len(b.Y) != cfg.B*cfg.T || len(b.Offsets) != cfg.B {
		t.Fatalf("shape %v, len(X)=%d len(Y)=%d len(Offsets)=%d", b.Shape(), len(b.X), len(b.Y), len(b.Offsets))
	}
	var used [256]bool
	for r, off := range b.Offsets {
		if off < 0 || off >= cfg.OffsetRange() {
			t.Fatalf("offset %d outside [0, %d)", off, cfg.OffsetRange())
		}
		x, y := b.Row(r)
		for i := range cfg.T {
			if x[i] != int64(defaultCorpus[off+i]) || y[i] != int64(defaultCorpus[off+i+1]) {
				t.Fatalf("row %d position %d: x=%d y=%d, corpus %d %d", r, i, x[i], y[i], defaultCorpus[off+i], defaultCorpus[off+i+1])
			}
			used[x[i]] = true
		}
	}
	// §3.2: 36 distinct bytes occur in batch 1, so 220 wte rows get no gradient.
	distinct := 0
	for _, u := range used {
		if u {
			distinct++
		}
	}
	if distinct != 36 || cfg.V-distinct != 220 {
		t.Errorf("batch 1 inputs use %d distinct bytes (%d unused wte rows), want 36 (220)", distinct, cfg.V-distinct)
	}
	// The spec's first offset: x[0] starts at corpus[80286].
	if x, _ := b.Row(0); string(bytesOf(x[:8])) != string(defaultCorpus[80286:80294]) {
		t.Errorf("row 0 = %q", bytesOf(x[:8]))
	}
}

func bytesOf(v []int64) []byte {
	out := make([]byte, len(v))
	for i, x := range v {
		out[i] = byte(x)
	}
	return out
}

func TestBatchStream(t *testing.T) {
	// Step s uses draws (s−1)·B … s·B−1 of one LCG; nothing else draws.
	cfg := Default()
	g := NewLCG(cfg.BatchSeed)
	s := newDefaultSampler(t)
	for step := 1; step <= 5; step++ {
		want := make([]int, cfg.B)
		for i := range want {
			want[i] = g.Randint(cfg.CorpusLen - cfg.T - 1)
		}
		var got []int
		if step%2 == 0 {
			got = s.NextOffsets()
		} else {
			got = s.Next().Offsets
		}
		if !slices.Equal(got, want) {
			t.Fatalf("step %d offsets %v, want %v", step, got, want)
		}
		if s.Step() != step {
			t.Fatalf("Step() = %d after %d batches", s.Step(), step)
		}
		at, err := BatchAt(cfg, defaultCorpus, step)
		if err != nil {
			t.Fatal(err)
		}
		if at.Step != step || !slices.Equal(at.Offsets, want) {
			t.Fatalf("BatchAt(%d): step %d offsets %v, want %v", step, at.Step, at.Offsets, want)
		}
	}
	if _, err := BatchAt(cfg, defaultCorpus, 0); err == nil {
		t.Error("BatchAt(step 0) succeeded")
	}
}

func TestBatchShard(t *testing.T) {
	b := newDefaultSampler(t).Next()
	for _, R := range []int{1, 2, 4, 8, 16} {
		var x, y []int64
		var offs []int
		for r := range R {
			sh, err := b.Shard(r, R)
			if err != nil {
				t.Fatal(err)
			}
			lo, hi, _ := RankRows(b.B, R, r)
			if lo != r*b.B/R || hi != (r+1)*b.B/R || sh.B != hi-lo || sh.T != b.T || sh.Step != b.Step {
				t.Fatalf("R=%d r=%d: rows [%d, %d), shard B=%d T=%d", R, r, lo, hi, sh.B, sh.T)
			}
			x, y, offs = append(x, sh.X...), append(y, sh.Y...), append(offs, sh.Offsets...)
		}
		if !slices.Equal(x, b.X) || !slices.Equal(y, b.Y) || !slices.Equal(offs, b.Offsets) {
			t.Errorf("R=%d: the shards do not concatenate to the batch", R)
		}
	}
	for _, tc := range []struct {
		B, R, r int
		want    string
	}{
		{16, 3, 0, "not divisible"},
		{16, 0, 0, "at least 1"},
		{16, 4, 4, "out of range"},
		{16, 4, -1, "out of range"},
	} {
		if _, _, err := RankRows(tc.B, tc.R, tc.r); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("RankRows(%d, %d, %d) error %v, want %q", tc.B, tc.R, tc.r, err, tc.want)
		}
	}
}

func TestNewSamplerErrors(t *testing.T) {
	cfg := Default()
	bad := cfg
	bad.D = 130
	nonASCII := slices.Clone(defaultCorpus)
	nonASCII[5] = 200
	small := cfg
	small.V = 128
	for _, tc := range []struct {
		name   string
		cfg    Config
		corpus []byte
		want   string
	}{
		{"invalid config", bad, defaultCorpus, "not divisible by H"},
		{"short corpus", cfg, defaultCorpus[:100], "CORPUS_LEN"},
		{"byte outside V", small, nonASCII, "not below V=128"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := NewSampler(tc.cfg, tc.corpus); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error %v, want %q", err, tc.want)
			}
		})
	}
}

func TestBatchOtherConfig(t *testing.T) {
	cfg := Default()
	cfg.B, cfg.T, cfg.CorpusLen, cfg.BatchSeed = 3, 5, 200, 7
	c := Corpus(cfg)
	b, err := BatchAt(cfg, c, 2)
	if err != nil {
		t.Fatal(err)
	}
	g := NewLCG(7)
	for range 3 {
		g.Next()
	}
	for r := range 3 {
		want := g.Randint(200 - 5 - 1)
		x, y := b.Row(r)
		if b.Offsets[r] != want || string(bytesOf(x)) != string(c[want:want+5]) || string(bytesOf(y)) != string(c[want+1:want+6]) {
			t.Errorf("row %d: offset %d (want %d), x %q, y %q", r, b.Offsets[r], want, bytesOf(x), bytesOf(y))
		}
	}
}
