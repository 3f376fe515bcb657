package enroll_test

import (
	"context"
	"slices"
	"testing"

	corev1 "k8s.io/api/core/v1"

	"github.com/inpod-dev/inpod/agent/enroll"
	"github.com/inpod-dev/inpod/agent/redirect"
	ztunnel "github.com/inpod-dev/inpod/zds/zdstest"
)

// The sweep of the pods outside the mesh: inpod's rules left in the netns
// of a pod outside the mesh (an agent killed between writing them and
// recording the pod, say) are found and removed, with an Event; nothing is
// taken from a pod in the mesh, enrolled or not (yet), nor looked for in a
// host-network pod. The rules are written straight into each netns by an
// engine of the agent's kind, as a path that failed to take them out would
// leave them, and every pod runs a process in its pod's cgroup so procfs
// finds its netns as it finds a real pod's.
func TestSweepRemovesRulesFromPodsOutsideTheMeshOnly(t *testing.T) {
	f := newFixture(t)
	f.standin(ztunnel.Config{})
	engine := redirect.NewEngine(redirect.NewNFTables())
	stray := func(namespace, name string) (*corev1.Pod, sandbox) {
		t.Helper()
		pod, sb := f.pod(namespace, name, nil), f.sandbox()
		sb.RunAsPod(t, string(pod.UID))
		if _, err := engine.Apply(sb.Open(t), redirect.Options{}); err != nil {
			t.Fatal(err)
		}
		return f.running(pod, sb), sb
	}
	outside, outsideSB := stray("plain", "leftover")
	// In the mesh but not in the table: its ADD failed after the rules
	// went in, and the runtime will retry it. Its rules are right.
	unenrolled, unenrolledSB := stray("mesh", "add-retried")
	enrolled, enrolledSB := f.enrolledRunning("enrolled")
	enrolledSB.RunAsPod(t, string(enrolled.UID))
	hostNet := f.running(f.pod("plain", "host-network", nil), f.sandbox())
	hostNet.Spec.HostNetwork = true
	finds := f.finder.calls.Load()

	checked, removed := f.p.SweepOutside(context.Background(), []*corev1.Pod{outside, unenrolled, enrolled, hostNet})
	if checked != 1 || removed != 1 {
		t.Fatalf("sweep checked %d pods and cleaned %d; want the one pod outside the mesh, cleaned", checked, removed)
	}
	if hasRules(t, outsideSB) {
		t.Fatal("the rules in the pod outside the mesh are still there")
	}
	if !hasRules(t, unenrolledSB) || !hasRules(t, enrolledSB) {
		t.Fatal("a pod in the mesh lost its rules to the sweep")
	}
	if !slices.Contains(f.rec.reasons(), enroll.EventRemovedOutside) {
		t.Fatalf("events %v; want %s on the pod outside the mesh", f.rec.reasons(), enroll.EventRemovedOutside)
	}
	if n := f.finder.calls.Load() - finds; n != 1 {
		t.Fatalf("the sweep searched procfs for %d pods; want only the one outside the mesh", n)
	}

	// A clean pod outside the mesh is checked and left alone.
	events := len(f.rec.reasons())
	if checked, removed := f.p.SweepOutside(context.Background(), []*corev1.Pod{outside}); checked != 1 || removed != 0 {
		t.Fatalf("second sweep checked %d and cleaned %d; want 1 checked, none cleaned", checked, removed)
	}
	if len(f.rec.reasons()) != events {
		t.Fatalf("a clean pod got an Event: %v", f.rec.reasons()[events:])
	}
}

// A static pod outside the mesh is swept too: its processes are in cgroups
// named by its config hash, not by its mirror pod's UID.
func TestSweepCleansAStaticPodOutsideTheMesh(t *testing.T) {
	f := newFixture(t)
	f.standin(ztunnel.Config{})
	const hash = "6f1c0ffee6f1c0ffee6f1c0ffee0beef"
	pod := mirror("plain", "static-leftover", "0b5e1c2a-3333-4c3d-9e8f-00000000beef", hash)
	sb := f.sandbox()
	sb.RunAsPod(t, hash)
	if _, err := redirect.NewEngine(redirect.NewNFTables()).Apply(sb.Open(t), redirect.Options{}); err != nil {
		t.Fatal(err)
	}
	checked, removed := f.p.SweepOutside(context.Background(), []*corev1.Pod{f.running(pod, sb)})
	if checked != 1 || removed != 1 || hasRules(t, sb) {
		t.Fatalf("sweep of a static pod outside the mesh: checked %d removed %d, rules still there: %v", checked, removed, hasRules(t, sb))
	}
}

// A pod outside the mesh with the policy route's like but none of inpod's
// netfilter rules (Istio's own CNI redirected it: the same table 100 and
// fwmark 0x111; or it routes with table 100 itself) keeps its routing: the
// sweep removes only where inpod's rules are.
func TestSweepLeavesRoutingInpodDidNotWriteAlone(t *testing.T) {
	f := newFixture(t)
	f.standin(ztunnel.Config{})
	pod, sb := f.pod("plain", "own-routing", nil), f.sandbox()
	sb.RunAsPod(t, string(pod.UID))
	sb.Exec(t, "ip", "route", "add", "local", "203.0.113.0/24", "dev", "lo", "table", "100")
	sb.Exec(t, "ip", "rule", "add", "pref", "32764", "fwmark", "0x111/0xfff", "lookup", "100")
	before := sb.Exec(t, "ip", "route", "show", "table", "100") + sb.Exec(t, "ip", "rule", "show")
	checked, removed := f.p.SweepOutside(context.Background(), []*corev1.Pod{f.running(pod, sb)})
	after := sb.Exec(t, "ip", "route", "show", "table", "100") + sb.Exec(t, "ip", "rule", "show")
	if removed != 0 || after != before || slices.Contains(f.rec.reasons(), enroll.EventRemovedOutside) {
		t.Fatalf("the sweep (checked %d, removed %d) changed routing inpod never wrote:\nbefore:\n%s\nafter:\n%s", checked, removed, before, after)
	}
}
