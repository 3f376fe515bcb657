package enroll

import (
	"github.com/inpod-dev/inpod/enrollment"

	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/util/workqueue"
)

// AnnotationWriter converges each pod's redirection annotation to the last
// value asked for, off the CNI critical path, retrying with backoff through
// an API server outage.
//
// It also keeps its writes out of a burst of pod starts: while the agent
// serves CNI events it waits for them to end, up to MaxDefer into each
// busy spell, and not at all with MaxDeferredBacklog pods waiting. Each
// patch costs the node CPU (the request, and the watch event it echoes
// back) that the ADDs in flight need, and on a node that hosts the control
// plane the API server's and etcd's too. A pod's "pending" is then usually
// replaced by its "enabled" before either is sent, one patch instead of
// two. Nothing waits on the annotation: the rules and ztunnel's Ack are in
// place before the ADD is answered, and what a restarted agent must know
// about pods whose patch has not landed, the node's record of pods with
// rules tells it (see Pipeline.Restore and package enrolledrecord).
type AnnotationWriter struct {
	client kubernetes.Interface
	log    *slog.Logger
	queue  workqueue.TypedRateLimitingInterface[annotatedPod]
	busy   Activity
	// maxDefer bounds the wait, so that on a node that never stops
	// starting pods the annotations still come, at the writer's own rate.
	maxDefer time.Duration
	// busyPeriod is the Quiet channel of the busy spell the writer last
	// waited in, and busySince when it first found it (only Run's
	// goroutine uses them). Each spell has its own channel.
	busyPeriod <-chan struct{}
	busySince  time.Time
	// backlogFull ends a wait once MaxDeferredBacklog pods are queued;
	// draining then keeps the writer from waiting until the queue is
	// empty.
	backlogFull chan struct{}
	draining    bool

	// first, maxHold and heldSince: see WriteAfter (heldSince is Run's
	// only).
	first     PendingWrites
	maxHold   time.Duration
	heldSince map[annotatedPod]time.Time

	mu   sync.Mutex
	want map[annotatedPod]string
}

// PendingWrites is another writer to pods whose pending write to a pod
// object must land before that pod's annotation (the readiness condition).
type PendingWrites interface {
	PendingFor(pod types.NamespacedName, uid types.UID) bool
}

// MaxHoldForFirst bounds how long WriteAfter holds an annotation back: a
// condition the API server keeps refusing must not keep the annotation
// away for good.
const MaxHoldForFirst = 2 * time.Second

// holdRecheck is how often a held annotation looks again: the write it
// waits for is one patch, ~10 ms.
const holdRecheck = 10 * time.Millisecond

// WriteAfter makes the writer hold a pod's annotation back while first has
// a write pending for that pod object, up to MaxHoldForFirst. The kubelet
// needs this order for the readiness condition: a metadata change it sees
// before the condition queues a sync of the pod as it was then, and when
// that sync is the one that finds the containers running it reports Ready
// False for want of the condition; Ready then waits for the kubelet's next
// relist. Measured on the real node: 7 of 20 enrolled pods whose
// annotation landed first were Ready 100–200 ms late, none of the others.
// Call it before Run.
func (w *AnnotationWriter) WriteAfter(first PendingWrites) {
	w.first = first
}

// heldForFirst says whether the pod's annotation waits for first's write;
// if so it is queued again.
func (w *AnnotationWriter) heldForFirst(pod annotatedPod) bool {
	// Only "enabled" waits: a removal tells Istio's peers to stop sending
	// the pod HBONE, and nothing waits on its order.
	w.mu.Lock()
	enabling := w.want[pod] == enrollment.AnnotationEnabled
	w.mu.Unlock()
	if !enabling || w.first == nil || !w.first.PendingFor(pod.NamespacedName, pod.UID) {
		delete(w.heldSince, pod)
		return false
	}
	since, held := w.heldSince[pod]
	if !held {
		since = time.Now()
		w.heldSince[pod] = since
	}
	if time.Since(since) >= w.maxHold {
		delete(w.heldSince, pod)
		return false
	}
	w.queue.AddAfter(pod, holdRecheck)
	return true
}

// annotatedPod names one pod object: a StatefulSet's pod comes back under
// its old name with a new UID, and an annotation asked for the old one
// must not land on the new one, which may be outside the mesh (Istio's
// peers take "enabled" to mean they may send it HBONE).
type annotatedPod struct {
	types.NamespacedName
	UID types.UID
}

// Activity tells the writer when the agent is serving CNI events.
type Activity interface {
	// Quiet returns nil when no CNI event is being served, else a channel
	// closed once none is.
	Quiet() <-chan struct{}
}

// MaxDefer is how long the writer waits at most for the CNI events in
// flight to end: a burst of 50 pod starts takes 0.1–0.25 s on a 2-core
// node.
const MaxDefer = 500 * time.Millisecond

// MaxDeferredBacklog is how many pods may wait for their annotation before
// the writer stops waiting for quiet moments: on a node whose busy spells
// follow each other it would otherwise write one patch per gap between
// them.
const MaxDeferredBacklog = 100

// NewAnnotationWriter writes through client; Run starts it. busy may be
// nil: the writer then never waits.
func NewAnnotationWriter(client kubernetes.Interface, busy Activity, log *slog.Logger) *AnnotationWriter {
	return &AnnotationWriter{
		client:      client,
		log:         log.With("component", "annotations"),
		queue:       workqueue.NewTypedRateLimitingQueue(workqueue.DefaultTypedControllerRateLimiter[annotatedPod]()),
		busy:        busy,
		maxDefer:    MaxDefer,
		backlogFull: make(chan struct{}, 1),
		want:        map[annotatedPod]string{},
		maxHold:     MaxHoldForFirst,
		heldSince:   map[annotatedPod]time.Time{},
	}
}

// Set asks for the annotation's value ("" removes it) on the pod object
// with this UID; once a pod of that name has another UID, the write is
// dropped. A write without a UID is refused: it would land on whatever pod
// has the name.
func (w *AnnotationWriter) Set(name types.NamespacedName, uid types.UID, value string) {
	if uid == "" {
		w.log.Error("annotation not written: no pod UID to write it to (a bug)", "pod", name, "value", value)
		return
	}
	pod := annotatedPod{name, uid}
	w.mu.Lock()
	w.want[pod] = value
	w.mu.Unlock()
	w.queue.Add(pod)
	if w.queue.Len() >= MaxDeferredBacklog {
		select {
		case w.backlogFull <- struct{}{}:
		default:
		}
	}
}

// Run writes until ctx ends.
func (w *AnnotationWriter) Run(ctx context.Context) {
	go func() {
		<-ctx.Done()
		w.queue.ShutDown()
	}()
	for {
		pod, quit := w.queue.Get()
		if quit {
			return
		}
		w.yield(ctx)
		if w.heldForFirst(pod) {
			w.queue.Done(pod)
			continue
		}
		err := w.write(ctx, pod)
		if err != nil {
			w.log.Warn("annotation not written yet; retrying", "pod", pod, "err", err)
			w.queue.AddRateLimited(pod)
		} else {
			w.queue.Forget(pod)
		}
		w.queue.Done(pod)
	}
}

// yield waits while CNI events are in flight, at most maxDefer into each
// busy spell; past that it writes at once, and with a long backlog until
// the queue is empty.
func (w *AnnotationWriter) yield(ctx context.Context) {
	if w.busy == nil {
		return
	}
	quiet := w.busy.Quiet()
	backlog := w.queue.Len()
	if quiet == nil || backlog < MaxDeferredBacklog && !w.draining {
		// A signal from a backlog already written must not cut the next
		// wait short.
		select {
		case <-w.backlogFull:
		default:
		}
	}
	if quiet == nil {
		w.draining = false
		return
	}
	if backlog >= MaxDeferredBacklog {
		w.draining = true
	}
	if w.draining {
		// This one is written at once too; the next waits again.
		w.draining = backlog > 0
		return
	}
	now := time.Now()
	if quiet != w.busyPeriod {
		w.busyPeriod, w.busySince = quiet, now
	}
	left := w.maxDefer - now.Sub(w.busySince)
	if left <= 0 {
		return
	}
	timer := time.NewTimer(left)
	defer timer.Stop()
	select {
	case <-quiet:
	case <-timer.C:
	case <-w.backlogFull:
		w.draining = w.queue.Len() >= MaxDeferredBacklog
	case <-ctx.Done():
	}
}

// Flush writes every pending annotation now, once each, for a shutdown
// after Run has stopped; it returns the failures.
func (w *AnnotationWriter) Flush(ctx context.Context) error {
	w.mu.Lock()
	pods := make([]annotatedPod, 0, len(w.want))
	for pod := range w.want {
		pods = append(pods, pod)
	}
	w.mu.Unlock()
	var errs []error
	for i, pod := range pods {
		if ctx.Err() != nil {
			errs = append(errs, fmt.Errorf("%d annotations not written: %w", len(pods)-i, context.Cause(ctx)))
			break
		}
		if err := w.write(ctx, pod); err != nil {
			errs = append(errs, fmt.Errorf("annotate %s: %w", pod, err))
			if len(errs) == maxFlushErrors {
				errs = append(errs, fmt.Errorf("and %d more not tried", len(pods)-i-1))
				break
			}
		}
	}
	return errors.Join(errs...)
}

// maxFlushErrors bounds the failures Flush lists: with the API server
// away, every write fails the same way.
const maxFlushErrors = 5

func (w *AnnotationWriter) write(ctx context.Context, pod annotatedPod) error {
	w.mu.Lock()
	value, ok := w.want[pod]
	w.mu.Unlock()
	if !ok {
		return nil
	}
	var v any = value
	if value == "" {
		v = nil // JSON merge patch: null deletes the key
	}
	// The UID cannot change, so the API server refuses the patch when the
	// name now belongs to another pod.
	meta := map[string]any{"annotations": map[string]any{enrollment.RedirectionAnnotation: v}, "uid": pod.UID}
	patch, _ := json.Marshal(map[string]any{"metadata": meta})
	_, err := w.client.CoreV1().Pods(pod.Namespace).Patch(ctx, pod.Name, types.MergePatchType, patch, metav1.PatchOptions{})
	if err != nil && (apierrors.IsConflict(err) || apierrors.IsInvalid(err)) {
		err = w.goneUnlessSame(ctx, pod, err)
	}
	if apierrors.IsNotFound(err) {
		err = nil // the pod is gone; so is its annotation
	}
	if err == nil {
		w.mu.Lock()
		if w.want[pod] == value {
			delete(w.want, pod)
		}
		w.mu.Unlock()
	}
	return err
}

// goneUnlessSame tells a patch refused because the name now belongs to
// another pod (NotFound: the annotation's pod is gone) from one refused
// for any other reason (patchErr, retried).
func (w *AnnotationWriter) goneUnlessSame(ctx context.Context, pod annotatedPod, patchErr error) error {
	current, err := w.client.CoreV1().Pods(pod.Namespace).Get(ctx, pod.Name, metav1.GetOptions{})
	if err != nil {
		return err
	}
	if current.UID != pod.UID {
		w.log.Debug("annotation dropped: the pod's name now belongs to another pod", "pod", pod.NamespacedName, "uid", pod.UID, "now", current.UID)
		return apierrors.NewNotFound(corev1.Resource("pods"), pod.Name)
	}
	return patchErr
}
