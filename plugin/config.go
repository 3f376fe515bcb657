// Package plugin is the inpod-cni chained CNI plugin: it runs last in the
// node's primary conflist, tells the node agent about every Kubernetes pod
// and returns the previous plugins' result unchanged. An enrolled pod's ADD
// succeeds only once the agent reports its redirection in place; a pod that
// is not enrolled passes straight through, also while the agent is down.
//
// The package must stay small (it is exec'ed once per pod start): it does
// not import client-go or the agent.
package plugin

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/containernetworking/cni/pkg/types"

	"github.com/inpod-dev/inpod/cnievent"
)

// PluginType is the plugin's name in a conflist.
const PluginType = cnievent.PluginBinary

// Config is the plugin's entry in the conflist, plus what the runtime adds.
type Config struct {
	CNIVersion    string          `json:"cniVersion"`
	Name          string          `json:"name"`
	Type          string          `json:"type"`
	Capabilities  map[string]bool `json:"capabilities,omitempty"`
	RuntimeConfig json.RawMessage `json:"runtimeConfig,omitempty"`
	Args          json.RawMessage `json:"args,omitempty"`
	PrevResult    json.RawMessage `json:"prevResult,omitempty"`

	ValidAttachments []types.GCAttachment `json:"cni.dev/valid-attachments,omitempty"`
	// Attachments is what libcni passes on GC (spec 1.1.0).
	Attachments json.RawMessage `json:"cni.dev/attachments,omitempty"`

	// AgentSocket is the agent's event socket.
	AgentSocket string `json:"agentSocket,omitempty"`
	// Timeout bounds the wait for the agent on ADD (a Go duration).
	Timeout string `json:"timeout,omitempty"`
	// ExcludeNamespaces are never enrolled; the plugin passes them without
	// asking anybody.
	ExcludeNamespaces []string `json:"excludeNamespaces,omitempty"`
	// APIAccess is a file (written by the agent) with the API server's
	// address and credentials, used only to decide enrollment while the
	// agent cannot be reached.
	APIAccess string `json:"apiAccess,omitempty"`
	// PassList is the agent's list of pods it knows are not enrolled
	// (package passlist); their ADD passes without asking the agent.
	PassList string `json:"passList,omitempty"`

	timeout time.Duration
}

// ParseConfig reads the plugin's configuration strictly: an unknown field
// or a malformed value is an error naming it.
func ParseConfig(data []byte) (*Config, error) {
	var c Config
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&c); err != nil {
		return nil, fmt.Errorf("inpod-cni: invalid network configuration: %s", describeJSONError(err))
	}
	if c.Type != PluginType {
		return nil, fmt.Errorf("inpod-cni: invalid network configuration: field \"type\" is %q, want %q", c.Type, PluginType)
	}
	if c.CNIVersion == "" {
		return nil, errors.New("inpod-cni: invalid network configuration: field \"cniVersion\" is required")
	}
	if c.AgentSocket == "" {
		c.AgentSocket = cnievent.DefaultSocketPath
	}
	c.timeout = cnievent.Deadline
	if c.Timeout != "" {
		d, err := time.ParseDuration(c.Timeout)
		if err != nil || d <= 0 {
			return nil, fmt.Errorf("inpod-cni: invalid network configuration: field \"timeout\" is %q, want a positive duration such as 30s", c.Timeout)
		}
		c.timeout = d
	}
	return &c, nil
}

func describeJSONError(err error) string {
	var typeErr *json.UnmarshalTypeError
	if errors.As(err, &typeErr) {
		return fmt.Sprintf("field %q has the wrong type (%s, want %s)", typeErr.Field, typeErr.Value, typeErr.Type)
	}
	msg := err.Error()
	if strings.HasPrefix(msg, "json: unknown field ") {
		return "unknown field " + strings.TrimPrefix(msg, "json: unknown field ")
	}
	return msg
}

func (c *Config) excluded(namespace string) bool {
	return slices.Contains(c.ExcludeNamespaces, namespace)
}

// k8sArgs are the pod identity the runtime passes in CNI_ARGS.
type k8sArgs struct {
	Namespace, Name, UID, InfraContainerID string
}

// parseK8sArgs reads CNI_ARGS ("K=V;K=V"). Values are not trusted beyond
// naming the pod: the agent checks them against its own view.
func parseK8sArgs(args string) (k8sArgs, error) {
	var k k8sArgs
	if args == "" {
		return k, nil
	}
	for _, kv := range strings.Split(args, ";") {
		key, value, ok := strings.Cut(kv, "=")
		if !ok {
			return k, fmt.Errorf("inpod-cni: malformed CNI_ARGS element %q (want KEY=VALUE)", kv)
		}
		switch key {
		case "K8S_POD_NAMESPACE":
			k.Namespace = value
		case "K8S_POD_NAME":
			k.Name = value
		case "K8S_POD_UID":
			k.UID = value
		case "K8S_POD_INFRA_CONTAINER_ID":
			k.InfraContainerID = value
		}
	}
	return k, nil
}
