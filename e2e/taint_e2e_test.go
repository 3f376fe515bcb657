//go:build e2e

package e2e

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/inpod-dev/inpod/agent"
	"github.com/inpod-dev/inpod/e2e/cluster"
	"github.com/inpod-dev/inpod/e2e/cluster/clustertest"
	"github.com/inpod-dev/inpod/e2e/images"
	"github.com/inpod-dev/inpod/internal/testkit"
	"github.com/inpod-dev/inpod/nodecondition"
	"github.com/inpod-dev/inpod/taintcontroller"
	ztunnel "github.com/inpod-dev/inpod/zds/zdstest"
)

// installNodeTaintPolicy applies deploy/controller/node-taint-policy.yaml
// and waits until it acts on a new Node (a new policy takes seconds).
func installNodeTaintPolicy(ctx context.Context, cp *cluster.ControlPlane, repo string) error {
	out, err := exec.CommandContext(ctx, filepath.Join(os.Getenv(cluster.BinDirEnv), "kubectl"), "--kubeconfig", cp.Kubeconfig,
		"apply", "-f", filepath.Join(repo, "deploy", "controller", "node-taint-policy.yaml")).CombinedOutput()
	if err != nil {
		return fmt.Errorf("kubectl apply: %v: %s", err, out)
	}
	probe := 0
	return testkit.Poll(60*time.Second, "the node-taint policy in effect", func() (bool, error) {
		probe++
		name := fmt.Sprintf("policy-probe-%d", probe)
		n, err := cp.Client.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{"kubernetes.io/os": "linux"}}}, metav1.CreateOptions{})
		if err != nil {
			return false, err
		}
		if err := cp.Client.CoreV1().Nodes().Delete(ctx, name, metav1.DeleteOptions{}); err != nil {
			return false, err
		}
		return hasTaint(n, taintcontroller.DefaultTaintKey), nil
	})
}

func hasTaint(n *corev1.Node, key string) bool {
	for _, t := range n.Spec.Taints {
		if t.Key == key && t.Effect == taintcontroller.DefaultTaintEffect {
			return true
		}
	}
	return false
}

// TestE2ETaintModeGatesScheduling: the node-taint policy is installed before
// the real kubelet registers, so its Node carries the startup taint; a pod
// without a toleration stays Pending; inpod-controller (a host process)
// removes the taint once the agent (gate node-condition) is ready and the
// node's agent pod is Ready, and the pod runs.
func TestE2ETaintModeGatesScheduling(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	repo := testkit.RepoDir(t)
	node := clustertest.Node(ctx, t, cluster.NodeConfig{Config: cluster.Config{Root: "/var/lib/inpod-e2e-taint"}, RepoDir: repo,
		BeforeKubelet: func(ctx context.Context, cp *cluster.ControlPlane) error {
			return installNodeTaintPolicy(ctx, cp, repo)
		}})
	client := node.Client
	getNode := func() *corev1.Node {
		n, err := client.CoreV1().Nodes().Get(ctx, node.Name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	if !hasTaint(getNode(), taintcontroller.DefaultTaintKey) {
		t.Fatalf("the kubelet registered its Node without the startup taint: %+v", getNode().Spec.Taints)
	}

	// The agent's pod (the DaemonSet's, here a stand-in beside the agent
	// that runs as a host process) tolerates the taint.
	const ns = taintcontroller.DefaultNamespace
	if _, err := client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, 30*time.Second, "the namespace's service account", func() bool {
		_, err := client.CoreV1().ServiceAccounts(ns).Get(ctx, "default", metav1.GetOptions{})
		return err == nil
	})
	pod := func(name, namespace string, lbls map[string]string, tol []corev1.Toleration) *corev1.Pod {
		return &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: namespace, Labels: lbls},
			Spec: corev1.PodSpec{TerminationGracePeriodSeconds: new(int64), Tolerations: tol,
				Containers: []corev1.Container{{Name: "app", Image: images.TestAppRef, ImagePullPolicy: corev1.PullNever}}},
		}
	}
	agentPod := pod("inpod-agent", ns, map[string]string{"app.kubernetes.io/name": "inpod", "app.kubernetes.io/component": "agent"},
		[]corev1.Toleration{{Key: taintcontroller.DefaultTaintKey, Operator: corev1.TolerationOpExists, Effect: corev1.TaintEffectNoSchedule}})
	if _, err := client.CoreV1().Pods(ns).Create(ctx, agentPod, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := client.CoreV1().Pods("default").Create(ctx, pod("app", "default", nil, nil), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	podReady := func(namespace, name string) bool {
		p, err := client.CoreV1().Pods(namespace).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return false
		}
		for _, c := range p.Status.Conditions {
			if c.Type == corev1.PodReady {
				return c.Status == corev1.ConditionTrue
			}
		}
		return false
	}
	testkit.Eventually(t, 90*time.Second, "the agent pod Ready", func() bool { return podReady(ns, "inpod-agent") })

	c, err := taintcontroller.New(taintcontroller.Config{Client: client, Mode: taintcontroller.Bootstrap,
		LeaseDuration: 2 * time.Second, RenewDeadline: 1500 * time.Millisecond, RetryPeriod: 200 * time.Millisecond,
		ReleaseOnCancel: true, Logger: slog.New(slog.NewTextHandler(os.Stderr, nil))})
	if err != nil {
		t.Fatal(err)
	}
	cctx, ccancel := context.WithCancel(ctx)
	cdone := make(chan error, 1)
	go func() { cdone <- c.Run(cctx) }()
	t.Cleanup(func() {
		ccancel()
		if err := <-cdone; err != nil {
			t.Errorf("inpod-controller: %v", err)
		}
	})

	a, zdsSocket := runHostAgent(ctx, t, node, func(c *agent.Config) { c.Gate = "node-condition" })
	condition := func() corev1.ConditionStatus { return nodeCondition(ctx, node, nodecondition.ConditionType) }
	// No ztunnel yet: the agent reports False, the taint stays, the pod
	// stays Pending for the taint.
	testkit.Eventually(t, 60*time.Second, "the condition False", func() bool { return condition() == corev1.ConditionFalse })
	testkit.Eventually(t, 60*time.Second, "the scheduler to report the taint", func() bool {
		p, err := client.CoreV1().Pods("default").Get(ctx, "app", metav1.GetOptions{})
		if err != nil {
			return false
		}
		for _, c := range p.Status.Conditions {
			if c.Type == corev1.PodScheduled && c.Status == corev1.ConditionFalse && strings.Contains(c.Message, "untolerated taint") {
				return p.Spec.NodeName == ""
			}
		}
		return false
	})
	if !hasTaint(getNode(), taintcontroller.DefaultTaintKey) {
		t.Fatal("taint removed while the agent reports False")
	}

	ztunnel.Start(t, ztunnel.Config{SocketPath: zdsSocket})
	testkit.Eventually(t, 30*time.Second, "the agent ready", func() bool { return a.Ready.State().Ready })
	readyAt := time.Now()
	testkit.Eventually(t, 30*time.Second, "the startup taint removed", func() bool { return !hasTaint(getNode(), taintcontroller.DefaultTaintKey) })
	t.Logf("agent ready → taint removed: %s", time.Since(readyAt).Round(time.Millisecond))
	testkit.Eventually(t, 90*time.Second, "the pod Running once the taint is gone", func() bool {
		p, err := client.CoreV1().Pods("default").Get(ctx, "app", metav1.GetOptions{})
		return err == nil && p.Status.Phase == corev1.PodRunning
	})
}
