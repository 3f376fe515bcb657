// Package podcondition writes the per-pod proof of redirection: the pod
// condition inpod.dev/redirected, which the chart's admission policy (or
// inpod-controller's webhook) makes a readiness gate of every enrolled pod,
// so that a Service sends an enrolled pod traffic only once inpod has
// proven its redirection, and stops while a loss is found that cannot be
// repaired at once.
//
// The Writer converges each pod's condition to the last value asked for,
// off the CNI critical path, the way enroll.AnnotationWriter converges the
// redirection annotation: one pending value per pod object (name and UID:
// a write for a pod that was replaced under the same name is dropped, never
// applied to the replacement), retried with a bounded backoff through an
// API server outage.
//
// It writes only what changes. A Set that says what the pod already
// carries, as far as the writer knows (it wrote it, or read it the first
// time it was asked about the pod), writes nothing; lastTransitionTime is
// sent only when the status changes, so a new reason or message keeps it.
// The patch is a strategic merge on the status subresource, where
// conditions merge on their type: the kubelet's conditions (Ready,
// ContainersReady, ...) and anyone else's are never touched.
package podcondition

import (
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

	"github.com/inpod-dev/inpod/enrollment"
)

// ConditionType is the pod condition, and the readiness gate's
// conditionType (docs/design/verification.md).
const ConditionType corev1.PodConditionType = enrollment.RedirectedCondition

// Defaults.
const (
	// DefaultMinBackoff and DefaultMaxBackoff bound the wait before a
	// failed write is tried again (doubling per failure of that pod). The
	// maximum is short because a pod's readiness waits on the write: once
	// the API server is back, every pending condition lands within it.
	DefaultMinBackoff = 200 * time.Millisecond
	DefaultMaxBackoff = 10 * time.Second
	// attemptTimeout bounds one attempt (a read and a patch), so a hung
	// connection cannot hold the queue behind one pod.
	attemptTimeout = 10 * time.Second
	// maxFlushErrors bounds the failures Flush lists: with the API server
	// away, every write fails the same way.
	maxFlushErrors = 5
)

// Observer counts the writer's work, for metrics.
type Observer interface {
	// Written counts a patch the API server accepted.
	Written()
	// Failed counts a failed attempt (it is retried).
	Failed()
}

// Config configures a Writer.
type Config struct {
	// Client patches pods/status (and reads a pod: see Current).
	Client kubernetes.Interface
	Logger *slog.Logger
	// Observer may be nil.
	Observer Observer
	// Current returns the pod as the agent's watch last saw it (nil when
	// it has none). The writer asks it once per pod object, the first time
	// it is asked to set a condition it has not written itself, to learn
	// what the pod already carries: a restarted agent then writes nothing
	// for a pod whose condition already says what it finds, and keeps the
	// lastTransitionTime of a condition whose status it does not change.
	// nil: the writer reads the pod from the API server instead (a GET per
	// pod object).
	Current func(types.NamespacedName) *corev1.Pod
	// MinBackoff and MaxBackoff: see DefaultMinBackoff (zero: default).
	MinBackoff, MaxBackoff time.Duration
	// Now stamps lastTransitionTime (nil: time.Now).
	Now func() time.Time
}

// Writer converges pods' ConditionType condition. Set and Forget may be
// called from any goroutine; Run writes.
type Writer struct {
	cfg   Config
	log   *slog.Logger
	queue workqueue.TypedRateLimitingInterface[podKey]

	mu sync.Mutex
	// want is what a pod should carry and may not yet: at most one value
	// per pod object (a newer Set replaces it).
	want map[podKey]condition
	// last is what a pod carries as far as the writer knows: what it
	// wrote, or read once. Absent: not known (a write then stamps a new
	// lastTransitionTime).
	last map[podKey]condition
	// unsure are the pods whose last patch failed: it may have landed all
	// the same (a timeout after the API server applied it), so what the
	// pod carries is read from the API server, never from a cache that
	// may not show that write yet.
	unsure map[podKey]bool
}

// podKey names one pod object: a StatefulSet's pod comes back under its old
// name with a new UID, and a condition meant for the old one must not make
// the new one Ready.
type podKey struct {
	types.NamespacedName
	UID types.UID
}

// condition is what the writer sets of the pod's condition.
type condition struct {
	status          corev1.ConditionStatus
	reason, message string
}

// New returns a writer; Run starts it.
func New(cfg Config) *Writer {
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if cfg.Observer == nil {
		cfg.Observer = nopObserver{}
	}
	if cfg.MinBackoff <= 0 {
		cfg.MinBackoff = DefaultMinBackoff
	}
	if cfg.MaxBackoff < cfg.MinBackoff {
		cfg.MaxBackoff = max(DefaultMaxBackoff, cfg.MinBackoff)
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	return &Writer{
		cfg: cfg,
		log: cfg.Logger.With("component", "podcondition"),
		queue: workqueue.NewTypedRateLimitingQueue(
			workqueue.NewTypedItemExponentialFailureRateLimiter[podKey](cfg.MinBackoff, cfg.MaxBackoff)),
		want:   map[podKey]condition{},
		last:   map[podKey]condition{},
		unsure: map[podKey]bool{},
	}
}

// Set asks for the pod object's condition: status True when proven, else
// False; reason and message as given ("" leaves them out). It returns at
// once; Run writes. A Set for a pod object that no longer exists (deleted,
// or its name now another pod's) is dropped. A Set without a UID is
// refused: it would land on whatever pod has the name.
func (w *Writer) Set(pod types.NamespacedName, uid types.UID, proven bool, reason, message string) {
	if uid == "" {
		w.log.Error("condition not written: no pod UID to write it to (a bug)", "pod", pod, "proven", proven)
		return
	}
	k := podKey{pod, uid}
	c := condition{status: corev1.ConditionFalse, reason: reason, message: message}
	if proven {
		c.status = corev1.ConditionTrue
	}
	w.mu.Lock()
	// Nothing pending and the pod carries it already: no write. With a
	// write pending (maybe in flight) the new value must be queued even
	// when it equals last, or the pending one would land after it.
	if _, pending := w.want[k]; !pending {
		if l, known := w.last[k]; known && l == c {
			w.mu.Unlock()
			return
		}
	}
	w.want[k] = c
	w.mu.Unlock()
	w.queue.Add(k)
}

// Forget drops what the writer holds for the pod object (a pending write,
// and what it knows the pod carries): call it when the pod is deleted, or
// the writer's memory grows with every pod the node ever ran.
func (w *Writer) Forget(pod types.NamespacedName, uid types.UID) {
	k := podKey{pod, uid}
	w.mu.Lock()
	delete(w.want, k)
	delete(w.last, k)
	delete(w.unsure, k)
	w.mu.Unlock()
}

// Run writes until ctx ends.
func (w *Writer) Run(ctx context.Context) {
	go func() {
		<-ctx.Done()
		w.queue.ShutDown()
	}()
	for {
		k, quit := w.queue.Get()
		if quit {
			return
		}
		actx, cancel := context.WithTimeout(ctx, attemptTimeout)
		err := w.write(actx, k)
		cancel()
		switch {
		case err == nil:
			if n := w.queue.NumRequeues(k); n > 0 {
				w.log.Info("condition written after failed attempts", "pod", k.NamespacedName, "uid", k.UID, "failed", n)
			}
			w.queue.Forget(k)
		case ctx.Err() != nil:
			// Stopping: Flush may still write it.
		default:
			w.cfg.Observer.Failed()
			// The first failure of each pod is worth a warning; the
			// retries of an outage would repeat it every few seconds for
			// every pod.
			level := slog.LevelDebug
			if w.queue.NumRequeues(k) == 0 {
				level = slog.LevelWarn
			}
			w.log.Log(ctx, level, "condition not written yet; retrying", "pod", k.NamespacedName, "uid", k.UID, "err", err)
			w.queue.AddRateLimited(k)
		}
		w.queue.Done(k)
	}
}

// Flush writes every pending condition now, once each, for a graceful stop
// after Run has returned; it returns the failures.
func (w *Writer) Flush(ctx context.Context) error {
	w.mu.Lock()
	keys := make([]podKey, 0, len(w.want))
	for k := range w.want {
		keys = append(keys, k)
	}
	w.mu.Unlock()
	var errs []error
	for i, k := range keys {
		if ctx.Err() != nil {
			errs = append(errs, fmt.Errorf("%d pod conditions not written: %w", len(keys)-i, context.Cause(ctx)))
			break
		}
		if err := w.write(ctx, k); err != nil {
			w.cfg.Observer.Failed()
			errs = append(errs, fmt.Errorf("condition of pod %s (uid %s): %w", k.NamespacedName, k.UID, err))
			if len(errs) == maxFlushErrors {
				errs = append(errs, fmt.Errorf("and %d more not tried", len(keys)-i-1))
				break
			}
		}
	}
	return errors.Join(errs...)
}

// PendingFor says whether the pod object waits for a write (or one is in
// flight).
func (w *Writer) PendingFor(pod types.NamespacedName, uid types.UID) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	_, pending := w.want[podKey{pod, uid}]
	return pending
}

// Pending is how many pod objects wait for a write.
func (w *Writer) Pending() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.want)
}

// write sends the pod object's pending condition, if any; nil when it is
// written, not needed, or dropped because the pod object is gone.
func (w *Writer) write(ctx context.Context, k podKey) error {
	w.mu.Lock()
	c, pending := w.want[k]
	last, known := w.last[k]
	w.mu.Unlock()
	if !pending {
		return nil
	}
	if !known {
		var gone bool
		var err error
		w.mu.Lock()
		fromAPI := w.unsure[k]
		w.mu.Unlock()
		last, known, gone, err = w.carried(ctx, k, fromAPI)
		if err != nil {
			return err
		}
		if gone {
			w.drop(k)
			return nil
		}
		if known {
			w.mu.Lock()
			if _, ok := w.last[k]; !ok {
				w.last[k] = last
			}
			w.mu.Unlock()
		}
	}
	if known && last == c {
		w.written(k, c)
		return nil
	}
	err := w.patch(ctx, k, c, !known || last.status != c.status)
	if err != nil && (apierrors.IsConflict(err) || apierrors.IsInvalid(err)) {
		err = w.goneUnlessSame(ctx, k, err)
	}
	if apierrors.IsNotFound(err) {
		// The pod is gone, or its name is another pod's: so is the
		// condition's reason to be.
		w.drop(k)
		return nil
	}
	if err != nil {
		// Landed or not, the pod may no longer carry last: a Set of
		// last meanwhile (labelled out and back) must still be written.
		w.mu.Lock()
		delete(w.last, k)
		w.unsure[k] = true
		w.mu.Unlock()
		return err
	}
	w.cfg.Observer.Written()
	w.written(k, c)
	return nil
}

// carried is the condition the pod object carries now (known false: none),
// from Config.Current or else (or fromAPI) the API server; gone when the
// pod is deleted or its name belongs to another pod.
func (w *Writer) carried(ctx context.Context, k podKey, fromAPI bool) (c condition, known, gone bool, err error) {
	var pod *corev1.Pod
	if w.cfg.Current != nil && !fromAPI {
		// A cached pod of another UID may be the cache lagging behind a
		// replacement, either way: the patch's UID precondition decides.
		if pod = w.cfg.Current(k.NamespacedName); pod == nil || pod.UID != k.UID {
			return condition{}, false, false, nil
		}
	} else {
		pod, err = w.cfg.Client.CoreV1().Pods(k.Namespace).Get(ctx, k.Name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return condition{}, false, true, nil
		}
		if err != nil {
			return condition{}, false, false, err
		}
		if pod.UID != k.UID {
			return condition{}, false, true, nil
		}
	}
	for _, pc := range pod.Status.Conditions {
		if pc.Type == ConditionType {
			return condition{status: pc.Status, reason: pc.Reason, message: pc.Message}, true, false, nil
		}
	}
	return condition{}, false, false, nil
}

// patch writes c with a strategic merge patch of the status subresource
// (conditions merge on type). The UID cannot change, so the API server
// refuses the patch when the name now belongs to another pod.
func (w *Writer) patch(ctx context.Context, k podKey, c condition, transition bool) error {
	cond := map[string]any{
		"type":   ConditionType,
		"status": c.status,
		// null deletes the key: a reason or message of an earlier
		// status must not stay behind.
		"reason":  nilIfEmpty(c.reason),
		"message": nilIfEmpty(c.message),
	}
	if transition {
		cond["lastTransitionTime"] = metav1.NewTime(w.cfg.Now())
	}
	body, err := json.Marshal(map[string]any{
		"metadata": map[string]any{"uid": k.UID},
		"status":   map[string]any{"conditions": []any{cond}},
	})
	if err != nil {
		return err
	}
	_, err = w.cfg.Client.CoreV1().Pods(k.Namespace).Patch(ctx, k.Name, types.StrategicMergePatchType, body, metav1.PatchOptions{}, "status")
	return err
}

func nilIfEmpty(s string) any {
	if s == "" {
		return nil
	}
	return s
}

// goneUnlessSame tells a patch refused because the name now belongs to
// another pod (NotFound) from one refused for any other reason (patchErr,
// retried).
func (w *Writer) goneUnlessSame(ctx context.Context, k podKey, patchErr error) error {
	current, err := w.cfg.Client.CoreV1().Pods(k.Namespace).Get(ctx, k.Name, metav1.GetOptions{})
	if err != nil {
		return err
	}
	if current.UID != k.UID {
		w.log.Debug("condition dropped: the pod's name now belongs to another pod", "pod", k.NamespacedName, "uid", k.UID, "now", current.UID)
		return apierrors.NewNotFound(corev1.Resource("pods"), k.Name)
	}
	return patchErr
}

// written records that the pod carries c; the pending value is done unless
// a newer Set replaced it meanwhile.
func (w *Writer) written(k podKey, c condition) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.last[k] = c
	delete(w.unsure, k)
	if w.want[k] == c {
		delete(w.want, k)
	}
}

// drop forgets a pod object that is gone.
func (w *Writer) drop(k podKey) {
	w.mu.Lock()
	defer w.mu.Unlock()
	delete(w.want, k)
	delete(w.last, k)
	delete(w.unsure, k)
}

type nopObserver struct{}

func (nopObserver) Written() {}
func (nopObserver) Failed()  {}
