package main

import (
	"fmt"
	"math"
	"strconv"
	"strings"

	"github.com/b7ea7098/loom/comm"
)

// benchOp is one benchmarked operation. Most are a single comm.Op; sendrecv
// is a ring of point-to-point transfers.
type benchOp struct {
	name string
	op   comm.Op // the comm.Op issued (OpSend for sendrecv)
}

// benchOps lists the operations loombench knows, in its default order.
var benchOps = []benchOp{
	{"allreduce", comm.OpAllReduce},
	{"allgather", comm.OpAllGather},
	{"reducescatter", comm.OpReduceScatter},
	{"broadcast", comm.OpBroadcast},
	{"reduce", comm.OpReduce},
	{"alltoall", comm.OpAllToAll},
	{"alltoallv", comm.OpAllToAllV},
	{"sendrecv", comm.OpSend},
}

// String returns the operation's flag name.
func (o benchOp) String() string { return o.name }

// inPlace reports whether the operation has an in-place form.
func (o benchOp) inPlace() bool {
	switch o.op {
	case comm.OpAllReduce, comm.OpAllGather, comm.OpReduceScatter, comm.OpBroadcast:
		return true
	}
	return false
}

// parseOps parses a comma-separated list of operation names.
func parseOps(s string) ([]benchOp, error) {
	var out []benchOp
	for _, name := range strings.Split(s, ",") {
		name = strings.ToLower(strings.TrimSpace(name))
		if name == "" {
			continue
		}
		found := false
		for _, o := range benchOps {
			if o.name == name {
				out = append(out, o)
				found = true
				break
			}
		}
		if !found {
			names := make([]string, len(benchOps))
			for i, o := range benchOps {
				names[i] = o.name
			}
			return nil, fmt.Errorf("unknown op %q (want a comma list of %s)", name, strings.Join(names, ", "))
		}
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("no op given")
	}
	return out, nil
}

// parseSize parses a byte count with an optional K, M or G suffix (powers of
// 1024, either case, optionally followed by "B" or "iB"): "8", "1K", "64M".
func parseSize(s string) (int64, error) {
	upper := strings.ToUpper(strings.TrimSpace(s))
	for _, unit := range []string{"IB", "B"} {
		if len(upper) > len(unit) && strings.HasSuffix(upper, unit) {
			upper = upper[:len(upper)-len(unit)]
			break
		}
	}
	mult := int64(1)
	if n := len(upper); n > 0 {
		switch upper[n-1] {
		case 'K':
			mult, upper = 1<<10, upper[:n-1]
		case 'M':
			mult, upper = 1<<20, upper[:n-1]
		case 'G':
			mult, upper = 1<<30, upper[:n-1]
		}
	}
	v, err := strconv.ParseInt(upper, 10, 64)
	if err != nil || v < 0 {
		return 0, fmt.Errorf("bad size %q (want a byte count such as 8, 1K, 64M or 1G)", s)
	}
	if v > math.MaxInt64/mult {
		return 0, fmt.Errorf("size %q is too large", s)
	}
	return v * mult, nil
}

// formatSize prints a byte count compactly with a binary suffix where exact.
func formatSize(b int64) string {
	switch {
	case b >= 1<<30 && b%(1<<30) == 0:
		return fmt.Sprintf("%dG", b>>30)
	case b >= 1<<20 && b%(1<<20) == 0:
		return fmt.Sprintf("%dM", b>>20)
	case b >= 1<<10 && b%(1<<10) == 0:
		return fmt.Sprintf("%dK", b>>10)
	}
	return strconv.FormatInt(b, 10)
}

// sizeSeries returns min, min·factor, ... up to and including max, as the
// size loop of nccl-tests does.
func sizeSeries(lo, hi, factor int64) ([]int64, error) {
	switch {
	case lo < 1:
		return nil, fmt.Errorf("minimum size %d must be at least 1 byte", lo)
	case hi < lo:
		return nil, fmt.Errorf("maximum size %d is below the minimum %d", hi, lo)
	case factor < 2:
		return nil, fmt.Errorf("size factor %d must be at least 2", factor)
	}
	var out []int64
	for s := lo; s <= hi; s *= factor {
		out = append(out, s)
		if s > math.MaxInt64/factor {
			break
		}
	}
	return out, nil
}

// shape is the per-rank layout of one benchmarked operation at one size,
// following nccl-tests' GetCollByteCount.
type shape struct {
	// target is the requested size in bytes (the -b/-e/-f series).
	target int64
	// paramCount is the count handed to the operation: the "count" column.
	paramCount int
	// sendCount and recvCount are the elements of each rank's send and
	// receive buffers (for alltoallv, recvCount is the largest over ranks).
	sendCount, recvCount int
	// bytes is the "size" column and the byte count of algbw:
	// max(send, recv) elements times the element size.
	bytes int64
	// sendCounts[r][j] and recvCounts[r][j] are alltoallv's per-peer counts
	// of rank r.
	sendCounts, recvCounts [][]int
}

// alignDown16 rounds a per-rank count down so that it covers a multiple of
// 16 bytes: count & ^(16/ts-1), as nccl-tests does.
func alignDown16(count, ts int) int {
	if ts >= 16 {
		return count
	}
	return count &^ (16/ts - 1)
}

// shapeOf computes the layout of op at size bytes for elements of ts bytes
// over n ranks.
func shapeOf(op benchOp, size int64, ts, n int) shape {
	count := int(size / int64(ts))
	sh := shape{target: size}
	switch op.op {
	case comm.OpAllGather:
		base := alignDown16(count/n, ts)
		sh.paramCount, sh.sendCount, sh.recvCount = base, base, base*n
	case comm.OpReduceScatter:
		base := alignDown16(count/n, ts)
		sh.paramCount, sh.sendCount, sh.recvCount = base, base*n, base
	case comm.OpAllToAll:
		per := alignDown16(count/n, ts)
		sh.paramCount, sh.sendCount, sh.recvCount = per, per*n, per*n
	case comm.OpAllToAllV:
		sh.sendCounts, sh.recvCounts = alltoallvCounts(count, n)
		maxSend, maxRecv := 0, 0
		for r := range n {
			maxSend = max(maxSend, sum(sh.sendCounts[r]))
			maxRecv = max(maxRecv, sum(sh.recvCounts[r]))
		}
		sh.paramCount, sh.sendCount, sh.recvCount = count, maxSend, maxRecv
	default: // allreduce, broadcast, reduce, sendrecv
		sh.paramCount, sh.sendCount, sh.recvCount = count, count, count
	}
	sh.bytes = int64(max(sh.sendCount, sh.recvCount)) * int64(ts)
	return sh
}

// alltoallvCounts builds the uneven alltoallv pattern for s elements per
// rank over n ranks: rank r sends cnt[r][j] = s·w[r][j]/W to rank j, with
// weights w[r][j] = 1 + (r+j) mod n and W = n + n(n-1)/2 their row sum, the
// rounding remainder going to j = n-1. Receive counts are the transpose.
func alltoallvCounts(s, n int) (send, recv [][]int) {
	w := n + n*(n-1)/2
	send = make([][]int, n)
	for r := range n {
		send[r] = make([]int, n)
		left := s
		for j := range n {
			send[r][j] = s * (1 + (r+j)%n) / w
			left -= send[r][j]
		}
		send[r][n-1] += left
	}
	recv = make([][]int, n)
	for r := range n {
		recv[r] = make([]int, n)
		for j := range n {
			recv[r][j] = send[j][r]
		}
	}
	return send, recv
}

func sum(xs []int) int {
	t := 0
	for _, x := range xs {
		t += x
	}
	return t
}

// offsets returns the exclusive prefix sums of counts: where each block
// starts when the blocks are packed in rank order.
func offsets(counts []int) []int {
	out := make([]int, len(counts))
	o := 0
	for i, c := range counts {
		out[i] = o
		o += c
	}
	return out
}

// busFactor is the factor from algorithm bandwidth to bus bandwidth for op
// over n ranks, as defined by nccl-tests.
func busFactor(op benchOp, n int) float64 {
	fn := float64(n)
	switch op.op {
	case comm.OpAllReduce:
		return 2 * (fn - 1) / fn
	case comm.OpAllGather, comm.OpReduceScatter, comm.OpAllToAll, comm.OpAllToAllV:
		return (fn - 1) / fn
	}
	return 1 // broadcast, reduce, sendrecv
}

// bandwidths returns the algorithm and bus bandwidth in GB/s (1e9 bytes per
// second) of op moving bytes in the given time.
func bandwidths(op benchOp, n int, bytes int64, seconds float64) (algbw, busbw float64) {
	if seconds <= 0 {
		return 0, 0
	}
	algbw = float64(bytes) / 1e9 / seconds
	return algbw, algbw * busFactor(op, n)
}
