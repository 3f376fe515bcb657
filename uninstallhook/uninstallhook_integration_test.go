//go:build integration

package uninstallhook_test

import (
	"context"
	"maps"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	admissionv1 "k8s.io/api/admissionregistration/v1"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes"

	"github.com/inpod-dev/inpod/e2e/cluster"
	"github.com/inpod-dev/inpod/e2e/cluster/clustertest"
	"github.com/inpod-dev/inpod/internal/testkit"
	"github.com/inpod-dev/inpod/uninstallhook"
)

const ns = "inpod-system"

// installedLabel is agent.NodeInstalledLabel (not imported: the hook must not
// need the agent).
const installedLabel = "inpod.dev/cni-installed"

var agentLabels = map[string]string{"app.kubernetes.io/name": "inpod", "app.kubernetes.io/component": "agent"}

// TestIntegrationUninstallHook runs the hook against a real API server. The
// test plays the garbage collector and the kubelets: once the DaemonSet is
// gone, it deletes the agent pods (as their agents exit). An agent that was
// running cleans its node; one that was crash-looping cleaned nothing, and
// the hook must say so instead of letting Helm delete the RBAC as if all
// were well.
func TestIntegrationUninstallHook(t *testing.T) {
	ctx := context.Background()
	cp := clustertest.ControlPlane(t, cluster.Config{})
	c := cp.Client
	if _, err := c.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}

	for _, tc := range []struct {
		name    string
		running map[string]bool // node → its agent's container runs
		exits   bool            // the agents exit once the DaemonSet is gone
		want    []string        // nodes the error names; none: success
		// labelled are nodes with no agent pod that still carry the
		// installed label: an agent left them without cleaning.
		labelled []string
	}{
		{"every agent running", map[string]bool{"node-a": true, "node-b": true}, true, nil, nil},
		{"one agent crash-looping", map[string]bool{"node-a": true, "node-b": false}, true, []string{"node-b"}, nil},
		{"an agent that never exits (node offline)", map[string]bool{"node-a": true}, false, []string{"node-a"}, nil},
		{"a node an agent left without cleaning it", map[string]bool{"node-a": true}, true, []string{"node-c"}, []string{"node-c"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			createAgents(t, c, tc.running)
			for _, n := range tc.labelled {
				if _, err := c.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: n,
					Labels: map[string]string{installedLabel: "true"}}}, metav1.CreateOptions{}); err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { c.CoreV1().Nodes().Delete(context.Background(), n, metav1.DeleteOptions{}) })
			}
			if !tc.exits {
				t.Cleanup(func() { deleteAgents(t, c) })
			}
			for _, b := range bindings {
				createBinding(t, c, b)
			}
			order := deletionOrder(t, c)
			done := make(chan error, 1)
			go func() {
				done <- uninstallhook.Run(ctx, uninstallhook.Config{
					Client: c, Namespace: ns, DaemonSet: "inpod-agent", Bindings: bindings,
					Selector: "app.kubernetes.io/name=inpod,app.kubernetes.io/component=agent", InstalledLabel: installedLabel,
					Timeout: 3 * time.Second, Poll: 50 * time.Millisecond,
				})
			}()
			testkit.Eventually(t, 30*time.Second, "the hook to delete the DaemonSet", func() bool {
				_, err := c.AppsV1().DaemonSets(ns).Get(ctx, "inpod-agent", metav1.GetOptions{})
				return apierrors.IsNotFound(err)
			})
			if tc.exits {
				deleteAgents(t, c)
			}
			// The bindings go first: Helm would delete them last, after
			// the agents and inpod-controller, and meanwhile a node
			// registering would keep the startup taint for good, and a pod
			// created would get an init container that can never pass.
			if got := order(); !slices.Equal(got, append(slices.Clone(bindings), "daemonset")) {
				t.Fatalf("deleted in order %v, want %v then the daemonset", got, bindings)
			}
			var err error
			select {
			case err = <-done:
			case <-time.After(30 * time.Second):
				t.Fatal("the hook did not return")
			}
			if len(tc.want) == 0 {
				if err != nil {
					t.Fatalf("hook failed: %v", err)
				}
				return
			}
			if err == nil {
				t.Fatalf("hook succeeded, want it to fail naming %v", tc.want)
			}
			for _, n := range append(slices.Collect(maps.Keys(tc.running)), tc.labelled...) {
				named := strings.Contains(err.Error(), n)
				wanted := false
				for _, w := range tc.want {
					wanted = wanted || w == n
				}
				if named != wanted {
					t.Errorf("error names %s: %t, want %t: %v", n, named, wanted, err)
				}
			}
			if !strings.Contains(err.Error(), "--no-hooks") {
				t.Errorf("error does not say how to finish: %v", err)
			}
		})
	}
}

// bindings are the chart's, node-taint and init-container policies (the
// chart's check compares the names with what it renders).
var bindings = []string{"inpod-node-startup-taint", "inpod-wait-ready-pod-label", "inpod-wait-ready-namespace-label"}

func createBinding(t *testing.T, c kubernetes.Interface, name string) {
	t.Helper()
	if _, err := c.AdmissionregistrationV1().MutatingAdmissionPolicyBindings().Create(context.Background(), &admissionv1.MutatingAdmissionPolicyBinding{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec:       admissionv1.MutatingAdmissionPolicyBindingSpec{PolicyName: name},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// deletionOrder watches the bindings and the DaemonSet from now; the
// function it returns waits for every deletion and names them in the order
// etcd committed them (the resourceVersion of a DELETED event is its
// revision: comparable across resources in a test, never in the product).
func deletionOrder(t *testing.T, c kubernetes.Interface) func() []string {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	bl, err := c.AdmissionregistrationV1().MutatingAdmissionPolicyBindings().List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	bw, err := c.AdmissionregistrationV1().MutatingAdmissionPolicyBindings().Watch(ctx, metav1.ListOptions{ResourceVersion: bl.ResourceVersion})
	if err != nil {
		t.Fatal(err)
	}
	dl, err := c.AppsV1().DaemonSets(ns).List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	dw, err := c.AppsV1().DaemonSets(ns).Watch(ctx, metav1.ListOptions{ResourceVersion: dl.ResourceVersion})
	if err != nil {
		t.Fatal(err)
	}
	// deleted collects n deletions of w by name.
	deleted := func(w watch.Interface, what string, n int, revs map[string]int64) {
		timeout := time.After(30 * time.Second)
		for got := 0; got < n; {
			select {
			case ev, ok := <-w.ResultChan():
				if !ok {
					t.Fatalf("%s watch closed", what)
				}
				if ev.Type != watch.Deleted {
					continue
				}
				m, err := meta.Accessor(ev.Object)
				if err != nil {
					t.Fatal(err)
				}
				rv, err := strconv.ParseInt(m.GetResourceVersion(), 10, 64)
				if err != nil {
					t.Fatal(err)
				}
				name := m.GetName()
				if what == "daemonset" {
					name = what
				}
				revs[name] = rv
				got++
			case <-timeout:
				t.Fatalf("%s: %d deleted of %d (%v)", what, len(revs), n, revs)
			}
		}
	}
	return func() []string {
		defer bw.Stop()
		defer dw.Stop()
		revs := map[string]int64{}
		deleted(bw, "bindings", len(bindings), revs)
		deleted(dw, "daemonset", 1, revs)
		var names []string
		for n := range revs {
			names = append(names, n)
		}
		slices.SortFunc(names, func(a, b string) int { return int(revs[a] - revs[b]) })
		return names
	}
}

func createAgents(t *testing.T, c kubernetes.Interface, running map[string]bool) {
	t.Helper()
	ctx := context.Background()
	tmpl := corev1.PodSpec{Containers: []corev1.Container{{Name: "agent", Image: "inpod-agent"}}}
	if _, err := c.AppsV1().DaemonSets(ns).Create(ctx, &appsv1.DaemonSet{
		ObjectMeta: metav1.ObjectMeta{Name: "inpod-agent", Labels: agentLabels},
		Spec: appsv1.DaemonSetSpec{
			Selector: &metav1.LabelSelector{MatchLabels: agentLabels},
			Template: corev1.PodTemplateSpec{ObjectMeta: metav1.ObjectMeta{Labels: agentLabels}, Spec: tmpl},
		},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	for node, run := range running {
		spec := tmpl
		spec.NodeName = node
		p, err := c.CoreV1().Pods(ns).Create(ctx, &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: "inpod-agent-" + node, Labels: agentLabels}, Spec: spec,
		}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		state := corev1.ContainerState{Running: &corev1.ContainerStateRunning{StartedAt: metav1.Now()}}
		if !run {
			state = corev1.ContainerState{Waiting: &corev1.ContainerStateWaiting{Reason: "CrashLoopBackOff"}}
		}
		p.Status = corev1.PodStatus{Phase: corev1.PodRunning,
			ContainerStatuses: []corev1.ContainerStatus{{Name: "agent", Image: "inpod-agent", State: state}}}
		if _, err := c.CoreV1().Pods(ns).UpdateStatus(ctx, p, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
}

func deleteAgents(t *testing.T, c kubernetes.Interface) {
	t.Helper()
	zero := int64(0)
	if err := c.CoreV1().Pods(ns).DeleteCollection(context.Background(),
		metav1.DeleteOptions{GracePeriodSeconds: &zero}, metav1.ListOptions{LabelSelector: "app.kubernetes.io/name=inpod"}); err != nil {
		t.Error(err)
	}
}
