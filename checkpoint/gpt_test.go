package checkpoint_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/b7ea7098/loom/checkpoint"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/local"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/models/gpt"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/reference"
	"github.com/b7ea7098/loom/reference/tinygpt"
)

// TestImportTinyGPT imports PyTorch's initial weights of the tiny GPT
// (the fixture's "init." tensors, a file PyTorch wrote) into the
// parameters of a randomly initialised gpt.Trainer on dp=2 × tp=2, by
// name, each rank reading its tp shard: the first step's loss is the one
// the model gives from the same weights passed as gpt.WithParams, bit for
// bit, and PyTorch's within the parity tolerance. Without WithReshape the
// fused qkv tensors' other shapes are refused.
func TestImportTinyGPT(t *testing.T) {
	fx, err := tinygpt.LoadFixture()
	if err != nil {
		t.Fatal(err)
	}
	ref, err := fx.Cfg()
	if err != nil {
		t.Fatal(err)
	}
	init, err := fx.Params(tinygpt.PrefixInit)
	if err != nil {
		t.Fatal(err)
	}
	raw, err := reference.ReadFile(reference.TinyGPTSafetensors)
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "tiny_gpt.safetensors")
	if err := os.WriteFile(path, raw, 0o644); err != nil {
		t.Fatal(err)
	}
	var losses [2]float64
	for i, imported := range []bool{true, false} {
		err := local.Run(context.Background(), 4, func(ctx context.Context, c comm.Communicator) error {
			m, err := mesh.New(c, []int{2, 2}, []string{"dp", "tp"})
			if err != nil {
				return err
			}
			opts := []gpt.TrainOption{gpt.WithRun(ref), gpt.WithDataParallel("dp"), gpt.WithTensorParallel("tp")}
			if !imported {
				opts = append(opts, gpt.WithModel(gpt.WithParams(init)))
			}
			tr, err := gpt.NewTrainer(ctx, m, gpt.FromReference(ref), opts...)
			if err != nil {
				return err
			}
			if imported {
				targets := map[string]*placement.Spec{}
				for _, n := range tr.Model.Names() {
					targets[n] = tr.Model.Param(n).Spec()
				}
				// loom fuses qkv as [3, D, D] and [3, D], PyTorch as [3D, D] and [3D].
				_, err := checkpoint.Import(ctx, path, targets, checkpoint.WithPrefix(tinygpt.PrefixInit))
				if !errors.Is(err, checkpoint.ErrInvalid) || !strings.Contains(err.Error(), "qkv") {
					return fmt.Errorf("without WithReshape: %v, want ErrInvalid naming a qkv tensor", err)
				}
				st, err := checkpoint.Import(ctx, path, targets, checkpoint.WithPrefix(tinygpt.PrefixInit), checkpoint.WithReshape())
				if err != nil {
					return err
				}
				for n, x := range st.Tensors {
					dst, ok := tr.Model.Param(n).Data().LocalData().([]float32)
					if !ok {
						return fmt.Errorf("%s: local block of %T", n, tr.Model.Param(n).Data().LocalData())
					}
					copy(dst, x.LocalData().([]float32))
				}
			}
			_, loss, err := tr.Step(ctx)
			if c.Rank() == 0 {
				losses[i] = loss
			}
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	if math.Float64bits(losses[0]) != math.Float64bits(losses[1]) {
		t.Errorf("step-1 loss %.9f from the imported weights, %.9f from WithParams", losses[0], losses[1])
	}
	if rel := math.Abs(losses[0]-fx.LossStep1) / fx.LossStep1; rel > fx.Tolerances.LossStep1Rel {
		t.Errorf("step-1 loss %.9f, PyTorch's %.9f (relative error %.3g)", losses[0], fx.LossStep1, rel)
	}
	t.Logf("step-1 loss %.9f (PyTorch %.9f)", losses[0], fx.LossStep1)
}
