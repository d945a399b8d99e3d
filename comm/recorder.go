package comm

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sync"
	"time"
)

// State is the life-cycle stage of a recorded operation.
type State uint8

// The states of a recorded operation.
const (
	Issued State = iota + 1
	Started
	Completed
	Failed
)

// String returns the state's name.
func (s State) String() string {
	switch s {
	case Issued:
		return "issued"
	case Started:
		return "started"
	case Completed:
		return "completed"
	case Failed:
		return "failed"
	}
	return "unknown"
}

// MarshalText implements encoding.TextMarshaler.
func (s State) MarshalText() ([]byte, error) { return []byte(s.String()), nil }

// UnmarshalText implements encoding.TextUnmarshaler, so that a Dump read back
// from JSON decodes.
func (s *State) UnmarshalText(b []byte) error {
	for _, v := range []State{Issued, Started, Completed, Failed} {
		if string(b) == v.String() {
			*s = v
			return nil
		}
	}
	return fmt.Errorf("comm: unknown state %q", b)
}

// Entry is one operation in a flight recorder.
type Entry struct {
	Seq       uint64    `json:"seq"`
	Op        string    `json:"op"`
	Label     string    `json:"label,omitempty"` // the caller's, see WithLabel
	DType     string    `json:"dtype,omitempty"`
	Bytes     int64     `json:"bytes"`
	Algorithm string    `json:"algorithm,omitempty"`
	Peer      int       `json:"peer"` // peer of Send/Recv, root of rooted ops, else -1
	Splits    []int     `json:"splits,omitempty"`
	Issued    time.Time `json:"issued"`
	Start     time.Time `json:"start,omitzero"`
	End       time.Time `json:"end,omitzero"`
	State     State     `json:"state"`
	Err       string    `json:"error,omitempty"`
}

// Recorder is a bounded ring of the most recent operations of one
// communicator on one rank: always on, cheap, and dumped when a call times
// out so that a hang can be diagnosed after the fact.
type Recorder struct {
	mu      sync.Mutex
	rank    int
	name    string
	entries []Entry
	total   uint64 // entries ever begun; entries[(total-1)%cap] is the newest
}

// NewRecorder returns a recorder keeping the last capacity entries for the
// named communicator as seen by rank.
func NewRecorder(name string, rank, capacity int) *Recorder {
	if capacity <= 0 {
		capacity = DefaultRecorderSize
	}
	return &Recorder{name: name, rank: rank, entries: make([]Entry, capacity)}
}

// labelKey is the context key of WithLabel.
type labelKey struct{}

// WithLabel returns a context whose calls are recorded, and reported in
// their errors, with label: what the caller does, in its own words
// ("fsdp unit blocks.1 all-gather"). A label given inside a labelled
// context is appended to the outer one after " / ". Every backend records
// the label of the context a call is issued with.
func WithLabel(ctx context.Context, label string) context.Context {
	if outer := LabelOf(ctx); outer != "" && label != "" {
		label = outer + " / " + label
	}
	return context.WithValue(ctx, labelKey{}, label)
}

// LabelOf returns the label WithLabel attached to ctx, or "".
func LabelOf(ctx context.Context) string {
	s, _ := ctx.Value(labelKey{}).(string)
	return s
}

// Begin records an issued operation and returns its id for Update.
func (r *Recorder) Begin(seq uint64, c *Call, algo Algorithm) uint64 {
	return r.BeginLabeled("", seq, c, algo)
}

// BeginLabeled is Begin for an operation the caller labelled (LabelOf
// its context).
func (r *Recorder) BeginLabeled(label string, seq uint64, c *Call, algo Algorithm) uint64 {
	var e Entry
	e.Seq, e.Op, e.Label, e.Algorithm, e.Peer, e.State = seq, c.Op.String(), label, "", -1, Issued
	if algo != Auto {
		e.Algorithm = algo.String()
	}
	b := c.Send
	if b == nil {
		b = c.Recv
	}
	if b != nil {
		e.DType = b.DType().String()
		e.Bytes = int64(c.Count()) * int64(b.DType().Size())
	}
	switch {
	case c.Op == OpSend || c.Op == OpRecv:
		e.Peer = c.Peer
	case c.Op.Rooted():
		e.Peer = c.Root
	case c.Op == OpAllToAllV:
		e.Splits = append([]int(nil), c.SendCounts...)
	}
	e.Issued = time.Now()
	r.mu.Lock()
	id := r.total
	r.entries[id%uint64(len(r.entries))] = e
	r.total++
	r.mu.Unlock()
	return id
}

// Update moves entry id to state s, stamping the time; err is recorded for
// Failed. Entries already overwritten are ignored.
func (r *Recorder) Update(id uint64, s State, err error) {
	now := time.Now()
	r.mu.Lock()
	defer r.mu.Unlock()
	if id+uint64(len(r.entries)) < r.total || id >= r.total {
		return
	}
	e := &r.entries[id%uint64(len(r.entries))]
	e.State = s
	switch s {
	case Started:
		e.Start = now
	case Completed, Failed:
		if e.Start.IsZero() {
			e.Start = now
		}
		e.End = now
	}
	if err != nil {
		e.Err = err.Error()
	}
}

// SetAlgorithm records the algorithm a backend chose for entry id.
func (r *Recorder) SetAlgorithm(id uint64, a Algorithm) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if id+uint64(len(r.entries)) < r.total || id >= r.total {
		return
	}
	r.entries[id%uint64(len(r.entries))].Algorithm = a.String()
}

// Find returns the newest retained entry with sequence number seq among
// the sends and receives (p2p true) or the other operations, which
// backends number apart; ok is false when it is not retained.
func (r *Recorder) Find(seq uint64, p2p bool) (e Entry, ok bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := min(r.total, uint64(len(r.entries)))
	for id := r.total; id > r.total-n; id-- {
		x := &r.entries[(id-1)%uint64(len(r.entries))]
		if x.Seq == seq && (x.Op == OpSend.String() || x.Op == OpRecv.String()) == p2p {
			return *x, true
		}
	}
	return Entry{}, false
}

// Entries returns a copy of the retained entries, oldest first.
func (r *Recorder) Entries() []Entry {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.entriesLocked()
}

func (r *Recorder) entriesLocked() []Entry {
	n := r.total
	if n > uint64(len(r.entries)) {
		n = uint64(len(r.entries))
	}
	out := make([]Entry, 0, n)
	for id := r.total - n; id < r.total; id++ {
		out = append(out, r.entries[id%uint64(len(r.entries))])
	}
	return out
}

// Dump is the serialisable form of a recorder.
type Dump struct {
	Communicator string  `json:"communicator"`
	Rank         int     `json:"rank"`
	Total        uint64  `json:"total"`
	Entries      []Entry `json:"entries"`
}

// Snapshot returns the recorder's contents as a Dump.
func (r *Recorder) Snapshot() Dump {
	r.mu.Lock()
	defer r.mu.Unlock()
	return Dump{Communicator: r.name, Rank: r.rank, Total: r.total, Entries: r.entriesLocked()}
}

// WriteText writes the retained entries as an aligned table, oldest first,
// the newest lines being those to read first after a hang.
func (r *Recorder) WriteText(w io.Writer) error {
	d := r.Snapshot()
	if _, err := fmt.Fprintf(w, "flight recorder: communicator %s, rank %d, %d operations (%d kept)\n",
		d.Communicator, d.Rank, d.Total, len(d.Entries)); err != nil {
		return err
	}
	for _, e := range d.Entries {
		dur := ""
		if !e.End.IsZero() {
			dur = e.End.Sub(e.Start).String()
		} else if !e.Start.IsZero() {
			dur = "running " + time.Since(e.Start).Round(time.Microsecond).String()
		}
		peer := ""
		if e.Peer >= 0 {
			peer = fmt.Sprintf("peer/root=%d", e.Peer)
		}
		if e.Splits != nil {
			peer = fmt.Sprintf("splits=%v", e.Splits)
		}
		label := ""
		if e.Label != "" {
			label = "[" + e.Label + "] "
		}
		if _, err := fmt.Fprintf(w, "  #%-6d %-13s %-8s %10dB %-18s %-9s %-14s %s %s%s\n",
			e.Seq, e.Op, e.DType, e.Bytes, e.Algorithm, e.State, dur, peer, label, e.Err); err != nil {
			return err
		}
	}
	return nil
}

// MarshalJSON implements json.Marshaler with the Dump form.
func (r *Recorder) MarshalJSON() ([]byte, error) { return json.Marshal(r.Snapshot()) }

// WriteFiles writes the dump as <dir>/<prefix>.txt and <dir>/<prefix>.json,
// each atomically (temporary file, then rename), and returns the paths.
func (r *Recorder) WriteFiles(dir, prefix string) ([]string, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("flight recorder dump: %w", err)
	}
	js, err := json.MarshalIndent(r.Snapshot(), "", "  ")
	if err != nil {
		return nil, fmt.Errorf("flight recorder dump: %w", err)
	}
	var txt bytesWriter
	if err := r.WriteText(&txt); err != nil {
		return nil, fmt.Errorf("flight recorder dump: %w", err)
	}
	var paths []string
	for _, f := range []struct {
		ext  string
		data []byte
	}{{".txt", txt}, {".json", js}} {
		p := filepath.Join(dir, prefix+f.ext)
		if err := writeAtomic(p, f.data); err != nil {
			return paths, fmt.Errorf("flight recorder dump: %w", err)
		}
		paths = append(paths, p)
	}
	return paths, nil
}

type bytesWriter []byte

func (b *bytesWriter) Write(p []byte) (int, error) { *b = append(*b, p...); return len(p), nil }

func writeAtomic(path string, data []byte) error {
	f, err := os.CreateTemp(filepath.Dir(path), filepath.Base(path)+".tmp*")
	if err != nil {
		return err
	}
	// fail abandons the temporary file: err is the failure, and closing and
	// removing the file are only tidying.
	fail := func(err error) error {
		_ = f.Close() // a second Close after a failed one only says so
		_ = os.Remove(f.Name())
		return err
	}
	if _, err := f.Write(data); err != nil {
		return fail(err)
	}
	if err := f.Chmod(0o644); err != nil { // CreateTemp makes files private
		return fail(err)
	}
	if err := f.Close(); err != nil {
		return fail(err)
	}
	return os.Rename(f.Name(), path)
}
