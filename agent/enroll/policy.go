// Package enroll decides which pods are in the mesh and carries each
// enrolled pod through its life: redirect on the CNI event, hand its netns
// to ztunnel, follow label changes and deletion, and restore everything
// after an agent restart without touching running traffic.
package enroll

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
	return ns != nil && ns.Labels[p.label()] == DataplaneAmbient
}

// ByPod decides from the pod alone where it can; decided is false when the
// answer is its namespace's label, which must then be known (a missing
// namespace is not "not enrolled").
func (p Policy) ByPod(pod *corev1.Pod) (enrolled, decided bool) {
	if pod == nil || pod.Spec.HostNetwork || slices.Contains(p.ExcludedNamespaces, pod.Namespace) {
		return false, true
	}
	switch pod.Labels[p.label()] {
	case DataplaneAmbient:
		return true, true
	case DataplaneNone:
		return false, true
	}
	return false, false
}

func (p Policy) label() string {
	if p.Label == "" {
		return DataplaneModeLabel
	}
	return p.Label
}
