package comm_test

import (
	"errors"
	"fmt"
	"maps"
	"strconv"
	"strings"
	"testing"

	"github.com/b7ea7098/loom/comm"
)

func TestReduceOpNames(t *testing.T) {
	want := []string{"sum", "avg", "prod", "min", "max"}
	if len(comm.AllReduceOps()) != len(want) {
		t.Fatalf("AllReduceOps = %v", comm.AllReduceOps())
	}
	for i, r := range comm.AllReduceOps() {
		if !r.Valid() {
			t.Errorf("%v not Valid", r)
		}
		if r.String() != want[i] {
			t.Errorf("AllReduceOps()[%d].String() = %q, want %q", i, r.String(), want[i])
		}
		for _, s := range []string{want[i], strings.ToUpper(want[i])} {
			if got, err := comm.ParseReduceOp(s); err != nil || got != r {
				t.Errorf("ParseReduceOp(%q) = %v, %v; want %v", s, got, err, r)
			}
		}
	}
	for _, r := range []comm.ReduceOp{0, 6, 200} {
		if r.Valid() {
			t.Errorf("ReduceOp(%d) Valid", r)
		}
		if !strings.HasPrefix(r.String(), "reduceop(") {
			t.Errorf("ReduceOp(%d).String() = %q", r, r.String())
		}
	}
	for _, s := range []string{"", "add", "mean", "sum "} {
		_, err := comm.ParseReduceOp(s)
		if err == nil || !strings.Contains(err.Error(), "unknown reduce op") || !strings.Contains(err.Error(), `"`+s+`"`) {
			t.Errorf("ParseReduceOp(%q) error = %v", s, err)
		}
	}
}

func TestAlgorithmNames(t *testing.T) {
	names := map[comm.Algorithm]string{
		comm.Auto: "auto", comm.Direct: "direct", comm.Ring: "ring",
		comm.RecursiveDoubling: "recursive_doubling", comm.HalvingDoubling: "halving_doubling",
		comm.Tree: "tree", comm.DoubleTree: "double_tree", comm.Hierarchical: "hierarchical",
	}
	if len(comm.AllAlgorithms()) != len(names)-1 {
		t.Errorf("AllAlgorithms = %v, want every algorithm but auto", comm.AllAlgorithms())
	}
	for _, a := range comm.AllAlgorithms() {
		if a == comm.Auto {
			t.Error("AllAlgorithms contains auto")
		}
	}
	for a, name := range names {
		if !a.Valid() || a.String() != name {
			t.Errorf("Algorithm(%d): Valid=%v String=%q, want %q", a, a.Valid(), a.String(), name)
		}
		if got, err := comm.ParseAlgorithm(name); err != nil || got != a {
			t.Errorf("ParseAlgorithm(%q) = %v, %v", name, got, err)
		}
	}
	aliases := []struct {
		in   string
		want comm.Algorithm
	}{
		{"rd", comm.RecursiveDoubling},
		{"Recursive-Doubling", comm.RecursiveDoubling},
		{"rabenseifner", comm.HalvingDoubling},
		{"hd", comm.HalvingDoubling},
		{"halving-doubling", comm.HalvingDoubling},
		{"dbtree", comm.DoubleTree},
		{"double-tree", comm.DoubleTree},
		{"hier", comm.Hierarchical},
		{"RING", comm.Ring},
	}
	for _, tc := range aliases {
		if got, err := comm.ParseAlgorithm(tc.in); err != nil || got != tc.want {
			t.Errorf("ParseAlgorithm(%q) = %v, %v; want %v", tc.in, got, err, tc.want)
		}
	}
	for _, a := range []comm.Algorithm{8, 255} {
		if a.Valid() || a.String() != "algorithm("+strconv.Itoa(int(a))+")" {
			t.Errorf("Algorithm(%d): Valid=%v String=%q", a, a.Valid(), a.String())
		}
	}
	for _, s := range []string{"", "bogus", "ring2", "algorithm(1)"} {
		_, err := comm.ParseAlgorithm(s)
		if err == nil {
			t.Errorf("ParseAlgorithm(%q) succeeded", s)
			continue
		}
		msg := err.Error()
		if !strings.Contains(msg, "unknown algorithm") || !strings.Contains(msg, `"`+strings.ToLower(s)+`"`) ||
			!strings.Contains(msg, "recursive_doubling") {
			t.Errorf("ParseAlgorithm(%q) error %q", s, msg)
		}
	}
}

var allOps = []struct {
	op                          comm.Op
	name                        string
	collective, rooted, reduces bool
}{
	{comm.OpAllReduce, "allreduce", true, false, true},
	{comm.OpBroadcast, "broadcast", true, true, false},
	{comm.OpReduce, "reduce", true, true, true},
	{comm.OpAllGather, "allgather", true, false, false},
	{comm.OpReduceScatter, "reducescatter", true, false, true},
	{comm.OpGather, "gather", true, true, false},
	{comm.OpScatter, "scatter", true, true, false},
	{comm.OpAllToAll, "alltoall", true, false, false},
	{comm.OpAllToAllV, "alltoallv", true, false, false},
	{comm.OpSend, "send", false, false, false},
	{comm.OpRecv, "recv", false, false, false},
	{comm.OpBarrier, "barrier", true, false, false},
	{comm.OpSplit, "split", true, false, false},
}

func TestOpNames(t *testing.T) {
	for _, tc := range allOps {
		t.Run(tc.name, func(t *testing.T) {
			if tc.op.String() != tc.name {
				t.Errorf("String = %q", tc.op.String())
			}
			for _, s := range []string{tc.name, strings.ToUpper(tc.name)} {
				if got, err := comm.ParseOp(s); err != nil || got != tc.op {
					t.Errorf("ParseOp(%q) = %v, %v", s, got, err)
				}
			}
			if tc.op.Collective() != tc.collective || tc.op.Rooted() != tc.rooted || tc.op.Reduces() != tc.reduces {
				t.Errorf("Collective=%v Rooted=%v Reduces=%v, want %v %v %v",
					tc.op.Collective(), tc.op.Rooted(), tc.op.Reduces(), tc.collective, tc.rooted, tc.reduces)
			}
		})
	}
	if s := comm.Op(0).String(); s != "op(0)" {
		t.Errorf("Op(0).String() = %q", s)
	}
	if s := comm.Op(99).String(); s != "op(99)" {
		t.Errorf("Op(99).String() = %q", s)
	}
	for _, s := range []string{"", "allreduc", "all_reduce", "op(1)"} {
		_, err := comm.ParseOp(s)
		if err == nil || !strings.Contains(err.Error(), `unknown op "`+s+`"`) {
			t.Errorf("ParseOp(%q) error = %v", s, err)
		}
	}
}

func TestParseAlgorithmOverrides(t *testing.T) {
	type O = comm.AlgorithmOverrides
	tests := []struct {
		in      string
		want    O
		format  string // String of the result
		wantErr string
	}{
		{in: "", want: O{}, format: ""},
		{in: "   ", want: O{}, format: ""},
		{in: "ring", want: O{0: comm.Ring}, format: "ring"},
		{in: " Tree ", want: O{0: comm.Tree}, format: "tree"},
		{in: "auto", want: O{0: comm.Auto}, format: "auto"},
		{in: "allreduce=ring", want: O{comm.OpAllReduce: comm.Ring}, format: "allreduce=ring"},
		{in: "allreduce=ring,allgather=direct", want: O{comm.OpAllReduce: comm.Ring, comm.OpAllGather: comm.Direct}, format: "allreduce=ring,allgather=direct"},
		{in: "reducescatter=rd, ring", want: O{0: comm.Ring, comm.OpReduceScatter: comm.RecursiveDoubling}, format: "ring,reducescatter=recursive_doubling"},
		{in: "AllReduce = tree , broadcast=dbtree", want: O{comm.OpAllReduce: comm.Tree, comm.OpBroadcast: comm.DoubleTree}, format: "allreduce=tree,broadcast=double_tree"},
		{in: "allreduce=halving-doubling", want: O{comm.OpAllReduce: comm.HalvingDoubling}, format: "allreduce=halving_doubling"},
		{in: "allreduce=ring,allreduce=tree", wantErr: `invalid call: entry "allreduce=tree": allreduce is already forced by entry "allreduce=ring"`},
		{in: "allreduce=ring,ALLREDUCE=ring", wantErr: `entry "ALLREDUCE=ring": allreduce is already forced by entry "allreduce=ring"`},
		{in: "ring,tree", wantErr: `entry "tree": a second default algorithm (the first is "ring")`},
		{in: "ring,allreduce=tree,rd", wantErr: `entry "rd": a second default algorithm`},
		{in: "bogus", wantErr: `entry "bogus": unknown algorithm "bogus" (want one of auto, direct, ring,`},
		{in: "allreduce=bogus", wantErr: `entry "allreduce=bogus": unknown algorithm "bogus"`},
		{in: "ring,allreduce=", wantErr: `entry "allreduce=": unknown algorithm ""`},
		{in: "allreduce=ring=tree", wantErr: `entry "allreduce=ring=tree": unknown algorithm "ring=tree"`},
		{in: "nosuchop=ring", wantErr: `entry "nosuchop=ring": unknown op "nosuchop" (want one of allreduce, broadcast,`},
		{in: "=ring", wantErr: `entry "=ring": unknown op ""`},
		{in: "ring,", wantErr: `invalid call: empty entry`},
		{in: ",ring", wantErr: `empty entry`},
		{in: "allreduce=ring,,allgather=ring", wantErr: `empty entry`},
		{in: " , ", wantErr: `empty entry`},
	}
	for _, tc := range tests {
		t.Run(tc.in, func(t *testing.T) {
			got, err := comm.ParseAlgorithmOverrides(tc.in)
			if tc.wantErr != "" {
				want := fmt.Sprintf("comm: ParseAlgorithmOverrides(%q): ", tc.in)
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) || !strings.HasPrefix(err.Error(), want) {
					t.Fatalf("error = %v, want one starting %q and containing %q", err, want, tc.wantErr)
				}
				if !errors.Is(err, comm.ErrInvalid) {
					t.Errorf("error %v does not wrap ErrInvalid", err)
				}
				if got != nil {
					t.Errorf("got %v with the error", got)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got == nil || !maps.Equal(got, tc.want) {
				t.Errorf("got %v, want %v", got, tc.want)
			}
			if s := got.String(); s != tc.format {
				t.Errorf("String() = %q, want %q", s, tc.format)
			}
			if again, err := comm.ParseAlgorithmOverrides(got.String()); err != nil || !maps.Equal(again, got) {
				t.Errorf("String() %q parses to %v, %v", got.String(), again, err)
			}
		})
	}
	if s := (comm.AlgorithmOverrides{comm.Op(99): comm.Ring}).String(); s != "op(99)=ring" {
		t.Errorf("an unknown op formats as %q", s)
	}
}

func TestAlgorithmOverridesFor(t *testing.T) {
	o := comm.AlgorithmOverrides{0: comm.Ring, comm.OpAllGather: comm.Direct, comm.OpBroadcast: comm.Auto}
	tests := []struct {
		o    comm.AlgorithmOverrides
		op   comm.Op
		want comm.Algorithm
	}{
		{o, comm.OpAllGather, comm.Direct},
		{o, comm.OpAllReduce, comm.Ring}, // falls back to the default
		{o, comm.OpBroadcast, comm.Auto}, // listed as auto: no fallback
		{comm.AlgorithmOverrides{comm.OpAllGather: comm.Tree}, comm.OpAllReduce, comm.Auto},
		{nil, comm.OpAllReduce, comm.Auto},
	}
	for _, tc := range tests {
		if got := tc.o.For(tc.op, nil); got != tc.want {
			t.Errorf("%v.For(%v) = %v, want %v", tc.o, tc.op, got, tc.want)
		}
	}
}

func TestAlgorithmOverridesFromEnv(t *testing.T) {
	tests := []struct {
		env     string
		op      comm.Op
		want    comm.Algorithm
		wantErr string
	}{
		{env: "", op: comm.OpAllReduce, want: comm.Auto},
		{env: "hier", op: comm.OpAllReduce, want: comm.Hierarchical},
		{env: "allgather=ring", op: comm.OpAllGather, want: comm.Ring},
		{env: "allgather=ring", op: comm.OpAllReduce, want: comm.Auto},
		{env: "allgather=nope", wantErr: `comm: LOOM_ALGO="allgather=nope": invalid call: entry "allgather=nope": unknown algorithm "nope"`},
		{env: "allgather=ring,allgather=tree", wantErr: `comm: LOOM_ALGO="allgather=ring,allgather=tree": invalid call: entry "allgather=tree": allgather is already forced by entry "allgather=ring"`},
	}
	for _, tc := range tests {
		t.Run(tc.env, func(t *testing.T) {
			t.Setenv(comm.AlgorithmEnv, tc.env)
			o, err := comm.AlgorithmOverridesFromEnv()
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("error = %v, want %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got := o.For(tc.op, nil); got != tc.want {
				t.Errorf("For(%v) = %v, want %v", tc.op, got, tc.want)
			}
		})
	}
	if comm.AlgorithmEnv != "LOOM_ALGO" {
		t.Errorf("AlgorithmEnv = %q", comm.AlgorithmEnv)
	}
}

// A single default algorithm applies only where the backend can run it;
// op=algorithm entries are strict.
func TestAlgorithmOverridesDefaultAppliesWhereItCan(t *testing.T) {
	o := comm.AlgorithmOverrides{0: comm.Ring, comm.OpBarrier: comm.Tree}
	onlyAllReduce := func(op comm.Op, a comm.Algorithm) bool { return op == comm.OpAllReduce }
	for _, tc := range []struct {
		op   comm.Op
		want comm.Algorithm
	}{
		{comm.OpAllReduce, comm.Ring},
		{comm.OpAllGather, comm.Auto},
		{comm.OpBarrier, comm.Tree},
	} {
		if got := o.For(tc.op, onlyAllReduce); got != tc.want {
			t.Errorf("For(%v) = %v, want %v", tc.op, got, tc.want)
		}
	}
}

// TestListsAreFresh checks that the list functions return a new slice on
// every call, so that one caller's edit cannot change what another sees.
func TestListsAreFresh(t *testing.T) {
	a := comm.AllAlgorithms()
	a[0] = comm.Auto
	if comm.AllAlgorithms()[0] != comm.Direct {
		t.Error("editing AllAlgorithms' result changed the next call's")
	}
	d := comm.AllDTypes()
	d[0] = 0
	if comm.AllDTypes()[0] != comm.Float32 {
		t.Error("editing AllDTypes' result changed the next call's")
	}
	r := comm.AllReduceOps()
	r[0] = 0
	if comm.AllReduceOps()[0] != comm.Sum {
		t.Error("editing AllReduceOps' result changed the next call's")
	}
}
