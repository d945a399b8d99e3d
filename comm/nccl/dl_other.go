//go:build !(linux && (amd64 || arm64))

package nccl

import "runtime"

// open fails: this package loads NCCL with purego on Linux amd64 and
// arm64 only.
func open(cfg loadConfig, tried []Attempt) (*Library, error) {
	return nil, &LoadError{Library: "nccl", Reason: "no NCCL loader for " + runtime.GOOS + "/" + runtime.GOARCH, Tried: tried}
}
