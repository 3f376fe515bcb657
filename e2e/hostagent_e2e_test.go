//go:build e2e

package e2e

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"testing"

	"github.com/inpod-dev/inpod/agent"
	"github.com/inpod-dev/inpod/agent/redirect"
	"github.com/inpod-dev/inpod/e2e/cluster"
	"github.com/inpod-dev/inpod/internal/testkit"
	"github.com/inpod-dev/inpod/netns"
	"github.com/inpod-dev/inpod/plugin/plugintest"
)

// runHostAgent runs the agent as a host process in the node's netns,
// against the node's kubelet, containerd and CNI configuration, with the
// plugin built as shipped; mod sets what a test needs beyond that. It stops
// the agent and removes its node-side table when the test ends. It returns
// the agent and its ZDS socket, for the stand-in.
func runHostAgent(ctx context.Context, t *testing.T, node *cluster.Node, mod func(*agent.Config)) (*agent.Agent, string) {
	t.Helper()
	dir := t.TempDir()
	image := filepath.Join(dir, "image")
	if err := plugintest.Build(image); err != nil {
		t.Fatal(err)
	}
	sockDir := testkit.ShortTempDir(t, "inpod-e2e-")
	zdsSocket := filepath.Join(sockDir, "ztunnel.sock")
	cfg := agent.Config{
		NodeName: node.Name, Kubeconfig: node.Kubeconfig,
		ZDSSocket: zdsSocket, CNISocket: filepath.Join(sockDir, "cni.sock"),
		CNISourceDir: image, CNIBinDir: node.CNIBin, CNIConfDir: node.CNIConf, InstallCNI: true,
		StateDir: filepath.Join(dir, "state"), RedirectBackend: "nftables", ExcludedNamespaces: []string{"kube-system"},
		HealthAddr: "127.0.0.1:0", MetricsAddr: "127.0.0.1:0",
		Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo})),
	}
	if mod != nil {
		mod(&cfg)
	}
	a, err := agent.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	actx, acancel := context.WithCancel(ctx)
	adone := make(chan error, 1)
	go func() { adone <- a.Run(actx) }()
	t.Cleanup(func() {
		acancel()
		if err := <-adone; err != nil {
			t.Errorf("agent: %v", err)
		}
		// The agent ran in the host netns; take its node-side table out.
		if host, err := netns.Open("/proc/self/ns/net"); err == nil {
			redirect.NewHostProbes(host).Uninstall()
			host.Close()
		}
	})
	return a, zdsSocket
}
