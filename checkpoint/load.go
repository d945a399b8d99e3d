package checkpoint

import (
	"context"
	"encoding/json"
	"fmt"
	"hash/crc32"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/placement"
)

// Load reads the checkpoint in dir (a folder Save returned, or Latest's
// answer) into tensors laid out by targets, which may differ from the
// saver's in mesh, world size, placements and device: loading is a
// redistribute whose source is the storage layout. Every rank of the job
// calls it; each rank passes the specs of the tensors it holds (every
// tensor of the checkpoint must be some rank's target), reads only the
// byte ranges its own blocks need (rounded out to the checksum blocks
// around them, which it verifies), and never holds more of a tensor than
// its block. WithDevice puts the blocks on a device.
//
// Nothing is built until every rank's checks have passed: a missing or
// extra tensor, another shape or dtype, or a Partial or Routed target is
// refused with ErrInvalid naming the tensor; a manifest that does not
// parse or fails its checksum, a truncated data file, or a chunk whose
// checksum fails (naming the file and the tensor) with ErrCorrupt. Every
// rank returns an error when any rank fails. The returned State holds the
// loaded tensors and all the checkpoint's entries.
func Load(ctx context.Context, dir string, targets map[string]*placement.Spec, opts ...Option) (*State, error) {
	const op = "Load"
	cfg, err := newConfig(op, forLoad, opts)
	if err != nil {
		return nil, err
	}
	got, err := load(ctx, op, dir, targets, cfg)
	if err != nil {
		return nil, err
	}
	return &got.State, nil
}

// LoadInto loads the checkpoint in dir into state's tensors in place, as
// Load would with their specs, and sets state.Entries to the checkpoint's
// entries: the tensors keep their memory and device (a model's parameters
// that an optimizer already holds). Every rank calls it with its tensors.
// Nothing is written into them until every rank has read and verified its
// blocks; errors are Load's. WithComm is its only option.
func LoadInto(ctx context.Context, dir string, state *State, opts ...Option) error {
	const op = "LoadInto"
	cfg, err := newConfig(op, forFill, opts)
	if err != nil {
		return err
	}
	if state == nil {
		return invalidf(op, "nil state")
	}
	targets := make(map[string]*placement.Spec, len(state.Tensors))
	for n, t := range state.Tensors {
		if t == nil {
			return invalidf(op, "tensor %q is nil", n)
		}
		targets[n] = t.Spec()
	}
	return fill(ctx, op, dir, state, targets, cfg, nil)
}

// fill loads dir into state's tensors in place (LoadInto), after check
// has passed the loaded entries on every rank (nil: no check).
func fill(ctx context.Context, op, dir string, state *State, targets map[string]*placement.Spec, cfg *config, check func(map[string]any) error) error {
	got, err := load(ctx, op, dir, targets, cfg)
	if err != nil {
		return err
	}
	if check != nil {
		if _, err := exchange(ctx, got.world, op, nil, check(got.Entries)); err != nil {
			return err
		}
	}
	for _, n := range slices.Sorted(maps.Keys(state.Tensors)) {
		t, src := state.Tensors[n], got.Tensors[n]
		switch d := t.LocalData().(type) {
		case []float32:
			copy(d, src.LocalData().([]float32))
		case []float64:
			copy(d, src.LocalData().([]float64))
		case device.Buffer:
			err = t.Device().CopyFromHost(d, src.LocalBuffer().(*comm.HostBuffer))
		default:
			err = fmt.Errorf("local block of type %T", d)
		}
		if err != nil {
			err = wrapf(op, err, "tensor %q", n)
			break
		}
	}
	if _, err := exchange(ctx, got.world, op, nil, err); err != nil {
		return err
	}
	state.Entries = got.Entries
	return nil
}

// load is Load with its options applied.
func load(ctx context.Context, op, dir string, targets map[string]*placement.Spec, cfg *config) (*loaded, error) {
	names := slices.Sorted(maps.Keys(targets))
	specs := make([]*placement.Spec, 0, len(names))
	for _, n := range names {
		if targets[n] == nil {
			return nil, invalidf(op, "target %q has a nil spec", n)
		}
		specs = append(specs, targets[n])
	}
	world, err := worldOf(op, cfg, specs)
	if err != nil {
		return nil, err
	}
	fs := files{rank: world.Rank(), hook: cfg.hook}

	// 1. The manifest, and the targets against it.
	m, err := readManifest(op, dir)
	if err == nil {
		err = checkTargets(op, m, targets, names, world, true)
	}
	msg, _ := json.Marshal(names) // a list of strings: Marshal cannot fail
	all, err := exchange(ctx, world, op, msg, err)
	if err != nil {
		return nil, err
	}
	wanted := map[string]bool{}
	for _, b := range all {
		var ns []string
		if err := json.Unmarshal(b, &ns); err != nil {
			return nil, wrapf(op, err, "a rank's target names")
		}
		for _, n := range ns {
			wanted[n] = true
		}
	}
	var extra []string
	for _, n := range slices.Sorted(maps.Keys(m.Tensors)) {
		if !wanted[n] {
			extra = append(extra, fmt.Sprintf("%q", n))
		}
	}
	if len(extra) > 0 {
		return nil, invalidf(op, "%s holds tensor(s) %s that no rank loads: a checkpoint of another model?", dir, strings.Join(extra, ", "))
	}

	// 2. Read this rank's blocks, verifying every block of bytes read.
	data, err := readBlocks(op, fs, dir, m, targets, names)
	if _, err := exchange(ctx, world, op, nil, err); err != nil {
		return nil, err
	}

	// 3. Wrap them, on the device asked for.
	out := &loaded{State: State{Tensors: map[string]*placement.DTensor{}, Entries: map[string]any{}}, world: world}
	err = nil
	for i, n := range names {
		t, terr := placement.NewLocal(targets[n], data[i])
		if terr == nil && cfg.dev != nil && cfg.dev.Kind() != device.KindHost {
			t, terr = t.To(cfg.dev)
		}
		if terr != nil {
			err = wrapf(op, terr, "tensor %q", n)
			break
		}
		out.Tensors[n] = t
	}
	if _, err := exchange(ctx, world, op, nil, err); err != nil {
		return nil, err
	}
	for n, e := range m.Entries {
		out.Entries[n], _ = e.decode() // check decoded them all
	}
	return out, nil
}

// loaded is what load built, with the job's communicator.
type loaded struct {
	State
	world comm.Communicator
}

// readManifest reads and checks dir's manifest.
func readManifest(op, dir string) (*manifest, error) {
	if b := filepath.Base(dir); strings.HasPrefix(b, stagingPrefix) || strings.HasPrefix(b, trashPrefix) {
		return nil, fmt.Errorf("checkpoint: %s: %w: %s is a save that did not finish or a checkpoint being deleted", op, ErrNotFound, dir)
	}
	path := filepath.Join(dir, manifestName)
	b, err := os.ReadFile(path)
	if err != nil {
		if os.IsNotExist(err) {
			return nil, fmt.Errorf("checkpoint: %s: %w: %s has no manifest: not a complete checkpoint", op, ErrNotFound, dir)
		}
		return nil, wrapf(op, err, "reading the manifest")
	}
	return decodeManifest(op, path, b)
}

// checkTargets refuses targets the checkpoint cannot fill; with fused, a
// target may be the other form of a fused tensor (fusedSplit).
func checkTargets(op string, m *manifest, targets map[string]*placement.Spec, names []string, world comm.Communicator, fused bool) error {
	for _, n := range names {
		s := targets[n]
		t, ok := m.Tensors[n]
		if !ok {
			return invalidf(op, "the checkpoint has no tensor %q (it has %d tensors): a checkpoint of another model?", n, len(m.Tensors))
		}
		if !slices.Equal(t.Shape, s.Shape()) && (!fused || fusedSplit(t.Shape, s.Shape()) == nil) {
			return invalidf(op, "tensor %q: the checkpoint's shape is %v, the target's %v", n, t.Shape, s.Shape())
		}
		if dt := dtypeName(s.DType()); dt != t.DType {
			return invalidf(op, "tensor %q: the checkpoint's dtype is %s, the target's %s", n, t.DType, dt)
		}
		for _, p := range s.Placements() {
			if p.IsPartial() || p.IsRouted() {
				return invalidf(op, "tensor %q: target placements %v: a checkpoint loads into Replicate and Shard placements", n, s.Placements())
			}
		}
		if s.Mesh().World() != world {
			return invalidf(op, "tensor %q's target is on a mesh of another world than the job's communicator", n)
		}
	}
	return nil
}

// run is a contiguous piece of a chunk that a destination block needs:
// n bytes from chunk byte src to destination byte dst.
type run struct{ src, dst, n int }

// runs lists the contiguous byte runs that copy the intersection of a
// chunk (offset co, size cs) and a destination block (do, ds), in source
// order; es is the element size.
func runs(co, cs, do, ds []int, es int) []run {
	nd := len(co)
	lo, hi := make([]int, nd), make([]int, nd)
	for d := range nd {
		lo[d], hi[d] = max(co[d], do[d]), min(co[d]+cs[d], do[d]+ds[d])
		if hi[d] <= lo[d] {
			return nil
		}
	}
	// Row-major strides in elements.
	cst, dst := make([]int, nd), make([]int, nd)
	for d, cs1, ds1 := nd-1, 1, 1; d >= 0; d-- {
		cst[d], dst[d] = cs1, ds1
		cs1 *= cs[d]
		ds1 *= ds[d]
	}
	// The trailing dims that both blocks hold whole join into one run.
	k := nd - 1
	for k > 0 && lo[k] == co[k] && hi[k] == co[k]+cs[k] && lo[k] == do[k] && hi[k] == do[k]+ds[k] {
		k--
	}
	n := es
	for d := max(k, 0); d < nd; d++ {
		n *= hi[d] - lo[d]
	}
	if nd == 0 {
		return []run{{0, 0, es}}
	}
	var out []run
	idx := slices.Clone(lo[:k])
	for {
		s, t := 0, 0
		for d := range nd {
			i := lo[d]
			if d < k {
				i = idx[d]
			}
			s += (i - co[d]) * cst[d]
			t += (i - do[d]) * dst[d]
		}
		out = append(out, run{s * es, t * es, n})
		// Next index over the outer dims < k.
		d := k - 1
		for ; d >= 0; d-- {
			idx[d]++
			if idx[d] < hi[d] {
				break
			}
			idx[d] = lo[d]
		}
		if d < 0 {
			return out
		}
	}
}

// maxSpanBlocks bounds how many checksum blocks one read takes, so that a
// large chunk is read in pieces of bounded memory.
const maxSpanBlocks = 64

// readBlocks reads this rank's block of every target from the data files:
// for each chunk that meets the block, the checksum blocks its runs touch,
// each verified before its bytes are copied. It returns the host blocks in
// names' order.
func readBlocks(op string, fs files, dir string, m *manifest, targets map[string]*placement.Spec, names []string) ([]any, error) {
	sizes := map[string]int64{}
	for _, f := range m.Files {
		sizes[f.Name] = f.Bytes
	}
	open := map[string]*os.File{}
	defer func() {
		for _, f := range open {
			_ = f.Close() // read only: closing loses nothing
		}
	}()
	file := func(name string) (*os.File, error) {
		if f, ok := open[name]; ok {
			return f, nil
		}
		path := filepath.Join(dir, name)
		f, err := os.Open(path)
		if err != nil {
			return nil, wrapf(op, err, "opening %s", path)
		}
		st, err := f.Stat()
		if err != nil {
			_ = f.Close()
			return nil, wrapf(op, err, "%s", path)
		}
		if st.Size() != sizes[name] {
			_ = f.Close()
			return nil, corruptf(op, "%s has %d bytes, the manifest says %d: truncated or replaced", path, st.Size(), sizes[name])
		}
		open[name] = f
		return f, nil
	}
	out := make([]any, len(names))
	for i, n := range names {
		s := targets[n]
		t := m.Tensors[n]
		es := dtypeSize(t.DType)
		do, ds, err := s.Box(s.Mesh().Rank())
		if err != nil {
			return nil, wrapf(op, err, "tensor %q", n)
		}
		var dstBytes []byte
		if s.DType() == comm.Float64 {
			v := make([]float64, prod(ds))
			out[i], dstBytes = v, comm.Host(v).Bytes()
		} else {
			v := make([]float32, prod(ds))
			out[i], dstBytes = v, comm.Host(v).Bytes()
		}
		if len(dstBytes) == 0 {
			continue
		}
		fine := fusedSplit(t.Shape, s.Shape())
		for _, c := range t.Chunks {
			var rs []run
			if fine == nil {
				rs = runs(c.Offset, c.Size, do, ds, es)
			} else {
				rs = fusedRuns(fine, len(t.Shape) < len(fine), len(ds) < len(fine), c.Offset, c.Size, do, ds, es)
			}
			if len(rs) == 0 {
				continue
			}
			f, err := file(c.File)
			if err != nil {
				return nil, err
			}
			if err := readChunk(op, fs, f, dir, n, c, m.Block, rs, dstBytes); err != nil {
				return nil, err
			}
		}
	}
	return out, nil
}

// readChunk reads the checksum blocks of chunk c that runs touch, in spans
// of consecutive blocks, verifies them and copies the runs into dst.
func readChunk(op string, fs files, f *os.File, dir, name string, c chunk, block int, rs []run, dst []byte) error {
	size := int(c.End - c.Begin)
	var touched []int
	for _, r := range rs {
		for b := r.src / block; b <= (r.src+r.n-1)/block; b++ {
			if len(touched) == 0 || touched[len(touched)-1] < b {
				touched = append(touched, b) // runs come in source order
			}
		}
	}
	var buf []byte
	for i := 0; i < len(touched); {
		j := i + 1
		for j < len(touched) && touched[j] == touched[j-1]+1 && j-i < maxSpanBlocks {
			j++
		}
		lo, hi := touched[i]*block, min(touched[j-1]*block+block, size)
		buf = slices.Grow(buf[:0], hi-lo)[:hi-lo]
		if err := fs.read(f, c.Begin+int64(lo), buf); err != nil {
			return wrapf(op, err, "reading tensor %q from %s", name, filepath.Join(dir, c.File))
		}
		for b := touched[i]; b <= touched[j-1] && c.CRC32C != nil; b++ { // an imported file has no checksums
			p := buf[b*block-lo : min(b*block+block, size)-lo]
			if crc32.Checksum(p, castagnoli) != c.CRC32C[b] {
				return corruptf(op, "%s: tensor %q, chunk at %v (%q), bytes [%d, %d) of the file: CRC-32C mismatch, the data is damaged",
					filepath.Join(dir, c.File), name, c.Offset, c.Key, c.Begin+int64(b*block), c.Begin+int64(b*block+len(p)))
			}
		}
		for _, r := range rs {
			s, e := max(r.src, lo), min(r.src+r.n, hi)
			if s < e {
				copy(dst[r.dst+s-r.src:], buf[s-lo:e-lo])
			}
		}
		i = j
	}
	return nil
}
