package tinygpt

import "testing"

// loadFixture loads the embedded tiny_gpt.json; a missing or damaged
// fixture fails the test.
func loadFixture(t *testing.T) *Fixture {
	t.Helper()
	fx, err := LoadFixture()
	if err != nil {
		t.Fatal(err)
	}
	return fx
}

// readSpec returns the embedded reference/TINY_GPT.md.
func readSpec(t *testing.T) string {
	t.Helper()
	data, err := loadFixture(t).Spec()
	if err != nil {
		t.Fatal(err)
	}
	return string(data)
}

// defaultCorpus is Corpus(Default()), generated once.
var defaultCorpus = Corpus(Default())
