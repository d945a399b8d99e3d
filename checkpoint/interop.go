package checkpoint

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/safetensors"
)

// WithPrefix maps a tensor's name n to prefix+n in the file (Export,
// Import). Import then reads only the file's tensors whose names start
// with prefix and ignores the others (a file holding several state dicts,
// "model." and "optim." say).
func WithPrefix(prefix string) Option {
	return func(c *config) {
		c.note("WithPrefix", forExport|forImport)
		c.prefix = prefix
	}
}

// WithReshape lets Import read a tensor of the file whose shape differs
// from its target's but holds as many elements, as the target's shape,
// row-major (PyTorch's fused [3·D] attention bias into a [3, D]
// parameter, say). Without it another shape is refused.
func WithReshape() Option {
	return func(c *config) {
		c.note("WithReshape", forImport)
		c.reshape = true
	}
}

// Export writes state's tensors, whole, as one safetensors file at path
// that PyTorch's, numpy's and any other safetensors reader loads: each
// tensor under its name (WithPrefix adds a prefix), its global shape and
// dtype, row-major little-endian, with the standard header (metadata
// {"format": "pt"}) and nothing loom-specific. Every rank of the job
// calls it; entries are not exported (a safetensors file holds tensors).
//
// The ranks first save their own blocks as a checkpoint in a staging
// folder beside path (".export-BASE", removed after), so that no rank
// gathers a tensor; world rank 0 then assembles the file one tensor at a
// time, in slabs of whole rows of at most 64 MiB (WithMemoryLimit; one
// row when a row is larger), verifying the checksums, and writes it under a staging name, fsynced and renamed into place: a
// killed export leaves path as it was. Rank 0 reads the other ranks'
// files, so path's folder must be one they all see, as a checkpoint's
// root is. Errors are Save's; every rank returns an error when any rank
// fails.
func Export(ctx context.Context, path string, state State, opts ...Option) error {
	const op = "Export"
	cfg, err := newConfig(op, forExport, opts)
	if err != nil {
		return err
	}
	world, err := worldOf(op, cfg, tensorMeshes(state.Tensors))
	if err != nil {
		return err
	}
	fs := files{rank: world.Rank(), hook: cfg.hook}
	stage := filepath.Join(filepath.Dir(path), ".export-"+filepath.Base(path))
	if world.Rank() == 0 {
		err = fs.removeAll(stage) // a killed export's remains
	}
	if _, err := exchange(ctx, world, op, nil, err); err != nil {
		return err
	}
	scfg := &config{block: defaultBlock, step: 0, hasStep: true, world: world, hook: cfg.hook}
	dir, err := save(ctx, op, stage, state, scfg)
	if err != nil {
		return err
	}
	if world.Rank() == 0 {
		slab := cfg.memLimit
		if slab == 0 {
			slab = defaultSlab
		}
		err = assemble(op, fs, dir, path, cfg.prefix, slab)
		if rerr := fs.removeAll(stage); err == nil && rerr != nil {
			err = wrapf(op, rerr, "removing %s", stage)
		}
	}
	_, err = exchange(ctx, world, op, nil, err)
	return err
}

// assemble writes the checkpoint in dir as one safetensors file at path,
// holding at most slab bytes of a tensor at a time (or one row).
func assemble(op string, fs files, dir, path, prefix string, slab int) error {
	m, err := readManifest(op, dir)
	if err != nil {
		return err
	}
	names := slices.Sorted(maps.Keys(m.Tensors))
	hdr := map[string]any{"__metadata__": map[string]string{"format": "pt"}}
	var off int64
	for _, n := range names {
		t := m.Tensors[n]
		size := int64(prod(t.Shape) * dtypeSize(t.DType))
		hdr[prefix+n] = map[string]any{"dtype": t.DType, "shape": t.Shape, "data_offsets": []int64{off, off + size}}
		off += size
	}
	h, _ := json.Marshal(hdr) // plain data: Marshal cannot fail
	for len(h)%8 != 0 {
		h = append(h, ' ')
	}
	head := binary.LittleEndian.AppendUint64(nil, uint64(len(h)))
	head = append(head, h...)

	tmp := path + ".tmp"
	w, err := fs.create(tmp)
	if err != nil {
		return wrapf(op, err, "creating %s", tmp)
	}
	defer w.Close() // on error paths; the success path closes it first
	if err := fs.write(w, 0, head); err != nil {
		return wrapf(op, err, "writing %s", tmp)
	}
	opened := map[string]*os.File{}
	defer func() {
		for _, f := range opened {
			_ = f.Close() // read only: closing loses nothing
		}
	}()
	open := func(name string) (*os.File, error) {
		if f, ok := opened[name]; ok {
			return f, nil
		}
		f, err := os.Open(filepath.Join(dir, name))
		if err != nil {
			return nil, wrapf(op, err, "opening %s", filepath.Join(dir, name))
		}
		opened[name] = f
		return f, nil
	}
	pos := int64(len(head))
	for _, n := range names {
		t := m.Tensors[n]
		if err := writeTensor(op, fs, w, pos, dir, m, n, slab, open); err != nil {
			return err
		}
		pos += int64(prod(t.Shape) * dtypeSize(t.DType))
	}
	if err := fs.fsync(w); err != nil {
		return wrapf(op, err, "syncing %s", tmp)
	}
	if err := w.Close(); err != nil {
		return wrapf(op, err, "closing %s", tmp)
	}
	if err := fs.rename(tmp, path); err != nil {
		return wrapf(op, err, "renaming %s", tmp)
	}
	if err := fs.fsyncDir(filepath.Dir(path)); err != nil {
		return wrapf(op, err, "syncing %s", filepath.Dir(path))
	}
	return nil
}

// defaultSlab bounds the bytes of a tensor that Export's assembling rank
// holds at once, unless WithMemoryLimit says otherwise.
const defaultSlab = 64 << 20

// writeTensor writes tensor n of the checkpoint in dir at pos of w,
// reading it in slabs of whole rows of at most slab bytes (one row when a
// row is larger), each verified against its checksums.
func writeTensor(op string, fs files, w *os.File, pos int64, dir string, m *manifest, n string, slab int, open func(string) (*os.File, error)) error {
	t := m.Tensors[n]
	es := dtypeSize(t.DType)
	if prod(t.Shape) == 0 {
		return nil
	}
	rows, rowBytes := 1, prod(t.Shape)*es
	if len(t.Shape) > 0 {
		rows, rowBytes = t.Shape[0], prod(t.Shape[1:])*es
	}
	per := max(1, slab/rowBytes)
	var buf []byte
	for r0 := 0; r0 < rows; r0 += per {
		do, ds := make([]int, len(t.Shape)), slices.Clone(t.Shape)
		if len(t.Shape) > 0 {
			do[0], ds[0] = r0, min(per, rows-r0)
		}
		buf = slices.Grow(buf[:0], prod(ds)*es)[:prod(ds)*es]
		for _, c := range t.Chunks {
			rs := runs(c.Offset, c.Size, do, ds, es)
			if len(rs) == 0 {
				continue
			}
			f, err := open(c.File)
			if err != nil {
				return err
			}
			if err := readChunk(op, fs, f, dir, n, c, m.Block, rs, buf); err != nil {
				return err
			}
		}
		if err := fs.write(w, pos, buf); err != nil {
			return wrapf(op, err, "writing %s", w.Name())
		}
		pos += int64(len(buf))
	}
	return nil
}

// Import reads a safetensors file (Export's, PyTorch's, any writer's) into
// tensors laid out by targets, as Load reads a checkpoint: the file is a
// source whose every tensor is one replicated chunk, and each rank reads
// only the byte ranges of its own blocks. Every rank of the job calls it
// with the specs of the tensors it holds; the file's tensor prefix+n fills
// target n (WithPrefix; the file's tensors without the prefix are
// ignored; WithReshape reads a tensor of another shape with as many
// elements as the target's). WithDevice puts the blocks on a device.
//
// A target missing from the file, a tensor of the file (under the prefix)
// that no rank loads, another shape, or another dtype (targets are F32 or
// F64; nothing is converted) is refused with ErrInvalid naming the tensor;
// a file that is not valid safetensors with ErrCorrupt. Nothing is built
// until every rank's checks have passed. The file has no checksums of its
// own, so its bytes are taken as they are.
func Import(ctx context.Context, path string, targets map[string]*placement.Spec, opts ...Option) (*State, error) {
	const op = "Import"
	cfg, err := newConfig(op, forLoad|forImport, opts)
	if err != nil {
		return nil, err
	}
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

	// 1. The file's header as a manifest of one chunk a tensor.
	m, err := fileManifest(op, path, cfg.prefix)
	if err == nil && cfg.reshape {
		for _, n := range names {
			t, ok := m.Tensors[n]
			if want := targets[n].Shape(); ok && prod(t.Shape) == prod(want) {
				t.Shape = want
				for i := range t.Chunks { // one, over the whole tensor
					t.Chunks[i].Offset, t.Chunks[i].Size = make([]int, len(want)), want
				}
			}
		}
	}
	if err == nil {
		err = checkTargets(op, m, targets, names, world, false)
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
			extra = append(extra, fmt.Sprintf("%q", cfg.prefix+n))
		}
	}
	if len(extra) > 0 {
		return nil, invalidf(op, "%s holds tensor(s) %s that no rank loads: a file of another model? (WithPrefix selects a part of a file)", path, strings.Join(extra, ", "))
	}

	// 2. Read this rank's blocks.
	data, err := readBlocks(op, fs, filepath.Dir(path), m, targets, names)
	if _, err := exchange(ctx, world, op, nil, err); err != nil {
		return nil, err
	}

	// 3. Wrap them, on the device asked for.
	out := &State{Tensors: map[string]*placement.DTensor{}, Entries: map[string]any{}}
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
	return out, nil
}

// fileManifest describes the safetensors file at path as a manifest: each
// tensor named prefix+n becomes tensor n, one chunk over its whole shape
// at its byte range, with no checksums (the file has none).
func fileManifest(op, path, prefix string) (*manifest, error) {
	f, err := safetensors.Open(path)
	if err != nil {
		return nil, corruptf(op, "%s: %v", path, err)
	}
	defer f.Close() // read only: closing loses nothing
	fh, err := os.Open(path)
	if err != nil {
		return nil, wrapf(op, err, "opening %s", path)
	}
	defer fh.Close()
	var lb [8]byte
	st, err := fh.Stat()
	if err == nil {
		_, err = fh.ReadAt(lb[:], 0)
	}
	if err != nil {
		return nil, wrapf(op, err, "reading %s", path)
	}
	base := 8 + int64(binary.LittleEndian.Uint64(lb[:])) // Open checked it
	file := filepath.Base(path)
	m := &manifest{Files: []fileRecord{{Name: file, Bytes: st.Size()}}, Tensors: map[string]*tensor{}, Block: 1 << 20}
	for _, key := range f.Names() {
		n, ok := strings.CutPrefix(key, prefix)
		if !ok {
			continue
		}
		info, err := f.Info(key)
		if err != nil {
			return nil, corruptf(op, "%s: %v", path, err)
		}
		t := &tensor{DType: string(info.DType), Shape: info.Shape}
		if info.Size > 0 {
			t.Chunks = []chunk{{Offset: make([]int, len(info.Shape)), Size: info.Shape, File: file, Key: key,
				Begin: base + info.Offset, End: base + info.Offset + info.Size}}
		}
		m.Tensors[n] = t
	}
	return m, nil
}
