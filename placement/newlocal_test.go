package placement_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// TestNewLocal: NewLocal wraps local slices, empty shards included, and
// rejects wrong lengths and dtypes.
func TestNewLocal(t *testing.T) {
	placementtest.Run(t, []int{4}, []string{"x"}, func(ctx context.Context, m *mesh.Mesh) error {
		// 3 rows over 4 ranks: chunk 1, rank 3 holds none.
		spec, err := placement.NewSpec(m, []int{3, 2}, comm.Float64, []placement.Placement{S0})
		if err != nil {
			return err
		}
		n := 2
		if m.Rank() == 3 {
			n = 0
		}
		data := make([]float64, n)
		for i := range data {
			data[i] = float64(2*m.Rank() + i)
		}
		dt, err := placement.NewLocal(spec, data)
		if err != nil {
			return err
		}
		full, err := dt.Full(ctx)
		if err != nil {
			return err
		}
		got := full.([]float64)
		for i, v := range got {
			if v != float64(i) {
				return fmt.Errorf("element %d = %v, want %d", i, v, i)
			}
		}
		if _, err := placement.NewLocal(spec, make([]float64, n+1)); !errors.Is(err, placement.ErrInvalid) || !strings.Contains(err.Error(), "elements") {
			return fmt.Errorf("wrong length: %v", err)
		}
		if _, err := placement.NewLocal(spec, make([]float32, n)); !errors.Is(err, placement.ErrInvalid) || !strings.Contains(err.Error(), "float32") {
			return fmt.Errorf("wrong dtype: %v", err)
		}
		if _, err := placement.NewLocal(spec, []int{1}); !errors.Is(err, placement.ErrInvalid) {
			return fmt.Errorf("wrong type: %v", err)
		}
		if _, err := placement.NewLocal(nil, data); !errors.Is(err, placement.ErrInvalid) {
			return fmt.Errorf("nil spec: %v", err)
		}
		scalar, err := placement.NewSpec(m, nil, comm.Float32, []placement.Placement{R})
		if err != nil {
			return err
		}
		if _, err := placement.NewLocal(scalar, []float32{1}); err != nil {
			return fmt.Errorf("scalar: %v", err)
		}
		return nil
	})
}
