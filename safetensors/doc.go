// Package safetensors reads and writes the Hugging Face safetensors format,
// the file format loom uses for checkpoints and reference fixtures.
//
// # Format
//
// A file is an 8-byte little-endian unsigned header length N, then N bytes of
// UTF-8 JSON (the header), then the data section. The header is one JSON
// object that maps each tensor name to
//
//	{"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}
//
// where the offsets are relative to the start of the data section, plus an
// optional "__metadata__" object of string values. Tensor data is row-major
// and little-endian. The header may be padded with trailing spaces; writers
// pad it so that the data section starts at a multiple of 8.
//
// [Read] and [Open] enforce the format's validation rules and report each
// violation with an [*Error] that wraps [ErrFormat]: a header longer than
// [MaxHeaderSize] or than the file, a header that is not valid UTF-8 or not a
// single JSON object (RFC 8259, with values nested at most 128 deep), a
// string escape that does not encode valid Unicode (an unpaired UTF-16
// surrogate such as \ud800), a tensor name that [Write] would refuse (the
// empty name), duplicate tensor names or metadata keys, unknown dtypes,
// malformed shapes or offsets, a byte range that does not match shape ×
// dtype size, and tensors that overlap, leave gaps, run past the end of the
// file or do not cover the data section exactly. Parsing takes time and
// memory linear in the header's size (a million tensors in an 80 MB header:
// about a second of CPU and 430 MB allocated in all), and memory is
// allocated only for bytes the reader has shown it holds.
//
// # Checksums
//
// loom writes checksums into every file (docs/design.md §7). The "__metadata__"
// entry [ChecksumKey] ("loom.sha256") holds a JSON object, encoded as a
// string, that maps every tensor name to the lowercase hex SHA-256 of that
// tensor's data bytes, for example
//
//	"loom.sha256": "{\"bias\":\"9f86…\",\"weight\":\"2c26…\"}"
//
// Other tools see an ordinary metadata string and can ignore it. When a file
// carries the key, [Read] checks that it names exactly the file's tensors,
// [File.Tensor] verifies each tensor it reads, and [File.Verify] checks all of
// them; a mismatch is an [*Error] that wraps [ErrChecksum] and names the
// tensor. Files without the key, such as those written by PyTorch, are read
// normally and are simply not verified.
//
// # Atomic writes
//
// [WriteFile] writes to a staging file in the target's folder, syncs it to
// disk and renames it over the target, so a reader sees either the old file
// or the complete new one, never a partial write, and a failed write leaves
// no staging file behind.
//
// A writer that dies mid-write (SIGKILL, a crash, a power cut) cannot remove
// its staging file, so the next WriteFile to the same path does. The rule:
// a staging file is "."+base+".tmp-"+decimal digits beside the target base,
// and its writer holds an exclusive flock(2) on it until the rename; the
// kernel releases that lock when the writer's process ends, however it
// ends. WriteFile removes every staging file of its own target that it can
// lock, and leaves those another process holds, so concurrent writers of one
// path do not remove each other's files; files of other targets and other
// names are never touched. Where flock is not available (Windows), nothing
// is removed.
//
// # Tensor data
//
// A [Tensor] holds its data as raw bytes; [Tensor.Float32s],
// [Tensor.Float64s] and [Tensor.Int64s] decode them and [FromFloat32s],
// [FromFloat64s] and [FromInt64s] build tensors from slices, empty shapes
// included. Package github.com/b7ea7098/loom/dense converts to and from
// gorgonia.org/tensor; this package does not depend on it.
package safetensors
