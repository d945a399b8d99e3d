package tinygpt_test

import (
	"fmt"

	"github.com/b7ea7098/loom/reference/tinygpt"
)

func Example() {
	cfg := tinygpt.Default()
	corpus := tinygpt.Corpus(cfg)
	s, err := tinygpt.NewSampler(cfg, corpus)
	if err != nil {
		panic(err)
	}
	b := s.Next() // batch 1
	x, y := b.Row(0)
	fmt.Println(tinygpt.CorpusSHA256(corpus))
	fmt.Println(b.Shape(), b.Offsets[:3])
	fmt.Printf("%q\n%q\n", bytes(x[:12]), bytes(y[:12])) // y is x shifted by one byte
	half, _ := b.Shard(1, 2)                             // rank 1 of 2 keeps rows 8…15
	fmt.Println(half.Offsets[0] == b.Offsets[8], cfg.NumParams())
	// Output:
	// 53fbf8dca4fcbdb7cf6ceddf68579a8b428febe02a3d276c53b8267af324c189
	// [16 64] [80286 15612 73159]
	// " tree tree t"
	// "tree tree tr"
	// true 470528
}

func bytes(v []int64) []byte {
	out := make([]byte, len(v))
	for i, t := range v {
		out[i] = byte(t)
	}
	return out
}
