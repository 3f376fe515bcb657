package nodecondition

import (
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"

	"github.com/inpod-dev/inpod/readiness"
)

func TestConditionForReadinessStates(t *testing.T) {
	agg := readiness.New(nil, readiness.CNIInstalled, readiness.ZtunnelConnected, readiness.PodsSynced)
	check := func(step string, status corev1.ConditionStatus, reason string, inMessage ...string) {
		t.Helper()
		c := For(agg.State())
		if c.Status != status || c.Reason != reason {
			t.Fatalf("%s: got %s/%s (%q), want %s/%s", step, c.Status, c.Reason, c.Message, status, reason)
		}
		for _, s := range inMessage {
			if !strings.Contains(c.Message, s) {
				t.Fatalf("%s: message %q does not name %q", step, c.Message, s)
			}
		}
	}
	// Everything fails at start: the reason is the first in order, the
	// message names all three.
	check("start", corev1.ConditionFalse, ReasonCNINotInstalled, "cni-installed", "ztunnel-connected", "pods-synced")
	agg.Set(readiness.PodsSynced, true, "synced")
	check("pods synced", corev1.ConditionFalse, ReasonCNINotInstalled, "cni-installed", "ztunnel-connected")
	agg.Set(readiness.CNIInstalled, true, "installed")
	check("cni installed", corev1.ConditionFalse, ReasonZtunnelNotConnected, "ztunnel-connected: not checked yet")
	agg.Set(readiness.ZtunnelConnected, true, "1 connection")
	check("all hold", corev1.ConditionTrue, ReasonReady)
	agg.Set(readiness.PodsSynced, false, "watch lost")
	check("pods lost", corev1.ConditionFalse, ReasonPodsNotSynced, "pods-synced: watch lost")
	if c := For(agg.State()); strings.Contains(c.Message, "cni-installed") || strings.Contains(c.Message, "ztunnel-connected") {
		t.Fatalf("message %q names a condition that holds", c.Message)
	}
	agg.Set(readiness.ZtunnelConnected, false, "no connection")
	check("ztunnel and pods", corev1.ConditionFalse, ReasonZtunnelNotConnected, "ztunnel-connected: no connection", "pods-synced: watch lost")

	// A condition this version does not name still makes the node not
	// ready, with a generic reason.
	other := readiness.New(nil, "something-new")
	if c := For(other.State()); c.Status != corev1.ConditionFalse || c.Reason != ReasonNotReady || !strings.Contains(c.Message, "something-new") {
		t.Fatalf("unknown condition: got %+v", c)
	}
	if c := For(readiness.State{}); c.Status != corev1.ConditionFalse || c.Reason != ReasonNotReady {
		t.Fatalf("empty aggregate: got %+v", c)
	}
}
