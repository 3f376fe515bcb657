package agent

import (
	"context"
	"log/slog"
	"reflect"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/client-go/kubernetes/scheme"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/client-go/tools/reference"

	"github.com/inpod-dev/inpod/agent/enroll"
	"github.com/inpod-dev/inpod/agent/podcondition"
	"github.com/inpod-dev/inpod/enrollment"
)

// podRead is every field of a cached pod the agent reads: the policy, the
// pipeline, events and the uninstall check. trimPod must keep each of them.
type podRead struct {
	Name, Namespace, UID, ResourceVersion string
	Labels                                map[string]string
	Redirection, Mirror, SandboxUID       string
	Deleting                              bool
	Controller                            *metav1.OwnerReference
	NodeName, ServiceAccount              string
	HostNetwork                           bool
	Phase                                 corev1.PodPhase
	PodIP                                 string
	PodIPs                                []corev1.PodIP
	SandboxReady                          []corev1.PodCondition
	EventRef                              *corev1.ObjectReference
	Created                               metav1.Time // the hand-over's rank
	Gated                                 bool
	Redirected                            []corev1.PodCondition
	Variant, VariantOnDNSNode             enroll.Variant
}

func readOf(t *testing.T, p *corev1.Pod) podRead {
	t.Helper()
	ref, err := reference.GetReference(scheme.Scheme, p)
	if err != nil {
		t.Fatal(err)
	}
	var sandboxReady, redirected []corev1.PodCondition
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReadyToStartContainers {
			sandboxReady = append(sandboxReady, corev1.PodCondition{Type: c.Type, Status: c.Status, LastTransitionTime: c.LastTransitionTime})
		}
		if c.Type == enrollment.RedirectedCondition {
			redirected = append(redirected, corev1.PodCondition{Type: c.Type, Status: c.Status, Reason: c.Reason, Message: c.Message})
		}
	}
	return podRead{Name: p.Name, Namespace: p.Namespace, UID: string(p.UID), ResourceVersion: p.ResourceVersion, Labels: p.Labels,
		Redirection: p.Annotations[enrollment.RedirectionAnnotation], Mirror: p.Annotations[enroll.MirrorAnnotation], SandboxUID: enroll.SandboxUID(p),
		Deleting: p.DeletionTimestamp != nil, Controller: metav1.GetControllerOf(p), NodeName: p.Spec.NodeName,
		ServiceAccount: p.Spec.ServiceAccountName, HostNetwork: p.Spec.HostNetwork, Phase: p.Status.Phase, PodIP: p.Status.PodIP,
		PodIPs: p.Status.PodIPs, SandboxReady: sandboxReady, EventRef: ref,
		Gated: enrollment.HasRedirectedGate(p), Redirected: redirected, Created: p.CreationTimestamp,
		Variant: variantOf(enroll.Variant{}, slog.New(slog.DiscardHandler))(p), VariantOnDNSNode: variantOf(enroll.Variant{DNSCapture: true}, slog.New(slog.DiscardHandler))(p)}
}

// A pod as the API server sends it: managedFields, a big last-applied
// annotation, containers, volumes, container statuses.
func fullPod(mod func(*corev1.Pod)) *corev1.Pod {
	now := metav1.NewTime(time.Date(2026, 12, 1, 10, 0, 0, 0, time.UTC))
	controller := true
	p := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: "mesh", Name: "web-0", UID: "uid-1", ResourceVersion: "42", Generation: 1,
			CreationTimestamp: now, GenerateName: "web-",
			Labels: map[string]string{"app": "web", "pod-template-hash": "abc"},
			Annotations: map[string]string{"kubectl.kubernetes.io/last-applied-configuration": string(make([]byte, 4096)),
				"prometheus.io/scrape": "true"},
			OwnerReferences: []metav1.OwnerReference{
				{APIVersion: "v1", Kind: "ConfigMap", Name: "not-the-controller", UID: "cm"},
				{APIVersion: "apps/v1", Kind: "StatefulSet", Name: "web", UID: "sts", Controller: &controller},
			},
			Finalizers:    []string{"example.com/f"},
			ManagedFields: []metav1.ManagedFieldsEntry{{Manager: "kubelet", Operation: metav1.ManagedFieldsOperationUpdate, FieldsType: "FieldsV1", FieldsV1: metav1.NewFieldsV1(`{"f:status":{}}`)}},
		},
		Spec: corev1.PodSpec{NodeName: "node-a", ServiceAccountName: "web-sa",
			Containers: []corev1.Container{{Name: "app", Image: "example.com/web:1", Env: []corev1.EnvVar{{Name: "A", Value: "b"}}}},
			Volumes:    []corev1.Volume{{Name: "data", VolumeSource: corev1.VolumeSource{EmptyDir: &corev1.EmptyDirVolumeSource{}}}}},
		Status: corev1.PodStatus{Phase: corev1.PodRunning, PodIP: "10.0.0.7", PodIPs: []corev1.PodIP{{IP: "10.0.0.7"}, {IP: "fd00::7"}},
			Conditions: []corev1.PodCondition{
				{Type: corev1.PodScheduled, Status: corev1.ConditionTrue, LastTransitionTime: now},
				{Type: corev1.PodReadyToStartContainers, Status: corev1.ConditionTrue, LastTransitionTime: now, Reason: "r", Message: "m"},
				{Type: corev1.PodReady, Status: corev1.ConditionTrue, LastTransitionTime: now},
			},
			ContainerStatuses: []corev1.ContainerStatus{{Name: "app", Ready: true, ImageID: "sha256:abc"}}},
	}
	if mod != nil {
		mod(p)
	}
	return p
}

// The transform keeps exactly what the agent reads: every read field is
// equal on the trimmed pod, and so is every enrollment decision, for a
// table of pods; and the bulk (managedFields, containers, other
// annotations) is gone.
func TestTrimPodKeepsWhatTheAgentReads(t *testing.T) {
	deleting := metav1.NewTime(time.Date(2026, 12, 1, 11, 0, 0, 0, time.UTC))
	pods := map[string]*corev1.Pod{
		"plain":            fullPod(nil),
		"labelled ambient": fullPod(func(p *corev1.Pod) { p.Labels[enrollment.DataplaneModeLabel] = enrollment.DataplaneAmbient }),
		"opted out":        fullPod(func(p *corev1.Pod) { p.Labels[enrollment.DataplaneModeLabel] = enrollment.DataplaneNone }),
		"custom label":     fullPod(func(p *corev1.Pod) { p.Labels["example.com/mesh"] = enrollment.DataplaneAmbient }),
		"host network": fullPod(func(p *corev1.Pod) {
			p.Spec.HostNetwork = true
			p.Labels[enrollment.DataplaneModeLabel] = enrollment.DataplaneAmbient
		}),
		"excluded namespace": fullPod(func(p *corev1.Pod) { p.Namespace = "kube-system" }),
		"no labels":          fullPod(func(p *corev1.Pod) { p.Labels = nil }),
		"annotated enabled":  fullPod(func(p *corev1.Pod) { p.Annotations[enrollment.RedirectionAnnotation] = enrollment.AnnotationEnabled }),
		"annotated pending":  fullPod(func(p *corev1.Pod) { p.Annotations[enrollment.RedirectionAnnotation] = enrollment.AnnotationPending }),
		"mirror of static":   fullPod(func(p *corev1.Pod) { p.Annotations[enroll.MirrorAnnotation] = "hash"; p.OwnerReferences = nil }),
		"no annotations":     fullPod(func(p *corev1.Pod) { p.Annotations = nil }),
		"DNS opted out":      fullPod(func(p *corev1.Pod) { p.Annotations[AnnotationDNSCapture] = "false" }),
		"DNS opted in":       fullPod(func(p *corev1.Pod) { p.Annotations[AnnotationDNSCapture] = "true" }),
		"ingress mode":       fullPod(func(p *corev1.Pod) { p.Annotations[AnnotationBypassInboundCapture] = "true" }),
		"virtual interfaces": fullPod(func(p *corev1.Pod) { p.Annotations[AnnotationRerouteVirtualInterfaces] = "virt0" }),
		"terminating":        fullPod(func(p *corev1.Pod) { p.DeletionTimestamp = &deleting }),
		"succeeded":          fullPod(func(p *corev1.Pod) { p.Status.Phase = corev1.PodSucceeded }),
		"pending, no IPs":    fullPod(func(p *corev1.Pod) { p.Status = corev1.PodStatus{Phase: corev1.PodPending} }),
		"only the old PodIP": fullPod(func(p *corev1.Pod) { p.Status.PodIPs = nil }),
		"sandbox not ready":  fullPod(func(p *corev1.Pod) { p.Status.Conditions[1].Status = corev1.ConditionFalse }),
		"gated, proven": fullPod(func(p *corev1.Pod) {
			p.Spec.ReadinessGates = []corev1.PodReadinessGate{{ConditionType: "example.com/other"}, {ConditionType: enrollment.RedirectedCondition}}
			p.Status.Conditions = append(p.Status.Conditions, corev1.PodCondition{Type: enrollment.RedirectedCondition, Status: corev1.ConditionTrue,
				Reason: enrollment.ReasonRedirected, Message: "redirection rules in place and ztunnel holds the pod", LastProbeTime: metav1.Now()})
		}),
		"other gate only": fullPod(func(p *corev1.Pod) {
			p.Spec.ReadinessGates = []corev1.PodReadinessGate{{ConditionType: "example.com/other"}}
		}),
		"agent pod": fullPod(func(p *corev1.Pod) {
			p.Labels = labels.Set{"app.kubernetes.io/name": "inpod", "app.kubernetes.io/component": "agent"}
		}),
		"no controller":      fullPod(func(p *corev1.Pod) { p.OwnerReferences = p.OwnerReferences[:1] }),
		"no status, no spec": {ObjectMeta: metav1.ObjectMeta{Namespace: "mesh", Name: "bare", UID: "u"}},
		"other node, no SA":  fullPod(func(p *corev1.Pod) { p.Spec.NodeName = "node-b"; p.Spec.ServiceAccountName = "" }),
		"ambient, terminated": fullPod(func(p *corev1.Pod) {
			p.Labels[enrollment.DataplaneModeLabel] = enrollment.DataplaneAmbient
			p.Status.Phase = corev1.PodFailed
		}),
	}
	namespaces := []*corev1.Namespace{
		{ObjectMeta: metav1.ObjectMeta{Name: "mesh"}},
		{ObjectMeta: metav1.ObjectMeta{Name: "mesh", Labels: map[string]string{enrollment.DataplaneModeLabel: enrollment.DataplaneAmbient}}},
		{ObjectMeta: metav1.ObjectMeta{Name: "mesh", Labels: map[string]string{"example.com/mesh": enrollment.DataplaneAmbient}}},
		nil,
	}
	policies := []enrollment.Policy{{ExcludedNamespaces: []string{"kube-system"}}, {Label: "example.com/mesh"}}
	for name, orig := range pods {
		before := orig.DeepCopy()
		obj, err := trimPod(orig)
		if err != nil {
			t.Fatal(err)
		}
		trimmed := obj.(*corev1.Pod)
		if !reflect.DeepEqual(orig, before) {
			t.Errorf("%s: trimPod changed the pod it was given", name)
		}
		if got, want := readOf(t, trimmed), readOf(t, orig); !reflect.DeepEqual(got, want) {
			t.Errorf("%s: the agent reads\n%+v\nfrom the trimmed pod, want\n%+v", name, got, want)
		}
		for _, pol := range policies {
			for _, ns := range namespaces {
				if got, want := pol.Enrolled(trimmed, ns), pol.Enrolled(orig, ns); got != want {
					t.Errorf("%s: enrolled = %v on the trimmed pod, %v on the original (policy %+v, namespace %+v)", name, got, want, pol, ns)
				}
			}
			gotE, gotD := pol.ByPod(trimmed)
			wantE, wantD := pol.ByPod(orig)
			if gotE != wantE || gotD != wantD {
				t.Errorf("%s: ByPod = %v, %v on the trimmed pod, %v, %v on the original", name, gotE, gotD, wantE, wantD)
			}
		}
		if len(trimmed.ManagedFields) > 0 || len(trimmed.Spec.Containers) > 0 || len(trimmed.Spec.Volumes) > 0 ||
			len(trimmed.Status.ContainerStatuses) > 0 || len(trimmed.Finalizers) > 0 || len(trimmed.Annotations) > len(keptPodAnnotations) || len(trimmed.Status.Conditions) > 2 || len(trimmed.Spec.ReadinessGates) > 1 {
			t.Errorf("%s: the trimmed pod keeps what the agent never reads: %+v", name, trimmed)
		}
		again, _ := trimPod(trimmed)
		if !reflect.DeepEqual(again, trimmed) {
			t.Errorf("%s: trimPod is not idempotent", name)
		}
	}
}

func TestTrimNamespaceAndDaemonSetKeepWhatTheAgentReads(t *testing.T) {
	ns := &metav1.PartialObjectMetadata{TypeMeta: metav1.TypeMeta{APIVersion: "meta.k8s.io/v1", Kind: "PartialObjectMetadata"},
		ObjectMeta: metav1.ObjectMeta{Name: "mesh", UID: "ns", ResourceVersion: "7",
			Labels:        map[string]string{enrollment.DataplaneModeLabel: enrollment.DataplaneAmbient, "kubernetes.io/metadata.name": "mesh"},
			Annotations:   map[string]string{"kubectl.kubernetes.io/last-applied-configuration": "{}"},
			ManagedFields: []metav1.ManagedFieldsEntry{{Manager: "kubectl"}}}}
	obj, _ := trimNamespace(enrollment.DataplaneModeLabel)(ns)
	got := obj.(*metav1.PartialObjectMetadata)
	if got.Name != ns.Name || got.ResourceVersion != "" || got.UID != "" ||
		!reflect.DeepEqual(got.Labels, map[string]string{enrollment.DataplaneModeLabel: enrollment.DataplaneAmbient}) {
		t.Errorf("trimmed namespace %+v: want its name and only the enrollment label of %+v", got, ns)
	}
	// Another enrollment label (the agent's --enrollment-label) is kept
	// instead; a namespace without it keeps no labels at all.
	obj, _ = trimNamespace("example.com/mesh")(ns)
	if l := obj.(*metav1.PartialObjectMetadata).Labels; l != nil {
		t.Errorf("trimmed for example.com/mesh, a namespace without that label keeps %v", l)
	}
	custom := ns.DeepCopy()
	custom.Labels["example.com/mesh"] = enrollment.DataplaneAmbient
	obj, _ = trimNamespace("example.com/mesh")(custom)
	if l := obj.(*metav1.PartialObjectMetadata).Labels; !reflect.DeepEqual(l, map[string]string{"example.com/mesh": enrollment.DataplaneAmbient}) {
		t.Errorf("trimmed for example.com/mesh: labels %v", l)
	}
	if len(got.ManagedFields) > 0 || len(got.Annotations) > 0 {
		t.Errorf("trimmed namespace keeps what the agent never reads: %+v", got)
	}
	pol := enrollment.Policy{}
	pod := fullPod(nil)
	if !pol.Enrolled(pod, &corev1.Namespace{ObjectMeta: got.ObjectMeta}) {
		t.Error("a pod of a labelled namespace is not enrolled from the trimmed namespace")
	}

	deleting := metav1.Now()
	ds := &appsv1.DaemonSet{ObjectMeta: metav1.ObjectMeta{Namespace: "inpod-system", Name: "inpod-agent", UID: "ds", ResourceVersion: "9",
		DeletionTimestamp: &deleting, ManagedFields: []metav1.ManagedFieldsEntry{{Manager: "helm"}}},
		Spec: appsv1.DaemonSetSpec{Template: corev1.PodTemplateSpec{ObjectMeta: metav1.ObjectMeta{Labels: map[string]string{"app.kubernetes.io/name": "inpod"}},
			Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "agent"}}}}}}
	obj, _ = trimDaemonSet(ds)
	d := obj.(*appsv1.DaemonSet)
	if d.Name != ds.Name || d.Namespace != ds.Namespace || d.UID != ds.UID || d.DeletionTimestamp != ds.DeletionTimestamp ||
		!reflect.DeepEqual(d.Spec.Template.Labels, ds.Spec.Template.Labels) {
		t.Errorf("trimmed DaemonSet %+v lost what the uninstall check reads of %+v", d, ds)
	}
	if len(d.ManagedFields) > 0 || len(d.Spec.Template.Spec.Containers) > 0 {
		t.Errorf("trimmed DaemonSet keeps what the agent never reads: %+v", d)
	}
}

// An agent restart costs no condition writes: a gated pod whose condition
// already says what the new agent finds is not patched. The condition
// writer compares with the pod as the agent's cache holds it, trimmed: the
// trim must keep what it compares.
func TestRestartWritesNoConditionAGatedPodCarries(t *testing.T) {
	for _, tc := range []struct{ reason, message string }{
		{enrollment.ReasonRedirected, enroll.MessageRedirected},
		{enrollment.ReasonNotEnrolled, enroll.MessageNotEnrolled},
	} {
		t.Run(tc.reason, func(t *testing.T) {
			pod := fullPod(func(p *corev1.Pod) {
				p.Spec.ReadinessGates = []corev1.PodReadinessGate{{ConditionType: enrollment.RedirectedCondition}}
				p.Status.Conditions = append(p.Status.Conditions, corev1.PodCondition{Type: enrollment.RedirectedCondition,
					Status: corev1.ConditionTrue, Reason: tc.reason, Message: tc.message})
			})
			cached, _ := trimPod(pod.DeepCopy())
			client := fake.NewClientset(pod)
			patches := 0
			client.PrependReactor("patch", "pods", func(k8stesting.Action) (bool, runtime.Object, error) {
				patches++
				return true, pod, nil
			})
			w := podcondition.New(podcondition.Config{Client: client, Current: func(types.NamespacedName) *corev1.Pod { return cached.(*corev1.Pod) }})
			w.Set(types.NamespacedName{Namespace: pod.Namespace, Name: pod.Name}, pod.UID, true, tc.reason, tc.message)
			if err := w.Flush(context.Background()); err != nil {
				t.Fatal(err)
			}
			if patches != 0 {
				t.Fatalf("%d patches of a pod that carries True/%s already", patches, tc.reason)
			}
		})
	}
}
