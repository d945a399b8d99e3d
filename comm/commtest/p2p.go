package commtest

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync/atomic"

	"github.com/b7ea7098/loom/comm"
)

// start issues call asynchronously: through the typed Async helper when no
// algorithm is forced, else through Start.
func start(ctx context.Context, c comm.Communicator, call comm.Call) (comm.Work, error) {
	if call.Algorithm != comm.Auto {
		return c.Start(ctx, call)
	}
	switch call.Op {
	case comm.OpAllReduce:
		return comm.AllReduceAsync(ctx, c, call.Send, call.Recv, call.Reduce)
	case comm.OpBroadcast:
		return comm.BroadcastAsync(ctx, c, call.Recv, call.Root)
	case comm.OpReduce:
		return comm.ReduceAsync(ctx, c, call.Send, call.Recv, call.Reduce, call.Root)
	case comm.OpAllGather:
		return comm.AllGatherAsync(ctx, c, call.Send, call.Recv)
	case comm.OpReduceScatter:
		return comm.ReduceScatterAsync(ctx, c, call.Send, call.Recv, call.Reduce)
	case comm.OpGather:
		return comm.GatherAsync(ctx, c, call.Send, call.Recv, call.Root)
	case comm.OpScatter:
		return comm.ScatterAsync(ctx, c, call.Send, call.Recv, call.Root)
	case comm.OpAllToAll:
		return comm.AllToAllAsync(ctx, c, call.Send, call.Recv)
	case comm.OpAllToAllV:
		return comm.AllToAllVAsync(ctx, c, call.Send, call.Recv, call.SendCounts, call.RecvCounts)
	case comm.OpSend:
		return comm.SendAsync(ctx, c, call.Send, call.Peer, call.Tag)
	case comm.OpRecv:
		return comm.RecvAsync(ctx, c, call.Recv, call.Peer, call.Tag)
	case comm.OpBarrier:
		return comm.BarrierAsync(ctx, c)
	}
	return c.Start(ctx, call)
}

// sendRecvCase checks point-to-point transfers on p >= 2 ranks:
//   - ring: every rank posts SendAsync to the next rank and RecvAsync from
//     the previous one, then waits for both;
//   - tags: every rank sends three messages to the next rank, tagged 7, 9
//     and 7 (with n, n+1 and n+2 elements), and posts its receives in the
//     order 9, 7, 7: tags select the message, and messages with one tag
//     match in the order they were sent;
//   - blocking: blocking Send and Recv around the ring, even ranks sending
//     first and odd ranks receiving first.
func sendRecvCase(k *kase) (rankFunc, func(int) error) {
	p, n := k.p, k.n
	type message struct {
		tag int
		in  *inputs
	}
	ins := shared(k, "in", func() []*inputs {
		return []*inputs{
			newInputs(k.dt, k.seed, Mixed, p, fixed(n)),
			newInputs(k.dt, k.seed+1, Mixed, p, fixed(n)),
			newInputs(k.dt, k.seed+2, Mixed, p, fixed(n+1)),
			newInputs(k.dt, k.seed+3, Mixed, p, fixed(n+2)),
			newInputs(k.dt, k.seed+4, Mixed, p, fixed(n)),
		}
	})
	ring, blocking := ins[0], ins[4]
	tagged := []message{{7, ins[1]}, {9, ins[2]}, {7, ins[3]}}
	recvOrder := []int{1, 0, 2} // indices into tagged
	return func(ctx context.Context, c comm.Communicator) error {
		r := c.Rank()
		next, prev := (r+1)%p, (r+p-1)%p
		var errs []error
		from := fmt.Sprintf("rank %d's", prev)

		// Ring.
		recv := garbage(k.dt, n)
		sw, err := start(ctx, c, comm.Call{Op: comm.OpSend, Send: ring.get(r), Peer: next, Algorithm: k.algo})
		if err != nil {
			return failed(c, "ring: SendAsync", err)
		}
		rw, err := start(ctx, c, comm.Call{Op: comm.OpRecv, Recv: recv, Peer: prev, Algorithm: k.algo})
		if err != nil {
			return failed(c, "ring: RecvAsync", err)
		}
		if err := comm.WaitAll(ctx, sw, rw); err != nil {
			return failed(c, "ring: WaitAll", err)
		}
		ck := newChecker("rank %d: ring", r)
		ck.copied(recv, 0, ring.get(prev), 0, n, from)
		errs = append(errs, ck.err(n))

		// Tags.
		var works []comm.Work
		for i, m := range tagged {
			w, err := start(ctx, c, comm.Call{Op: comm.OpSend, Send: m.in.get(r), Peer: next, Tag: m.tag, Algorithm: k.algo})
			if err != nil {
				return failed(c, fmt.Sprintf("tags: SendAsync of message %d (tag %d)", i, m.tag), err)
			}
			works = append(works, w)
		}
		recvs := make([]*comm.HostBuffer, len(tagged))
		for _, i := range recvOrder {
			m := tagged[i]
			recvs[i] = garbage(k.dt, m.in.length(prev))
			w, err := start(ctx, c, comm.Call{Op: comm.OpRecv, Recv: recvs[i], Peer: prev, Tag: m.tag, Algorithm: k.algo})
			if err != nil {
				return failed(c, fmt.Sprintf("tags: RecvAsync of message %d (tag %d)", i, m.tag), err)
			}
			works = append(works, w)
		}
		if err := comm.WaitAll(ctx, works...); err != nil {
			return failed(c, "tags: WaitAll", err)
		}
		for i, m := range tagged {
			ck := newChecker("rank %d: tags: message %d (tag %d)", r, i, m.tag)
			ck.copied(recvs[i], 0, m.in.get(prev), 0, recvs[i].Len(), from)
			errs = append(errs, ck.err(recvs[i].Len()))
		}

		// Blocking.
		recv = garbage(k.dt, n)
		steps := []comm.Call{
			{Op: comm.OpSend, Send: blocking.get(r), Peer: next, Tag: 3, Algorithm: k.algo},
			{Op: comm.OpRecv, Recv: recv, Peer: prev, Tag: 3, Algorithm: k.algo},
		}
		if r%2 == 1 {
			steps[0], steps[1] = steps[1], steps[0]
		}
		for _, s := range steps {
			if err := issue(ctx, c, s); err != nil {
				return failed(c, "blocking: "+s.Op.String(), err)
			}
		}
		ck = newChecker("rank %d: blocking", r)
		ck.copied(recv, 0, blocking.get(prev), 0, n, from)
		errs = append(errs, ck.err(n))
		return errors.Join(errs...)
	}, nil
}

// barrierCase checks that no rank leaves a barrier before every rank has
// entered it: each rank counts itself in before the barrier and reads the
// count after it. Every algorithm runs twice, blocking and async. The check
// needs every rank in this process; where the launcher ran only some of
// them here, it checks only that the barriers complete.
func barrierCase(k *kase) (rankFunc, func(int) error) {
	rounds := 2 * len(k.algos)
	arrived := make([]atomic.Int32, rounds)
	seen := make([][]int32, rounds)
	for i := range seen {
		seen[i] = make([]int32, k.p)
	}
	name := func(i int) string {
		mode := "blocking"
		if i%2 == 1 {
			mode = "async"
		}
		return fmt.Sprintf("%s %v barrier (round %d)", mode, k.algos[i/2], i)
	}
	fn := func(ctx context.Context, c comm.Communicator) error {
		r := c.Rank()
		for i := range rounds {
			arrived[i].Add(1)
			call := comm.Call{Op: comm.OpBarrier, Algorithm: k.algos[i/2]}
			var err error
			if i%2 == 0 {
				err = issue(ctx, c, call)
			} else {
				var w comm.Work
				if w, err = start(ctx, c, call); err == nil {
					err = w.Wait(ctx)
				}
			}
			if err != nil {
				return failed(c, name(i), err)
			}
			seen[i][r] = arrived[i].Load()
		}
		return nil
	}
	after := func(local int) error {
		if local != k.p {
			return nil
		}
		var errs []error
		for i := range rounds {
			for r, s := range seen[i] {
				if int(s) != k.p {
					errs = append(errs, fmt.Errorf("rank %d left the %s when only %d of %d ranks had entered it", r, name(i), s, k.p))
				}
			}
		}
		return errors.Join(errs...)
	}
	return fn, after
}

// splitCase checks Split: the members of each part, their order by (key,
// rank), the new ranks and sizes, nil for a negative color, nested splits,
// and that both the parts and the parent work afterwards.
func splitCase(k *kase) (rankFunc, func(int) error) {
	p := k.p
	worldRanks := func(keep func(i int) bool) []int {
		var out []int
		for i := range p {
			if keep(i) {
				out = append(out, i)
			}
		}
		return out
	}
	return func(ctx context.Context, c comm.Communicator) error {
		r := c.Rank()
		split := func(name string, color, key int, want []int) (comm.Communicator, error) {
			sub, err := c.Split(ctx, color, key)
			if err != nil {
				return nil, failed(c, name+": Split", err)
			}
			if want == nil {
				if sub != nil {
					return nil, failed(c, name, fmt.Errorf("color %d: got a communicator of %d ranks, want nil", color, sub.Size()), sub)
				}
				return nil, nil
			}
			return sub, checkMembers(ctx, c, sub, name, want)
		}

		// Two parts by parity, each ordered by descending world rank.
		parity := worldRanks(func(i int) bool { return i%2 == r%2 })
		slices.Reverse(parity)
		byParity, err := split("parity", r%2, -r, parity)
		if err != nil {
			return err
		}
		// Nested: split the parity part again by its ranks' parity,
		// keyed by descending sub-rank (so ascending world rank).
		sr := byParity.Rank()
		var nested []int
		for i, w := range parity {
			if i%2 == sr%2 {
				nested = append(nested, w)
			}
		}
		slices.Reverse(nested)
		sub, err := byParity.Split(ctx, sr%2, -sr)
		if err != nil {
			return failed(c, "nested: Split", err, byParity)
		}
		if err := checkMembers(ctx, c, sub, "nested", nested); err != nil {
			return err
		}

		// The last rank passes a negative color and gets nil.
		var rest []int
		if r != p-1 {
			rest = worldRanks(func(i int) bool { return i != p-1 })
		}
		color := 0
		if r == p-1 {
			color = -1
		}
		if _, err := split("drop_last", color, 0, rest); err != nil {
			return err
		}

		// Pairs with equal keys: ordered by rank.
		if _, err := split("pairs", r/2, 0, worldRanks(func(i int) bool { return i/2 == r/2 })); err != nil {
			return err
		}

		// Every rank passes a negative color.
		if _, err := split("none", -1, r, nil); err != nil {
			return err
		}

		// The parent still works.
		return checkMembers(ctx, c, c, "parent", worldRanks(func(int) bool { return true }))
	}, nil
}

// checkMembers checks that sub has the world ranks members in this order,
// that this rank holds its place, and that AllGather and AllReduce work on
// it. Errors abort both communicators, since the members can no longer agree
// on what to run next.
func checkMembers(ctx context.Context, world, sub comm.Communicator, name string, members []int) error {
	r := world.Rank()
	if sub == nil {
		return failed(world, name, fmt.Errorf("got a nil communicator, want one of ranks %v", members))
	}
	if sub.Size() != len(members) {
		return failed(world, name, fmt.Errorf("got %d ranks, want %d (world ranks %v)", sub.Size(), len(members), members), sub)
	}
	if want := slices.Index(members, r); sub.Rank() != want {
		return failed(world, name, fmt.Errorf("got rank %d, want %d (world ranks %v)", sub.Rank(), want, members), sub)
	}
	got := make([]int64, len(members))
	if err := comm.AllGather(ctx, sub, comm.Host([]int64{int64(r)}), comm.Host(got)); err != nil {
		return failed(world, name+": AllGather", err, sub)
	}
	sum := []int64{int64(r)}
	if err := comm.AllReduce(ctx, sub, comm.Host(sum), comm.Host(sum), comm.Sum); err != nil {
		return failed(world, name+": AllReduce", err, sub)
	}
	var want int64
	for i, m := range members {
		want += int64(m)
		if got[i] != int64(m) {
			return fmt.Errorf("rank %d: %s: AllGather of world ranks got %v, want %v", r, name, got, members)
		}
	}
	if sum[0] != want {
		return fmt.Errorf("rank %d: %s: AllReduce of world ranks got %d, want %d", r, name, sum[0], want)
	}
	return nil
}

// asyncCase issues one async call of every kind back to back, with a ring
// exchange among them, before waiting for any: the calls must complete in
// the background in issue order without mixing their data.
func asyncCase(k *kase) (rankFunc, func(int) error) {
	const n = 1031
	p := k.p
	dt := comm.Float32
	in := func(i, length int) *inputs { return newInputs(dt, k.seed+uint64(i), Mixed, p, fixed(length)) }
	var (
		arIn = newInputs(comm.Int32, k.seed, Mixed, p, fixed(n))
		bcIn = in(1, n)
		rdIn = in(2, n)
		agIn = in(3, n)
		rsIn = in(4, p*n)
		gaIn = in(5, n)
		scIn = in(6, p*n)
		atIn = in(7, p*n)
		p2In = in(8, n)
	)
	bcRoot, rdRoot, gaRoot, scRoot := p-1, p/2, 0, (p+1)/2%p
	return func(ctx context.Context, c comm.Communicator) error {
		r := c.Rank()
		var (
			ar     = garbage(comm.Int32, n)
			bc     = garbage(dt, n)
			rd     *comm.HostBuffer
			ag     = garbage(dt, p*n)
			rs     = garbage(dt, n)
			ga     *comm.HostBuffer
			sc     = garbage(dt, n)
			scSend *comm.HostBuffer
			at     = garbage(dt, p*n)
			p2     = garbage(dt, n)
		)
		if r == bcRoot {
			bc = clone(bcIn.get(r))
		}
		if r == rdRoot {
			rd = garbage(dt, n)
		}
		if r == gaRoot {
			ga = garbage(dt, p*n)
		}
		if r == scRoot {
			scSend = scIn.get(r)
		}
		calls := []comm.Call{
			{Op: comm.OpAllReduce, Send: arIn.get(r), Recv: ar, Reduce: comm.Sum},
			{Op: comm.OpBroadcast, Send: bc, Recv: bc, Root: bcRoot},
			{Op: comm.OpReduce, Send: rdIn.get(r), Recv: host(rd), Reduce: comm.Max, Root: rdRoot},
			{Op: comm.OpAllGather, Send: agIn.get(r), Recv: ag},
			{Op: comm.OpReduceScatter, Send: rsIn.get(r), Recv: rs, Reduce: comm.Min},
			{Op: comm.OpGather, Send: gaIn.get(r), Recv: host(ga), Root: gaRoot},
			{Op: comm.OpScatter, Send: host(scSend), Recv: sc, Root: scRoot},
			{Op: comm.OpAllToAll, Send: atIn.get(r), Recv: at},
			{Op: comm.OpBarrier},
		}
		if p > 1 {
			// Point-to-point work is posted at once, not queued behind
			// the collectives.
			calls = append(calls,
				comm.Call{Op: comm.OpRecv, Recv: p2, Peer: (r + p - 1) % p, Tag: 1},
				comm.Call{Op: comm.OpSend, Send: p2In.get(r), Peer: (r + 1) % p, Tag: 1})
		}
		var works []comm.Work
		for _, call := range calls {
			w, err := start(ctx, c, call)
			if err != nil {
				return failed(c, call.Op.String()+" Async", err)
			}
			works = append(works, w)
		}
		if err := comm.WaitAll(ctx, works...); err != nil {
			return failed(c, "WaitAll", err)
		}
		for _, w := range works {
			select {
			case <-w.Done():
			default:
				return failed(c, "Done", errors.New("the channel is not closed after WaitAll returned"))
			}
		}

		var errs []error
		check := func(name string, f func(ck *checker) int) {
			ck := newChecker("rank %d: %s", r, name)
			errs = append(errs, ck.err(f(ck)))
		}
		check("allreduce sum int32", func(ck *checker) int {
			ck.reduced(ar, 0, reduceRange(comm.Int32, comm.Sum, p, arIn.get, 0, n), 0, n)
			return n
		})
		check(fmt.Sprintf("broadcast root %d", bcRoot), func(ck *checker) int {
			ck.copied(bc, 0, bcIn.get(bcRoot), 0, n, "root's")
			return n
		})
		if r == rdRoot {
			check(fmt.Sprintf("reduce max root %d", rdRoot), func(ck *checker) int {
				ck.reduced(rd, 0, reduceRange(dt, comm.Max, p, rdIn.get, 0, n), 0, n)
				return n
			})
		}
		check("allgather", func(ck *checker) int {
			for j := range p {
				ck.copied(ag, j*n, agIn.get(j), 0, n, fmt.Sprintf("rank %d's", j))
			}
			return p * n
		})
		check("reducescatter min", func(ck *checker) int {
			ck.reduced(rs, 0, reduceRange(dt, comm.Min, p, rsIn.get, r*n, (r+1)*n), 0, n)
			return n
		})
		if r == gaRoot {
			check(fmt.Sprintf("gather root %d", gaRoot), func(ck *checker) int {
				for j := range p {
					ck.copied(ga, j*n, gaIn.get(j), 0, n, fmt.Sprintf("rank %d's", j))
				}
				return p * n
			})
		}
		check(fmt.Sprintf("scatter root %d", scRoot), func(ck *checker) int {
			ck.copied(sc, 0, scIn.get(scRoot), r*n, n, "root's")
			return n
		})
		check("alltoall", func(ck *checker) int {
			for j := range p {
				ck.copied(at, j*n, atIn.get(j), r*n, n, fmt.Sprintf("rank %d's", j))
			}
			return p * n
		})
		if p > 1 {
			check("ring send/recv", func(ck *checker) int {
				ck.copied(p2, 0, p2In.get((r+p-1)%p), 0, n, "previous rank's")
				return n
			})
		}
		return errors.Join(errs...)
	}, nil
}
