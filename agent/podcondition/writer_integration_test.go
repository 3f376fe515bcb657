//go:build integration

package podcondition_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apiequality "k8s.io/apimachinery/pkg/api/equality"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"

	"github.com/inpod-dev/inpod/agent/podcondition"
	"github.com/inpod-dev/inpod/e2e/cluster"
	"github.com/inpod-dev/inpod/e2e/cluster/clustertest"
	"github.com/inpod-dev/inpod/internal/testkit"
)

// clock is the writer's Now: each transition the test makes is a minute
// later, so that lastTransitionTime (whole seconds on the wire) tells
// transitions apart without the test waiting for the wall clock.
type clock struct{ t atomic.Int64 }

func newClock() *clock {
	c := &clock{}
	c.t.Store(time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC).Unix())
	return c
}

func (c *clock) Now() time.Time { return time.Unix(c.t.Load(), 0).UTC() }
func (c *clock) advance()       { c.t.Add(60) }

// counter is the Observer.
type counter struct{ written, failed atomic.Int64 }

func (c *counter) Written() { c.written.Add(1) }
func (c *counter) Failed()  { c.failed.Add(1) }

func setup(t *testing.T) (*cluster.ControlPlane, kubernetes.Interface) {
	t.Helper()
	cp := clustertest.ControlPlane(t, cluster.Config{})
	if _, err := cp.Client.CoreV1().Namespaces().Create(context.Background(),
		&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "mesh"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	return cp, cp.Client
}

// createPod creates an enrolled pod as admission leaves it (with the
// readiness gate), bound to a node, and has a "kubelet" give it the
// conditions a real one writes: the writer must never touch those.
func createPod(t *testing.T, c kubernetes.Interface, name types.NamespacedName) *corev1.Pod {
	t.Helper()
	ctx := context.Background()
	pod, err := c.CoreV1().Pods(name.Namespace).Create(ctx, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: name.Namespace, Name: name.Name},
		Spec: corev1.PodSpec{
			NodeName:       "node-a",
			Containers:     []corev1.Container{{Name: "app", Image: "app"}},
			ReadinessGates: []corev1.PodReadinessGate{{ConditionType: podcondition.ConditionType}},
		},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	at := metav1.NewTime(time.Now().Add(-time.Hour).Truncate(time.Second))
	pod.Status.Phase = corev1.PodRunning
	pod.Status.Conditions = []corev1.PodCondition{
		{Type: corev1.PodScheduled, Status: corev1.ConditionTrue, LastTransitionTime: at},
		{Type: corev1.ContainersReady, Status: corev1.ConditionTrue, LastTransitionTime: at},
		{Type: corev1.PodReady, Status: corev1.ConditionFalse, Reason: "ReadinessGatesNotReady",
			Message: `corresponding condition of pod readiness gate "inpod.dev/redirected" does not exist.`, LastTransitionTime: at},
	}
	if pod, err = c.CoreV1().Pods(name.Namespace).UpdateStatus(ctx, pod, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	return pod
}

func get(t *testing.T, c kubernetes.Interface, name types.NamespacedName) *corev1.Pod {
	t.Helper()
	pod, err := c.CoreV1().Pods(name.Namespace).Get(context.Background(), name.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return pod
}

// ours is the pod's inpod.dev/redirected condition, nil if none.
func ours(p *corev1.Pod) *corev1.PodCondition {
	for i := range p.Status.Conditions {
		if p.Status.Conditions[i].Type == podcondition.ConditionType {
			return &p.Status.Conditions[i]
		}
	}
	return nil
}

// others are the pod's conditions but ours.
func others(p *corev1.Pod) []corev1.PodCondition {
	var out []corev1.PodCondition
	for _, c := range p.Status.Conditions {
		if c.Type != podcondition.ConditionType {
			out = append(out, c)
		}
	}
	return out
}

func run(t *testing.T, w *podcondition.Writer) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() { w.Run(ctx) })
	t.Cleanup(func() { cancel(); wg.Wait() })
}

// TestIntegrationConditionTransitions: through Run, against a real API
// server, the condition turns True, then False with a reason, then True
// again; lastTransitionTime is stamped on each transition and on nothing
// else (a new message keeps it); a Set that says what the pod carries
// writes nothing (no request, the pod's resourceVersion unchanged); the
// "kubelet's" conditions and the rest of the pod's status stay as they
// were.
func TestIntegrationConditionTransitions(t *testing.T) {
	_, c := setup(t)
	name := types.NamespacedName{Namespace: "mesh", Name: "web-0"}
	pod := createPod(t, c, name)
	clk := newClock()
	obs := &counter{}
	w := podcondition.New(podcondition.Config{Client: c, Observer: obs, Now: clk.Now})
	run(t, w)

	// wait returns the pod once its condition says status (and reason).
	wait := func(status corev1.ConditionStatus, reason, message string) *corev1.Pod {
		t.Helper()
		var got *corev1.Pod
		testkit.Eventually(t, 10*time.Second, "condition "+string(status)+" "+reason, func() bool {
			got = get(t, c, name)
			oc := ours(got)
			return oc != nil && oc.Status == status && oc.Reason == reason && oc.Message == message
		})
		// The API shows the patch before its answer reaches the writer,
		// which only then takes the write off its pending list.
		testkit.Eventually(t, 10*time.Second, "the write answered", func() bool { return w.Pending() == 0 })
		if !apiequality.Semantic.DeepEqual(others(got), others(pod)) {
			t.Fatalf("the pod's other conditions changed:\n%+v\nwere\n%+v", others(got), others(pod))
		}
		if got.Status.Phase != pod.Status.Phase {
			t.Fatalf("phase %s, was %s", got.Status.Phase, pod.Status.Phase)
		}
		return got
	}
	// noWrite: a Set that changes nothing has nothing pending at once.
	noWrite := func(what string, status bool, reason, message string, before *corev1.Pod) {
		t.Helper()
		n := obs.written.Load()
		w.Set(name, pod.UID, status, reason, message)
		if p := w.Pending(); p != 0 {
			t.Fatalf("%s: %d writes pending for a Set that changes nothing", what, p)
		}
		if got := get(t, c, name); got.ResourceVersion != before.ResourceVersion || obs.written.Load() != n {
			t.Fatalf("%s: the pod was written (resourceVersion %s, was %s; writes %d, were %d)",
				what, got.ResourceVersion, before.ResourceVersion, obs.written.Load(), n)
		}
	}
	transitionAt := func(p *corev1.Pod) time.Time { return ours(p).LastTransitionTime.UTC() }

	w.Set(name, pod.UID, true, "Redirected", "rules in place")
	p1 := wait(corev1.ConditionTrue, "Redirected", "rules in place")
	if got, want := transitionAt(p1), clk.Now(); !got.Equal(want) {
		t.Fatalf("first lastTransitionTime %s, want %s", got, want)
	}
	noWrite("the same True again", true, "Redirected", "rules in place", p1)

	// A new message, the same status: written, lastTransitionTime kept.
	clk.advance()
	w.Set(name, pod.UID, true, "Redirected", "re-verified")
	p2 := wait(corev1.ConditionTrue, "Redirected", "re-verified")
	if !transitionAt(p2).Equal(transitionAt(p1)) {
		t.Fatalf("lastTransitionTime moved on a message change: %s, was %s", transitionAt(p2), transitionAt(p1))
	}

	clk.advance()
	w.Set(name, pod.UID, false, "RulesLost", "the pod's netfilter rules were flushed")
	p3 := wait(corev1.ConditionFalse, "RulesLost", "the pod's netfilter rules were flushed")
	if got, want := transitionAt(p3), clk.Now(); !got.Equal(want) || got.Equal(transitionAt(p1)) {
		t.Fatalf("lastTransitionTime on True→False %s, want %s", got, want)
	}
	noWrite("the same False again", false, "RulesLost", "the pod's netfilter rules were flushed", p3)

	// Back to True without a message: the False's message does not stay.
	clk.advance()
	w.Set(name, pod.UID, true, "Redirected", "")
	p4 := wait(corev1.ConditionTrue, "Redirected", "")
	if got, want := transitionAt(p4), clk.Now(); !got.Equal(want) || got.Equal(transitionAt(p3)) {
		t.Fatalf("lastTransitionTime on False→True %s, want %s", got, want)
	}

	if obs.failed.Load() != 0 {
		t.Fatalf("%d failed attempts against a healthy API server", obs.failed.Load())
	}
}

// TestIntegrationConditionCoalesces: Sets that follow each other faster
// than the writer writes cost one write, of the last value asked for, or
// none when that is what the pod carries already.
func TestIntegrationConditionCoalesces(t *testing.T) {
	_, c := setup(t)
	ctx := context.Background()
	name := types.NamespacedName{Namespace: "mesh", Name: "web-0"}
	pod := createPod(t, c, name)
	obs := &counter{}
	w := podcondition.New(podcondition.Config{Client: c, Observer: obs})
	w.Set(name, pod.UID, true, "Redirected", "")
	if err := w.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	flip := func(last bool) {
		for range 20 {
			w.Set(name, pod.UID, false, "ZtunnelAway", "no ztunnel")
			w.Set(name, pod.UID, true, "Redirected", "")
		}
		if !last {
			w.Set(name, pod.UID, false, "ZtunnelAway", "no ztunnel")
		}
		if err := w.Flush(ctx); err != nil {
			t.Fatal(err)
		}
	}
	before := get(t, c, name)
	flip(true)
	if got := get(t, c, name); obs.written.Load() != 1 || got.ResourceVersion != before.ResourceVersion {
		t.Fatalf("flips ending where they started: %d writes in all, resourceVersion %s (was %s); want only the first write",
			obs.written.Load(), got.ResourceVersion, before.ResourceVersion)
	}
	flip(false)
	oc := ours(get(t, c, name))
	if obs.written.Load() != 2 || oc == nil || oc.Status != corev1.ConditionFalse || oc.Reason != "ZtunnelAway" {
		t.Fatalf("flips ending False: %d writes in all (want 2), condition %+v", obs.written.Load(), oc)
	}
}

// TestIntegrationConditionFollowsThePodNotItsName: a StatefulSet's pod
// comes back under its old name with a new UID while a condition for the
// old pod still waits to be written. The replacement must not be made
// Ready by the old pod's proof: the write is dropped (not failed, not
// retried), and the replacement's own condition is written when asked.
func TestIntegrationConditionFollowsThePodNotItsName(t *testing.T) {
	_, c := setup(t)
	ctx := context.Background()
	name := types.NamespacedName{Namespace: "mesh", Name: "web-0"}
	w := podcondition.New(podcondition.Config{Client: c})

	old := createPod(t, c, name)
	w.Set(name, old.UID, false, "NotYetProven", "")
	if err := w.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	if oc := ours(get(t, c, name)); oc == nil || oc.Status != corev1.ConditionFalse {
		t.Fatalf("condition on the pod it was asked for: %+v", oc)
	}

	// The old pod is proven, and replaced before the write goes out.
	w.Set(name, old.UID, true, "Redirected", "")
	if err := c.CoreV1().Pods(name.Namespace).Delete(ctx, name.Name, *metav1.NewDeleteOptions(0)); err != nil {
		t.Fatal(err)
	}
	replacement := createPod(t, c, name)
	if err := w.Flush(ctx); err != nil {
		t.Fatalf("a write for a pod that is gone must be dropped, not failed: %v", err)
	}
	got := get(t, c, name)
	if got.UID != replacement.UID {
		t.Fatalf("pod UID %s, want the replacement's %s", got.UID, replacement.UID)
	}
	if oc := ours(got); oc != nil {
		t.Fatalf("the old pod's condition landed on its replacement: %+v", oc)
	}
	if n := w.Pending(); n != 0 {
		t.Fatalf("%d writes still pending after the pod they were for is gone", n)
	}

	// The same through Run: the old pod's write is dropped, the
	// replacement's lands.
	run(t, w)
	w.Set(name, old.UID, true, "Redirected", "old")
	w.Set(name, replacement.UID, false, "NotYetProven", "new")
	testkit.Eventually(t, 10*time.Second, "the replacement's condition", func() bool {
		oc := ours(get(t, c, name))
		return oc != nil && oc.Message == "new" && w.Pending() == 0
	})
	if oc := ours(get(t, c, name)); oc.Status != corev1.ConditionFalse {
		t.Fatalf("the replacement's condition %+v, want its own False", oc)
	}
}

// TestIntegrationConditionThroughAnOutage: a Set while the API server is
// down is retried with backoff (each failure counted) and lands once it is
// back, without another Set.
func TestIntegrationConditionThroughAnOutage(t *testing.T) {
	cp, c := setup(t)
	name := types.NamespacedName{Namespace: "mesh", Name: "web-0"}
	pod := createPod(t, c, name)
	obs := &counter{}
	w := podcondition.New(podcondition.Config{Client: c, Observer: obs, MaxBackoff: 500 * time.Millisecond})
	run(t, w)

	cp.StopAPIServer()
	w.Set(name, pod.UID, true, "Redirected", "")
	testkit.Eventually(t, 20*time.Second, "failed attempts while the API server is down", func() bool { return obs.failed.Load() >= 2 })
	if err := cp.StartAPIServer(context.Background()); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, 20*time.Second, "the condition written once the API server is back", func() bool {
		oc := ours(get(t, c, name))
		return oc != nil && oc.Status == corev1.ConditionTrue
	})
	testkit.Eventually(t, 5*time.Second, "nothing pending", func() bool { return w.Pending() == 0 })
	if obs.written.Load() != 1 {
		t.Fatalf("%d writes, want 1", obs.written.Load())
	}
}

// TestIntegrationConditionAfterRestart: a new writer (a restarted agent)
// asked for what the pod already carries writes nothing and keeps its
// lastTransitionTime, whether it learns the pod's condition from the
// agent's watch (Config.Current) or from the API server; asked for
// another status, it writes a transition.
func TestIntegrationConditionAfterRestart(t *testing.T) {
	_, c := setup(t)
	ctx := context.Background()
	name := types.NamespacedName{Namespace: "mesh", Name: "web-0"}
	pod := createPod(t, c, name)
	clk := newClock()
	first := podcondition.New(podcondition.Config{Client: c, Now: clk.Now})
	first.Set(name, pod.UID, true, "Redirected", "")
	if err := first.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	before := get(t, c, name)
	clk.advance()

	for _, tc := range []struct {
		what    string
		current func(types.NamespacedName) *corev1.Pod
	}{
		{"read from the API server", nil},
		{"from the agent's watch", func(n types.NamespacedName) *corev1.Pod {
			if n != name {
				return nil
			}
			return before.DeepCopy()
		}},
	} {
		obs := &counter{}
		w := podcondition.New(podcondition.Config{Client: c, Observer: obs, Now: clk.Now, Current: tc.current})
		w.Set(name, pod.UID, true, "Redirected", "")
		if err := w.Flush(ctx); err != nil {
			t.Fatal(err)
		}
		got := get(t, c, name)
		if obs.written.Load() != 0 || got.ResourceVersion != before.ResourceVersion || w.Pending() != 0 {
			t.Fatalf("%s: a restarted writer rewrote an unchanged condition (%d writes, resourceVersion %s, was %s)",
				tc.what, obs.written.Load(), got.ResourceVersion, before.ResourceVersion)
		}
		// Known now: the same Set again is not even queued.
		w.Set(name, pod.UID, true, "Redirected", "")
		if w.Pending() != 0 {
			t.Fatalf("%s: a Set of what the pod carries is pending", tc.what)
		}
	}

	w := podcondition.New(podcondition.Config{Client: c, Now: clk.Now})
	w.Set(name, pod.UID, false, "ZtunnelAway", "no ztunnel connected")
	if err := w.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	oc := ours(get(t, c, name))
	if oc.Status != corev1.ConditionFalse || !oc.LastTransitionTime.UTC().Equal(clk.Now()) {
		t.Fatalf("after a restart, True→False: %+v, want False at %s", oc, clk.Now())
	}
}
