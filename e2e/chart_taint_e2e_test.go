//go:build e2e

package e2e

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/inpod-dev/inpod/e2e/chart"
	"github.com/inpod-dev/inpod/e2e/images"
	"github.com/inpod-dev/inpod/internal/testkit"
	"github.com/inpod-dev/inpod/nodecondition"
	"github.com/inpod-dev/inpod/release"
	"github.com/inpod-dev/inpod/taintcontroller"
)

// TestE2EChartTaintMode installs the chart in taint mode on the real node
// (gates={node-condition}, controller.enabled, controller.nodeTaintPolicy):
// the policy taints a Node created afterwards; the node itself existed
// before the install, which the CREATE-only policy never sees, so it is
// tainted by hand first, as docs/install.md tells users to do for existing
// nodes. inpod-controller runs as a Deployment pod on that tainted node (it
// tolerates the taint), keeps the taint while the agent reports False (no
// ztunnel yet), and removes it once the agent is ready; a pod without a
// toleration then runs.
func TestE2EChartTaintMode(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	c := newChartNode(ctx, t, "/var/lib/inpod-e2e-charttaint")
	node, client := c.Node, c.Client

	const key = taintcontroller.DefaultTaintKey
	getNode := func() *corev1.Node {
		n, err := client.CoreV1().Nodes().Get(ctx, node.Name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	// The existing node, tainted by hand (kubectl taint nodes NODE
	// inpod.dev/not-ready:NoSchedule).
	n := getNode()
	n.Spec.Taints = append(n.Spec.Taints, corev1.Taint{Key: key, Effect: corev1.TaintEffectNoSchedule})
	if _, err := client.CoreV1().Nodes().Update(ctx, n, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}

	c.install(t, "--set", "gates={node-condition}",
		"--set", "controller.enabled=true", "--set", "controller.nodeTaintPolicy.enabled=true",
		"--set", "controller.image.repository="+release.ControllerRepository, "--set", "controller.image.tag="+release.DevTag,
		"--set", "controller.image.pullPolicy=Never")

	// The chart's policy taints a Node at CREATE (a new policy takes
	// seconds to act: probe until it does).
	probe := 0
	testkit.Eventually(t, time.Minute, "the chart's node-taint policy tainting a new Node", func() bool {
		probe++
		name := fmt.Sprintf("policy-probe-%d", probe)
		// kubernetes.io/os: as a kubelet labels its Node; the policy selects
		// the agent's nodes only.
		created, err := client.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name,
			Labels: map[string]string{"kubernetes.io/os": "linux"}}}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if err := client.CoreV1().Nodes().Delete(ctx, name, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
		return hasTaint(created, key)
	})

	if _, err := client.CoreV1().Pods("default").Create(ctx, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "app", Namespace: "default"},
		Spec: corev1.PodSpec{TerminationGracePeriodSeconds: new(int64),
			Containers: []corev1.Container{{Name: "app", Image: images.TestAppRef, ImagePullPolicy: corev1.PullNever}}},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, 2*time.Minute, "the controller pod Ready on the tainted node", func() bool {
		pods, err := client.CoreV1().Pods(chart.Namespace).List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/component=controller"})
		if err != nil {
			return false
		}
		for _, p := range pods.Items {
			for _, c := range p.Status.Conditions {
				if c.Type == corev1.PodReady && c.Status == corev1.ConditionTrue {
					return true
				}
			}
		}
		return false
	})
	condition := func() corev1.ConditionStatus { return nodeCondition(ctx, node, nodecondition.ConditionType) }
	// No ztunnel yet: the agent reports False and the taint stays.
	testkit.Eventually(t, 2*time.Minute, "the condition False", func() bool { return condition() == corev1.ConditionFalse })
	testkit.Eventually(t, time.Minute, "the scheduler to report the taint", func() bool {
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
	if !hasTaint(getNode(), key) {
		t.Fatal("taint removed while the agent reports False")
	}

	c.standInUp(t)
	testkit.Eventually(t, 2*time.Minute, "the agent pod Ready", func() bool { return agentReady(t, ctx, node) != "" })
	readyAt := time.Now()
	testkit.Eventually(t, time.Minute, "the startup taint removed by the controller's pod", func() bool { return !hasTaint(getNode(), key) })
	t.Logf("agent pod Ready → taint removed: %s", time.Since(readyAt).Round(time.Millisecond))
	if condition() != corev1.ConditionTrue {
		t.Errorf("taint removed with the condition %q", condition())
	}
	if _, done := getNode().Annotations[taintcontroller.DoneAnnotation]; !done {
		t.Errorf("bootstrap mode did not record the node as done (%s)", taintcontroller.DoneAnnotation)
	}
	testkit.Eventually(t, 2*time.Minute, "the pod Running once the taint is gone", func() bool {
		p, err := client.CoreV1().Pods("default").Get(ctx, "app", metav1.GetOptions{})
		return err == nil && p.Status.Phase == corev1.PodRunning
	})
}
