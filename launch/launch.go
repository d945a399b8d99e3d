// Package launch decides, from the environment and before anything
// starts, how this process takes part in a training job, and starts its
// part: in-process ranks (comm/local) when the program was not launched
// by a job starter, one MPI rank (comm/mpi) under mpirun, and under
// torchrun or cmd/loomrun one NCCL rank (comm/nccl) on GPU LOCAL_RANK
// where the host has GPUs, else one TCP rank (comm/tcp, pure Go: the role
// gloo plays for torchrun). NCCL's unique id and TCP's addresses pass
// through the rendezvous server at MASTER_ADDR:MASTER_PORT.
//
//	job, err := launch.Detect(os.Getenv, *backend, dp*tp) // or launch.Auto(dp*tp)
//	...
//	err = job.Run(ctx, func(ctx context.Context, c comm.Communicator) error {
//		m, err := mesh.New(c, []int{dp, tp}, []string{"dp", "tp"})
//		...
//	})
//
// The backend is the -backend flag when set, else LOOM_BACKEND, else
// what the environment shows: Open MPI's OMPI_COMM_WORLD_SIZE means mpi;
// torchrun's (and loomrun's) RANK or WORLD_SIZE means nccl on a host whose
// CUDA driver finds a GPU and tcp on one without (no driver library, or
// none of its devices visible; LOOM_CUDA_DRIVER=off counts as none);
// nothing means local. The MPI
// backend exists only in binaries built with -tags mpi (it needs cgo and
// Open MPI); a binary without it that mpirun started says so instead of
// running one whole job in every process.
package launch

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"slices"
	"strconv"
	"strings"

	"github.com/b7ea7098/loom"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/local"
	"github.com/b7ea7098/loom/device/cuda"
)

// BackendEnv names the environment variable that chooses the backend
// when the program's -backend flag is empty: local, mpi, nccl or tcp.
const BackendEnv = "LOOM_BACKEND"

// The backends.
const (
	// Local runs every rank as a goroutine of this process (comm/local).
	Local = "local"
	// MPI runs one rank per process on Open MPI (comm/mpi; build tag mpi).
	MPI = "mpi"
	// NCCL runs one rank per process on GPU LOCAL_RANK (comm/nccl).
	NCCL = "nccl"
	// TCP runs one rank per process over TCP connections between the
	// processes (comm/tcp): any number of hosts, no GPU, no cgo.
	TCP = "tcp"
)

// Backends returns the backend names, in the order of the -backend flag's
// help.
func Backends() []string { return []string{Local, MPI, NCCL, TCP} }

// ErrInvalid is wrapped by the errors of a contradictory or incomplete
// environment or request; it matches loom.ErrInvalid.
var ErrInvalid = loom.NewSentinel("invalid job", loom.ErrInvalid)

// Job is how this process takes part in a job, as Detect found it.
type Job struct {
	// Backend is Local, MPI, NCCL or TCP.
	Backend string
	// WorldSize is the number of ranks in the whole job.
	WorldSize int
	// Processes is the number of processes of the job: 1 for Local,
	// WorldSize otherwise (one rank per process).
	Processes int
	// Rank is the world rank of this process's first rank: 0 for Local,
	// where the process holds every rank.
	Rank int
	// LocalRank is this process's index among the job's processes on its
	// host: the GPU it drives on NCCL; 0 for Local.
	LocalRank int
	// LocalRanks is the number of the job's ranks on this host, which
	// share its CPUs: WorldSize for Local.
	LocalRanks int
	// Addr is the rendezvous server's host:port (MASTER_ADDR,
	// MASTER_PORT) on NCCL and TCP, empty otherwise.
	Addr string
}

// Root reports whether this process holds world rank 0: the one that
// prints progress and writes the job's results.
func (j *Job) Root() bool { return j.Rank == 0 }

// String describes the job in one line, for a program's banner.
func (j *Job) String() string {
	if j.Backend == Local {
		return fmt.Sprintf("%d in-process rank(s)", j.WorldSize)
	}
	return fmt.Sprintf("%d %s processes of one rank each (%d on this host)", j.Processes, j.Backend, j.LocalRanks)
}

// InProcess returns the job of ranks in-process ranks (the Local backend),
// whatever the environment says: for tests, and for a second run inside
// one process (a one-rank comparison).
func InProcess(ranks int) (*Job, error) {
	return Detect(func(string) string { return "" }, Local, ranks)
}

// Auto returns how this process takes part in a job of ranks ranks (what
// the program's layout flags ask for), read from the process's own
// environment with the backend chosen automatically: it is
// Detect(os.Getenv, "", ranks), the one call of a program without a
// -backend flag. The same binary then runs ranks in-process ranks when
// started by hand or by go run, one rank per process under loomrun or
// torchrun (TCP, or NCCL where the CUDA driver finds a GPU) and under
// mpirun (a binary built with -tags mpi); LOOM_BACKEND overrides the
// choice. Its errors are Detect's (wrapping ErrInvalid).
func Auto(ranks int) (*Job, error) {
	return Detect(os.Getenv, "", ranks)
}

// Detect returns how this process takes part in a job of ranks ranks
// (what the program's layout flags ask for, dp·tp) from the environment
// that getenv reads (os.Getenv) and backend, the -backend flag ("" for
// automatic: BackendEnv, else the job starter's variables, else Local;
// under torchrun or loomrun NCCL where the CUDA driver finds a GPU, TCP
// otherwise). It starts nothing. A contradictory or incomplete
// environment is an error wrapping ErrInvalid that names the variable:
// WORLD_SIZE without RANK, a rank outside the world, a world size that is
// not ranks, the MPI backend in a binary built without -tags mpi, and so
// on.
func Detect(getenv func(string) string, backend string, ranks int) (*Job, error) {
	return detect(getenv, backend, ranks, hasGPU)
}

// detect is Detect with the probe that says whether the host has a GPU
// (hasGPU; tests pass their own).
func detect(getenv func(string) string, backend string, ranks int, gpus func(getenv func(string) string) bool) (*Job, error) {
	if getenv == nil {
		return nil, fmt.Errorf("launch: Detect: %w: nil getenv", ErrInvalid)
	}
	if ranks < 1 {
		return nil, fmt.Errorf("launch: Detect: %w: the layout asks for %d ranks; want at least 1", ErrInvalid, ranks)
	}
	chosen, err := choose(getenv, backend, gpus)
	if err != nil {
		return nil, err
	}
	switch chosen {
	case MPI:
		return detectMPI(getenv, ranks)
	case NCCL, TCP:
		return detectTorchrun(getenv, chosen, ranks)
	default:
		return &Job{Backend: Local, WorldSize: ranks, Processes: 1, LocalRanks: ranks}, nil
	}
}

// choose picks the backend: the flag, else BackendEnv, else the job
// starter's variables (and, under torchrun, whether gpus finds a GPU).
func choose(getenv func(string) string, flagValue string, gpus func(func(string) string) bool) (string, error) {
	name, from := strings.TrimSpace(flagValue), "-backend"
	if name == "" {
		name, from = strings.TrimSpace(getenv(BackendEnv)), BackendEnv
	}
	if name != "" {
		switch name {
		case Local, MPI, NCCL, TCP:
			return name, nil
		}
		return "", fmt.Errorf("launch: %w: %s=%q; want %s", ErrInvalid, from, name, strings.Join(Backends(), ", "))
	}
	switch {
	case getenv("OMPI_COMM_WORLD_SIZE") != "" || getenv("OMPI_COMM_WORLD_RANK") != "":
		return MPI, nil
	case getenv("RANK") != "" || getenv("WORLD_SIZE") != "":
		if gpus(getenv) {
			return NCCL, nil
		}
		return TCP, nil
	}
	return Local, nil
}

// detectMPI reads Open MPI's variables.
func detectMPI(getenv func(string) string, ranks int) (*Job, error) {
	if !mpiBuilt {
		if getenv("OMPI_COMM_WORLD_SIZE") != "" {
			return nil, fmt.Errorf("launch: %w: launched by mpirun (OMPI_COMM_WORLD_SIZE=%s) but built without -tags mpi: rebuild with go build -tags mpi, or pass -backend local to run the whole job in every process", ErrInvalid, getenv("OMPI_COMM_WORLD_SIZE"))
		}
		return nil, fmt.Errorf("launch: %w: the mpi backend needs a binary built with -tags mpi (go build -tags mpi)", ErrInvalid)
	}
	size, err := intVar(getenv, "OMPI_COMM_WORLD_SIZE", "start the program with mpirun -np N", 1)
	if err != nil {
		return nil, err
	}
	rank, err := rankVar(getenv, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", size)
	if err != nil {
		return nil, err
	}
	localSize, localRank, err := localVars(getenv, "OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", size, rank)
	if err != nil {
		return nil, err
	}
	if size != ranks {
		return nil, fmt.Errorf("launch: %w: OMPI_COMM_WORLD_SIZE=%d but the layout needs %d ranks: start it with mpirun -np %d", ErrInvalid, size, ranks, ranks)
	}
	return &Job{Backend: MPI, WorldSize: size, Processes: size, Rank: rank, LocalRank: localRank, LocalRanks: localSize}, nil
}

// detectTorchrun reads torchrun's (and cmd/loomrun's) variables for the
// NCCL or TCP backend; LOCAL_RANK, the GPU, is required on NCCL only.
func detectTorchrun(getenv func(string) string, backend string, ranks int) (*Job, error) {
	const hint = "start the program with loomrun or torchrun"
	size, err := intVar(getenv, "WORLD_SIZE", hint, 1)
	if err != nil {
		return nil, err
	}
	rank, err := rankVar(getenv, "RANK", "WORLD_SIZE", size)
	if err != nil {
		return nil, err
	}
	if backend == NCCL && getenv("LOCAL_RANK") == "" {
		return nil, fmt.Errorf("launch: %w: RANK=%d is set but LOCAL_RANK (the GPU of this process) is not: %s", ErrInvalid, rank, hint)
	}
	localSize, localRank, err := localVars(getenv, "LOCAL_WORLD_SIZE", "LOCAL_RANK", size, rank)
	if err != nil {
		return nil, err
	}
	host, port := getenv("MASTER_ADDR"), getenv("MASTER_PORT")
	if host == "" || port == "" {
		return nil, fmt.Errorf("launch: %w: MASTER_ADDR (%q) and MASTER_PORT (%q), the rendezvous server, must both be set: %s", ErrInvalid, host, port, hint)
	}
	if p, err := strconv.Atoi(port); err != nil || p < 1 || p > 65535 {
		return nil, fmt.Errorf("launch: %w: MASTER_PORT=%q; want a port number 1-65535", ErrInvalid, port)
	}
	if size != ranks {
		return nil, fmt.Errorf("launch: %w: WORLD_SIZE=%d but the layout needs %d ranks: start %d processes", ErrInvalid, size, ranks, ranks)
	}
	return &Job{Backend: backend, WorldSize: size, Processes: size, Rank: rank, LocalRank: localRank, LocalRanks: localSize, Addr: net.JoinHostPort(host, port)}, nil
}

// intVar reads the integer variable name, at least lo; hint says how to
// set it when it is missing.
func intVar(getenv func(string) string, name, hint string, lo int) (int, error) {
	s := strings.TrimSpace(getenv(name))
	if s == "" {
		return 0, fmt.Errorf("launch: %w: %s is not set: %s", ErrInvalid, name, hint)
	}
	v, err := strconv.Atoi(s)
	if err != nil || v < lo {
		return 0, fmt.Errorf("launch: %w: %s=%q; want an integer ≥ %d", ErrInvalid, name, s, lo)
	}
	return v, nil
}

// rankVar reads the rank variable name, which must lie in [0, size) where
// size came from sizeName.
func rankVar(getenv func(string) string, name, sizeName string, size int) (int, error) {
	s := strings.TrimSpace(getenv(name))
	if s == "" {
		return 0, fmt.Errorf("launch: %w: %s=%d is set but %s is not", ErrInvalid, sizeName, size, name)
	}
	v, err := strconv.Atoi(s)
	if err != nil || v < 0 || v >= size {
		return 0, fmt.Errorf("launch: %w: %s=%q; want an integer in [0, %d) (%s=%d)", ErrInvalid, name, s, size, sizeName, size)
	}
	return v, nil
}

// localVars reads the optional per-host size and rank variables, which
// default to one host holding the whole job.
func localVars(getenv func(string) string, sizeName, rankName string, size, rank int) (localSize, localRank int, err error) {
	localSize, localRank = size, rank
	if getenv(sizeName) != "" {
		if localSize, err = intVar(getenv, sizeName, "", 1); err != nil {
			return 0, 0, err
		}
		if localSize > size {
			return 0, 0, fmt.Errorf("launch: %w: %s=%d exceeds the world size %d", ErrInvalid, sizeName, localSize, size)
		}
	}
	if getenv(rankName) != "" {
		if localRank, err = rankVar(getenv, rankName, sizeName, localSize); err != nil {
			return 0, 0, err
		}
	} else if localRank >= localSize {
		return 0, 0, fmt.Errorf("launch: %w: %s=%d is set but %s is not", ErrInvalid, sizeName, localSize, rankName)
	}
	return localSize, localRank, nil
}

// Check reports whether this process can run its part of the job, before
// anything starts: on NCCL it loads NCCL and the CUDA driver and returns
// the loader's error (matching nccl.ErrUnavailable) where they are
// missing; the other backends (TCP included: pure Go) need nothing more
// than Detect checked.
func (j *Job) Check() error {
	if j.Backend == NCCL {
		return checkNCCL(j)
	}
	return nil
}

// Option configures Job.Run.
type Option func(*runConfig)

type runConfig struct {
	local []local.Option
	shape []int     // the mesh the ranks build, outermost axis first; nil: unknown
	log   io.Writer // where the root process says how it placed the ranks
	// device: on NCCL, open the rank's GPU as a cuda.Device (WithDevice)
	// with deviceOpts
	device     bool
	deviceOpts []cuda.DeviceOption
}

// WithMesh says which mesh the ranks will build on the world (its axis
// sizes, outermost first, as mesh.New takes them), so that on NCCL each
// process drives the GPU that comm/nccl/topology's Order gives its mesh
// position: the innermost axis (tp) on the fastest links (NVLink). Without
// it, or where the topology is unknown, process LOCAL_RANK drives GPU
// LOCAL_RANK.
func WithMesh(shape ...int) Option {
	return func(c *runConfig) { c.shape = slices.Clone(shape) }
}

// WithLog makes the process holding world rank 0 write to w how it placed
// the ranks (on NCCL: the topology's source and the GPU of every local
// mesh position).
func WithLog(w io.Writer) Option {
	return func(c *runConfig) { c.log = w }
}

// WithLocal passes opts to local.Run on the Local backend (CPU binding,
// communicator options); the other backends ignore them.
func WithLocal(opts ...local.Option) Option {
	return func(c *runConfig) { c.local = append(c.local, opts...) }
}

// Func is the body a rank runs on its world communicator.
type Func func(ctx context.Context, c comm.Communicator) error

// Run runs this process's part of the job: fn on each of WorldSize
// goroutines with local.Run on Local, or once on this process's world
// communicator on MPI (initialising and finalising MPI) and NCCL (GPU
// LocalRank, bootstrapped through the rendezvous server at Addr) and TCP
// (connected through the rendezvous server at Addr, the setup bounded by
// comm.TimeoutEnv's timeout). On MPI, NCCL and TCP an error of fn aborts
// the world communicator, so that the other
// processes' collectives fail promptly instead of waiting for it. On MPI a
// rank that fails on a communication error (comm.ErrTimeout,
// comm.ErrAborted) then writes its error to stderr and ends the whole job
// with MPI_Abort, without returning, so that mpirun exits non-zero; a
// clean run finalises MPI.
func (j *Job) Run(ctx context.Context, fn Func, opts ...Option) error {
	if fn == nil {
		return fmt.Errorf("launch: Run: %w: nil function", ErrInvalid)
	}
	var cfg runConfig
	for _, o := range opts {
		o(&cfg)
	}
	switch j.Backend {
	case Local:
		return local.Run(ctx, j.WorldSize, local.RankFunc(fn), cfg.local...)
	case MPI:
		return runMPI(ctx, j, fn)
	case NCCL:
		return runNCCL(ctx, j, fn, cfg)
	case TCP:
		return runTCP(ctx, j, fn)
	}
	return fmt.Errorf("launch: Run: %w: backend %q; want %s", ErrInvalid, j.Backend, strings.Join(Backends(), ", "))
}

// endMPIRank ends an MPI rank whose body returned err (nil: it succeeded).
// A rank that failed on a communication error (comm.ErrTimeout or
// comm.ErrAborted: a peer that never came, a peer's abort, a partition)
// writes its error to stderr and ends the whole job with abort
// (MPI_Abort, code 1), which makes mpirun end every process and exit
// non-zero: its collectives stay posted in MPI, so MPI_Finalize could
// hang, and peers that did not fail could wait for it until their own
// timeout. Otherwise it calls finalize (MPI_Finalize); if that refuses
// (operations are stuck in MPI), the rank reports both errors and aborts
// the job too. It returns err, joined with finalize's error; abort does
// not return when MPI is initialised.
func endMPIRank(rank int, err error, finalize func() error, abort func(code int), stderr io.Writer) error {
	if err != nil && (errors.Is(err, comm.ErrTimeout) || errors.Is(err, comm.ErrAborted)) {
		fmt.Fprintf(stderr, "launch: mpi: %v\nlaunch: mpi: rank %d failed on a communication error; ending the MPI job (MPI_Abort)\n", err, rank)
		abort(1)
		return err
	}
	if ferr := finalize(); ferr != nil {
		ferr = fmt.Errorf("launch: mpi: %w", ferr)
		fmt.Fprintf(stderr, "launch: mpi: rank %d: %v\nlaunch: mpi: ending the MPI job (MPI_Abort)\n", rank, errors.Join(err, ferr))
		abort(1)
		return errors.Join(err, ferr)
	}
	return err
}

// runOne runs fn on c, this process's one rank, checking first that c is
// the rank Detect expected; an error aborts c for the other processes.
func runOne(ctx context.Context, j *Job, c comm.Communicator, fn Func) error {
	if c.Size() != j.WorldSize || c.Rank() != j.Rank {
		err := fmt.Errorf("launch: %s: %w: the communicator is rank %d of %d, the environment said rank %d of %d", j.Backend, ErrInvalid, c.Rank(), c.Size(), j.Rank, j.WorldSize)
		c.Abort(err)
		return err
	}
	if err := fn(ctx, c); err != nil {
		c.Abort(err)
		return fmt.Errorf("rank %d: %w", j.Rank, err)
	}
	return nil
}
