//go:build integration

package taintcontroller

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	admissionv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"

	"github.com/inpod-dev/inpod/e2e/cluster"
	"github.com/inpod-dev/inpod/e2e/cluster/clustertest"
	"github.com/inpod-dev/inpod/internal/testkit"
)

// applyPolicy creates deploy/controller/node-taint-policy.yaml as shipped
// and waits until it acts (a new policy takes a few seconds).
func applyPolicy(t *testing.T, admin kubernetes.Interface) {
	t.Helper()
	ctx := context.Background()
	data, err := os.ReadFile(filepath.Join(testkit.RepoDir(t), "deploy", "controller", "node-taint-policy.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	for _, doc := range strings.Split(string(data), "\n---\n") {
		obj, _, err := scheme.Codecs.UniversalDeserializer().Decode([]byte(doc), nil, nil)
		if err != nil {
			t.Fatal(err)
		}
		switch o := obj.(type) {
		case *admissionv1.MutatingAdmissionPolicy:
			_, err = admin.AdmissionregistrationV1().MutatingAdmissionPolicies().Create(ctx, o, metav1.CreateOptions{})
		case *admissionv1.MutatingAdmissionPolicyBinding:
			_, err = admin.AdmissionregistrationV1().MutatingAdmissionPolicyBindings().Create(ctx, o, metav1.CreateOptions{})
		default:
			t.Fatalf("unexpected %T in node-taint-policy.yaml", obj)
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	probe := 0
	testkit.Eventually(t, 60*time.Second, "the policy taints a new Node", func() bool {
		probe++
		name := fmt.Sprintf("probe-%d", probe)
		n, err := admin.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: linux}}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if err := admin.CoreV1().Nodes().Delete(ctx, name, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
		return hasStartupTaint(n)
	})
}

// linux is the label the kubelet gives its Node at self-registration; the
// policy selects agent.nodeSelector (kubernetes.io/os=linux by default).
var linux = map[string]string{"kubernetes.io/os": "linux"}

func hasStartupTaint(n *corev1.Node) bool {
	k := 0
	for _, tt := range n.Spec.Taints {
		if tt.Key == taint.Key && tt.Effect == taint.Effect {
			k++
		}
	}
	return k == 1
}

func TestIntegrationTaintPolicyTaintsNodesAtCreate(t *testing.T) {
	// TaintNodesByCondition (on by default) adds node.kubernetes.io/not-ready
	// to every new Node before the policy runs; without it the policy sees
	// Nodes without taints at all.
	for _, tc := range []struct {
		name string
		args []string
	}{
		{"default", []string{"--enable-admission-plugins", "NodeRestriction"}},
		{"no-TaintNodesByCondition", []string{"--enable-admission-plugins", "NodeRestriction",
			"--disable-admission-plugins", "ServiceAccount,TaintNodesByCondition"}},
	} {
		t.Run(tc.name, func(t *testing.T) { testPolicy(t, tc.args) })
	}
}

func testPolicy(t *testing.T, args []string) {
	ctx := context.Background()
	cp := clustertest.ControlPlane(t, cluster.Config{APIServerArgs: args})
	admin := cp.Client

	// A node that exists before the policy is installed is not tainted by
	// it, then or later (CREATE only).
	if _, err := admin.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "existing"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	applyPolicy(t, admin)

	// A plain client.
	n, err := admin.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "plain", Labels: linux}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if !hasStartupTaint(n) {
		t.Fatalf("plain client's Node: taints %+v", n.Spec.Taints)
	}
	t.Logf("plain client's Node: taints %+v", n.Spec.Taints)

	// A node the agent never runs on (agent.nodeSelector is
	// kubernetes.io/os=linux) is never tainted: nothing would remove it.
	n, err = admin.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "windows",
		Labels: map[string]string{"kubernetes.io/os": "windows"}}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if hasStartupTaint(n) {
		t.Fatalf("a Windows Node (no agent runs there) got the startup taint: %+v", n.Spec.Taints)
	}

	// A kubelet registering itself, under NodeRestriction, with its own
	// startup taints and with ours already among them.
	kubelet := func(name string) kubernetes.Interface {
		rc := rest.CopyConfig(cp.Rest)
		rc.Impersonate = rest.ImpersonationConfig{UserName: "system:node:" + name, Groups: []string{"system:nodes", "system:authenticated"}}
		c, err := kubernetes.NewForConfig(rc)
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	// NodeRestriction is on: a kubelet may not create another's Node.
	if _, err := kubelet("k1").CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "someone-else"}}, metav1.CreateOptions{}); !apierrors.IsForbidden(err) {
		t.Fatalf("a kubelet created another node's Node (err %v): NodeRestriction is not in effect", err)
	}
	pool := corev1.Taint{Key: "pool.example.com/startup", Effect: corev1.TaintEffectNoSchedule}
	for _, tc := range []struct {
		name   string
		taints []corev1.Taint
	}{
		{"k1", nil},
		{"k2", []corev1.Taint{pool}},
		{"k3", []corev1.Taint{pool, taint}},
	} {
		n, err := kubelet(tc.name).CoreV1().Nodes().Create(ctx, &corev1.Node{
			ObjectMeta: metav1.ObjectMeta{Name: tc.name, Labels: map[string]string{"kubernetes.io/hostname": tc.name, "kubernetes.io/os": "linux"}},
			Spec:       corev1.NodeSpec{Taints: tc.taints},
		}, metav1.CreateOptions{})
		if err != nil {
			t.Fatalf("kubelet %s registering: %v", tc.name, err)
		}
		if !hasStartupTaint(n) {
			t.Fatalf("kubelet %s's Node: taints %+v, want the startup taint once", tc.name, n.Spec.Taints)
		}
		for _, want := range tc.taints {
			found := false
			for _, got := range n.Spec.Taints {
				found = found || got == want
			}
			if !found {
				t.Fatalf("kubelet %s's own taint %v lost: %+v", tc.name, want, n.Spec.Taints)
			}
		}
	}

	e, err := admin.CoreV1().Nodes().Get(ctx, "existing", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	e.Labels = map[string]string{"touched": "yes"}
	if e, err = admin.CoreV1().Nodes().Update(ctx, e, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	if hasStartupTaint(e) {
		t.Fatal("the policy tainted an existing Node on update")
	}
}
