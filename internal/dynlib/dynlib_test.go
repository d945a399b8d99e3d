//go:build linux && (amd64 || arm64)

package dynlib

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// These tests load libc and libm, which every glibc Linux system has.
const (
	libc    = "libc.so.6"
	libm    = "libm.so.6"
	missing = "libloom-missing.so.1"
	testEnv = "LOOM_DYNLIB_TEST_LIB"
)

// fns are the entry points the tests bind.
type fns struct {
	cos    func(float64) float64
	getpid func() int32
	absent func() int32 // an optional symbol no library has
	addr   uintptr      // a raw address
}

// The symbol tables of the tests, for BindNew.

func libmSymbols(f *fns) []Symbol {
	return []Symbol{
		{Name: "cos", Fn: &f.cos},
		{Name: "loom_absent_symbol", Fn: &f.absent, Optional: true},
		{Name: "sin", Fn: &f.addr},
	}
}

func libcSymbols(f *fns) []Symbol { return []Symbol{{Name: "getpid", Fn: &f.getpid}} }

func missingSymbols(f *fns) []Symbol {
	return []Symbol{
		{Name: "getpid", Fn: &f.getpid},
		{Name: "loom_absent_symbol", Fn: &f.absent},
		{Name: "loom_absent_too", Fn: &f.absent},
	}
}

func badSymbols(*fns) []Symbol { return []Symbol{{Name: "getpid", Fn: 42}} }

func TestFirst(t *testing.T) {
	cases := []struct {
		name   string
		opt    string // the option's value, used when optSet
		optSet bool
		env    string   // the value of testEnv
		names  []string // the default candidates
		bind   func(*Library) (*fns, error)

		wantErr  string   // a substring of the error; "" for success
		tried    []string // the names tried, in order
		rejected int      // how many of them were rejected
		forced   bool
		disabled bool
		check    func(t *testing.T, f *fns, l *Library)
	}{
		{
			name: "libm", names: []string{libm}, bind: BindNew(libmSymbols),
			tried: []string{libm},
			check: func(t *testing.T, f *fns, l *Library) {
				if got := f.cos(0); got != 1 {
					t.Errorf("cos(0) = %v", got)
				}
				if f.absent != nil {
					t.Error("the optional missing symbol was bound")
				}
				if f.addr == 0 {
					t.Error("the *uintptr symbol was not set")
				}
				p := l.Path("cos")
				if !filepath.IsAbs(p) || !strings.Contains(filepath.Base(p), "libm") {
					t.Errorf("Path = %q, want the absolute path of libm", p)
				}
				if l.Path("loom_absent_symbol") != libm {
					t.Errorf("Path of a missing symbol = %q, want the name", l.Path("loom_absent_symbol"))
				}
			},
		},
		{
			name: "libc", names: []string{libc}, bind: BindNew(libcSymbols),
			tried: []string{libc},
			check: func(t *testing.T, f *fns, _ *Library) {
				if got := f.getpid(); int(got) != os.Getpid() {
					t.Errorf("getpid() = %d, want %d", got, os.Getpid())
				}
			},
		},
		{
			name: "missing soname then libm", names: []string{missing, libm}, bind: BindNew(libmSymbols),
			tried: []string{missing, libm}, rejected: 1,
		},
		{
			name: "missing soname", names: []string{missing}, bind: BindNew(libmSymbols),
			wantErr: "no test library could be loaded; tried " + missing + " (", tried: []string{missing}, rejected: 1,
		},
		{
			name: "no candidates", bind: BindNew(libmSymbols),
			wantErr: "tried nothing",
		},
		{
			name: "forced by the option", opt: libm, optSet: true, names: []string{libc}, bind: BindNew(libmSymbols),
			tried: []string{libm}, forced: true,
		},
		{
			name: "the option overrides the environment", optSet: true, env: missing, names: []string{libm}, bind: BindNew(libmSymbols),
			tried: []string{libm},
		},
		{
			name: "forced by the environment", env: " " + libc + " ", names: []string{libm}, bind: BindNew(libcSymbols),
			tried: []string{libc}, forced: true,
		},
		{
			name: "forced and missing", env: missing, names: []string{libm}, bind: BindNew(libmSymbols),
			wantErr: "(forced)", tried: []string{missing}, rejected: 1, forced: true,
		},
		{
			name: "off", opt: Off, optSet: true, names: []string{libm}, bind: BindNew(libmSymbols),
			wantErr: "disabled", disabled: true,
		},
		{
			name: "off from the environment", env: "OFF", names: []string{libm}, bind: BindNew(libmSymbols),
			wantErr: "disabled", disabled: true,
		},
		{
			name: "missing required symbols", names: []string{libc}, bind: BindNew(missingSymbols),
			wantErr: "missing symbols loom_absent_symbol, loom_absent_too", tried: []string{libc}, rejected: 1,
		},
		{
			name: "unbindable Fn", names: []string{libc}, bind: BindNew(badSymbols),
			wantErr: "binding: ", tried: []string{libc}, rejected: 1,
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Setenv(testEnv, tc.env)
			s := SpecFrom(tc.opt, tc.optSet, testEnv).Search("test", tc.names...)
			if s.Forced != tc.forced || s.Disabled != tc.disabled {
				t.Fatalf("Search = %+v, want forced %v, disabled %v", s, tc.forced, tc.disabled)
			}
			f, lib, tried, err := First(s, tc.bind)

			var names []string
			rejected := 0
			for i, a := range tried {
				names = append(names, a.Name)
				if a.Library != "test" {
					t.Errorf("attempt %d is for library %q", i, a.Library)
				}
				if a.Err != nil {
					rejected++
					if !strings.HasPrefix(a.String(), "test "+a.Name+": ") || strings.HasSuffix(a.String(), ": ok") {
						t.Errorf("rejected attempt formats as %q", a)
					}
				} else if a.String() != "test "+a.Name+": ok" {
					t.Errorf("kept attempt formats as %q", a)
				}
			}
			if !slices.Equal(names, tc.tried) || rejected != tc.rejected {
				t.Errorf("tried %v (%d rejected), want %v (%d rejected)", tried, rejected, tc.tried, tc.rejected)
			}

			if tc.wantErr != "" {
				var le *LoadError
				if !errors.As(err, &le) || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("err = %v, want a *LoadError mentioning %q", err, tc.wantErr)
				}
				if f != nil || lib != nil {
					t.Error("a failed First returned a value or a library")
				}
				if le.Forced != tc.forced || le.Disabled != tc.disabled || len(le.Tried) != len(tried) {
					t.Errorf("LoadError %+v does not match the search and the attempts", le)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if f == nil || lib == nil || lib.Name() != tc.tried[len(tc.tried)-1] {
				t.Fatalf("First = %v, %v", f, lib)
			}
			if tc.check != nil {
				tc.check(t, f, lib)
			}
		})
	}
}

func TestSymbolError(t *testing.T) {
	_, _, _, err := First(Search{Library: "c", Names: []string{libc}}, BindNew(missingSymbols))
	var se *SymbolError
	if !errors.As(err, &se) {
		t.Fatalf("err = %v, want it to wrap a *SymbolError", err)
	}
	if se.Library != libc || !slices.Equal(se.Missing, []string{"loom_absent_symbol", "loom_absent_too"}) {
		t.Errorf("SymbolError = %+v", se)
	}
}

func TestOpen(t *testing.T) {
	if _, err := Open(missing); err == nil || !strings.Contains(err.Error(), missing) {
		t.Errorf("Open(%q) = %v, want an error naming it", missing, err)
	}
	l, err := Open(libm)
	if err != nil {
		t.Fatal(err)
	}
	f, err := BindNew(libmSymbols)(l)
	if err != nil {
		t.Fatal(err)
	}
	if f.cos(0) != 1 {
		t.Error("cos(0) != 1")
	}
	if err := l.Close(); err != nil {
		t.Errorf("Close: %v", err)
	}
}

func TestSupported(t *testing.T) {
	if !Supported {
		t.Error("Supported is false on linux/amd64 or linux/arm64")
	}
}
