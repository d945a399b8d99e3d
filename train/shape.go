package train

import (
	"errors"
	"flag"
	"fmt"
	"slices"
	"strings"

	"github.com/b7ea7098/loom/internal/numcheck"
)

// Shape is a transformer's shape and global batch as the examples' flags
// give them.
type Shape struct {
	// Layers is the number of blocks, Width the model width, Heads the
	// attention heads, FF the MLP's (or each expert's) hidden width, Seq
	// the sequence length in tokens and Vocab the vocabulary size.
	Layers, Width, Heads, FF, Seq, Vocab int
	// Batch is the global batch in sequences.
	Batch int
}

// ShapeFlags are the model-shape flags the example programs share: -model
// names a preset, and -layers, -width, -heads, -ff, -seq, -vocab and
// -batch override its fields one by one.
type ShapeFlags struct {
	// Model is -model: the preset's name.
	Model   string
	presets []string
	v       Shape
}

// shapeFlag is one override flag: its name, its usage and its field.
type shapeFlag struct {
	name, usage string
	field       func(*Shape) *int
	min         int // 0 for -layers (a model of no blocks), else 1
}

var shapeFlags = []shapeFlag{
	{"layers", "transformer blocks", func(s *Shape) *int { return &s.Layers }, 0},
	{"width", "model width (channels of the residual stream)", func(s *Shape) *int { return &s.Width }, 1},
	{"heads", "attention heads (they must divide -width)", func(s *Shape) *int { return &s.Heads }, 1},
	{"ff", "hidden width of the MLP (of each expert, in a MoE model)", func(s *Shape) *int { return &s.FF }, 1},
	{"seq", "sequence length in tokens", func(s *Shape) *int { return &s.Seq }, 1},
	{"vocab", "vocabulary size", func(s *Shape) *int { return &s.Vocab }, 1},
	{"batch", "global batch in sequences (sharded over the data-parallel ranks)", func(s *Shape) *int { return &s.Batch }, 1},
}

// Register defines -model (default def, one of presets) and the
// override flags on fs.
func (s *ShapeFlags) Register(fs *flag.FlagSet, def string, presets []string) {
	s.presets = slices.Clone(presets)
	fs.StringVar(&s.Model, "model", def, "the model's shape and batch: "+strings.Join(presets, ", ")+"; the flags -layers … -batch override its fields")
	for _, f := range shapeFlags {
		fs.IntVar(f.field(&s.v), f.name, 0, f.usage+" (default: the preset's)")
	}
}

// Preset returns -model's name after checking it is one of the presets;
// an unknown name is an error wrapping ErrInvalid that lists them.
func (s *ShapeFlags) Preset() (string, error) {
	if !slices.Contains(s.presets, s.Model) {
		return "", fmt.Errorf("%w: -model %q; want %s", ErrInvalid, s.Model, strings.Join(s.presets, ", "))
	}
	return s.Model, nil
}

// Apply returns p with every override flag that was set on fs's command
// line in place of its field (call it after fs.Parse). Each value set must be at least 1 (-layers at least 0); every bad
// one is reported, each wrapping ErrInvalid and naming its flag.
func (s *ShapeFlags) Apply(fs *flag.FlagSet, p Shape) (Shape, error) {
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	var errs []error
	for _, f := range shapeFlags {
		if !set[f.name] {
			continue
		}
		v := *f.field(&s.v)
		var err error
		if f.min == 0 {
			err = numcheck.NonNegativeCount(ErrInvalid, "-"+f.name, v)
		} else {
			err = numcheck.Count(ErrInvalid, "-"+f.name, v)
		}
		if err != nil {
			errs = append(errs, err)
			continue
		}
		*f.field(&p) = v
	}
	return p, errors.Join(errs...)
}
