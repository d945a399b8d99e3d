package tcp

import "encoding/binary"

// KillConnections closes every connection of c's process at once, without
// the goodbye of Close: to its peers, the process was killed. The process
// is marked closed first, so that its own readers, failing on the closed
// connections, send no notices a killed process could not send.
func KillConnections(c *Comm) {
	c.t.mu.Lock()
	c.t.closed = true
	c.t.mu.Unlock()
	for _, p := range c.t.peers {
		if p != nil {
			p.conn.Close()
		}
	}
}

// SendGarbage queues a frame of an unknown kind for the world rank peer,
// through the writer so that it does not interleave with real frames.
func SendGarbage(c *Comm, peer int) {
	c.t.post(peer, 0x7f, 0, 0, 0, []byte("not a frame"), false)
}

// PathCounts returns how many frames c's process wrote whole on the
// direct path, began there and left to the writer, and received in place.
func PathCounts(c *Comm) (direct, partial, inPlace int64) {
	return c.t.direct.Load(), c.t.partial.Load(), c.t.inPlace.Load()
}

// SendPartialFrame writes to the world rank peer the header of a
// collective frame of c for sequence number seq announcing n payload
// bytes, followed by sent only: a sender that stalls mid-frame.
func SendPartialFrame(c *Comm, peer int, seq uint64, n int, sent []byte) {
	f := newFrame(kindColl, c.id, seq, 0, sent)
	binary.LittleEndian.PutUint64(f.hdr[25:], uint64(n))
	p := c.t.peers[peer]
	p.mu.Lock()
	p.queue = append(p.queue, f)
	p.mu.Unlock()
	p.kick()
}
