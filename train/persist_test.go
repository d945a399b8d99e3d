package train

import (
	"context"
	"errors"
	"flag"
	"io"
	"path/filepath"
	"strings"
	"testing"

	"github.com/b7ea7098/loom/checkpoint"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// Persist's flags are checked together before any rank starts, and
// -resume without a checkpoint names the folder.
func TestPersistValidate(t *testing.T) {
	for _, c := range []struct {
		args []string
		want []string // substrings of the error; none: valid
	}{
		{nil, nil},
		{[]string{"-checkpoint", "d", "-save-every", "5", "-keep", "2", "-async-save", "-resume"}, nil},
		{[]string{"-data", "f.txt", "-val", "0"}, []string{"-val 0"}},
		{[]string{"-data", "f.txt", "-val", "1"}, []string{"-val 1"}},
		{[]string{"-save-every", "-1", "-checkpoint", "d"}, []string{"-save-every"}},
		{[]string{"-val-batches", "0"}, []string{"-val-batches"}},
		{[]string{"-resume"}, []string{"need -checkpoint DIR"}},
		{[]string{"-keep", "3", "-save-every", "-2"}, []string{"need -checkpoint DIR", "-save-every"}},
	} {
		var p Persist
		fs := flag.NewFlagSet("t", flag.ContinueOnError)
		fs.SetOutput(io.Discard)
		p.Register(fs)
		if err := fs.Parse(c.args); err != nil {
			t.Fatal(err)
		}
		err := p.Validate()
		if len(c.want) == 0 {
			if err != nil {
				t.Errorf("%v: %v", c.args, err)
			}
			continue
		}
		if !errors.Is(err, ErrInvalid) {
			t.Errorf("%v: %v, want ErrInvalid", c.args, err)
			continue
		}
		for _, w := range c.want {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("%v: %v, want it to say %q", c.args, err, w)
			}
		}
	}
	p := Persist{Dir: filepath.Join(t.TempDir(), "none"), Resume: true}
	if _, err := p.Prepare(10); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), p.Dir) {
		t.Errorf("-resume without a checkpoint: %v, want ErrInvalid naming %s", err, p.Dir)
	}
	if step, err := (&Persist{}).Prepare(10); step != 0 || err != nil {
		t.Errorf("without -resume: %d, %v", step, err)
	}
	root := t.TempDir()
	err := placementtest.Simulate(context.Background(), []int{1}, []string{"dp"}, func(ctx context.Context, m *mesh.Mesh) error {
		_, err := checkpoint.Save(ctx, root, checkpoint.State{Entries: map[string]any{"n": int64(1)}}, checkpoint.WithStep(5), checkpoint.WithComm(m.World()))
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		total int
		ok    bool
	}{{6, true}, {5, false}, {4, false}} {
		p := Persist{Dir: root, Resume: true}
		step, err := p.Prepare(c.total)
		if c.ok && (step != 5 || err != nil) {
			t.Errorf("checkpoint at step 5, -steps %d: %d, %v; want 5", c.total, step, err)
		}
		if !c.ok && (!errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "nothing left to train")) {
			t.Errorf("checkpoint at step 5, -steps %d: %d, %v; want ErrInvalid saying nothing is left", c.total, step, err)
		}
	}
}
