package kernels

import (
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/b7ea7098/loom"
)

func TestParseLibrary(t *testing.T) {
	tests := []struct {
		spec    string
		pureGo  bool
		cands   []string // nil: automatic
		wantErr string
	}{
		{spec: ""},
		{spec: "auto"},
		{spec: "AUTO"},
		{spec: "go", pureGo: true},
		{spec: "Go", pureGo: true},
		{spec: "pure-go", pureGo: true},
		{spec: "purego", pureGo: true},
		{spec: "none", pureGo: true},
		{spec: "off", pureGo: true},
		{spec: "openblas", cands: openblasCandidates()},
		{spec: "OpenBLAS", cands: openblasCandidates()},
		{spec: "blis", cands: blisCandidates()},
		{spec: "/opt/intel/lib/libmkl_rt.so", cands: []string{"/opt/intel/lib/libmkl_rt.so"}},
		{spec: "./libcblas.so", cands: []string{"./libcblas.so"}},
		{spec: "libmkl_rt.so", cands: []string{"libmkl_rt.so"}},
		{spec: "libopenblas.so.0", cands: []string{"libopenblas.so.0"}},
		{spec: "libblas.so.3.10.0", cands: []string{"libblas.so.3.10.0"}},
		{spec: "libopenblas.dylib", cands: []string{"libopenblas.dylib"}},
		{spec: "openblas.DLL", cands: []string{"openblas.DLL"}},
		{spec: `C:\blas\openblas.dll`, cands: []string{`C:\blas\openblas.dll`}},
		{spec: "openblass", wantErr: `unknown GEMM backend "openblass"`},
		{spec: "openblas,blis", wantErr: `unknown GEMM backend "openblas,blis"`},
		{spec: "mkl", wantErr: `unknown GEMM backend "mkl"`},
		{spec: "1", wantErr: `unknown GEMM backend "1"`},
		{spec: ".so", wantErr: `unknown GEMM backend ".so"`},
		{spec: "libfoo.sox", wantErr: `unknown GEMM backend "libfoo.sox"`},
	}
	for _, tc := range tests {
		t.Run(tc.spec, func(t *testing.T) {
			got, err := parseLibrary(tc.spec)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) || !errors.Is(err, loom.ErrInvalid) {
					t.Fatalf("parseLibrary(%q) = %+v, %v; want an ErrInvalid error containing %q", tc.spec, got, err, tc.wantErr)
				}
				return
			}
			if err != nil || got.pureGo != tc.pureGo || !slices.Equal(got.cands, tc.cands) || (got.cands == nil) != (tc.cands == nil) {
				t.Errorf("parseLibrary(%q) = %+v, %v; want pure Go %v, candidates %q", tc.spec, got, err, tc.pureGo, tc.cands)
			}
		})
	}
}

// TestLoadRejectsUnknownSpec checks that a misspelt LOOM_BLAS or
// WithLibrary value is an error that names where it came from, before any
// library is searched for.
func TestLoadRejectsUnknownSpec(t *testing.T) {
	t.Setenv(EnvVar, " openblass ")
	_, err := Load()
	if err == nil || !errors.Is(err, ErrInvalid) || !strings.HasPrefix(err.Error(), `kernels: Load: LOOM_BLAS="openblass": `) {
		t.Errorf("LOOM_BLAS=openblass: %v", err)
	}
	_, err = Load(WithLibrary("bliss"))
	if err == nil || !errors.Is(err, ErrInvalid) || !strings.HasPrefix(err.Error(), `kernels: Load: WithLibrary("bliss"): `) {
		t.Errorf("WithLibrary(bliss): %v", err)
	}
	t.Setenv(EnvVar, "OFF")
	if b, err := Load(); err != nil || b.Backend() != BackendGo {
		t.Errorf("LOOM_BLAS=OFF: %v, %v; want the pure-Go GEMM", b, err)
	}
}

// FuzzParseLibrary checks that any LOOM_BLAS value either parses to one
// choice or fails with ErrInvalid, and that a forced choice names exactly
// the value or one family.
func FuzzParseLibrary(f *testing.F) {
	for _, s := range []string{"", "auto", "go", "off", "openblas", "blis", "/x/libcblas.so", "libx.so.3", "x.dll", "openblass", ".so", "a.b.so.c", "\x00.so"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, spec string) {
		c, err := parseLibrary(spec)
		if err != nil {
			if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "unknown GEMM backend") {
				t.Fatalf("parseLibrary(%q): error %v", spec, err)
			}
			return
		}
		switch {
		case c.pureGo && c.cands != nil:
			t.Fatalf("parseLibrary(%q) = %+v: pure Go and a library", spec, c)
		case c.cands == nil || c.pureGo:
		case slices.Equal(c.cands, []string{spec}):
			if !looksLikeLibrary(spec) {
				t.Fatalf("parseLibrary(%q) forces a file name that does not look like a library", spec)
			}
		case !slices.Equal(c.cands, openblasCandidates()) && !slices.Equal(c.cands, blisCandidates()):
			t.Fatalf("parseLibrary(%q) = %+v", spec, c)
		}
	})
}

func TestAutoPolicy(t *testing.T) {
	for _, c := range []struct {
		ranks      int
		vec, useGo bool
		reason     string
	}{
		{0, true, false, "one rank in this process"},
		{1, true, false, "one rank in this process"},
		{1, false, false, "one rank in this process"},
		{2, true, true, "2 in-process ranks scale better without cgo; LOOM_BLAS=openblas to force"},
		{8, true, true, "8 in-process ranks scale better without cgo"},
		{4, false, false, "no vector kernels on this CPU"},
	} {
		useGo, reason := autoPolicy(c.ranks, c.vec)
		if useGo != c.useGo || !strings.Contains(reason, c.reason) {
			t.Errorf("autoPolicy(%d, %v) = %v, %q; want %v, a reason containing %q", c.ranks, c.vec, useGo, reason, c.useGo, c.reason)
		}
	}
}

func TestNarrowCore(t *testing.T) {
	for _, c := range []struct {
		config, core string
		narrow       bool
	}{
		{"OpenBLAS 0.3.21 NO_LAPACKE DYNAMIC_ARCH NO_AFFINITY Prescott MAX_THREADS=64", "Prescott", true},
		{"OpenBLAS 0.3.20 DYNAMIC_ARCH NO_AFFINITY Sandybridge MAX_THREADS=64", "Sandybridge", true},
		{"OpenBLAS 0.3.8 NO_AFFINITY CORE2 MAX_THREADS=8", "CORE2", true},
		{"OpenBLAS 0.3.21 NO_LAPACKE DYNAMIC_ARCH NO_AFFINITY Cooperlake MAX_THREADS=64", "", false},
		{"OpenBLAS 0.3.21 DYNAMIC_ARCH NO_AFFINITY Haswell MAX_THREADS=64", "", false},
		{"OpenBLAS 0.3.21 DYNAMIC_ARCH NO_AFFINITY Zen MAX_THREADS=64", "", false},
		{"OpenBLAS 0.3.26 DYNAMIC_ARCH NO_AFFINITY neoversen1 MAX_THREADS=64", "", false},
		{"", "", false},
	} {
		core, narrow := narrowCore(c.config)
		if core != c.core || narrow != c.narrow {
			t.Errorf("narrowCore(%q) = %q, %v; want %q, %v", c.config, core, narrow, c.core, c.narrow)
		}
	}
}

// TestLoadRanksInProcess checks that WithRanksInProcess picks loom's GEMM
// for several ranks in automatic mode only: LOOM_BLAS and WithLibrary
// still force a library, and Reason says which rule chose.
func TestLoadRanksInProcess(t *testing.T) {
	ob, openblasErr := Load(WithLibrary("openblas"))
	oneRank, oneReason := BackendOpenBLAS, "one rank in this process"
	if _, narrow := narrowCore(ob.Config()); openblasErr == nil && narrow && blocking32().vec {
		oneRank, oneReason = BackendGo, "OpenBLAS runs its"
	}
	for _, c := range []struct {
		name, env string
		opts      []Option
		want      Backend
		reason    string
		needLib   bool
	}{
		{"auto, 2 ranks", "", []Option{WithRanksInProcess(2)}, BackendGo, "2 in-process ranks scale better without cgo", false},
		{"auto spelt out, 2 ranks", "auto", []Option{WithRanksInProcess(2)}, BackendGo, "2 in-process ranks", false},
		{"LOOM_BLAS=go, 1 rank", "go", []Option{WithRanksInProcess(1)}, BackendGo, `forced by LOOM_BLAS="go"`, false},
		{"LOOM_BLAS=openblas, 2 ranks", "openblas", []Option{WithRanksInProcess(2)}, BackendOpenBLAS, `forced by LOOM_BLAS="openblas"`, true},
		{"WithLibrary over LOOM_BLAS, 4 ranks", "go", []Option{WithRanksInProcess(4), WithLibrary("openblas")}, BackendOpenBLAS, `forced by WithLibrary("openblas")`, true},
		{"auto, 1 rank", "", []Option{WithRanksInProcess(1)}, oneRank, oneReason, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			if c.needLib && openblasErr != nil {
				t.Skipf("OpenBLAS not available (install libopenblas0): %v", openblasErr)
			}
			if c.want == BackendGo && !strings.HasPrefix(c.reason, "forced") && !blocking32().vec {
				t.Skip("loom's GEMM has no vector kernels on this CPU, so automatic selection keeps a library")
			}
			t.Setenv(EnvVar, c.env)
			b, err := Load(c.opts...)
			if err != nil {
				t.Fatal(err)
			}
			if b.Backend() != c.want || !strings.Contains(b.Reason(), c.reason) {
				t.Errorf("got %s (%q), want %s with a reason containing %q", b.Backend(), b.Reason(), c.want, c.reason)
			}
		})
	}
}
