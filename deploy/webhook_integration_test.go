//go:build integration

package deploy_test

import (
	"context"
	"encoding/base64"
	"net"
	"slices"
	"strings"
	"sync"
	"testing"

	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/inpod-dev/inpod/enrollment"
	"github.com/inpod-dev/inpod/internal/requestcases"
	"github.com/inpod-dev/inpod/requestwebhook"
)

// TestIntegrationResourceRequestWebhook is TestIntegrationResourceRequestPolicy
// for mode=webhook (the request and the readiness gate): the chart's MutatingWebhookConfiguration (its rules,
// selectors, failure policy and caBundle; only the Service reference is
// replaced by this process's address) on a real API server, calling the
// webhook served by this test over real TLS on localhost, with the
// controller's ServiceAccount and the chart's webhook RBAC; the same pods
// (server-side dry run) with the same expectations.
func TestIntegrationResourceRequestWebhook(t *testing.T) {
	a := startAPIServer(t)
	ctx := context.Background()
	certDir := t.TempDir()
	ca := requestcases.WriteServingCert(t, certDir, 1)
	objs := render(t, "--set", "enrollment.autoRequest.mode=webhook", "--set", "controller.enabled=true",
		"--set", "enrollment.autoRequest.webhook.caBundle="+base64.StdEncoding.EncodeToString(ca))
	if n := len(kinds(objs, "MutatingAdmissionPolicy", "MutatingAdmissionPolicyBinding")); n != 0 {
		t.Fatalf("mode=webhook also renders %d policy objects", n)
	}

	// The controller's identity, with only the chart's webhook RBAC.
	sa := &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "inpod-controller", Namespace: namespace}}
	if _, err := a.Client.CoreV1().ServiceAccounts(namespace).Create(ctx, sa, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	var rbac []*unstructured.Unstructured
	for _, o := range kinds(objs, "ClusterRole", "ClusterRoleBinding") {
		if o.GetName() == "inpod-controller-webhook" {
			rbac = append(rbac, o)
		}
	}
	if len(rbac) != 2 {
		t.Fatalf("the chart renders %d of the webhook's ClusterRole and ClusterRoleBinding", len(rbac))
	}
	a.create(t, false, rbac...)
	exp := int64(3600)
	tr, err := a.Client.CoreV1().ServiceAccounts(namespace).CreateToken(ctx, sa.Name,
		&authenticationv1.TokenRequest{Spec: authenticationv1.TokenRequestSpec{ExpirationSeconds: &exp}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	rc := rest.AnonymousClientConfig(a.Rest)
	rc.BearerToken = tr.Status.Token
	client, err := kubernetes.NewForConfig(rc)
	if err != nil {
		t.Fatal(err)
	}

	// The webhook as the chart's Deployment configures it: the request and
	// the readiness gate (a default install).
	var args []string
	for _, d := range kinds(objs, "Deployment") {
		if d.GetName() == "inpod-controller" {
			cs, _, _ := unstructured.NestedSlice(d.Object, "spec", "template", "spec", "containers")
			a, _, _ := unstructured.NestedStringSlice(cs[0].(map[string]any), "args")
			args = a
		}
	}
	for _, want := range []string{"--resource-request=true", "--readiness-gate=true"} {
		if !slices.Contains(args, want) {
			t.Fatalf("the controller's args %v lack %s", args, want)
		}
	}
	addr, stop := serveRequestWebhook(t, ctx, client, certDir)

	mwcs := kinds(objs, "MutatingWebhookConfiguration")
	if len(mwcs) != 1 {
		t.Fatalf("%d MutatingWebhookConfigurations rendered", len(mwcs))
	}
	mwc := mwcs[0]
	hooks, _, _ := unstructured.NestedSlice(mwc.Object, "webhooks")
	for _, h := range hooks {
		cc := h.(map[string]any)["clientConfig"].(map[string]any)
		svc := cc["service"].(map[string]any)
		if svc["name"] != "inpod-webhook" || svc["path"] != requestwebhook.Path || cc["caBundle"] == nil {
			t.Fatalf("clientConfig %v: want the Service inpod-webhook, path %s, a caBundle", cc, requestwebhook.Path)
		}
		if p := h.(map[string]any)["failurePolicy"]; p != "Ignore" {
			t.Errorf("failurePolicy %v, want Ignore", p)
		}
	}
	pointWebhooksAt(t, mwc, addr)
	a.create(t, false, mwc)
	a.checkRequestCases(t, "the webhook")

	// The controller down: pods are still created, unchanged (Ignore).
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	p := requestcases.Cases()[0].Pod
	got, err := a.Client.CoreV1().Pods(p.Namespace).Create(ctx, p, metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
	if err != nil {
		t.Fatalf("webhook down: an enrolled pod's creation failed: %v", err)
	}
	if requestcases.Requested(got) || requestcases.HasReadinessGate(got) {
		t.Error("webhook down: the pod has the request or the readiness gate")
	}
	if !strings.Contains(p.Namespace, "mesh") {
		t.Fatalf("case 0 is not an enrolled pod: %s", p.Namespace)
	}
}

// serveRequestWebhook runs the request webhook as the chart's default
// install configures it (the request and the readiness gate), with the
// serving certificate in certDir, until stop or the test's end; it returns
// its address.
func serveRequestWebhook(t testing.TB, ctx context.Context, client kubernetes.Interface, certDir string) (addr string, stop func() error) {
	t.Helper()
	w, err := requestwebhook.New(requestwebhook.Config{
		Client:        client,
		Policy:        enrollment.Policy{ExcludedNamespaces: []string{requestcases.Excluded}, Label: requestcases.Label},
		ResourceName:  requestcases.ResourceName,
		ReadinessGate: true,
		OwnNamespace:  requestcases.Own,
		CertDir:       certDir,
	})
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	wctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- w.Serve(wctx, ln) }()
	var once sync.Once
	var served error
	stop = func() error {
		once.Do(func() { cancel(); served = <-done })
		return served
	}
	t.Cleanup(func() {
		if err := stop(); err != nil {
			t.Error(err)
		}
	})
	return ln.Addr().String(), stop
}

// pointWebhooksAt sends the rendered MutatingWebhookConfiguration's calls to
// addr instead of the chart's Service, which no cluster here runs.
func pointWebhooksAt(t testing.TB, mwc *unstructured.Unstructured, addr string) {
	t.Helper()
	hooks, _, _ := unstructured.NestedSlice(mwc.Object, "webhooks")
	for _, h := range hooks {
		cc := h.(map[string]any)["clientConfig"].(map[string]any)
		delete(cc, "service")
		cc["url"] = "https://" + addr + requestwebhook.Path
	}
	if err := unstructured.SetNestedSlice(mwc.Object, hooks, "webhooks"); err != nil {
		t.Fatal(err)
	}
}
