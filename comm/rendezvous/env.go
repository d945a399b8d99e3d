package rendezvous

import (
	"context"
	"fmt"
	"net"
	"os"
)

// EnvAddr returns the rendezvous address from the environment that
// cmd/loomrun (and torchrun) sets: MASTER_ADDR and MASTER_PORT joined as
// "host:port".
func EnvAddr() (string, error) {
	host, port := os.Getenv("MASTER_ADDR"), os.Getenv("MASTER_PORT")
	if host == "" || port == "" {
		return "", fmt.Errorf("rendezvous: MASTER_ADDR (%q) and MASTER_PORT (%q) must both be set", host, port)
	}
	return net.JoinHostPort(host, port), nil
}

// DialEnv dials the server at EnvAddr: the rendezvous server cmd/loomrun
// runs for the processes it starts.
func DialEnv(ctx context.Context, opts ...ClientOption) (*Client, error) {
	addr, err := EnvAddr()
	if err != nil {
		return nil, err
	}
	return Dial(ctx, addr, opts...)
}
