package main

import (
	"bytes"
	"context"
	"io"
	"log/slog"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/inpod-dev/inpod/agent/observe"
	"github.com/inpod-dev/inpod/internal/testkit"
)

// The probe against the agent's real probe server: 0 for /healthz and a
// ready /readyz, 1 with the agent's reason for an unready one, 1 when no
// agent answers, 2 for a bad invocation.
func TestProbeAsksTheAgentsOwnSocket(t *testing.T) {
	path := filepath.Join(testkit.ShortTempDir(t, "probe-"), "probe.sock")
	var ready atomic.Bool
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- observe.ServeProbes(ctx, slog.New(slog.NewTextHandler(io.Discard, nil)), path, func() (bool, string) {
			if ready.Load() {
				return true, "ready"
			}
			return false, "not ready: ztunnel-connected: no ztunnel"
		})
	}()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	}()
	probe := func(args ...string) (int, string) {
		var out, errOut bytes.Buffer
		code := run(args, &out, &errOut)
		return code, out.String() + errOut.String()
	}
	testkit.Eventually(t, 10*time.Second, "the probe server answering", func() bool {
		code, _ := probe(path, "/healthz")
		return code == 0
	})
	if code, out := probe(path, "/readyz"); code != 1 || !strings.Contains(out, "no ztunnel") {
		t.Fatalf("unready: exit %d, %q; want 1 with the reason", code, out)
	}
	ready.Store(true)
	if code, out := probe(path, "/readyz"); code != 0 {
		t.Fatalf("ready: exit %d, %q", code, out)
	}
	if code, _ := probe(filepath.Join(filepath.Dir(path), "none.sock"), "/readyz"); code != 1 {
		t.Fatalf("no agent: exit %d, want 1", code)
	}
	if code, _ := probe(path); code != 2 {
		t.Fatalf("no path: exit %d, want 2", code)
	}
}
