package memory_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/local"
	"github.com/b7ea7098/loom/memory"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// TestMeterPeaks: each kind keeps its own largest value, and the peak is
// the largest total of one sample, which is less than the sum of the
// kinds' maxima when they peak at different samples.
func TestMeterPeaks(t *testing.T) {
	samples := []memory.Use{
		{Params: 100, Grads: 0, Activations: 50},
		{Params: 100, Grads: 40, Activations: 10, Comm: 5},
		{Params: 100, Grads: 80, Optim: 30},
	}
	var m memory.Meter
	i := 0
	m.Add(func() memory.Use { return samples[i] })
	m.Add(func() memory.Use { return memory.Use{Optim: 1} })
	m.Add(nil) // ignored
	for i = range samples {
		if got, want := m.Sample().Total(), samples[i].Total()+1; got != want {
			t.Errorf("sample %d: total %d, want %d", i, got, want)
		}
	}
	want := memory.Report{Use: memory.Use{Params: 100, Grads: 80, Optim: 31, Activations: 50, Comm: 5}, Peak: 211}
	if got := m.Report(); got != want {
		t.Errorf("Report = %+v, want %+v", got, want)
	}
	m.Reset()
	if got := m.Report(); got != (memory.Report{}) {
		t.Errorf("after Reset: %+v", got)
	}
}

// TestMaxOverRanks: every rank gets the element-wise maximum, on 1 and 3
// ranks.
func TestMaxOverRanks(t *testing.T) {
	for _, p := range []int{1, 3} {
		t.Run(fmt.Sprint(p), func(t *testing.T) {
			err := local.Run(context.Background(), p, func(ctx context.Context, c comm.Communicator) error {
				r := int64(c.Rank())
				in := memory.Report{Use: memory.Use{Params: 10 - r, Grads: r, Optim: 7, Activations: 3 * r, Comm: 0}, Peak: 100 + r}
				got, err := memory.MaxOverRanks(ctx, c, in)
				if err != nil {
					return err
				}
				last := int64(p - 1)
				want := memory.Report{Use: memory.Use{Params: 10, Grads: last, Optim: 7, Activations: 3 * last}, Peak: 100 + last}
				if got != want {
					return fmt.Errorf("rank %d: %+v, want %+v", c.Rank(), got, want)
				}
				return nil
			})
			if err != nil {
				t.Fatal(err)
			}
		})
	}
}

// TestTensor counts the local block: a [5, 3] float64 tensor sharded over
// 2 ranks holds 3 and 2 rows.
func TestTensor(t *testing.T) {
	if memory.Tensor(nil) != 0 {
		t.Error("Tensor(nil) != 0")
	}
	placementtest.Run(t, []int{2}, []string{"fsdp"}, func(ctx context.Context, m *mesh.Mesh) error {
		spec, err := placement.NewSpec(m, []int{5, 3}, comm.Float64, []placement.Placement{placement.Shard(0)})
		if err != nil {
			return err
		}
		dt, err := placement.FromFull(spec, make([]float64, 15))
		if err != nil {
			return err
		}
		if got, want := memory.Tensor(dt), int64([]int{3, 2}[m.Rank()]*3*8); got != want {
			return fmt.Errorf("rank %d: %d bytes, want %d", m.Rank(), got, want)
		}
		return nil
	})
}
