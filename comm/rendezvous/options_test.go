package rendezvous

import (
	"context"
	"strings"
	"testing"
	"time"
)

func TestClientOptions(t *testing.T) {
	def := clientConfig{timeout: 5 * time.Minute, dialTimeout: 30 * time.Second, retryInterval: 50 * time.Millisecond, maxFrame: DefaultMaxFrame}
	with := func(f func(*clientConfig)) clientConfig { c := def; f(&c); return c }
	tests := []struct {
		name string
		opts []ClientOption
		want clientConfig
	}{
		{"defaults", nil, def},
		{"nil option skipped", []ClientOption{nil}, def},
		{"timeout", []ClientOption{WithTimeout(time.Second)}, with(func(c *clientConfig) { c.timeout = time.Second })},
		{"no timeout", []ClientOption{WithTimeout(0)}, with(func(c *clientConfig) { c.timeout = 0 })},
		{"dial timeout", []ClientOption{WithDialTimeout(time.Second)}, with(func(c *clientConfig) { c.dialTimeout = time.Second })},
		{"non-positive dial timeout keeps the default", []ClientOption{WithDialTimeout(-1)}, def},
		{"retry interval", []ClientOption{WithRetryInterval(time.Millisecond)}, with(func(c *clientConfig) { c.retryInterval = time.Millisecond })},
		{"zero retry interval keeps the default", []ClientOption{WithRetryInterval(0)}, def},
		{"max frame", []ClientOption{WithClientMaxFrame(100)}, with(func(c *clientConfig) { c.maxFrame = 100 })},
		{"zero max frame keeps the default", []ClientOption{WithClientMaxFrame(0)}, def},
		{"later option wins", []ClientOption{WithTimeout(time.Second), WithTimeout(time.Hour)}, with(func(c *clientConfig) { c.timeout = time.Hour })},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := newClientConfig(tc.opts); got != tc.want {
				t.Errorf("config %+v, want %+v", got, tc.want)
			}
		})
	}
}

func TestServerOptions(t *testing.T) {
	def := serverConfig{maxFrame: DefaultMaxFrame, maxPending: 4096, writeTimeout: 30 * time.Second, frameTimeout: 30 * time.Second}
	with := func(f func(*serverConfig)) serverConfig { c := def; f(&c); return c }
	tests := []struct {
		name string
		opts []ServerOption
		want serverConfig
	}{
		{"defaults", nil, def},
		{"nil option skipped", []ServerOption{nil}, def},
		{"max frame", []ServerOption{WithServerMaxFrame(64)}, with(func(c *serverConfig) { c.maxFrame = 64 })},
		{"negative max frame keeps the default", []ServerOption{WithServerMaxFrame(-1)}, def},
		{"max pending", []ServerOption{WithMaxPending(3)}, with(func(c *serverConfig) { c.maxPending = 3 })},
		{"zero max pending keeps the default", []ServerOption{WithMaxPending(0)}, def},
		{"write timeout", []ServerOption{WithWriteTimeout(time.Second)}, with(func(c *serverConfig) { c.writeTimeout = time.Second })},
		{"zero write timeout keeps the default", []ServerOption{WithWriteTimeout(0)}, def},
		{"frame timeout", []ServerOption{WithFrameTimeout(time.Second)}, with(func(c *serverConfig) { c.frameTimeout = time.Second })},
		{"zero frame timeout keeps the default", []ServerOption{WithFrameTimeout(0)}, def},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := newServerConfig(tc.opts); got != tc.want {
				t.Errorf("config %+v, want %+v", got, tc.want)
			}
		})
	}
}

// TestServerMaxFrame checks that the server enforces its own limit: a
// request the client allows but the server does not is answered with an
// error and the connection closed.
func TestServerMaxFrame(t *testing.T) {
	checkLeaks(t)
	s := startServer(t, WithServerMaxFrame(1024))
	c := dial(t, s.Addr())
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := c.Set(ctx, "small", make([]byte, 100)); err != nil {
		t.Fatalf("small set: %v", err)
	}
	err := c.Set(ctx, "big", make([]byte, 2000))
	if err == nil || !strings.Contains(err.Error(), "frame too large: 2020 bytes, limit 1024") {
		t.Errorf("set of 2000 bytes under a 1024-byte server limit: %v", err)
	}
}
