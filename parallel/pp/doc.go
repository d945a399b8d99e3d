// Package pp holds pipeline-parallel schedules as data (issue 30): a
// schedule is, for each rank of the pipeline axis, the ordered list of
// actions that rank performs in one training step — forward (F) of a
// micro-batch on a stage, backward for inputs (I), backward for weights
// (W), full backward (B), the sends and receives of activations and
// gradients, FSDP unshard and reshard, and the once-per-step gradient
// reduction.
//
// Use it to choose, print, check or write a pipeline schedule before a
// run: which schedule fits a pp degree and a micro-batch count, its
// theoretical bubble and its peak activations per stage, or whether a
// schedule of one's own is sound (the package's Example prints 1F1B for 4
// ranks; ExampleReadCSV rejects a deadlocking one; ExampleLower inserts
// the communication).
//
// A schedule is built by a function (GPipe, OneFOneB, Interleaved1F1B,
// ZBH1, ZBV, or Build by name), or loaded from CSV in PyTorch's
// [stage][type][micro-batch] notation ("0F1", "1B0", "2I3", "0W1"), or
// written by hand and checked with Infer; it prints as a table of ranks
// against time steps (Table). Builders and CSV hold compute actions only;
// Lower inserts the communication in one pass. Validate checks a schedule
// before anything runs, and Simulate runs its lists with unit costs to
// find deadlocks, the bubble fraction and the peak number of micro-batches
// whose activations each stage holds.
//
// What a runtime executing a lowered schedule must do for the checks to
// hold: run each rank's list in order; never block on a send (the
// simulation treats sends as asynchronous, as comm.SendAsync is); treat
// a RECV_F or RECV_B as the point where the data must have arrived (the
// receive may be posted earlier, but posting them all up front is what
// makes PyTorch's warm-up bubble); and hold a micro-batch's activations
// on a stage from its F until its B, or until its W when the backward is
// split, which is what the peak counts assume.
package pp
