// Package apicheck decides a pod's enrollment from the Kubernetes API server
// for inpod-cni while the node agent cannot be reached.
//
// It lives in its own small binary, inpod-cni-apicheck, which the plugin
// execs only in that case: TLS and HTTP would otherwise be linked into the
// plugin and their initialisation paid on every pod start on the node, for a
// request made only while the agent is away.
//
// The contract with the plugin: run
//
//	inpod-cni-apicheck --access FILE --namespace NS --name POD
//
// and read one Verdict as JSON on stdout when it exits 0; any other exit
// means enrollment could not be decided, with the reason on stderr.
package apicheck

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/inpod-dev/inpod/apiaccess"
)

// Istio's enrollment label and values; the agent may name another label
// (apiaccess.Access.EnrollmentLabel), the values stay Istio's.
const (
	DataplaneModeLabel = "istio.io/dataplane-mode"
	DataplaneAmbient   = "ambient"
	DataplaneNone      = "none"
)

// Verdict is the answer.
type Verdict struct {
	Enrolled bool `json:"enrolled"`
	// Reason names the label that enrolled the pod.
	Reason string `json:"reason,omitempty"`
}

// Decide applies the agent's rules to the pod's and its namespace's labels:
// the pod's own label wins, "none" opts out, otherwise the namespace's label
// decides.
func Decide(ctx context.Context, a *apiaccess.Access, namespace, name string) (Verdict, error) {
	c, err := newClient(a)
	if err != nil {
		return Verdict{}, err
	}
	label := a.EnrollmentLabel
	if label == "" {
		label = DataplaneModeLabel
	}
	podLabels, err := c.labels(ctx, "/api/v1/namespaces/"+url.PathEscape(namespace)+"/pods/"+url.PathEscape(name))
	if err != nil {
		return Verdict{}, explain(err, a, time.Now())
	}
	switch podLabels[label] {
	case DataplaneAmbient:
		return Verdict{Enrolled: true, Reason: "pod label " + label + "=" + DataplaneAmbient}, nil
	case DataplaneNone:
		return Verdict{}, nil
	}
	nsLabels, err := c.labels(ctx, "/api/v1/namespaces/"+url.PathEscape(namespace))
	if err != nil {
		return Verdict{}, explain(err, a, time.Now())
	}
	if nsLabels[label] == DataplaneAmbient {
		return Verdict{Enrolled: true, Reason: "namespace label " + label + "=" + DataplaneAmbient}, nil
	}
	return Verdict{}, nil
}

// explain adds what the access file knows to a refusal: a token past its
// expiry means the agent has not renewed it, which is the thing to fix.
func explain(err error, a *apiaccess.Access, now time.Time) error {
	var refused *statusError
	if errors.As(err, &refused) && refused.code == http.StatusUnauthorized && !a.Expires.IsZero() && now.After(a.Expires) {
		return fmt.Errorf("%w (the access file's token expired at %s: the inpod agent has not renewed it since)", err, a.Expires.UTC().Format(time.RFC3339))
	}
	return err
}

// statusError is an answer of the API server other than 200.
type statusError struct {
	path    string
	code    int
	message string
}

func (e *statusError) Error() string {
	return fmt.Sprintf("API server: GET %s: %d: %s", e.path, e.code, e.message)
}

type client struct {
	http   *http.Client
	server string
	token  string
}

func newClient(a *apiaccess.Access) (*client, error) {
	pool := x509.NewCertPool()
	if len(a.CAData) > 0 && !pool.AppendCertsFromPEM(a.CAData) {
		return nil, errors.New("access file: field \"caData\" holds no PEM certificate")
	}
	transport := &http.Transport{
		TLSClientConfig:     &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12},
		TLSHandshakeTimeout: 5 * time.Second,
		Proxy:               nil, // node-local traffic to the API server; a proxy in the runtime's env must not apply
	}
	return &client{
		http:   &http.Client{Transport: transport},
		server: strings.TrimSuffix(a.Server, "/"),
		token:  a.Token,
	}, nil
}

// labels GETs one object's labels.
func (c *client) labels(ctx context.Context, path string) (map[string]string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, c.server+path, nil)
	if err != nil {
		return nil, err
	}
	req.Header.Set("Authorization", "Bearer "+c.token)
	req.Header.Set("Accept", "application/json")
	req.Header.Set("User-Agent", "inpod-cni-apicheck")
	resp, err := c.http.Do(req)
	if err != nil {
		return nil, fmt.Errorf("API server: %w", err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 4<<20))
	if err != nil {
		return nil, fmt.Errorf("API server: GET %s: read body: %w", path, err)
	}
	if resp.StatusCode != http.StatusOK {
		var status struct {
			Message string `json:"message"`
		}
		json.Unmarshal(body, &status)
		if status.Message == "" {
			status.Message = http.StatusText(resp.StatusCode)
		}
		return nil, &statusError{path: path, code: resp.StatusCode, message: status.Message}
	}
	var obj struct {
		Metadata struct {
			Labels map[string]string `json:"labels"`
		} `json:"metadata"`
	}
	if err := json.Unmarshal(body, &obj); err != nil {
		return nil, fmt.Errorf("API server: GET %s: %v", path, err)
	}
	return obj.Metadata.Labels, nil
}
