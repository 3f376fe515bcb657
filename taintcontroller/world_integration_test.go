//go:build integration

package taintcontroller

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"

	"github.com/inpod-dev/inpod/e2e/cluster"
	"github.com/inpod-dev/inpod/internal/testkit"
	"github.com/inpod-dev/inpod/nodecondition"
)

const ns = DefaultNamespace

// world is a real apiserver with the controller's RBAC from
// deploy/controller/rbac.yaml; controllers run as its ServiceAccount.
type world struct {
	t        *testing.T
	cp       *cluster.ControlPlane
	admin    kubernetes.Interface
	barriers int
}

func newWorld(t testing.TB) *world {
	t.Helper()
	cp, err := cluster.StartControlPlane(context.Background(), cluster.Config{Root: filepath.Join(t.TempDir(), "cp")})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cp.Stop() })
	// The test's own writes must not be held back by client-side rate
	// limits (the benchmark writes 200 conditions at once).
	rc := rest.CopyConfig(cp.Rest)
	rc.QPS, rc.Burst = 1000, 1000
	admin, err := kubernetes.NewForConfig(rc)
	if err != nil {
		t.Fatal(err)
	}
	w := &world{cp: cp, admin: admin}
	if tt, ok := t.(*testing.T); ok {
		w.t = tt
	}
	w.applyRBAC(t)
	return w
}

// applyRBAC creates deploy/controller/rbac.yaml as shipped.
func (w *world) applyRBAC(t testing.TB) {
	ctx := context.Background()
	if _, err := w.admin.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile(filepath.Join(testkit.RepoDir(t), "deploy", "controller", "rbac.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	for _, doc := range strings.Split(string(data), "\n---\n") {
		obj, _, err := scheme.Codecs.UniversalDeserializer().Decode([]byte(doc), nil, nil)
		if err != nil {
			t.Fatal(err)
		}
		switch o := obj.(type) {
		case *corev1.ServiceAccount:
			_, err = w.admin.CoreV1().ServiceAccounts(o.Namespace).Create(ctx, o, metav1.CreateOptions{})
		case *rbacv1.ClusterRole:
			_, err = w.admin.RbacV1().ClusterRoles().Create(ctx, o, metav1.CreateOptions{})
		case *rbacv1.ClusterRoleBinding:
			_, err = w.admin.RbacV1().ClusterRoleBindings().Create(ctx, o, metav1.CreateOptions{})
		case *rbacv1.Role:
			_, err = w.admin.RbacV1().Roles(o.Namespace).Create(ctx, o, metav1.CreateOptions{})
		case *rbacv1.RoleBinding:
			_, err = w.admin.RbacV1().RoleBindings(o.Namespace).Create(ctx, o, metav1.CreateOptions{})
		default:
			t.Fatalf("unexpected object %T in rbac.yaml", obj)
		}
		if err != nil {
			t.Fatal(err)
		}
	}
}

// writes counts one controller's API writes, and lets a test run a hook
// before a request goes to the real apiserver (fault injection).
type writes struct {
	mu     sync.Mutex
	byPath map[string]int // "PATCH nodes/a"
	// okByPath counts the writes the apiserver accepted (2xx).
	okByPath map[string]int
	total    atomic.Int64
	// before, when set, runs before each request; it may act on the
	// cluster through another client.
	before func(r *http.Request)
}

func (c *writes) RoundTrip(next http.RoundTripper) http.RoundTripper {
	return rtFunc(func(r *http.Request) (*http.Response, error) {
		c.mu.Lock()
		before := c.before
		c.mu.Unlock()
		if before != nil {
			before(r)
		}
		if r.Method == http.MethodGet {
			return next.RoundTrip(r)
		}
		key := r.Method + " " + strings.TrimPrefix(r.URL.Path, "/api/v1/")
		c.total.Add(1)
		c.mu.Lock()
		if c.byPath == nil {
			c.byPath, c.okByPath = map[string]int{}, map[string]int{}
		}
		c.byPath[key]++
		c.mu.Unlock()
		resp, err := next.RoundTrip(r)
		if err == nil && resp.StatusCode/100 == 2 {
			c.mu.Lock()
			c.okByPath[key]++
			c.mu.Unlock()
		}
		return resp, err
	})
}

func (c *writes) count(key string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.byPath[key]
}

func (c *writes) accepted(key string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.okByPath[key]
}

func (c *writes) nodeWrites() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := 0
	for k, v := range c.byPath {
		if strings.HasPrefix(k, "PATCH nodes/") || strings.HasPrefix(k, "PUT nodes/") {
			n += v
		}
	}
	return n
}

// byKind sums the writes by resource: nodes, events, leases, other.
func (c *writes) byKind() map[string]int {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := map[string]int{}
	for k, v := range c.byPath {
		kind := "other"
		for _, r := range []string{"nodes", "events", "leases"} {
			if strings.Contains(k, r+"/") || strings.HasSuffix(k, r) {
				kind = r
				break
			}
		}
		out[kind] += v
	}
	return out
}

// nonLease counts the writes other than the leader election's.
func (c *writes) nonLease() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := 0
	for k, v := range c.byPath {
		if !strings.Contains(k, "/leases") {
			n += v
		}
	}
	return n
}

func (c *writes) setBefore(f func(r *http.Request)) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.before = f
}

type rtFunc func(*http.Request) (*http.Response, error)

func (f rtFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

// controllerClient is a client with the controller's ServiceAccount's
// rights whose requests go through w.
func (w *world) controllerClient(t testing.TB, c *writes) kubernetes.Interface {
	rc := rest.CopyConfig(w.cp.Rest)
	rc.Impersonate = rest.ImpersonationConfig{UserName: "system:serviceaccount:" + ns + ":inpod-controller"}
	rc.QPS, rc.Burst = DefaultQPS, DefaultBurst // as inpod-controller's
	if c != nil {
		rc.WrapTransport = c.RoundTrip
	}
	cs, err := kubernetes.NewForConfig(rc)
	if err != nil {
		t.Fatal(err)
	}
	return cs
}

// running is one controller process stand-in.
type running struct {
	c      *Controller
	writes *writes
	cancel context.CancelFunc
	done   chan struct{}
	// restarts counts Runs that ended with an error and were started
	// again (as the kubelet restarts the container).
	restarts atomic.Int64
}

// start runs a controller until stop or the test's end. Run is started
// again when it returns an error, like a restarted container.
func (w *world) start(t testing.TB, cfg Config) *running {
	t.Helper()
	r := &running{writes: &writes{}, done: make(chan struct{})}
	cfg.Client = w.controllerClient(t, r.writes)
	if cfg.AgentNamespace == "" {
		cfg.AgentNamespace = ns
	}
	if cfg.Workers == 0 {
		cfg.Workers = 1 // FIFO: barriers order events (see barrier)
	}
	if cfg.LeaseDuration == 0 {
		cfg.LeaseDuration, cfg.RenewDeadline, cfg.RetryPeriod = 2*time.Second, 1500*time.Millisecond, 200*time.Millisecond
		cfg.ReleaseOnCancel = true
	}
	if cfg.Identity == "" {
		cfg.Identity = fmt.Sprintf("test-%d", time.Now().UnixNano())
	}
	c, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	r.c = c
	ctx, cancel := context.WithCancel(context.Background())
	r.cancel = cancel
	go func() {
		defer close(r.done)
		for ctx.Err() == nil {
			if err := c.Run(ctx); err != nil && ctx.Err() == nil {
				r.restarts.Add(1)
				t.Logf("controller %s: %v (restarting)", cfg.Identity, err)
			}
		}
	}()
	t.Cleanup(r.stop)
	return r
}

func (r *running) stop() {
	r.cancel()
	<-r.done
}

var taint = corev1.Taint{Key: DefaultTaintKey, Effect: DefaultTaintEffect}

// addNode creates a Node with the startup taint (and extra taints).
func (w *world) addNode(t testing.TB, name string, lbls map[string]string, extra ...corev1.Taint) {
	t.Helper()
	n := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: lbls},
		Spec: corev1.NodeSpec{Taints: append([]corev1.Taint{taint}, extra...)}}
	if _, err := w.admin.CoreV1().Nodes().Create(context.Background(), n, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// setCondition writes the agent's condition as the nodecondition gate
// does (a strategic merge patch of the one condition).
func (w *world) setCondition(t testing.TB, node string, status corev1.ConditionStatus) {
	t.Helper()
	now := metav1.Now()
	patch, _ := json.Marshal(map[string]any{"status": map[string]any{"conditions": []corev1.NodeCondition{{
		Type: nodecondition.ConditionType, Status: status, Reason: "Test", LastHeartbeatTime: now, LastTransitionTime: now,
	}}}})
	if _, err := w.admin.CoreV1().Nodes().Patch(context.Background(), node, types.StrategicMergePatchType, patch, metav1.PatchOptions{}, "status"); err != nil {
		t.Fatal(err)
	}
}

func agentPodName(node string) string { return "agent-" + node }

// addAgentPod creates the node's agent pod (bound to it) with Ready as given.
func (w *world) addAgentPod(t testing.TB, node string, ready bool) {
	t.Helper()
	p := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: agentPodName(node), Namespace: ns,
			Labels: map[string]string{"app.kubernetes.io/name": "inpod", "app.kubernetes.io/component": "agent"}},
		Spec: corev1.PodSpec{NodeName: node, Containers: []corev1.Container{{Name: "agent", Image: "inpod-agent"}}},
	}
	if _, err := w.admin.CoreV1().Pods(ns).Create(context.Background(), p, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	w.setPodReady(t, node, ready)
}

func (w *world) setPodReady(t testing.TB, node string, ready bool) {
	t.Helper()
	ctx := context.Background()
	p, err := w.admin.CoreV1().Pods(ns).Get(ctx, agentPodName(node), metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	s := corev1.ConditionFalse
	if ready {
		s = corev1.ConditionTrue
	}
	p.Status.Phase = corev1.PodRunning
	p.Status.Conditions = []corev1.PodCondition{{Type: corev1.PodReady, Status: s, LastTransitionTime: metav1.Now()}}
	if _, err := w.admin.CoreV1().Pods(ns).UpdateStatus(ctx, p, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
}

func (w *world) deleteAgentPod(t testing.TB, node string) {
	t.Helper()
	zero := int64(0)
	if err := w.admin.CoreV1().Pods(ns).Delete(context.Background(), agentPodName(node), metav1.DeleteOptions{GracePeriodSeconds: &zero}); err != nil {
		t.Fatal(err)
	}
}

func (w *world) node(t testing.TB, name string) *corev1.Node {
	t.Helper()
	n, err := w.admin.CoreV1().Nodes().Get(context.Background(), name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return n
}

func (w *world) tainted(t testing.TB, name string) bool {
	t.Helper()
	for _, tt := range w.node(t, name).Spec.Taints {
		if tt.Key == taint.Key && tt.Effect == taint.Effect {
			return true
		}
	}
	return false
}

func (w *world) waitTainted(t testing.TB, name string, want bool) time.Duration {
	t.Helper()
	return testkit.Eventually(t, 30*time.Second, fmt.Sprintf("node %s tainted=%v", name, want), func() bool { return w.tainted(t, name) == want })
}

// barrier makes a fresh node ready and waits for the controller to untaint
// it. With one worker the queue is FIFO, and the barrier's last event comes
// after every earlier event of the same informers, so when it returns the
// controller has handled every change made before it.
func (w *world) barrier(t testing.TB, lbls map[string]string) {
	t.Helper()
	w.barriers++
	name := fmt.Sprintf("barrier-%d", w.barriers)
	w.addNode(t, name, lbls)
	w.addAgentPod(t, name, true)
	w.setCondition(t, name, corev1.ConditionTrue)
	w.waitTainted(t, name, false)
}

// events are the Events the controller recorded on a node.
func (w *world) events(t testing.TB, node string) []corev1.Event {
	t.Helper()
	l, err := w.admin.CoreV1().Events("default").List(context.Background(), metav1.ListOptions{
		FieldSelector: "involvedObject.kind=Node,involvedObject.name=" + node})
	if err != nil {
		t.Fatal(err)
	}
	return l.Items
}
