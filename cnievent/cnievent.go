// Package cnievent is the small request/response the inpod-cni plugin sends
// to the node agent over its unix socket: one JSON request, one JSON reply,
// then the connection closes. It is a leaf shared by the plugin (which must
// stay small) and the agent's server.
package cnievent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"time"
)

// DefaultSocketPath is where the agent listens.
const DefaultSocketPath = "/var/run/inpod/cni.sock"

// The binaries the agent installs in the CNI bin dir: the plugin, and the
// companion it runs to decide enrollment from the API server while the agent
// is unreachable.
const (
	PluginBinary   = "inpod-cni"
	APICheckBinary = "inpod-cni-apicheck"
)

// MaxMessageSize bounds a request or a reply; anything larger is refused.
const MaxMessageSize = 64 << 10

// MaxIPs bounds the IPs of one request: Kubernetes gives a pod one per
// family, and the agent refuses more.
const MaxIPs = 16

// Command is the CNI operation the event reports.
type Command string

const (
	Add   Command = "ADD"
	Del   Command = "DEL"
	Check Command = "CHECK"
)

// Request describes one pod's network attachment.
type Request struct {
	Command      Command  `json:"command"`
	PodNamespace string   `json:"podNamespace"`
	PodName      string   `json:"podName"`
	PodUID       string   `json:"podUID,omitempty"`
	ContainerID  string   `json:"containerID"`
	Netns        string   `json:"netns,omitempty"`
	IfName       string   `json:"ifName,omitempty"`
	IPs          []string `json:"ips,omitempty"`
}

// Pod names the pod for messages.
func (r *Request) Pod() string { return r.PodNamespace + "/" + r.PodName }

// Outcome is the agent's verdict.
type Outcome string

const (
	// Redirected: the pod is enrolled and its redirection is in place
	// (ADD), verified (CHECK) or removed (DEL).
	Redirected Outcome = "redirected"
	// NotEnrolled: the pod is not in the mesh; the plugin passes it through.
	NotEnrolled Outcome = "not-enrolled"
	// Failed: the pod is enrolled and the operation failed; Message says why.
	Failed Outcome = "failed"
)

// Response is the agent's answer.
type Response struct {
	Outcome Outcome `json:"outcome"`
	Message string  `json:"message,omitempty"`
}

// ErrUnreachable wraps failures to reach the agent at all (no socket,
// refused, timed out before a reply), as opposed to an answer.
var ErrUnreachable = errors.New("inpod agent unreachable")

// Send delivers req to the agent at socket and returns its answer.
func Send(ctx context.Context, socket string, req *Request) (*Response, error) {
	// Encoded before connecting, so the whole request is there when the
	// agent accepts and it answers without waiting on the plugin.
	body, err := json.Marshal(req)
	if err != nil {
		return nil, err
	}
	if len(body) > MaxMessageSize {
		return nil, fmt.Errorf("request for %s is %d bytes, over the %d limit", req.Pod(), len(body), MaxMessageSize)
	}
	var d net.Dialer
	c, err := d.DialContext(ctx, "unix", socket)
	if err != nil {
		return nil, fmt.Errorf("%w at %s: %v", ErrUnreachable, socket, err)
	}
	defer c.Close()
	if deadline, ok := ctx.Deadline(); ok {
		c.SetDeadline(deadline)
	}
	if _, err := c.Write(body); err != nil {
		return nil, fmt.Errorf("%w: send to %s: %v", ErrUnreachable, socket, err)
	}
	// Half-close: the server reads the request to EOF.
	if uc, ok := c.(*net.UnixConn); ok {
		uc.CloseWrite()
	}
	data, err := io.ReadAll(io.LimitReader(c, MaxMessageSize+1))
	if err != nil {
		if errors.Is(err, context.DeadlineExceeded) || isTimeout(err) {
			return nil, fmt.Errorf("%w: no answer from %s in time", ErrUnreachable, socket)
		}
		return nil, fmt.Errorf("%w: read from %s: %v", ErrUnreachable, socket, err)
	}
	if len(data) == 0 {
		return nil, fmt.Errorf("%w: %s closed the connection without an answer", ErrUnreachable, socket)
	}
	var resp Response
	if err := json.Unmarshal(data, &resp); err != nil || len(data) > MaxMessageSize {
		return nil, fmt.Errorf("undecodable answer from the agent (%d bytes): %v", len(data), err)
	}
	switch resp.Outcome {
	case Redirected, NotEnrolled, Failed:
		return &resp, nil
	}
	return nil, fmt.Errorf("agent answered with unknown outcome %q", resp.Outcome)
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

// Deadline is how long the plugin waits for an ADD by default: long enough
// for rules plus ztunnel's ack on a loaded node, short of the kubelet's own
// CNI timeout so the runtime sees a clear error instead of its own.
const Deadline = 60 * time.Second
