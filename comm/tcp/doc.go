// Package tcp is a pure-Go multi-process communicator over TCP: the role
// gloo plays for torchrun. Ranks find each other through the rendezvous
// store (package comm/rendezvous) that cmd/loomrun runs: each rank listens
// on an address, publishes it in the store, and the ranks connect into a
// full mesh (the lower rank dials), checking job, rank, size and protocol
// version in a handshake. No cgo, any number of hosts.
//
// Every collective of comm.Communicator is built from framed messages on
// those connections: ring algorithms for large messages (chunked into
// segments, so that sending, receiving and reducing overlap), binomial trees
// for small ones and direct exchanges for the personalised collectives. Auto
// chooses by a fixed crossover (see Algorithms); comm.AlgorithmEnv forces a
// choice. Errors follow comm/local's contract: timeouts, cancellation and
// aborts reach every rank, naming the rank at fault, the op and its
// sequence number; a peer's closed connection or a garbage frame aborts
// every communicator of the process, naming that peer.
package tcp
