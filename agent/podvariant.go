package agent

import (
	"log/slog"
	"slices"
	"strconv"
	"strings"

	corev1 "k8s.io/api/core/v1"

	"github.com/inpod-dev/inpod/agent/enroll"
	"github.com/inpod-dev/inpod/agent/redirect"
)

// The pod annotations Istio's node agent honours in ambient mode that change
// a pod's redirection, honoured the same way here (Istio's
// getPodLevelTrafficOverrides): each a boolean that, when present and
// valid, overrides the node's default for that pod.
const (
	// AnnotationDNSCapture: "false" keeps the pod's DNS out of ztunnel's
	// DNS proxy on a node that captures DNS; "true" captures it on a node
	// that does not.
	AnnotationDNSCapture = "ambient.istio.io/dns-capture"
	// AnnotationBypassInboundCapture: "true" redirects only the pod's
	// outbound traffic (Istio's ingress mode, for pods that take traffic
	// from outside the mesh).
	AnnotationBypassInboundCapture = "ambient.istio.io/bypass-inbound-capture"
	// AnnotationRerouteVirtualInterfaces: a comma-separated list of the
	// pod's interfaces whose incoming TCP is a guest's outbound traffic
	// (KubeVirt's VMs): redirected to ztunnel's outbound listener.
	AnnotationRerouteVirtualInterfaces = "istio.io/reroute-virtual-interfaces"
)

// variantOf decides each pod's variant of the redirection: the node's
// defaults, overridden by the pod's annotations. A value strconv.ParseBool
// refuses is ignored with a warning, as Istio ignores it: the pod keeps the
// node's default, which for inbound capture is the stricter choice. A
// virtual interface that is no interface name (redirect.ValidInterfaceName)
// is left out with a warning, where Istio would write it into its rules:
// its traffic stays under inbound capture, the stricter choice again.
//
// A pod's annotations are its owner's to set, like the enrollment label
// that can take it out of the mesh altogether: neither can reach another
// pod's rules.
func variantOf(defaults enroll.Variant, log *slog.Logger) func(*corev1.Pod) enroll.Variant {
	return func(pod *corev1.Pod) enroll.Variant {
		v := defaults
		if on, ok := boolAnnotation(pod, AnnotationDNSCapture, log); ok {
			v.DNSCapture = on
		}
		if on, ok := boolAnnotation(pod, AnnotationBypassInboundCapture, log); ok {
			v.NoInboundCapture = on
		}
		v.VirtualInterfaces = virtualInterfaces(pod, log)
		return v
	}
}

func virtualInterfaces(pod *corev1.Pod, log *slog.Logger) []string {
	raw, present := pod.Annotations[AnnotationRerouteVirtualInterfaces]
	if !present {
		return nil
	}
	var out []string
	for _, name := range strings.Split(raw, ",") {
		name = strings.TrimSpace(name)
		switch {
		case name == "" || slices.Contains(out, name):
		case !redirect.ValidInterfaceName(name):
			log.Warn("ignoring a virtual interface that is no interface name; its traffic stays under inbound capture", "pod", pod.Namespace+"/"+pod.Name, "annotation", AnnotationRerouteVirtualInterfaces, "value", name)
		default:
			if name == "eth0" || name == "lo" {
				// As Istio allows it; but the pod's own inbound traffic
				// (eth0) or local connections (lo) then reach ztunnel as
				// the pod's outbound, past inbound policy.
				log.Warn("a virtual interface names the pod's own interface: its traffic is treated as the pod's outbound", "pod", pod.Namespace+"/"+pod.Name, "annotation", AnnotationRerouteVirtualInterfaces, "value", name)
			}
			out = append(out, name)
		}
	}
	return out
}

func boolAnnotation(pod *corev1.Pod, name string, log *slog.Logger) (value, ok bool) {
	raw, present := pod.Annotations[name]
	if !present {
		return false, false
	}
	value, err := strconv.ParseBool(raw)
	if err != nil {
		log.Warn("ignoring a pod annotation that is not a boolean; the node's default applies", "pod", pod.Namespace+"/"+pod.Name, "annotation", name, "value", raw)
		return false, false
	}
	return value, true
}
