package observe

import (
	"context"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/inpod-dev/inpod/internal/testkit"
	"github.com/inpod-dev/inpod/readiness"
)

func freeAddr(t *testing.T) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

func get(t *testing.T, url string) (int, string) {
	t.Helper()
	var code int
	var body string
	testkit.Eventually(t, 5*time.Second, "an answer from "+url, func() bool {
		resp, err := http.Get(url)
		if err != nil {
			return false
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		code, body = resp.StatusCode, string(b)
		return true
	})
	return code, body
}

func TestHealthReadinessAndMetricsEndpoints(t *testing.T) {
	ready := readiness.New(nil, readiness.CNIInstalled, readiness.ZtunnelConnected)
	m := NewMetrics()
	ready.OnChange(m.Readiness)
	health, metrics := freeAddr(t), freeAddr(t)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- Serve(ctx, slog.New(slog.NewTextHandler(io.Discard, nil)), health, metrics, m, ready, false)
	}()
	defer func() { cancel(); <-done }()

	if code, _ := get(t, "http://"+health+"/healthz"); code != 200 {
		t.Fatalf("/healthz = %d", code)
	}
	ready.Set(readiness.CNIInstalled, true, "")
	code, body := get(t, "http://"+health+"/readyz")
	if code != http.StatusServiceUnavailable || !strings.Contains(body, "ztunnel-connected") {
		t.Fatalf("/readyz not ready = %d %q, want 503 naming the failing condition", code, body)
	}
	ready.Set(readiness.ZtunnelConnected, true, "")
	if code, _ := get(t, "http://"+health+"/readyz"); code != 200 {
		t.Fatalf("/readyz ready = %d", code)
	}
	m.Enrolled("cni", 3*time.Millisecond)
	m.Failed("ZtunnelTimeout")
	_, text := get(t, "http://"+metrics+"/metrics")
	for _, want := range []string{`inpod_node_ready 1`, `inpod_node_ready_transitions_total 1`,
		`inpod_enrollments_total{source="cni"} 1`, `inpod_enrollment_failures_total{reason="ZtunnelTimeout"} 1`,
		`inpod_enrollment_duration_seconds_bucket`} {
		if !strings.Contains(text, want) {
			t.Errorf("/metrics lacks %q", want)
		}
	}
}
