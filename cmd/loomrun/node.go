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
	"sync/atomic"
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

// aliveKey is node's heartbeat counter; aliveDone added to it says the
// node is done and stops beating.
func aliveKey(node int) string { return "loomrun/alive/" + strconv.Itoa(node) }

const aliveDone = 1 << 40

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

// heartbeatInterval is how often a node other than 0 tells node 0 that its
// loomrun lives, and how often node 0 checks: a tenth of --node-timeout,
// within 10 ms and 1 s.
func heartbeatInterval(nodeTimeout time.Duration) time.Duration {
	return min(max(nodeTimeout/10, 10*time.Millisecond), time.Second)
}

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
	joinBy       time.Time // the join's deadline: --join-timeout after dialling began
	nodeTimeout  time.Duration
	c            *rendezvous.Client
	logf         func(format string, args ...any)

	// failed delivers the first failure published by any node (this one
	// included), or the loss of node 0's server; it is written once.
	failed     chan string
	serverLost atomic.Bool // node 0's server is gone or unreachable: finish skips it
	stopWatch  context.CancelFunc
	watchDone  chan struct{}
	publishing sync.WaitGroup
	beats      sync.WaitGroup // the heartbeat or the monitor
	lost       chan int       // on node 0, the nodes that stopped beating
	stopBeats  context.CancelFunc
}

// dialCluster connects to node 0's server, retrying until joinTimeout
// passes (node 0 may start after this node), and starts watching the
// job's failure key.
func dialCluster(cfg *config, addr string, logf func(string, ...any)) (*cluster, error) {
	joinBy := time.Now().Add(cfg.joinTimeout)
	ctx, cancel := context.WithDeadline(context.Background(), joinBy)
	defer cancel()
	// No per-call bound: the watch of the failure key lasts the whole
	// job. Every other call carries its own deadline.
	c, err := rendezvous.Dial(ctx, addr, rendezvous.WithTimeout(0), rendezvous.WithDialTimeout(cfg.joinTimeout))
	if err != nil {
		return nil, fmt.Errorf("cannot reach node 0's rendezvous server at %s within --join-timeout %v: %w", addr, cfg.joinTimeout, err)
	}
	wctx, stop := context.WithCancel(context.Background())
	cl := &cluster{
		node: cfg.nodeRank, nnodes: cfg.nnodes, nproc: cfg.nproc, addr: addr,
		joinTimeout: cfg.joinTimeout, joinBy: joinBy, nodeTimeout: cfg.nodeTimeout,
		c: c, logf: logf, failed: make(chan string, 1), stopWatch: stop, watchDone: make(chan struct{}),
		stopBeats: func() {}, lost: make(chan int, cfg.nnodes),
	}
	go cl.watch(wctx)
	return cl, nil
}

// startBeats starts, once the nodes have joined, the heartbeat of a node
// other than 0, or on node 0 the monitor of the others' heartbeats: a
// node whose loomrun dies, even by SIGKILL, or that node 0 can no longer
// reach, stops beating, and node 0 publishes that as the job's failure
// after --node-timeout. The heartbeat is also how the other nodes watch
// node 0: its loomrun holds the server, so a node whose beats go
// unanswered for --node-timeout (node 0 partitioned away, frozen, or its
// host gone without closing the connection) fails the job on its side,
// naming node 0. (A node 0 that dies closes its connections, which every
// other node's watch sees at once.)
func (cl *cluster) startBeats() {
	ctx, cancel := context.WithCancel(context.Background())
	cl.stopBeats = cancel
	every := heartbeatInterval(cl.nodeTimeout)
	cl.beats.Add(1)
	go func() {
		defer cl.beats.Done()
		if cl.node != 0 {
			cl.beat(ctx, every)
			return
		}
		cl.monitor(ctx, every)
	}()
}

// beat adds to this node's heartbeat counter every interval until ctx
// ends. Each call may take until --node-timeout after the last answered
// one; when it gets no answer by then, node 0 is lost: beat reports it on
// cl.failed and returns.
func (cl *cluster) beat(ctx context.Context, every time.Duration) {
	t := time.NewTicker(every)
	defer t.Stop()
	answered := time.Now()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		by := answered.Add(cl.nodeTimeout)
		cctx, cancel := context.WithDeadline(ctx, by)
		_, err := cl.c.Add(cctx, aliveKey(cl.node), 1)
		cancel()
		switch {
		case err == nil:
			answered = time.Now()
		case ctx.Err() != nil: // stopped: this node is done
			return
		case !time.Now().Before(by):
			cl.lose(fmt.Sprintf("node 0's loomrun stopped responding (its rendezvous server at %s did not answer for %v)", cl.addr, cl.nodeTimeout))
			return
		}
		// Otherwise a lost connection that reconnecting could not mend
		// yet: the watch reports a closed one; the next tick retries.
	}
}

// monitor, on node 0, checks every interval that each other node's
// heartbeat counter moved within --node-timeout, and publishes the first
// node that stopped as the job's failure (and sends it on cl.lost).
func (cl *cluster) monitor(ctx context.Context, every time.Duration) {
	t := time.NewTicker(every)
	defer t.Stop()
	last := map[int]int64{}
	heard := map[int]time.Time{}
	for j := 1; j < cl.nnodes; j++ {
		heard[j] = time.Now()
	}
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		for j, at := range heard {
			cctx, cancel := context.WithTimeout(ctx, every)
			v, err := cl.c.Add(cctx, aliveKey(j), 0)
			cancel()
			switch {
			case err != nil:
				// Our own server: only a call cut short by its
				// timeout or by stopBeats; the next tick retries.
			case v >= aliveDone:
				delete(heard, j)
			case v != last[j]:
				last[j], heard[j] = v, time.Now()
			case time.Since(at) > cl.nodeTimeout:
				delete(heard, j)
				cl.lost <- j // once per node: fits the buffer
				cl.publish(fmt.Sprintf("node %d's loomrun stopped responding (no heartbeat for %v)", j, cl.nodeTimeout))
			}
		}
	}
}

// lose records that node 0's server is gone or unreachable and delivers
// reason on cl.failed, unless a failure is already there.
func (cl *cluster) lose(reason string) {
	cl.serverLost.Store(true)
	select {
	case cl.failed <- reason:
	default:
	}
}

// watch waits for the job's failure key and delivers it on cl.failed. If
// the server goes away first, that is the failure: node 0 is gone.
func (cl *cluster) watch(ctx context.Context) {
	defer close(cl.watchDone)
	v, err := cl.c.Get(ctx, keyFailed)
	switch {
	case err == nil:
		select {
		case cl.failed <- string(v):
		default: // the heartbeat reported node 0 lost first
		}
	case ctx.Err() != nil: // stopped: this node is done
	default:
		cl.lose(fmt.Sprintf("lost node 0's rendezvous server at %s: %v", cl.addr, err))
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
	ctx, cancel := context.WithDeadline(context.Background(), cl.joinBy)
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
	cl.stopBeats()
	cl.beats.Wait()
	cl.publishing.Wait()
	if cl.serverLost.Load() {
		// Nobody is there to tell: do not wait publishTimeout for it.
		cl.close()
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), publishTimeout)
	defer cancel()
	if _, err := cl.c.Add(ctx, aliveKey(cl.node), aliveDone); err != nil {
		cl.logf("cannot tell node 0 that this node is done: %v", err)
	}
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
		case j := <-cl.lost:
			// Its loomrun is gone: nothing will report.
			if waiting[j] {
				delete(waiting, j)
				missing = append(missing, j)
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
	sort.Ints(missing)
	if failed != nil {
		// Every node is done; a failure published meanwhile is there.
		select {
		case first = <-failed:
		default:
		}
	}
	return failures, first, missing
}
