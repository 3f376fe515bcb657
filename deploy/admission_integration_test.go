//go:build integration

package deploy_test

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	resourcev1 "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/inpod-dev/inpod/internal/requestcases"
	"github.com/inpod-dev/inpod/internal/testkit"
)

// kinds keeps the rendered objects of the given kinds.
func kinds(objs []*unstructured.Unstructured, want ...string) []*unstructured.Unstructured {
	var out []*unstructured.Unstructured
	for _, o := range objs {
		for _, k := range want {
			if o.GetKind() == k {
				out = append(out, o)
			}
		}
	}
	return out
}

// TestIntegrationResourceRequestPolicy creates the chart's
// MutatingAdmissionPolicy on a real API server and creates pods (server-side
// dry run: admission runs, nothing is stored): every pod the enrollment
// rules enroll gains the request on one container; every exclusion stays
// unchanged. The cases are requestcases', shared with the webhook's tests.
func TestIntegrationResourceRequestPolicy(t *testing.T) {
	a := startAPIServer(t)
	a.create(t, false, kinds(render(t), "MutatingAdmissionPolicy", "MutatingAdmissionPolicyBinding")...)
	// A policy takes effect a few seconds after it is created.
	a.checkRequestCases(t, "the policy")
}

// checkRequestCases creates requestcases' namespaces and admits each of
// its pods (server-side dry run), once the mutation (by, for messages) is
// seen to apply.
// admit is what admission makes of p (a dry-run create); a refusal fails
// the test.
func (a *apiserver) admit(t *testing.T, p *corev1.Pod) *corev1.Pod {
	t.Helper()
	out, err := a.Client.CoreV1().Pods(p.Namespace).Create(context.Background(), p, metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
	if err != nil {
		t.Fatalf("pod %s/%s refused: %v", p.Namespace, p.Name, err)
	}
	return out
}

func (a *apiserver) checkRequestCases(t *testing.T, by string) {
	t.Helper()
	ctx := context.Background()
	nss := a.Client.CoreV1().Namespaces()
	for _, ns := range requestcases.Namespaces() {
		if _, err := nss.Create(ctx, ns, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	ks, err := nss.Get(ctx, requestcases.Excluded, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	requestcases.LabelExcluded(ks)
	if _, err := nss.Update(ctx, ks, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	admit := func(p *corev1.Pod) *corev1.Pod { t.Helper(); return a.admit(t, p) }
	probe := requestcases.Cases()[0]
	testkit.Eventually(t, 30*time.Second, by+" to apply", func() bool {
		return probe.Check(admit(probe.Pod.DeepCopy())) == nil
	})
	for _, c := range requestcases.Cases() {
		if err := c.Check(admit(c.Pod.DeepCopy())); err != nil {
			t.Errorf("%s: pod %s/%s (want %s): %v", by, c.Pod.Namespace, c.Pod.Name, c.Want, err)
		}
	}
}

// TestIntegrationNodeConfinementPolicy: with the chart's RBAC and
// ValidatingAdmissionPolicy on a real API server, the agent of node A —
// authenticated with a token of its ServiceAccount bound to its pod on node
// A, exactly as the kubelet gives it — may patch the pods of node A, its own
// Node's InPodRedirectionReady condition and node A's ResourceSlices, and
// nothing of node B; a token of the ServiceAccount that is not bound to a
// pod (no node name) may patch nothing.
func TestIntegrationNodeConfinementPolicy(t *testing.T) {
	a := startAPIServer(t)
	ctx := context.Background()
	admin := a.Client
	// Every gate on: the agent's RBAC then grants all it can be given
	// (nodes/status, ResourceSlices), so that the policy, not RBAC, is what
	// is tested.
	objs := render(t, "--set", "gates={deviceplugin,dra,node-condition}")
	a.create(t, false, kinds(objs, "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding",
		"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")...)

	for _, n := range []string{"node-a", "node-b"} {
		if _, err := admin.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: n}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		if _, err := admin.CoreV1().Pods("default").Create(ctx, &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: "app-" + n},
			Spec:       corev1.PodSpec{NodeName: n, Containers: []corev1.Container{{Name: "app", Image: "app"}}},
		}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		if _, err := admin.ResourceV1().ResourceSlices().Create(ctx, slice(n), metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	// The agent's pod on node A, and its token as the kubelet requests it:
	// bound to that pod, so the API server adds the node's name.
	agentPod, err := admin.CoreV1().Pods(namespace).Create(ctx, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "inpod-agent-a"},
		Spec:       corev1.PodSpec{NodeName: "node-a", ServiceAccountName: "inpod-agent", Containers: []corev1.Container{{Name: "agent", Image: "agent"}}},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	agentA := a.tokenClient(t, &authenticationv1.BoundObjectReference{Kind: "Pod", APIVersion: "v1", Name: agentPod.Name, UID: agentPod.UID})
	unbound := a.tokenClient(t, nil)

	annotate := func(c kubernetes.Interface, name string) error {
		_, err := c.CoreV1().Pods("default").Patch(ctx, name, types.MergePatchType,
			[]byte(`{"metadata":{"annotations":{"ambient.istio.io/redirection":"enabled"}}}`), metav1.PatchOptions{})
		return err
	}
	condition := func(c kubernetes.Interface, node string) error {
		patch := fmt.Sprintf(`{"status":{"conditions":[{"type":"InPodRedirectionReady","status":"True","reason":"Ready","lastTransitionTime":%q}]}}`,
			time.Now().UTC().Format(time.RFC3339))
		_, err := c.CoreV1().Nodes().Patch(ctx, node, types.StrategicMergePatchType, []byte(patch), metav1.PatchOptions{}, "status")
		return err
	}
	capacity := func(c kubernetes.Interface, node string) error {
		_, err := c.CoreV1().Nodes().Patch(ctx, node, types.StrategicMergePatchType,
			[]byte(`{"status":{"capacity":{"inpod.dev/redirection":"1000"},"allocatable":{"inpod.dev/redirection":"1000"}}}`), metav1.PatchOptions{}, "status")
		return err
	}
	otherCondition := func(c kubernetes.Interface, node string) error {
		_, err := c.CoreV1().Nodes().Patch(ctx, node, types.StrategicMergePatchType,
			[]byte(`{"status":{"conditions":[{"type":"Ready","status":"False","reason":"Forged"}]}}`), metav1.PatchOptions{}, "status")
		return err
	}
	sliceUpdate := func(c kubernetes.Interface, node string) error {
		s, err := admin.ResourceV1().ResourceSlices().Get(ctx, "slice-"+node, metav1.GetOptions{})
		if err != nil {
			return err
		}
		s.Spec.Pool.Generation++
		_, err = c.ResourceV1().ResourceSlices().Update(ctx, s, metav1.UpdateOptions{})
		return err
	}
	sliceCreate := func(c kubernetes.Interface, node string) error {
		s := slice(node)
		s.Name += "-new"
		_, err := c.ResourceV1().ResourceSlices().Create(ctx, s, metav1.CreateOptions{})
		return err
	}
	relabel := func(c kubernetes.Interface, name string) error {
		_, err := c.CoreV1().Pods("default").Patch(ctx, name, types.MergePatchType,
			[]byte(`{"metadata":{"labels":{"app":"stolen-endpoints"}}}`), metav1.PatchOptions{})
		return err
	}
	otherAnnotation := func(c kubernetes.Interface, name string) error {
		_, err := c.CoreV1().Pods("default").Patch(ctx, name, types.MergePatchType,
			[]byte(`{"metadata":{"annotations":{"example.com/other":"x"}}}`), metav1.PatchOptions{})
		return err
	}
	otherDriverSlice := func(c kubernetes.Interface, node string) error {
		s := slice(node)
		s.Name += "-gpu"
		s.Spec.Driver = "gpu.example.com"
		_, err := c.ResourceV1().ResourceSlices().Create(ctx, s, metav1.CreateOptions{})
		return err
	}
	sliceDelete := func(c kubernetes.Interface, node string) error {
		return c.ResourceV1().ResourceSlices().Delete(ctx, "slice-"+node, metav1.DeleteOptions{})
	}

	// The policy takes a few seconds to apply after it is created.
	testkit.Eventually(t, 30*time.Second, "the policy to apply", func() bool {
		return denied(annotate(agentA, "app-node-b"))
	})
	for _, c := range []struct {
		what string
		err  error
		want string // "" allowed, else a word of the denial
	}{
		{"annotate a pod of its node", annotate(agentA, "app-node-a"), ""},
		{"annotate a pod of node B", annotate(agentA, "app-node-b"), "only pods bound to its node"},
		{"relabel a pod of its node", relabel(agentA, "app-node-a"), "only the ambient.istio.io/redirection annotation"},
		{"another annotation of a pod of its node", otherAnnotation(agentA, "app-node-a"), "only the ambient.istio.io/redirection annotation"},
		{"create another driver's ResourceSlice on its node", otherDriverSlice(agentA, "node-a"), "driver redirection.inpod.dev"},
		{"its Node's InPodRedirectionReady condition", condition(agentA, "node-a"), ""},
		{"node B's condition", condition(agentA, "node-b"), "only its own Node"},
		{"its Node's capacity", capacity(agentA, "node-a"), "only the InPodRedirectionReady condition"},
		{"another condition of its Node", otherCondition(agentA, "node-a"), "only the InPodRedirectionReady condition"},
		{"update its node's ResourceSlice", sliceUpdate(agentA, "node-a"), ""},
		{"create a ResourceSlice for its node", sliceCreate(agentA, "node-a"), ""},
		{"update node B's ResourceSlice", sliceUpdate(agentA, "node-b"), "ResourceSlices"},
		{"create a ResourceSlice for node B", sliceCreate(agentA, "node-b"), "ResourceSlices"},
		{"delete node B's ResourceSlice", sliceDelete(agentA, "node-b"), "ResourceSlices"},
		{"delete its node's ResourceSlice", sliceDelete(agentA, "node-a"), ""},
		{"unbound token: annotate a pod of node A", annotate(unbound, "app-node-a"), "names no node"},
		{"unbound token: node A's condition", condition(unbound, "node-a"), "names no node"},
	} {
		switch {
		case c.want == "" && c.err != nil:
			t.Errorf("%s: refused: %v", c.what, c.err)
		case c.want != "" && !denied(c.err):
			t.Errorf("%s: allowed (err %v), want denied by the policy", c.what, c.err)
		case c.want != "" && !strings.Contains(c.err.Error(), c.want):
			t.Errorf("%s: denied with %q, want it to say %q", c.what, c.err, c.want)
		}
	}
	// The admin (everyone but the agent) is not confined.
	if err := annotate(admin, "app-node-b"); err != nil {
		t.Errorf("admin refused: %v", err)
	}
}

// denied is a refusal by the admission policy (RBAC refusals say
// "cannot").
func denied(err error) bool {
	return apierrors.IsForbidden(err) || apierrors.IsInvalid(err)
}

func slice(node string) *resourcev1.ResourceSlice {
	return &resourcev1.ResourceSlice{
		ObjectMeta: metav1.ObjectMeta{Name: "slice-" + node},
		Spec: resourcev1.ResourceSliceSpec{
			Driver:   "redirection.inpod.dev",
			NodeName: &node,
			Pool:     resourcev1.ResourcePool{Name: node, Generation: 1, ResourceSliceCount: 1},
			Devices:  []resourcev1.Device{{Name: "redirection"}},
		},
	}
}

// tokenClient is a client with a token of the agent's ServiceAccount from
// the TokenRequest API, bound to ref when it is set (as the kubelet binds a
// pod's token).
func (a *apiserver) tokenClient(t *testing.T, ref *authenticationv1.BoundObjectReference) kubernetes.Interface {
	t.Helper()
	exp := int64(3600)
	tr, err := a.Client.CoreV1().ServiceAccounts(namespace).CreateToken(context.Background(), "inpod-agent",
		&authenticationv1.TokenRequest{Spec: authenticationv1.TokenRequestSpec{ExpirationSeconds: &exp, BoundObjectRef: ref}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if ref != nil {
		// The claim the policy reads, as the API server reports it.
		review, err := a.Client.AuthenticationV1().TokenReviews().Create(context.Background(),
			&authenticationv1.TokenReview{Spec: authenticationv1.TokenReviewSpec{Token: tr.Status.Token}}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		extra, _ := json.Marshal(review.Status.User.Extra)
		if !strings.Contains(string(extra), "authentication.kubernetes.io/node-name") {
			t.Fatalf("the pod-bound token carries no node name: %s", extra)
		}
	}
	rc := rest.AnonymousClientConfig(a.Rest)
	rc.BearerToken = tr.Status.Token
	c, err := kubernetes.NewForConfig(rc)
	if err != nil {
		t.Fatal(err)
	}
	return c
}
