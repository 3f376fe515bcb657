package agent

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"time"

	"k8s.io/client-go/rest"

	"github.com/inpod-dev/inpod/internal/atomicfile"
	"github.com/inpod-dev/inpod/plugin/apicheck"
)

// apiAccessFile lives in the CNI conf dir, which survives a reboot, so pods
// that are not enrolled can start before the agent does. It has no CNI
// extension (.conf, .conflist, .json): runtimes would try to load it as a
// network configuration.
const apiAccessFile = "inpod-api-access"

// apiAccess keeps the file that the plugin's agent-down check
// (inpod-cni-apicheck) reads in step with the agent's own credentials: the
// API server, its CA and the agent's token, which may only read pods and
// namespaces. The file is 0600 and never read by runtimes (not a CNI
// extension).
type apiAccess struct {
	rest *rest.Config
	path string
	// label is the agent's enrollment label, which the check applies.
	label string
}

// write brings the file up to date, writing only when it changed.
func (w apiAccess) write() (changed bool, err error) {
	token := w.rest.BearerToken
	// The file, when there is one, is the current token: the kubelet
	// rotates projected service-account tokens in place.
	if w.rest.BearerTokenFile != "" {
		data, err := os.ReadFile(w.rest.BearerTokenFile)
		if err != nil {
			return false, err
		}
		token = string(bytes.TrimSpace(data))
	}
	if token == "" {
		return false, errors.New("the agent authenticates without a bearer token")
	}
	ca := w.rest.CAData
	if len(ca) == 0 && w.rest.CAFile != "" {
		data, err := os.ReadFile(w.rest.CAFile)
		if err != nil {
			return false, err
		}
		ca = data
	}
	data, err := json.Marshal(apicheck.Access{Server: w.rest.Host, CAData: ca, Token: token, EnrollmentLabel: w.label})
	if err != nil {
		return false, err
	}
	if have, err := os.ReadFile(w.path); err == nil && bytes.Equal(have, data) {
		return false, nil
	}
	if err := os.MkdirAll(filepath.Dir(w.path), 0o755); err != nil {
		return false, err
	}
	if err := atomicfile.Write(w.path, data, 0o600); err != nil {
		return false, err
	}
	return true, nil
}

// follow rewrites the file every interval when the token (or CA) changed,
// so the agent-down check never holds an expired token.
func (w apiAccess) follow(ctx context.Context, log *slog.Logger, every time.Duration) {
	tick := time.NewTicker(every)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
			changed, err := w.write()
			switch {
			case err != nil:
				log.Warn("could not refresh the plugin's API access file; its agent-down check may hold an expired token", "err", err)
			case changed:
				log.Info("refreshed the plugin's API access file (rotated credentials)", "file", w.path)
			}
		}
	}
}
