// Package blocks holds what package parallel and the parallelism packages
// beside it (parallel/tp, parallel/ddp, parallel/fsdp) share about
// parameter blocks: freeing a replaced device block, telling the host
// apart, element counts. It is internal: its names may change with those
// packages.
package blocks
