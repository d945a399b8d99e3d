package tinygpt

import (
	"bytes"
	"strings"
	"testing"
)

// Checks from reference/TINY_GPT.md §2.2 for the default seed.
const (
	specCorpusSHA256 = "53fbf8dca4fcbdb7cf6ceddf68579a8b428febe02a3d276c53b8267af324c189"
	specCorpusStart  = "Gathers the model sends mesh reduces loss.\nScatters model scatters shard and. Device "
)

func TestCorpusDefault(t *testing.T) {
	c := defaultCorpus
	if len(c) != Default().CorpusLen {
		t.Fatalf("len = %d, want %d", len(c), Default().CorpusLen)
	}
	if got := CorpusSHA256(c); got != specCorpusSHA256 {
		t.Errorf("SHA-256 = %s, want %s", got, specCorpusSHA256)
	}
	if !bytes.HasPrefix(c, []byte(specCorpusStart)) {
		t.Errorf("corpus starts %q, want %q", c[:len(specCorpusStart)], specCorpusStart)
	}
	var seen [256]bool
	distinct := 0
	for i, b := range c {
		if b >= 128 {
			t.Fatalf("byte %d at offset %d is not ASCII", b, i)
		}
		if !seen[b] {
			seen[b] = true
			distinct++
		}
	}
	if distinct != 40 {
		t.Errorf("%d distinct byte values, want 40", distinct)
	}
	if !bytes.Equal(Corpus(Default()), c) {
		t.Error("Corpus is not deterministic")
	}
}

func TestCorpusFixture(t *testing.T) {
	fx := loadFixture(t)
	cfg, err := fx.Cfg()
	if err != nil {
		t.Fatal(err)
	}
	c := Corpus(cfg)
	if got := CorpusSHA256(c); got != fx.CorpusSHA256 {
		t.Errorf("SHA-256 = %s, fixture corpus_sha256 = %s", got, fx.CorpusSHA256)
	}
	if len(fx.CorpusHead) != 160 {
		t.Errorf("corpus_head has %d characters, the spec says 160", len(fx.CorpusHead))
	}
	if head := string(c[:len(fx.CorpusHead)]); head != fx.CorpusHead {
		t.Errorf("head = %q, fixture corpus_head = %q", head, fx.CorpusHead)
	}
	if len(c) != fx.CorpusLen {
		t.Errorf("len = %d, fixture corpus_len = %d", len(c), fx.CorpusLen)
	}
}

func TestCorpusFirstSentence(t *testing.T) {
	s := Sentences(Default().CorpusSeed, 2)
	if n := len(s[0].Words); n != 7 {
		t.Fatalf("first sentence has n = %d, want 7", n)
	}
	w := Words()
	var got []string
	for _, i := range s[0].Words {
		got = append(got, w[i])
	}
	if want := "gathers the model sends mesh reduces loss"; strings.Join(got, " ") != want {
		t.Errorf("first sentence words %q, want %q", strings.Join(got, " "), want)
	}
	if !s[0].Newline || s[1].Newline {
		t.Errorf("separators: newline = %v, %v; want true, false", s[0].Newline, s[1].Newline)
	}
	// Each later word follows w = (5·w + 1 + randint(4)) mod 32.
	for _, sent := range Sentences(Default().CorpusSeed, 200) {
		if n := len(sent.Words); n < 3 || n > 10 {
			t.Fatalf("sentence with %d words", n)
		}
		for i := 1; i < len(sent.Words); i++ {
			d := (sent.Words[i] - (5*sent.Words[i-1]+1)%NumWords + NumWords) % NumWords
			if d > 3 {
				t.Fatalf("word %d follows %d: step %d is not in [0, 4)", sent.Words[i], sent.Words[i-1], d)
			}
		}
	}
}

func TestCorpusCut(t *testing.T) {
	// The first sentence is 42 bytes plus its '\n'. Shorter corpora are
	// prefixes of longer ones: the cut may fall anywhere, including right
	// after a separator.
	for _, tc := range []struct {
		name string
		n    int
		want string
	}{
		{"empty", 0, ""},
		{"negative", -5, ""},
		{"one byte", 1, "G"},
		{"inside the first sentence", 7, "Gathers"},
		{"before the period", 41, "Gathers the model sends mesh reduces loss"},
		{"before the separator", 42, "Gathers the model sends mesh reduces loss."},
		{"after the newline", 43, "Gathers the model sends mesh reduces loss.\n"},
		{"one into sentence 2", 44, "Gathers the model sends mesh reduces loss.\nS"},
		{"spec start", len(specCorpusStart), specCorpusStart},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := Default()
			cfg.CorpusLen = tc.n
			got := Corpus(cfg)
			if string(got) != tc.want {
				t.Errorf("Corpus = %q, want %q", got, tc.want)
			}
			if len(got) != cap(got) {
				t.Errorf("cap %d > len %d: appending could see hidden bytes", cap(got), len(got))
			}
		})
	}
}

func TestCorpusSentenceShape(t *testing.T) {
	// Every sentence: upper-case first letter, words of the list, '.', then
	// '\n' or ' '.
	known := map[string]bool{}
	for _, w := range Words() {
		known[w] = true
	}
	text := string(defaultCorpus)
	sentences := strings.FieldsFunc(text, func(r rune) bool { return r == '.' })
	for i, s := range sentences[:len(sentences)-1] { // the last one may be cut
		if i > 0 {
			if s[0] != ' ' && s[0] != '\n' {
				t.Fatalf("sentence %d: separator %q", i, s[0])
			}
			s = s[1:]
		}
		if s[0] < 'A' || s[0] > 'Z' {
			t.Fatalf("sentence %d %q does not start upper-case", i, s)
		}
		ws := strings.Split(strings.ToLower(s[:1])+s[1:], " ")
		if len(ws) < 3 || len(ws) > 10 {
			t.Fatalf("sentence %d %q has %d words", i, s, len(ws))
		}
		for _, w := range ws {
			if !known[w] {
				t.Fatalf("sentence %d %q: unknown word %q", i, s, w)
			}
		}
	}
}

func TestCorpusOtherSeed(t *testing.T) {
	cfg := Default()
	cfg.CorpusSeed = 1
	cfg.CorpusLen = 4096
	c := Corpus(cfg)
	if len(c) != 4096 || bytes.Equal(c, defaultCorpus[:4096]) {
		t.Errorf("seed 1: len %d, equal to the default corpus: %v", len(c), bytes.Equal(c, defaultCorpus[:4096]))
	}
}
