package dynlib

import (
	"errors"
	"slices"
	"testing"
)

func TestSpec(t *testing.T) {
	defaults := []string{"liba.so.1", "liba.so"}
	for _, tc := range []struct {
		spec     Spec
		off      bool
		forced   bool
		names    []string
		disabled bool
	}{
		{"", false, false, defaults, false},
		{"off", true, false, nil, true},
		{"Off", true, false, nil, true},
		{"/opt/lib/liba.so.2", false, true, []string{"/opt/lib/liba.so.2"}, false},
		{"liba.so.3", false, true, []string{"liba.so.3"}, false},
	} {
		s := tc.spec.Search("a", defaults...)
		if tc.spec.Off() != tc.off || tc.spec.Forced() != tc.forced || s.Forced != tc.forced ||
			s.Disabled != tc.disabled || !slices.Equal(s.Names, tc.names) || s.Library != "a" {
			t.Errorf("Spec(%q): Off %v, Forced %v, Search %+v", tc.spec, tc.spec.Off(), tc.spec.Forced(), s)
		}
	}
}

func TestLoadErrorText(t *testing.T) {
	notFound := errors.New("not found")
	e := &LoadError{Library: "nvrtc", Forced: true, Tried: []Attempt{
		{Library: "nvrtc", Name: "libnvrtc.so.13", Err: notFound},
		{Library: "nvrtc", Name: "libnvrtc.so.12", Err: &SymbolError{Library: "libnvrtc.so.12", Missing: []string{"nvrtcGetPTX"}}},
	}}
	want := "dynlib: no nvrtc library could be loaded (forced); tried libnvrtc.so.13 (not found); libnvrtc.so.12 (missing symbols nvrtcGetPTX)"
	if e.Error() != want {
		t.Errorf("Error() = %q, want %q", e.Error(), want)
	}
	var se *SymbolError
	if !errors.Is(e, notFound) || !errors.As(e, &se) || se.Missing[0] != "nvrtcGetPTX" {
		t.Error("LoadError does not unwrap to the reasons of its attempts")
	}
	if got := (&LoadError{Library: "nccl", Disabled: true}).Error(); got != "dynlib: nccl is disabled (off)" {
		t.Errorf("disabled: %q", got)
	}
	if got := (&LoadError{Library: "cblas"}).Error(); got != "dynlib: no cblas library could be loaded; tried nothing" {
		t.Errorf("nothing tried: %q", got)
	}
}

// attempt is a package's own attempt type, as device/cuda and comm/nccl
// declare it.
type attempt struct {
	Library string
	Name    string
	Err     error
}

func TestAttemptsAs(t *testing.T) {
	in := []Attempt{{Library: "cuda", Name: "libcuda.so.1", Err: errors.New("no")}, {Library: "cuda", Name: "libcuda.so"}}
	out := AttemptsAs[attempt](in)
	if len(out) != 2 || out[0] != attempt(in[0]) || out[1] != attempt(in[1]) {
		t.Errorf("AttemptsAs = %v", out)
	}
	if out := AttemptsAs[attempt](nil); len(out) != 0 {
		t.Errorf("AttemptsAs(nil) = %v", out)
	}
}

// TestUnsupported checks that where loading is not implemented every
// candidate is rejected with an error matching errors.ErrUnsupported.
func TestUnsupported(t *testing.T) {
	if Supported {
		t.Skip("loading is implemented here")
	}
	_, _, tried, err := First(Search{Library: "a", Names: []string{"liba.so"}}, func(*Library) (int, error) { return 0, nil })
	if !errors.Is(err, errors.ErrUnsupported) || len(tried) != 1 {
		t.Errorf("First = %v, %v", tried, err)
	}
}
