package enroll

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"sync"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/util/workqueue"
)

// AnnotationWriter converges each pod's redirection annotation to the last
// value asked for, off the CNI critical path, retrying with backoff through
// an API server outage.
type AnnotationWriter struct {
	client kubernetes.Interface
	log    *slog.Logger
	queue  workqueue.TypedRateLimitingInterface[types.NamespacedName]

	mu   sync.Mutex
	want map[types.NamespacedName]string
}

// NewAnnotationWriter writes through client; Run starts it.
func NewAnnotationWriter(client kubernetes.Interface, log *slog.Logger) *AnnotationWriter {
	return &AnnotationWriter{
		client: client,
		log:    log.With("component", "annotations"),
		queue:  workqueue.NewTypedRateLimitingQueue(workqueue.DefaultTypedControllerRateLimiter[types.NamespacedName]()),
		want:   map[types.NamespacedName]string{},
	}
}

// Set asks for the annotation's value ("" removes it).
func (w *AnnotationWriter) Set(pod types.NamespacedName, value string) {
	w.mu.Lock()
	w.want[pod] = value
	w.mu.Unlock()
	w.queue.Add(pod)
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

// Flush writes every pending annotation now, once each, for a shutdown
// after Run has stopped; it returns the failures.
func (w *AnnotationWriter) Flush(ctx context.Context) error {
	w.mu.Lock()
	pods := make([]types.NamespacedName, 0, len(w.want))
	for pod := range w.want {
		pods = append(pods, pod)
	}
	w.mu.Unlock()
	var errs []error
	for _, pod := range pods {
		if err := w.write(ctx, pod); err != nil {
			errs = append(errs, fmt.Errorf("annotate %s: %w", pod, err))
		}
	}
	return errors.Join(errs...)
}

func (w *AnnotationWriter) write(ctx context.Context, pod types.NamespacedName) error {
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
	patch, _ := json.Marshal(map[string]any{"metadata": map[string]any{"annotations": map[string]any{RedirectionAnnotation: v}}})
	_, err := w.client.CoreV1().Pods(pod.Namespace).Patch(ctx, pod.Name, types.MergePatchType, patch, metav1.PatchOptions{})
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
