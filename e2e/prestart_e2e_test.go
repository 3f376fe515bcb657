//go:build e2e

package e2e

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/inpod-dev/inpod/internal/testkit"
)

// TestE2EPreStartHoldsASandboxSetUpWithoutInpod (cni.mode=chained): the scheduling gate keeps
// an enrolled pod off a node that is not ready, but a pod admitted while it
// was ready can still get a sandbox set up without inpod, when another CNI
// rewrote the conflist without inpod-cni and the runtime read it before the
// agent's repair. The device plugin's PreStartContainer then holds the app
// until the agent has redirected that sandbox in place, so the app still
// starts with ztunnel's listeners in its netns (without the check it starts
// at once, with none).
//
// The window is made wide on purpose: the pod is admitted (its device
// allocated) but waits for a ConfigMap volume; the agent is frozen
// (SIGSTOP), so it cannot repair the conflist, which is then rewritten
// without inpod-cni; the ConfigMap appears, the kubelet sets the sandbox up
// through the rewritten chain, and only once the sandbox has its address
// does the agent run again.
func TestE2EPreStartHoldsASandboxSetUpWithoutInpod(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 12*time.Minute)
	defer cancel()
	c := newChartNode(ctx, t, "/var/lib/inpod-e2e-prestart")
	conflist := filepath.Join(c.CNIConf, "10-e2e.conflist")
	unchained, err := os.ReadFile(conflist)
	if err != nil {
		t.Fatal(err)
	}
	// The window exists only with inpod chained into the primary's file:
	// owned (the default), the primary's rewrite leaves the chain alone.
	c.install(t, "--set", "cni.mode=chained")
	c.standInUp(t)
	testkit.Eventually(t, 3*time.Minute, "the agent pod Ready", func() bool { return agentReady(t, ctx, c.Node) != "" })
	testkit.Eventually(t, 2*time.Minute, "the gate open on the Node", func() bool { return allocatable(ctx, c.Node, gateResource) > 0 })
	c.waitRequestPolicy(t)

	p := testAppPod("mesh", "held")
	p.Spec.Volumes = []corev1.Volume{{Name: "late", VolumeSource: corev1.VolumeSource{ConfigMap: &corev1.ConfigMapVolumeSource{
		LocalObjectReference: corev1.LocalObjectReference{Name: "late"}}}}}
	p.Spec.Containers[0].VolumeMounts = []corev1.VolumeMount{{Name: "late", MountPath: "/late"}}
	c.create(t, p)
	testkit.Eventually(t, 2*time.Minute, "the pod admitted and waiting for its ConfigMap", func() bool {
		return eventFor(ctx, c.Node, "mesh", "held", "FailedMount", "late") != ""
	})

	_, resume, err := freezeProcs(c.Containerd, "inpod-agent")
	t.Cleanup(resume)
	if err != nil {
		t.Fatal(err)
	}
	before := podAddresses()
	if err := os.WriteFile(conflist, unchained, 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Client.CoreV1().ConfigMaps("mesh").Create(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: "late"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	// The sandbox set up through the chain without inpod: a new netns
	// with its address (the frozen agent cannot have seen its ADD).
	testkit.Eventually(t, 3*time.Minute, "the pod's sandbox set up while the agent is frozen", func() bool {
		for ip := range podAddresses() {
			if !before[ip] {
				return true
			}
		}
		return false
	})
	resume()

	held := waitReady(t, ctx, c.Node, "mesh", "held")
	c.enrolled(t, held)
	c.inbound(t, held)
	if msg := eventFor(ctx, c.Node, "mesh", "held", "Failed", "PreStartContainer"); msg == "" {
		t.Fatal("the app started without the kubelet's PreStartContainer ever holding it: the sandbox went through inpod after all, and this test proved nothing")
	} else {
		t.Logf("held by the kubelet: %s", msg)
	}
}

// podAddresses is every IPv4 address in a netns the runtime created, apart
// from loopback.
func podAddresses() map[string]bool {
	out := map[string]bool{}
	for ip := range netnsByIP() {
		if ip != "127.0.0.1" {
			out[ip] = true
		}
	}
	return out
}
