package trace

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"

	"github.com/b7ea7098/loom/comm"
)

// exported is the form in which Export encodes a timeline: its epoch on
// the wall clock, its groups and its events, the events' groups by index
// into Groups.
type exported struct {
	EpochUnixNano int64
	Groups        []exportedGroup
	Events        []exportedEvent
}

type exportedGroup struct {
	Key, Name string
	Size      int
	Members   [][3]int // key, pos, rank
}

type exportedEvent struct {
	Start, End, Issued int64
	Name, Cat          string
	Bytes              int64
	Seq                uint64
	Rank, Group, Peer  int32
	Lane               Lane
	Op                 comm.Op
	DType              comm.DType
	Flags              flags
}

// Export encodes tl's events and groups as JSON, for Import into the
// timeline of another process (the one that writes the job's trace). It
// first resolves the communication calls whose recorder entries are
// complete, as Events does; calls still running are left out.
func (tl *Timeline) Export() ([]byte, error) {
	if tl == nil {
		return nil, fmt.Errorf("trace: Export: %w: nil timeline", ErrInvalid)
	}
	tl.resolve(true)
	tl.mu.Lock()
	x := exported{EpochUnixNano: tl.epoch.UnixNano(), Events: make([]exportedEvent, len(tl.events))}
	for _, g := range tl.groups {
		eg := exportedGroup{Key: g.key, Name: g.name, Size: g.size}
		for _, m := range g.members {
			eg.Members = append(eg.Members, [3]int{m.key, m.pos, m.rank})
		}
		x.Groups = append(x.Groups, eg)
	}
	for i, e := range tl.events {
		x.Events[i] = exportedEvent{
			Start: e.start, End: e.end, Issued: e.issued, Name: e.name, Cat: e.cat, Bytes: e.bytes, Seq: e.seq,
			Rank: e.rank, Group: e.group, Peer: e.peer, Lane: e.lane, Op: e.op, DType: e.dtype, Flags: e.flags,
		}
	}
	tl.mu.Unlock()
	b, err := json.Marshal(x)
	if err != nil {
		return nil, fmt.Errorf("trace: Export: %w", err)
	}
	return b, nil
}

// Import adds to tl what Export encoded on another timeline: its events,
// their times moved from that timeline's epoch to tl's by the wall clock
// (exact on one host; across hosts as good as their clocks agree), and
// its groups' members, merged with tl's groups of the same key so that a
// group whose members were traced in different processes gets its full
// label ("[0,2]"). Events beyond tl's capacity are counted as dropped.
func (tl *Timeline) Import(b []byte) error {
	if tl == nil {
		return fmt.Errorf("trace: Import: %w: nil timeline", ErrInvalid)
	}
	var x exported
	if err := json.Unmarshal(b, &x); err != nil {
		return fmt.Errorf("trace: Import: %w: %w", ErrInvalid, err)
	}
	shift := x.EpochUnixNano - tl.epoch.UnixNano()
	ids := make([]int32, len(x.Groups))
	for i, g := range x.Groups {
		if g.Size < 1 {
			return fmt.Errorf("trace: Import: %w: group %q of size %d", ErrInvalid, g.Key, g.Size)
		}
		ids[i] = -1
		for _, m := range g.Members {
			ids[i] = tl.joinGroup(g.Key, g.Size, member{key: m[0], pos: m[1], rank: m[2]}, g.Name)
		}
	}
	tl.mu.Lock()
	defer tl.mu.Unlock()
	for _, e := range x.Events {
		group := int32(-1)
		if e.Group >= 0 && int(e.Group) < len(ids) {
			group = ids[e.Group]
		}
		if !e.Lane.Valid() {
			return fmt.Errorf("trace: Import: %w: event %q on lane %d", ErrInvalid, e.Name, e.Lane)
		}
		tl.addLocked(event{
			start: e.Start + shift, end: e.End + shift, issued: e.Issued + shift, name: e.Name, cat: e.Cat,
			bytes: e.Bytes, seq: e.Seq, rank: e.Rank, group: group, peer: e.Peer, lane: e.Lane, op: e.Op, dtype: e.DType, flags: e.Flags,
		})
	}
	return nil
}

// Gather merges every rank's timeline into root's: each rank Exports its
// timeline, the encodings travel over c (their lengths gathered on every
// rank, then the bytes, padded to the longest, gathered on root) and root
// Imports the others' into its own. It is collective over c; use it when
// each process of a job has its own Timeline (one rank per process), with
// an untraced communicator, so that the gathering is not part of the
// trace. A Timeline shared by in-process ranks needs no Gather.
func Gather(ctx context.Context, c comm.Communicator, tl *Timeline, root int) error {
	if c == nil || tl == nil {
		return fmt.Errorf("trace: Gather: %w: nil communicator or timeline", ErrInvalid)
	}
	b, err := tl.Export()
	if err != nil {
		return err
	}
	n := c.Size()
	lens := make([]int64, n)
	if err := comm.AllGather(ctx, c, comm.Host([]int64{int64(len(b))}), comm.Host(lens)); err != nil {
		return fmt.Errorf("trace: Gather: lengths: %w", err)
	}
	longest := max(1, int(slices.Max(lens))) // a collective of 0 elements is not every backend's
	send := make([]byte, longest)
	copy(send, b)
	var recv []byte
	if c.Rank() == root {
		recv = make([]byte, longest*n)
	}
	if err := comm.Gather(ctx, c, comm.Host(send), comm.Host(recv), root); err != nil {
		return fmt.Errorf("trace: Gather: timelines: %w", err)
	}
	if c.Rank() != root {
		return nil
	}
	for r := range n {
		if r == root {
			continue
		}
		if err := tl.Import(recv[r*longest : r*longest+int(lens[r])]); err != nil {
			return fmt.Errorf("trace: Gather: rank %d's timeline: %w", r, err)
		}
	}
	return nil
}
