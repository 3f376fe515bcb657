package plugin

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"os"
	"strings"
	"time"
)

// Istio's enrollment labels.
const (
	DataplaneModeLabel = "istio.io/dataplane-mode"
	DataplaneAmbient   = "ambient"
	DataplaneNone      = "none"
)

// APIAccess is the file the agent writes for the plugin: where the API
// server is and how to authenticate, with a token that may only read pods
// and namespaces. It is JSON (not a kubeconfig) so the plugin needs neither
// client-go nor a YAML parser.
type APIAccess struct {
	Server string `json:"server"`
	CAData []byte `json:"caData"`
	Token  string `json:"token"`
}

// decideFromAPI decides enrollment when the agent is unreachable by reading
// the pod's and namespace's labels from the API server, with the same rules
// as the agent: the pod's own label wins, "none" opts out, otherwise the
// namespace's label decides.
func decideFromAPI(conf *Config, k k8sArgs) (bool, string, error) {
	if conf.APIAccess == "" {
		return false, "", errors.New("no apiAccess file configured")
	}
	data, err := os.ReadFile(conf.APIAccess)
	if err != nil {
		return false, "", err
	}
	var access APIAccess
	if err := json.Unmarshal(data, &access); err != nil {
		return false, "", fmt.Errorf("%s: %v", conf.APIAccess, err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	podLabels, err := access.labels(ctx, "/api/v1/namespaces/"+url.PathEscape(k.Namespace)+"/pods/"+url.PathEscape(k.Name))
	if err != nil {
		return false, "", err
	}
	switch podLabels[DataplaneModeLabel] {
	case DataplaneAmbient:
		return true, "pod label " + DataplaneModeLabel + "=" + DataplaneAmbient, nil
	case DataplaneNone:
		return false, "", nil
	}
	nsLabels, err := access.labels(ctx, "/api/v1/namespaces/"+url.PathEscape(k.Namespace))
	if err != nil {
		return false, "", err
	}
	if nsLabels[DataplaneModeLabel] == DataplaneAmbient {
		return true, "namespace label " + DataplaneModeLabel + "=" + DataplaneAmbient, nil
	}
	return false, "", nil
}

// labels GETs one object's labels. It speaks HTTP/1.0 over crypto/tls by
// hand rather than through net/http: net/http's package initialisation
// alone costs the plugin about half a millisecond on every exec, on the hot
// path of every pod start, for a request made only while the agent is down.
// HTTP/1.0 keeps the reply simple: no chunking, the body ends with the
// connection.
func (a *APIAccess) labels(ctx context.Context, path string) (map[string]string, error) {
	u, err := url.Parse(a.Server)
	if err != nil || u.Scheme != "https" || u.Host == "" {
		return nil, fmt.Errorf("apiAccess server %q is not an https URL", a.Server)
	}
	pool := x509.NewCertPool()
	if len(a.CAData) > 0 && !pool.AppendCertsFromPEM(a.CAData) {
		return nil, errors.New("apiAccess caData holds no certificate")
	}
	host := u.Host
	if u.Port() == "" {
		host = net.JoinHostPort(u.Hostname(), "443")
	}
	d := tls.Dialer{Config: &tls.Config{RootCAs: pool, ServerName: u.Hostname(), MinVersion: tls.VersionTLS12, NextProtos: []string{"http/1.1"}}}
	conn, err := d.DialContext(ctx, "tcp", host)
	if err != nil {
		return nil, fmt.Errorf("API server: %w", err)
	}
	defer conn.Close()
	if deadline, ok := ctx.Deadline(); ok {
		conn.SetDeadline(deadline)
	}
	fmt.Fprintf(conn, "GET %s HTTP/1.0\r\nHost: %s\r\nAuthorization: Bearer %s\r\nAccept: application/json\r\nUser-Agent: inpod-cni\r\n\r\n",
		strings.TrimSuffix(u.Path, "/")+path, u.Host, a.Token)
	r := bufio.NewReader(io.LimitReader(conn, 4<<20))
	status, err := r.ReadString('\n')
	if err != nil {
		return nil, fmt.Errorf("API server: read status: %w", err)
	}
	fields := strings.Fields(status)
	if len(fields) < 2 || !strings.HasPrefix(fields[0], "HTTP/") {
		return nil, fmt.Errorf("API server: malformed status line %q", strings.TrimSpace(status))
	}
	for {
		line, err := r.ReadString('\n')
		if err != nil {
			return nil, fmt.Errorf("API server: read headers: %w", err)
		}
		if strings.EqualFold(strings.TrimSpace(line), "transfer-encoding: chunked") {
			return nil, errors.New("API server: chunked reply to an HTTP/1.0 request")
		}
		if line == "\r\n" || line == "\n" {
			break
		}
	}
	body, err := io.ReadAll(r)
	if err != nil {
		return nil, fmt.Errorf("API server: read body: %w", err)
	}
	if fields[1] != "200" {
		return nil, fmt.Errorf("API server: GET %s: %s", path, strings.Join(fields[1:], " "))
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
