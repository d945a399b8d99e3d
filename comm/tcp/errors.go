package tcp

import "github.com/b7ea7098/loom"

// Sentinel errors; test for them with errors.Is.
var (
	// ErrHandshake: a peer that connected belongs to another job, has
	// another rank or size than expected, or speaks another protocol version.
	ErrHandshake = loom.NewSentinel("tcp: handshake failed", loom.ErrMismatch)
	// ErrPeer: a peer's connection closed, failed, or carried a frame that
	// is not of this protocol.
	ErrPeer = loom.NewSentinel("tcp: peer failed")
)
