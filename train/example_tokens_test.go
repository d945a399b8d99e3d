package train_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/launch"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/train"
)

// Read a text file as byte tokens on two data-parallel ranks: windows of
// T+1 tokens, the last tenth held out for validation, each rank its rows
// of every shuffled global batch, and a position to checkpoint. A
// nanoGPT train.bin or an llm.c .bin file opens the same way (OpenTokens
// detects the format) with the tokenizer's vocabulary, 50257 for GPT-2.
func ExampleWindows() {
	dir, err := os.MkdirTemp("", "text")
	if err != nil {
		fmt.Println(err)
		return
	}
	defer os.RemoveAll(dir)
	path := filepath.Join(dir, "input.txt")
	text := []byte("It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of foolishness.\n")
	if err := os.WriteFile(path, text, 0o644); err != nil {
		fmt.Println(err)
		return
	}
	job, err := launch.InProcess(2)
	if err != nil {
		fmt.Println(err)
		return
	}
	err = job.Run(context.Background(), func(ctx context.Context, c comm.Communicator) error {
		m, err := mesh.New(c, []int{2}, []string{"dp"})
		if err != nil {
			return err
		}
		f, err := train.OpenTokens(path, 256) // one token per byte
		if err != nil {
			return err
		}
		defer f.Close()
		all, err := train.NewWindows(f, 8, m, "dp") // T = 8
		if err != nil {
			return err
		}
		data, held, err := all.Split(0.1)
		if err != nil {
			return err
		}
		sampler, err := data.Sampler(4, train.WithShuffle(1)) // this rank's rows of each batch of 4
		if err != nil {
			return err
		}
		batch, err := data.Batch(ctx, sampler.Next()) // a train.LM: X and Y for gpt.Model.Forward
		if err != nil {
			return err
		}
		state := sampler.State() // saved with a checkpoint; sampler.Restore(state) resumes
		if c.Rank() == 0 {
			fmt.Printf("%d windows, %d held out; batch %v, rank 0 holds %d rows; next %+v\n",
				data.Len(), held.Len(), batch.X.Shape(), len(batch.X.Local())/8, state)
		}
		return nil
	})
	if err != nil {
		fmt.Println(err)
	}
	// Output:
	// 11 windows, 2 held out; batch [4 8], rank 0 holds 2 rows; next {Epoch:0 Index:1}
}
