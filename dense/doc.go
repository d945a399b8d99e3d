// Package dense converts between loom's tensors and gorgonia.org/tensor's
// *tensor.Dense. It is the only package of loom that imports gorgonia:
// placement holds tensor data in loom's own dense representation (a shape
// plus a row-major []float32 or []float64) and knows nothing of gorgonia.
//
// Each conversion copies: the result never shares memory with its input.
// Views, transposed and column-major tensors are read in logical row-major
// order. gorgonia cannot represent a tensor with a zero dim (its Size and
// Data panic), so conversions to *tensor.Dense refuse empty tensors with
// an error wrapping ErrInvalid instead; loom's own representation holds them
// (placement.DTensor.Full).
//
// The conversions, named from the gorgonia side:
//
//   - ToDTensor and FromDTensor: a global tensor every rank holds <->
//     placement.DTensor (like placement.FromFull and DTensor.Full).
package dense
