// Package dense converts between loom's tensors and gorgonia.org/tensor's
// *tensor.Dense. It is the only package of loom that imports gorgonia:
// placement, safetensors and comm hold tensor data in loom's own dense
// representation (a shape plus a row-major []float32, []float64 or []byte)
// and know nothing of gorgonia, so a program that does not use gorgonia does
// not link it.
//
// Each conversion copies: the result never shares memory with its input,
// except ToBuffer, which wraps a tensor's backing array for a collective.
// Views, transposed and column-major tensors are read in logical row-major
// order. gorgonia cannot represent a tensor with a zero dim (its Size and
// Data panic), so conversions to *tensor.Dense refuse empty tensors with
// an error wrapping ErrInvalid instead; loom's own representation holds them
// (placement.DTensor.Full, safetensors.Tensor).
//
// The conversions, named from the gorgonia side:
//
//   - ToDTensor and FromDTensor: a global tensor every rank holds <->
//     placement.DTensor (like placement.FromFull and DTensor.Full).
//   - ToSafetensor and FromSafetensor: safetensors.Tensor, for
//     checkpoints and fixtures.
//   - ToBuffer: a comm.HostBuffer over the tensor's memory, for
//     collectives.
package dense
