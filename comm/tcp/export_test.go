package tcp

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
