package main

import (
	"bytes"
	"context"
	"io"
	"slices"
	"strings"
	"testing"

	"github.com/b7ea7098/loom/reference/tinygpt"
)

// TestParseCP: -cp adds the innermost mesh axis (two for hybrid), counts
// in the ranks, and its method and balance flags are checked before any
// rank starts.
func TestParseCP(t *testing.T) {
	ref := tinygpt.Default()
	for _, tc := range []struct {
		args  []string
		ranks int
		shape []int
		names []string
		want  string // error text; "" accepted
	}{
		{args: []string{"-dp", "1", "-tp", "1", "-cp", "2"}, ranks: 2, shape: []int{1, 1, 1, 2}, names: []string{"dp", "fsdp", "tp", "cp"}},
		{args: []string{"-dp", "2", "-tp", "2", "-cp", "2", "-cp-method", "ring"}, ranks: 8, shape: []int{2, 1, 2, 2}, names: []string{"dp", "fsdp", "tp", "cp"}},
		{args: []string{"-dp", "1", "-tp", "1", "-cp", "4", "-cp-method", "hybrid"}, ranks: 4, shape: []int{1, 1, 1, 2, 2}, names: []string{"dp", "fsdp", "tp", "cp", "cpu"}},
		{args: []string{"-dp", "1", "-tp", "1", "-cp", "4", "-cp-method", "Ulysses"}, ranks: 4, shape: []int{1, 1, 1, 4}, names: []string{"dp", "fsdp", "tp", "cp"}},
		{args: []string{"-dp", "1", "-tp", "2", "-cp", "4", "-cp-method", "ulysses"}, want: "splits the 2 heads per tensor-parallel rank over cp (4): they must be divisible; cp can be 1 or 2"},
		{args: []string{"-dp", "1", "-tp", "1", "-cp", "3", "-cp-method", "hybrid"}, want: "Hybrid's inner (Ulysses) ranks (2) must divide cp (3)"},
		{args: []string{"-cp", "2", "-cp-method", "tree"}, want: `unknown method "tree"`},
		{args: []string{"-cp-method", "ring"}, want: "apply to context parallelism: set -cp to 2 or more"},
		{args: []string{"-cp", "0"}, want: "-cp 0; want at least 1"},
		{args: []string{"-tp", "2", "-sp", "-cp", "2"}, want: "context parallelism (cp 2) and sequence parallelism both shard the sequence"},
		{args: []string{"-dp", "1", "-tp", "1", "-seq", "8", "-cp", "8"}, want: "its length (8) must be at least 2·cp (2 × 8); use plain shards or cp of at most 4"},
		{args: []string{"-dp", "1", "-tp", "1", "-seq", "8", "-cp", "8", "-cp-balance=false"}, ranks: 8, shape: []int{1, 1, 1, 8}, names: []string{"dp", "fsdp", "tp", "cp"}},
	} {
		o, err := parse(tc.args, io.Discard, ref)
		if tc.want != "" {
			if err == nil || strings.Count(err.Error(), tc.want) != 1 {
				t.Errorf("parse(%q): %v; want %q once", tc.args, err, tc.want)
			}
			continue
		}
		if err != nil {
			t.Errorf("parse(%q): %v", tc.args, err)
			continue
		}
		shape, names := o.cpf.axes(o.dp, o.fsdp, o.tp)
		if o.loop.Ranks != tc.ranks || !slices.Equal(o.loop.Shape, tc.shape) || !slices.Equal(shape, tc.shape) || !slices.Equal(names, tc.names) {
			t.Errorf("parse(%q): %d ranks, mesh %v %v; want %d, %v %v", tc.args, o.loop.Ranks, shape, names, tc.ranks, tc.shape, tc.names)
		}
	}
}

// TestCPFlatFSDP: with -fsdp and -cp, FSDP shards over the flattened
// fsdp×cp axes unless -cp-flat-fsdp=false, and the first line says so;
// two steps of the flattened layout agree with the one-rank run
// (-compare).
func TestCPFlatFSDP(t *testing.T) {
	ref := tinygpt.Default()
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"-dp", "1", "-tp", "1", "-fsdp", "2", "-cp", "2"}, "cp=2 (auto; FSDP over fsdp×cp: 1/4 of the parameters per rank)"},
		{[]string{"-dp", "1", "-tp", "1", "-fsdp", "2", "-cp", "2", "-cp-flat-fsdp=false"}, "cp=2 (auto; FSDP over fsdp: 1/2 of the parameters per rank, gradients summed over cp)"},
		{[]string{"-dp", "1", "-tp", "1", "-cp", "2"}, "cp=2 (auto)"},
	} {
		o, err := parse(tc.args, io.Discard, ref)
		if err != nil {
			t.Fatalf("parse(%q): %v", tc.args, err)
		}
		if got := o.layout(); !strings.Contains(got, tc.want) {
			t.Errorf("parse(%q): layout %q; want %q", tc.args, got, tc.want)
		}
	}
	var out bytes.Buffer
	args := []string{"-dp", "1", "-tp", "1", "-fsdp", "2", "-cp", "2", "-cp-method", "ring", "-steps", "2", "-every", "1", "-threads", "1", "-compare"}
	if err := run(context.Background(), args, &out); err != nil {
		t.Fatalf("run %v: %v\n%s", args, err, out.String())
	}
	for _, want := range []string{"FSDP over fsdp×cp: 1/4 of the parameters per rank", "largest loss difference"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("output lacks %q:\n%s", want, out.String())
		}
	}
}
