package requestwebhook

import (
	"encoding/json"
	"slices"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"

	"github.com/inpod-dev/inpod/enrollment"
)

// PartOfLabel with the value PartOf marks inpod's own pods, which never
// get the request (the chart's common labels).
const (
	PartOfLabel = "app.kubernetes.io/part-of"
	PartOf      = "inpod"
)

// MirrorAnnotation marks a static pod's mirror: the kubelet runs the static
// manifest, not the mirror's spec, so a request there would only skew the
// scheduler's accounting.
const MirrorAnnotation = "kubernetes.io/config.mirror"

// ReadinessGate is the condition type of the readiness gate the webhook
// adds with Config.ReadinessGate (docs/design/verification.md): the agent
// sets it True once the pod's redirection is proven.
const ReadinessGate corev1.PodConditionType = enrollment.RedirectedCondition

// rules is the decision, apart from how the namespace is found.
type rules struct {
	policy   enrollment.Policy
	resource corev1.ResourceName
	// request and gate say what an enrolled pod gets: the resource
	// request, the readiness gate.
	request, gate bool
	// own is inpod's namespace, the only one where part-of=inpod exempts.
	own string
}

// skip reports whether the pod gets nothing, whatever its namespace:
// inpod's own (in its namespace), a mirror pod, one that has all it would
// get already, or decided by its own labels, host network or namespace
// name (enrollment.Policy.ByPod). decided false means its namespace's label
// decides.
func (r rules) skip(pod *corev1.Pod) (skip, decided bool) {
	if _, mirror := pod.Annotations[MirrorAnnotation]; mirror || len(pod.Spec.Containers) == 0 || (pod.Namespace == r.own && pod.Labels[PartOfLabel] == PartOf) {
		return true, true
	}
	if !r.wantsRequest(pod) && !r.wantsGate(pod) {
		return true, true
	}
	enrolled, decided := r.policy.ByPod(pod)
	return decided && !enrolled, decided
}

// wantsRequest: an enrolled pod gets the request unless it has it.
func (r rules) wantsRequest(pod *corev1.Pod) bool { return r.request && !r.requesting(pod) }

// wantsGate: an enrolled pod gets the readiness gate unless it has it.
func (r rules) wantsGate(pod *corev1.Pod) bool {
	return r.gate && !slices.ContainsFunc(pod.Spec.ReadinessGates, func(g corev1.PodReadinessGate) bool {
		return g.ConditionType == ReadinessGate
	})
}

// requesting: any container asks for the resource, as a request or a
// limit (the API server fills the request from the limit); init containers
// count (a sidecar may carry it), or the pod would ask for it twice.
func (r rules) requesting(pod *corev1.Pod) bool {
	for _, c := range slices.Concat(pod.Spec.InitContainers, pod.Spec.Containers) {
		_, req := c.Resources.Requests[r.resource]
		_, lim := c.Resources.Limits[r.resource]
		if req || lim {
			return true
		}
	}
	return false
}

// wants is the whole decision for a pod whose namespace is ns (nil: not
// known, which enrolls only by the pod's own label).
func (r rules) wants(pod *corev1.Pod, ns *corev1.Namespace) bool {
	if skip, _ := r.skip(pod); skip {
		return false
	}
	return r.policy.Enrolled(pod, ns)
}

type patchOp struct {
	Op    string `json:"op"`
	Path  string `json:"path"`
	Value any    `json:"value"`
}

// patch is the JSONPatch for an enrolled pod, nil when it needs none.
//
// The request: the first container gets 1 of the resource in requests and
// limits. It sets the container's whole resources (add replaces an
// existing member), which works whether or not the pod's manifest had
// resources, requests or limits, and keeps what it had.
//
// The readiness gate: the pod's readiness gates as they are, plus ours.
// The whole list, for the same reason; it is the list of the object this
// review carries, which the API server patches, so gates of the pod's
// own (a load balancer controller's) are kept.
func (r rules) patch(pod *corev1.Pod) ([]byte, error) {
	var ops []patchOp
	if r.wantsRequest(pod) {
		res := pod.Spec.Containers[0].Resources.DeepCopy()
		if res.Requests == nil {
			res.Requests = corev1.ResourceList{}
		}
		if res.Limits == nil {
			res.Limits = corev1.ResourceList{}
		}
		one := resource.MustParse("1")
		res.Requests[r.resource] = one
		res.Limits[r.resource] = one
		ops = append(ops, patchOp{Op: "add", Path: "/spec/containers/0/resources", Value: res})
	}
	if r.wantsGate(pod) {
		gates := append(slices.Clone(pod.Spec.ReadinessGates), corev1.PodReadinessGate{ConditionType: ReadinessGate})
		ops = append(ops, patchOp{Op: "add", Path: "/spec/readinessGates", Value: gates})
	}
	if len(ops) == 0 {
		return nil, nil
	}
	return json.Marshal(ops)
}
