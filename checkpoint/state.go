package checkpoint

import (
	"github.com/b7ea7098/loom/placement"
)

// State is what a checkpoint holds: named distributed tensors and small
// typed user entries. Module and optimizer state (parameters, moments,
// step counts) plug in as tensors under their names; the data sampler's
// position, an RNG state or a learning-rate schedule's step are entries.
//
// Tensors may differ from rank to rank (a pipeline stage passes its own
// layers), but a tensor that a rank passes must be passed, with the same
// spec, by every rank of its mesh. Entries too may differ from rank to
// rank (a pipeline stage's optimizer step counts): the checkpoint holds
// their union, and an entry that several ranks pass must have the same
// value on each.
type State struct {
	// Tensors maps names to this rank's handles on the tensors. Any
	// placement but Partial and Routed, on any device.
	Tensors map[string]*placement.DTensor
	// Entries maps names to values of type bool, int64, float64, string,
	// []byte, []int64 or []float64; Load returns them with the same types.
	Entries map[string]any
}
