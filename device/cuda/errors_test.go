package cuda

import (
	"errors"
	"testing"

	"github.com/b7ea7098/loom"
)

// TestErrorKinds: the package's own argument checks wrap ErrInvalid and
// requests this setup cannot serve ErrUnsupported; both match loom's
// kinds.
func TestErrorKinds(t *testing.T) {
	_, _, badCC := ChooseArch(0, []int{80})
	_, _, noArch := ChooseArch(70, []int{80, 90})
	_, negCount := GroupIndex([]int{1, -1}, 1, 2, true)
	_, intArg := packArgs([]any{5})
	var nilCtx *Context
	_, nilAlloc := nilCtx.Alloc(8)
	for _, c := range []struct {
		name       string
		err        error
		want, kind error
	}{
		{"ChooseArch bad capability", badCC, ErrInvalid, loom.ErrInvalid},
		{"GroupIndex negative count", negCount, ErrInvalid, loom.ErrInvalid},
		{"packArgs int", intArg, ErrInvalid, loom.ErrInvalid},
		{"Alloc on nil Context", nilAlloc, ErrInvalid, loom.ErrInvalid},
		{"ChooseArch no architecture", noArch, ErrUnsupported, loom.ErrUnsupported},
	} {
		if !errors.Is(c.err, c.want) || !errors.Is(c.err, c.kind) {
			t.Errorf("%s: %v, want an error wrapping %v", c.name, c.err, c.want)
		}
	}
}
