//go:build e2e

package cluster_test

import (
	"context"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/inpod-dev/inpod/e2e/cluster"
	"github.com/inpod-dev/inpod/e2e/images"
	"github.com/inpod-dev/inpod/internal/testkit"
)

func TestE2ENodeRunsAPodAndTearsDownClean(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	root := "/var/lib/inpod-e2e-test"
	netnsBefore := netnsNames()
	tablesBefore, _ := exec.Command("nft", "list", "tables").Output()
	start := time.Now()
	node, err := cluster.StartNode(ctx, cluster.NodeConfig{Config: cluster.Config{Root: root}, RepoDir: testkit.RepoDir(t)})
	if err != nil {
		t.Fatal(err)
	}
	stopped := false
	t.Cleanup(func() {
		if !stopped {
			node.Stop()
		}
	})
	t.Logf("node Ready in %s", time.Since(start).Round(time.Millisecond))

	pods := node.Client.CoreV1().Pods("default")
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "app"},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{
			Name: "app", Image: images.TestAppRef, ImagePullPolicy: corev1.PullNever,
		}}},
	}
	if _, err := pods.Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	var running *corev1.Pod
	if err := testkit.Poll(2*time.Minute, "the pod Running", func() (bool, error) {
		p, err := pods.Get(ctx, "app", metav1.GetOptions{})
		if err == nil && p.Status.Phase == corev1.PodRunning {
			running = p
		}
		return running != nil, nil
	}); err != nil {
		t.Fatalf("%v\nkubelet:\n%s", err, node.Logs("kubelet", 40))
	}
	t.Logf("pod Running %s after start", time.Since(start).Round(time.Millisecond))
	ip, err := netip.ParseAddr(running.Status.PodIP)
	if err != nil || !netip.MustParsePrefix(cluster.PodCIDR).Contains(ip) {
		t.Fatalf("pod IP %q is not from the bridge's range %s", running.Status.PodIP, cluster.PodCIDR)
	}

	kubectl := func(args ...string) string {
		t.Helper()
		cmd := exec.CommandContext(ctx, filepath.Join(os.Getenv(cluster.BinDirEnv), "kubectl"), append([]string{"--kubeconfig", node.Kubeconfig}, args...)...)
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("kubectl %s: %v: %s", strings.Join(args, " "), err, out)
		}
		return string(out)
	}
	if out := kubectl("exec", "app", "--", "/testapp", "--dial", "127.0.0.1:8080"); !strings.Contains(out, "testapp host=app") {
		t.Errorf("kubectl exec: %q", out)
	}
	if out := kubectl("logs", "app"); !strings.Contains(out, "serving on") {
		t.Errorf("kubectl logs: %q", out)
	}

	if err := node.Stop(); err != nil {
		t.Fatal(err)
	}
	stopped = true
	// Nothing of the node is left.
	if _, err := os.Stat(root); !os.IsNotExist(err) {
		t.Errorf("state root %s still there (%v)", root, err)
	}
	if mounts, _ := os.ReadFile("/proc/self/mountinfo"); strings.Contains(string(mounts), root) {
		t.Errorf("mounts under %s remain", root)
	}
	if err := exec.Command("ip", "link", "show", cluster.BridgeName).Run(); err == nil {
		t.Errorf("bridge %s remains", cluster.BridgeName)
	}
	if tables, _ := exec.Command("nft", "list", "tables").Output(); string(tables) != string(tablesBefore) {
		t.Errorf("host netfilter tables changed:\nbefore:\n%s\nafter:\n%s", tablesBefore, tables)
	}
	for ns := range netnsNames() {
		if !netnsBefore[ns] {
			t.Errorf("netns %s remains", ns)
		}
	}
	procs, _ := filepath.Glob("/proc/[0-9]*/cmdline")
	for _, p := range procs {
		if b, err := os.ReadFile(p); err == nil && strings.Contains(string(b), root) {
			t.Errorf("process %s still runs: %q", p, strings.ReplaceAll(string(b), "\x00", " "))
		}
	}
}

func netnsNames() map[string]bool {
	out := map[string]bool{}
	entries, _ := os.ReadDir("/var/run/netns")
	for _, e := range entries {
		out[e.Name()] = true
	}
	return out
}
