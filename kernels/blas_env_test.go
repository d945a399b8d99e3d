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
