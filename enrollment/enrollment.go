// Package enrollment is who is in the mesh, in Istio's names: the
// enrollment label and its values, the annotation the agent writes on an
// enrolled pod, and the pod condition (and readiness gate) that says its
// redirection is proven. The agent, the resource-request webhook, the
// controller and the admission-policy tests share these rules, so the pods
// the policies guard are exactly the pods the agent enrolls; none of them
// imports the agent for it. A leaf: it imports only the Kubernetes API
// types.
package enrollment

import (
	"slices"

	corev1 "k8s.io/api/core/v1"
)

// Istio's names, so istiod and ztunnel tooling read inpod's state.
const (
	DataplaneModeLabel    = "istio.io/dataplane-mode"
	DataplaneAmbient      = "ambient"
	DataplaneNone         = "none"
	RedirectionAnnotation = "ambient.istio.io/redirection"
	AnnotationPending     = "pending"
	AnnotationEnabled     = "enabled"
)

// Policy is who is enrolled.
type Policy struct {
	// ExcludedNamespaces are never enrolled (default kube-system).
	ExcludedNamespaces []string
	// Label is the enrollment label on pods and namespaces (default
	// istio.io/dataplane-mode, Istio's); the values stay Istio's: "ambient"
	// enrolls, "none" opts a pod out.
	Label string
}

// Enrolled applies Istio's rules: never host-network pods or excluded
// namespaces; the pod's own label wins ("none" opts out); otherwise the
// namespace's label decides.
func (p Policy) Enrolled(pod *corev1.Pod, ns *corev1.Namespace) bool {
	if enrolled, decided := p.ByPod(pod); decided {
		return enrolled
	}
	return ns != nil && ns.Labels[p.LabelName()] == DataplaneAmbient
}

// ByPod decides from the pod alone where it can; decided is false when the
// answer is its namespace's label, which must then be known (a missing
// namespace is not "not enrolled").
func (p Policy) ByPod(pod *corev1.Pod) (enrolled, decided bool) {
	if pod == nil || pod.Spec.HostNetwork || slices.Contains(p.ExcludedNamespaces, pod.Namespace) {
		return false, true
	}
	switch pod.Labels[p.LabelName()] {
	case DataplaneAmbient:
		return true, true
	case DataplaneNone:
		return false, true
	}
	return false, false
}

// LabelName is the label the policy reads on pods and namespaces: Label,
// or Istio's when it is empty.
func (p Policy) LabelName() string {
	if p.Label == "" {
		return DataplaneModeLabel
	}
	return p.Label
}

// RedirectedCondition is the pod condition (and readiness gate) the agent
// sets True while a pod's redirection is proven.
const RedirectedCondition = "inpod.dev/redirected"

// Reasons of RedirectedCondition: proven, and not in the mesh.
const (
	ReasonRedirected = "Redirected"
	// ReasonNotEnrolled: a pod that carries the readiness gate but is not
	// in the mesh (it left it, or its namespace was unlabelled before it
	// started); the gate must never hold back a pod outside the mesh.
	ReasonNotEnrolled = "NotEnrolled"
)

// HasRedirectedGate reports whether the pod's readiness waits for
// RedirectedCondition.
func HasRedirectedGate(pod *corev1.Pod) bool {
	return slices.ContainsFunc(pod.Spec.ReadinessGates, func(g corev1.PodReadinessGate) bool {
		return g.ConditionType == RedirectedCondition
	})
}
