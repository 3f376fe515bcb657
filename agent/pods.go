package agent

import (
	"context"
	"fmt"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	listersv1 "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/metadata"
	"k8s.io/client-go/metadata/metadatainformer"
	"k8s.io/client-go/metadata/metadatalister"
	"k8s.io/client-go/tools/cache"

	"github.com/inpod-dev/inpod/agent/enroll"
	"github.com/inpod-dev/inpod/enrollment"
	"github.com/inpod-dev/inpod/passlist"
)

// podCache answers the pipeline from the informers: the pods of this node
// and all namespaces.
type podCache struct {
	client kubernetes.Interface
	// node is this node's name: the cache holds its pods only, and a pod
	// read from the API is answered only when bound here.
	node       string
	pods       listersv1.PodLister
	namespaces metadatalister.Lister
	// cacheWait bounds how long a CNI event waits for the watch to deliver a
	// pod it has not seen yet, before one direct API read.
	cacheWait time.Duration
}

var namespacesResource = corev1.SchemeGroupVersion.WithResource("namespaces")

// newInformers builds the pod watch (this node's pods) and the namespace
// watch. Both keep only what the agent reads (trimPod, trimNamespace): the
// caches hold every pod of the node and every namespace of the cluster for
// the agent's whole life, on every node, and the rest of each object (its
// containers, volumes, managedFields, status of each container) was most
// of the agent's heap. Namespaces are watched as metadata only, since
// their enrollment label is all the policy reads of them.
func newInformers(client kubernetes.Interface, meta metadata.Interface, node, enrollmentLabel string) (informers.SharedInformerFactory, metadatainformer.SharedInformerFactory) {
	podInf := informers.NewSharedInformerFactoryWithOptions(client, 0,
		informers.WithTweakListOptions(func(o *metav1.ListOptions) {
			o.FieldSelector = fields.OneTermEqualSelector("spec.nodeName", node).String()
		}),
		informers.WithTransform(trimPod))
	nsInf := metadatainformer.NewSharedInformerFactoryWithOptions(meta, 0, metadatainformer.WithTransform(trimNamespace(enrollmentLabel)))
	return podInf, nsInf
}

// keptPodAnnotations are the only annotations of a pod the agent reads.
var keptPodAnnotations = []string{enrollment.RedirectionAnnotation, enroll.MirrorAnnotation, AnnotationDNSCapture, AnnotationBypassInboundCapture, AnnotationRerouteVirtualInterfaces}

// trimPod keeps of a pod exactly what the agent reads from its cache:
//   - the policy (enrollment.Policy): namespace, labels, spec.hostNetwork;
//   - the pipeline (agent/enroll): name, UID, the redirection and mirror
//     annotations, Istio's per-pod annotations that choose the pod's
//     variant (variantOf), spec.serviceAccountName (sent to ztunnel), status.phase,
//     the pod IPs, and the PodReadyToStartContainers condition (a new
//     sandbox; see enroll's sandboxMayHaveChanged); events on the pod need
//     its name, namespace, UID and resourceVersion;
//   - the verifier (enroll/verify.go): whether the pod's readiness gates
//     include inpod.dev/redirected; that condition's status, reason and
//     message, which the condition writer (podcondition.Config.Current)
//     compares with what it is asked to write: without them every restart
//     would patch every gated pod to say what it already says;
//   - the uninstall check (removal.go): spec.nodeName, deletionTimestamp,
//     the controlling owner reference, labels, status.phase;
//   - the hand-over (handover.go): the agent's own pod's creationTimestamp,
//     its rank.
//
// Anything else is dropped, managedFields first. A new reader of a pod
// field must be added here, or it reads the zero value: TestTrimPodKeeps...
// holds the list. Idempotent, as client-go requires (a transform may see
// an object it already transformed).
func trimPod(obj any) (any, error) {
	pod, ok := obj.(*corev1.Pod)
	if !ok {
		return obj, nil
	}
	out := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{
			Name: pod.Name, Namespace: pod.Namespace, UID: pod.UID, ResourceVersion: pod.ResourceVersion,
			Labels: pod.Labels, DeletionTimestamp: pod.DeletionTimestamp, CreationTimestamp: pod.CreationTimestamp,
		},
		Spec:   corev1.PodSpec{NodeName: pod.Spec.NodeName, HostNetwork: pod.Spec.HostNetwork, ServiceAccountName: pod.Spec.ServiceAccountName},
		Status: corev1.PodStatus{Phase: pod.Status.Phase, PodIP: pod.Status.PodIP, PodIPs: pod.Status.PodIPs},
	}
	for _, k := range keptPodAnnotations {
		if v, ok := pod.Annotations[k]; ok {
			if out.Annotations == nil {
				out.Annotations = make(map[string]string, len(keptPodAnnotations))
			}
			out.Annotations[k] = v
		}
	}
	if ref := metav1.GetControllerOfNoCopy(pod); ref != nil {
		out.OwnerReferences = []metav1.OwnerReference{*ref}
	}
	for _, c := range pod.Status.Conditions {
		switch c.Type {
		case corev1.PodReadyToStartContainers:
			out.Status.Conditions = append(out.Status.Conditions, corev1.PodCondition{Type: c.Type, Status: c.Status, LastTransitionTime: c.LastTransitionTime})
		case enrollment.RedirectedCondition:
			out.Status.Conditions = append(out.Status.Conditions, corev1.PodCondition{Type: c.Type, Status: c.Status, LastTransitionTime: c.LastTransitionTime,
				Reason: c.Reason, Message: c.Message})
		}
	}
	for _, g := range pod.Spec.ReadinessGates {
		if g.ConditionType == enrollment.RedirectedCondition {
			out.Spec.ReadinessGates = []corev1.PodReadinessGate{g}
		}
	}
	return out, nil
}

// trimNamespace keeps of a namespace's metadata what the agent reads: its
// name and its enrollment label. Every node's agent holds every namespace
// of the cluster for its whole life: at 10,000 namespaces, their other
// labels (kubernetes.io/metadata.name on each, and whatever teams add) were
// half of what the cache held (BenchmarkIntegrationAgentInformersAtScale).
// The kept strings are copied: a decoded object's strings sit among the
// garbage of the list that brought them, and would keep its memory
// fragmented for as long as the agent runs.
func trimNamespace(enrollmentLabel string) func(obj any) (any, error) {
	return func(obj any) (any, error) {
		ns, ok := obj.(*metav1.PartialObjectMetadata)
		if !ok {
			return obj, nil
		}
		out := &metav1.PartialObjectMetadata{TypeMeta: ns.TypeMeta, ObjectMeta: metav1.ObjectMeta{Name: strings.Clone(ns.Name)}}
		if v, ok := ns.Labels[enrollmentLabel]; ok {
			out.Labels = map[string]string{enrollmentLabel: strings.Clone(v)}
		}
		return out, nil
	}
}

func (c *podCache) Pod(ctx context.Context, namespace, name string) (*corev1.Pod, error) {
	return cachedOrRead(ctx, c.cacheWait,
		func() (*corev1.Pod, error) { return c.pods.Pods(namespace).Get(name) },
		func(ctx context.Context) (*corev1.Pod, error) {
			pod, err := c.Live(ctx, namespace, name)
			if err == nil && pod.Spec.NodeName != c.node {
				// A request for another node's pod (the runtime only starts
				// pods bound here) must not get rules into the netns it names.
				return nil, fmt.Errorf("pod %s/%s is bound to node %q, not this node %q; refusing it", namespace, name, pod.Spec.NodeName, c.node)
			}
			return pod, err
		})
}

// Live reads the pod from the API, past the cache.
func (c *podCache) Live(ctx context.Context, namespace, name string) (*corev1.Pod, error) {
	return c.client.CoreV1().Pods(namespace).Get(ctx, name, metav1.GetOptions{})
}

// liveOrGone is Live, bounded, with nil for a pod that does not exist.
func (c *podCache) liveOrGone(ctx context.Context, key types.NamespacedName) (*corev1.Pod, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	pod, err := c.Live(ctx, key.Namespace, key.Name)
	if apierrors.IsNotFound(err) {
		return nil, nil
	}
	return pod, err
}

// Namespace is waited for like a pod: the namespace watch may lag the pod
// watch (a namespace created just before its pod, an agent whose namespace
// LIST is slow or throttled at start-up), and a namespace missing from the
// cache must never read as "not labelled".
func (c *podCache) Namespace(ctx context.Context, name string) (*corev1.Namespace, error) {
	return cachedOrRead(ctx, c.cacheWait,
		func() (*corev1.Namespace, error) { return c.cachedNamespace(name) },
		func(ctx context.Context) (*corev1.Namespace, error) {
			return c.client.CoreV1().Namespaces().Get(ctx, name, metav1.GetOptions{})
		})
}

// cachedNamespace is the namespace as the metadata watch has it: the
// policy reads only its labels.
func (c *podCache) cachedNamespace(name string) (*corev1.Namespace, error) {
	m, err := c.namespaces.Get(name)
	if err != nil {
		return nil, err
	}
	return &corev1.Namespace{ObjectMeta: m.ObjectMeta}, nil
}

// cachedOrRead answers from the cache, waiting up to wait for the watch to
// deliver an object it lacks, then reads the API once.
func cachedOrRead[T any](ctx context.Context, wait time.Duration, cached func() (T, error), read func(context.Context) (T, error)) (T, error) {
	deadline := time.Now().Add(wait)
	for {
		obj, err := cached()
		if err == nil {
			return obj, nil
		}
		if !apierrors.IsNotFound(err) {
			return obj, err
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	return read(rctx)
}

// notEnrolled decides, from the cache, whether a pod is known not to be
// enrolled: a pod whose namespace the cache lacks is not known.
func (c *podCache) notEnrolled(policy enrollment.Policy) passlist.Decide {
	return func(namespace, name string) (string, bool, bool) {
		pod, err := c.pods.Pods(namespace).Get(name)
		if err != nil {
			return "", false, false
		}
		// The UID the runtime will name, so a static pod's sandbox
		// (named by its manifest's hash) matches its mirror's entry.
		uid := enroll.SandboxUID(pod)
		ns, err := c.cachedNamespace(namespace)
		if err != nil {
			return uid, false, true
		}
		return uid, !policy.Enrolled(pod, ns), true
	}
}

// podsOfNamespace lists this node's pods in a namespace from the cache.
func (c *podCache) podsOfNamespace(ns string) []*corev1.Pod {
	pods, _ := c.pods.Pods(ns).List(labels.Everything())
	return pods
}

func handlerFuncs(add func(obj any), del func(obj any)) cache.ResourceEventHandlerFuncs {
	return cache.ResourceEventHandlerFuncs{
		AddFunc:    add,
		UpdateFunc: func(_, obj any) { add(obj) },
		DeleteFunc: del,
	}
}

// sandboxCheckInterval paces the backstop sweep over enrolled pods. Pod
// updates already reconcile (and so verify) a pod whose status says the
// kubelet recreated its sandbox; the sweep catches one whose status did not
// change: a reconcile checks a sandbox not checked for this long.
const sandboxCheckInterval = enroll.DefaultSandboxCheckEvery

// checkSandboxes queues every enrolled pod each interval; reconcile then
// verifies that its sandbox is the netns inpod holds.
func checkSandboxes(ctx context.Context, every time.Duration, enrolled func() []types.NamespacedName, queue interface{ Add(types.NamespacedName) }) {
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			for _, key := range enrolled() {
				queue.Add(key)
			}
		}
	}
}
