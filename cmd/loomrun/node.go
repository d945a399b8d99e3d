package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/b7ea7098/loom/comm/rendezvous"
)

// The keys loomrun's nodes use in the job's rendezvous store. The ranks
// share the store; they must leave the "loomrun/" prefix alone.
const (
	keyFailed = "loomrun/failed"       // the first failure anywhere: its description
	keyClaim  = "loomrun/failed/claim" // counter: the node that takes it to 1 sets keyFailed
)

func joinKey(node int) string { return "loomrun/join/" + strconv.Itoa(node) } // counter: duplicate node ranks
func nodeKey(node int) string { return "loomrun/node/" + strconv.Itoa(node) } // the node's record
func doneKey(node int) string { return "loomrun/done/" + strconv.Itoa(node) } // "ok" or "failed: why"

const (
	// publishTimeout bounds telling the other nodes of a failure or of
	// this node's end.
	publishTimeout = 5 * time.Second
	// joinFailureWait is how long node 0 keeps its server up after a
	// failed join, so that the nodes that joined can read why.
	joinFailureWait = 5 * time.Second
	// stopSlack is added to the time a node needs to end its ranks
	// (--grace, then the supervisors' sweep) when node 0 waits for the
	// other nodes after a failure.
	stopSlack = 5 * time.Second
)

// nodeRecord is what a node tells the others when it joins: the flags
// that must agree, and where it runs (for messages).
type nodeRecord struct {
	nnodes, nproc int
	host          string
	pid           int
}

func (r nodeRecord) encode() []byte {
	return []byte(fmt.Sprintf("nnodes=%d nproc=%d pid=%d host=%s", r.nnodes, r.nproc, r.pid, r.host))
}

func decodeRecord(b []byte) (nodeRecord, error) {
	var r nodeRecord
	if _, err := fmt.Sscanf(string(b), "nnodes=%d nproc=%d pid=%d host=%s", &r.nnodes, &r.nproc, &r.pid, &r.host); err != nil {
		return r, fmt.Errorf("malformed node record %q: %w", b, err)
	}
	return r, nil
}

// cluster is one node's part in a job of several nodes: its client of node
// 0's rendezvous server, and the watch of the job's failure key.
type cluster struct {
	node, nnodes int
	nproc        int
	addr         string // node 0's server
	joinTimeout  time.Duration
	c            *rendezvous.Client
	logf         func(format string, args ...any)

	// failed delivers the first failure published by any node (this one
	// included), or the loss of node 0's server; it is written once.
	failed     chan string
	stopWatch  context.CancelFunc
	watchDone  chan struct{}
	publishing sync.WaitGroup
	claimed    bool // this node published the job's failure (guarded by mu)
	mu         sync.Mutex
}

// dialCluster connects to node 0's server, retrying until joinTimeout
// passes (node 0 may start after this node), and starts watching the
// job's failure key.
func dialCluster(cfg *config, addr string, logf func(string, ...any)) (*cluster, error) {
	ctx, cancel := context.WithTimeout(context.Background(), cfg.joinTimeout)
	defer cancel()
	// No per-call bound: the watch of the failure key lasts the whole
	// job. Every other call carries its own deadline.
	c, err := rendezvous.Dial(ctx, addr, rendezvous.WithTimeout(0), rendezvous.WithDialTimeout(cfg.joinTimeout))
	if err != nil {
		return nil, fmt.Errorf("cannot reach node 0's rendezvous server at %s within --join-timeout %v: %w", addr, cfg.joinTimeout, err)
	}
	wctx, stop := context.WithCancel(context.Background())
	cl := &cluster{
		node: cfg.nodeRank, nnodes: cfg.nnodes, nproc: cfg.nproc, addr: addr, joinTimeout: cfg.joinTimeout,
		c: c, logf: logf, failed: make(chan string, 1), stopWatch: stop, watchDone: make(chan struct{}),
	}
	go cl.watch(wctx)
	return cl, nil
}

// watch waits for the job's failure key and delivers it on cl.failed. If
// the server goes away first, that is the failure: node 0 is gone.
func (cl *cluster) watch(ctx context.Context) {
	defer close(cl.watchDone)
	v, err := cl.c.Get(ctx, keyFailed)
	switch {
	case err == nil:
		cl.failed <- string(v)
	case ctx.Err() != nil: // stopped: this node is done
	default:
		cl.failed <- fmt.Sprintf("lost node 0's rendezvous server at %s: %v", cl.addr, err)
	}
}

// publish tells every node that the job failed, unless some node already
// did; it does not block.
func (cl *cluster) publish(reason string) {
	cl.publishing.Add(1)
	go func() {
		defer cl.publishing.Done()
		ctx, cancel := context.WithTimeout(context.Background(), publishTimeout)
		defer cancel()
		n, err := cl.c.Add(ctx, keyClaim, 1)
		if err == nil && n == 1 {
			cl.mu.Lock()
			cl.claimed = true
			cl.mu.Unlock()
			err = cl.c.Set(ctx, keyFailed, []byte(reason))
		}
		if err != nil {
			cl.logf("cannot tell the other nodes that the job failed: %v", err)
		}
	}()
}

// nodeNames formats node ranks: "node 1" or "nodes 1,3".
func nodeNames(nodes []int) string {
	if len(nodes) == 1 {
		return "node " + strconv.Itoa(nodes[0])
	}
	return "nodes " + rankList(nodes)
}

// join registers this node and waits until every node has, checking that
// they agree on --nnodes and --nproc-per-node. It returns the nodes that
// joined (this one included), also when it fails: node 0 waits for them to
// learn of the failure before it closes the server. A failure that this
// node finds is published, so every node reports it.
func (cl *cluster) join() (joined map[int]bool, err error) {
	ctx, cancel := context.WithTimeout(context.Background(), cl.joinTimeout)
	defer cancel()
	joined = map[int]bool{}
	fail := func(err error) (map[int]bool, error) {
		cl.publish("join failed: " + err.Error())
		return joined, err
	}
	n, err := cl.c.Add(ctx, joinKey(cl.node), 1)
	if err != nil {
		return joined, err
	}
	if n > 1 {
		// The first node with this rank is the one the others know:
		// report it, not this one, as joined.
		return fail(fmt.Errorf("--node-rank %d was given to two nodes", cl.node))
	}
	host, err := os.Hostname()
	if err != nil {
		host = "unknown"
	}
	me := nodeRecord{nnodes: cl.nnodes, nproc: cl.nproc, host: strings.ReplaceAll(host, " ", "_"), pid: os.Getpid()}
	if err := cl.c.Set(ctx, nodeKey(cl.node), me.encode()); err != nil {
		return joined, err
	}
	joined[cl.node] = true

	type arrival struct {
		node int
		rec  nodeRecord
		err  error
	}
	arrivals := make(chan arrival, cl.nnodes)
	gctx, stopGets := context.WithCancel(ctx)
	var wg sync.WaitGroup
	defer func() {
		stopGets()
		wg.Wait()
	}()
	for j := 0; j < cl.nnodes; j++ {
		if j == cl.node {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			v, err := cl.c.Get(gctx, nodeKey(j))
			a := arrival{node: j, err: err}
			if err == nil {
				a.rec, a.err = decodeRecord(v)
			}
			arrivals <- a
		}()
	}
	for len(joined) < cl.nnodes {
		select {
		case a := <-arrivals:
			switch {
			case a.err != nil && ctx.Err() != nil:
				var missing []int
				for j := 0; j < cl.nnodes; j++ {
					if !joined[j] {
						missing = append(missing, j)
					}
				}
				return fail(fmt.Errorf("%s did not join within --join-timeout %v", nodeNames(missing), cl.joinTimeout))
			case a.err != nil:
				return joined, fmt.Errorf("node %d's record: %w", a.node, a.err)
			}
			joined[a.node] = true
			if err := mismatch(cl.node, me, a.node, a.rec); err != nil {
				return fail(err)
			}
		case reason := <-cl.failed:
			cl.failed <- reason // for the caller's end of the job, which reads it again
			return joined, errors.New(strings.TrimPrefix(reason, "join failed: "))
		}
	}
	return joined, nil
}

// mismatch reports flags on which nodes a and b disagree, naming them in
// the same order on every node.
func mismatch(a int, ra nodeRecord, b int, rb nodeRecord) error {
	if a > b {
		a, b, ra, rb = b, a, rb, ra
	}
	switch {
	case ra.nnodes != rb.nnodes:
		return fmt.Errorf("node %d has --nnodes %d, node %d (host %s) has %d", a, ra.nnodes, b, rb.host, rb.nnodes)
	case ra.nproc != rb.nproc:
		return fmt.Errorf("node %d has --nproc-per-node %d, node %d (host %s) has %d", a, ra.nproc, b, rb.host, rb.nproc)
	}
	return nil
}

// finish reports this node's end (outcome "" for success), waits for its
// publications, and closes the client.
func (cl *cluster) finish(outcome string) {
	cl.publishing.Wait()
	ctx, cancel := context.WithTimeout(context.Background(), publishTimeout)
	defer cancel()
	v := "ok"
	if outcome != "" {
		v = "failed: " + outcome
	}
	if err := cl.c.Set(ctx, doneKey(cl.node), []byte(v)); err != nil {
		cl.logf("cannot tell node 0 that this node is done: %v", err)
	}
	cl.close()
}

// close stops the watch and closes the client.
func (cl *cluster) close() {
	cl.stopWatch()
	<-cl.watchDone
	// Client.Close always returns nil.
	_ = cl.c.Close()
}

// awaitNodes, on node 0, waits until every node in nodes other than this
// one has reported its end, so that the server outlives their use of it.
// bound (0: none) limits the wait; after a failure anywhere (on cl.failed)
// the wait is limited to afterFailure. It returns the failures the nodes
// reported, the job's failure if one was published (it names the rank or
// node that failed first; "" if none), and the nodes that did not report.
func (cl *cluster) awaitNodes(nodes map[int]bool, bound, afterFailure time.Duration, sigs <-chan os.Signal) (failures []string, first string, missing []int) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	type report struct {
		node int
		v    string
		err  error
	}
	reports := make(chan report, len(nodes))
	var wg sync.WaitGroup
	defer func() {
		cancel()
		wg.Wait()
	}()
	waiting := map[int]bool{}
	for j := range nodes {
		if j == cl.node {
			continue
		}
		waiting[j] = true
		wg.Add(1)
		go func() {
			defer wg.Done()
			v, err := cl.c.Get(ctx, doneKey(j))
			reports <- report{node: j, v: string(v), err: err}
		}()
	}
	var timer <-chan time.Time
	if bound > 0 {
		t := time.NewTimer(bound)
		defer t.Stop()
		timer = t.C
	}
	failed := cl.failed
	for len(waiting) > 0 {
		select {
		case r := <-reports:
			delete(waiting, r.node)
			if r.err != nil {
				cl.logf("node %d's report: %v", r.node, r.err)
			} else if f, ok := strings.CutPrefix(r.v, "failed: "); ok {
				failures = append(failures, f)
			}
		case first = <-failed:
			failed = nil
			t := time.NewTimer(afterFailure)
			defer t.Stop()
			timer = t.C
		case sig := <-sigs:
			cl.logf("received %s while waiting for the other nodes; telling them to stop", sigString(sig))
			cl.publish(fmt.Sprintf("node %d's loomrun received %s", cl.node, sigString(sig)))
		case <-timer:
			for j := range waiting {
				missing = append(missing, j)
			}
			sort.Ints(missing)
			return failures, first, missing
		}
	}
	if failed != nil {
		// Every node is done; a failure published meanwhile is there.
		select {
		case first = <-failed:
		default:
		}
	}
	return failures, first, nil
}
