//go:build integration

package taintcontroller

import (
	"context"
	"net/http"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/util/retry"

	"github.com/inpod-dev/inpod/internal/testkit"
)

var other = corev1.Taint{Key: "example.com/other", Value: "x", Effect: corev1.TaintEffectNoSchedule}

// withoutSystem drops the taints the apiserver's TaintNodesByCondition
// admission adds to a Node without a Ready condition (these test Nodes have
// no kubelet); the controller leaves them alone like any other.
func withoutSystem(taints []corev1.Taint) []corev1.Taint {
	var out []corev1.Taint
	for _, t := range taints {
		if !strings.HasPrefix(t.Key, "node.kubernetes.io/") {
			out = append(out, t)
		}
	}
	return out
}

// Node b carries only the taint of an earlier key (the chart's key changed
// on upgrade): it goes by the same rule, in the same steps.
func TestIntegrationTaintRemovedOnlyWhenConditionTrueAndAgentReady(t *testing.T) {
	w := newWorld(t)
	w.addNode(t, "a", nil, other)
	previous := corev1.Taint{Key: "example.com/old-startup", Effect: corev1.TaintEffectNoSchedule}
	b := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "b"}, Spec: corev1.NodeSpec{Taints: []corev1.Taint{previous, other}}}
	if _, err := w.admin.CoreV1().Nodes().Create(context.Background(), b, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	r := w.start(t, Config{Mode: Bootstrap, PreviousTaints: []corev1.Taint{{Key: previous.Key}}})
	nodes := []string{"a", "b"}
	each := func(f func(node string)) {
		for _, n := range nodes {
			f(n)
		}
	}
	hasPrevious := func(name string) bool {
		return slices.ContainsFunc(w.node(t, name).Spec.Taints, func(t corev1.Taint) bool { return t.Key == previous.Key })
	}

	stillTainted := func(step string) {
		t.Helper()
		w.barrier(t, nil)
		if !w.tainted(t, "a") || r.writes.count("PATCH nodes/a") != 0 {
			t.Fatalf("%s: node a untainted or written (%d patches) before its condition is True and its agent pod Ready", step, r.writes.count("PATCH nodes/a"))
		}
		if !hasPrevious("b") || r.writes.count("PATCH nodes/b") != 0 {
			t.Fatalf("%s: node b's previous taint removed or node b written (%d patches) before its condition is True and its agent pod Ready", step, r.writes.count("PATCH nodes/b"))
		}
	}
	stillTainted("no condition, no agent pod")
	each(func(n string) { w.setCondition(t, n, corev1.ConditionTrue) })
	stillTainted("condition True, no agent pod")
	each(func(n string) { w.addAgentPod(t, n, false) })
	stillTainted("condition True, agent pod not Ready")
	each(func(n string) { w.setCondition(t, n, corev1.ConditionFalse); w.setPodReady(t, n, true) })
	stillTainted("condition False, agent pod Ready")
	each(func(n string) { w.setCondition(t, n, corev1.ConditionUnknown) })
	stillTainted("condition Unknown, agent pod Ready")

	each(func(n string) { w.setCondition(t, n, corev1.ConditionTrue) })
	w.waitTainted(t, "a", false)
	testkit.Eventually(t, 30*time.Second, "node b's previous taint removed", func() bool { return !hasPrevious("b") })
	each(func(name string) {
		n := w.node(t, name)
		if got := withoutSystem(n.Spec.Taints); len(got) != 1 || got[0] != other {
			t.Fatalf("node %s: taints %+v: want only the other component's taint", name, n.Spec.Taints)
		}
		if _, ok := n.Annotations[DoneAnnotation]; !ok {
			t.Fatalf("node %s: bootstrap not recorded: annotations %v", name, n.Annotations)
		}
	})
	if w.tainted(t, "b") {
		t.Fatal("node b got the startup taint: a previous taint is never a reason to add it")
	}
	each(func(name string) {
		key := map[string]string{"a": DefaultTaintKey, "b": previous.Key}[name]
		testkit.Eventually(t, 10*time.Second, "an Event on node "+name+" naming "+key, func() bool {
			for _, e := range w.events(t, name) {
				if e.Reason == eventReasonRemoved && strings.Contains(e.Message, key) {
					return true
				}
			}
			return false
		})
	})

	// bootstrap never puts the taint back: not on False, not without an
	// agent pod.
	w.setCondition(t, "a", corev1.ConditionFalse)
	w.deleteAgentPod(t, "a")
	w.barrier(t, nil)
	if w.tainted(t, "a") || r.writes.accepted("PATCH nodes/a") != 1 {
		t.Fatalf("bootstrap re-tainted or wrote node a again (%d patches accepted)", r.writes.accepted("PATCH nodes/a"))
	}
}

func TestIntegrationTaintBootstrapSurvivesRestart(t *testing.T) {
	w := newWorld(t)
	w.addNode(t, "done", nil)
	w.addNode(t, "unfinished", nil)
	w.addAgentPod(t, "done", true)
	w.setCondition(t, "done", corev1.ConditionTrue)
	r := w.start(t, Config{Mode: Bootstrap})
	w.waitTainted(t, "done", false)
	r.stop()
	current := taint.Key + ":" + string(taint.Effect)
	if v := w.node(t, "done").Annotations[DoneAnnotation]; doneTaint(v) != current {
		t.Fatalf("done annotation %q does not name the taint removed, %s", v, current)
	}

	// While no controller runs, someone puts the taint back on the
	// finished node (an admin, or a pool's startup taints on an update),
	// and the unfinished node becomes ready.
	n := w.node(t, "done")
	n.Spec.Taints = append(n.Spec.Taints, taint)
	if _, err := w.admin.CoreV1().Nodes().Update(context.Background(), n, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	w.addAgentPod(t, "unfinished", true)
	w.setCondition(t, "unfinished", corev1.ConditionTrue)
	// Two nodes carry the taint under an annotation that is not for it:
	// "handover" was marked done by the old leader of a rolling update
	// that changed the key (the node-taint policy already added the new
	// one), "legacy" by a version that wrote the time alone. Neither is
	// done for this taint, and neither is written before it is ready.
	for name, v := range map[string]string{"handover": doneValue(time.Now(), "example.com/old", DefaultTaintEffect), "legacy": time.Now().UTC().Format(time.RFC3339)} {
		w.addNode(t, name, nil)
		n := w.node(t, name)
		n.Annotations = map[string]string{DoneAnnotation: v}
		if _, err := w.admin.CoreV1().Nodes().Update(context.Background(), n, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
		w.addAgentPod(t, name, true)
	}

	r2 := w.start(t, Config{Mode: Bootstrap})
	w.waitTainted(t, "unfinished", false)
	w.barrier(t, nil)
	if !w.tainted(t, "done") || r2.writes.count("PATCH nodes/done") != 0 {
		t.Fatalf("restarted bootstrap controller re-opened the finished node (%d patches)", r2.writes.count("PATCH nodes/done"))
	}
	for _, name := range []string{"handover", "legacy"} {
		if !w.tainted(t, name) || r2.writes.count("PATCH nodes/"+name) != 0 {
			t.Fatalf("node %s untainted or written (%d patches) before its condition is True", name, r2.writes.count("PATCH nodes/"+name))
		}
		w.setCondition(t, name, corev1.ConditionTrue)
		w.waitTainted(t, name, false)
		if v := w.node(t, name).Annotations[DoneAnnotation]; doneTaint(v) != current {
			t.Fatalf("node %s: done annotation %q, want it rewritten for %s", name, v, current)
		}
	}

	// The same name created again is a new node: bootstrapped afresh,
	// and only once its new condition is True.
	if err := w.admin.CoreV1().Nodes().Delete(context.Background(), "done", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	w.addNode(t, "done", nil)
	w.barrier(t, nil)
	if !w.tainted(t, "done") {
		t.Fatal("recreated node untainted before it reported its condition")
	}
	w.setCondition(t, "done", corev1.ConditionTrue)
	w.waitTainted(t, "done", false)
}

// Bootstrap, then continuous, then bootstrap again (upgrades or a rollback
// switching the mode): continuous mode taints a node bootstrap mode had
// finished, and that write takes the done mark with it, or back in
// bootstrap mode the node would count as done for exactly that taint and
// keep it for good once ready.
func TestIntegrationTaintModeSwitchesStrandNoNode(t *testing.T) {
	w := newWorld(t)
	w.addNode(t, "n", nil)
	w.addAgentPod(t, "n", true)
	w.setCondition(t, "n", corev1.ConditionTrue)
	r := w.start(t, Config{Mode: Bootstrap})
	w.waitTainted(t, "n", false)
	r.stop()
	if _, ok := w.node(t, "n").Annotations[DoneAnnotation]; !ok {
		t.Fatal("bootstrap mode left no done mark")
	}

	r = w.start(t, Config{Mode: Continuous, Grace: time.Second})
	w.setCondition(t, "n", corev1.ConditionFalse)
	w.waitTainted(t, "n", true)
	r.stop()
	if v, ok := w.node(t, "n").Annotations[DoneAnnotation]; ok {
		t.Fatalf("continuous mode tainted the node and kept its done mark %q", v)
	}

	w.start(t, Config{Mode: Bootstrap})
	w.barrier(t, nil)
	if !w.tainted(t, "n") {
		t.Fatal("bootstrap mode removed the taint of a node that is not ready")
	}
	w.setCondition(t, "n", corev1.ConditionTrue)
	w.waitTainted(t, "n", false)
}

func TestIntegrationTaintContinuous(t *testing.T) {
	w := newWorld(t)
	const grace = 1500 * time.Millisecond
	w.addNode(t, "a", nil, other)
	w.addAgentPod(t, "a", true)
	// Another node's agent: the DaemonSet is still there when a's pod goes.
	w.addNode(t, "b", nil)
	w.addAgentPod(t, "b", true)
	w.setCondition(t, "a", corev1.ConditionTrue)
	r := w.start(t, Config{Mode: Continuous, Grace: grace})
	w.waitTainted(t, "a", false)

	// An explicit False re-taints at once (well within the grace).
	w.setCondition(t, "a", corev1.ConditionFalse)
	if took := w.waitTainted(t, "a", true); took >= grace {
		t.Fatalf("re-tainting on False took %s, want no grace (%s)", took, grace)
	}
	testkit.Eventually(t, 10*time.Second, "a StartupTaintAdded Event", func() bool {
		for _, e := range w.events(t, "a") {
			if e.Reason == eventReasonAdded && e.Type == corev1.EventTypeWarning {
				return true
			}
		}
		return false
	})
	w.setCondition(t, "a", corev1.ConditionTrue)
	w.waitTainted(t, "a", false)

	// The agent pod gone: tainted, but only after the grace period (a
	// dead agent cannot report False).
	start := time.Now()
	w.deleteAgentPod(t, "a")
	w.waitTainted(t, "a", true)
	if took := time.Since(start); took < grace {
		t.Fatalf("tainted %s after the agent pod left, before the grace period %s", took, grace)
	}
	w.addAgentPod(t, "a", true)
	w.waitTainted(t, "a", false)

	// An agent pod not Ready past the grace period, likewise.
	start = time.Now()
	w.setPodReady(t, "a", false)
	w.waitTainted(t, "a", true)
	if took := time.Since(start); took < grace {
		t.Fatalf("tainted %s after the agent pod turned not Ready, before the grace period %s", took, grace)
	}
	// Back within the grace period: no taint at all.
	w.setPodReady(t, "a", true)
	w.waitTainted(t, "a", false)
	// The untaint is visible in the API before its response reaches the
	// controller's client, where it is counted; the one worker has that
	// response once it has handled a later barrier.
	w.barrier(t, nil)
	patches := r.writes.accepted("PATCH nodes/a")
	w.setPodReady(t, "a", false)
	w.setPodReady(t, "a", true)
	w.barrier(t, nil)
	testkit.Eventually(t, 10*time.Second, "the grace period passed", func() bool { return time.Since(start) > 3*grace })
	w.barrier(t, nil)
	if got := r.writes.accepted("PATCH nodes/a"); got != patches || w.tainted(t, "a") {
		t.Fatalf("an agent pod back within the grace period still led to %d writes", got-patches)
	}
	n := w.node(t, "a")
	if got := withoutSystem(n.Spec.Taints); len(got) != 1 || got[0] != other {
		t.Fatalf("taints %+v: want only the other component's taint", n.Spec.Taints)
	}
	if _, ok := n.Annotations[DoneAnnotation]; ok {
		t.Fatal("continuous mode wrote the bootstrap annotation")
	}
	m := metricValues(t, r.c.cfg.Metrics)
	if removed, added := m["inpod_controller_taints_removed_total"], m["inpod_controller_taints_added_total"]; removed < 4 || added != 3 {
		t.Fatalf("metrics: %v taints removed, %v added; want at least 4 removed (a and barriers) and 3 added", removed, added)
	}
	if m["inpod_controller_untaint_latency_seconds"] < 4 || m["inpod_controller_leader"] != 1 {
		t.Fatalf("metrics: %v untaint latencies observed, leader %v", m["inpod_controller_untaint_latency_seconds"], m["inpod_controller_leader"])
	}
}

func TestIntegrationTaintNodeSelector(t *testing.T) {
	w := newWorld(t)
	mesh := map[string]string{"mesh": "yes"}
	w.addNode(t, "outside", nil)
	w.addAgentPod(t, "outside", true)
	w.setCondition(t, "outside", corev1.ConditionFalse)
	w.addNode(t, "inside", mesh)
	w.addAgentPod(t, "inside", true)
	w.setCondition(t, "inside", corev1.ConditionTrue)
	r := w.start(t, Config{Mode: Continuous, NodeSelector: "mesh=yes"})
	w.waitTainted(t, "inside", false)
	w.setCondition(t, "outside", corev1.ConditionTrue)
	w.barrier(t, mesh)
	if !w.tainted(t, "outside") || r.writes.count("PATCH nodes/outside") != 0 {
		t.Fatal("a node outside the selector was written")
	}
}

// A change to another taint made between the controller's read (its
// cache) and its write must survive: the write is conditional on the
// resourceVersion read, so it meets a Conflict and is decided again on the
// Node as it is now.
func TestIntegrationTaintConcurrentTaintChangeSurvives(t *testing.T) {
	for _, mode := range []Mode{Bootstrap, Continuous} {
		t.Run(string(mode), func(t *testing.T) {
			w := newWorld(t)
			w.addNode(t, "a", nil)
			w.addAgentPod(t, "a", true)
			r := w.start(t, Config{Mode: mode})
			w.barrier(t, nil)

			var injected atomic.Int32
			r.writes.setBefore(func(req *http.Request) {
				if req.Method != http.MethodPatch || req.URL.Path != "/api/v1/nodes/a" || !injected.CompareAndSwap(0, 1) {
					return
				}
				// Another component adds its taint right now.
				if err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
					n, err := w.admin.CoreV1().Nodes().Get(context.Background(), "a", metav1.GetOptions{})
					if err != nil {
						return err
					}
					n.Spec.Taints = append(n.Spec.Taints, other)
					_, err = w.admin.CoreV1().Nodes().Update(context.Background(), n, metav1.UpdateOptions{})
					return err
				}); err != nil {
					t.Error(err)
				}
			})
			w.setCondition(t, "a", corev1.ConditionTrue)
			w.waitTainted(t, "a", false)
			// The untaint is visible before its answer is counted; the one
			// worker has that answer once it has handled a later barrier.
			w.barrier(t, nil)
			if injected.Load() != 1 {
				t.Fatal("the concurrent change was not injected")
			}
			n := w.node(t, "a")
			if got := withoutSystem(n.Spec.Taints); len(got) != 1 || got[0] != other {
				t.Fatalf("taints %+v: the concurrent taint was lost", n.Spec.Taints)
			}
			// The first refused (Conflict), then decided again on the fresh
			// Node; a reconcile from a cache that has not caught up yet may
			// try once more and be refused too. Exactly one lands.
			if got, ok := r.writes.count("PATCH nodes/a"), r.writes.accepted("PATCH nodes/a"); got < 2 || ok != 1 {
				t.Fatalf("%d patches of node a, %d accepted; want at least 2 (refused, then decided again), exactly 1 accepted", got, ok)
			}
		})
	}
}

// Continuous mode adds the taint only with evidence that the node is in the
// mesh: never to a node that never reported the condition, and to none at
// all once no agent pod is left (inpod being uninstalled: the DaemonSet's
// pods terminating, then gone) — the taint would block every pod there.
func TestIntegrationTaintContinuousNeverBlocksNodesOutsideTheMesh(t *testing.T) {
	w := newWorld(t)
	const grace = time.Second
	ctx := context.Background()
	if _, err := w.admin.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "plain"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	w.addNode(t, "a", nil)
	w.addAgentPod(t, "a", true)
	w.setCondition(t, "a", corev1.ConditionTrue)
	r := w.start(t, Config{Mode: Continuous, Grace: grace})
	w.waitTainted(t, "a", false)
	start := time.Now()
	w.barrier(t, nil)
	testkit.Eventually(t, 10*time.Second, "three grace periods", func() bool { return time.Since(start) > 3*grace })
	w.barrier(t, nil)
	if w.tainted(t, "plain") || r.writes.count("PATCH nodes/plain") != 0 {
		t.Fatal("continuous mode tainted a node that never reported InPodRedirectionReady")
	}

	// Uninstall: every agent pod terminates (held by a finalizer, as
	// during the agent's own shutdown), then is gone.
	pods, err := w.admin.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range pods.Items {
		p.Finalizers = []string{"example.com/hold"}
		if _, err := w.admin.CoreV1().Pods(ns).Update(ctx, &p, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
		if err := w.admin.CoreV1().Pods(ns).Delete(ctx, p.Name, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	patches := r.writes.nodeWrites()
	start = time.Now()
	testkit.Eventually(t, 10*time.Second, "three grace periods", func() bool { return time.Since(start) > 3*grace })
	if got := r.writes.nodeWrites(); got != patches || w.tainted(t, "a") {
		t.Fatalf("%d Node writes while every agent pod was terminating (uninstall); node a tainted: %v", got-patches, w.tainted(t, "a"))
	}
	for _, p := range pods.Items {
		patch := []byte(`{"metadata":{"finalizers":null}}`)
		if _, err := w.admin.CoreV1().Pods(ns).Patch(ctx, p.Name, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	start = time.Now()
	testkit.Eventually(t, 10*time.Second, "three grace periods", func() bool { return time.Since(start) > 3*grace })
	if got := r.writes.nodeWrites(); got != patches || w.tainted(t, "a") {
		t.Fatalf("%d Node writes after every agent pod was gone (uninstall)", got-patches)
	}
}

// metricValues reads the controller's series: a counter's or gauge's value,
// a histogram's sample count.
func metricValues(t *testing.T, m *Metrics) map[string]float64 {
	t.Helper()
	fams, err := m.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]float64{}
	for _, f := range fams {
		for _, mm := range f.GetMetric() {
			switch {
			case mm.Counter != nil:
				out[f.GetName()] += mm.Counter.GetValue()
			case mm.Gauge != nil:
				out[f.GetName()] += mm.Gauge.GetValue()
			case mm.Histogram != nil:
				out[f.GetName()] += float64(mm.Histogram.GetSampleCount())
			}
		}
	}
	return out
}
