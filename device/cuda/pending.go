package cuda

import "github.com/b7ea7098/loom/device"

// The Kernels methods below were added to device.Kernels after the CUDA
// kernels they need were written; until they have them, each is an error
// wrapping loom.ErrUnsupported that names the missing kernel.

// SoftmaxDim needs a softmax kernel over the middle dim of [outer, n, inner].
func (k cudaKernels) SoftmaxDim(dst, src device.Buffer, outer, n, inner int, log bool) error {
	return unsupported(k.d, "SoftmaxDim", "no kernel for a softmax over a dim other than the last yet")
}

// SoftmaxDimBackward needs the backward of SoftmaxDim's kernel.
func (k cudaKernels) SoftmaxDimBackward(dx, y, dy device.Buffer, outer, n, inner int, log bool) error {
	return unsupported(k.d, "SoftmaxDimBackward", "no kernel for a softmax over a dim other than the last yet")
}

// CrossEntropyMean needs xent.cu's loss divided on the device.
func (k cudaKernels) CrossEntropyMean(loss, lse, logits, targets device.Buffer, v, count int) error {
	return unsupported(k.d, "CrossEntropyMean", "xent.cu has no mean form yet (the divide on the device)")
}

// CrossEntropyMeanBackward needs xent.cu's backward with the scale read
// on the device.
func (k cudaKernels) CrossEntropyMeanBackward(dx, logits, targets, lse, g device.Buffer, v, count int) error {
	return unsupported(k.d, "CrossEntropyMeanBackward", "xent.cu has no backward that reads its scale on the device yet")
}
