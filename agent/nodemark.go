package agent

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
)

// NodeInstalledLabel marks a Node whose runtime chain holds inpod-cni: set
// by the agent once it has installed the plugin, removed when it removes
// inpod from the node, and kept while the agent is away (the plugin stays
// then too). The uninstall hook finds by it every node that still chains
// inpod, including one whose agent is gone without cleaning it (moved off
// the DaemonSet while it was down, killed during its removal), which no
// agent pod names.
const NodeInstalledLabel = "inpod.dev/cni-installed"

// nodeMark writes NodeInstalledLabel on the agent's Node: once after the
// plugin is first installed (retried with back-off until it lands, so an
// API server outage at start only delays it), and off at removal. One
// patch per agent start: the label is not re-asserted if someone removes
// it, which keeps a node's agents from reading their Node in a loop.
type nodeMark struct {
	client kubernetes.Interface
	node   string
	log    *slog.Logger
	wanted chan struct{}
}

func newNodeMark(client kubernetes.Interface, node string, log *slog.Logger) *nodeMark {
	return &nodeMark{client: client, node: node, log: log, wanted: make(chan struct{}, 1)}
}

// installed asks for the label; it never blocks.
func (m *nodeMark) installed() {
	select {
	case m.wanted <- struct{}{}:
	default:
	}
}

// run sets the label once asked, until it has landed or ctx ends.
func (m *nodeMark) run(ctx context.Context) {
	select {
	case <-ctx.Done():
		return
	case <-m.wanted:
	}
	for wait := time.Second; ; wait = min(2*wait, 30*time.Second) {
		err := m.patch(ctx, true)
		if err == nil {
			return
		}
		m.log.Warn("cannot label this Node as chaining inpod-cni; an uninstall cannot find it by the label until it lands", "label", NodeInstalledLabel, "err", err, "retryIn", wait)
		select {
		case <-ctx.Done():
			return
		case <-time.After(wait):
		}
	}
}

// patch sets (on) or removes the label.
func (m *nodeMark) patch(ctx context.Context, on bool) error {
	value := `null`
	if on {
		value = `"true"`
	}
	patch := fmt.Sprintf(`{"metadata":{"labels":{%q:%s}}}`, NodeInstalledLabel, value)
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	_, err := m.client.CoreV1().Nodes().Patch(ctx, m.node, types.MergePatchType, []byte(patch), metav1.PatchOptions{})
	if !on && apierrors.IsNotFound(err) {
		return nil // no Node, no label
	}
	if err != nil {
		return fmt.Errorf("label Node %s: %w", m.node, err)
	}
	return nil
}
