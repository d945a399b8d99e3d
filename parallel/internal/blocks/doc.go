// Package blocks holds what the data-parallel packages (parallel/ddp and
// parallel/fsdp) and tensor parallelism (parallel/tp) share about
// parameter blocks: which device holds a parameter list, freeing a
// replaced device block, element counts, and how the ranks of a group
// describe a parameter list to agree on it (comm.Agree). It is internal:
// its names may change with those packages.
package blocks
