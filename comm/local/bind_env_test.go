package local

import (
	"errors"
	"strings"
	"testing"

	"github.com/b7ea7098/loom/comm"
)

func TestParseBind(t *testing.T) {
	tests := []struct {
		v       string
		want    bool
		wantErr bool
	}{
		{v: ""}, {v: " "}, {v: "0"}, {v: "false"}, {v: "FALSE"}, {v: "none"}, {v: " None "},
		{v: "1", want: true}, {v: "true", want: true}, {v: "True", want: true}, {v: "auto", want: true}, {v: " auto\t", want: true},
		{v: "yes", wantErr: true}, {v: "2", wantErr: true}, {v: "1,1", wantErr: true}, {v: "true,false", wantErr: true},
		{v: "on", wantErr: true}, {v: "sometimes", wantErr: true}, {v: "0x1", wantErr: true},
	}
	for _, tc := range tests {
		got, err := parseBind(tc.v)
		if tc.wantErr {
			if err == nil || !errors.Is(err, comm.ErrInvalid) || !strings.HasPrefix(err.Error(), "local: "+BindEnv+"=") || !strings.Contains(err.Error(), `"`+tc.v+`"`) {
				t.Errorf("parseBind(%q) = %v, %v; want an ErrInvalid error quoting the value", tc.v, got, err)
			}
			continue
		}
		if err != nil || got != tc.want {
			t.Errorf("parseBind(%q) = %v, %v; want %v", tc.v, got, err, tc.want)
		}
	}
}

// FuzzParseBind checks that any LOOM_BIND value is a yes, a no or an
// ErrInvalid error, never a panic, and that what it accepts is one of the
// documented words.
func FuzzParseBind(f *testing.F) {
	for _, s := range []string{"", "1", "0", "auto", "none", "TRUE", " false ", "yes", "1,0"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, v string) {
		on, err := parseBind(v)
		if err != nil {
			if !errors.Is(err, comm.ErrInvalid) {
				t.Fatalf("parseBind(%q): %v does not wrap ErrInvalid", v, err)
			}
			return
		}
		switch w := strings.ToLower(strings.TrimSpace(v)); {
		case on && (w == "1" || w == "true" || w == "auto"):
		case !on && (w == "" || w == "0" || w == "false" || w == "none"):
		default:
			t.Fatalf("parseBind(%q) = %v", v, on)
		}
	})
}
