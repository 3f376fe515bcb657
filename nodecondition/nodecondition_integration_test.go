//go:build integration

package nodecondition

import (
	"context"
	"encoding/json"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/inpod-dev/inpod/e2e/cluster"
	"github.com/inpod-dev/inpod/e2e/cluster/clustertest"
	"github.com/inpod-dev/inpod/internal/testkit"
	"github.com/inpod-dev/inpod/readiness"
)

const nodeName = "node-a"

// counter is the gate's Observer.
type counter struct {
	mu       sync.Mutex
	written  map[corev1.ConditionStatus]int
	failures int
}

func (c *counter) ConditionWritten(s corev1.ConditionStatus) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.written == nil {
		c.written = map[corev1.ConditionStatus]int{}
	}
	c.written[s]++
}

func (c *counter) ConditionWriteFailed() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.failures++
}

func (c *counter) writes() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.written[corev1.ConditionTrue] + c.written[corev1.ConditionFalse]
}

func (c *counter) failed() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.failures
}

type world struct {
	t     *testing.T
	cp    *cluster.ControlPlane
	admin kubernetes.Interface
	// agent has exactly the rights deploy/rbac/agent.yaml gives the agent.
	agent kubernetes.Interface
	ready *readiness.Aggregate
}

// kubeletReady is the kubelet's condition the gate must never touch.
var kubeletReady = corev1.NodeCondition{Type: corev1.NodeReady, Status: corev1.ConditionTrue, Reason: "KubeletReady",
	Message: "kubelet is posting ready status", LastHeartbeatTime: metav1.Unix(1_700_000_000, 0), LastTransitionTime: metav1.Unix(1_700_000_000, 0)}

func newWorld(t *testing.T) *world {
	t.Helper()
	ctx := context.Background()
	cp := clustertest.ControlPlane(t, cluster.Config{})
	w := &world{t: t, cp: cp, admin: cp.Client,
		ready: readiness.New(nil, readiness.CNIInstalled, readiness.ZtunnelConnected, readiness.PodsSynced)}
	clustertest.ApplyShippedRBAC(t, w.admin)
	rc := rest.CopyConfig(cp.Rest)
	rc.Impersonate = rest.ImpersonationConfig{UserName: "system:serviceaccount:inpod-system:inpod-agent"}
	var err error
	if w.agent, err = kubernetes.NewForConfig(rc); err != nil {
		t.Fatal(err)
	}
	node, err := w.admin.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: nodeName}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	node.Status.Conditions = []corev1.NodeCondition{kubeletReady}
	if _, err := w.admin.CoreV1().Nodes().UpdateStatus(ctx, node, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	return w
}

// start runs a gate until the test ends or stop is called; stop waits for
// Run to return.
func (w *world) start(obs *counter, clock func() time.Time) (stop func()) {
	w.t.Helper()
	return w.startWith(Config{Observer: obs}, clock)
}

// startWith is start with cfg's StartupGrace, Observer and Logger.
func (w *world) startWith(cfg Config, clock func() time.Time) (stop func()) {
	w.t.Helper()
	cfg.Client, cfg.NodeName = w.agent, nodeName
	cfg.MinBackoff, cfg.MaxBackoff = 20*time.Millisecond, 300*time.Millisecond
	g, err := New(cfg)
	if err != nil {
		w.t.Fatal(err)
	}
	if clock != nil {
		g.now = clock
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- g.Run(ctx, w.ready) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			if err := <-done; err != nil {
				w.t.Errorf("Run: %v", err)
			}
		})
	}
	w.t.Cleanup(stop)
	return stop
}

func (w *world) node() *corev1.Node {
	w.t.Helper()
	n, err := w.admin.CoreV1().Nodes().Get(context.Background(), nodeName, metav1.GetOptions{})
	if err != nil {
		w.t.Fatal(err)
	}
	return n
}

func find(n *corev1.Node, typ corev1.NodeConditionType) *corev1.NodeCondition {
	for i := range n.Status.Conditions {
		if n.Status.Conditions[i].Type == typ {
			return &n.Status.Conditions[i]
		}
	}
	return nil
}

// waitCondition waits until the Node's condition has status and reason and
// returns it, checking the kubelet's condition is as the test last set it.
func (w *world) waitCondition(status corev1.ConditionStatus, reason string, kubelet corev1.NodeCondition) corev1.NodeCondition {
	w.t.Helper()
	var got corev1.NodeCondition
	testkit.Eventually(w.t, 30*time.Second, "condition "+string(status)+"/"+reason, func() bool {
		n := w.node()
		c := find(n, ConditionType)
		if c == nil || c.Status != status || c.Reason != reason {
			return false
		}
		got = *c
		return true
	})
	n := w.node()
	k := find(n, corev1.NodeReady)
	if k == nil || k.Status != kubelet.Status || k.Message != kubelet.Message || !k.LastHeartbeatTime.Equal(&kubelet.LastHeartbeatTime) {
		w.t.Fatalf("the kubelet's Ready condition changed: %+v, want %+v", k, kubelet)
	}
	if len(n.Status.Conditions) != 2 {
		w.t.Fatalf("conditions: %+v, want only Ready and %s", n.Status.Conditions, ConditionType)
	}
	return got
}

// fakeClock advances a minute per reading, so every write has a distinct
// time at the API's one-second resolution.
func fakeClock() func() time.Time {
	var mu sync.Mutex
	t := time.Unix(1_800_000_000, 0)
	return func() time.Time {
		mu.Lock()
		defer mu.Unlock()
		t = t.Add(time.Minute)
		return t
	}
}

func TestIntegrationNodeConditionFollowsReadiness(t *testing.T) {
	w := newWorld(t)
	obs := &counter{}
	clock := fakeClock()
	stop := w.start(obs, clock)

	// At start nothing holds: False, the first failing reason, every
	// missing condition named.
	c := w.waitCondition(corev1.ConditionFalse, ReasonCNINotInstalled, kubeletReady)
	for _, s := range []string{"cni-installed", "ztunnel-connected", "pods-synced"} {
		if !strings.Contains(c.Message, s) {
			t.Fatalf("message %q does not name %s", c.Message, s)
		}
	}
	firstFalse := c.LastTransitionTime

	// The kubelet rewrites its conditions between the gate's writes.
	n := w.node()
	kubelet := kubeletReady
	kubelet.Message, kubelet.LastHeartbeatTime = "kubelet is posting ready status (again)", metav1.Unix(1_700_000_100, 0)
	*find(n, corev1.NodeReady) = kubelet
	if _, err := w.admin.CoreV1().Nodes().UpdateStatus(context.Background(), n, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}

	// A new reason with the same status is not a transition.
	w.ready.Set(readiness.CNIInstalled, true, "installed")
	w.ready.Set(readiness.PodsSynced, true, "synced")
	c = w.waitCondition(corev1.ConditionFalse, ReasonZtunnelNotConnected, kubelet)
	if !c.LastTransitionTime.Equal(&firstFalse) {
		t.Fatalf("lastTransitionTime moved from %s to %s without a status change", firstFalse, c.LastTransitionTime)
	}
	if strings.Contains(c.Message, "cni-installed") || !strings.Contains(c.Message, "ztunnel-connected") {
		t.Fatalf("message %q: want only the ztunnel named", c.Message)
	}

	w.ready.Set(readiness.ZtunnelConnected, true, "1 connection")
	c = w.waitCondition(corev1.ConditionTrue, ReasonReady, kubelet)
	if !c.LastTransitionTime.After(firstFalse.Time) {
		t.Fatalf("lastTransitionTime %s did not move on False→True (was %s)", c.LastTransitionTime, firstFalse)
	}
	trueSince := c.LastTransitionTime

	// Stopping the gate writes nothing (no False from a stopping agent).
	rv := w.node().ResourceVersion
	stop()
	if got := w.node().ResourceVersion; got != rv {
		t.Fatalf("the Node changed when the gate stopped (resourceVersion %s → %s): %+v", rv, got, find(w.node(), ConditionType))
	}

	// A new gate on the same state (an agent restart) finds the condition
	// already right and writes nothing: the only write it makes is for
	// the next change. Run handles states in order, so had it written the
	// first, it would count two.
	obs2 := &counter{}
	w.start(obs2, clock)
	w.ready.Set(readiness.PodsSynced, false, "watch lost")
	c = w.waitCondition(corev1.ConditionFalse, ReasonPodsNotSynced, kubelet)
	testkit.Eventually(t, 10*time.Second, "the write counted", func() bool { return obs2.writes() >= 1 })
	if obs2.writes() != 1 {
		t.Fatalf("restarted gate wrote %d times, want 1 (the identical state must not be written)", obs2.writes())
	}
	if !c.LastTransitionTime.After(trueSince.Time) {
		t.Fatalf("lastTransitionTime %s did not move on True→False", c.LastTransitionTime)
	}
	if obs.failed() != 0 || obs2.failed() != 0 {
		t.Fatalf("%d+%d failed writes without an outage", obs.failed(), obs2.failed())
	}
}

func TestIntegrationNodeConditionConvergesAcrossAPIServerOutage(t *testing.T) {
	w := newWorld(t)
	for _, c := range []string{readiness.CNIInstalled, readiness.ZtunnelConnected, readiness.PodsSynced} {
		w.ready.Set(c, true, "ok")
	}
	obs := &counter{}
	w.start(obs, nil)
	w.waitCondition(corev1.ConditionTrue, ReasonReady, kubeletReady)
	testkit.Eventually(t, 10*time.Second, "the write counted", func() bool { return obs.writes() == 1 })
	before := obs.writes()

	w.cp.StopAPIServer()
	// Readiness flips while every write fails; each state is attempted
	// (a failure counted) before the next.
	failedAfter := func(what string, n int) {
		testkit.Eventually(t, 30*time.Second, what, func() bool { return obs.failed() > n })
	}
	w.ready.Set(readiness.ZtunnelConnected, false, "no connection")
	failedAfter("a failed write of False", 0)
	f := obs.failed()
	w.ready.Set(readiness.ZtunnelConnected, true, "1 connection")
	failedAfter("a failed write of True", f)
	f = obs.failed()
	w.ready.Set(readiness.PodsSynced, false, "watch lost")
	failedAfter("a failed write of the latest False", f)

	if err := w.cp.StartAPIServer(context.Background()); err != nil {
		t.Fatal(err)
	}
	c := w.waitCondition(corev1.ConditionFalse, ReasonPodsNotSynced, kubeletReady)
	if !strings.Contains(c.Message, "pods-synced: watch lost") || strings.Contains(c.Message, "ztunnel") {
		t.Fatalf("message %q: want the latest state (pods not synced, ztunnel connected)", c.Message)
	}
	// Only the latest state was written after the outage: no stale value
	// on the way.
	if got := obs.writes() - before; got != 1 {
		t.Fatalf("%d writes after the outage, want 1 (the latest state only)", got)
	}
}

// logRecorder keeps the gate's log messages, for tests that wait on a
// decision that writes nothing.
type logRecorder struct {
	mu   *sync.Mutex
	msgs *[]string
}

func newLogRecorder() logRecorder { return logRecorder{mu: &sync.Mutex{}, msgs: &[]string{}} }

func (r logRecorder) Enabled(context.Context, slog.Level) bool { return true }
func (r logRecorder) WithAttrs([]slog.Attr) slog.Handler       { return r }
func (r logRecorder) WithGroup(string) slog.Handler            { return r }
func (r logRecorder) Handle(_ context.Context, rec slog.Record) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	*r.msgs = append(*r.msgs, rec.Message)
	return nil
}

func (r logRecorder) has(msg string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, m := range *r.msgs {
		if m == msg {
			return true
		}
	}
	return false
}

// readyAndTrue brings the Node's condition to True with a gate that then
// stops, and leaves the aggregate ready: the state a restarted agent finds.
func (w *world) readyAndTrue() {
	w.t.Helper()
	for _, c := range []string{readiness.CNIInstalled, readiness.ZtunnelConnected, readiness.PodsSynced} {
		w.ready.Set(c, true, "ok")
	}
	stop := w.start(&counter{}, nil)
	w.waitCondition(corev1.ConditionTrue, ReasonReady, kubeletReady)
	stop()
}

// A rolling upgrade restarts the agent on a ready node: the new agent is
// not ready until ztunnel reconnects, and a False written meanwhile would
// have inpod-controller (continuous mode) re-taint the node at once.
func TestIntegrationNodeConditionRestartKeepsTrueWithinGrace(t *testing.T) {
	w := newWorld(t)
	w.readyAndTrue()
	w.ready.Set(readiness.ZtunnelConnected, false, "no connection yet")
	rv := w.node().ResourceVersion

	logs, obs := newLogRecorder(), &counter{}
	w.startWith(Config{Observer: obs, StartupGrace: time.Minute, Logger: slog.New(logs)}, nil)
	testkit.Eventually(t, 10*time.Second, "the restarted gate holding (or writing)", func() bool {
		return logs.has(holdingMsg) || w.node().ResourceVersion != rv
	})
	if n := w.node(); n.ResourceVersion != rv {
		t.Fatalf("the restarted gate wrote before its first ready verdict (resourceVersion %s → %s): %+v", rv, n.ResourceVersion, find(n, ConditionType))
	}
	w.ready.Set(readiness.ZtunnelConnected, true, "1 connection")
	testkit.Eventually(t, 10*time.Second, "the ready verdict seen", func() bool { return logs.has(readyInGraceMsg) })

	// The next change is the gate's first write: nothing was written for
	// the not-ready start nor for the ready verdict (the Node said True).
	w.ready.Set(readiness.PodsSynced, false, "watch lost")
	w.waitCondition(corev1.ConditionFalse, ReasonPodsNotSynced, kubeletReady)
	testkit.Eventually(t, 10*time.Second, "the write counted", func() bool { return obs.writes() >= 1 })
	if obs.writes() != 1 {
		t.Fatalf("restarted gate wrote %d times, want 1 (only the change after the ready verdict)", obs.writes())
	}
}

func TestIntegrationNodeConditionRestartWritesFalseAfterGrace(t *testing.T) {
	w := newWorld(t)
	w.readyAndTrue()
	w.ready.Set(readiness.ZtunnelConnected, false, "ztunnel gone")

	const grace = 2 * time.Second
	start := time.Now()
	w.startWith(Config{Observer: &counter{}, StartupGrace: grace}, nil)
	w.waitCondition(corev1.ConditionFalse, ReasonZtunnelNotConnected, kubeletReady)
	if took := time.Since(start); took < grace {
		t.Fatalf("False written %s after the restart, before the %s startup grace", took.Round(time.Millisecond), grace)
	}
}

// createNode registers the Node with the kubelet's condition only, as a
// kubelet (re-)registering does.
func (w *world) createNode() {
	w.t.Helper()
	ctx := context.Background()
	if _, err := w.admin.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: nodeName}}, metav1.CreateOptions{}); err != nil {
		w.t.Fatal(err)
	}
	// A merge by type: the gate may already have written its condition.
	patch, err := json.Marshal(map[string]any{"status": map[string]any{"conditions": []corev1.NodeCondition{kubeletReady}}})
	if err != nil {
		w.t.Fatal(err)
	}
	if _, err := w.admin.CoreV1().Nodes().Patch(ctx, nodeName, types.StrategicMergePatchType, patch, metav1.PatchOptions{}, "status"); err != nil {
		w.t.Fatal(err)
	}
}

func TestIntegrationNodeConditionRestoredOnNewOrChangedNode(t *testing.T) {
	w := newWorld(t)
	for _, c := range []string{readiness.CNIInstalled, readiness.ZtunnelConnected, readiness.PodsSynced} {
		w.ready.Set(c, true, "ok")
	}
	obs := &counter{}
	w.start(obs, nil)
	w.waitCondition(corev1.ConditionTrue, ReasonReady, kubeletReady)
	ctx := context.Background()

	// The Node is deleted and registered again (kubelet restart) under the
	// running agent: the new Node gets the condition without a readiness
	// change.
	old := w.node().UID
	if err := w.admin.CoreV1().Nodes().Delete(ctx, nodeName, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, 10*time.Second, "the Node gone", func() bool {
		_, err := w.admin.CoreV1().Nodes().Get(ctx, nodeName, metav1.GetOptions{})
		return err != nil
	})
	w.createNode()
	if w.node().UID == old {
		t.Fatal("the Node was not recreated")
	}
	w.waitCondition(corev1.ConditionTrue, ReasonReady, kubeletReady)

	// Someone else sets it False: the gate writes its state again.
	patch := `{"status":{"conditions":[{"type":"InPodRedirectionReady","status":"False","reason":"Manual","message":"set by hand"}]}}`
	if _, err := w.admin.CoreV1().Nodes().Patch(ctx, nodeName, types.StrategicMergePatchType, []byte(patch), metav1.PatchOptions{}, "status"); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, 30*time.Second, "the condition restored", func() bool {
		c := find(w.node(), ConditionType)
		return c != nil && c.Status == corev1.ConditionTrue && c.Reason == ReasonReady
	})

	// Other changes to the Node (the kubelet's status) cost no write: the
	// next write is the next readiness change.
	testkit.Eventually(t, 10*time.Second, "the writes counted", func() bool { return obs.writes() >= 3 })
	before := obs.writes()
	n := w.node()
	kubelet := kubeletReady
	kubelet.Message, kubelet.LastHeartbeatTime = "kubelet is posting ready status (again)", metav1.Unix(1_700_000_100, 0)
	*find(n, corev1.NodeReady) = kubelet
	if _, err := w.admin.CoreV1().Nodes().UpdateStatus(ctx, n, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	w.ready.Set(readiness.PodsSynced, false, "watch lost")
	w.waitCondition(corev1.ConditionFalse, ReasonPodsNotSynced, kubelet)
	testkit.Eventually(t, 10*time.Second, "the write counted", func() bool { return obs.writes() > before })
	if got := obs.writes() - before; got != 1 {
		t.Fatalf("%d writes for one readiness change after a kubelet status update, want 1", got)
	}
	if obs.failed() != 0 {
		t.Fatalf("%d failed writes", obs.failed())
	}
}
