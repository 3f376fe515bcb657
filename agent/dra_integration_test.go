//go:build integration

package agent_test

import (
	"context"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/inpod-dev/inpod/deviceplugin"
	"github.com/inpod-dev/inpod/dra"
	ztunnel "github.com/inpod-dev/inpod/zds/zdstest"
)

func (w *world) resourceSlices() []resourceapi.ResourceSlice {
	w.t.Helper()
	l, err := w.client.ResourceV1().ResourceSlices().List(context.Background(), metav1.ListOptions{})
	if err != nil {
		w.t.Fatal(err)
	}
	return l.Items
}

func untainted(s []resourceapi.ResourceSlice) bool {
	return len(s) == 1 && len(s[0].Spec.Devices) == 1 && len(s[0].Spec.Devices[0].Taints) == 0
}

// --gate=deviceplugin,dra with exactly deploy/rbac's rights: both gates
// follow the agent (the device plugin's devices and the slice's taint), a
// restart of the agent leaves the slice as it was, and an uninstall removes
// it with the rest of inpod.
func TestIntegrationDRAGateWithTheDevicePluginRestartAndUninstall(t *testing.T) {
	w := newWorld(t)
	ctx := context.Background()
	if _, err := w.client.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: nodeName}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	w.applyRBAC()
	ds, self := w.agentDaemonSet("inpod-agent")
	w.runAs(self)
	w.cfg.Gate = "deviceplugin,dra"
	stop := w.runAgent()
	w.eventually("the slice untainted", func() bool { return untainted(w.resourceSlices()) })
	w.eventually("the device plugin's devices healthy", func() bool { return w.kubelet.Allocatable(deviceplugin.DefaultResourceName) == 4 })

	w.stopStandin()
	w.eventually("the slice tainted for ztunnel", func() bool {
		s := w.resourceSlices()
		return len(s) == 1 && len(s[0].Spec.Devices[0].Taints) == 1 && s[0].Spec.Devices[0].Taints[0].Key == dra.TaintKeyPrefix+"ztunnel-not-connected"
	})
	w.eventually("the device plugin's devices unhealthy", func() bool { return w.kubelet.Allocatable(deviceplugin.DefaultResourceName) == 0 })
	w.stopStandin = w.startStandin()
	w.eventually("the slice untainted again", func() bool { return untainted(w.resourceSlices()) })
	before := w.resourceSlices()[0]

	// A restart (the DaemonSet stays): the slice stays, the same object.
	if err := stop(); err != nil {
		t.Fatalf("agent: %v", err)
	}
	if s := w.resourceSlices(); len(s) != 1 || s[0].UID != before.UID || s[0].ResourceVersion != before.ResourceVersion {
		t.Fatalf("slices after a restart: %+v, want %s unchanged", s, before.Name)
	}
	stop = w.runAgent()
	w.eventually("the agent ready again", func() bool { return w.agent.Ready.State().Ready })
	if s := w.resourceSlices(); len(s) != 1 || s[0].UID != before.UID || s[0].ResourceVersion != before.ResourceVersion {
		t.Fatalf("slices after the restarted agent is ready: %+v, want %s unchanged", s, before.Name)
	}

	// Uninstall: the DaemonSet goes, the agent removes inpod, the slice too.
	w.deleteDaemonSet(ds)
	w.terminate(self)
	if err := stop(); err != nil {
		t.Fatalf("agent: %v", err)
	}
	if s := w.resourceSlices(); len(s) != 0 {
		t.Fatalf("slices after uninstall: %+v", s)
	}
}

// An agent killed while ready leaves the slice as it was (nothing runs to
// change it; the kubelet would withdraw it 30 s later), and the restarted
// agent, ready within its startup grace, does not write it either: the
// same object. It then follows readiness as before.
func TestIntegrationDRAAgentKilledWhileReadyAndRestarted(t *testing.T) {
	w := newWorld(t)
	ctx := context.Background()
	if _, err := w.client.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: nodeName}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	bin := buildAgent(t)
	w.cfg.Gate = "dra"
	// A ztunnel that reconnects after 2 s, as a real one backs off: the
	// restarted agent is not ready for its first moments.
	w.stopStandin()
	w.standin, w.stopStandin = ztunnel.Start(t, ztunnel.Config{SocketPath: w.cfg.ZDSSocket, MinBackoff: 2 * time.Second, MaxBackoff: 2 * time.Second})
	first := w.startAgentProcess(bin)
	w.eventually("the slice untainted", func() bool { return untainted(w.resourceSlices()) })
	before := w.resourceSlices()[0]

	first.cmd.Process.Signal(syscall.SIGKILL)
	first.cmd.Wait()
	l, err := w.client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	writes, err := w.client.ResourceV1().ResourceSlices().Watch(ctx, metav1.ListOptions{ResourceVersion: l.ResourceVersion})
	if err != nil {
		t.Fatal(err)
	}
	defer writes.Stop()
	w.startAgentProcess(bin) // returns once /readyz says ready
	// An absence: no write within a bound well past the helper's first
	// sync (about 1 s after the gate publishes).
	quiet := time.After(4 * time.Second)
	for done := false; !done; {
		select {
		case ev := <-writes.ResultChan():
			t.Fatalf("the restarted agent wrote the slice: %s", ev.Type)
		case <-quiet:
			done = true
		}
	}
	if s := w.resourceSlices(); len(s) != 1 || s[0].UID != before.UID || s[0].ResourceVersion != before.ResourceVersion {
		t.Fatalf("slices after kill and restart: %+v, want %s unchanged", s, before.Name)
	}
	w.stopStandin()
	w.eventually("the restarted agent taints the slice", func() bool {
		s := w.resourceSlices()
		return len(s) == 1 && len(s[0].Spec.Devices[0].Taints) > 0
	})
}
