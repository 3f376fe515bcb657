//go:build integration

package agent_test

import (
	"context"
	"net/http"
	"net/netip"
	"slices"
	"strings"
	"syscall"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/inpod-dev/inpod/agent/redirect"
	"github.com/inpod-dev/inpod/enrollment"
)

// newRestoreWorld is a world with an enrolled namespace "leaving" (the
// tests take its label away while no agent runs) and the agent built as a
// binary, to be killed and started again.
func newRestoreWorld(t *testing.T) (*world, string) {
	w := newWorld(t)
	if _, err := w.client.CoreV1().Namespaces().Create(context.Background(), &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "leaving",
		Labels: map[string]string{enrollment.DataplaneModeLabel: enrollment.DataplaneAmbient}}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	bin := buildAgent(t)
	return w, bin
}

func unlabel(t *testing.T, w *world, namespace string) {
	t.Helper()
	ctx := context.Background()
	ns, err := w.client.CoreV1().Namespaces().Get(ctx, namespace, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	ns.Labels = nil
	if _, err := w.client.CoreV1().Namespaces().Update(ctx, ns, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// A killed agent's successor disturbs no enrolled pod's traffic even when it
// cannot find the pod's netns (no process of it in its cgroup): ztunnel
// keeps the proxy (snapshot Keep) and the probe exemption stays. A pod whose
// namespace lost its label while no agent ran leaves the mesh: rules,
// proxy, annotation.
func TestIntegrationRestartHoldsAnUnfoundPodAndReleasesAnUnlabelledOne(t *testing.T) {
	w, bin := newRestoreWorld(t)
	first := w.startAgentProcess(bin)

	unfound, unfoundNS := w.pod("mesh", "unfound")
	res, err := w.cniAdd(unfound, unfoundNS)
	if err != nil {
		t.Fatal(err)
	}
	unfoundIP := res.IPs[0].Address.IP.String()
	w.setRunning(unfound, unfoundIP) // and no process in its cgroup
	leaving, leavingNS := w.pod("leaving", "app")
	res, err = w.cniAdd(leaving, leavingNS)
	if err != nil {
		t.Fatal(err)
	}
	leavingIP := res.IPs[0].Address.IP.String()
	w.setRunning(leaving, leavingIP)
	leavingNS.RunAsPod(t, string(leaving.UID))
	w.eventually("both pods annotated enabled", func() bool {
		return w.annotation(unfound) == enrollment.AnnotationEnabled && w.annotation(leaving) == enrollment.AnnotationEnabled
	})

	first.cmd.Process.Signal(syscall.SIGKILL)
	first.cmd.Wait()
	unlabel(t, w, "leaving")
	connects := w.standin.Connects()
	w.startAgentProcess(bin)
	w.eventually("ztunnel reconnected and re-snapshotted", func() bool {
		return w.standin.Connects() > connects && w.standin.SnapshotDone()
	})

	if _, ok := w.standin.Workloads()[string(unfound.UID)]; !ok {
		t.Error("the restarted agent's snapshot dropped an enrolled pod whose netns it could not find: its traffic is black-holed")
	}
	if !hasRules(t, unfoundNS) {
		t.Error("the unfound pod lost its rules")
	}
	probes := redirect.NewHostProbes(w.nodeNS)
	members, err := probes.Members()
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(members, netip.MustParseAddr(unfoundIP)) {
		t.Errorf("the unfound pod's probe exemption was pruned (%v): its probes go to the proxy", members)
	}
	if errs := w.standin.ProtocolErrors(); len(errs) > 0 {
		t.Fatalf("protocol errors: %v", errs)
	}

	w.eventually("the un-labelled pod out of the mesh", func() bool {
		_, inZtunnel := w.standin.Workloads()[string(leaving.UID)]
		return !hasRules(t, leavingNS) && !inZtunnel && w.annotation(leaving) == ""
	})
	members, err = probes.Members()
	if err != nil {
		t.Fatal(err)
	}
	if slices.Contains(members, netip.MustParseAddr(leavingIP)) {
		t.Errorf("the un-labelled pod keeps its probe exemption: %v", members)
	}
}

// The same restart when none of the first agent's annotation patches
// landed (it died before them; here a proxy answers them with an empty
// response, which client-go takes for a failure): the node's
// record of pods with rules stands in. A pod whose status has no IPs yet is
// held, so ztunnel keeps the proxy its rules point at; a pod whose
// namespace lost its label while no agent ran has its rules removed rather
// than being left blocked.
func TestIntegrationRestartWithoutAnnotationsUsesTheNodesRecord(t *testing.T) {
	w, bin := newRestoreWorld(t)
	direct := w.cfg.Kubeconfig
	w.cfg.Kubeconfig = apiProxy(t, w.cp, func(r *http.Request) bool {
		return r.Method != http.MethodPatch || !strings.Contains(r.URL.Path, "/pods/")
	})
	first := w.startAgentProcess(bin)

	noIPs, noIPsNS := w.pod("mesh", "no-ips-yet")
	if _, err := w.cniAdd(noIPs, noIPsNS); err != nil {
		t.Fatal(err)
	}
	leaving, leavingNS := w.pod("leaving", "app")
	res, err := w.cniAdd(leaving, leavingNS)
	if err != nil {
		t.Fatal(err)
	}
	w.setRunning(leaving, res.IPs[0].Address.IP.String())
	leavingNS.RunAsPod(t, string(leaving.UID))
	first.cmd.Process.Signal(syscall.SIGKILL)
	first.cmd.Wait()
	for _, p := range []*corev1.Pod{noIPs, leaving} {
		if v := w.annotation(p); v != "" {
			t.Fatalf("pod %s annotated %q: the test needs the annotation never to have landed", p.Name, v)
		}
	}

	unlabel(t, w, "leaving")
	w.cfg.Kubeconfig = direct
	connects := w.standin.Connects()
	w.startAgentProcess(bin)
	w.eventually("ztunnel reconnected and re-snapshotted", func() bool {
		return w.standin.Connects() > connects && w.standin.SnapshotDone()
	})
	if _, ok := w.standin.Workloads()[string(noIPs.UID)]; !ok {
		t.Error("the restarted agent's snapshot dropped an enrolled pod that reports no IPs yet: its traffic is black-holed")
	}
	if !hasRules(t, noIPsNS) {
		t.Error("the pod without IPs lost its rules")
	}
	w.eventually("the un-labelled pod out of the mesh", func() bool {
		_, inZtunnel := w.standin.Workloads()[string(leaving.UID)]
		return !hasRules(t, leavingNS) && !inZtunnel
	})
}
