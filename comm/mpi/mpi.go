//go:build mpi

package mpi

/*
#cgo pkg-config: ompi-c
#include "loom_mpi.h"
*/
import "C"

import (
	"errors"
	"fmt"
	"hash/fnv"
	"math"
	"strings"
	"sync"
	"unsafe"

	"github.com/b7ea7098/loom/comm"
)

// ThreadLevel is an MPI thread-support level.
type ThreadLevel int

// The MPI thread-support levels, in increasing order.
const (
	ThreadSingle ThreadLevel = iota
	ThreadFunneled
	ThreadSerialized
	ThreadMultiple
)

// String returns the MPI name of the level ("MPI_THREAD_MULTIPLE").
func (l ThreadLevel) String() string {
	switch l {
	case ThreadSingle:
		return "MPI_THREAD_SINGLE"
	case ThreadFunneled:
		return "MPI_THREAD_FUNNELED"
	case ThreadSerialized:
		return "MPI_THREAD_SERIALIZED"
	case ThreadMultiple:
		return "MPI_THREAD_MULTIPLE"
	}
	return fmt.Sprintf("ThreadLevel(%d)", int(l))
}

// maxCount is the largest element count of one MPI call (C int). Tests
// lower it to exercise the splitting of large messages.
var maxCount = math.MaxInt32

// lib is the process-wide MPI state.
var lib struct {
	mu        sync.Mutex
	init      bool
	finalized bool
	provided  ThreadLevel
	tagUB     int
	worlds    int            // World calls so far, for communicator ids
	live      map[*Comm]bool // communicators not yet freed
	// serial serialises every MPI call when MPI did not provide
	// MPI_THREAD_MULTIPLE.
	serial sync.Mutex
}

// Init initialises MPI with MPI_Init_thread, asking for
// MPI_THREAD_MULTIPLE; Provided reports what MPI granted. With less than
// MPI_THREAD_MULTIPLE the package serialises all its MPI calls behind one
// lock. Init is idempotent; World calls it. It also creates the 16-bit
// float reduction operators.
func Init() error {
	lib.mu.Lock()
	defer lib.mu.Unlock()
	if lib.finalized {
		return errors.New("mpi: Init after Finalize (MPI cannot be initialised twice)")
	}
	if lib.init {
		return nil
	}
	var already C.int
	if rc := C.MPI_Initialized(&already); rc != C.loom_success() {
		return fmt.Errorf("mpi: MPI_Initialized: %w", mpiError(rc))
	}
	var provided C.int
	if already != 0 {
		if rc := C.MPI_Query_thread(&provided); rc != C.loom_success() {
			return fmt.Errorf("mpi: MPI_Query_thread: %w", mpiError(rc))
		}
	} else if rc := C.loom_init_thread(&provided); rc != C.loom_success() {
		return fmt.Errorf("mpi: MPI_Init_thread: %w", mpiError(rc))
	}
	switch provided {
	case C.loom_thread_multiple():
		lib.provided = ThreadMultiple
	case C.loom_thread_serialized():
		lib.provided = ThreadSerialized
	case C.loom_thread_funneled():
		lib.provided = ThreadFunneled
	default:
		lib.provided = ThreadSingle
	}
	C.loom_set_errors_return(C.loom_comm_world())
	if rc := C.loom_create_half_ops(); rc != C.loom_success() {
		return fmt.Errorf("mpi: MPI_Op_create for 16-bit floats: %w", mpiError(rc))
	}
	lib.tagUB = int(C.loom_tag_ub())
	lib.live = map[*Comm]bool{}
	lib.init = true
	return nil
}

// Initialized reports whether Init has succeeded and Finalize has not run.
func Initialized() bool {
	lib.mu.Lock()
	defer lib.mu.Unlock()
	return lib.init && !lib.finalized
}

// Provided returns the thread-support level MPI granted to Init.
func Provided() ThreadLevel {
	lib.mu.Lock()
	defer lib.mu.Unlock()
	return lib.provided
}

// serialized reports whether MPI calls must be serialised.
func serialized() bool { return lib.provided != ThreadMultiple }

// Finalize frees every communicator still alive and calls MPI_Finalize.
// Every process must call it before exiting. It refuses, returning an
// error and leaving MPI initialised, when operations abandoned by an abort
// or a timeout are still posted in MPI, since MPI_Finalize could then hang:
// end such a job with AbortJob.
func Finalize() error {
	lib.mu.Lock()
	if !lib.init || lib.finalized {
		lib.mu.Unlock()
		return nil
	}
	comms := make([]*Comm, 0, len(lib.live))
	for c := range lib.live {
		comms = append(comms, c)
	}
	lib.mu.Unlock()
	stuck := 0
	for _, c := range comms {
		stuck += c.release()
	}
	if stuck > 0 {
		return fmt.Errorf("mpi: Finalize: %d operations abandoned after an abort or timeout are still posted in MPI, and MPI_Finalize could hang; end the job with mpi.AbortJob", stuck)
	}
	lib.mu.Lock()
	defer lib.mu.Unlock()
	C.loom_free_half_ops()
	lib.finalized = true
	if rc := C.MPI_Finalize(); rc != C.loom_success() {
		return fmt.Errorf("mpi: MPI_Finalize: %w", mpiError(rc))
	}
	return nil
}

// AbortJob ends every process of the MPI job with MPI_Abort on
// MPI_COMM_WORLD and the given exit code: the one sure way to end a job
// whose ranks are stuck in a collective that MPI cannot cancel. It does
// not return when MPI is initialised.
func AbortJob(code int) {
	if !Initialized() {
		return
	}
	C.MPI_Abort(C.loom_comm_world(), C.int(code))
}

// World returns a new communicator over every process of the MPI job: a
// duplicate of MPI_COMM_WORLD, with rank and size read from MPI. It
// initialises MPI first if needed. It is collective: every process calls
// it, the same number of times, and with the same WithBlockingCalls choice.
// Both that and each rank's configuration (options, environment) are
// checked collectively: a disagreement or an invalid configuration on one
// rank is an error on every rank. Without WithOptions, the options come
// from comm.OptionsFromEnv.
func World(opts ...Option) (*Comm, error) {
	if err := Init(); err != nil {
		return nil, err
	}
	// A configuration error does not return yet: the other ranks are
	// entering MPI_Comm_dup, and agreeConfig lets every rank fail alike.
	cfg, cfgErr := configure(opts)
	lib.mu.Lock()
	if lib.finalized {
		lib.mu.Unlock()
		return nil, errors.New("mpi: World after Finalize")
	}
	lib.worlds++
	n := lib.worlds
	lib.mu.Unlock()
	lockSerial()
	var h C.MPI_Comm
	rc := C.MPI_Comm_dup(C.loom_comm_world(), &h)
	unlockSerial()
	if rc != C.loom_success() {
		return nil, fmt.Errorf("mpi: MPI_Comm_dup(MPI_COMM_WORLD): %w", mpiError(rc))
	}
	if err := agreeConfig(h, cfg.blocking, cfgErr); err != nil {
		lockSerial()
		C.MPI_Comm_free(&h)
		unlockSerial()
		if err == cfgErr {
			return nil, err
		}
		return nil, fmt.Errorf("mpi: World: %w", err)
	}
	name := "world"
	if n > 1 {
		name = fmt.Sprintf("world%d", n)
	}
	return newComm(h, name, hashID(0, "world", uint64(n), 0), cfg)
}

// agreeConfig checks, collectively on the new communicator h, that every
// rank configured itself without error (cfgErr, this rank's), chose the
// same call mode (blocking and nonblocking collectives never match in
// MPI), and, for the blocking mode, has MPI_THREAD_MULTIPLE (its watchdog
// calls MPI while a call blocks). Every rank reaches the same verdict,
// instead of one returning while the others wait for it.
func agreeConfig(h C.MPI_Comm, blocking bool, cfgErr error) error {
	flag := func(b bool) C.int {
		if b {
			return 1
		}
		return 0
	}
	b := flag(blocking)
	// max: any blocking, any nonblocking, any without THREAD_MULTIPLE,
	// any misconfigured.
	v := [4]C.int{b, -b, flag(blocking && serialized()), flag(cfgErr != nil)}
	lockSerial()
	rc := C.loom_allreduce(C.loom_in_place(), unsafe.Pointer(&v[0]), C.int(len(v)), C.loom_dtype(5), C.loom_op(5, 5), h, nil)
	unlockSerial()
	if err := ok(rc, "MPI_Allreduce (configuration agreement)"); err != nil {
		return err
	}
	switch {
	case cfgErr != nil:
		return cfgErr
	case v[3] != 0:
		return fmt.Errorf("%w: another rank's configuration is invalid (it reports why)", comm.ErrInvalid)
	case v[0] != -v[1]:
		return fmt.Errorf("%w: ranks disagree on WithBlockingCalls (%s); blocking and nonblocking MPI collectives never match, so every rank must choose alike", comm.ErrInvalid, BlockingEnv)
	case v[2] != 0:
		return errors.New("WithBlockingCalls needs MPI_THREAD_MULTIPLE, and MPI provided less on some rank")
	}
	return nil
}

func lockSerial() {
	if serialized() {
		lib.serial.Lock()
	}
}

func unlockSerial() {
	if serialized() {
		lib.serial.Unlock()
	}
}

// hashID derives a communicator id that every member computes alike; abort
// notices carry it, so that a notice for a freed communicator whose MPI
// context id was reused is ignored.
func hashID(parent uint64, kind string, seq uint64, color int) uint64 {
	h := fnv.New64a()
	var b [24]byte
	for i := range 8 {
		b[i] = byte(parent >> (8 * i))
		b[8+i] = byte(seq >> (8 * i))
		b[16+i] = byte(uint64(int64(color)) >> (8 * i))
	}
	h.Write(b[:])
	h.Write([]byte(kind))
	return h.Sum64()
}

// mpiErr is an error code returned by MPI.
type mpiErr int

func (e mpiErr) Error() string {
	var buf [512]C.char
	n := C.loom_error_string(C.int(e), &buf[0], C.int(len(buf)))
	if n <= 0 {
		return fmt.Sprintf("MPI error %d", int(e))
	}
	return fmt.Sprintf("MPI error %d: %s", int(e), strings.TrimSpace(C.GoStringN(&buf[0], n)))
}

func mpiError(rc C.int) error { return mpiErr(rc) }

// ok converts an MPI return code into an error.
func ok(rc C.int, what string) error {
	if rc == C.loom_success() {
		return nil
	}
	return fmt.Errorf("%s: %w", what, mpiError(rc))
}

// ptr returns the address of element off of b (nil for an empty range).
func ptr(b []byte) unsafe.Pointer {
	if len(b) == 0 {
		return nil
	}
	return unsafe.Pointer(&b[0])
}
