//go:build mpi

package mpi

// Hooks for the external tests.
var (
	RawAllReduceSum = rawAllReduceSum
	CF32ToBF16      = cF32ToBF16
	CF32ToF16       = cF32ToF16
	CF16ToF32       = cF16ToF32
	OrphanCount     = orphanCount
	PollNotices     = pollNotices
	RawAllReduce    = rawAllReduce
)

// SetEndJob replaces what c does when a blocking call cannot be
// interrupted (MPI_Abort), so that tests can observe it.
func SetEndJob(c *Comm, f func(error)) { c.endJob = f }

// SetMaxCount lowers the per-call element limit, so that tests exercise the
// splitting of large messages; it returns a function restoring it.
func SetMaxCount(n int) func() {
	old := maxCount
	maxCount = n
	return func() { maxCount = old }
}
