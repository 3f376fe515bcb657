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
	testkit.Eventually(t, 60*time.Second, "the scheduler to report the pod unschedulable", func() bool {
		p, err := pods.Get(ctx, "early", metav1.GetOptions{})
		if err != nil {
			return false
		}
		for _, c := range p.Status.Conditions {
			if c.Type == corev1.PodScheduled && c.Status == corev1.ConditionFalse && strings.Contains(c.Message, string(gateResource)) {
				return p.Spec.NodeName == ""
			}
		}
		return false
	})

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

	// The window the other way: ztunnel goes, devices turn Unhealthy at
	// once, but the Node still shows them allocatable until the next
	// status sync. A pod the scheduler binds in that window is refused by
	// the kubelet's own admission (the device manager sees no healthy
	// device) and never starts.
	stopZ()
	testkit.Eventually(t, 10*time.Second, "the agent not ready", func() bool { return !a.Ready.State().Ready })
	if got := allocatable(); got == 0 {
		t.Skip("the node status sync already ran; the window this case needs has closed")
	}
	if _, err := pods.Create(ctx, gated("in-window"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, 60*time.Second, "the kubelet to refuse the pod bound in the window", func() bool {
		p, err := pods.Get(ctx, "in-window", metav1.GetOptions{})
		if err != nil || p.Spec.NodeName == "" {
			return false
		}
		return p.Status.Phase == corev1.PodFailed && p.Status.Reason == "UnexpectedAdmissionError"
	})
	testkit.Eventually(t, 60*time.Second, "allocatable back to 0 on the Node", func() bool { return allocatable() == 0 })
}
