package pp

import "github.com/b7ea7098/loom"

// Sentinel errors; test for them with errors.Is.
var (
	// ErrInvalid: a schedule or an argument was refused before anything
	// ran: a bad count (ranks, micro-batches, stages per rank), too few
	// micro-batches for a schedule (the error names the minimum), an
	// action list that breaks a rule (the error names the rank, the
	// position and the action), a CSV cell that does not parse.
	ErrInvalid = loom.NewSentinel("pp: invalid argument", loom.ErrInvalid)
	// ErrDeadlock: simulating the per-rank action lists with blocking
	// receives stopped with actions left; the error names the action each
	// stuck rank waits at. It also matches ErrInvalid: the schedule is
	// rejected before any data moves.
	ErrDeadlock = loom.NewSentinel("pp: schedule deadlocks", ErrInvalid, loom.ErrInvalid)
)
