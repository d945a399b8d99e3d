package cp_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/parallel/cp"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

func TestParseMethod(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want cp.Method
		ok   bool
	}{
		{"ring", cp.Ring, true}, {"AllGather", cp.AllGather, true}, {" ulysses ", cp.Ulysses, true},
		{"hybrid", cp.Hybrid, true}, {"auto", cp.Auto, true}, {"zigzag", 0, false}, {"", 0, false},
	} {
		got, err := cp.ParseMethod(tc.in)
		if tc.ok && (err != nil || got != tc.want) {
			t.Errorf("ParseMethod(%q) = %v, %v; want %v", tc.in, got, err, tc.want)
		}
		if !tc.ok && !errors.Is(err, cp.ErrInvalid) {
			t.Errorf("ParseMethod(%q): %v, want ErrInvalid", tc.in, err)
		}
		if back, err := cp.ParseMethod(got.String()); tc.ok && (err != nil || back != got) {
			t.Errorf("%v: String %q parses as %v, %v", got, got.String(), back, err)
		}
	}
}

// TestOptionsAndAuto: bad options are refused before any data moves, and
// Auto's choice gives the one-rank result (each choice is a method the
// parity tests cover) for a cost model that favours each method.
func TestOptionsAndAuto(t *testing.T) {
	placementtest.Run(t, []int{2}, []string{"cp"}, func(ctx context.Context, m *mesh.Mesh) error {
		spec, err := placement.NewSpec(m, []int{1, 2, 6, 2}, comm.Float64, []placement.Placement{placement.Shard(2)})
		if err != nil {
			return err
		}
		d, err := placement.FromFull(spec, placementtest.Random(spec.Shape(), comm.Float64, 2))
		if err != nil {
			return err
		}
		q, err := autograd.NewTape().Param("q", d)
		if err != nil {
			return err
		}
		for name, o := range map[string]cp.Option{
			"negative rate": cp.WithComputeRate(-1), "zero timeout": cp.WithTimeout(0), "method 9": cp.WithMethod(9),
		} {
			if _, err := cp.Attention(ctx, q, q, q, "cp", o); !errors.Is(err, cp.ErrInvalid) {
				return fmt.Errorf("%s: %v, want ErrInvalid", name, err)
			}
		}
		if _, err := cp.Attention(ctx, q, q, q, "tp"); !errors.Is(err, cp.ErrInvalid) {
			return fmt.Errorf("unknown axis: %v, want ErrInvalid", err)
		}
		slow := comm.BuiltinCostModel()
		slow.Beta *= 1e6 // bandwidth-bound: Ulysses moves the least
		for _, model := range []*comm.CostModel{comm.BuiltinCostModel(), slow} {
			for _, rate := range []float64{1e3, 1e15} {
				y, err := cp.Attention(ctx, q, q, q, "cp", cp.WithCostModel(model), cp.WithComputeRate(rate), cp.WithTimeout(time.Minute))
				if err != nil {
					return err
				}
				if _, err := y.Data().Full(ctx); err != nil {
					return err
				}
			}
		}
		return nil
	})
}

// MethodOf reads the method the options give, as Attention does: Auto by
// default, Hybrid with an inner axis, and an invalid option's error.
func TestMethodOf(t *testing.T) {
	for _, tc := range []struct {
		opts []cp.Option
		want cp.Method
		err  bool
	}{
		{nil, cp.Auto, false},
		{[]cp.Option{cp.WithMethod(cp.Ulysses)}, cp.Ulysses, false},
		{[]cp.Option{cp.WithUlyssesAxis("cpu")}, cp.Hybrid, false},
		{[]cp.Option{cp.WithMethod(cp.Ring), cp.WithTimeout(0)}, 0, true},
		{[]cp.Option{cp.WithComputeRate(0)}, 0, true},
	} {
		got, err := cp.MethodOf(tc.opts...)
		if tc.err != (err != nil) || (!tc.err && got != tc.want) || (tc.err && (!errors.Is(err, cp.ErrInvalid) || strings.Count(err.Error(), "cp: ") != 1)) {
			t.Errorf("MethodOf(%d options) = %v, %v; want %v (error %v)", len(tc.opts), got, err, tc.want, tc.err)
		}
	}
}
