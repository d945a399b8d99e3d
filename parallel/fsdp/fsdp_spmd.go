package fsdp

import (
	"context"
	"fmt"
	"slices"
	"strings"

	"github.com/b7ea7098/loom"
	"github.com/b7ea7098/loom/comm"
)

// The SPMD check of a step. The unit tags of every all-gather and
// reduce-scatter chunk catch ranks that issue different collectives, but
// not ranks that issue the same ones for different reasons: with the
// parameters kept gathered (WithReshard(false), ZeRO-1/2) or prefetched, a
// rank that skips a unit issues exactly its peers' collectives and
// contributes zeros for the unit it skipped, so the others' gradients are
// mixed with nothing to show for it. So every rank also keeps a trace of
// the units it entered in forward, in order, and at the first reduction
// of each pass the ranks of the data-parallel group (shard and replicate
// axes) compare one 64-bit hash of it, by an all-gather of 8 bytes per
// rank on a communicator of its own (so that it can be issued wherever a
// pass's first reduction happens, and is never interleaved with the
// gathers and reductions). When the hashes differ, every rank learns it
// from the same all-gather; at the end of the pass (Finish, Discard or
// NoReplicaSync), where every rank has issued the same collectives, they
// exchange the traces themselves (comm.Agree) and every rank returns the
// same error naming the ranks and the first unit that differs.

// maxTrace bounds the entries a trace keeps for the error message; its
// hash covers every entry.
const maxTrace = 4096

// fnv64Offset and fnv64Prime are FNV-1a's 64-bit constants.
const (
	fnv64Offset uint64 = 14695981039346656037
	fnv64Prime  uint64 = 1099511628211
)

// endMicroBatch is the trace entry that ends a pass (a micro-batch whose
// reduction comes later, under NoSync).
const endMicroBatch = -1

// unitTrace is the units entered in forward since the ranks last compared
// them, and the comparison in flight.
type unitTrace struct {
	items []int32 // unit indices in order of entry (the first maxTrace), or endMicroBatch
	n     int     // entries in all
	hash  uint64  // FNV-1a of every entry

	work  comm.Work // the all-gather of the hashes in flight
	send  []int64
	recv  []int64
	sent  []int32 // the items whose hash is in flight
	sentN int
	at    string // the reduction it was issued before, for errors

	// A comparison that found a difference, kept for the end of the pass.
	bad    bool
	badOf  []int32
	badN   int
	hashes []int64
}

func (t *unitTrace) reset() {
	t.items, t.n, t.hash = t.items[:0], 0, fnv64Offset
}

// add appends entry x.
func (t *unitTrace) add(x int32) {
	if t.n < maxTrace {
		t.items = append(t.items, x)
	}
	t.n++
	for _, b := range [4]byte{byte(x), byte(x >> 8), byte(x >> 16), byte(x >> 24)} {
		t.hash = (t.hash ^ uint64(b)) * fnv64Prime
	}
}

// record notes that unit u was entered in forward (not in a checkpointed
// region's recomputation during backward, which every rank reruns alike).
func (f *FSDP) record(u *fsdpUnit) {
	f.trace.add(int32(u.index))
}

// endTrace marks the end of a pass whose reduction is still to come.
func (f *FSDP) endTrace() {
	if f.trace.n > 0 {
		f.trace.add(endMicroBatch)
	}
}

// compare issues the comparison of the trace across the data-parallel
// group and starts a new trace. It waits for the previous comparison
// first (issued a pass ago: complete by now, in practice).
func (f *FSDP) compare(ctx context.Context, at *fsdpUnit) error {
	t := &f.trace
	if f.fpc == nil { // one data-parallel rank: nothing to compare
		t.reset()
		return nil
	}
	if err := f.checkTrace(ctx); err != nil {
		return err
	}
	p := f.fpc.Size()
	if t.send == nil {
		t.send, t.recv = make([]int64, 1), make([]int64, p)
	}
	t.send[0] = int64(t.hash)
	t.sent, t.sentN = append(t.sent[:0], t.items...), t.n
	t.at = fmt.Sprintf("%s of unit %q", f.reduceOp(), at.path)
	t.reset()
	w, err := comm.AllGatherAsync(comm.WithLabel(ctx, "fsdp unit-order check"), f.fpc, comm.Host(t.send), comm.Host(t.recv))
	if err != nil {
		return t.waitError(err)
	}
	t.work = w
	return nil
}

// checkTrace waits for the comparison in flight and keeps the first
// difference for spmdError.
func (f *FSDP) checkTrace(ctx context.Context) error {
	t := &f.trace
	w := t.work
	if w == nil {
		return nil
	}
	t.work = nil
	if err := w.Wait(ctx); err != nil {
		return t.waitError(err)
	}
	if !t.bad && slices.ContainsFunc(t.recv, func(h int64) bool { return h != t.recv[0] }) {
		t.bad, t.badOf, t.badN, t.hashes = true, slices.Clone(t.sent), t.sentN, slices.Clone(t.recv)
	}
	return nil
}

// waitError wraps an error of the hashes' all-gather.
func (t *unitTrace) waitError(err error) error {
	return fmt.Errorf("fsdp: FSDP SPMD check (all-gather of the hashes of the units entered in forward, issued with the %s): %w", t.at, err)
}

// spmdError completes the comparisons and, when one found a difference,
// exchanges the traces to name the ranks and the first unit that differs:
// an error matching loom.ErrMismatch (a *comm.DisagreementError), the same
// on every rank of the group. Every rank of the group calls it at the same
// point of its sequence of collectives on fpc: the end of a pass.
func (f *FSDP) spmdError(ctx context.Context) error {
	if err := f.checkTrace(ctx); err != nil {
		return err
	}
	t := &f.trace
	if !t.bad {
		return nil
	}
	t.bad = false
	items := make([]string, 0, len(t.badOf)+1)
	for _, i := range t.badOf {
		items = append(items, f.traceEntry(i))
	}
	if t.badN > len(t.badOf) {
		items = append(items, fmt.Sprintf("(%d entries in all)", t.badN))
	}
	err := comm.Agree(ctx, f.fpc, "the FSDP units entered in forward"+f.fpAlong, items)
	if err == nil {
		// The hashes differ where the kept entries agree: past maxTrace
		// (or a hash collision). The hashes still tell who differs.
		ref := t.hashes[0]
		var ranks []string
		for r, h := range t.hashes {
			if h != ref {
				ranks = append(ranks, fmt.Sprint(r))
			}
		}
		err = fmt.Errorf("%w: ranks disagree on the FSDP units entered in forward%s: rank(s) %s differ from rank 0 after the first %d entries", loom.ErrMismatch, f.fpAlong, strings.Join(ranks, ", "), maxTrace)
	}
	return fmt.Errorf("fsdp: FSDP: the ranks ran different units before reducing gradients (non-SPMD control flow): %w", err)
}

// traceEntry names a trace entry for an error message.
func (f *FSDP) traceEntry(i int32) string {
	switch {
	case i == endMicroBatch:
		return "(end of a micro-batch)"
	case int(i) >= len(f.units) || i < 0:
		return fmt.Sprintf("(unit %d)", i)
	case f.units[i].path == "":
		return "(root)"
	}
	return f.units[i].path
}

// groupNote says which shard-axis ranks the WithReshardTo group's ranks are,
// for an error of the group communicator: its ranks count from 0 within
// the group, so that its "rank 1" is, in group 2 of WithReshardTo(2), rank 5.
func (f *FSDP) groupNote() string {
	n := f.cfg.reshard
	base := f.rank / n * n
	along := ""
	if f.m.NDim() > 1 {
		along = fmt.Sprintf(" along axis %q", f.shardLabel())
	}
	if n > 8 {
		return fmt.Sprintf(" (its communicator's group rank i is rank %d+i%s)", base, along)
	}
	parts := make([]string, n)
	for i := range n {
		parts[i] = fmt.Sprintf("group rank %d is rank %d", i, base+i)
	}
	return fmt.Sprintf(" (on its communicator %s%s)", strings.Join(parts, ", "), along)
}
