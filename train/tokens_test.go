package train_test

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/b7ea7098/loom"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement/placementtest"
	"github.com/b7ea7098/loom/train"
)

// uint16Bytes is toks as little-endian uint16, nanoGPT's train.bin.
func uint16Bytes(toks []int) []byte {
	b := make([]byte, 2*len(toks))
	for i, v := range toks {
		binary.LittleEndian.PutUint16(b[2*i:], uint16(v))
	}
	return b
}

// llmcBytes is toks in llm.c's format, with the header's fields given.
func llmcBytes(magic, version, count int32, toks []int) []byte {
	h := make([]byte, 1024)
	binary.LittleEndian.PutUint32(h, uint32(magic))
	binary.LittleEndian.PutUint32(h[4:], uint32(version))
	binary.LittleEndian.PutUint32(h[8:], uint32(count))
	return append(h, uint16Bytes(toks)...)
}

func writeFile(t *testing.T, name string, b []byte) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(p, b, 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

func readAll(t *testing.T, f *train.TokenFile) []int64 {
	t.Helper()
	got := make([]int64, f.Len())
	if err := f.Read(got, 0); err != nil {
		t.Fatal(err)
	}
	return got
}

// TestOpenTokens: each format is detected (or forced) and its tokens read
// back, including a file of more than one 1 MiB scan chunk.
func TestOpenTokens(t *testing.T) {
	big := make([]int, 700_000) // 1.4 MB of uint16: two scan chunks
	for i := range big {
		big[i] = (i * 7919) % 50257
	}
	for _, tc := range []struct {
		name, file string
		data       []byte
		vocab      int
		opts       []train.TokenOption
		format     train.TokenFormat
		want       []int
	}{
		{"text", "input.txt", []byte("hi\n\xff"), 256, nil, train.FormatBytes, []int{'h', 'i', '\n', 0xff}},
		{"nanoGPT", "train.bin", uint16Bytes([]int{0, 1, 50256, 300}), 50257, nil, train.FormatUint16, []int{0, 1, 50256, 300}},
		{"nanoGPT forced", "tokens.dat", uint16Bytes([]int{5, 6}), 7, []train.TokenOption{train.WithFormat(train.FormatUint16)}, train.FormatUint16, []int{5, 6}},
		{"bytes forced on .bin", "x.bin", []byte{1, 2, 3}, 256, []train.TokenOption{train.WithFormat(train.FormatBytes)}, train.FormatBytes, []int{1, 2, 3}},
		{"llm.c", "tiny_train.bin", llmcBytes(20240520, 1, 3, []int{10, 20, 50256}), 50257, nil, train.FormatLLMC, []int{10, 20, 50256}},
		{"llm.c big", "big_train.bin", llmcBytes(20240520, 1, int32(len(big)), big), 50257, nil, train.FormatLLMC, big},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f, err := train.OpenTokens(writeFile(t, tc.file, tc.data), tc.vocab, tc.opts...)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			if f.Format() != tc.format || f.Len() != len(tc.want) || f.Vocab() != tc.vocab {
				t.Fatalf("format %v, %d tokens, vocab %d; want %v, %d, %d", f.Format(), f.Len(), f.Vocab(), tc.format, len(tc.want), tc.vocab)
			}
			got := readAll(t, f)
			for i, w := range tc.want {
				if got[i] != int64(w) {
					t.Fatalf("token %d = %d, want %d", i, got[i], w)
				}
			}
			if err := f.Read(make([]int64, 2), f.Len()-1); !errors.Is(err, train.ErrInvalid) {
				t.Errorf("a read past the end: %v, want ErrInvalid", err)
			}
		})
	}
}

// TestOpenTokensRefused: truncated files, bad headers and tokens outside
// the vocabulary are refused with an error naming the file and the byte
// offset of the fault, matching ErrTokenFile and loom.ErrInvalid.
func TestOpenTokensRefused(t *testing.T) {
	big := make([]int, 700_000)
	big[600_000] = 60000 // in the second 1 MiB chunk of the scan
	llmc := train.WithFormat(train.FormatLLMC)
	for _, tc := range []struct {
		name, file string
		data       []byte
		vocab      int
		opts       []train.TokenOption
		offset     int
	}{
		{"nanoGPT truncated", "train.bin", uint16Bytes([]int{1, 2, 3})[:5], 50257, nil, 4},
		{"nanoGPT out of vocab", "val.bin", uint16Bytes([]int{1, 2, 50257, 3}), 50257, nil, 4},
		{"llm.c bad magic", "x.bin", llmcBytes(20240521, 1, 2, []int{1, 2}), 50257, []train.TokenOption{llmc}, 0},
		{"llm.c bad version", "x.bin", llmcBytes(20240520, 2, 2, []int{1, 2}), 50257, nil, 4},
		{"llm.c truncated body", "x.bin", llmcBytes(20240520, 1, 3, []int{1, 2}), 50257, nil, 8},
		{"llm.c truncated header", "x.bin", llmcBytes(20240520, 1, 0, nil)[:100], 50257, nil, 100},
		{"llm.c out of vocab", "x.bin", llmcBytes(20240520, 1, int32(len(big)), big), 50257, nil, 1024 + 2*600_000},
		{"text out of vocab", "input.txt", []byte("abc\x80d"), 128, nil, 3},
		{"empty", "input.txt", nil, 256, nil, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			path := writeFile(t, tc.file, tc.data)
			f, err := train.OpenTokens(path, tc.vocab, tc.opts...)
			if err == nil {
				f.Close()
				t.Fatal("opened")
			}
			if !errors.Is(err, train.ErrTokenFile) || !errors.Is(err, loom.ErrInvalid) {
				t.Errorf("error %v does not match ErrTokenFile and loom.ErrInvalid", err)
			}
			if want := fmt.Sprintf("%s: byte offset %d:", path, tc.offset); !strings.Contains(err.Error(), want) {
				t.Errorf("error %q does not name %q", err, want)
			}
		})
	}
	if _, err := train.OpenTokens(writeFile(t, "a.txt", []byte("ab")), 0); !errors.Is(err, train.ErrInvalid) {
		t.Errorf("vocabulary 0: %v, want ErrInvalid", err)
	}
	if _, err := train.OpenTokens(filepath.Join(t.TempDir(), "missing.txt"), 256); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("missing file: %v, want ErrNotExist", err)
	}
}

// corpus is an ASCII text of about n bytes.
func corpus(n int) []byte {
	words := strings.Fields("the quick brown fox jumps over a lazy dog while seven wizards quietly hex jovial zebras")
	var b []byte
	for i := 0; len(b) < n; i++ {
		b = append(b, words[(i*i+3*i)%len(words)]...)
		b = append(b, " .\n"[i%3])
	}
	return b[:n]
}

// windowRef is window r of a serial reading of text: inputs and targets.
func windowRef(text []byte, first, r, T int) (x, y []int64) {
	for i := range T {
		x = append(x, int64(text[(first+r)*T+i]))
		y = append(y, int64(text[(first+r)*T+i+1]))
	}
	return x, y
}

// TestWindowsRanks: on every layout each rank's block of a batch holds
// the windows of its rows, equal to a serial reading of the text; the
// data-parallel ranks' rows are disjoint and together the global batch
// in order (uneven and empty shares included), and the other axes' ranks
// hold the same rows. The held-out windows are the file's tail.
func TestWindowsRanks(t *testing.T) {
	text := corpus(1000)
	path := writeFile(t, "input.txt", text)
	const T, batch, steps = 7, 5, 40 // 142 windows, 28 batches an epoch: steps cross an epoch
	for _, l := range []struct {
		name  string
		shape []int
		names []string
		dp    []string
	}{
		{"1 rank", []int{1}, []string{"dp"}, nil},
		{"dp=2,tp=2", []int{2, 2}, []string{"dp", "tp"}, []string{"dp"}},
		{"dp=3", []int{3}, []string{"dp"}, []string{"dp"}}, // rows 2, 2, 1
		{"dp=2×fsdp=3", []int{2, 3}, []string{"dp", "fsdp"}, []string{"dp", "fsdp"}},
	} {
		t.Run(l.name, func(t *testing.T) {
			f, err := train.OpenTokens(path, 256)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			ranks := 1
			for _, s := range l.shape {
				ranks *= s
			}
			got := make([][][]int, ranks) // rank, step: the global rows its block holds
			var global [][]int            // step: rank 0's global batch
			placementtest.Run(t, l.shape, l.names, func(ctx context.Context, m *mesh.Mesh) error {
				all, err := train.NewWindows(f, T, m, l.dp...)
				if err != nil {
					return err
				}
				w, val, err := all.Split(0.1)
				if err != nil {
					return err
				}
				if all.Len() != (len(text)-1)/T || val.Len() != 15 || w.Len() != all.Len()-15 {
					return fmt.Errorf("%d windows, %d held out, %d left", all.Len(), val.Len(), w.Len())
				}
				vx, vy, err := val.Rows([]int{0, 14})
				if err != nil {
					return err
				}
				for i, r := range []int{0, 14} {
					x, y := windowRef(text, w.Len(), r, T)
					if !slices.Equal(vx[i*T:(i+1)*T], x) || !slices.Equal(vy[i*T:(i+1)*T], y) {
						return fmt.Errorf("validation window %d is not window %d of the file", r, w.Len()+r)
					}
				}
				s, err := w.Sampler(batch, train.WithShuffle(3))
				if err != nil {
					return err
				}
				for range steps {
					smp := s.Next()
					b, err := w.Batch(ctx, smp)
					if err != nil {
						return err
					}
					xs, ys := b.X.Local(), b.Y.Local()
					if len(xs)%T != 0 || len(ys) != len(xs) {
						return fmt.Errorf("blocks of %d and %d ids", len(xs), len(ys))
					}
					var rows []int
					for i := range len(xs) / T {
						// Identify the block's row i among the global batch's
						// windows by its tokens.
						found := -1
						for _, r := range smp.Global {
							x, y := windowRef(text, 0, r, T)
							if slices.Equal(xs[i*T:(i+1)*T], x) && slices.Equal(ys[i*T:(i+1)*T], y) {
								found = r
								break
							}
						}
						if found < 0 {
							return fmt.Errorf("step %d row %d: %v is no window of the batch", smp.Index, i, xs[i*T:(i+1)*T])
						}
						rows = append(rows, found)
					}
					if len(l.dp) == 1 && !slices.Equal(rows, smp.Rows) {
						return fmt.Errorf("rows %v, the sampler's %v", rows, smp.Rows)
					}
					got[m.Rank()] = append(got[m.Rank()], rows)
					if m.Rank() == 0 {
						global = append(global, smp.Global)
					}
				}
				return nil
			})
			if t.Failed() {
				return
			}
			// The data-parallel axes lead the mesh's, so rank r is data
			// rank r/rest, rest the ranks of the other axes.
			rest := ranks
			for i := range l.dp {
				rest /= l.shape[i]
			}
			for step := range steps {
				var union []int
				for r := 0; r < ranks; r += rest {
					union = append(union, got[r][step]...)
				}
				if !slices.Equal(union, global[step]) {
					t.Fatalf("step %d: the data-parallel ranks' rows %v, the global batch %v", step, union, global[step])
				}
				for r := range ranks {
					if lead := r / rest * rest; !slices.Equal(got[r][step], got[lead][step]) {
						t.Fatalf("step %d: rank %d holds %v, rank %d of its data-parallel group %v", step, r, got[r][step], lead, got[lead][step])
					}
				}
			}
		})
	}
}

// TestWindowsResume: n steps straight give the batches of k steps, the
// sampler's State through JSON into a sampler over a freshly opened file,
// and n−k more steps, on every rank, across an epoch boundary, for
// every k around it.
func TestWindowsResume(t *testing.T) {
	path := writeFile(t, "input.txt", corpus(600))
	const T, batch, n = 5, 4, 35 // 119 windows, 29 batches an epoch
	placementtest.Run(t, []int{2}, []string{"dp"}, func(ctx context.Context, m *mesh.Mesh) error {
		open := func() (*train.TokenFile, *train.Windows, *train.Sampler, error) {
			f, err := train.OpenTokens(path, 256)
			if err != nil {
				return nil, nil, nil, err
			}
			w, err := train.NewWindows(f, T, m, "dp")
			if err != nil {
				return nil, nil, nil, err
			}
			s, err := w.Sampler(batch, train.WithShuffle(11))
			return f, w, s, err
		}
		next := func(w *train.Windows, s *train.Sampler) ([]int64, error) {
			b, err := w.Batch(ctx, s.Next())
			if err != nil {
				return nil, err
			}
			return append(b.X.Local(), b.Y.Local()...), nil
		}
		f, w, s, err := open()
		if err != nil {
			return err
		}
		defer f.Close()
		var straight [][]int64
		for range n {
			b, err := next(w, s)
			if err != nil {
				return err
			}
			straight = append(straight, b)
		}
		for _, k := range []int{0, 1, 28, 29, 30, n} {
			f1, w1, s1, err := open()
			if err != nil {
				return err
			}
			for range k {
				if _, err := next(w1, s1); err != nil {
					return err
				}
			}
			blob, err := json.Marshal(s1.State())
			f1.Close()
			if err != nil {
				return err
			}
			f2, w2, s2, err := open()
			if err != nil {
				return err
			}
			defer f2.Close()
			var st train.SamplerState
			if err := json.Unmarshal(blob, &st); err != nil {
				return err
			}
			if err := s2.Restore(st); err != nil {
				return err
			}
			for i := k; i < n; i++ {
				b, err := next(w2, s2)
				if err != nil {
					return err
				}
				if !slices.Equal(b, straight[i]) {
					return fmt.Errorf("resumed after %d steps: step %d's block %v, straight %v", k, i, b, straight[i])
				}
			}
		}
		return nil
	})
}

// TestWindowsRefused: a window length below 1, a file shorter than one
// window, an axis the mesh lacks, and splits that leave a side empty are
// refused with ErrInvalid.
func TestWindowsRefused(t *testing.T) {
	path := writeFile(t, "input.txt", corpus(21)) // 20 windows of T=1, 2 of T=8
	placementtest.Run(t, []int{1}, []string{"dp"}, func(ctx context.Context, m *mesh.Mesh) error {
		f, err := train.OpenTokens(path, 256)
		if err != nil {
			return err
		}
		defer f.Close()
		for _, tc := range []struct {
			name string
			T    int
			axes []string
		}{{"T=0", 0, nil}, {"T=21 on 21 tokens", 21, nil}, {"no such axis", 4, []string{"fsdp"}}} {
			if _, err := train.NewWindows(f, tc.T, m, tc.axes...); !errors.Is(err, train.ErrInvalid) {
				t.Errorf("%s: %v, want ErrInvalid", tc.name, err)
			}
		}
		if _, err := train.NewWindows(f, 20, m); err != nil {
			t.Errorf("T=20 on 21 tokens: %v", err)
		}
		w, err := train.NewWindows(f, 1, m)
		if err != nil {
			return err
		}
		for _, frac := range []float64{0, -0.1, 0.96, 1, 1.5} { // 0.96 holds out all 20
			if _, _, err := w.Split(frac); !errors.Is(err, train.ErrInvalid) {
				t.Errorf("Split(%v): %v, want ErrInvalid", frac, err)
			}
		}
		if a, b, err := w.Split(0.95); err != nil || a.Len() != 1 || b.Len() != 19 {
			t.Errorf("Split(0.95): %v windows and %v, %v; want 1 and 19", a, b, err)
		}
		if _, _, err := w.Rows([]int{20}); !errors.Is(err, train.ErrInvalid) {
			t.Errorf("Rows past the end: %v, want ErrInvalid", err)
		}
		if _, err := train.ValLoss[train.LM](ctx, nil, w, nil, 0, nil); !errors.Is(err, train.ErrInvalid) {
			t.Errorf("ValLoss of nothing: %v, want ErrInvalid", err)
		}
		return nil
	})
}

// BenchmarkOpenTokens times OpenTokens's check of every token of a 64 MiB
// llm.c file (from the page cache once warm): the cost of opening a
// corpus, in bytes per second.
func BenchmarkOpenTokens(b *testing.B) {
	toks := make([]int, 32<<20)
	for i := range toks {
		toks[i] = i % 50257
	}
	path := filepath.Join(b.TempDir(), "train.bin")
	if err := os.WriteFile(path, llmcBytes(20240520, 1, int32(len(toks)), toks), 0o644); err != nil {
		b.Fatal(err)
	}
	b.SetBytes(int64(2 * len(toks)))
	for b.Loop() {
		f, err := train.OpenTokens(path, 50257)
		if err != nil {
			b.Fatal(err)
		}
		f.Close()
	}
}
