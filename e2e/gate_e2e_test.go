//go:build e2e

// Package e2e holds the end-to-end tests: inpod on a real single node.
package e2e

import (
	"context"
	"io"
	"log/slog"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/inpod-dev/inpod/agent"
	"github.com/inpod-dev/inpod/deviceplugin"
	"github.com/inpod-dev/inpod/e2e/cluster"
	"github.com/inpod-dev/inpod/e2e/cluster/clustertest"
	"github.com/inpod-dev/inpod/e2e/images"
	"github.com/inpod-dev/inpod/enrollment"
	"github.com/inpod-dev/inpod/internal/testkit"
	ztunnel "github.com/inpod-dev/inpod/zds/zdstest"
)

const gateResource = corev1.ResourceName(deviceplugin.DefaultResourceName)

// TestE2EDevicePluginGatesScheduling runs the agent (as a host process, in
// the node's netns, against the node's real kubelet, containerd and CNI
// configuration) with the ztunnel stand-in, and checks the gate end to end.
func TestE2EDevicePluginGatesScheduling(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	node := clustertest.Node(ctx, t, cluster.NodeConfig{Config: cluster.Config{Root: "/var/lib/inpod-e2e-gate"}, RepoDir: testkit.RepoDir(t)})
	client := node.Client

	const devices = 16
	a, zdsSocket := runHostAgent(ctx, t, node, func(c *agent.Config) {
		c.DevicePlugin = deviceplugin.Config{PluginDir: node.DevicePluginDir(), Devices: devices}
	})

	allocatable := func() int64 {
		n, err := client.CoreV1().Nodes().Get(ctx, node.Name, metav1.GetOptions{})
		if err != nil {
			return -1
		}
		q := n.Status.Allocatable[gateResource]
		return q.Value()
	}
	capacity := func() int64 {
		n, _ := client.CoreV1().Nodes().Get(ctx, node.Name, metav1.GetOptions{})
		q := n.Status.Capacity[gateResource]
		return q.Value()
	}
	// Registered, but not ready (no ztunnel): capacity N, allocatable 0.
	testkit.Eventually(t, 60*time.Second, "the resource registered on the Node", func() bool { return capacity() == devices })
	if got := allocatable(); got != 0 {
		t.Fatalf("allocatable %d before ztunnel connected, want 0", got)
	}

	gated := func(name string) *corev1.Pod {
		return &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: name},
			Spec: corev1.PodSpec{
				TerminationGracePeriodSeconds: new(int64),
				Containers: []corev1.Container{{Name: "app", Image: images.TestAppRef, ImagePullPolicy: corev1.PullNever,
					Resources: corev1.ResourceRequirements{
						Requests: corev1.ResourceList{gateResource: resource.MustParse("1")},
						Limits:   corev1.ResourceList{gateResource: resource.MustParse("1")},
					}}},
			},
		}
	}
	pods := client.CoreV1().Pods("default")
	if _, err := pods.Create(ctx, gated("early"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	unschedulable := func(name string) func() bool {
		return func() bool {
			p, err := pods.Get(ctx, name, metav1.GetOptions{})
			if err != nil {
				return false
			}
			for _, c := range p.Status.Conditions {
				if c.Type == corev1.PodScheduled && c.Status == corev1.ConditionFalse && strings.Contains(c.Message, string(gateResource)) {
					return p.Spec.NodeName == ""
				}
			}
			return false
		}
	}
	testkit.Eventually(t, 60*time.Second, "the scheduler to report the pod unschedulable", unschedulable("early"))

	// ztunnel connects: the node becomes ready; the scheduler sees it at
	// the kubelet's next node-status sync.
	z := ztunnel.New(ztunnel.Config{SocketPath: zdsSocket, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	zctx, zcancel := context.WithCancel(ctx)
	zdone := make(chan struct{})
	go func() { z.Run(zctx); close(zdone) }()
	stopZ := func() { zcancel(); <-zdone }
	t.Cleanup(stopZ)
	testkit.Eventually(t, 30*time.Second, "the agent ready", func() bool { return a.Ready.State().Ready })
	window := testkit.Eventually(t, 60*time.Second, "allocatable on the Node", func() bool { return allocatable() == devices })
	t.Logf("window from the agent ready to the Node's allocatable updated: %s (kubelet nodeStatusUpdateFrequency 10s)", window.Round(10*time.Millisecond))
	testkit.Eventually(t, 90*time.Second, "the gated pod Running once the node is ready", func() bool {
		p, err := pods.Get(ctx, "early", metav1.GetOptions{})
		return err == nil && p.Status.Phase == corev1.PodRunning
	})

	// The gate the other way. ztunnel goes: the agent sets the Node's
	// allocatable to 0 at once (the scheduler binds nothing more here) and
	// keeps its devices Healthy until the pods already bound have been
	// through the kubelet's admission; only then Unhealthy. Before, the
	// devices turned Unhealthy at once while the Node showed them
	// allocatable until the kubelet's next status sync, and the kubelet
	// refused every pod bound in between for good (UnexpectedAdmissionError).
	// Both pods here are enrolled: they run redirected once ztunnel is back.
	enrolled := func(p *corev1.Pod) *corev1.Pod {
		p.Labels = map[string]string{enrollment.DataplaneModeLabel: enrollment.DataplaneAmbient}
		return p
	}
	stopZ()
	testkit.Eventually(t, 10*time.Second, "the agent not ready", func() bool { return !a.Ready.State().Ready })
	// Bound by the scheduler just before it saw the Node's allocatable drop.
	justBound := enrolled(gated("just-bound"))
	justBound.Spec.NodeName = node.Name
	if _, err := pods.Create(ctx, justBound, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	closed := testkit.Eventually(t, 5*time.Second, "allocatable 0 on the Node well before the kubelet's next status sync", func() bool { return allocatable() == 0 })
	t.Logf("from the agent not ready to the Node's allocatable 0: %s", closed.Round(10*time.Millisecond))
	if _, err := pods.Create(ctx, enrolled(gated("after-dip")), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, 60*time.Second, "the scheduler to hold the pod created after the dip", unschedulable("after-dip"))
	testkit.Eventually(t, 30*time.Second, "the kubelet to admit the pod bound just before the dip", func() bool {
		p, err := pods.Get(ctx, "just-bound", metav1.GetOptions{})
		if err != nil {
			return false
		}
		if p.Status.Phase == corev1.PodFailed {
			t.Fatalf("the pod bound just before the dip failed: %s: %s", p.Status.Reason, p.Status.Message)
		}
		return p.Status.StartTime != nil
	})
	testkit.Eventually(t, 30*time.Second, "the devices Unhealthy once the bound pod was admitted", func() bool {
		return healthChanges(t, a, "Unhealthy") == 1 && allocatable() == 0
	})

	z2 := ztunnel.New(ztunnel.Config{SocketPath: zdsSocket, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	z2ctx, z2cancel := context.WithCancel(ctx)
	z2done := make(chan struct{})
	go func() { z2.Run(z2ctx); close(z2done) }()
	t.Cleanup(func() { z2cancel(); <-z2done })
	testkit.Eventually(t, 30*time.Second, "the agent ready again", func() bool { return a.Ready.State().Ready })
	for _, name := range []string{"just-bound", "after-dip"} {
		testkit.Eventually(t, 120*time.Second, name+" Running and redirected once the node is ready again", func() bool {
			p, err := pods.Get(ctx, name, metav1.GetOptions{})
			if err != nil {
				return false
			}
			if p.Status.Phase == corev1.PodFailed {
				t.Fatalf("%s failed: %s: %s", name, p.Status.Reason, p.Status.Message)
			}
			return p.Status.Phase == corev1.PodRunning && p.Annotations[enrollment.RedirectionAnnotation] == enrollment.AnnotationEnabled
		})
	}
}

// healthChanges reads the agent's count of device health changes to "to".
func healthChanges(t *testing.T, a *agent.Agent, to string) float64 {
	t.Helper()
	families, err := a.Metrics.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() != "inpod_deviceplugin_health_changes_total" {
			continue
		}
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "to" && l.GetValue() == to {
					return m.GetCounter().GetValue()
				}
			}
		}
	}
	return 0
}
