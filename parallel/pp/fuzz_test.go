package pp

import (
	"bytes"
	"strings"
	"testing"
)

// FuzzReadCSV: any text either reads as a schedule that validates,
// prints, lowers (when compute-only) and writes back to the same lists,
// or is an error; nothing panics.
func FuzzReadCSV(f *testing.F) {
	for _, name := range []string{"gpipe", "1f1b", "interleaved", "zb1", "zbv"} {
		s, err := Build(name, 2, 4, 0)
		if err != nil {
			f.Fatal(err)
		}
		var buf bytes.Buffer
		if err := s.WriteCSV(&buf); err != nil {
			f.Fatal(err)
		}
		f.Add(buf.String())
	}
	f.Add("0F0,0B0,0UNSHARD\n")
	f.Add("0F0,0SEND_F0\n1RECV_F0,1F0,1B0,1SEND_B0\n")
	f.Fuzz(func(t *testing.T, text string) {
		s, err := ReadCSV(strings.NewReader(text), "fuzz")
		if err != nil {
			return
		}
		if err := s.Validate(); err != nil {
			t.Fatalf("read a schedule that does not validate: %v", err)
		}
		_ = s.Table()
		if !s.Lowered() {
			if _, err := Lower(s, WithFSDP(), WithReduceGrad()); err != nil {
				t.Fatalf("lowering a valid schedule: %v", err)
			}
		}
		var buf bytes.Buffer
		if err := s.WriteCSV(&buf); err != nil {
			t.Fatal(err)
		}
		back, err := ReadCSV(&buf, "fuzz")
		if err != nil {
			t.Fatalf("reading back: %v", err)
		}
		if lists(back) != lists(s) {
			t.Fatalf("read back\n%s\nwant\n%s", lists(back), lists(s))
		}
	})
}
