package main

import (
	"context"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/local"
)

func init() {
	backends["local"] = backend{
		run: func(ctx context.Context, p int, opts comm.Options, fn func(context.Context, comm.Communicator) error) error {
			return local.Run(ctx, p, fn, local.WithOptions(opts))
		},
		algorithms:  local.Algorithms,
		tuningCalls: local.MaxTuningCalls,
	}
}
