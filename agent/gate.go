package agent

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strings"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/inpod-dev/inpod/deviceplugin"
	"github.com/inpod-dev/inpod/dra"
	"github.com/inpod-dev/inpod/nodecondition"
	"github.com/inpod-dev/inpod/readiness"
)

// Gate makes scheduling onto this node follow readiness (deviceplugin,
// dra, node-condition). The agent runs every configured
// gate alongside its other pieces: Run follows ready until ctx ends, and
// its error stops the agent.
type Gate interface {
	// Name is the gate's --gate value.
	Name() string
	Run(ctx context.Context, ready *readiness.Aggregate) error
}

// gateNames are the --gate values the agent can build; "none" is the empty
// list.
var gateNames = []string{"deviceplugin", "dra", "node-condition"}

// nodeRemover is a gate that leaves something on the node or in the API
// that an uninstall must take away (after the gate has stopped).
type nodeRemover interface {
	RemoveFromNode(ctx context.Context) error
}

// gateList checks a --gate list before anything is built (New calls it
// before it needs a cluster): an unknown name fails New.
func gateList(list string) ([]string, error) {
	if strings.TrimSpace(list) == "" {
		list = "deviceplugin"
	}
	var names []string
	for name := range strings.SplitSeq(list, ",") {
		name = strings.TrimSpace(name)
		if slices.Contains(names, name) {
			return nil, fmt.Errorf("agent: --gate %q names %q twice", list, name)
		}
		switch {
		case name == "none" || slices.Contains(gateNames, name):
		default:
			return nil, fmt.Errorf("agent: unknown gate %q (want %s, or none)", name, strings.Join(gateNames, ", "))
		}
		names = append(names, name)
	}
	if slices.Contains(names, "none") && len(names) > 1 {
		return nil, fmt.Errorf("agent: --gate %q: none cannot be combined with a gate", list)
	}
	return names, nil
}

// newGates builds the gates of a checked list, before anything runs (after
// the API client: the node-condition gate writes through it). A new gate
// is one name in gateNames and one case here.
func (a *Agent) newGates(names []string) ([]Gate, error) {
	var gates []Gate
	for _, name := range names {
		var (
			g   Gate
			err error
		)
		switch name {
		case "none":
			continue
		case "deviceplugin":
			cfg := a.cfg.DevicePlugin
			cfg.Observer, cfg.Logger, cfg.DevicesFrom = a.Metrics, a.log, a.podCapacity
			if a.preStart, err = a.newPreStartCheck(cfg.ResourceName); err != nil {
				return nil, err
			}
			if a.preStart != nil {
				cfg.PreStart = a.preStart.check
			}
			// The close reads and writes through a client of its own:
			// its few requests a second while closing must not wait
			// behind a burst of annotation patches, nor hold them back.
			var own kubernetes.Interface
			if own, err = kubernetes.NewForConfig(rest.CopyConfig(a.restCfg)); err != nil {
				return nil, err
			}
			resource := cfg.ResourceName
			if resource == "" {
				resource = deviceplugin.DefaultResourceName
			}
			a.closer = newSchedulingCloser(own, a.cfg.NodeName, corev1.ResourceName(resource), a.log)
			cfg.Closer = a.closer
			g, err = deviceplugin.New(cfg)
		case "dra":
			// A client of its own (same limits, its own budget):
			// client-go rate-limits per client, and a burst of
			// annotation patches on the shared one must not hold back
			// a taint.
			var own kubernetes.Interface
			if own, err = kubernetes.NewForConfig(rest.CopyConfig(a.restCfg)); err != nil {
				return nil, err
			}
			cfg := a.cfg.DRA
			cfg.Client, cfg.NodeName, cfg.Observer, cfg.Logger = own, a.cfg.NodeName, a.Metrics, a.log
			g, err = dra.New(cfg)
		case "node-condition":
			cfg := a.cfg.NodeCondition
			cfg.Client, cfg.NodeName, cfg.Observer, cfg.Logger = a.client, a.cfg.NodeName, a.Metrics, a.log
			g, err = nodecondition.New(cfg)
		default:
			err = fmt.Errorf("agent: gate %q has no constructor", name)
		}
		if err != nil {
			return nil, err
		}
		gates = append(gates, g)
	}
	return gates, nil
}

// newPreStartCheck builds the device-plugin gate's container-start check,
// or nil (with a warning) when the kubelet's pod-resources API is not
// there: without it the check could name no pod and would hold every gated
// container for good.
func (a *Agent) newPreStartCheck(resource string) (*preStartCheck, error) {
	socket := a.cfg.PodResourcesSocket
	if socket == "" {
		return nil, nil
	}
	if resource == "" {
		resource = deviceplugin.DefaultResourceName
	}
	warn := func(err error) {
		a.log.Warn("the kubelet's pod-resources API does not answer, so container starts are not checked: a pod whose sandbox was set up while another CNI's rewrite dropped inpod-cni can start before the agent redirects it (mount the kubelet's pod-resources directory read-only, or set --pod-resources-socket)", "socket", socket, "err", err)
	}
	if _, err := os.Stat(socket); err != nil {
		warn(err)
		return nil, nil
	}
	c, err := newPreStartCheck(context.Background(), socket, resource, a.log)
	if err != nil {
		warn(err)
		return nil, nil
	}
	a.log.Info("container starts of gated pods are checked (PreStartContainer)", "podResources", socket)
	return c, nil
}
