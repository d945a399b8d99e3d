package comm_test

import (
	"errors"
	"math"
	"strings"
	"testing"

	"github.com/b7ea7098/loom/comm"
)

// fakeBuffer is a Buffer of any dtype, such as a device buffer would be.
type fakeBuffer struct {
	dt comm.DType
	n  int
}

func (f fakeBuffer) DType() comm.DType { return f.dt }
func (f fakeBuffer) Len() int          { return f.n }
func (f fakeBuffer) Slice(lo, hi int) comm.Buffer {
	if lo < 0 || hi < lo || hi > f.n {
		panic("fakeBuffer: slice bounds out of range")
	}
	return fakeBuffer{f.dt, hi - lo}
}
func (f fakeBuffer) Device() string { return "cuda:0" }

func f32(n int) comm.Buffer { return comm.Host(make([]float32, n)) }

func TestCallValidate(t *testing.T) {
	const rank, size = 1, 4
	buf8 := f32(8)
	tests := []struct {
		name string
		c    comm.Call
		want string
	}{
		// Valid calls of every op.
		{name: "allreduce", c: comm.Call{Op: comm.OpAllReduce, Send: f32(8), Recv: f32(8), Reduce: comm.Sum}},
		{name: "allreduce in place", c: comm.Call{Op: comm.OpAllReduce, Send: buf8, Recv: buf8, Reduce: comm.Max}},
		{name: "allreduce forced ring", c: comm.Call{Op: comm.OpAllReduce, Send: f32(8), Recv: f32(8), Reduce: comm.Avg, Algorithm: comm.Ring}},
		{name: "allreduce on device buffers", c: comm.Call{Op: comm.OpAllReduce, Send: fakeBuffer{comm.BFloat16, 3}, Recv: fakeBuffer{comm.BFloat16, 3}, Reduce: comm.Sum}},
		{name: "broadcast", c: comm.Call{Op: comm.OpBroadcast, Send: buf8, Recv: buf8, Root: 3}},
		{name: "broadcast recv only", c: comm.Call{Op: comm.OpBroadcast, Recv: buf8, Root: 0}},
		{name: "broadcast ignores reduce op", c: comm.Call{Op: comm.OpBroadcast, Recv: buf8, Reduce: 77}},
		{name: "reduce non-root without recv", c: comm.Call{Op: comm.OpReduce, Send: f32(8), Reduce: comm.Prod, Root: 0}},
		{name: "reduce non-root ignores recv length", c: comm.Call{Op: comm.OpReduce, Send: f32(8), Recv: f32(1), Reduce: comm.Prod, Root: 0}},
		{name: "reduce root", c: comm.Call{Op: comm.OpReduce, Send: f32(8), Recv: f32(8), Reduce: comm.Min, Root: rank}},
		{name: "allgather", c: comm.Call{Op: comm.OpAllGather, Send: f32(2), Recv: f32(8)}},
		{name: "allgather in place", c: comm.Call{Op: comm.OpAllGather, Send: buf8.Slice(2, 4), Recv: buf8}},
		{name: "reducescatter", c: comm.Call{Op: comm.OpReduceScatter, Send: f32(8), Recv: f32(2), Reduce: comm.Sum}},
		{name: "gather non-root", c: comm.Call{Op: comm.OpGather, Send: f32(2), Root: 2}},
		{name: "gather root", c: comm.Call{Op: comm.OpGather, Send: f32(2), Recv: f32(8), Root: rank}},
		{name: "scatter non-root", c: comm.Call{Op: comm.OpScatter, Recv: f32(2), Root: 0}},
		{name: "scatter root", c: comm.Call{Op: comm.OpScatter, Send: f32(8), Recv: f32(2), Root: rank}},
		{name: "alltoall", c: comm.Call{Op: comm.OpAllToAll, Send: f32(8), Recv: f32(8)}},
		{name: "alltoall empty", c: comm.Call{Op: comm.OpAllToAll, Send: f32(0), Recv: f32(0)}},
		{name: "alltoallv", c: comm.Call{Op: comm.OpAllToAllV, Send: f32(8), Recv: f32(5), SendCounts: []int{1, 2, 0, 5}, RecvCounts: []int{2, 2, 1, 0}}},
		{name: "alltoallv counts below buffers", c: comm.Call{Op: comm.OpAllToAllV, Send: f32(8), Recv: f32(8), SendCounts: []int{1, 0, 0, 0}, RecvCounts: []int{0, 0, 0, 0}}},
		{name: "send", c: comm.Call{Op: comm.OpSend, Send: f32(3), Peer: 3, Tag: 7}},
		{name: "recv", c: comm.Call{Op: comm.OpRecv, Recv: f32(3), Peer: 0}},
		{name: "barrier", c: comm.Call{Op: comm.OpBarrier}},
		{name: "split", c: comm.Call{Op: comm.OpSplit}},

		// Errors.
		{name: "op zero", c: comm.Call{}, want: "op(0): unknown op"},
		{name: "op out of range", c: comm.Call{Op: 99, Send: f32(1)}, want: "op(99): unknown op"},
		{name: "allreduce nil send", c: comm.Call{Op: comm.OpAllReduce, Recv: f32(8), Reduce: comm.Sum}, want: "allreduce: send buffer is nil"},
		{name: "allreduce nil recv", c: comm.Call{Op: comm.OpAllReduce, Send: f32(8), Reduce: comm.Sum}, want: "allreduce: recv buffer is nil, want 8 elements"},
		{name: "allreduce short recv", c: comm.Call{Op: comm.OpAllReduce, Send: f32(8), Recv: f32(7), Reduce: comm.Sum}, want: "recv buffer has 7 elements, want 8"},
		{name: "allreduce no reduce op", c: comm.Call{Op: comm.OpAllReduce, Send: f32(8), Recv: f32(8)}, want: "reduce op reduceop(0) is not one of sum, avg, prod, min, max"},
		{name: "allreduce reduce op 6", c: comm.Call{Op: comm.OpAllReduce, Send: f32(8), Recv: f32(8), Reduce: 6}, want: "reduce op reduceop(6)"},
		{name: "reduce no reduce op", c: comm.Call{Op: comm.OpReduce, Send: f32(8), Recv: f32(8)}, want: "reduce: reduce op reduceop(0)"},
		{name: "reducescatter no reduce op", c: comm.Call{Op: comm.OpReduceScatter, Send: f32(8), Recv: f32(2)}, want: "reducescatter: reduce op reduceop(0)"},
		{name: "invalid algorithm", c: comm.Call{Op: comm.OpAllReduce, Send: f32(8), Recv: f32(8), Reduce: comm.Sum, Algorithm: 8}, want: "unknown algorithm 8"},
		{name: "barrier invalid algorithm", c: comm.Call{Op: comm.OpBarrier, Algorithm: 200}, want: "barrier: unknown algorithm 200"},
		{name: "dtype mismatch", c: comm.Call{Op: comm.OpAllReduce, Send: f32(8), Recv: comm.Host(make([]float64, 8)), Reduce: comm.Sum}, want: "send is float32 but recv is float64"},
		{name: "dtype mismatch on send", c: comm.Call{Op: comm.OpSend, Send: f32(2), Recv: comm.Host(make([]int32, 2)), Peer: 0}, want: "send is float32 but recv is int32"},
		{name: "invalid send dtype", c: comm.Call{Op: comm.OpSend, Send: fakeBuffer{0, 4}, Peer: 0}, want: "invalid dtype dtype(0)"},
		{name: "invalid recv dtype", c: comm.Call{Op: comm.OpRecv, Recv: fakeBuffer{9, 4}, Peer: 0}, want: "invalid dtype dtype(9)"},
		{name: "broadcast root -1", c: comm.Call{Op: comm.OpBroadcast, Recv: buf8, Root: -1}, want: "broadcast: root -1 out of range [0,4)"},
		{name: "broadcast root = size", c: comm.Call{Op: comm.OpBroadcast, Recv: buf8, Root: 4}, want: "root 4 out of range [0,4)"},
		{name: "broadcast nil", c: comm.Call{Op: comm.OpBroadcast, Root: 0}, want: "broadcast: buffer is nil"},
		{name: "broadcast length mismatch", c: comm.Call{Op: comm.OpBroadcast, Send: f32(3), Recv: f32(4)}, want: "send has 3 elements but recv has 4"},
		{name: "reduce root out of range", c: comm.Call{Op: comm.OpReduce, Send: f32(8), Reduce: comm.Sum, Root: 5}, want: "reduce: root 5 out of range [0,4)"},
		{name: "reduce nil send", c: comm.Call{Op: comm.OpReduce, Recv: f32(8), Reduce: comm.Sum}, want: "reduce: send buffer is nil"},
		{name: "reduce root nil recv", c: comm.Call{Op: comm.OpReduce, Send: f32(8), Reduce: comm.Sum, Root: rank}, want: "recv buffer is nil, want 8 elements"},
		{name: "reduce root short recv", c: comm.Call{Op: comm.OpReduce, Send: f32(8), Recv: f32(4), Reduce: comm.Sum, Root: rank}, want: "recv buffer has 4 elements, want 8"},
		{name: "allgather nil send", c: comm.Call{Op: comm.OpAllGather, Recv: f32(8)}, want: "allgather: send buffer is nil"},
		{name: "allgather nil recv", c: comm.Call{Op: comm.OpAllGather, Send: f32(2)}, want: "recv buffer is nil, want 8 elements"},
		{name: "allgather recv not p·n", c: comm.Call{Op: comm.OpAllGather, Send: f32(2), Recv: f32(2)}, want: "recv buffer has 2 elements, want 8"},
		{name: "reducescatter nil recv", c: comm.Call{Op: comm.OpReduceScatter, Send: f32(8), Reduce: comm.Sum}, want: "reducescatter: recv buffer is nil"},
		{name: "reducescatter nil send", c: comm.Call{Op: comm.OpReduceScatter, Recv: f32(2), Reduce: comm.Sum}, want: "send buffer is nil, want 8 elements"},
		{name: "reducescatter send not p·n", c: comm.Call{Op: comm.OpReduceScatter, Send: f32(6), Recv: f32(2), Reduce: comm.Sum}, want: "send buffer has 6 elements, want 8"},
		{name: "gather root out of range", c: comm.Call{Op: comm.OpGather, Send: f32(2), Root: -3}, want: "gather: root -3 out of range"},
		{name: "gather nil send", c: comm.Call{Op: comm.OpGather, Root: 0}, want: "gather: send buffer is nil"},
		{name: "gather root nil recv", c: comm.Call{Op: comm.OpGather, Send: f32(2), Root: rank}, want: "recv buffer is nil, want 8 elements"},
		{name: "gather root short recv", c: comm.Call{Op: comm.OpGather, Send: f32(2), Recv: f32(6), Root: rank}, want: "recv buffer has 6 elements, want 8"},
		{name: "scatter root out of range", c: comm.Call{Op: comm.OpScatter, Recv: f32(2), Root: 4}, want: "scatter: root 4 out of range"},
		{name: "scatter nil recv", c: comm.Call{Op: comm.OpScatter, Root: 0}, want: "scatter: recv buffer is nil"},
		{name: "scatter root nil send", c: comm.Call{Op: comm.OpScatter, Recv: f32(2), Root: rank}, want: "send buffer is nil, want 8 elements"},
		{name: "scatter root short send", c: comm.Call{Op: comm.OpScatter, Send: f32(7), Recv: f32(2), Root: rank}, want: "send buffer has 7 elements, want 8"},
		{name: "alltoall nil send", c: comm.Call{Op: comm.OpAllToAll, Recv: f32(8)}, want: "alltoall: send buffer is nil"},
		{name: "alltoall not divisible", c: comm.Call{Op: comm.OpAllToAll, Send: f32(6), Recv: f32(6)}, want: "send has 6 elements, not a multiple of 4 ranks"},
		{name: "alltoall recv length", c: comm.Call{Op: comm.OpAllToAll, Send: f32(8), Recv: f32(4)}, want: "recv buffer has 4 elements, want 8"},
		{name: "alltoall nil recv", c: comm.Call{Op: comm.OpAllToAll, Send: f32(8)}, want: "recv buffer is nil, want 8 elements"},
		{name: "alltoallv nil send", c: comm.Call{Op: comm.OpAllToAllV, Recv: f32(4), SendCounts: []int{1, 1, 1, 1}, RecvCounts: []int{1, 1, 1, 1}}, want: "alltoallv: send and recv buffers are required"},
		{name: "alltoallv nil recv", c: comm.Call{Op: comm.OpAllToAllV, Send: f32(4), SendCounts: []int{1, 1, 1, 1}, RecvCounts: []int{1, 1, 1, 1}}, want: "send and recv buffers are required"},
		{name: "alltoallv short send counts", c: comm.Call{Op: comm.OpAllToAllV, Send: f32(4), Recv: f32(4), SendCounts: []int{1, 1, 1}, RecvCounts: []int{1, 1, 1, 1}}, want: "3 send counts for 4 ranks"},
		{name: "alltoallv nil recv counts", c: comm.Call{Op: comm.OpAllToAllV, Send: f32(4), Recv: f32(4), SendCounts: []int{1, 1, 1, 1}}, want: "0 recv counts for 4 ranks"},
		{name: "alltoallv long recv counts", c: comm.Call{Op: comm.OpAllToAllV, Send: f32(4), Recv: f32(5), SendCounts: []int{1, 1, 1, 1}, RecvCounts: []int{1, 1, 1, 1, 1}}, want: "5 recv counts for 4 ranks"},
		{name: "alltoallv negative send count", c: comm.Call{Op: comm.OpAllToAllV, Send: f32(4), Recv: f32(4), SendCounts: []int{1, 1, -1, 1}, RecvCounts: []int{1, 1, 1, 1}}, want: "send count for rank 2 is negative (-1)"},
		{name: "alltoallv negative recv count", c: comm.Call{Op: comm.OpAllToAllV, Send: f32(4), Recv: f32(4), SendCounts: []int{1, 1, 1, 1}, RecvCounts: []int{-5, 1, 1, 1}}, want: "recv count for rank 0 is negative (-5)"},
		{name: "alltoallv send counts exceed", c: comm.Call{Op: comm.OpAllToAllV, Send: f32(4), Recv: f32(8), SendCounts: []int{1, 1, 1, 2}, RecvCounts: []int{1, 1, 1, 1}}, want: "send counts exceed the buffer of 4 elements"},
		{name: "alltoallv recv counts exceed", c: comm.Call{Op: comm.OpAllToAllV, Send: f32(4), Recv: f32(3), SendCounts: []int{1, 1, 1, 1}, RecvCounts: []int{1, 1, 1, 1}}, want: "recv counts exceed the buffer of 3 elements"},
		{name: "alltoallv counts overflowing int", c: comm.Call{Op: comm.OpAllToAllV, Send: f32(4), Recv: f32(4), SendCounts: []int{math.MaxInt, math.MaxInt, 2, 0}, RecvCounts: []int{1, 1, 1, 1}}, want: "send counts exceed the buffer of 4 elements"},
		{name: "send peer out of range", c: comm.Call{Op: comm.OpSend, Send: f32(3), Peer: 4}, want: "send: peer 4 out of range [0,4)"},
		{name: "send peer negative", c: comm.Call{Op: comm.OpSend, Send: f32(3), Peer: -1}, want: "peer -1 out of range [0,4)"},
		{name: "send to self", c: comm.Call{Op: comm.OpSend, Send: f32(3), Peer: rank}, want: "send: peer 1 is this rank"},
		// p·n used to wrap: 4 ranks × 2^62 elements is 2^64, i.e. 0, so an
		// empty buffer passed as the gathered or scattered whole.
		{name: "allgather count overflows", c: comm.Call{Op: comm.OpAllGather, Send: fakeBuffer{comm.Float32, 1 << 62}, Recv: fakeBuffer{comm.Float32, 0}}, want: "recv buffer of 4 blocks of 4611686018427387904 elements: the count overflows int"},
		{name: "reducescatter count overflows", c: comm.Call{Op: comm.OpReduceScatter, Send: fakeBuffer{comm.Float32, 0}, Recv: fakeBuffer{comm.Float32, 1 << 62}, Reduce: comm.Sum}, want: "send buffer of 4 blocks of 4611686018427387904 elements: the count overflows int"},
		{name: "gather root count overflows", c: comm.Call{Op: comm.OpGather, Send: fakeBuffer{comm.Float32, 1 << 62}, Recv: fakeBuffer{comm.Float32, 0}, Root: rank}, want: "the count overflows int"},
		{name: "scatter root count overflows", c: comm.Call{Op: comm.OpScatter, Send: fakeBuffer{comm.Float32, 0}, Recv: fakeBuffer{comm.Float32, 1 << 62}, Root: rank}, want: "the count overflows int"},
		{name: "recv from self", c: comm.Call{Op: comm.OpRecv, Recv: f32(3), Peer: rank}, want: "recv: peer 1 is this rank"},
		{name: "send nil", c: comm.Call{Op: comm.OpSend, Peer: 0}, want: "send: send buffer is nil"},
		{name: "recv nil", c: comm.Call{Op: comm.OpRecv, Send: f32(3), Peer: 0}, want: "recv: recv buffer is nil"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.c.Validate(rank, size)
			if tc.want == "" {
				if err != nil {
					t.Fatalf("Validate: %v", err)
				}
				return
			}
			if err == nil {
				t.Fatalf("Validate succeeded, want an error containing %q", tc.want)
			}
			if !errors.Is(err, comm.ErrInvalid) {
				t.Errorf("error %q does not wrap ErrInvalid", err)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error %q does not contain %q", err, tc.want)
			}
			if !strings.HasPrefix(err.Error(), comm.ErrInvalid.Error()+": "+tc.c.Op.String()+": ") {
				t.Errorf("error %q does not start with %q", err, comm.ErrInvalid.Error()+": "+tc.c.Op.String())
			}
		})
	}
}

func TestCallValidateSizeOne(t *testing.T) {
	// With one rank every count rule degenerates to n == n, and rank 0 is
	// root; a send to anyone is out of range or to self.
	ok := []comm.Call{
		{Op: comm.OpAllGather, Send: f32(3), Recv: f32(3)},
		{Op: comm.OpAllToAll, Send: f32(3), Recv: f32(3)},
		{Op: comm.OpGather, Send: f32(3), Recv: f32(3)},
		{Op: comm.OpAllToAllV, Send: f32(3), Recv: f32(3), SendCounts: []int{3}, RecvCounts: []int{3}},
	}
	for _, c := range ok {
		if err := c.Validate(0, 1); err != nil {
			t.Errorf("%v on one rank: %v", c.Op, err)
		}
	}
	if err := (&comm.Call{Op: comm.OpSend, Send: f32(1), Peer: 0}).Validate(0, 1); err == nil || !strings.Contains(err.Error(), "is this rank") {
		t.Errorf("send to self on one rank: %v", err)
	}
}

func TestCallCount(t *testing.T) {
	tests := []struct {
		c    comm.Call
		want int
	}{
		{comm.Call{Op: comm.OpAllReduce, Send: f32(5), Recv: f32(6)}, 6},
		{comm.Call{Op: comm.OpAllReduce}, 0},
		{comm.Call{Op: comm.OpBroadcast, Send: f32(2), Recv: f32(3)}, 3},
		{comm.Call{Op: comm.OpBroadcast, Send: f32(2)}, 0},
		{comm.Call{Op: comm.OpReduce, Send: f32(4), Recv: f32(9)}, 4},
		{comm.Call{Op: comm.OpAllGather, Send: f32(2), Recv: f32(8)}, 2},
		{comm.Call{Op: comm.OpReduceScatter, Send: f32(8), Recv: f32(2)}, 2},
		{comm.Call{Op: comm.OpGather, Send: f32(2), Recv: f32(8)}, 2},
		{comm.Call{Op: comm.OpScatter, Send: f32(8), Recv: f32(2)}, 2},
		{comm.Call{Op: comm.OpAllToAll, Send: f32(8), Recv: f32(12)}, 8},
		{comm.Call{Op: comm.OpAllToAllV, Send: f32(7), Recv: f32(3)}, 7},
		{comm.Call{Op: comm.OpSend, Send: f32(3)}, 3},
		{comm.Call{Op: comm.OpRecv, Recv: f32(4)}, 4},
		{comm.Call{Op: comm.OpRecv, Send: f32(9)}, 0},
		{comm.Call{Op: comm.OpBarrier}, 0},
		{comm.Call{Op: comm.OpSplit}, 0},
		{comm.Call{Op: comm.OpSend, Send: fakeBuffer{comm.Float16, 11}}, 11},
	}
	for _, tc := range tests {
		if got := tc.c.Count(); got != tc.want {
			t.Errorf("%v Count() = %d, want %d", tc.c.Op, got, tc.want)
		}
	}
}

// InPlace recognises exactly NCCL's in-place forms.
func TestCallInPlace(t *testing.T) {
	buf := comm.Host(make([]float32, 12))
	sub := func(lo, hi int) comm.Buffer { return buf.Slice(lo, hi) }
	tests := []struct {
		name string
		call comm.Call
		rank int
		want bool
	}{
		{"allreduce same", comm.Call{Op: comm.OpAllReduce, Send: buf, Recv: buf}, 0, true},
		{"allreduce distinct", comm.Call{Op: comm.OpAllReduce, Send: sub(0, 6), Recv: sub(6, 12)}, 0, false},
		{"allgather rank block", comm.Call{Op: comm.OpAllGather, Send: sub(8, 12), Recv: buf}, 2, true},
		{"allgather wrong block", comm.Call{Op: comm.OpAllGather, Send: sub(4, 8), Recv: buf}, 2, false},
		{"reducescatter rank block", comm.Call{Op: comm.OpReduceScatter, Send: buf, Recv: sub(4, 8)}, 1, true},
		{"reducescatter wrong block", comm.Call{Op: comm.OpReduceScatter, Send: buf, Recv: sub(4, 8)}, 0, false},
		{"broadcast without send", comm.Call{Op: comm.OpBroadcast, Recv: buf}, 0, true},
		{"alltoall never", comm.Call{Op: comm.OpAllToAll, Send: buf, Recv: buf}, 0, false},
	}
	for _, tc := range tests {
		if got := tc.call.InPlace(tc.rank); got != tc.want {
			t.Errorf("%s: InPlace = %v, want %v", tc.name, got, tc.want)
		}
	}
	if comm.InPlaceRule(comm.OpAllGather) != "send is recv's block at rank·n" {
		t.Error("InPlaceRule(allgather)")
	}
}
