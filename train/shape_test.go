package train

import (
	"errors"
	"flag"
	"io"
	"strings"
	"testing"

	"github.com/b7ea7098/loom"
)

// TestShapeFlags: -model checks its preset, each override flag set
// replaces its field only, and bad values name their flags.
func TestShapeFlags(t *testing.T) {
	base := Shape{Layers: 2, Width: 128, Heads: 4, FF: 512, Seq: 64, Vocab: 256, Batch: 16}
	for _, tc := range []struct {
		args   []string
		preset string
		want   Shape
		errs   []string
	}{
		{nil, "tiny", base, nil},
		{[]string{"-model", "big"}, "big", base, nil},
		{[]string{"-layers", "0", "-batch", "3"}, "tiny", Shape{0, 128, 4, 512, 64, 256, 3}, nil},
		{[]string{"-width", "32", "-heads", "2", "-ff", "64", "-seq", "16", "-vocab", "128"}, "tiny", Shape{2, 32, 2, 64, 16, 128, 16}, nil},
		{[]string{"-layers", "-1", "-width", "0", "-vocab", "5"}, "tiny", Shape{}, []string{"-layers -1: must be zero or positive", "-width 0: must be at least 1"}},
		{[]string{"-seq", "-4", "-batch", "0"}, "tiny", Shape{}, []string{"-seq -4", "-batch 0"}},
	} {
		var s ShapeFlags
		fs := flag.NewFlagSet("test", flag.ContinueOnError)
		fs.SetOutput(io.Discard)
		s.Register(fs, "tiny", []string{"tiny", "big"})
		if err := fs.Parse(tc.args); err != nil {
			t.Fatal(err)
		}
		if p, err := s.Preset(); err != nil || p != tc.preset {
			t.Errorf("%q: Preset() = %q, %v", tc.args, p, err)
		}
		got, err := s.Apply(fs, base)
		if tc.errs == nil {
			if err != nil || got != tc.want {
				t.Errorf("%q: Apply = %+v, %v; want %+v", tc.args, got, err, tc.want)
			}
			continue
		}
		for _, w := range tc.errs {
			if !errors.Is(err, ErrInvalid) || err == nil || strings.Count(err.Error(), w) != 1 {
				t.Errorf("%q: Apply error %v; want %q once", tc.args, err, w)
			}
		}
	}
	var s ShapeFlags
	fs := flag.NewFlagSet("test", flag.ContinueOnError)
	s.Register(fs, "tiny", []string{"tiny", "big"})
	if err := fs.Parse([]string{"-model", "huge"}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Preset(); !errors.Is(err, loom.ErrInvalid) || !strings.Contains(err.Error(), `-model "huge"; want tiny, big`) {
		t.Errorf("unknown preset: %v", err)
	}
}
