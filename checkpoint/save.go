package checkpoint

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"hash/crc32"
	"hash/fnv"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/placement"
)

// castagnoli is CRC-32C's table: hardware-accelerated on amd64 and arm64
// (several GB/s per core), so checksumming costs little next to the write.
var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// tensorDesc is a tensor's layout, the same on every rank that holds it.
type tensorDesc struct {
	DType   string  `json:"dtype"`
	Shape   []int   `json:"shape"`
	SavedAs savedAs `json:"saved_as"`
}

// tensorMsg is what a rank says about one of its tensors: a hash of the
// layout (to check that the holders agree), its own block, and the layout
// itself from the tensor's mesh rank 0 only, so that a rank's message
// grows with its tensors, not with the mesh's size.
type tensorMsg struct {
	Hash   uint64          `json:"hash"`
	Box    []int           `json:"box"` // offset then size
	Layout json.RawMessage `json:"layout,omitempty"`
}

// tensorLayout is a tensor's layout and the block each holder holds.
type tensorLayout struct {
	tensorDesc
	holders []int   // world ranks, ascending
	boxes   [][]int // per holder: offset then size
}

// saveDesc is a rank's first message: its options, entries and tensors.
type saveDesc struct {
	Step    int                  `json:"step"`
	HasStep bool                 `json:"has_step"`
	Keep    int                  `json:"keep"`
	Block   int                  `json:"block"`
	Entries map[string]entry     `json:"entries"`
	Tensors map[string]tensorMsg `json:"tensors"`
}

// owned is a chunk assigned to a rank for writing.
type owned struct {
	name      string
	off, size []int
	bytes     int
	owner     int // world rank
}

// Save writes state as a new checkpoint under root and returns its folder.
// Every rank of the job calls it (the ranks of WithComm, or of the
// tensors' mesh's world), with the same options; the checkpoint holds
// the union of the ranks' entries (State.Entries).
//
// Each distinct block of a tensor is written once, by one of the ranks that
// hold it: replicas are spread over their holders to balance the bytes each
// rank writes (largest chunks first, each to its holder with the fewest
// bytes so far, ties to the lowest rank), so a data-parallel model is
// written by all its ranks at once rather than all by rank 0. Each rank
// writes its chunks into one safetensors file, rank-NNNNN.safetensors,
// copying a device tensor's block to the host one tensor at a time. Rank 0
// then writes manifest.json (every tensor's shape, dtype and chunks with
// their file, byte range and CRC-32C per block; the saver's mesh and
// placements for information).
//
// A checkpoint becomes visible only when complete: files are written under
// staging names in a staging folder, each fsynced and renamed, the
// manifest last, the folder fsynced and then renamed to step-NNNNNNNNNN,
// and root fsynced. A save killed at any point leaves the previous
// checkpoint as Latest and no folder that Latest or Load takes for a
// checkpoint; the next Save removes its remains. Rank 0 holds root's lock
// (an flock on root/.lock) for the save: a root being written by another
// job is refused with ErrLocked naming the holder.
//
// Partial and Routed tensors are refused (ErrInvalid): a Partial tensor's
// value exists on no rank, and reducing it here would hide a collective
// and its memory in a save; redistribute it first. Errors wrap ErrInvalid,
// ErrMismatch (ranks disagree), ErrLocked, or the file system's errors;
// every rank returns an error when any rank fails.
func Save(ctx context.Context, root string, state State, opts ...Option) (string, error) {
	const op = "Save"
	cfg, err := newConfig(op, forSave, opts)
	if err != nil {
		return "", err
	}
	return save(ctx, op, root, state, cfg)
}

// save is Save with its options applied.
func save(ctx context.Context, op, root string, state State, cfg *config) (string, error) {
	world, err := worldOf(op, cfg, tensorMeshes(state.Tensors))
	if err != nil {
		return "", err
	}
	fs := files{rank: world.Rank(), hook: cfg.hook}
	sv, err := prepare(ctx, op, root, cfg, state, world, world, fs)
	if err != nil {
		return "", err
	}
	defer sv.release()
	return sv.finish(ctx, op, world, fs, directSource(sv.plan, state.Tensors))
}

// saving is a save between its agreement (prepare) and its writes
// (finish): the layouts every rank agreed on, the step, this rank's file
// plan and, on rank 0, root's lock.
type saving struct {
	root    string
	desc    saveDesc // rank 0's options, every rank's entries
	layouts map[string]*tensorLayout
	step    int
	staging string
	plan    *filePlan // nil when this rank owns no chunk
	lk      *lock     // rank 0 only
	err     error     // planning failed: finish reports it to every rank
}

// release drops root's lock if this rank holds it.
func (sv *saving) release() {
	if sv.lk != nil {
		sv.lk.release()
		sv.lk = nil
	}
}

// prepare runs the first phases of a save on every rank: the ranks agree
// on every tensor's layout, rank 0 locks root, picks the step and makes
// the staging folder, and each rank plans its data file. Nothing of the
// tensors' data is read yet. The ranks talk on wire, world or a
// communicator split from it with the same ranks.
func prepare(ctx context.Context, op, root string, cfg *config, state State, world, wire comm.Communicator, fs files) (*saving, error) {
	rank := world.Rank()
	// 1. Every rank learns every tensor's layout and checks agreement.
	desc, err := describe(op, cfg, state, world)
	msg, _ := json.Marshal(desc) // plain data: Marshal cannot fail
	all, err := exchange(ctx, wire, op, msg, err)
	if err != nil {
		return nil, err
	}
	descs, layouts, err := merge(op, all)
	if err != nil {
		return nil, err // every rank finds the same disagreement
	}

	// 2. Rank 0 locks root, picks the step and makes the staging folder.
	sv := &saving{root: root, desc: descs[0], layouts: layouts}
	var stepMsg []byte
	var lerr error
	if rank == 0 {
		var step int
		sv.lk, step, lerr = begin(op, root, descs[0], fs)
		stepMsg = []byte(strconv.Itoa(step))
	}
	all, err = exchange(ctx, wire, op, stepMsg, lerr)
	if err != nil {
		sv.release()
		return nil, err
	}
	sv.step, _ = strconv.Atoi(string(all[0])) // rank 0 wrote a decimal
	sv.staging = filepath.Join(root, stagingPrefix+stepName(sv.step))

	// An error here reaches the other ranks in finish's first exchange.
	chunks, err := assign(op, layouts, world.Size())
	if err == nil {
		sv.plan, err = planRank(rank, chunks, state.Tensors)
	}
	sv.err = err
	return sv, nil
}

// finish runs the last phases of a save on every rank: each writes its
// chunks as src delivers them, then rank 0 writes the manifest and
// commits. It returns the checkpoint's folder.
func (sv *saving) finish(ctx context.Context, op string, world comm.Communicator, fs files, src chunkSource) (string, error) {
	// 3. Every rank writes the chunks it owns.
	rec, err := (*rankRecord)(nil), sv.err
	if err == nil {
		rec, err = writeRank(fs, sv.staging, sv.plan, sv.desc.Block, src)
	}
	msg, _ := json.Marshal(rec)
	all, err := exchange(ctx, world, op, msg, err)
	if err != nil {
		return "", err
	}

	// 4. Rank 0 writes the manifest and commits.
	final := filepath.Join(sv.root, stepName(sv.step))
	var cerr error
	if world.Rank() == 0 {
		cerr = commit(op, fs, sv.root, sv.staging, final, sv.step, world.Size(), sv.desc, sv.layouts, all)
	}
	if _, err := exchange(ctx, world, op, nil, cerr); err != nil {
		return "", err
	}
	return final, nil
}

// worldOf returns the communicator of the job: WithComm's, else the world
// of the tensors' meshes, which must be one.
func worldOf(op string, cfg *config, specs []*placement.Spec) (comm.Communicator, error) {
	if cfg.world != nil {
		return cfg.world, nil
	}
	if len(specs) == 0 {
		return nil, invalidf(op, "no tensors: give the job's communicator (WithComm)")
	}
	w := specs[0].Mesh().World()
	for _, s := range specs[1:] {
		if s.Mesh().World() != w {
			return nil, invalidf(op, "the tensors are on meshes of different worlds: give the job's communicator (WithComm)")
		}
	}
	return w, nil
}

// tensorMeshes returns the specs of the tensors, in name order.
func tensorMeshes(ts map[string]*placement.DTensor) []*placement.Spec {
	var out []*placement.Spec
	for _, name := range slices.Sorted(maps.Keys(ts)) {
		if t := ts[name]; t != nil {
			out = append(out, t.Spec())
		}
	}
	return out
}

// describe builds this rank's description of its state.
func describe(op string, cfg *config, state State, world comm.Communicator) (saveDesc, error) {
	d := saveDesc{Step: cfg.step, HasStep: cfg.hasStep, Keep: cfg.keep, Block: cfg.block,
		Entries: map[string]entry{}, Tensors: map[string]tensorMsg{}}
	for _, name := range slices.Sorted(maps.Keys(state.Entries)) {
		e, err := encodeEntry(state.Entries[name])
		if err != nil {
			return d, invalidf(op, "entry %q: %v", name, err)
		}
		d.Entries[name] = e
	}
	for _, name := range slices.Sorted(maps.Keys(state.Tensors)) {
		t := state.Tensors[name]
		if err := checkName(name); err != nil {
			return d, invalidf(op, "tensor %q: %v", name, err)
		}
		if t == nil {
			return d, invalidf(op, "tensor %q is nil", name)
		}
		s := t.Spec()
		if s.Mesh().World() != world {
			return d, invalidf(op, "tensor %q is on a mesh of another world than the job's communicator", name)
		}
		td := tensorDesc{DType: dtypeName(s.DType()), Shape: s.Shape(), SavedAs: savedAsOf(s)}
		for _, p := range s.Placements() {
			if p.IsPartial() || p.IsRouted() {
				return d, invalidf(op, "tensor %q is %v on mesh %v: a checkpoint holds values, so redistribute a Partial tensor first (a Routed one lives only inside an MoE layer's step)", name, s.Placements(), s.Mesh())
			}
		}
		off, size, err := s.Box(s.Mesh().Rank())
		if err != nil {
			return d, wrapf(op, err, "tensor %q", name)
		}
		raw, _ := json.Marshal(td) // plain data: Marshal cannot fail
		h := fnv.New64a()
		h.Write(raw) // a hash.Hash's Write never fails
		msg := tensorMsg{Hash: h.Sum64(), Box: append(off, size...)}
		if s.Mesh().Rank() == 0 {
			msg.Layout = raw
		}
		d.Tensors[name] = msg
	}
	return d, nil
}

// checkName refuses names the files could not hold.
func checkName(name string) error {
	if name == "" {
		return fmt.Errorf("empty name")
	}
	if strings.ContainsRune(name, '@') {
		return fmt.Errorf("'@' is reserved for chunk names")
	}
	return nil
}

func dtypeName(dt comm.DType) string {
	if dt == comm.Float64 {
		return "F64"
	}
	return "F32" // a Spec is float32 or float64
}

func savedAsOf(s *placement.Spec) savedAs {
	m := s.Mesh()
	sa := savedAs{MeshAxes: m.Names(), MeshShape: m.Shape(), MeshRanks: m.WorldRanks()}
	for _, p := range s.Placements() {
		sa.Placements = append(sa.Placements, p.String())
	}
	for d := range s.Shape() {
		sa.Order = append(sa.Order, s.Order(d))
	}
	return sa
}

// merge parses every rank's description, checks that the ranks agree and
// returns the descriptions, rank 0's holding the union of every rank's
// entries, and every tensor's layout by name.
func merge(op string, all [][]byte) ([]saveDesc, map[string]*tensorLayout, error) {
	descs := make([]saveDesc, len(all))
	for r, b := range all {
		if err := json.Unmarshal(b, &descs[r]); err != nil {
			return nil, nil, wrapf(op, err, "rank %d's description", r)
		}
	}
	d0 := descs[0]
	for r, d := range descs[1:] {
		if d.Step != d0.Step || d.HasStep != d0.HasStep || d.Keep != d0.Keep || d.Block != d0.Block {
			return nil, nil, mismatchf(op, "rank %d's options (step %d given %v, keep %d, block %d) differ from rank 0's (step %d given %v, keep %d, block %d)",
				r+1, d.Step, d.HasStep, d.Keep, d.Block, d0.Step, d0.HasStep, d0.Keep, d0.Block)
		}
	}
	// Entries are the union of the ranks': a pipeline's stages each give
	// their own parameters' step counts. An entry that several ranks give
	// must be the same on each.
	union, from := map[string]entry{}, map[string]int{}
	for r, d := range descs {
		for _, n := range slices.Sorted(maps.Keys(d.Entries)) {
			e := d.Entries[n]
			if prev, ok := union[n]; ok {
				a, _ := json.Marshal(prev) // plain data: Marshal cannot fail
				b, _ := json.Marshal(e)
				if !bytes.Equal(a, b) {
					return nil, nil, mismatchf(op, "entry %q: rank %d's value differs from rank %d's", n, r, from[n])
				}
				continue
			}
			union[n], from[n] = e, r
		}
	}
	descs[0].Entries = union
	layouts := map[string]*tensorLayout{}
	hashes := map[string]uint64{}
	for r, d := range descs {
		for name, msg := range d.Tensors {
			l, ok := layouts[name]
			if !ok {
				l = &tensorLayout{}
				layouts[name] = l
				hashes[name] = msg.Hash
			} else if msg.Hash != hashes[name] {
				return nil, nil, mismatchf(op, "tensor %q: rank %d's layout differs from rank %d's", name, r, l.holders[0])
			}
			l.holders = append(l.holders, r)
			l.boxes = append(l.boxes, msg.Box)
			if msg.Layout != nil {
				if err := json.Unmarshal(msg.Layout, &l.tensorDesc); err != nil {
					return nil, nil, wrapf(op, err, "tensor %q's layout from rank %d", name, r)
				}
			}
		}
	}
	for _, name := range slices.Sorted(maps.Keys(layouts)) {
		l := layouts[name]
		if !slices.Equal(slices.Sorted(slices.Values(l.SavedAs.MeshRanks)), l.holders) {
			// Also when mesh rank 0 did not pass it: no layout arrived.
			for _, r := range l.SavedAs.MeshRanks {
				if !slices.Contains(l.holders, r) {
					return nil, nil, mismatchf(op, "tensor %q is on world ranks %v, but rank %d did not pass it", name, l.SavedAs.MeshRanks, r)
				}
			}
			return nil, nil, mismatchf(op, "tensor %q is passed by world ranks %v, but its mesh's rank 0 is not among them, or others are", name, l.holders)
		}
	}
	return descs, layouts, nil
}

// assign lists the distinct non-empty blocks of every tensor and gives
// each to one of its holders: largest first, to the holder with the fewest
// bytes so far (ties: the lowest world rank). Every rank computes the same.
func assign(op string, layouts map[string]*tensorLayout, worldSize int) ([]owned, error) {
	type cand struct {
		owned
		holders []int
	}
	var cands []cand
	for _, name := range slices.Sorted(maps.Keys(layouts)) {
		td := layouts[name]
		nd := len(td.Shape)
		byBox := map[string]int{}
		for hi, box := range td.boxes {
			off, size := box[:nd], box[nd:]
			if prod(size) == 0 {
				continue
			}
			key := fmt.Sprint(box)
			i, ok := byBox[key]
			if !ok {
				i = len(cands)
				byBox[key] = i
				cands = append(cands, cand{owned: owned{name: name, off: off, size: size, bytes: prod(size) * dtypeSize(td.DType)}})
			}
			cands[i].holders = append(cands[i].holders, td.holders[hi])
		}
	}
	slices.SortStableFunc(cands, func(a, b cand) int { return b.bytes - a.bytes })
	load := make([]int, worldSize)
	out := make([]owned, len(cands))
	for i, c := range cands {
		best := -1
		for _, h := range c.holders {
			if h < 0 || h >= worldSize {
				return nil, invalidf(op, "tensor %q is held by world rank %d of a world of %d", c.name, h, worldSize)
			}
			if best < 0 || load[h] < load[best] || load[h] == load[best] && h < best {
				best = h
			}
		}
		load[best] += c.bytes
		c.owner = best
		out[i] = c.owned
	}
	return out, nil
}

// begin runs rank 0's start of a save: it takes root's lock, removes what
// killed saves left, picks the step and creates the staging folder.
func begin(op, root string, d saveDesc, fs files) (*lock, int, error) {
	if err := os.MkdirAll(root, 0o755); err != nil {
		return nil, 0, wrapf(op, err, "creating %s", root)
	}
	step := d.Step
	lk, err := acquire(op, root, step)
	if err != nil {
		return nil, 0, err
	}
	ents, err := os.ReadDir(root)
	if err != nil {
		return lk, 0, wrapf(op, err, "listing %s", root)
	}
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), stagingPrefix) || strings.HasPrefix(e.Name(), trashPrefix) {
			// Under the lock nobody else writes here: these are the
			// remains of a killed save or prune.
			if err := fs.removeAll(filepath.Join(root, e.Name())); err != nil {
				return lk, 0, wrapf(op, err, "removing the remains of an interrupted save")
			}
		}
	}
	steps, err := committed(root)
	if err != nil {
		return lk, 0, wrapf(op, err, "listing %s", root)
	}
	if !d.HasStep {
		step = 0
		if len(steps) > 0 {
			step = steps[len(steps)-1] + 1
		}
	}
	if _, err := os.Lstat(filepath.Join(root, stepName(step))); err == nil {
		return lk, 0, invalidf(op, "%s already exists: a checkpoint is never overwritten", filepath.Join(root, stepName(step)))
	}
	if err := fs.mkdir(filepath.Join(root, stagingPrefix+stepName(step))); err != nil {
		return lk, 0, wrapf(op, err, "creating the staging folder")
	}
	return lk, step, nil
}

// rankRecord is what a rank wrote: its file and chunks.
type rankRecord struct {
	File   *fileRecord  `json:"file,omitempty"`
	Chunks []namedChunk `json:"chunks"`
}

type namedChunk struct {
	Name string `json:"name"`
	chunk
}

// fileName is a rank's data file.
func fileName(rank int) string { return fmt.Sprintf("rank-%05d.safetensors", rank) }

// chunkKey names a chunk inside its file: the tensor's name when the
// chunk is the whole tensor, else the name and the chunk's offset.
func chunkKey(name string, off, size []int, shape []int) string {
	if slices.Equal(size, shape) {
		return name
	}
	s := make([]string, len(off))
	for i, o := range off {
		s[i] = strconv.Itoa(o)
	}
	return name + "@" + strings.Join(s, ",")
}

// filePlan is a rank's data file laid out before any byte is written:
// its chunks in file (key) order, the header, and each chunk's place.
type filePlan struct {
	name  string
	head  []byte // length, JSON header, padding
	items []planned
}

// planned is one chunk of a filePlan: its bytes start at begin.
type planned struct {
	owned
	key   string
	dtype string
	begin int64
}

// planRank lays out this rank's data file: the chunks it owns, in key
// order, back to back after a safetensors header. It returns nil when the
// rank owns no chunk.
func planRank(rank int, all []owned, tensors map[string]*placement.DTensor) (*filePlan, error) {
	p := &filePlan{name: fileName(rank)}
	for _, c := range all {
		if c.owner == rank {
			t := tensors[c.name]
			p.items = append(p.items, planned{owned: c, key: chunkKey(c.name, c.off, c.size, t.Spec().Shape()), dtype: dtypeName(t.Spec().DType())})
		}
	}
	if len(p.items) == 0 {
		return nil, nil
	}
	slices.SortFunc(p.items, func(a, b planned) int { return strings.Compare(a.key, b.key) })
	hdr := map[string]any{"__metadata__": map[string]string{"format": format}}
	var off int64
	for i := range p.items {
		c := &p.items[i]
		if _, dup := hdr[c.key]; dup {
			return nil, invalidf("Save", "two chunks are named %q in %s", c.key, p.name)
		}
		hdr[c.key] = map[string]any{"dtype": c.dtype, "shape": c.size, "data_offsets": []int64{off, off + int64(c.bytes)}}
		c.begin = off
		off += int64(c.bytes)
	}
	h, _ := json.Marshal(hdr) // plain data: Marshal cannot fail
	for len(h)%8 != 0 {
		h = append(h, ' ')
	}
	p.head = make([]byte, 8, 8+len(h))
	for i := range 8 {
		p.head[i] = byte(uint64(len(h)) >> (8 * i))
	}
	p.head = append(p.head, h...)
	for i := range p.items {
		p.items[i].begin += int64(len(p.head))
	}
	return p, nil
}

// writebackBytes is how many bytes written into a data file accumulate
// before the save starts their writeback (startWriteback): the disk then
// writes while the next chunks are copied and checksummed, instead of all
// at the fsync.
const writebackBytes = 4 << 20

// chunkSource delivers chunk i's bytes of a filePlan to emit, in order,
// in one or more pieces that together hold exactly its bytes.
type chunkSource func(i int, emit func([]byte) error) error

// writeRank writes this rank's chunks into its data file in the staging
// folder (plan from planRank; nil writes nothing): the header, then each
// chunk's bytes as src delivers them, checksummed on the way; then fsync
// and rename from the staging name.
func writeRank(fs files, staging string, p *filePlan, block int, src chunkSource) (*rankRecord, error) {
	rec := &rankRecord{}
	if p == nil {
		return rec, nil
	}
	tmp := filepath.Join(staging, p.name+".tmp")
	w, err := fs.create(tmp)
	if err != nil {
		return nil, wrapf("Save", err, "creating %s", tmp)
	}
	defer w.Close() // on error paths; the success path closes it first
	if err := fs.write(w, 0, p.head); err != nil {
		return nil, wrapf("Save", err, "writing %s", tmp)
	}
	end := int64(len(p.head))
	started := int64(0) // the bytes whose writeback has been started
	for i, c := range p.items {
		var sums []uint32
		var crc uint32
		inBlock, got := 0, 0
		err := src(i, func(data []byte) error {
			if got+len(data) > c.bytes {
				return invalidf("Save", "tensor %q: local block of more than the %d bytes its box %v holds", c.name, c.bytes, c.size)
			}
			if err := fs.write(w, c.begin+int64(got), data); err != nil {
				return wrapf("Save", err, "writing %s", tmp)
			}
			got += len(data)
			if written := c.begin + int64(got); written-started >= writebackBytes {
				fs.writeback(w, started, written-started)
				started = written
			}
			for len(data) > 0 {
				n := min(block-inBlock, len(data))
				crc = crc32.Update(crc, castagnoli, data[:n])
				data, inBlock = data[n:], inBlock+n
				if inBlock == block {
					sums, crc, inBlock = append(sums, crc), 0, 0
				}
			}
			return nil
		})
		if err != nil {
			return nil, err
		}
		if got != c.bytes {
			return nil, invalidf("Save", "tensor %q: local block of %d bytes, its box %v holds %d", c.name, got, c.size, c.bytes)
		}
		if inBlock > 0 {
			sums = append(sums, crc)
		}
		rec.Chunks = append(rec.Chunks, namedChunk{Name: c.name, chunk: chunk{Offset: c.off, Size: c.size, File: p.name, Key: c.key,
			Begin: c.begin, End: c.begin + int64(c.bytes), CRC32C: sums}})
		end = c.begin + int64(c.bytes)
	}
	if err := fs.fsync(w); err != nil {
		return nil, wrapf("Save", err, "syncing %s", tmp)
	}
	if err := w.Close(); err != nil {
		return nil, wrapf("Save", err, "closing %s", tmp)
	}
	if err := fs.rename(tmp, filepath.Join(staging, p.name)); err != nil {
		return nil, wrapf("Save", err, "renaming %s", tmp)
	}
	rec.File = &fileRecord{Name: p.name, Rank: fs.rank, Bytes: end}
	return rec, nil
}

// directSource delivers each chunk of p as its tensor's host bytes: a
// view of a host block, a copy of a device block made when it is written.
func directSource(p *filePlan, tensors map[string]*placement.DTensor) chunkSource {
	return func(i int, emit func([]byte) error) error {
		c := p.items[i]
		data, err := hostBytes(tensors[c.name])
		if err != nil {
			return wrapf("Save", err, "copying tensor %q to the host", c.name)
		}
		return emit(data)
	}
}

// hostBytes returns the tensor's local block as little-endian bytes in
// host memory: a view of a host block, a copy of a device block.
func hostBytes(t *placement.DTensor) ([]byte, error) {
	h, err := t.To(device.Host())
	if err != nil {
		return nil, err
	}
	switch d := h.LocalData().(type) {
	case []float32:
		return comm.Host(d).Bytes(), nil
	case []float64:
		return comm.Host(d).Bytes(), nil
	}
	return nil, fmt.Errorf("local block of type %T", h.LocalData())
}

// commit is rank 0's end of a save: the manifest from every rank's
// record, written last into the staging folder; the folder synced and
// renamed into place; root synced; older checkpoints pruned.
func commit(op string, fs files, root, staging, final string, step, worldSize int, d saveDesc, layouts map[string]*tensorLayout, recs [][]byte) error {
	m := &manifest{Format: format, Step: step, WorldSize: worldSize, Checksum: "crc32c", Block: d.Block,
		Files: []fileRecord{}, Tensors: map[string]*tensor{}, Entries: d.Entries}
	for name, td := range layouts {
		m.Tensors[name] = &tensor{DType: td.DType, Shape: td.Shape, SavedAs: td.SavedAs, Chunks: []chunk{}}
	}
	for r, raw := range recs {
		var rec rankRecord
		if err := json.Unmarshal(raw, &rec); err != nil {
			return wrapf(op, err, "rank %d's record", r)
		}
		if rec.File != nil {
			m.Files = append(m.Files, *rec.File)
		}
		for _, c := range rec.Chunks {
			m.Tensors[c.Name].Chunks = append(m.Tensors[c.Name].Chunks, c.chunk)
		}
	}
	for _, t := range m.Tensors {
		slices.SortFunc(t.Chunks, func(a, b chunk) int { return slices.Compare(a.Offset, b.Offset) })
	}
	if err := m.check(); err != nil {
		return wrapf(op, err, "the manifest built from the ranks' records")
	}
	data, err := encodeManifest(m)
	if err != nil {
		return wrapf(op, err, "encoding the manifest")
	}
	if err := fs.writeFile(filepath.Join(staging, manifestName), data); err != nil {
		return wrapf(op, err, "writing the manifest")
	}
	if err := fs.fsyncDir(staging); err != nil {
		return wrapf(op, err, "syncing %s", staging)
	}
	if err := fs.rename(staging, final); err != nil {
		return wrapf(op, err, "renaming %s to %s", staging, final)
	}
	if err := fs.fsyncDir(root); err != nil {
		return wrapf(op, err, "syncing %s", root)
	}
	if d.Keep > 0 {
		if err := prune(fs, root, d.Keep); err != nil {
			return fmt.Errorf("checkpoint: %s: %s is complete, but removing older checkpoints failed: %w", op, final, err)
		}
	}
	return nil
}

// prune keeps the newest keep checkpoints of root. Each older one is first
// renamed to a trash name (one atomic step, after which it is no
// checkpoint), then removed.
func prune(fs files, root string, keep int) error {
	steps, err := committed(root)
	if err != nil {
		return err
	}
	var errs []error
	for _, s := range steps[:max(0, len(steps)-keep)] {
		trash := filepath.Join(root, trashPrefix+stepName(s))
		if err := fs.rename(filepath.Join(root, stepName(s)), trash); err != nil {
			errs = append(errs, err)
			continue
		}
		if err := fs.fsyncDir(root); err != nil {
			errs = append(errs, err)
		}
		if err := fs.removeAll(trash); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}
