// Package tinygpt is the exactly specified data side of the tiny GPT
// reference in reference/TINY_GPT.md: the configuration (§1), the
// 32-bit LCG (§2.1), the synthetic corpus (§2.2), the batch sampler (§2.3),
// the parameter names, shapes and initialisation kinds (§3.1), the tensor
// names of the safetensors fixture (§5.1) and a typed loader for the scalar
// fixture tiny_gpt.json (§5.2, §6, §7).
//
// Everything here is deterministic and bit-exact with the PyTorch reference;
// the model, its backward pass and AdamW (§3.2, §4) live elsewhere and use
// this package for their inputs and reference numbers.
//
// # The fixture
//
// The fixture's files are embedded in package reference, so every program
// and test finds them in a lone clone, from any working directory:
//
//	fx, err := tinygpt.LoadFixture() // checks the JSON against itself
//	if err != nil {
//		return err
//	}
//	init, err := fx.Params(tinygpt.PrefixInit) // checks the tensors' SHA-256
//
// LoadFixtureFS reads the same files from another file system.
package tinygpt
