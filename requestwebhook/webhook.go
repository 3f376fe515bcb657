package requestwebhook

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"time"

	admissionv1 "k8s.io/api/admission/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	listersv1 "k8s.io/client-go/listers/core/v1"

	"github.com/inpod-dev/inpod/enrollment"
)

// Path is where the webhook answers AdmissionReviews.
const Path = "/mutate-pods"

// Defaults.
const (
	DefaultResourceName = "inpod.dev/redirection"
	// Below the chart's timeoutSeconds, so the API server gets an answer
	// (allowed) rather than a timeout.
	namespaceReadTimeout = 2 * time.Second
	// The API server sends at most 3 MiB of object; leave room for the
	// review around it.
	maxBody = 7 << 20
)

// Config is the webhook's.
type Config struct {
	// Client reads Namespaces (a watch, and a read for a namespace the
	// watch has not seen yet).
	Client kubernetes.Interface
	// Policy is the agent's enrollment policy (excluded namespaces, label).
	Policy enrollment.Policy
	// ResourceName is the extended resource requested.
	ResourceName corev1.ResourceName
	// NoResourceRequest: enrolled pods do not get the request (no gate
	// advertises the resource; the webhook serves the readiness gate).
	NoResourceRequest bool
	// ReadinessGate: enrolled pods get the readiness gate ReadinessGate,
	// so a Service sends them traffic only once the agent has proven
	// their redirection.
	ReadinessGate bool
	// OwnNamespace is inpod's namespace (the chart's release namespace):
	// only there does the label part-of=inpod exempt a pod; elsewhere it is
	// a user's pod, which the agent enrolls like any other.
	OwnNamespace string
	// Addr is the HTTPS listen address, e.g. ":9443".
	Addr string
	// CertDir holds tls.crt and tls.key, read again when they change.
	CertDir string
	Logger  *slog.Logger
}

// Webhook answers AdmissionReviews for pod creations.
type Webhook struct {
	cfg        Config
	rules      rules
	log        *slog.Logger
	factory    informers.SharedInformerFactory
	namespaces listersv1.NamespaceLister
	synced     func() bool
}

// New checks cfg; Run serves.
func New(cfg Config) (*Webhook, error) {
	if cfg.Client == nil {
		return nil, errors.New("requestwebhook: no client")
	}
	if cfg.ResourceName == "" {
		cfg.ResourceName = DefaultResourceName
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	f := informers.NewSharedInformerFactory(cfg.Client, 0)
	inf := f.Core().V1().Namespaces()
	w := &Webhook{
		cfg:        cfg,
		rules:      rules{policy: cfg.Policy, resource: cfg.ResourceName, request: !cfg.NoResourceRequest, gate: cfg.ReadinessGate, own: cfg.OwnNamespace},
		log:        cfg.Logger.With("component", "requestwebhook"),
		factory:    f,
		namespaces: inf.Lister(),
		synced:     inf.Informer().HasSynced,
	}
	return w, nil
}

// Run watches Namespaces and serves HTTPS on Addr until ctx ends. It does
// not fail: the webhook shares its process with the taint controller, which
// must go on removing taints whatever happens here. A listener that cannot
// be opened (the address taken) or that fails is opened again after
// RetryInterval, with an error logged each time; a missing certificate
// fails handshakes only, until it appears (see Serve).
func (w *Webhook) Run(ctx context.Context) error {
	w.factory.Start(ctx.Done())
	defer w.factory.Shutdown()
	for {
		ln, err := net.Listen("tcp", w.cfg.Addr)
		if err == nil {
			err = w.serve(ctx, ln)
		}
		if ctx.Err() != nil {
			return nil
		}
		w.log.Error("webhook not serving; retrying", "addr", w.cfg.Addr, "in", RetryInterval, "err", err)
		t := time.NewTimer(RetryInterval)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil
		case <-t.C:
		}
	}
}

// RetryInterval is how long Run waits before it opens its listener again.
var RetryInterval = 5 * time.Second

// Serve is Run on a listener of the caller's (closed when it returns),
// without the retry: it fails only when the listener does. It starts
// without the certificate files: handshakes fail (the API server then
// applies failurePolicy Ignore) until they appear, read on each handshake.
func (w *Webhook) Serve(ctx context.Context, ln net.Listener) error {
	w.factory.Start(ctx.Done())
	defer w.factory.Shutdown()
	return w.serve(ctx, ln)
}

func (w *Webhook) serve(ctx context.Context, ln net.Listener) error {
	certs := &certFiles{dir: w.cfg.CertDir, log: w.log}
	if _, err := certs.get(nil); err != nil {
		w.log.Warn("no serving certificate yet; handshakes fail until it appears", "err", err)
	}
	mux := http.NewServeMux()
	mux.Handle(Path, w)
	srv := &http.Server{
		Handler:           mux,
		ReadHeaderTimeout: 10 * time.Second,
		TLSConfig:         &tls.Config{MinVersion: tls.VersionTLS12, GetCertificate: certs.get},
		ErrorLog:          slog.NewLogLogger(w.log.Handler(), slog.LevelDebug),
	}
	w.log.Info("serving", "addr", ln.Addr().String(), "path", Path)
	done := make(chan error, 1)
	go func() { done <- srv.ServeTLS(ln, "", "") }()
	select {
	case err := <-done:
		return fmt.Errorf("requestwebhook: %w", err)
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	srv.Shutdown(sctx)
	<-done
	return nil
}

// ServeHTTP answers one AdmissionReview (admission/v1, JSON).
func (w *Webhook) ServeHTTP(rw http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodPost {
		http.Error(rw, "POST an AdmissionReview", http.StatusMethodNotAllowed)
		return
	}
	var review admissionv1.AdmissionReview
	if err := json.NewDecoder(io.LimitReader(r.Body, maxBody)).Decode(&review); err != nil || review.Request == nil {
		http.Error(rw, "not an AdmissionReview", http.StatusBadRequest)
		return
	}
	out := admissionv1.AdmissionReview{
		TypeMeta: metav1.TypeMeta{APIVersion: "admission.k8s.io/v1", Kind: "AdmissionReview"},
		Response: w.review(r.Context(), review.Request),
	}
	rw.Header().Set("Content-Type", "application/json")
	json.NewEncoder(rw).Encode(out)
}

// review is always allowed: the answer is only whether a patch comes with
// it (see the package doc).
func (w *Webhook) review(ctx context.Context, req *admissionv1.AdmissionRequest) *admissionv1.AdmissionResponse {
	resp := &admissionv1.AdmissionResponse{UID: req.UID, Allowed: true}
	if req.Resource.Group != "" || req.Resource.Resource != "pods" || req.SubResource != "" || req.Operation != admissionv1.Create {
		return resp
	}
	var pod corev1.Pod
	if err := json.Unmarshal(req.Object.Raw, &pod); err != nil {
		w.log.Warn("pod not decoded; admitted unchanged", "namespace", req.Namespace, "err", err)
		return resp
	}
	// At creation the pod's namespace may only be the request's.
	if pod.Namespace == "" {
		pod.Namespace = req.Namespace
	}
	name := pod.Name
	if name == "" {
		name = pod.GenerateName + "*"
	}
	log := w.log.With("pod", pod.Namespace+"/"+name)
	skip, decided := w.rules.skip(&pod)
	if skip {
		return resp
	}
	var ns *corev1.Namespace
	if !decided {
		var err error
		if ns, err = w.namespace(ctx, pod.Namespace); err != nil {
			log.Warn("namespace not read; admitted unchanged (the CNI still fails it closed on a node that is not ready)", "err", err)
			resp.Warnings = []string{"inpod: namespace not read, " + w.missed(&pod)}
			return resp
		}
	}
	if !w.rules.wants(&pod, ns) {
		return resp
	}
	patch, err := w.rules.patch(&pod)
	if err != nil || patch == nil {
		if err != nil {
			log.Warn("patch not built; admitted unchanged", "err", err)
		}
		return resp
	}
	pt := admissionv1.PatchTypeJSONPatch
	resp.Patch, resp.PatchType = patch, &pt
	log.Debug("pod patched", "request", w.rules.wantsRequest(&pod), "container", pod.Spec.Containers[0].Name, "readinessGate", w.rules.wantsGate(&pod))
	return resp
}

// missed says what an enrolled pod admitted unchanged goes without.
func (w *Webhook) missed(pod *corev1.Pod) string {
	var s []string
	if w.rules.wantsRequest(pod) {
		s = append(s, "no "+string(w.cfg.ResourceName)+" request added")
	}
	if w.rules.wantsGate(pod) {
		s = append(s, "no readiness gate "+string(ReadinessGate)+" added")
	}
	return strings.Join(s, ", ")
}

// namespace reads ns from the watch, or from the API when the watch has
// not seen it (not synced yet, or a namespace created a moment ago).
func (w *Webhook) namespace(ctx context.Context, name string) (*corev1.Namespace, error) {
	if w.synced() {
		ns, err := w.namespaces.Get(name)
		if err == nil {
			return ns, nil
		}
		if !apierrors.IsNotFound(err) {
			return nil, err
		}
	}
	ctx, cancel := context.WithTimeout(ctx, namespaceReadTimeout)
	defer cancel()
	return w.cfg.Client.CoreV1().Namespaces().Get(ctx, name, metav1.GetOptions{})
}
