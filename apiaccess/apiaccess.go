// Package apiaccess is the file through which the node agent gives the
// plugin's agent-down check (inpod-cni-apicheck) its way to the API server:
// the format, the agent's writer and the check's reader, in one place so the
// two sides cannot drift apart.
//
// It is a leaf: the check's small binary links it, so it imports nothing of
// inpod but internal/atomicfile, and no client-go.
package apiaccess

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"time"

	"github.com/inpod-dev/inpod/internal/atomicfile"
)

// FileName is the file's name in the CNI conf dir. That dir survives a
// reboot, so pods that are not enrolled can start before the agent does. The
// name has no CNI extension (.conf, .conflist, .json): runtimes would try to
// load the file as a network configuration.
const FileName = "inpod-api-access"

// Access is what the check needs: where the API server is and a token that
// may only get pods and namespaces, requested by the agent for the plugin's
// own ServiceAccount and not bound to the agent's pod. It is JSON rather
// than a kubeconfig so the check needs neither client-go nor a YAML parser.
type Access struct {
	Server string `json:"server"`
	CAData []byte `json:"caData"`
	Token  string `json:"token"`
	// Expires is when Token stops being accepted (zero: unknown). The
	// check still asks the API server with an expired token (the node's
	// clock may be wrong); it only uses Expires to explain a 401.
	Expires time.Time `json:"expires,omitzero"`
	// EnrollmentLabel is the agent's --enrollment-label (empty: Istio's).
	EnrollmentLabel string `json:"enrollmentLabel,omitempty"`
}

// Validate reports the first field that makes a unusable.
func (a *Access) Validate() error {
	u, err := url.Parse(a.Server)
	if err != nil || u.Scheme != "https" || u.Host == "" {
		return fmt.Errorf("field \"server\" is %q, want an https URL", a.Server)
	}
	if a.Token == "" {
		return fmt.Errorf("field \"token\" is empty")
	}
	return nil
}

// Read reads and validates the file at path.
func Read(path string) (*Access, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var a Access
	if err := json.Unmarshal(data, &a); err != nil {
		return nil, fmt.Errorf("%s: %v", path, err)
	}
	if err := a.Validate(); err != nil {
		return nil, fmt.Errorf("%s: %v", path, err)
	}
	return &a, nil
}

// Write replaces the file at path with a, mode 0600 (it holds a token),
// atomically so the check never reads half a file; an identical file is left
// alone. It creates the directory if needed.
func Write(path string, a *Access) (changed bool, err error) {
	if err := a.Validate(); err != nil {
		return false, fmt.Errorf("%s: %v", path, err)
	}
	data, err := json.Marshal(a)
	if err != nil {
		return false, err
	}
	if have, err := os.ReadFile(path); err == nil && bytes.Equal(have, data) {
		return false, nil
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return false, err
	}
	if err := atomicfile.Write(path, data, 0o600); err != nil {
		return false, err
	}
	return true, nil
}
