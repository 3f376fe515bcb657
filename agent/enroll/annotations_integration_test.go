//go:build integration

package enroll

import (
	"context"
	"log/slog"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"

	"github.com/inpod-dev/inpod/e2e/cluster"
	"github.com/inpod-dev/inpod/e2e/cluster/clustertest"
	"github.com/inpod-dev/inpod/enrollment"
)

func createPod(t *testing.T, c kubernetes.Interface, name types.NamespacedName) *corev1.Pod {
	t.Helper()
	pod, err := c.CoreV1().Pods(name.Namespace).Create(context.Background(), &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: name.Namespace, Name: name.Name},
		Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "app", Image: "app"}}},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return pod
}

func redirectionAnnotation(t *testing.T, c kubernetes.Interface, name types.NamespacedName) (string, types.UID) {
	t.Helper()
	pod, err := c.CoreV1().Pods(name.Namespace).Get(context.Background(), name.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return pod.Annotations[enrollment.RedirectionAnnotation], pod.UID
}

// TestIntegrationAnnotationFollowsThePodNotItsName: a StatefulSet's pod
// comes back under its old name with a new UID, possibly outside the mesh
// (its namespace unlabelled meanwhile), while the old pod's "enabled" still
// waits to be written (the writer defers its writes past a burst and
// retries through an API outage). Istio's peers send HBONE to a pod
// annotated "enabled", so the new pod must not get it, and must not lose
// the annotation its own enrollment asked for to the old pod's removal.
func TestIntegrationAnnotationFollowsThePodNotItsName(t *testing.T) {
	cp := clustertest.ControlPlane(t, cluster.Config{})
	ctx := context.Background()
	c := cp.Client
	if _, err := c.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "mesh"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	name := types.NamespacedName{Namespace: "mesh", Name: "web-0"}
	w := NewAnnotationWriter(c, nil, slog.New(slog.DiscardHandler))

	old := createPod(t, c, name)
	w.Set(name, old.UID, enrollment.AnnotationEnabled)
	if err := w.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	if got, _ := redirectionAnnotation(t, c, name); got != enrollment.AnnotationEnabled {
		t.Fatalf("annotation on the pod it was asked for: %q, want %q", got, enrollment.AnnotationEnabled)
	}

	// The old pod asks again (a reconcile) and is replaced before the
	// write goes out.
	w.Set(name, old.UID, enrollment.AnnotationEnabled)
	if err := c.CoreV1().Pods(name.Namespace).Delete(ctx, name.Name, *metav1.NewDeleteOptions(0)); err != nil {
		t.Fatal(err)
	}
	replacement := createPod(t, c, name)
	if err := w.Flush(ctx); err != nil {
		t.Fatalf("a write for a pod that is gone must be dropped, not failed: %v", err)
	}
	if got, uid := redirectionAnnotation(t, c, name); got != "" {
		t.Fatalf("the old pod's %q landed on its replacement (UID %s, old %s)", got, uid, old.UID)
	}
	if n := len(w.want); n != 0 {
		t.Fatalf("%d writes still wanted after the pod they were for is gone", n)
	}

	// The replacement is enrolled; the old pod's removal comes after.
	w.Set(name, replacement.UID, enrollment.AnnotationEnabled)
	w.Set(name, old.UID, "")
	if err := w.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	if got, _ := redirectionAnnotation(t, c, name); got != enrollment.AnnotationEnabled {
		t.Fatalf("the replacement's annotation after the old pod's removal: %q, want %q", got, enrollment.AnnotationEnabled)
	}
	if n := len(w.want); n != 0 {
		t.Fatalf("%d writes still wanted", n)
	}
}
