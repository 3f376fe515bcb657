package plugin

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
	"os"
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
	client, err := access.client()
	if err != nil {
		return false, "", err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	podLabels, err := access.labels(ctx, client, "/api/v1/namespaces/"+url.PathEscape(k.Namespace)+"/pods/"+url.PathEscape(k.Name))
	if err != nil {
		return false, "", err
	}
	switch podLabels[DataplaneModeLabel] {
	case DataplaneAmbient:
		return true, "pod label " + DataplaneModeLabel + "=" + DataplaneAmbient, nil
	case DataplaneNone:
		return false, "", nil
	}
	nsLabels, err := access.labels(ctx, client, "/api/v1/namespaces/"+url.PathEscape(k.Namespace))
	if err != nil {
		return false, "", err
	}
	if nsLabels[DataplaneModeLabel] == DataplaneAmbient {
		return true, "namespace label " + DataplaneModeLabel + "=" + DataplaneAmbient, nil
	}
	return false, "", nil
}

func (a *APIAccess) client() (*http.Client, error) {
	pool := x509.NewCertPool()
	if len(a.CAData) > 0 && !pool.AppendCertsFromPEM(a.CAData) {
		return nil, errors.New("apiAccess caData holds no certificate")
	}
	return &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}}}, nil
}

func (a *APIAccess) labels(ctx context.Context, c *http.Client, path string) (map[string]string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, a.Server+path, nil)
	if err != nil {
		return nil, err
	}
	req.Header.Set("Authorization", "Bearer "+a.Token)
	req.Header.Set("Accept", "application/json")
	resp, err := c.Do(req)
	if err != nil {
		return nil, fmt.Errorf("API server: %w", err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 4<<20))
	if err != nil {
		return nil, err
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("API server: GET %s: %s", path, resp.Status)
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
