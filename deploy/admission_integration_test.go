//go:build integration

package deploy_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"slices"
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

	"github.com/inpod-dev/inpod/agent/podcondition"
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
// MutatingAdmissionPolicies of a default install (the resource request and
// the readiness gate) on a real API server and creates pods (server-side
// dry run: admission runs, nothing is stored): every pod the enrollment
// rules enroll gains the request on one container and the readiness gate
// inpod.dev/redirected after its own gates; every exclusion stays
// unchanged. The cases are requestcases', shared with the webhook's tests.
func TestIntegrationResourceRequestPolicy(t *testing.T) {
	a := startAPIServer(t)
	a.create(t, false, kinds(render(t), "MutatingAdmissionPolicy", "MutatingAdmissionPolicyBinding")...)
	// A policy takes effect a few seconds after it is created.
	a.checkRequestCases(t, "the policy")
}

// TestIntegrationReadinessGatePolicy: with a gate that advertises no
// resource (taint mode), the readiness-gate policy is the only mutating
// policy, and it alone decides: every pod the enrollment rules enroll gets
// the gate, keeping its own (readinessGates is an atomic list, so a
// replacing patch would drop them), once; no pod outside them (plain
// namespace, label none, host network, excluded namespace, a mirror pod,
// inpod's own) gets it, and no pod gains a request.
func TestIntegrationReadinessGatePolicy(t *testing.T) {
	objs := render(t, "--set", "gates={node-condition}")
	var policies []string
	for _, o := range kinds(objs, "MutatingAdmissionPolicy") {
		policies = append(policies, o.GetName())
	}
	if !slices.Equal(policies, []string{"inpod-readiness-gate"}) {
		t.Fatalf("policies %v, want only inpod-readiness-gate", policies)
	}
	a := startAPIServer(t)
	a.create(t, false, kinds(objs, "MutatingAdmissionPolicy", "MutatingAdmissionPolicyBinding")...)
	a.checkAdmissionCases(t, "the readiness-gate policy", false, true)
}

// checkRequestCases is checkAdmissionCases for a default install: the
// request and the readiness gate.
func (a *apiserver) checkRequestCases(t *testing.T, by string) {
	t.Helper()
	a.checkAdmissionCases(t, by, true, true)
}

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

// checkAdmissionCases creates requestcases' namespaces and admits each of
// its pods (server-side dry run), once the mutation (by, for messages) is
// seen to apply: with request, the enrolled pods gain the resource request
// (else no pod does); with gate, the readiness gate (else no pod does).
// inpod's own pods get neither.
func (a *apiserver) checkAdmissionCases(t *testing.T, by string, request, gate bool) {
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
	check := func(c requestcases.Case, got *corev1.Pod) error {
		checkRequest, checkGate := c.CheckNotRequested, c.CheckNoReadinessGate
		if request {
			checkRequest = c.Check
		}
		if gate {
			checkGate = c.CheckReadinessGate
		}
		return errors.Join(checkRequest(got), checkGate(got))
	}
	// The probe is enrolled: it gains whatever is on.
	probe := requestcases.Cases()[0]
	testkit.Eventually(t, 30*time.Second, by+" to apply", func() bool {
		return check(probe, admit(probe.Pod.DeepCopy())) == nil
	})
	for _, c := range requestcases.Cases() {
		if err := check(c, admit(c.Pod.DeepCopy())); err != nil {
			t.Errorf("%s: pod %s/%s (want %s, gated %t): %v", by, c.Pod.Namespace, c.Pod.Name, c.Want, c.Gated(), err)
		}
	}
	// inpod's own pods, in its namespace only, get neither.
	if got := admit(requestcases.OwnPod()); requestcases.Requested(got) || requestcases.HasReadinessGate(got) {
		t.Errorf("%s: inpod's own pod in %s was changed: %+v", by, requestcases.Own, got.Spec)
	}
}

// TestIntegrationNodeConfinementPolicy: with the chart's RBAC and
// ValidatingAdmissionPolicy on a real API server, the agent of node A —
// authenticated with a token of its ServiceAccount bound to its pod on node
// A, exactly as the kubelet gives it — may patch the pods of node A (their
// redirection annotation, and of their status only the inpod.dev/redirected
// condition, written by the agent's podcondition.Writer), its own Node's
// InPodRedirectionReady condition and node A's ResourceSlices, and nothing
// of node B; a token of the ServiceAccount that is not bound to a pod (no
// node name) may patch nothing.
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
	// The device-plugin gate's close: its resource's allocatable count set
	// to 0, exactly as agent.schedulingCloser patches it.
	allocatable := func(c kubernetes.Interface, node, resource, count string) error {
		_, err := c.CoreV1().Nodes().PatchStatus(ctx, node, fmt.Appendf(nil, `{"status":{"allocatable":{%q:%q}}}`, resource, count))
		return err
	}
	for _, n := range []string{"node-a", "node-b"} {
		if err := allocatable(admin, n, "inpod.dev/redirection", "8"); err != nil {
			t.Fatal(err)
		}
		if err := allocatable(admin, n, "cpu", "4"); err != nil {
			t.Fatal(err)
		}
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
	// The per-pod proof, written by the agent's own writer (its patch,
	// the pod's UID included, exactly as the agent sends it).
	proof := func(c kubernetes.Interface, name string, proven bool) error {
		p, err := admin.CoreV1().Pods("default").Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		w := podcondition.New(podcondition.Config{Client: c})
		w.Set(types.NamespacedName{Namespace: "default", Name: name}, p.UID, proven, "Redirected", "")
		return w.Flush(ctx)
	}
	podStatus := func(c kubernetes.Interface, name, patch string) error {
		_, err := c.CoreV1().Pods("default").Patch(ctx, name, types.StrategicMergePatchType, []byte(patch), metav1.PatchOptions{}, "status")
		return err
	}
	// The kubelet's condition: Ready, which picks Service endpoints.
	podReady := func(c kubernetes.Interface, name string) error {
		return podStatus(c, name, `{"status":{"conditions":[{"type":"Ready","status":"True"}]}}`)
	}
	// Another status field: the pod's IP, which Service endpoints point to.
	podIP := func(c kubernetes.Interface, name string) error {
		return podStatus(c, name, `{"status":{"podIP":"192.0.2.99","podIPs":[{"ip":"192.0.2.99"}]}}`)
	}
	// The pod's labels, through the status subresource.
	statusRelabel := func(c kubernetes.Interface, name string) error {
		return podStatus(c, name, `{"metadata":{"labels":{"app":"stolen-endpoints"}}}`)
	}

	nodeLabel := func(c kubernetes.Interface, node, key, value string) error {
		_, err := c.CoreV1().Nodes().Patch(ctx, node, types.MergePatchType,
			[]byte(fmt.Sprintf(`{"metadata":{"labels":{%q:%s}}}`, key, value)), metav1.PatchOptions{})
		return err
	}
	nodeTaint := func(c kubernetes.Interface, node string) error {
		_, err := c.CoreV1().Nodes().Patch(ctx, node, types.MergePatchType,
			[]byte(`{"spec":{"taints":[{"key":"stolen","effect":"NoSchedule"}]}}`), metav1.PatchOptions{})
		return err
	}
	statusNodeLabel := func(c kubernetes.Interface, node string) error {
		_, err := c.CoreV1().Nodes().Patch(ctx, node, types.MergePatchType,
			[]byte(`{"metadata":{"labels":{"topology.kubernetes.io/zone":"x"}}}`), metav1.PatchOptions{}, "status")
		return err
	}
	const installed = "inpod.dev/cni-installed"

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
		{"its Node's allocatable inpod.dev/redirection, raised", allocatable(agentA, "node-a", "inpod.dev/redirection", "9"), "only the InPodRedirectionReady condition"},
		{"its Node's allocatable cpu, to 0", allocatable(agentA, "node-a", "cpu", "0"), "only the InPodRedirectionReady condition"},
		{"its Node's allocatable of a resource it lacks, to 0", allocatable(agentA, "node-a", "example.com/other", "0"), "only the InPodRedirectionReady condition"},
		{"its Node's allocatable inpod.dev/redirection, to 0", allocatable(agentA, "node-a", "inpod.dev/redirection", "0"), ""},
		{"node B's allocatable inpod.dev/redirection, to 0", allocatable(agentA, "node-b", "inpod.dev/redirection", "0"), "only its own Node"},
		{"unbound token: node A's allocatable inpod.dev/redirection, to 0", allocatable(unbound, "node-a", "inpod.dev/redirection", "0"), "names no node"},
		{"another condition of its Node", otherCondition(agentA, "node-a"), "only the InPodRedirectionReady condition"},
		{"update its node's ResourceSlice", sliceUpdate(agentA, "node-a"), ""},
		{"create a ResourceSlice for its node", sliceCreate(agentA, "node-a"), ""},
		{"update node B's ResourceSlice", sliceUpdate(agentA, "node-b"), "ResourceSlices"},
		{"create a ResourceSlice for node B", sliceCreate(agentA, "node-b"), "ResourceSlices"},
		{"delete node B's ResourceSlice", sliceDelete(agentA, "node-b"), "ResourceSlices"},
		{"delete its node's ResourceSlice", sliceDelete(agentA, "node-a"), ""},
		{"label its Node " + installed, nodeLabel(agentA, "node-a", installed, `"true"`), ""},
		{"label its Node " + installed + " with another value", nodeLabel(agentA, "node-a", installed, `"false"`), "only the " + installed + " label"},
		{"another label of its Node", nodeLabel(agentA, "node-a", "topology.kubernetes.io/zone", `"x"`), "only the " + installed + " label"},
		{"taint its Node", nodeTaint(agentA, "node-a"), "only the " + installed + " label"},
		{"its Node's labels through its status", statusNodeLabel(agentA, "node-a"), "only the InPodRedirectionReady condition"},
		{"label node B " + installed, nodeLabel(agentA, "node-b", installed, `"true"`), "only its own Node"},
		{"remove the label from its Node", nodeLabel(agentA, "node-a", installed, "null"), ""},
		{"unbound token: annotate a pod of node A", annotate(unbound, "app-node-a"), "names no node"},
		{"unbound token: node A's condition", condition(unbound, "node-a"), "names no node"},
		{"the inpod.dev/redirected condition of a pod of its node", proof(agentA, "app-node-a", true), ""},
		{"the inpod.dev/redirected condition of a pod of its node, turned False", proof(agentA, "app-node-a", false), ""},
		{"the inpod.dev/redirected condition of a pod of node B", proof(agentA, "app-node-b", true), "only pods bound to its node"},
		{"the Ready condition of a pod of its node", podReady(agentA, "app-node-a"), "only the inpod.dev/redirected condition"},
		{"the IP of a pod of its node", podIP(agentA, "app-node-a"), "only the inpod.dev/redirected condition"},
		{"the labels of a pod of its node, through its status", statusRelabel(agentA, "app-node-a"), "only the inpod.dev/redirected condition"},
		{"unbound token: the inpod.dev/redirected condition of a pod of node A", proof(unbound, "app-node-a", true), "names no node"},
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
	// What the agent was allowed is on the pod (its last word, False),
	// and nothing it was refused.
	p, err := admin.CoreV1().Pods("default").Get(ctx, "app-node-a", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var conds []string
	for _, c := range p.Status.Conditions {
		conds = append(conds, string(c.Type)+"="+string(c.Status))
	}
	if !slices.Equal(conds, []string{"inpod.dev/redirected=False"}) || p.Status.PodIP != "" || p.Labels["app"] != "" {
		t.Errorf("pod of node A: conditions %v, IP %q, labels %v; want only inpod.dev/redirected=False", conds, p.Status.PodIP, p.Labels)
	}
	if p, err = admin.CoreV1().Pods("default").Get(ctx, "app-node-b", metav1.GetOptions{}); err != nil || len(p.Status.Conditions) != 0 {
		t.Errorf("pod of node B: conditions %v (%v), want none", p.Status.Conditions, err)
	}
}

// TestIntegrationNodeConfinementCoversPodStatus: the confinement policy
// keeps every field of a pod's status but conditions from the agent by
// naming each (CEL cannot compare a status minus one field): a field that
// k8s.io/api's PodStatus gained and the policy does not name would be the
// agent's to change. The list is checked here against the Go type.
func TestIntegrationNodeConfinementCoversPodStatus(t *testing.T) {
	vaps := kinds(render(t), "ValidatingAdmissionPolicy")
	var exprs []string
	for _, v := range vaps {
		if v.GetName() != "inpod-agent-node-confinement" {
			continue
		}
		vs, _, _ := unstructured.NestedSlice(v.Object, "spec", "validations")
		for _, x := range vs {
			exprs = append(exprs, x.(map[string]any)["expression"].(string))
		}
	}
	all := strings.Join(exprs, "\n")
	if all == "" {
		t.Fatal("no inpod-agent-node-confinement policy rendered")
	}
	st := reflect.TypeFor[corev1.PodStatus]()
	for i := range st.NumField() {
		name, _, _ := strings.Cut(st.Field(i).Tag.Get("json"), ",")
		if name == "conditions" {
			continue
		}
		if want := fmt.Sprintf("object.?status.?%s == oldObject.?status.?%s", name, name); !strings.Contains(all, want) {
			t.Errorf("PodStatus.%s (%s) is not compared by the confinement policy: the agent could change it", st.Field(i).Name, name)
		}
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
