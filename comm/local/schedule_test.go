package local

import (
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/internal/kernel"
)

// interpret runs a schedule serially in a random order that honours only
// the schedule's own waits, so a missing read-after-write or write-after-
// read wait shows up as a wrong result. Buffers hold exact integers in
// float64, and the reduction is a sum.
func interpret(t *testing.T, s *schedule, rng *rand.Rand, send, recv [][]float64, alias func(r int, b bufID) (bufID, int)) {
	t.Helper()
	p := len(s.steps)
	scratch := make([][]float64, p)
	for r := range scratch {
		scratch[r] = make([]float64, s.scratch[r])
	}
	buf := func(x ref) []float64 {
		var b []float64
		switch x.buf {
		case bufSend:
			b = send[x.rank]
		case bufRecv:
			b = recv[x.rank]
		case bufScratch:
			b = scratch[x.rank]
		}
		return b[x.off : x.off+x.n]
	}
	done := make([]int, p)
	for {
		var ready []int
		for r := 0; r < p; r++ {
			if done[r] == len(s.steps[r]) {
				continue
			}
			ok := true
			for _, d := range s.steps[r][done[r]].deps {
				if done[d.rank] < d.mark {
					ok = false
				}
			}
			if ok {
				ready = append(ready, r)
			}
		}
		if len(ready) == 0 {
			for r := range done {
				if done[r] != len(s.steps[r]) {
					t.Fatalf("deadlock: rank %d stuck at step %d\n%v", r, done[r], s)
				}
			}
			return
		}
		r := ready[rng.IntN(len(ready))]
		st := s.steps[r][done[r]]
		dst := buf(st.dsts[0])
		switch st.kind {
		case stepCopy:
			for _, d := range st.dsts {
				copy(buf(d), buf(st.srcs[0]))
			}
		case stepReduce:
			// The real kernel, so that destinations aliasing sources are
			// exercised as the executor meets them.
			srcs := make([][]byte, len(st.srcs))
			for i, src := range st.srcs {
				srcs[i] = comm.Host(buf(src)).Bytes()
			}
			dsts := make([][]byte, len(st.dsts))
			for i, d := range st.dsts {
				dsts[i] = comm.Host(buf(d)).Bytes()
			}
			if err := kernel.ReduceInto(comm.Float64, comm.Sum, false, dsts, srcs); err != nil {
				t.Fatal(err)
			}
		case stepScale:
			for i := range dst {
				dst[i] /= float64(p)
			}
		}
		done[r]++
	}
}

func TestSchedulesComputeTheirCollective(t *testing.T) {
	ops := []comm.Op{comm.OpAllReduce, comm.OpReduceScatter, comm.OpAllGather, comm.OpBroadcast, comm.OpReduce}
	rng := rand.New(rand.NewPCG(1, 2))
	for _, op := range ops {
		for _, algo := range Algorithms(op) {
			for p := 1; p <= 9; p++ {
				for _, n := range []int{0, 1, p - 1, p + 1, 37} {
					for _, inPlace := range []bool{false, true} {
						for _, root := range []int{0, p - 1} {
							name := fmt.Sprintf("%v/%v/p=%d/n=%d/inplace=%v/root=%d", op, algo, p, n, inPlace, root)
							for _, allInPlace := range []bool{false, true} {
								checkSchedule(t, name, rng, plan{op: op, algo: algo, p: p, n: n, root: root, piece: 3}, inPlace, allInPlace)
							}
						}
					}
				}
			}
		}
	}
}

func checkSchedule(t *testing.T, name string, rng *rand.Rand, pl plan, inPlace, allInPlace bool) {
	p, n := pl.p, pl.n
	pl.inPlace = make([]bool, p)
	for r := range pl.inPlace {
		pl.inPlace[r] = inPlace && (r%2 == 0 || allInPlace) // a mix, or every rank
	}
	s, err := generate(pl)
	if err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	sendLen, recvLen := n, n
	switch pl.op {
	case comm.OpAllGather:
		recvLen = p * n
	case comm.OpReduceScatter:
		sendLen = p * n
	}
	send := make([][]float64, p)
	recv := make([][]float64, p)
	for r := 0; r < p; r++ {
		send[r] = make([]float64, sendLen)
		for i := range send[r] {
			send[r][i] = float64(1 + r*1000 + i)
		}
		recv[r] = make([]float64, recvLen)
		for i := range recv[r] {
			recv[r][i] = -1
		}
		if pl.inPlace[r] {
			switch pl.op {
			case comm.OpAllReduce, comm.OpBroadcast:
				copy(recv[r], send[r])
				send[r] = recv[r]
			case comm.OpAllGather:
				copy(recv[r][r*n:], send[r])
				send[r] = recv[r][r*n : (r+1)*n]
			case comm.OpReduceScatter:
				recv[r] = send[r][r*n : (r+1)*n]
			}
		}
	}
	in := make([][]float64, p)
	for r := range in {
		in[r] = append([]float64(nil), send[r]...)
	}
	for trial := 0; trial < 3; trial++ {
		for r := 0; r < p; r++ {
			copy(send[r], in[r])
			if !pl.inPlace[r] && pl.op != comm.OpBroadcast {
				for i := range recv[r] {
					recv[r][i] = -1
				}
			}
		}
		interpret(t, s, rng, send, recv, nil)
		for r := 0; r < p; r++ {
			want := expected(pl, in, r)
			if want == nil {
				continue
			}
			for i := range want {
				if recv[r][i] != want[i] {
					t.Fatalf("%s: rank %d recv[%d] = %v, want %v\n%v", name, r, i, recv[r][i], want[i], s)
				}
			}
		}
	}
}

func expected(pl plan, in [][]float64, r int) []float64 {
	p, n := pl.p, pl.n
	sum := func(lo, k int) []float64 {
		out := make([]float64, k)
		for q := 0; q < p; q++ {
			for i := range out {
				out[i] += in[q][lo+i]
			}
		}
		return out
	}
	switch pl.op {
	case comm.OpAllReduce:
		return sum(0, n)
	case comm.OpReduce:
		if r != pl.root {
			return nil
		}
		return sum(0, n)
	case comm.OpReduceScatter:
		return sum(r*n, n)
	case comm.OpAllGather:
		var out []float64
		for q := 0; q < p; q++ {
			out = append(out, in[q][:n]...)
		}
		return out
	case comm.OpBroadcast:
		return in[pl.root]
	}
	return nil
}
