// Command loomrun launches the processes of a loom job, on one machine or
// across several, in the manner of torchrun.
//
// Usage:
//
//	loomrun [-n N | --nproc-per-node N] [--nnodes M --node-rank K]
//	        [--master-addr ADDR] [--master-port PORT] [--join-timeout D]
//	        [--node-timeout D] [--timeout D] [--grace D] [--bind none|core]
//	        [--] prog [args...]
//
// loomrun starts N copies of prog on this machine (a node), each with the
// environment torchrun sets:
//
//	RANK              this process's rank: K·N + LOCAL_RANK
//	WORLD_SIZE        M·N
//	LOCAL_RANK        its rank on this node, 0..N-1
//	LOCAL_WORLD_SIZE  N
//	GROUP_RANK        K, this node's rank (--node-rank, default 0)
//	GROUP_WORLD_SIZE  M, the number of nodes (--nnodes, default 1)
//	MASTER_ADDR       --master-addr (default 127.0.0.1)
//	MASTER_PORT       --master-port, or the free port picked when it is 0 (the default)
//
// A loom program (package launch) runs one rank in each process: on GPU
// LOCAL_RANK through NCCL where the CUDA driver finds a GPU, and over TCP
// between the processes (comm/tcp) where it does not.
//
// Node 0 runs a rendezvous server (github.com/b7ea7098/loom/comm/rendezvous)
// on MASTER_ADDR:MASTER_PORT for the lifetime of the job: processes connect
// with rendezvous.DialEnv and use it to exchange bootstrap data (an NCCL
// unique id, addresses) and to meet at barriers. The store starts empty and
// ends with the job; keys under "loomrun/" are loomrun's own.
//
// # Several nodes
//
// A job of M nodes runs one loomrun on each, all with the same --nnodes,
// --nproc-per-node, --master-addr and --master-port (which must then be
// given: the others need node 0's port), each with its own --node-rank:
//
//	node0$ loomrun --nnodes 2 --node-rank 0 -n 4 --master-addr node0 --master-port 29500 prog
//	node1$ loomrun --nnodes 2 --node-rank 1 -n 4 --master-addr node0 --master-port 29500 prog
//
// Node 0 listens on --master-addr, so it must be an address of node 0 that
// the others reach. Before starting any process, the nodes join at node 0's
// store: each registers there (node 0's server may start after the other
// nodes; they retry) and waits until all M have, or --join-timeout (default
// 5m) passes; then the join fails on every node that came, naming the
// nodes missing. A node whose --nnodes or --nproc-per-node differs from
// another's, or a --node-rank given twice, fails the join of every node,
// which each reports. A failed join exits with status 2.
//
// Once started, the job ends everywhere when it fails anywhere: the first
// node that sees a failure (one of its ranks failed, it got a signal, or
// its --timeout passed) records it in the store, and every node, watching
// that record, ends its ranks as described below and exits with status 1
// and the message "job failed: rank R (node K) ..." naming the failed rank
// and its node (or the node, for a signal or a timeout). A node whose
// loomrun dies or can no longer be reached is caught too, by every node:
// every node other than 0 beats a heartbeat in the store, and when node 0
// has not heard one from a node for --node-timeout (default 30s), it
// fails the job naming the node; a node whose heartbeats node 0's server
// has not answered for --node-timeout (node 0 partitioned away, frozen,
// or its host gone) concludes that node 0 is lost and ends its ranks with
// "job failed: node 0's loomrun stopped responding"; and when node 0's
// loomrun dies, its server's connections close, and every other node ends
// its ranks at once. Node 0 exits only once every node has
// reported its end (or, after a failure, once they had the time to end
// their ranks), so its server outlives the other nodes' use of it, and
// its exit status is 1 if any node failed.
//
// # Binding
//
// With --bind core (the default, like mpirun's --bind-to core) each local rank is
// pinned to cores of its own on Linux: the CPUs loomrun may run on are cut
// into N equal runs of consecutive CPUs, LOCAL_RANK taking the
// LOCAL_RANK-th, so that two ranks never share a core and a rank's memory
// stays warm in its core's caches. With more ranks than CPUs, or on
// systems other than Linux, nothing is pinned and loomrun says so.
// --bind none leaves the scheduler free to move every rank anywhere. The
// environment variable LOOM_BIND, which also binds comm/local's in-process
// ranks, sets the default in its words: 1, true or auto for core; 0,
// false or none for none.
//
// Each process runs in its own process group. SIGINT and SIGTERM sent to
// loomrun are forwarded to every process's whole group; after --grace the
// ones still running get SIGKILL. When a process fails (exits with a
// non-zero status, or is killed by a signal), loomrun reports which rank
// failed and how, sends SIGTERM to the others, SIGKILL to those still
// running after --grace, waits for all of them, and exits with status 1.
// --timeout (0: none) bounds the whole job the same way.
//
// # No process left behind
//
// No process of a job outlives it: not a rank's children, not when a rank
// exits early, not when loomrun itself is killed. Each rank runs under a
// supervisor, loomrun's own binary re-executed, which starts the rank's
// program as the leader of a new process group and reports its exit to
// loomrun over a pipe:
//
//   - A rank's children stay in its group after it exits, so loomrun
//     signals every rank's group when it stops the job, including the
//     groups whose leader has exited. The supervisor learns of the rank's
//     exit without reaping it (waitid with WNOWAIT), so the rank's pid,
//     which is the group's id, cannot be reused while loomrun may signal
//     the group.
//   - Once every rank has exited, each supervisor ends what is left of its
//     rank (reported as "rank R left N process(es) running"; the exit
//     status does not change): SIGTERM to the group, SIGKILL after
//     --grace. It is a child subreaper (Linux's PR_SET_CHILD_SUBREAPER), so
//     every orphan of the rank is reparented to it, also one that left the
//     group with setsid: it signals those too, reaps them all, and exits
//     when none is left.
//   - The supervisor also watches a pipe that only loomrun holds open: when
//     loomrun exits or dies, even by SIGKILL, the kernel closes it and the
//     supervisor ends the rank's processes in the same way.
//   - If a supervisor is killed, the kernel kills its rank (the rank's
//     parent-death signal, PR_SET_PDEATHSIG, is SIGKILL); loomrun reports
//     the rank as lost, ends the job, SIGKILLs the rest of the rank's group
//     at once and, a subreaper itself, SIGKILLs the orphans reparented to it
//     before it exits.
//   - The output of a rank is read until every process holding it has
//     exited, and at most 250 ms after the rank's processes were ended, so
//     a process that escaped cannot keep the job from ending.
//
// This needs neither cgroups nor privileges. What it cannot catch is a
// process that both leaves the rank's group and escapes a killed
// supervisor while loomrun is killed too. On unix systems other than Linux
// there is no subreaper or parent-death signal: the supervisors still end
// every rank's group when the job ends or loomrun dies, but orphans that
// leave the group escape, and a group may be signalled after its leader
// was reaped. Elsewhere loomrun starts the processes directly and ends only
// them.
//
// In a job of several nodes this holds on each node for its own ranks; a
// node's loomrun that is killed takes its ranks with it, and the others
// end theirs as described under "Several nodes".
//
// Exit status: 0 when every process exited with status 0 (on node 0: on
// every node); 1 when one failed, anywhere, or the job timed out; 2 for
// bad arguments, a failed join or a failure to start; 128+n when loomrun
// was stopped by signal n (after forwarding it).
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
	nproc       int
	bind        string        // "core" or "none"
	nnodes      int           // nodes of the job; 0 counts as 1
	nodeRank    int           // this node, 0..nnodes-1
	joinTimeout time.Duration // how long the nodes wait for each other
	nodeTimeout time.Duration // how long a node waits for a silent node (or node 0's server)
	masterAddr  string
	masterPort  int
	timeout     time.Duration // whole job; 0: none
	grace       time.Duration // SIGTERM to SIGKILL
	prog        string
	args        []string
}

// parseArgs parses the command line (without the program name).
func parseArgs(args []string, stderr io.Writer) (*config, error) {
	fs := flag.NewFlagSet("loomrun", flag.ContinueOnError)
	fs.SetOutput(stderr)
	cfg := &config{}
	fs.IntVar(&cfg.nproc, "n", 1, "number of processes to start (same as --nproc-per-node)")
	fs.IntVar(&cfg.nproc, "nproc-per-node", 1, "number of processes to start on this node")
	fs.IntVar(&cfg.nnodes, "nnodes", 1, "number of nodes (one loomrun on each)")
	fs.IntVar(&cfg.nodeRank, "node-rank", 0, "this node's rank, 0..nnodes-1; node 0 runs the rendezvous server")
	fs.StringVar(&cfg.masterAddr, "master-addr", "127.0.0.1", "address of node 0's rendezvous server (MASTER_ADDR)")
	fs.IntVar(&cfg.masterPort, "master-port", 0, "port of the rendezvous server (MASTER_PORT); 0 picks a free one (one node only)")
	fs.DurationVar(&cfg.joinTimeout, "join-timeout", 5*time.Minute, "how long the nodes wait for each other to join")
	fs.DurationVar(&cfg.nodeTimeout, "node-timeout", 30*time.Second, "end the job when another node's loomrun (or node 0's rendezvous server) has not been heard from for this long")
	fs.DurationVar(&cfg.timeout, "timeout", 0, "end the whole job after this long (0: no limit)")
	fs.DurationVar(&cfg.grace, "grace", 5*time.Second, "time between SIGTERM and SIGKILL when ending processes")
	bind, bindErr := bindDefault(os.Getenv(bindEnv))
	fs.StringVar(&cfg.bind, "bind", bind, "pin each local rank to cores of its own (core) or not (none); default core, or as "+bindEnv+" says")
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "usage: loomrun [-n N] [--nnodes M --node-rank K] [--master-addr ADDR] [--master-port PORT]\n"+
			"               [--join-timeout D] [--node-timeout D] [--timeout D] [--grace D] [--bind none|core] [--] prog [args...]\n\n")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	bindSet := false
	fs.Visit(func(f *flag.Flag) { bindSet = bindSet || f.Name == "bind" })
	if bindErr != nil && !bindSet {
		return nil, bindErr
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
	case cfg.nnodes < 1:
		return nil, fmt.Errorf("--nnodes %d: need at least 1 node", cfg.nnodes)
	case cfg.nnodes > 4096 || cfg.nnodes*cfg.nproc > 1<<20:
		return nil, fmt.Errorf("--nnodes %d with %d process(es) each: at most 4096 nodes and 2^20 processes", cfg.nnodes, cfg.nproc)
	case cfg.nodeRank < 0 || cfg.nodeRank >= cfg.nnodes:
		return nil, fmt.Errorf("--node-rank %d: want 0..%d (--nnodes %d)", cfg.nodeRank, cfg.nnodes-1, cfg.nnodes)
	case cfg.masterPort < 0 || cfg.masterPort > 65535:
		return nil, fmt.Errorf("--master-port %d: not a port number", cfg.masterPort)
	case cfg.masterPort == 0 && cfg.nnodes > 1:
		return nil, fmt.Errorf("--master-port 0 with --nnodes %d: the other nodes need to know node 0's port", cfg.nnodes)
	case cfg.joinTimeout <= 0:
		return nil, fmt.Errorf("--join-timeout %v: must be positive", cfg.joinTimeout)
	case cfg.nodeTimeout <= 0:
		return nil, fmt.Errorf("--node-timeout %v: must be positive", cfg.nodeTimeout)
	case cfg.masterAddr == "":
		return nil, errors.New("--master-addr is empty")
	case cfg.timeout < 0:
		return nil, fmt.Errorf("--timeout %v is negative", cfg.timeout)
	case cfg.grace < 0:
		return nil, fmt.Errorf("--grace %v is negative", cfg.grace)
	case cfg.bind != bindCore && cfg.bind != bindNone:
		return nil, fmt.Errorf("--bind %q: want core or none", cfg.bind)
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
	// Process-wide, so here and not in run: orphans of a rank whose
	// supervisor died are reparented to loomrun, which ends them below.
	if err := setSubreaper(); err != nil {
		fmt.Fprintf(os.Stderr, "loomrun: %v; a rank whose supervisor dies may leave processes behind\n", err)
	}
	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM)
	defer signal.Stop(sigs)
	code := run(context.Background(), cfg, os.Stdout, os.Stderr, sigs)
	if n := endOrphans(sweepTimeout); n > 0 {
		fmt.Fprintf(os.Stderr, "loomrun: killed %d orphaned process(es) of the job\n", n)
	}
	return code
}

func main() {
	if isSupervisor() {
		os.Exit(superviseMain(os.Args[1:]))
	}
	os.Exit(realMain(os.Args[1:]))
}
