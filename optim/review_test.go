package optim_test

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/optim"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// A gradient sharding dim 0 over (tp, dp) where the parameter uses (dp, tp)
// has the same local shapes but other elements: Step refuses it instead of
// updating the wrong elements.
func TestAdamWRejectsAnotherShardOrder(t *testing.T) {
	placementtest.Run(t, []int{2, 2}, []string{"dp", "tp"}, func(ctx context.Context, m *mesh.Mesh) error {
		s0 := placement.Shard(0)
		ps, err := placement.NewSpec(m, []int{4}, comm.Float64, []placement.Placement{s0, s0})
		if err != nil {
			return err
		}
		gs, err := placement.NewSpec(m, []int{4}, comm.Float64, []placement.Placement{s0, s0}, placement.WithOrder(0, "tp", "dp"))
		if err != nil {
			return err
		}
		pd, _ := placement.FromFull(ps, []float64{0, 0, 0, 0})
		gd, _ := placement.FromFull(gs, []float64{0, 1, 0, 0})
		tape := autograd.NewTape()
		p, _ := tape.Param("p", pd)
		if err := p.SetGrad(gd); err != nil {
			return err
		}
		opt, err := optim.NewAdamW([]*autograd.Value{p}, optim.WithLR(0.1), optim.WithWeightDecay(0), optim.WithBetas(0.9, 0.999), optim.WithEps(1e-8))
		if err != nil {
			return err
		}
		err = opt.Step()
		if err == nil || !strings.Contains(err.Error(), "shards dim 0 over mesh axes [tp dp] where the parameter uses [dp tp]") {
			return fmt.Errorf("Step with a gradient in another shard order: %v", err)
		}
		if got := pd.LocalData().([]float64); got[0] != 0 || opt.StepCount(0) != 0 {
			return fmt.Errorf("the refused step changed the parameter (%v) or its step count", got)
		}
		return nil
	})
}

// Hyper-parameters changed between steps are checked again, before any
// update; StepCount out of range is -1.
func TestAdamWStepChecksHyperparamsAndStepCountRange(t *testing.T) {
	placementtest.Run(t, []int{1}, []string{"dp"}, func(ctx context.Context, m *mesh.Mesh) (err error) {
		ps, _ := placement.NewSpec(m, []int{2}, comm.Float64, []placement.Placement{placement.Replicate()})
		pd, _ := placement.FromFull(ps, []float64{1, 2})
		gd, _ := placement.FromFull(ps, []float64{1, 1})
		tape := autograd.NewTape()
		p, _ := tape.Param("p", pd)
		_ = p.SetGrad(gd)
		opt, _ := optim.NewAdamW([]*autograd.Value{p}, optim.WithLR(0.1), optim.WithWeightDecay(0), optim.WithBetas(0.9, 0.999), optim.WithEps(1e-8))
		opt.Beta1 = 1 // "may be changed between steps"
		if err := opt.Step(); err == nil {
			return fmt.Errorf("Beta1=1 accepted by Step; parameter now %v", p.Data().LocalData())
		}
		if got := p.Data().LocalData().([]float64); got[0] != 1 || got[1] != 2 {
			return fmt.Errorf("a rejected step changed the parameter to %v", got)
		}
		if n := opt.StepCount(1); n != -1 {
			return fmt.Errorf("StepCount(1) with one parameter = %d, want -1", n)
		}
		return nil
	})
}
