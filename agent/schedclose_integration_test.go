//go:build integration

package agent_test

import (
	"context"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/inpod-dev/inpod/deviceplugin"
)

// The device-plugin gate closes in two steps, with deploy/rbac's rights:
// on a readiness dip, and when the agent stops, it first sets its Node's
// allocatable to 0 (writing it again when the kubelet's status sync puts
// the count back), keeps the devices Healthy until a pod bound just
// before has been through the kubelet's admission, and only then turns
// them Unhealthy (or stops serving). Before, the kubelet refused such a
// pod for good (UnexpectedAdmissionError).
func TestIntegrationDevicePluginGateClosesSchedulingFirst(t *testing.T) {
	w := newWorld(t)
	ctx := context.Background()
	const res = corev1.ResourceName(deviceplugin.DefaultResourceName)
	nodes := w.client.CoreV1().Nodes()
	if _, err := nodes.Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: nodeName}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	// What the kubelet writes at its status sync: 4 devices, all Healthy.
	kubeletSync := func() {
		t.Helper()
		if _, err := nodes.PatchStatus(ctx, nodeName, []byte(`{"status":{"capacity":{"inpod.dev/redirection":"4"},"allocatable":{"inpod.dev/redirection":"4"}}}`)); err != nil {
			t.Fatal(err)
		}
	}
	allocatable := func() int64 {
		n, err := nodes.Get(ctx, nodeName, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		q, ok := n.Status.Allocatable[res]
		if !ok {
			return -1
		}
		return q.Value()
	}
	kubeletSync()
	w.applyRBAC()
	_, self := w.agentDaemonSet("inpod-agent")
	w.runAs(self)
	w.cfg.Gate = "deviceplugin"
	stopAgent := w.runAgent()
	w.eventually("devices Healthy", func() bool { return w.kubelet.Allocatable(string(res)) == 4 })

	// A pod the scheduler bound on the count the Node showed, which the
	// kubelet has not admitted yet.
	n := 0
	boundPod := func() *corev1.Pod {
		t.Helper()
		n++
		p, err := w.client.CoreV1().Pods("plain").Create(ctx, &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{GenerateName: "bound-"},
			Spec: corev1.PodSpec{NodeName: nodeName, Containers: []corev1.Container{{Name: "app", Image: "app",
				Resources: corev1.ResourceRequirements{Limits: corev1.ResourceList{res: resource.MustParse("1")}}}}},
		}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		w.eventually("the agent's watch has the bound pod", func() bool { return w.agent.PodCached(p.Namespace, p.Name) })
		return p
	}
	admit := func(p *corev1.Pod) {
		t.Helper()
		now := metav1.Now()
		p.Status = corev1.PodStatus{Phase: corev1.PodPending, StartTime: &now}
		if _, err := w.client.CoreV1().Pods(p.Namespace).UpdateStatus(ctx, p, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	// holds polls, for d after since, that the
	// devices stay Healthy.
	holds := func(since time.Time, d time.Duration, what string) {
		t.Helper()
		w.eventually(what, func() bool {
			if u, ok := w.kubelet.FirstSince(string(res), since, 0); ok {
				t.Fatalf("devices turned Unhealthy at %s (%s after the dip) with a bound pod not yet admitted", u.At, u.At.Sub(since))
			}
			return time.Since(since) > d
		})
	}

	// A readiness dip: ztunnel goes.
	pending := boundPod()
	dip := time.Now()
	w.stopStandin()
	w.eventually("the Node's allocatable 0", func() bool { return allocatable() == 0 })
	kubeletSync()
	w.eventually("the Node's allocatable 0 again after the kubelet's status sync", func() bool { return allocatable() == 0 })
	holds(dip, 2*time.Second, "devices Healthy while the bound pod waits for admission")
	admit(pending)
	w.eventually("devices Unhealthy once the bound pod is admitted", func() bool { return w.kubelet.Allocatable(string(res)) == 0 })
	// A kubelet status sync that computed its count before it saw the
	// devices Unhealthy: the agent keeps the Node at 0.
	kubeletSync()
	w.eventually("the Node's allocatable kept at 0 after the devices turned Unhealthy", func() bool { return allocatable() == 0 })

	// Ready again: Healthy at once; the kubelet writes the count back,
	// and nothing of the agent's closes it again.
	w.stopStandin = w.startStandin()
	w.eventually("devices Healthy again", func() bool { return w.kubelet.Allocatable(string(res)) == 4 })
	kubeletSync()
	reopened := time.Now()
	w.eventually("the Node's count left open once ready again", func() bool {
		if n := allocatable(); n != 4 {
			t.Fatalf("the Node's allocatable %d after the node was ready again and the kubelet wrote 4", n)
		}
		return time.Since(reopened) > 1500*time.Millisecond
	})

	// The agent stops (a restart, an upgrade): the same close before the
	// plugin's stream ends.
	pending = boundPod()
	stopping := time.Now()
	stopped := make(chan error, 1)
	go func() { stopped <- stopAgent() }()
	w.eventually("the Node's allocatable 0 as the agent stops", func() bool { return allocatable() == 0 })
	// A shutdown's close is bounded at 2 s (the agent's termination
	// grace period holds it): admitted within it.
	holds(stopping, 900*time.Millisecond, "devices Healthy while the stopping agent waits for the bound pod's admission")
	select {
	case err := <-stopped:
		t.Fatalf("the agent stopped (%v) before the bound pod was admitted", err)
	default:
	}
	admit(pending)
	select {
	case err := <-stopped:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the agent did not stop once the bound pod was admitted")
	}

	closes := map[string]uint64{}
	families, err := w.agent.Metrics.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() == "inpod_deviceplugin_close_seconds" {
			for _, m := range f.GetMetric() {
				closes[m.GetLabel()[0].GetValue()] = m.GetHistogram().GetSampleCount()
			}
		}
	}
	if closes["closed"] != 2 || closes["incomplete"] != 0 {
		t.Fatalf("closes %v, want 2 closed", closes)
	}
}
