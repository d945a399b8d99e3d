package moe

// SetSplitMinBytes sets the payload per rank and call from which the
// dispatches using ws split their all-to-all-v by local expert: 1 splits
// whenever there are several local experts, a negative value never.
func SetSplitMinBytes(ws *Workspace, n int) { ws.splitMin = n }

// OpenMoEReference opens the embedded MoE reference fixture for the
// external tests.
var OpenMoEReference = openMoEReference
