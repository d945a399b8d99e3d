package tinygpt

import (
	"errors"
	"os"
	"path/filepath"
	"testing"
)

// loadFixture loads tiny_gpt.json from the shared reference folder and skips
// the test if that folder is absent.
func loadFixture(t *testing.T) *Fixture {
	t.Helper()
	fx, err := LoadDefaultFixture()
	if errors.Is(err, ErrNoFixture) {
		t.Skipf("the reference fixture is absent (../shared/reference beside the repository): %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	return fx
}

// readSpec returns TINY_GPT.md from the shared reference folder and skips the
// test if that folder is absent.
func readSpec(t *testing.T) string {
	t.Helper()
	dir, err := FixtureDir()
	if errors.Is(err, ErrNoFixture) {
		t.Skipf("the reference fixture is absent (../shared/reference beside the repository): %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile(filepath.Join(dir, SpecName))
	if err != nil {
		t.Fatal(err)
	}
	return string(data)
}

// defaultCorpus is Corpus(Default()), generated once.
var defaultCorpus = Corpus(Default())
