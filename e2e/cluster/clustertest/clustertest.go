// Package clustertest starts the real cluster pieces of e2e/cluster for a
// test and stops them when the test ends, failed or not: the one place the
// integration and e2e tiers get their API server or node from.
package clustertest

import (
	"context"
	"path/filepath"
	"testing"

	"github.com/inpod-dev/inpod/e2e/cluster"
)

// ControlPlane starts etcd and kube-apiserver under the test's temporary
// directory (cfg.Root empty) and stops them at the test's end.
func ControlPlane(t testing.TB, cfg cluster.Config) *cluster.ControlPlane {
	t.Helper()
	if cfg.Root == "" {
		cfg.Root = filepath.Join(t.TempDir(), "cp")
	}
	cp, err := cluster.StartControlPlane(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cp.Stop() })
	return cp
}

// Node starts a full single node (control plane, containerd, kubelet) and
// stops it at the test's end, reporting a failed stop as a test error.
func Node(ctx context.Context, t testing.TB, cfg cluster.NodeConfig) *cluster.Node {
	t.Helper()
	node, err := cluster.StartNode(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := node.Stop(); err != nil {
			t.Error(err)
		}
	})
	return node
}
