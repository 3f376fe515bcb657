package plugin

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/inpod-dev/inpod/cnievent"
)

// decideFromAPI decides enrollment while the agent is unreachable by running
// inpod-cni-apicheck (package plugin/apicheck), which reads the pod's and
// namespace's labels from the API server. It is a separate binary so that
// TLS and HTTP stay out of this one, which every pod start execs.
func decideFromAPI(conf *Config, k k8sArgs, cniPath string) (enrolled bool, why string, err error) {
	if conf.APIAccess == "" {
		return false, "", errors.New("no apiAccess file configured")
	}
	bin, err := findInPath(cnievent.APICheckBinary, cniPath)
	if err != nil {
		return false, "", err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, "--access", conf.APIAccess, "--namespace", k.Namespace, "--name", k.Name, "--timeout", "8s")
	// A clean environment: nothing from the runtime's (proxies, INPOD_*
	// overrides) may change how the check runs.
	cmd.Env = []string{}
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		msg := strings.TrimSpace(stderr.String())
		if msg == "" {
			msg = err.Error()
		}
		return false, "", errors.New(msg)
	}
	var v struct {
		Enrolled bool   `json:"enrolled"`
		Reason   string `json:"reason"`
	}
	if err := json.Unmarshal(stdout.Bytes(), &v); err != nil {
		return false, "", fmt.Errorf("%s printed no verdict: %v", cnievent.APICheckBinary, err)
	}
	return v.Enrolled, v.Reason, nil
}

// findInPath looks for a binary in CNI_PATH, where the runtime looks for
// plugins and where the agent installs both. Not libcni's
// invoke.FindInPath: that package would link OpenTelemetry, gzip and
// multipart into a binary exec'ed for every pod.
func findInPath(name, cniPath string) (string, error) {
	for _, dir := range filepath.SplitList(cniPath) {
		p := filepath.Join(dir, name)
		if fi, err := os.Stat(p); err == nil && fi.Mode().IsRegular() && fi.Mode().Perm()&0o111 != 0 {
			return p, nil
		}
	}
	return "", fmt.Errorf("%s not found in CNI_PATH %q", name, cniPath)
}
