package rendezvous_test

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/b7ea7098/loom/comm/rendezvous"
)

// Four ranks share a unique id published by rank 0, then meet at a
// barrier. In a real job each rank is a process that finds the server
// with rendezvous.DialEnv (cmd/loomrun sets MASTER_ADDR and MASTER_PORT).
func Example() {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	srv, err := rendezvous.Listen(ctx, "127.0.0.1:0")
	if err != nil {
		fmt.Println(err)
		return
	}
	defer srv.Close()

	const world = 4
	ids := make([]string, world)
	var wg sync.WaitGroup
	for rank := 0; rank < world; rank++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c, err := rendezvous.Dial(ctx, srv.Addr(), rendezvous.WithTimeout(5*time.Second))
			if err != nil {
				fmt.Println(err)
				return
			}
			defer c.Close()
			if rank == 0 {
				if err := c.Set(ctx, "nccl/unique-id", []byte("id-1234")); err != nil {
					fmt.Println(err)
					return
				}
			}
			id, err := c.Get(ctx, "nccl/unique-id") // blocks until rank 0 set it
			if err != nil {
				fmt.Println(err)
				return
			}
			ids[rank] = string(id)
			if err := c.Barrier(ctx, "init", world); err != nil {
				fmt.Println(err)
			}
		}()
	}
	wg.Wait()
	fmt.Println(ids)
	// Output: [id-1234 id-1234 id-1234 id-1234]
}
