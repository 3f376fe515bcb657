package requestwebhook_test

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	admissionv1 "k8s.io/api/admission/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/inpod-dev/inpod/enrollment"
	"github.com/inpod-dev/inpod/internal/requestcases"
	"github.com/inpod-dev/inpod/internal/testkit"
	"github.com/inpod-dev/inpod/requestwebhook"
)

func newWebhook(t *testing.T, certDir string) *requestwebhook.Webhook {
	t.Helper()
	return newWebhookWith(t, certDir, true, true)
}

// newWebhookWith adds the request and the readiness gate as told.
func newWebhookWith(t *testing.T, certDir string, request, gate bool) *requestwebhook.Webhook {
	t.Helper()
	var objs []runtime.Object
	for _, ns := range requestcases.Namespaces() {
		objs = append(objs, ns)
	}
	ks := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: requestcases.Excluded}}
	requestcases.LabelExcluded(ks)
	objs = append(objs, ks)
	w, err := requestwebhook.New(requestwebhook.Config{
		Client:            fake.NewClientset(objs...),
		Policy:            enrollment.Policy{ExcludedNamespaces: []string{requestcases.Excluded}, Label: requestcases.Label},
		ResourceName:      requestcases.ResourceName,
		NoResourceRequest: !request,
		ReadinessGate:     gate,
		OwnNamespace:      requestcases.Own,
		CertDir:           certDir,
	})
	if err != nil {
		t.Fatal(err)
	}
	return w
}

// admit sends the pod's creation to the handler as the API server does,
// with the pod's namespace only in the request (as for a pod created
// without metadata.namespace), and applies the answer's patch.
func admit(t *testing.T, h http.Handler, p *corev1.Pod) (*corev1.Pod, *admissionv1.AdmissionResponse) {
	t.Helper()
	ns := p.Namespace
	p = p.DeepCopy()
	p.Namespace = ""
	raw, _ := json.Marshal(p)
	review := admissionv1.AdmissionReview{
		TypeMeta: metav1.TypeMeta{APIVersion: "admission.k8s.io/v1", Kind: "AdmissionReview"},
		Request: &admissionv1.AdmissionRequest{
			UID: types.UID("uid-" + p.Name), Operation: admissionv1.Create, Namespace: ns, Name: p.Name,
			Kind:     metav1.GroupVersionKind{Version: "v1", Kind: "Pod"},
			Resource: metav1.GroupVersionResource{Version: "v1", Resource: "pods"},
			Object:   runtime.RawExtension{Raw: raw},
		},
	}
	body, _ := json.Marshal(review)
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(http.MethodPost, requestwebhook.Path, bytes.NewReader(body)))
	if rec.Code != http.StatusOK {
		t.Fatalf("status %d: %s", rec.Code, rec.Body)
	}
	var out admissionv1.AdmissionReview
	if err := json.Unmarshal(rec.Body.Bytes(), &out); err != nil {
		t.Fatal(err)
	}
	resp := out.Response
	if resp == nil || resp.UID != review.Request.UID || !resp.Allowed || out.APIVersion != "admission.k8s.io/v1" || out.Kind != "AdmissionReview" {
		t.Fatalf("answer %s: want an allowed admission/v1 AdmissionReview with the request's UID", rec.Body)
	}
	if resp.Patch == nil {
		return p, resp
	}
	if resp.PatchType == nil || *resp.PatchType != admissionv1.PatchTypeJSONPatch {
		t.Fatalf("patch type %v", resp.PatchType)
	}
	return applyPatch(t, raw, resp.Patch), resp
}

// applyPatch applies the JSONPatch "add" operations of RFC 6902 (what the
// webhook emits): the integration test has the API server apply them.
func applyPatch(t *testing.T, doc, patch []byte) *corev1.Pod {
	t.Helper()
	var obj any
	var ops []struct {
		Op, Path string
		Value    any
	}
	if err := json.Unmarshal(doc, &obj); err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(patch, &ops); err != nil {
		t.Fatal(err)
	}
	for _, op := range ops {
		if op.Op != "add" {
			t.Fatalf("unexpected patch op %q", op.Op)
		}
		keys := strings.Split(strings.TrimPrefix(op.Path, "/"), "/")
		cur := obj
		for i, k := range keys {
			k = strings.NewReplacer("~1", "/", "~0", "~").Replace(k)
			last := i == len(keys)-1
			switch c := cur.(type) {
			case map[string]any:
				if last {
					c[k] = op.Value
				} else if cur = c[k]; cur == nil {
					t.Fatalf("patch path %s: no %s", op.Path, k)
				}
			case []any:
				n, err := strconv.Atoi(k)
				if err != nil || n >= len(c) || last {
					t.Fatalf("patch path %s: index %s", op.Path, k)
				}
				cur = c[n]
			default:
				t.Fatalf("patch path %s: %s in a scalar", op.Path, k)
			}
		}
	}
	out, _ := json.Marshal(obj)
	var p corev1.Pod
	if err := json.Unmarshal(out, &p); err != nil {
		t.Fatal(err)
	}
	return &p
}

// The decision table the chart's MutatingAdmissionPolicies are tested
// with: the request and the readiness gate together (the default install),
// and each alone (the readiness gate off; a gate that advertises no
// resource).
func TestDecisionTable(t *testing.T) {
	for _, tc := range []struct {
		name          string
		request, gate bool
	}{
		{"request and readiness gate", true, true},
		{"request alone", true, false},
		{"readiness gate alone", false, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := newWebhookWith(t, "", tc.request, tc.gate)
			for _, c := range requestcases.Cases() {
				got, resp := admit(t, w, c.Pod)
				check := c.CheckNotRequested
				if tc.request {
					check = c.Check
				}
				if err := check(got); err != nil {
					t.Errorf("pod %s/%s (want %s): %v", c.Pod.Namespace, c.Pod.Name, c.Want, err)
				}
				gateCheck := c.CheckNoReadinessGate
				if tc.gate {
					gateCheck = c.CheckReadinessGate
				}
				if err := gateCheck(got); err != nil {
					t.Errorf("pod %s/%s: %v", c.Pod.Namespace, c.Pod.Name, err)
				}
				// A pod that gets nothing gets no patch at all.
				wantPatch := tc.request && c.Want == requestcases.Gains || tc.gate && c.Gated() && !requestcases.HasReadinessGate(c.Pod)
				if !wantPatch && resp.Patch != nil {
					t.Errorf("pod %s/%s (want %s): a patch: %s", c.Pod.Namespace, c.Pod.Name, c.Want, resp.Patch)
				}
			}
			// inpod's own pods, in its namespace only, never get either.
			if got, resp := admit(t, w, requestcases.OwnPod()); requestcases.Requested(got) || requestcases.HasReadinessGate(got) || resp.Patch != nil {
				t.Errorf("inpod's own pod in %s was patched: %s", requestcases.Own, resp.Patch)
			}
		})
	}
}

// Whatever fails, the pod is admitted: without the request it still fails
// closed at the CNI if enrolled; a refusal would block pods outside the
// mesh.
func TestNeverRefuses(t *testing.T) {
	w := newWebhook(t, "")
	base := requestcases.Cases()[0].Pod
	ghost := base.DeepCopy()
	ghost.Namespace = "no-such-namespace"
	if got, resp := admit(t, w, ghost); requestcases.Requested(got) || requestcases.HasReadinessGate(got) || len(resp.Warnings) == 0 {
		t.Errorf("namespace not readable: requested %t, gated %t, warnings %v; want admitted unchanged with a warning",
			requestcases.Requested(got), requestcases.HasReadinessGate(got), resp.Warnings)
	}
	noContainers := base.DeepCopy()
	noContainers.Spec.Containers = nil
	if got, _ := admit(t, w, noContainers); requestcases.Requested(got) || requestcases.HasReadinessGate(got) {
		t.Error("a pod without containers was patched")
	}

	// Not a pod creation: no patch.
	raw, _ := json.Marshal(base)
	for _, req := range []admissionv1.AdmissionRequest{
		{Operation: admissionv1.Update, Resource: metav1.GroupVersionResource{Version: "v1", Resource: "pods"}},
		{Operation: admissionv1.Create, Resource: metav1.GroupVersionResource{Version: "v1", Resource: "pods"}, SubResource: "binding"},
		{Operation: admissionv1.Create, Resource: metav1.GroupVersionResource{Group: "apps", Version: "v1", Resource: "deployments"}},
	} {
		req.UID, req.Namespace, req.Object.Raw = "u", base.Namespace, raw
		body, _ := json.Marshal(admissionv1.AdmissionReview{Request: &req})
		rec := httptest.NewRecorder()
		w.ServeHTTP(rec, httptest.NewRequest(http.MethodPost, requestwebhook.Path, bytes.NewReader(body)))
		var out admissionv1.AdmissionReview
		if err := json.Unmarshal(rec.Body.Bytes(), &out); err != nil || out.Response == nil || !out.Response.Allowed || out.Response.Patch != nil {
			t.Errorf("%s %s/%s: %s; want allowed without a patch", req.Operation, req.Resource.Resource, req.SubResource, rec.Body)
		}
	}
	// Garbage is a bad request, not a refusal of a pod (the API server
	// applies the failure policy: Ignore).
	rec := httptest.NewRecorder()
	w.ServeHTTP(rec, httptest.NewRequest(http.MethodPost, requestwebhook.Path, strings.NewReader("{")))
	if rec.Code != http.StatusBadRequest {
		t.Errorf("garbage: status %d", rec.Code)
	}
}

// A rotated certificate is served without a restart; a half-written
// rotation (the key new, the certificate not yet) keeps the previous pair.
func TestCertificateReloadedWhenRotated(t *testing.T) {
	dir := t.TempDir()
	requestcases.WriteServingCert(t, dir, 1)
	w := newWebhook(t, dir)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- w.Serve(ctx, ln) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	})
	serial := func() (int64, error) {
		c, err := tls.DialWithDialer(&net.Dialer{Timeout: time.Second}, "tcp", ln.Addr().String(), &tls.Config{InsecureSkipVerify: true})
		if err != nil {
			return 0, err
		}
		defer c.Close()
		return c.ConnectionState().PeerCertificates[0].SerialNumber.Int64(), nil
	}
	servesSerial := func(want int64) {
		t.Helper()
		if err := testkit.Poll(5*time.Second, fmt.Sprintf("serial %d served", want), func() (bool, error) {
			got, err := serial()
			return err == nil && got == want, nil
		}); err != nil {
			got, err := serial()
			t.Fatalf("%v: serving serial %d (%v)", err, got, err)
		}
	}
	servesSerial(1)

	crt := requestcases.WriteServingCert(t, dir, 2)
	servesSerial(2)
	// The served certificate is the one written, and verifies.
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(crt)
	c, err := tls.Dial("tcp", ln.Addr().String(), &tls.Config{RootCAs: pool})
	if err != nil {
		t.Fatalf("rotated certificate does not verify: %v", err)
	}
	c.Close()

	// Mid-rotation: a new key with the old certificate.
	other := t.TempDir()
	requestcases.WriteServingCert(t, other, 3)
	key, _ := readFile(other, requestwebhook.KeyFile)
	writeFile(t, dir, requestwebhook.KeyFile, key)
	if got, err := serial(); err != nil || got != 2 {
		t.Errorf("half-rotated: serial %d, %v; want the previous (2) still served", got, err)
	}
}

func readFile(dir, name string) ([]byte, error) { return os.ReadFile(filepath.Join(dir, name)) }

func writeFile(t *testing.T, dir, name string, data []byte) {
	t.Helper()
	if err := os.WriteFile(filepath.Join(dir, name), data, 0o600); err != nil {
		t.Fatal(err)
	}
}
