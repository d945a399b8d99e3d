// Package rendezvous is a small TCP key-value store used to bootstrap
// multi-process jobs (rank discovery, sharing an NCCL unique id), in the
// manner of PyTorch's TCPStore.
//
// One process runs a [Server]; every process (the server's own included)
// connects with a [Client] and calls [Client.Set], [Client.Get] (which
// blocks until the key exists), [Client.Wait], [Client.Add] (an atomic
// counter), [Client.Delete] and the [Client.Barrier] helper. cmd/loomrun
// starts a Server at MASTER_ADDR:MASTER_PORT for the processes it launches;
// [DialEnv] connects to it.
//
// # Errors and time limits
//
// Every client call honours its context and the client's per-call timeout
// ([WithTimeout]); blocking requests carry their remaining time to
// the server, which gives up on them too. Every error is an [*Error] naming
// the operation, the key and the server address. Test causes with
// errors.Is: [ErrTimeout] (the client timeout, a context deadline or the
// server's deadline; these also match context.DeadlineExceeded),
// context.Canceled, [ErrConnLost] (the server went away: every pending call
// fails at once), [ErrClosed], [ErrFrameTooLarge], [ErrProtocol]; an error
// the server reported is a [*ServerError].
//
// # Reconnection
//
// A Client holds one TCP connection and multiplexes all calls over it, so
// many goroutines may share one Client. [Dial] retries refused or failed
// connections until the dial timeout ([WithDialTimeout]) passes. When an established
// connection breaks, every pending call fails with [ErrConnLost]; calls are
// never retried automatically, since Add is not idempotent and the server
// may have applied the request. The next call after a break makes one fresh
// connection attempt (bounded by its context and timeout) and fails at once
// if that attempt fails; it does not wait for the server to return. The
// store lives in the server process: a restarted server starts empty, so
// values set before the break are gone unless set again.
//
// # Protocol
//
// The protocol is versioned by the magic string "LOOMRDV1", exchanged in a
// ping when a connection opens. Every message is a frame:
//
//	frame    = length:u32 body[length]        (1 <= length <= max frame, 64 MiB by default)
//	request  = op:u8 id:u64 timeout_ms:u32 args
//	response = status:u8 id:u64 payload
//	string   = length:u32 bytes[length]
//
// Integers are big-endian. id is chosen by the client (non-zero) and echoed
// in the response, so responses may come back in any order. timeout_ms
// bounds a blocking request on the server (0: no bound). Requests:
//
//	op 1 PING    args: magic[8]                 payload: magic[8]
//	op 2 SET     args: key:string value[rest]   payload: empty
//	op 3 GET     args: key:string               payload: value[rest]   (blocks)
//	op 4 WAIT    args: n:u32 key:string * n     payload: empty         (blocks)
//	op 5 ADD     args: key:string delta:i64     payload: new value:i64
//	op 6 DELETE  args: key:string               payload: existed:u8
//	op 7 CANCEL  args: target id:u64            no response
//
// Status is 0 (ok), 1 (error; payload is a UTF-8 message) or 2 (the
// request's timeout passed on the server). Counters are stored as decimal
// ASCII, so Get of a counter returns e.g. "3", and Add on a value that is
// not a decimal integer is an error. A frame longer than the maximum is
// answered with an error (id 0) and the connection is closed; so is a
// malformed request. An unknown op is answered with an error and the
// connection stays open. The server reads a frame's body as it arrives,
// so a length header alone never makes it allocate the full length, and
// a client that stalls inside a frame is disconnected after the frame
// timeout ([WithFrameTimeout]); a connection idle between frames is not.
package rendezvous
