package observe

import (
	"context"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/tools/record"
)

// Events records Kubernetes events on pods, as "inpod-agent" on this node.
type Events struct {
	recorder record.EventRecorder
}

// NewEvents starts an event broadcaster that stops with ctx.
func NewEvents(ctx context.Context, client kubernetes.Interface, node string) *Events {
	b := record.NewBroadcaster(record.WithContext(ctx))
	b.StartRecordingToSink(&typedcorev1.EventSinkImpl{Interface: client.CoreV1().Events("")})
	go func() {
		<-ctx.Done()
		b.Shutdown()
	}()
	return &Events{recorder: b.NewRecorder(scheme.Scheme, corev1.EventSource{Component: "inpod-agent", Host: node})}
}

// Warn implements enroll.Events.
func (e *Events) Warn(pod *corev1.Pod, reason, message string) {
	e.recorder.Event(pod, corev1.EventTypeWarning, reason, message)
}
