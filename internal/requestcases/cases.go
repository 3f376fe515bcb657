// Package requestcases is the one table of cases for what admission adds to
// enrolled pods, the automatic resource request and the readiness gate
// inpod.dev/redirected, shared by the tests of their two implementations:
// the chart's MutatingAdmissionPolicies (deploy/) and inpod-controller's
// webhook (requestwebhook/); the init-container policy's test uses it too
// (Gated). Both must decide exactly as the agent enrolls (agent/enroll
// Policy). Only tests import it.
package requestcases

import (
	"fmt"
	"slices"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/inpod-dev/inpod/enrollment"
)

// ResourceName and Label are the chart's defaults; ReadinessGate is the
// condition type of the readiness gate (DESIGN.md, "per-pod proof").
const (
	ResourceName  = corev1.ResourceName("inpod.dev/redirection")
	Label         = "istio.io/dataplane-mode"
	ReadinessGate = corev1.PodConditionType(enrollment.RedirectedCondition)
)

// OtherGate is a readiness gate of someone else's (a load balancer
// controller's, say), which admission must keep.
const OtherGate = corev1.PodConditionType("example.com/lb-registered")

// Want is what admission must do to a pod.
type Want int

const (
	// Gains: exactly one container (the first) gains the request, 1 in
	// requests and limits; the pod's other resources stay.
	Gains Want = iota
	// Unchanged: no container requests the resource.
	Unchanged
	// AlreadyRequests: the pod requests it on its second container already
	// and is left as it is.
	AlreadyRequests
)

func (w Want) String() string {
	return [...]string{"gains the request", "unchanged", "already requests it"}[w]
}

// Case is one pod created in one of Namespaces.
type Case struct {
	Pod  *corev1.Pod
	Want Want
}

// AgentOnly: the agent enrolls the pod, but admission leaves it alone
// (Want Unchanged, no init container): a mirror pod, whose API spec is not
// what the kubelet runs.
func (c Case) AgentOnly() bool { return c.Pod.Annotations[MirrorAnnotation] != "" }

// MirrorAnnotation marks the API copy of a static pod (the kubelet's).
const MirrorAnnotation = "kubernetes.io/config.mirror"

// Namespaces the cases' pods are created in: mesh is labelled ambient,
// plain is not. kube-system (excluded) must be labelled ambient too: call
// LabelExcluded on it.
func Namespaces() []*corev1.Namespace {
	return []*corev1.Namespace{
		{ObjectMeta: metav1.ObjectMeta{Name: "mesh", Labels: map[string]string{Label: "ambient", "kubernetes.io/metadata.name": "mesh"}}},
		{ObjectMeta: metav1.ObjectMeta{Name: "plain", Labels: map[string]string{"kubernetes.io/metadata.name": "plain"}}},
	}
}

// Own is inpod's namespace in the tests (the release namespace): only there
// does app.kubernetes.io/part-of=inpod exempt a pod. Not among Namespaces:
// the tests create it with the chart.
const Own = "inpod-system"

// OwnPod is an inpod pod in Own, labelled ambient: admission leaves it
// alone (the exemption that lets inpod start before its own gate).
func OwnPod() *corev1.Pod {
	return pod(Own, "inpod-own", map[string]string{"app.kubernetes.io/part-of": "inpod", Label: "ambient"}, nil)
}

// Excluded is the excluded namespace of the cases (the chart's default).
const Excluded = "kube-system"

// LabelExcluded labels the excluded namespace ambient: it stays excluded.
func LabelExcluded(ns *corev1.Namespace) {
	if ns.Labels == nil {
		ns.Labels = map[string]string{}
	}
	ns.Labels[Label] = "ambient"
}

func pod(ns, name string, labels map[string]string, mod func(*corev1.Pod)) *corev1.Pod {
	p := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, Labels: labels},
		Spec: corev1.PodSpec{Containers: []corev1.Container{
			{Name: "app", Image: "app"},
			{Name: "sidecar", Image: "sidecar"},
		}},
	}
	if mod != nil {
		mod(p)
	}
	return p
}

// Cases returns fresh pods (callers may change them).
func Cases() []Case {
	ambient := map[string]string{Label: "ambient"}
	return []Case{
		{pod("mesh", "by-namespace", nil, nil), Gains},
		{pod("plain", "by-pod-label", ambient, nil), Gains},
		{pod("mesh", "other-label-value", map[string]string{Label: "sidecar"}, nil), Gains},
		{pod("mesh", "other-resources", nil, func(p *corev1.Pod) {
			p.Spec.Containers[0].Resources = corev1.ResourceRequirements{
				Requests: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("100m")},
				Limits:   corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("64Mi")},
			}
		}), Gains},

		{pod("plain", "unlabelled", nil, nil), Unchanged},
		{pod("mesh", "opted-out", map[string]string{Label: "none"}, nil), Unchanged},
		{pod("plain", "host-network", ambient, func(p *corev1.Pod) { p.Spec.HostNetwork = true }), Unchanged},
		{pod("mesh", "host-network-by-namespace", nil, func(p *corev1.Pod) { p.Spec.HostNetwork = true }), Unchanged},
		{pod(Excluded, "excluded-namespace", nil, nil), Unchanged},
		{pod(Excluded, "excluded-namespace-pod-label", ambient, nil), Unchanged},
		// inpod's label outside inpod's namespace is a user's pod: the agent
		// enrolls it, so it is gated like any other (inpod's own pods, in
		// its namespace, are tested by each implementation).
		{pod("mesh", "inpod-label-elsewhere", map[string]string{"app.kubernetes.io/part-of": "inpod"}, nil), Gains},
		{pod("plain", "inpod-label-elsewhere-labelled", map[string]string{"app.kubernetes.io/part-of": "inpod", Label: "ambient"}, nil), Gains},
		// A static pod's mirror: the kubelet runs the static manifest, never
		// this spec; a request would only skew the scheduler's accounting,
		// and an init container would never run.
		{pod("mesh", "mirror", ambient, func(p *corev1.Pod) {
			p.Annotations = map[string]string{MirrorAnnotation: "0123456789abcdef"}
			p.Spec.NodeName = "node-a"
		}), Unchanged},

		// Already requesting it (on another container, or only as a
		// limit): left as it is.
		{pod("mesh", "already", nil, func(p *corev1.Pod) {
			p.Spec.Containers[1].Resources.Limits = corev1.ResourceList{ResourceName: resource.MustParse("1")}
			p.Spec.Containers[1].Resources.Requests = corev1.ResourceList{ResourceName: resource.MustParse("1")}
		}), AlreadyRequests},
		{pod("plain", "already-limit-only", ambient, func(p *corev1.Pod) {
			p.Spec.Containers[1].Resources.Limits = corev1.ResourceList{ResourceName: resource.MustParse("1")}
		}), AlreadyRequests},
		// A sidecar (restartable init container) that already requests it:
		// the pod asks for it once, not twice ("unchanged": no regular
		// container gains it).
		// Readiness gates of their own: readinessGates is an atomic list,
		// so an addition that replaced it would drop the other gate (and
		// with it what the pod's owner waits for). Ours comes after.
		{pod("mesh", "other-readiness-gate", nil, func(p *corev1.Pod) {
			p.Spec.ReadinessGates = []corev1.PodReadinessGate{{ConditionType: OtherGate}}
		}), Gains},
		// Ours already (created from an admitted pod's spec): not twice.
		{pod("plain", "readiness-gate-already", ambient, func(p *corev1.Pod) {
			p.Spec.ReadinessGates = []corev1.PodReadinessGate{{ConditionType: OtherGate}, {ConditionType: ReadinessGate}}
		}), Gains},
		// Outside the mesh, its own gate stays and is alone.
		{pod("plain", "unlabelled-other-readiness-gate", nil, func(p *corev1.Pod) {
			p.Spec.ReadinessGates = []corev1.PodReadinessGate{{ConditionType: OtherGate}}
		}), Unchanged},
		{pod("mesh", "already-sidecar", nil, func(p *corev1.Pod) {
			always := corev1.ContainerRestartPolicyAlways
			p.Spec.InitContainers = []corev1.Container{{Name: "mesh-sidecar", Image: "sidecar", RestartPolicy: &always,
				Resources: corev1.ResourceRequirements{
					Requests: corev1.ResourceList{ResourceName: resource.MustParse("1")},
					Limits:   corev1.ResourceList{ResourceName: resource.MustParse("1")},
				}}}
		}), Unchanged},
	}
}

// Enrolled says whether the enrollment rules enroll the case's pod (the
// agent's view; the init-container policy follows Gated): every pod that
// gains or already requests the resource, and a pod left unchanged only
// because a sidecar (init container) requests it already.
func (c Case) Enrolled() bool {
	if c.Want != Unchanged || c.AgentOnly() {
		return true
	}
	for _, ic := range c.Pod.Spec.InitContainers {
		_, r := ic.Resources.Requests[ResourceName]
		_, l := ic.Resources.Limits[ResourceName]
		if r || l {
			return true
		}
	}
	return false
}

// Gated says whether admission gives the pod inpod-wait-ready (gate
// initcontainer) and the readiness gate: enrolled, and not AgentOnly.
func (c Case) Gated() bool { return c.Enrolled() && !c.AgentOnly() }

// requests counts the containers requesting the resource, and says whether
// each that does asks for exactly 1 in requests and limits.
func requests(p *corev1.Pod) (n int, exact bool) {
	exact = true
	for _, c := range p.Spec.Containers {
		r, hasR := c.Resources.Requests[ResourceName]
		l, hasL := c.Resources.Limits[ResourceName]
		if hasR || hasL {
			n++
			exact = exact && hasR && hasL && r.Value() == 1 && l.Value() == 1
		}
	}
	return n, exact
}

// Requested reports whether some container of p requests the resource.
func Requested(p *corev1.Pod) bool {
	n, _ := requests(p)
	return n > 0
}

// Check compares the admitted pod got with what c wants; nil when it
// matches.
func (c Case) Check(got *corev1.Pod) error {
	n, exact := requests(got)
	switch c.Want {
	case Gains:
		if n != 1 || !exact {
			return fmt.Errorf("%d containers request %s (exactly 1 each: %t), want one: %+v", n, ResourceName, exact, got.Spec.Containers)
		}
		if _, ok := got.Spec.Containers[0].Resources.Limits[ResourceName]; !ok {
			return fmt.Errorf("the request is not on the first container: %+v", got.Spec.Containers)
		}
		want := c.Pod.Spec.Containers[0].Resources
		have := got.Spec.Containers[0].Resources
		for name, q := range want.Requests {
			if h := have.Requests[name]; h.Cmp(q) != 0 {
				return fmt.Errorf("the pod's own request %s changed: %s, was %s", name, h.String(), q.String())
			}
		}
		for name, q := range want.Limits {
			if h := have.Limits[name]; h.Cmp(q) != 0 {
				return fmt.Errorf("the pod's own limit %s changed: %s, was %s", name, h.String(), q.String())
			}
		}
	case Unchanged:
		if n != 0 {
			return fmt.Errorf("not enrolled, but gained the request: %+v", got.Spec.Containers)
		}
	case AlreadyRequests:
		if n != 1 {
			return fmt.Errorf("already requesting: now %d containers request it", n)
		}
		if _, has := got.Spec.Containers[0].Resources.Limits[ResourceName]; has {
			return fmt.Errorf("already requesting on its second container: the first gained it too")
		}
	}
	return nil
}

// gateTypes lists the condition types of p's readiness gates, in order.
func gateTypes(p *corev1.Pod) []corev1.PodConditionType {
	var out []corev1.PodConditionType
	for _, g := range p.Spec.ReadinessGates {
		out = append(out, g.ConditionType)
	}
	return out
}

// HasReadinessGate reports whether p waits for ReadinessGate.
func HasReadinessGate(p *corev1.Pod) bool { return slices.Contains(gateTypes(p), ReadinessGate) }

// CheckReadinessGate compares the admitted pod's readiness gates with what
// admission must make of the case's pod, with the readiness gate on: a
// Gated pod keeps its own gates, in order, and has ReadinessGate once
// (last, when admission added it); any other pod keeps exactly its own.
func (c Case) CheckReadinessGate(got *corev1.Pod) error {
	own, have := gateTypes(c.Pod), gateTypes(got)
	want := own
	if c.Gated() && !slices.Contains(own, ReadinessGate) {
		want = append(slices.Clone(own), ReadinessGate)
	}
	if !slices.Equal(have, want) {
		return fmt.Errorf("readiness gates %v, want %v (gated: %t)", have, want, c.Gated())
	}
	return nil
}

// CheckNoReadinessGate: with the readiness gate off, every pod keeps
// exactly its own readiness gates.
func (c Case) CheckNoReadinessGate(got *corev1.Pod) error {
	if own, have := gateTypes(c.Pod), gateTypes(got); !slices.Equal(have, own) {
		return fmt.Errorf("readiness gates %v, want its own %v", have, own)
	}
	return nil
}

// CheckNotRequested: with the resource request off (no gate that
// advertises the resource), no pod gains it; a pod's own request stays.
func (c Case) CheckNotRequested(got *corev1.Pod) error {
	n, _ := requests(got)
	own, _ := requests(c.Pod)
	if n != own {
		return fmt.Errorf("%d containers request %s, the pod had %d", n, ResourceName, own)
	}
	return nil
}
