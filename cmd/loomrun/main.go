// Command loomrun launches the processes of a loom job on this machine, in
// the manner of torchrun.
//
// Usage:
//
//	loomrun [-n N | --nproc-per-node N] [--master-addr ADDR] [--master-port PORT]
//	        [--timeout D] [--grace D] [--] prog [args...]
//
// loomrun starts N copies of prog, each with the environment torchrun sets:
//
//	RANK              this process's rank, 0..N-1
//	WORLD_SIZE        N
//	LOCAL_RANK        = RANK (one machine)
//	LOCAL_WORLD_SIZE  N
//	MASTER_ADDR       --master-addr (default 127.0.0.1)
//	MASTER_PORT       --master-port, or the free port picked when it is 0 (the default)
//
// Before starting them, loomrun runs a rendezvous server
// (github.com/b7ea7098/loom/comm/rendezvous) at MASTER_ADDR:MASTER_PORT for
// the lifetime of the job: processes connect with rendezvous.DialEnv and use
// it to exchange bootstrap data (an NCCL unique id, addresses) and to meet
// at barriers. The store starts empty and ends with the job.
//
// Every line a process writes to stdout or stderr is copied to loomrun's
// stdout or stderr with the prefix "[rank R] ". Lines are written whole, so
// lines of different ranks never mix; a partial last line gets a newline, and
// a line longer than 64 KiB is split into prefixed pieces. Standard input of
// the processes is empty.
//
// Each process runs in its own process group. SIGINT and SIGTERM sent to
// loomrun are forwarded to every running process (to its whole group);
// after --grace the ones still running get SIGKILL. When a process fails
// (exits with a non-zero status, or is killed by a signal), loomrun reports
// which rank failed and how, sends SIGTERM to the others, SIGKILL to those
// still running after --grace, waits for all of them, and exits with status
// 1. --timeout (0: none) bounds the whole job the same way. If loomrun itself
// dies, Linux sends its processes SIGTERM.
//
// Exit status: 0 when every process exited with status 0; 1 when one failed
// or the job timed out; 2 for bad arguments or a failure to start; 128+n
// when loomrun was stopped by signal n (after forwarding it).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
	"time"
)

// config is the parsed command line.
type config struct {
	nproc      int
	masterAddr string
	masterPort int
	timeout    time.Duration // whole job; 0: none
	grace      time.Duration // SIGTERM to SIGKILL
	prog       string
	args       []string
}

// parseArgs parses the command line (without the program name).
func parseArgs(args []string, stderr io.Writer) (*config, error) {
	fs := flag.NewFlagSet("loomrun", flag.ContinueOnError)
	fs.SetOutput(stderr)
	cfg := &config{}
	fs.IntVar(&cfg.nproc, "n", 1, "number of processes to start (same as --nproc-per-node)")
	fs.IntVar(&cfg.nproc, "nproc-per-node", 1, "number of processes to start")
	fs.StringVar(&cfg.masterAddr, "master-addr", "127.0.0.1", "address of the rendezvous server (MASTER_ADDR)")
	fs.IntVar(&cfg.masterPort, "master-port", 0, "port of the rendezvous server (MASTER_PORT); 0 picks a free one")
	fs.DurationVar(&cfg.timeout, "timeout", 0, "end the whole job after this long (0: no limit)")
	fs.DurationVar(&cfg.grace, "grace", 5*time.Second, "time between SIGTERM and SIGKILL when ending processes")
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "usage: loomrun [-n N] [--master-addr ADDR] [--master-port PORT] [--timeout D] [--grace D] [--] prog [args...]\n\n")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	rest := fs.Args()
	if len(rest) == 0 {
		return nil, errors.New("no program to run")
	}
	cfg.prog, cfg.args = rest[0], rest[1:]
	switch {
	case cfg.nproc < 1:
		return nil, fmt.Errorf("-n %d: need at least 1 process", cfg.nproc)
	case cfg.nproc > 4096:
		return nil, fmt.Errorf("-n %d: at most 4096 processes", cfg.nproc)
	case cfg.masterPort < 0 || cfg.masterPort > 65535:
		return nil, fmt.Errorf("--master-port %d: not a port number", cfg.masterPort)
	case cfg.masterAddr == "":
		return nil, errors.New("--master-addr is empty")
	case cfg.timeout < 0:
		return nil, fmt.Errorf("--timeout %v is negative", cfg.timeout)
	case cfg.grace < 0:
		return nil, fmt.Errorf("--grace %v is negative", cfg.grace)
	}
	return cfg, nil
}

// realMain runs loomrun with the given arguments and returns its exit status.
func realMain(args []string) int {
	cfg, err := parseArgs(args, os.Stderr)
	if err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		fmt.Fprintf(os.Stderr, "loomrun: %v\n", err)
		return 2
	}
	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM)
	defer signal.Stop(sigs)
	return run(context.Background(), cfg, os.Stdout, os.Stderr, sigs)
}

func main() {
	os.Exit(realMain(os.Args[1:]))
}
