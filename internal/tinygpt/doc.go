// Package tinygpt is the exactly specified data side of the tiny GPT
// reference in ../shared/reference/TINY_GPT.md: the configuration (§1), the
// 32-bit LCG (§2.1), the synthetic corpus (§2.2), the batch sampler (§2.3),
// the parameter names, shapes and initialisation kinds (§3.1), the tensor
// names of the safetensors fixture (§5.1) and a typed loader for the scalar
// fixture tiny_gpt.json (§5.2, §6, §7).
//
// Everything here is deterministic and bit-exact with the PyTorch reference;
// the model, its backward pass and AdamW (§3.2, §4) live elsewhere and use
// this package for their inputs and reference numbers.
//
// # Locating the fixture
//
// The fixture folder sits beside the repository, at
// <module root>/../shared/reference (from this package's folder that is
// ../../../shared/reference); CI clones the repository with shared/ beside it
// as well. [FixtureDir] finds it from the working directory, so it works from
// tests (whose working directory is the package folder) and from programs run
// inside the module. The environment variable LOOM_REFERENCE_DIR overrides
// the search. A test that needs the fixture does
//
//	fx, err := tinygpt.LoadDefaultFixture()
//	if errors.Is(err, tinygpt.ErrNoFixture) {
//		t.Skip(err)
//	}
//	if err != nil {
//		t.Fatal(err)
//	}
//
// and then reads the tensors from fx.SafetensorsPath().
package tinygpt
