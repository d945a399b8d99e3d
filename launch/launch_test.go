package launch

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/b7ea7098/loom"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/nccl"
	"github.com/b7ea7098/loom/device/cuda"
)

// env is a fake environment.
func env(kv ...string) func(string) string {
	m := map[string]string{}
	for i := 0; i+1 < len(kv); i += 2 {
		m[kv[i]] = kv[i+1]
	}
	return func(k string) string { return m[k] }
}

func TestDetect(t *testing.T) {
	torch := []string{"RANK", "1", "WORLD_SIZE", "4", "LOCAL_RANK", "1", "LOCAL_WORLD_SIZE", "2", "MASTER_ADDR", "127.0.0.1", "MASTER_PORT", "29500"}
	with := func(base []string, kv ...string) []string { return append(append([]string(nil), base...), kv...) }
	ompi := []string{"OMPI_COMM_WORLD_SIZE", "4", "OMPI_COMM_WORLD_RANK", "3", "OMPI_COMM_WORLD_LOCAL_SIZE", "4", "OMPI_COMM_WORLD_LOCAL_RANK", "3"}
	mpiJob := &Job{Backend: MPI, WorldSize: 4, Processes: 4, Rank: 3, LocalRank: 3, LocalRanks: 4}
	tests := []struct {
		name    string
		env     []string
		backend string
		ranks   int
		want    *Job   // nil: an error
		wantErr string // part of the error
		mpiOnly bool   // the case needs (or, with wantErr, contradicts) the mpi build
		gpu     bool   // the host's CUDA driver finds a GPU
	}{
		{name: "nothing set is local", ranks: 4, want: &Job{Backend: Local, WorldSize: 4, Processes: 1, LocalRanks: 4}},
		{name: "flag local over torchrun", env: torch, backend: "local", ranks: 2, want: &Job{Backend: Local, WorldSize: 2, Processes: 1, LocalRanks: 2}},
		{name: "LOOM_BACKEND local", env: with(ompi, BackendEnv, "local"), ranks: 1, want: &Job{Backend: Local, WorldSize: 1, Processes: 1, LocalRanks: 1}},
		{name: "unknown flag", backend: "gloo", ranks: 1, wantErr: `-backend="gloo"; want local, mpi, nccl, tcp`},
		{name: "unknown env", env: []string{BackendEnv, "gloo"}, ranks: 1, wantErr: `LOOM_BACKEND="gloo"`},
		{name: "no ranks", ranks: 0, wantErr: "asks for 0 ranks"},
		{name: "torchrun with GPUs", env: torch, gpu: true, ranks: 4, want: &Job{Backend: NCCL, WorldSize: 4, Processes: 4, Rank: 1, LocalRank: 1, LocalRanks: 2, Addr: "127.0.0.1:29500"}},
		{name: "torchrun without GPUs", env: torch, ranks: 4, want: &Job{Backend: TCP, WorldSize: 4, Processes: 4, Rank: 1, LocalRank: 1, LocalRanks: 2, Addr: "127.0.0.1:29500"}},
		{name: "flag nccl without GPUs", env: torch, backend: "nccl", ranks: 4, want: &Job{Backend: NCCL, WorldSize: 4, Processes: 4, Rank: 1, LocalRank: 1, LocalRanks: 2, Addr: "127.0.0.1:29500"}},
		{name: "LOOM_BACKEND tcp with GPUs", env: with(torch, BackendEnv, "tcp"), gpu: true, ranks: 4, want: &Job{Backend: TCP, WorldSize: 4, Processes: 4, Rank: 1, LocalRank: 1, LocalRanks: 2, Addr: "127.0.0.1:29500"}},
		{name: "tcp without LOCAL_RANK", env: []string{"RANK", "2", "WORLD_SIZE", "3", "MASTER_ADDR", "h", "MASTER_PORT", "1"}, ranks: 3, want: &Job{Backend: TCP, WorldSize: 3, Processes: 3, Rank: 2, LocalRank: 2, LocalRanks: 3, Addr: "h:1"}},
		{name: "tcp requested, nothing set", backend: "tcp", ranks: 2, wantErr: "WORLD_SIZE is not set: start the program with loomrun or torchrun"},
		{name: "tcp, no MASTER_ADDR", env: with(torch, "MASTER_ADDR", ""), ranks: 4, wantErr: "MASTER_ADDR"},
		{name: "WORLD_SIZE without RANK", env: []string{"WORLD_SIZE", "2"}, ranks: 2, wantErr: "WORLD_SIZE=2 is set but RANK is not"},
		{name: "RANK without WORLD_SIZE", env: []string{"RANK", "0"}, ranks: 2, wantErr: "WORLD_SIZE is not set"},
		{name: "RANK past WORLD_SIZE", env: with(torch, "RANK", "4"), ranks: 4, wantErr: `RANK="4"; want an integer in [0, 4)`},
		{name: "RANK not a number", env: with(torch, "RANK", "one"), ranks: 4, wantErr: `RANK="one"`},
		{name: "world size against layout", env: torch, ranks: 2, wantErr: "WORLD_SIZE=4 but the layout needs 2 ranks"},
		{name: "nccl, no LOCAL_RANK", env: []string{"RANK", "0", "WORLD_SIZE", "1", "MASTER_ADDR", "h", "MASTER_PORT", "1"}, gpu: true, ranks: 1, wantErr: "LOCAL_RANK"},
		{name: "LOCAL_RANK past LOCAL_WORLD_SIZE", env: with(torch, "LOCAL_RANK", "2"), ranks: 4, wantErr: `LOCAL_RANK="2"; want an integer in [0, 2)`},
		{name: "no MASTER_PORT", env: with(torch, "MASTER_PORT", ""), ranks: 4, wantErr: "MASTER_PORT"},
		{name: "bad MASTER_PORT", env: with(torch, "MASTER_PORT", "70000"), ranks: 4, wantErr: `MASTER_PORT="70000"`},
		{name: "nccl requested, nothing set", backend: "nccl", ranks: 2, wantErr: "WORLD_SIZE is not set: start the program with loomrun or torchrun"},
		{name: "mpirun, no tag", env: ompi, ranks: 4, wantErr: "launched by mpirun (OMPI_COMM_WORLD_SIZE=4) but built without -tags mpi: rebuild with go build -tags mpi"},
		{name: "mpi requested, no tag", env: []string{BackendEnv, "mpi"}, ranks: 4, wantErr: "needs a binary built with -tags mpi"},
		{name: "mpirun", env: ompi, ranks: 4, want: mpiJob, mpiOnly: true},
		{name: "mpirun, world size against layout", env: ompi, ranks: 2, wantErr: "OMPI_COMM_WORLD_SIZE=4 but the layout needs 2 ranks: start it with mpirun -np 2", mpiOnly: true},
		{name: "mpirun, rank missing", env: []string{"OMPI_COMM_WORLD_SIZE", "2"}, ranks: 2, wantErr: "OMPI_COMM_WORLD_SIZE=2 is set but OMPI_COMM_WORLD_RANK is not", mpiOnly: true},
		{name: "mpi requested, not under mpirun", backend: "mpi", ranks: 2, wantErr: "OMPI_COMM_WORLD_SIZE is not set: start the program with mpirun", mpiOnly: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			isNoTagCase := strings.Contains(tt.wantErr, "-tags mpi")
			if tt.mpiOnly != mpiBuilt && (tt.mpiOnly || isNoTagCase) {
				t.Skipf("needs a build with mpi=%v", tt.mpiOnly)
			}
			probed := false
			gpus := func(getenv func(string) string) bool {
				probed = true
				return tt.gpu
			}
			job, err := detect(env(tt.env...), tt.backend, tt.ranks, gpus)
			// The probe loads the CUDA driver: only an automatic choice
			// under torchrun needs it.
			if auto := tt.backend == "" && !slices.Contains(tt.env, BackendEnv) && (slices.Contains(tt.env, "RANK") || slices.Contains(tt.env, "WORLD_SIZE")); probed != auto {
				t.Errorf("GPU probe called: %v; want %v", probed, auto)
			}
			if tt.want != nil {
				if err != nil {
					t.Fatalf("Detect: %v", err)
				}
				if *job != *tt.want {
					t.Fatalf("Detect = %+v, want %+v", *job, *tt.want)
				}
				return
			}
			if err == nil {
				t.Fatalf("Detect = %+v, want an error containing %q", *job, tt.wantErr)
			}
			if !errors.Is(err, ErrInvalid) || !errors.Is(err, loom.ErrInvalid) {
				t.Errorf("error %v does not match ErrInvalid and loom.ErrInvalid", err)
			}
			if !strings.Contains(err.Error(), tt.wantErr) || !strings.HasPrefix(err.Error(), "launch: ") {
				t.Errorf("error %q; want it to start with \"launch: \" and contain %q", err, tt.wantErr)
			}
		})
	}
}

func TestRunLocal(t *testing.T) {
	job, err := Detect(env(), "", 3)
	if err != nil {
		t.Fatal(err)
	}
	var seen atomic.Int64
	err = job.Run(context.Background(), func(ctx context.Context, c comm.Communicator) error {
		x := []float32{1}
		if err := comm.AllReduce(ctx, c, comm.Host(x), comm.Host(x), comm.Sum); err != nil {
			return err
		}
		if x[0] != 3 || c.Size() != 3 {
			return errors.New("wrong world")
		}
		seen.Add(1 << (4 * c.Rank()))
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if seen.Load() != 0x111 {
		t.Fatalf("ranks seen %#x, want 0x111", seen.Load())
	}
	if err := job.Run(context.Background(), nil); !errors.Is(err, ErrInvalid) {
		t.Errorf("Run(nil) = %v, want ErrInvalid", err)
	}
	bad := &Job{Backend: "gloo"}
	if err := bad.Run(context.Background(), func(context.Context, comm.Communicator) error { return nil }); !errors.Is(err, ErrInvalid) {
		t.Errorf("Run on backend gloo = %v, want ErrInvalid", err)
	}
}

func TestRunNCCLUnavailable(t *testing.T) {
	// A library path that does not exist: the loader's error, before any
	// rendezvous.
	t.Setenv("LOOM_NCCL", t.TempDir()+"/libnccl-missing.so")
	job, err := Detect(env("RANK", "0", "WORLD_SIZE", "1", "LOCAL_RANK", "0", "MASTER_ADDR", "127.0.0.1", "MASTER_PORT", "1"), NCCL, 1)
	if err != nil {
		t.Fatal(err)
	}
	if err := job.Check(); !errors.Is(err, nccl.ErrUnavailable) || !strings.Contains(err.Error(), "launch: nccl (RANK=0 LOCAL_RANK=0)") {
		t.Errorf("Check = %v, want the NCCL loader's error", err)
	}
	err = job.Run(context.Background(), func(context.Context, comm.Communicator) error { return nil })
	if !errors.Is(err, nccl.ErrUnavailable) || !strings.Contains(err.Error(), "launch: nccl (RANK=0 LOCAL_RANK=0)") {
		t.Fatalf("Run = %v, want the NCCL loader's error", err)
	}
	local, err := InProcess(2)
	if err != nil || local.Check() != nil {
		t.Errorf("InProcess(2) = %+v, %v; Check = %v", local, err, local.Check())
	}
}

// TestEndMPIRank: a rank that failed on a communication error reports it
// and aborts the MPI job without finalizing; a clean rank finalizes; a
// Finalize that refuses aborts too.
func TestEndMPIRank(t *testing.T) {
	timeout := &comm.Error{Backend: "mpi", Rank: 1, Op: comm.OpAllReduce, Seq: 33, Peer: -1, Err: fmt.Errorf("%w after 10s", comm.ErrTimeout)}
	aborted := &comm.Error{Backend: "mpi", Rank: 1, Op: comm.OpAllReduce, Seq: 34, Peer: -1, Err: &comm.AbortError{Rank: 0, Cause: errors.New("rank 0 failed")}}
	stuck := errors.New("mpi: Finalize: 1 operations abandoned")
	bad := fmt.Errorf("setup: %w", ErrInvalid)
	tests := []struct {
		name        string
		err, ferr   error
		finalized   bool
		aborted     bool
		stderrWants []string
	}{
		{name: "clean", finalized: true},
		{name: "timeout", err: fmt.Errorf("rank 1: step 3: %w", timeout), aborted: true,
			stderrWants: []string{"allreduce #33: timed out after 10s", "rank 1 failed on a communication error; ending the MPI job (MPI_Abort)"}},
		{name: "peer aborted", err: fmt.Errorf("rank 1: %w", aborted), aborted: true,
			stderrWants: []string{"communicator aborted by rank 0", "ending the MPI job (MPI_Abort)"}},
		{name: "other error", err: bad, finalized: true},
		{name: "finalize refuses", err: bad, ferr: stuck, finalized: true, aborted: true,
			stderrWants: []string{"rank 1: setup: invalid job", "Finalize: 1 operations abandoned", "ending the MPI job (MPI_Abort)"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var finalized, abortedJob bool
			var stderr strings.Builder
			err := endMPIRank(1, tc.err, func() error { finalized = true; return tc.ferr }, func(code int) {
				if code == 0 {
					t.Errorf("abort code 0")
				}
				abortedJob = true
			}, &stderr)
			if finalized != tc.finalized || abortedJob != tc.aborted {
				t.Errorf("finalized %v, aborted %v; want %v, %v", finalized, abortedJob, tc.finalized, tc.aborted)
			}
			if tc.err != nil && !errors.Is(err, tc.err) || tc.ferr != nil && !strings.Contains(fmt.Sprint(err), tc.ferr.Error()) || tc.err == nil && tc.ferr == nil && err != nil {
				t.Errorf("returned %v; want %v and %v", err, tc.err, tc.ferr)
			}
			for _, w := range tc.stderrWants {
				if !strings.Contains(stderr.String(), w) {
					t.Errorf("stderr %q lacks %q", stderr.String(), w)
				}
			}
			if len(tc.stderrWants) == 0 && stderr.Len() > 0 {
				t.Errorf("stderr %q, want nothing", stderr.String())
			}
		})
	}
}

// TestAuto: Auto reads the process's own environment (not a fake one):
// nothing set is in-process ranks, loomrun's variables on a host without
// GPUs one TCP rank of this process's RANK, LOOM_BACKEND overrides the
// choice, and a world of the wrong size is refused.
func TestAuto(t *testing.T) {
	vars := []string{BackendEnv, "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", cuda.DriverEnv}
	loomrun := []string{"RANK", "1", "WORLD_SIZE", "2", "LOCAL_RANK", "1", "LOCAL_WORLD_SIZE", "2", "MASTER_ADDR", "127.0.0.1", "MASTER_PORT", "29500", cuda.DriverEnv, "off"}
	tests := []struct {
		name    string
		env     []string
		ranks   int
		want    *Job
		wantErr string
	}{
		{"nothing set", nil, 3, &Job{Backend: Local, WorldSize: 3, Processes: 1, LocalRanks: 3}, ""},
		{"loomrun without GPUs", loomrun, 2, &Job{Backend: TCP, WorldSize: 2, Processes: 2, Rank: 1, LocalRank: 1, LocalRanks: 2, Addr: "127.0.0.1:29500"}, ""},
		{"LOOM_BACKEND=local under loomrun", append(slices.Clone(loomrun), BackendEnv, "local"), 2, &Job{Backend: Local, WorldSize: 2, Processes: 1, LocalRanks: 2}, ""},
		{"world of the wrong size", loomrun, 4, nil, "WORLD_SIZE=2 but the layout needs 4 ranks"},
		{"LOOM_BACKEND=tcp without loomrun", []string{BackendEnv, "tcp"}, 2, nil, "WORLD_SIZE is not set"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			for _, v := range vars {
				t.Setenv(v, "")
			}
			for i := 0; i+1 < len(tc.env); i += 2 {
				t.Setenv(tc.env[i], tc.env[i+1])
			}
			got, err := Auto(tc.ranks)
			if tc.want == nil {
				if err == nil || !errors.Is(err, loom.ErrInvalid) || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("Auto(%d) = %+v, %v; want an error matching loom.ErrInvalid with %q", tc.ranks, got, err, tc.wantErr)
				}
				return
			}
			if err != nil || *got != *tc.want {
				t.Fatalf("Auto(%d) = %+v, %v; want %+v", tc.ranks, got, err, tc.want)
			}
		})
	}
}
