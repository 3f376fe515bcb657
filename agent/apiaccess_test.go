package agent

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"path/filepath"
	"sync"
	"testing"
	"time"

	authv1 "k8s.io/api/authentication/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"

	"github.com/inpod-dev/inpod/apiaccess"
	"github.com/inpod-dev/inpod/internal/testkit"
)

// fakeTokens plays the TokenRequest API, failing while down is set.
type fakeTokens struct {
	mu       sync.Mutex
	down     bool
	issued   int
	requests []*authv1.TokenRequest
	names    []string
}

func (f *fakeTokens) CreateToken(_ context.Context, sa string, req *authv1.TokenRequest, _ metav1.CreateOptions) (*authv1.TokenRequest, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.requests, f.names = append(f.requests, req), append(f.names, sa)
	if f.down {
		return nil, errors.New("connection refused")
	}
	f.issued++
	out := req.DeepCopy()
	out.Status = authv1.TokenRequestStatus{Token: "token-" + string(rune('0'+f.issued)),
		ExpirationTimestamp: metav1.NewTime(time.Now().Add(time.Duration(*req.Spec.ExpirationSeconds) * time.Second))}
	return out, nil
}

func (f *fakeTokens) setDown(down bool) { f.mu.Lock(); f.down = down; f.mu.Unlock() }

type countingObserver struct {
	mu       sync.Mutex
	renewed  int
	failures int
}

func (o *countingObserver) PluginTokenRenewed(time.Time) { o.mu.Lock(); o.renewed++; o.mu.Unlock() }
func (o *countingObserver) PluginTokenRenewalFailed()    { o.mu.Lock(); o.failures++; o.mu.Unlock() }
func (o *countingObserver) counts() (int, int) {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.renewed, o.failures
}

func newTestCredential(t *testing.T, tokens tokenRequester, obs credentialObserver) *pluginCredential {
	return &pluginCredential{
		tokens: tokens, serviceAccount: "inpod-cni",
		rest:  &rest.Config{Host: "https://10.0.0.1:6443", TLSClientConfig: rest.TLSClientConfig{CAData: []byte("-----BEGIN CERTIFICATE-----\n")}},
		path:  filepath.Join(t.TempDir(), "net.d", apiaccess.FileName),
		label: "mesh.example.com/mode", log: slog.New(slog.NewTextHandler(io.Discard, nil)), observer: obs,
		renewal: 30 * time.Millisecond, retryMin: 5 * time.Millisecond, retryMax: 20 * time.Millisecond,
	}
}

func runCredential(t *testing.T, c *pluginCredential) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { c.run(ctx); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
}

func readToken(path string) string {
	a, err := apiaccess.Read(path)
	if err != nil {
		return ""
	}
	return a.Token
}

// The file carries a token of the plugin's ServiceAccount, bound to nothing,
// with the lifetime asked for, and is renewed well before it expires.
func TestPluginCredentialRequestsAnUnboundTokenAndRenewsIt(t *testing.T) {
	tokens, obs := &fakeTokens{}, &countingObserver{}
	c := newTestCredential(t, tokens, obs)
	runCredential(t, c)
	testkit.Eventually(t, 5*time.Second, "a renewed token in the file", func() bool { return readToken(c.path) == "token-2" })
	a, err := apiaccess.Read(c.path)
	if err != nil {
		t.Fatal(err)
	}
	if a.Server != "https://10.0.0.1:6443" || string(a.CAData) != "-----BEGIN CERTIFICATE-----\n" || a.EnrollmentLabel != "mesh.example.com/mode" {
		t.Fatalf("access file: %+v", a)
	}
	if left := time.Until(a.Expires); left < 23*time.Hour || left > 25*time.Hour {
		t.Fatalf("the token expires in %s, want about a day", left)
	}
	tokens.mu.Lock()
	req, name := tokens.requests[0], tokens.names[0]
	tokens.mu.Unlock()
	if name != "inpod-cni" || req.Spec.BoundObjectRef != nil || *req.Spec.ExpirationSeconds != int64(pluginTokenLifetime/time.Second) {
		t.Fatalf("token request for %q: %+v; want inpod-cni, unbound, %s", name, req.Spec, pluginTokenLifetime)
	}
}

// A failed renewal leaves the valid token in place, is counted, and is
// retried until the API server answers again; with no API server at start
// there is no file until the first token arrives.
func TestPluginCredentialKeepsTheOldTokenWhileRenewalFails(t *testing.T) {
	tokens, obs := &fakeTokens{down: true}, &countingObserver{}
	c := newTestCredential(t, tokens, obs)
	runCredential(t, c)
	testkit.Eventually(t, 5*time.Second, "failed requests counted", func() bool { _, f := obs.counts(); return f >= 2 })
	if readToken(c.path) != "" {
		t.Fatal("a file without a token from the API server")
	}
	tokens.setDown(false)
	testkit.Eventually(t, 5*time.Second, "the first token once the API server answers", func() bool { return readToken(c.path) == "token-1" })
	tokens.setDown(true)
	_, before := obs.counts()
	testkit.Eventually(t, 5*time.Second, "renewals failing", func() bool { _, f := obs.counts(); return f >= before+3 })
	if got := readToken(c.path); got != "token-1" {
		t.Fatalf("the file holds %q while renewals fail, want the still valid token-1", got)
	}
	tokens.setDown(false)
	testkit.Eventually(t, 5*time.Second, "renewal after the outage", func() bool { return readToken(c.path) == "token-2" })
}
