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
