package zdstest

import (
	"context"
	"io"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/inpod-dev/inpod/readiness"
	"github.com/inpod-dev/inpod/zds"
)

// Start runs a stand-in with cfg for a test, reconnecting quickly (10 ms to
// 100 ms unless cfg says otherwise) and logging nowhere unless cfg has a
// logger. It stops at the returned func or at the test's end, whichever is
// first; a protocol violation it saw then fails a test that had not failed
// already.
func Start(t testing.TB, cfg Config) (*Standin, func()) {
	t.Helper()
	if cfg.MinBackoff == 0 {
		cfg.MinBackoff = 10 * time.Millisecond
	}
	if cfg.MaxBackoff == 0 {
		cfg.MaxBackoff = 100 * time.Millisecond
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	z := New(cfg)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { z.Run(ctx); close(done) }()
	var once sync.Once
	stop := func() {
		once.Do(func() {
			cancel()
			<-done
			if errs := z.ProtocolErrors(); len(errs) > 0 && !t.Failed() {
				t.Errorf("the ztunnel stand-in saw protocol errors: %v", errs)
			}
		})
	}
	t.Cleanup(stop)
	return z, stop
}

// ServeNoPods runs a ZDS server with no pods on socketPath for a test of a
// gate, reporting ztunnel's presence into ready's ZtunnelConnected
// condition the way the agent does, until the test ends.
func ServeNoPods(t testing.TB, socketPath string, ready *readiness.Aggregate, log *slog.Logger) *zds.Server {
	t.Helper()
	srv, err := zds.NewServer(zds.Config{SocketPath: socketPath, Source: noPods{}, Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	if err := srv.Listen(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { defer wg.Done(); srv.Serve(ctx) }()
	go func() {
		defer wg.Done()
		srv.Follow(ctx, func(st zds.State) { ready.Set(readiness.ZtunnelConnected, st.Ready, st.NotReadyReason()) })
	}()
	t.Cleanup(func() { cancel(); wg.Wait() })
	return srv
}

type noPods struct{}

func (noPods) Snapshot(context.Context) ([]zds.Workload, error) { return nil, nil }
