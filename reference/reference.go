// Package reference holds the exactly specified reference models that loom
// must reproduce, with PyTorch's numbers, embedded in the package so that
// every program and test finds them in a lone clone of the repository,
// whatever its working directory:
//
//   - TINY_GPT.md, tiny_gpt.json, tiny_gpt.safetensors: a tiny pre-LayerNorm
//     GPT, its synthetic corpus, initial parameters, step-1 gradients, the
//     parameters after one AdamW update and the 200-step loss curve
//     (typed access in package [github.com/b7ea7098/loom/reference/tinygpt]);
//   - MOE_LAYER.md, moe_layer.json, moe_layer.safetensors: one mixture-of-
//     experts layer, its router, experts, outputs and gradients.
//
// The specifications (the .md files) say exactly how each number was
// produced. Each fixture's JSON records the SHA-256 of its tensor file, so
// a damaged file is an error, never a silent difference.
package reference

import (
	"embed"
	"fmt"
	"io/fs"
)

// File names of the embedded reference files.
const (
	TinyGPTSpec        = "TINY_GPT.md"
	TinyGPTJSON        = "tiny_gpt.json"
	TinyGPTSafetensors = "tiny_gpt.safetensors"
	MoESpec            = "MOE_LAYER.md"
	MoEJSON            = "moe_layer.json"
	MoESafetensors     = "moe_layer.safetensors"
)

//go:embed TINY_GPT.md tiny_gpt.json tiny_gpt.safetensors MOE_LAYER.md moe_layer.json moe_layer.safetensors
var files embed.FS

// FS returns the embedded reference files, read-only, at the top level of
// the file system (names as in the constants above).
func FS() fs.FS { return files }

// ReadFile returns the contents of the embedded file name (one of the
// constants above); any other name is an error wrapping fs.ErrNotExist.
func ReadFile(name string) ([]byte, error) {
	b, err := files.ReadFile(name)
	if err != nil {
		return nil, fmt.Errorf("reference: %w", err)
	}
	return b, nil
}
