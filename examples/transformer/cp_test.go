package main

import (
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
		{args: []string{"-dp", "1", "-tp", "2", "-cp", "4", "-cp-method", "ulysses"}, want: "splits the 2 heads per tensor-parallel rank over -cp 4: they must be divisible; cp can be 1 or 2"},
		{args: []string{"-dp", "1", "-tp", "1", "-cp", "3", "-cp-method", "hybrid"}, want: "-cp (3) and the heads per tensor-parallel rank (4) must be even"},
		{args: []string{"-cp", "2", "-cp-method", "tree"}, want: `unknown method "tree"`},
		{args: []string{"-cp-method", "ring"}, want: "apply to context parallelism: set -cp to 2 or more"},
		{args: []string{"-cp", "0"}, want: "-cp 0; want at least 1"},
		{args: []string{"-tp", "2", "-sp", "-cp", "2"}, want: "context parallelism (cp 2) and sequence parallelism both shard the sequence"},
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
