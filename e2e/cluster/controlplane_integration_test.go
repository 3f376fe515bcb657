//go:build integration

package cluster_test

import (
	"context"
	"os"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"

	"github.com/inpod-dev/inpod/e2e/cluster"
)

func TestIntegrationControlPlaneServesPods(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	start := time.Now()
	cp, err := cluster.StartControlPlane(ctx, cluster.Config{Root: t.TempDir() + "/cp"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := cp.Stop(); err != nil {
			t.Error(err)
		}
	})
	t.Logf("control plane ready in %s", time.Since(start).Round(time.Millisecond))

	pods := cp.Client.CoreV1().Pods("default")
	w, err := pods.Watch(ctx, metav1.ListOptions{FieldSelector: "metadata.name=watched"})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Stop()
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "watched", Labels: map[string]string{"istio.io/dataplane-mode": "ambient"}},
		Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "c", Image: "inpod.dev/e2e/testapp:dev"}}},
	}
	if _, err := pods.Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	select {
	case ev := <-w.ResultChan():
		got, ok := ev.Object.(*corev1.Pod)
		if ev.Type != watch.Added || !ok || got.Labels["istio.io/dataplane-mode"] != "ambient" {
			t.Fatalf("watch event %s %T, want the created pod", ev.Type, ev.Object)
		}
	case <-ctx.Done():
		t.Fatal("no watch event for the created pod")
	}
}

// A run killed midway leaves processes, mounts and state; the next start
// must clear them rather than fail.
func TestIntegrationStartClearsLeftoversOfAKilledRun(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	root := t.TempDir() + "/cp"
	first, err := cluster.StartControlPlane(ctx, cluster.Config{Root: root})
	if err != nil {
		t.Fatal(err)
	}
	// "Kill" the first run: never Stop it, and leave a mount in its state.
	stale := root + "/kubelet/pods/x/volumes/tmp"
	if err := os.MkdirAll(stale, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("tmpfs", stale, "tmpfs", 0, ""); err != nil {
		t.Fatal(err)
	}
	etcdPID := first.PID("etcd")

	second, err := cluster.StartControlPlane(ctx, cluster.Config{Root: root})
	if err != nil {
		t.Fatalf("start over leftovers: %v", err)
	}
	t.Cleanup(func() { second.Stop() })
	if err := unix.Kill(etcdPID, 0); err == nil {
		t.Errorf("the killed run's etcd (pid %d) still runs", etcdPID)
	}
	if mounts, _ := os.ReadFile("/proc/self/mountinfo"); strings.Contains(string(mounts), stale) {
		t.Error("the killed run's mount is still there")
	}
	if _, err := second.Client.CoreV1().Namespaces().List(ctx, metav1.ListOptions{}); err != nil {
		t.Fatal(err)
	}
}
