package agent

import (
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// The agent's API client carries the configured rate limit, defaulting to
// DefaultKubeAPIQPS/DefaultKubeAPIBurst rather than client-go's 5/s, and
// the gates' own clients copy it.
func TestNewSetsTheAPIRateLimit(t *testing.T) {
	kubeconfig := filepath.Join(t.TempDir(), "kubeconfig")
	if err := os.WriteFile(kubeconfig, []byte(`apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "https://127.0.0.1:1"}}]
users: [{name: u, user: {token: t}}]
contexts: [{name: x, context: {cluster: c, user: u}}]
current-context: x
`), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		qps       float32
		burst     int
		wantQPS   float32
		wantBurst int
	}{
		{0, 0, DefaultKubeAPIQPS, DefaultKubeAPIBurst},
		{100, 200, 100, 200},
		{2, 0, 2, DefaultKubeAPIBurst},
		{100, 0, 100, 100},
	} {
		a, err := New(Config{NodeName: "n", Kubeconfig: kubeconfig, Gate: "none", KubeAPIQPS: tc.qps, KubeAPIBurst: tc.burst})
		if err != nil {
			t.Fatalf("New(qps %v, burst %d): %v", tc.qps, tc.burst, err)
		}
		if a.restCfg.QPS != tc.wantQPS || a.restCfg.Burst != tc.wantBurst {
			t.Errorf("New(qps %v, burst %d): client limit %v/%d, want %v/%d", tc.qps, tc.burst, a.restCfg.QPS, a.restCfg.Burst, tc.wantQPS, tc.wantBurst)
		}
	}
}

// A rate limit client-go cannot honour is refused before anything runs.
func TestNewRejectsUnusableAPIRateLimits(t *testing.T) {
	for _, tc := range []struct {
		qps   float32
		burst int
		want  string
	}{
		{-1, 0, "not a usable rate limit"},
		{float32(math.NaN()), 0, "not a usable rate limit"},
		{0, -1, "not a usable rate limit"},
		{100, 10, "below --kube-api-qps"},
	} {
		_, err := New(Config{NodeName: "n", KubeAPIQPS: tc.qps, KubeAPIBurst: tc.burst})
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("New(qps %v, burst %d) = %v, want an error containing %q", tc.qps, tc.burst, err, tc.want)
		}
	}
}
