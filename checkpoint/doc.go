// Package checkpoint saves and loads distributed checkpoints: named
// distributed tensors (placement.DTensor) and small typed entries, written
// from any mesh and placements and read back into any other mesh, world
// size, placements and device.
//
// # Saving
//
// Every rank of a job calls [Save] with its [State]. Each distinct block of
// a tensor is written once, by one of the ranks that hold it (replicas are
// spread over their holders by bytes), into that rank's safetensors file,
// rank-NNNNN.safetensors; a block on a device is copied to the host one
// tensor at a time. Rank 0 writes manifest.json last. A checkpoint folder
// looks like
//
//	root/.lock                           flock of the writing job, naming it
//	root/step-0000000042/manifest.json   the index (written last)
//	root/step-0000000042/rank-00000.safetensors
//	root/step-0000000042/rank-00001.safetensors
//
// The manifest is JSON, {"manifest": BODY, "sha256": HEX}, where HEX is the
// SHA-256 of BODY's bytes as they stand in the file. BODY records the
// format ("loom.checkpoint/1"), the step, the world size, the checksum
// ("crc32c") and its block in bytes, the data files with their sizes,
// every tensor's dtype ("F32", "F64"), global shape, the saver's mesh and
// placements (for information), and its chunks: offset and size in every
// dim, file, name inside the file, byte range [begin, end) in the file and
// one CRC-32C (Castagnoli) per block of the chunk's bytes; and the entries,
// each {"type", "value"} with int64 and float64 values as decimal strings
// so that no JSON reader rounds them. A chunk's bytes are row-major,
// little-endian, over its size; the data files are ordinary safetensors
// files that other tools read.
//
// CRC-32C rather than SHA-256: the checksums guard against damage, not
// against an adversary, and CRC-32C runs at several GB/s a core with the
// CPU's instruction, so a save costs little more than its writes. Blocks
// (1 MiB by default, [WithBlockSize]) let a reader that needs a few rows of
// a large chunk verify what it reads without reading the whole chunk.
//
// # Saving in the background
//
// A [Saver] saves while training goes on: [Saver.Save] snapshots the
// chunks this rank writes to host memory (a device block copied off the
// device) and returns; the files are then written in the background with
// the same crash safety as Save. Saves run one at a time: the next Save,
// [Saver.Wait] or [Saver.Close] waits for the previous one and returns its
// error. [WithMemoryLimit] bounds the snapshot's host memory: the chunks
// are copied piece by piece while the writer frees what it has written,
// trading time blocked for memory. The returned [AsyncSave] reports the
// time the caller was blocked and the peak of host memory the snapshot
// held. The background writer talks to the other ranks on a communicator
// split once from the job's, so it never interleaves with training's
// collectives.
//
// # Safety
//
// A checkpoint is visible only when complete. Files are written in a
// staging folder (".staging-step-…") under staging names, each fsynced and
// renamed; the manifest is written last the same way; the folder is
// fsynced, renamed to step-NNNNNNNNNN, and root fsynced. [Latest] and
// [Load] take only step folders that hold a manifest, so a save killed at
// any point (tested by SIGKILL before every file operation) leaves the
// previous checkpoint as the latest and nothing that loads; the next save
// removes the remains. [WithKeep] deletes older checkpoints after the new
// one is complete, each renamed to a trash name first. Rank 0 holds an
// flock on root/.lock for the save, which the kernel releases however the
// process ends; a save into a root locked by another job fails with
// [ErrLocked], naming the holder.
//
// # Loading
//
// [Load] is a redistribute whose source layout is the storage: each rank
// passes the specs it wants, intersects its block with the manifest's
// chunks, and reads only those byte ranges (rounded out to the checksum
// blocks, which it verifies). Meshes, world sizes, placements (Replicate
// and Shard, uneven and empty shards, any shard order) and devices may all
// differ from the saver's; no rank holds more of a tensor than its own
// block. A missing or extra tensor, another shape or dtype, a damaged
// manifest, a truncated file or a failed checksum (naming the file and
// the tensor) is refused before any tensor is built, on every rank.
// [LoadInto] fills existing tensors in place instead (a model's
// parameters, which an optimizer already holds), on their own devices.
//
// # State dicts and resuming a job
//
// A part of a training job that a checkpoint holds is a [Stateful]: its
// StateDict returns its tensors (handles on the live tensors, with their
// placements) and entries under a prefix, and LoadStateDict takes the
// entries back after a load has filled the tensors in place. [Module]
// makes one of a model's module tree (its parameters by name, and the
// state of its Stateful modules, such as a Dropout's, by path);
// optim.AdamW and optim.SGD, train.Sampler and train.Trainer, and the
// models' trainers (gpt.Trainer.Parts) are Stateful; gpt.PipelineParts
// gives a pipelined rank's stages by the model's names, so that a
// checkpoint moves between pipeline splits and one rank (ranks may pass
// different entries: the checkpoint holds their union). A
// [LoadTargeter] loads tensors that it does not save (a tied copy). [JobState] builds a
// whole job's State from its [Parts] and the step; [LoadJob] loads a
// checkpoint into the parts on the job's current layout and device. A
// fused tensor saved as [C·R, …] loads into [C, R, …] and back: tensor
// parallelism keeps a fused projection by chunks, one rank and FSDP keep
// it flat. [StepOf] reads a checkpoint's step.
//
// # Interop
//
// [Export] writes the whole model as one plain safetensors file, each
// tensor under its name with its global shape (the file PyTorch's
// safetensors.torch.load_file and numpy read); the ranks save their blocks
// to a staging folder beside it, and world rank 0 assembles the file from
// them in slabs of rows within [WithMemoryLimit]. [Import] reads such a file,
// PyTorch's included, into any layout as Load reads a checkpoint, each
// rank reading only its blocks' bytes ([WithPrefix] picks a part of a
// file, [WithReshape] lets a fused tensor take the target's shape).
//
// Tensors are float32 or float64 (placement's dtypes); hosts are
// little-endian (every platform loom runs on).
package checkpoint
