package tinygpt

// NumWords is the size of the corpus word list.
const NumWords = 32

var words = [NumWords]string{
	"the", "a", "model", "rank", "tensor", "shard", "ring", "tree",
	"mesh", "device", "gradient", "reduces", "gathers", "scatters", "sends", "receives",
	"fast", "slow", "large", "small", "every", "each", "layer", "head",
	"token", "batch", "step", "loss", "is", "and", "with", "over",
}

// Words returns the word list of reference/TINY_GPT.md §2.2; a word's index is its
// position. The result is a copy.
func Words() [NumWords]string { return words }

// Sentence is the record of the draws behind one corpus sentence, for tests
// and diagnostics.
type Sentence struct {
	// Words are the word indices, in order (len(Words) = n, from 3 to 10).
	Words []int
	// Newline reports whether the separator after the period is '\n'
	// (otherwise it is a space).
	Newline bool
}

// nextSentence draws one sentence from g, in exactly the order of §2.2.
func nextSentence(g *LCG) Sentence {
	n := 3 + g.Randint(8)
	ws := make([]int, n)
	w := g.Randint(NumWords)
	ws[0] = w
	for i := 1; i < n; i++ {
		w = (5*w + 1 + g.Randint(4)) % NumWords
		ws[i] = w
	}
	return Sentence{Words: ws, Newline: g.Randint(4) == 0}
}

// appendText appends the sentence's text: the words joined by single spaces,
// the first character upper-cased (ASCII), a period and the separator.
func (s Sentence) appendText(dst []byte) []byte {
	start := len(dst)
	for i, w := range s.Words {
		if i > 0 {
			dst = append(dst, ' ')
		}
		dst = append(dst, words[w]...)
	}
	if c := dst[start]; 'a' <= c && c <= 'z' {
		dst[start] = c - 'a' + 'A'
	}
	dst = append(dst, '.')
	if s.Newline {
		return append(dst, '\n')
	}
	return append(dst, ' ')
}

// Sentences returns the first k sentences the corpus generator draws from
// seed, before any cut.
func Sentences(seed uint32, k int) []Sentence {
	g := NewLCG(seed)
	out := make([]Sentence, k)
	for i := range out {
		out[i] = nextSentence(g)
	}
	return out
}

// Corpus returns the cfg.CorpusLen bytes of the synthetic corpus of
// reference/TINY_GPT.md §2.2, generated from an LCG seeded with cfg.CorpusSeed. Only
// those two fields are used. Sentences are appended while the text is
// shorter than CorpusLen, then the text is cut to exactly CorpusLen bytes
// (the cut may fall inside the last sentence). A CorpusLen ≤ 0 gives an
// empty corpus.
func Corpus(cfg Config) []byte {
	n := cfg.CorpusLen
	if n <= 0 {
		return []byte{}
	}
	// The longest sentence is 10 words of at most 8 letters, 9 spaces, a
	// period and a separator: 91 bytes.
	buf := make([]byte, 0, n+128)
	g := NewLCG(cfg.CorpusSeed)
	for len(buf) < n {
		buf = nextSentence(g).appendText(buf)
	}
	return buf[:n:n]
}
