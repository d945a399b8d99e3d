package checkpoint

import (
	"context"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/safetensors"
)

// TestWrittenRanges saves on dp2×tp2 and checks, from the bytes each rank
// wrote: every rank writes only its own file; the data bytes written by
// all ranks cover every tensor's bytes exactly once (a replica is written
// by one rank); the replicated chunks are spread over their holders by
// bytes; and each file is valid safetensors holding its chunks' values.
func TestWrittenRanges(t *testing.T) {
	defs := map[string]tdef{
		"w": {shape: []int{6, 4}, dtype: comm.Float32, seed: 1}, // [R, S(0)]: 2 chunks of 48 bytes, 2 holders each
		"b": {shape: []int{4}, dtype: comm.Float32, seed: 2},    // replicated: 1 chunk of 16 bytes, 4 holders
		"e": {shape: []int{3, 0}, dtype: comm.Float32, seed: 3}, // zero size: no chunk
	}
	lay := byName(map[string][]placement.Placement{"w": {R, S0}, "b": {R, R}, "e": {R, S0}}, nil)
	rec := &recorder{}
	root := t.TempDir()
	path := saveOn(t, root, meshLayout{"dp2×tp2", []int{2, 2}, []string{"dp", "tp"}, lay}, defs, withHook(rec.hook))
	m, err := readManifest("test", path)
	if err != nil {
		t.Fatal(err)
	}
	// Largest first to the least-loaded holder: w's rows 0-2 (held by
	// ranks 0 and 2) to 0, rows 3-5 (ranks 1, 3) to 1, b to 2.
	wantOwner := map[string]int{"w@0,0": 0, "w@3,0": 1, "b": 2}
	written := rec.ranges("write")
	for _, n := range []string{"w", "b", "e"} {
		tm := m.Tensors[n]
		var bytes int
		for _, c := range tm.Chunks {
			bytes += int(c.End - c.Begin)
			owner, ok := wantOwner[c.Key]
			if !ok {
				t.Errorf("unexpected chunk %q", c.Key)
				continue
			}
			if c.File != fileName(owner) {
				t.Errorf("chunk %q is in %s, want %s", c.Key, c.File, fileName(owner))
			}
			// The owner wrote exactly this range of its (staging) file.
			found := false
			for _, r := range written[owner][c.File+".tmp"] {
				found = found || r[0] <= c.Begin && c.End <= r[1]
			}
			if !found {
				t.Errorf("rank %d's writes %v do not hold chunk %q [%d, %d)", owner, written[owner], c.Key, c.Begin, c.End)
			}
		}
		if want := prod(defs[n].shape) * 4; bytes != want {
			t.Errorf("tensor %s: chunks hold %d bytes, want %d", n, bytes, want)
		}
	}
	for rank, files := range written {
		for f, rs := range files {
			if rank == 0 && strings.HasPrefix(f, manifestName) {
				continue
			}
			if f != fileName(rank)+".tmp" {
				t.Errorf("rank %d wrote %s", rank, f)
				continue
			}
			// Header plus data, nothing else: one range from 0 to the end.
			var size int64
			for _, fr := range m.Files {
				if fr.Name == fileName(rank) {
					size = fr.Bytes
				}
			}
			if len(rs) != 1 || rs[0] != [2]int64{0, size} {
				t.Errorf("rank %d wrote %v of %s, want [0, %d)", rank, rs, f, size)
			}
		}
	}
	if _, ok := written[3]; ok {
		t.Errorf("rank 3 owns nothing but wrote %v", written[3])
	}
	// Every data file is safetensors with its chunks' values.
	for _, fr := range m.Files {
		f, err := safetensors.Open(filepath.Join(path, fr.Name))
		if err != nil {
			t.Fatal(err)
		}
		for _, key := range f.Names() {
			name, _, _ := strings.Cut(key, "@")
			tn, err := f.Tensor(key)
			if err != nil {
				t.Fatal(err)
			}
			vals, err := tn.Float32s()
			if err != nil {
				t.Fatal(err)
			}
			full := defs[name].full().([]float32)
			var c chunk
			for _, ch := range m.Tensors[name].Chunks {
				if ch.Key == key {
					c = ch
				}
			}
			cols := defs[name].shape[len(defs[name].shape)-1]
			start := 0
			if len(c.Offset) == 2 {
				start = c.Offset[0] * cols
			}
			if err := bitsEqual(vals, full[start:start+len(vals)]); err != nil {
				t.Errorf("%s in %s: %v", key, fr.Name, err)
			}
		}
		f.Close()
	}
}

// TestEntriesRoundTrip saves every entry type, extremes included, and
// loads them back with their types and values.
func TestEntriesRoundTrip(t *testing.T) {
	entries := map[string]any{
		"flag":  true,
		"step":  int64(math.MaxInt64),
		"neg":   int64(math.MinInt64),
		"lr":    3e-4,
		"inf":   math.Inf(-1),
		"nan":   math.NaN(),
		"tiny":  math.SmallestNonzeroFloat64,
		"name":  "run \"a\"\n",
		"rng":   []byte{0, 1, 255},
		"pos":   []int64{1, -2, math.MaxInt64},
		"moms":  []float64{0.9, 0.999, math.Inf(1)},
		"empty": []int64{},
	}
	root := t.TempDir()
	simulate(t, []int{3}, []string{"dp"}, func(ctx context.Context, m *mesh.Mesh) error {
		st := State{Entries: entries, Tensors: map[string]*placement.DTensor{}}
		if _, err := Save(ctx, root, st, WithComm(m.World())); err != nil {
			return err
		}
		path, err := Latest(root)
		if err != nil {
			return err
		}
		got, err := Load(ctx, path, nil, WithComm(m.World()))
		if err != nil {
			return err
		}
		for k, want := range entries {
			g := got.Entries[k]
			if fmt.Sprintf("%T %#v", g, g) != fmt.Sprintf("%T %#v", want, want) {
				return fmt.Errorf("entry %s: got %T %#v, want %T %#v", k, g, g, want, want)
			}
		}
		if len(got.Entries) != len(entries) {
			return fmt.Errorf("%d entries, want %d", len(got.Entries), len(entries))
		}
		return nil
	})
}

// TestSaveStartsWriteback: a rank's data file is handed to the disk as it
// is written, 4 MiB or more at a time in file order (so the disk writes
// while the rest is still copied, and the fsync waits only for the
// tail), every byte but the last few MiB before the file's fsync.
func TestSaveStartsWriteback(t *testing.T) {
	defs := map[string]tdef{ // 2 × 5 MiB on each of 2 ranks
		"a": {shape: []int{2 * 320, 4096}, dtype: comm.Float32, seed: 1},
		"b": {shape: []int{2 * 320, 4096}, dtype: comm.Float32, seed: 2},
	}
	rec := &recorder{}
	saveOn(t, t.TempDir(), meshLayout{"tp2", []int{2}, []string{"tp"}, byName(map[string][]placement.Placement{"a": {S0}, "b": {S0}}, nil)}, defs, withHook(rec.hook))
	for rank := range 2 {
		var next, written int64
		synced := false
		for _, ev := range rec.events {
			if ev.Rank != rank || baseName(ev.Path) != fileName(rank)+".tmp" {
				continue
			}
			switch ev.Op {
			case "write":
				written = max(written, ev.Off+ev.N)
			case "writeback":
				if synced || ev.Off != next || ev.N < writebackBytes || ev.Off+ev.N > written {
					t.Fatalf("rank %d: writeback of [%d, %d) after %d bytes written, %d handed over before (synced %v)", rank, ev.Off, ev.Off+ev.N, written, next, synced)
				}
				next = ev.Off + ev.N
			case "fsync":
				synced = true
			}
		}
		if !synced || next < written-writebackBytes || next == 0 {
			t.Errorf("rank %d: %d of %d bytes handed to the disk before the fsync (synced %v)", rank, next, written, synced)
		}
	}
}

// TestEntriesUnion: ranks may pass different entries (a pipeline's stages,
// each with its own parameters' step counts): the checkpoint holds their
// union, an entry several ranks pass once, and every rank loads them all.
func TestEntriesUnion(t *testing.T) {
	root := t.TempDir()
	simulate(t, []int{3}, []string{"pp"}, func(ctx context.Context, m *mesh.Mesh) error {
		r := int64(m.Rank())
		st := State{Entries: map[string]any{"shared": "all", fmt.Sprintf("stage%d.step", r): 10 + r}}
		if m.Rank() == 2 {
			delete(st.Entries, "shared")
		}
		if _, err := Save(ctx, root, st, WithComm(m.World())); err != nil {
			return err
		}
		path, err := Latest(root)
		if err != nil {
			return err
		}
		got, err := Load(ctx, path, nil, WithComm(m.World()))
		if err != nil {
			return err
		}
		want := map[string]any{"shared": "all", "stage0.step": int64(10), "stage1.step": int64(11), "stage2.step": int64(12)}
		if fmt.Sprint(got.Entries) != fmt.Sprint(want) {
			return fmt.Errorf("entries %v, want %v", got.Entries, want)
		}
		return nil
	})
}

// TestSaveRefuses: bad input is refused before anything is written, with
// the same error kind on every rank.
func TestSaveRefuses(t *testing.T) {
	cases := []struct {
		name string
		st   func(m *mesh.Mesh) (State, error)
		opts []Option
		want error
		says string
	}{
		{"partial tensor", func(m *mesh.Mesh) (State, error) {
			s, err := placement.NewSpec(m, []int{4}, comm.Float32, []placement.Placement{placement.Partial(comm.Sum)})
			if err != nil {
				return State{}, err
			}
			x, err := placement.FromFull(s, make([]float32, 4))
			return State{Tensors: map[string]*placement.DTensor{"g": x}}, err
		}, nil, ErrInvalid, `tensor "g" is [P(sum)]`},
		{"entry type", func(*mesh.Mesh) (State, error) {
			return State{Entries: map[string]any{"n": 3}}, nil
		}, nil, ErrInvalid, `entry "n": type int`},
		{"entries differ", func(m *mesh.Mesh) (State, error) {
			return State{Entries: map[string]any{"r": int64(m.Rank())}}, nil
		}, nil, ErrMismatch, `entry "r": rank 1's value differs from rank 0's`},
		{"load option", func(*mesh.Mesh) (State, error) { return State{}, nil }, []Option{WithDevice(nil)}, ErrInvalid, "WithDevice is not an option of Save"},
		{"negative keep", func(*mesh.Mesh) (State, error) { return State{}, nil }, []Option{WithKeep(-1)}, ErrInvalid, "keep -1"},
		{"chunk name", func(m *mesh.Mesh) (State, error) {
			s, _ := placement.NewSpec(m, []int{2}, comm.Float32, []placement.Placement{R})
			x, err := placement.FromFull(s, make([]float32, 2))
			return State{Tensors: map[string]*placement.DTensor{"a@0": x}}, err
		}, nil, ErrInvalid, "reserved"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			root := t.TempDir()
			err := simulateErr([]int{2}, []string{"dp"}, func(ctx context.Context, m *mesh.Mesh) error {
				st, err := c.st(m)
				if err != nil {
					return fmt.Errorf("setup: %w", err)
				}
				_, err = Save(ctx, root, st, append([]Option{WithComm(m.World())}, c.opts...)...)
				if !errors.Is(err, c.want) || !strings.Contains(err.Error(), c.says) {
					return fmt.Errorf("got %v, want %v saying %q", err, c.want, c.says)
				}
				return nil
			})
			if err != nil {
				t.Fatal(err)
			}
			if ents, _ := os.ReadDir(root); slices.ContainsFunc(ents, func(e os.DirEntry) bool { return e.Name() != lockName }) {
				t.Errorf("the refused save left %v", ents)
			}
		})
	}
}
