package nccl

import (
	"context"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/internal/checkwire"
)

// checkFingerprint allgathers this rank's fingerprint of call at seq, with
// its local validation error (invalid) and, for Split, color and key; it
// returns the same verdict on every rank: nil, an ErrInvalid error listing
// the ranks that rejected the call, or a *comm.MismatchError. Neither
// verdict aborts the communicator, and neither takes a sequence number.
func (c *Comm) checkFingerprint(ctx context.Context, seq uint64, call *comm.Call, invalid error, color, key int) error {
	fp := comm.FingerprintOf(seq, call)
	fp.Site = callerSite()
	mine := make([]byte, checkwire.FingerprintSize(c.size))
	checkwire.PutFingerprint(mine, c.size, fp, invalid, color, key)
	all, err := c.exchange(ctx, call.Op, seq, mine)
	if err != nil {
		return err
	}
	if err := checkwire.CheckFingerprints(all, c.size); err != nil {
		return c.wrap(call.Op, seq, -1, err)
	}
	return nil
}

// checkCounts checks AllToAllV's counts across ranks before data moves:
// every rank allgathers its send and receive counts (and its local
// validation error), so every rank reaches the same verdict: nil, an
// ErrInvalid error listing the ranks that rejected the call, or the
// comm.CheckCounts error listing every disagreeing pair. Neither verdict
// aborts the communicator, and neither takes a sequence number.
func (c *Comm) checkCounts(ctx context.Context, seq uint64, call *comm.Call, invalid error) error {
	mine := make([]byte, checkwire.CountsSize(c.size))
	checkwire.PutCounts(mine, c.size, call.SendCounts, call.RecvCounts, invalid)
	all, err := c.exchange(ctx, call.Op, seq, mine)
	if err != nil {
		return err
	}
	if err := checkwire.CheckCounts(all, c.size); err != nil {
		return c.wrap(call.Op, seq, -1, err)
	}
	return nil
}
