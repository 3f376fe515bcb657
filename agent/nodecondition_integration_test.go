//go:build integration

package agent_test

import (
	"context"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/inpod-dev/inpod/nodecondition"
)

// --gate=node-condition, run with exactly deploy/rbac's rights: the agent
// writes InPodRedirectionReady as it becomes ready and as ztunnel leaves.
func TestIntegrationNodeConditionGateFollowsTheAgent(t *testing.T) {
	w := newWorld(t)
	ctx := context.Background()
	if _, err := w.client.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: nodeName}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	w.applyRBAC()
	_, self := w.agentDaemonSet("inpod-agent")
	w.runAs(self)
	w.cfg.Gate = "deviceplugin,node-condition"
	w.startInProcessAgent()

	condition := func() *corev1.NodeCondition {
		n, err := w.client.CoreV1().Nodes().Get(ctx, nodeName, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		for i := range n.Status.Conditions {
			if n.Status.Conditions[i].Type == nodecondition.ConditionType {
				return &n.Status.Conditions[i]
			}
		}
		return nil
	}
	w.eventually("the condition True", func() bool {
		c := condition()
		return c != nil && c.Status == corev1.ConditionTrue && c.Reason == nodecondition.ReasonReady
	})
	w.stopStandin()
	w.eventually("the condition False for ztunnel", func() bool {
		c := condition()
		return c != nil && c.Status == corev1.ConditionFalse && c.Reason == nodecondition.ReasonZtunnelNotConnected
	})
	families, err := w.agent.Metrics.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	writes := map[string]float64{}
	for _, f := range families {
		for _, m := range f.GetMetric() {
			switch f.GetName() {
			case "inpod_node_condition_write_failures_total":
				if v := m.GetCounter().GetValue(); v != 0 {
					t.Fatalf("%v failed condition writes with deploy/rbac's rights", v)
				}
			case "inpod_node_condition_writes_total":
				writes[m.GetLabel()[0].GetValue()] = m.GetCounter().GetValue()
			}
		}
	}
	if writes["True"] < 1 || writes["False"] < 1 {
		t.Fatalf("condition writes by status: %v, want True and False counted", writes)
	}
}
