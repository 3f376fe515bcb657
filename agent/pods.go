package agent

import (
	"context"
	"fmt"
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
	"k8s.io/client-go/tools/cache"

	"github.com/inpod-dev/inpod/agent/enroll"
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
	namespaces listersv1.NamespaceLister
	// cacheWait bounds how long a CNI event waits for the watch to deliver a
	// pod it has not seen yet, before one direct API read.
	cacheWait time.Duration
}

func newInformers(client kubernetes.Interface, node string) (podInf, nsInf informers.SharedInformerFactory) {
	podInf = informers.NewSharedInformerFactoryWithOptions(client, 0,
		informers.WithTweakListOptions(func(o *metav1.ListOptions) {
			o.FieldSelector = fields.OneTermEqualSelector("spec.nodeName", node).String()
		}))
	nsInf = informers.NewSharedInformerFactory(client, 0)
	return podInf, nsInf
}

func (c *podCache) Pod(ctx context.Context, namespace, name string) (*corev1.Pod, error) {
	return cachedOrRead(ctx, c.cacheWait,
		func() (*corev1.Pod, error) { return c.pods.Pods(namespace).Get(name) },
		func(ctx context.Context) (*corev1.Pod, error) {
			pod, err := c.client.CoreV1().Pods(namespace).Get(ctx, name, metav1.GetOptions{})
			if err == nil && pod.Spec.NodeName != c.node {
				// A request for another node's pod (the runtime only starts
				// pods bound here) must not get rules into the netns it names.
				return nil, fmt.Errorf("pod %s/%s is bound to node %q, not this node %q; refusing it", namespace, name, pod.Spec.NodeName, c.node)
			}
			return pod, err
		})
}

// Namespace is waited for like a pod: the namespace watch may lag the pod
// watch (a namespace created just before its pod, an agent whose namespace
// LIST is slow or throttled at start-up), and a namespace missing from the
// cache must never read as "not labelled".
func (c *podCache) Namespace(ctx context.Context, name string) (*corev1.Namespace, error) {
	return cachedOrRead(ctx, c.cacheWait,
		func() (*corev1.Namespace, error) { return c.namespaces.Get(name) },
		func(ctx context.Context) (*corev1.Namespace, error) {
			return c.client.CoreV1().Namespaces().Get(ctx, name, metav1.GetOptions{})
		})
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
func (c *podCache) notEnrolled(policy enroll.Policy) passlist.Decide {
	return func(namespace, name string) (string, bool, bool) {
		pod, err := c.pods.Pods(namespace).Get(name)
		if err != nil {
			return "", false, false
		}
		// The UID the runtime will name, so a static pod's sandbox
		// (named by its manifest's hash) matches its mirror's entry.
		uid := enroll.SandboxUID(pod)
		ns, err := c.namespaces.Get(namespace)
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
