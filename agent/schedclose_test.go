package agent

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	"github.com/inpod-dev/inpod/deviceplugin"
	"github.com/inpod-dev/inpod/internal/testkit"
)

// The closer's own decisions, with a fake API for the faults
// (TestIntegrationDevicePluginGateClosesSchedulingFirst runs it against a
// real API server).

const closeRes = corev1.ResourceName(deviceplugin.DefaultResourceName)

func closeWorld(t *testing.T, pods ...*corev1.Pod) (*fake.Clientset, *schedulingCloser) {
	t.Helper()
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-a"}, Status: corev1.NodeStatus{
		Capacity:    corev1.ResourceList{closeRes: resource.MustParse("4")},
		Allocatable: corev1.ResourceList{closeRes: resource.MustParse("4")}}}
	objs := []runtime.Object{node}
	for _, p := range pods {
		objs = append(objs, p)
	}
	client := fake.NewClientset(objs...)
	c := newSchedulingCloser(client, "node-a", closeRes, slog.New(slog.DiscardHandler))
	c.settle, c.poll = 100*time.Millisecond, 10*time.Millisecond
	return client, c
}

func boundPod(name string, requests bool) *corev1.Pod {
	p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "mesh", Name: name},
		Spec:   corev1.PodSpec{NodeName: "node-a", Containers: []corev1.Container{{Name: "app"}}},
		Status: corev1.PodStatus{Phase: corev1.PodPending}}
	if requests {
		p.Spec.Containers[0].Resources.Limits = corev1.ResourceList{closeRes: resource.MustParse("1")}
	}
	return p
}

func allocatableOf(t *testing.T, client *fake.Clientset) int64 {
	t.Helper()
	n, err := client.CoreV1().Nodes().Get(context.Background(), "node-a", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	q := n.Status.Allocatable[closeRes]
	return q.Value()
}

func runClose(c *schedulingCloser, timeout time.Duration) (<-chan error, time.Time) {
	done := make(chan error, 1)
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	go func() { defer cancel(); done <- c.CloseScheduling(ctx) }()
	return done, time.Now()
}

// A close ends once every bound pod requesting the resource has a start
// time, and no sooner than the settle time after the Node's count read 0;
// pods that do not request the resource, or that the kubelet decided on,
// do not hold it.
func TestCloseWaitsForBoundPodsThenTheSettleTime(t *testing.T) {
	decided := boundPod("refused", true)
	decided.Status.Phase = corev1.PodFailed
	client, c := closeWorld(t, boundPod("waiting", true), boundPod("plain", false), decided)
	done, start := runClose(c, time.Minute)
	testkit.Eventually(t, 10*time.Second, "the Node's count written 0, and the close holding past its settle time", func() bool {
		select {
		case err := <-done:
			t.Fatalf("the close ended (%v) with a bound pod not yet admitted", err)
		default:
		}
		return allocatableOf(t, client) == 0 && time.Since(start) > 5*c.settle
	})
	p, _ := client.CoreV1().Pods("mesh").Get(context.Background(), "waiting", metav1.GetOptions{})
	now := metav1.Now()
	p.Status.StartTime = &now
	if _, err := client.CoreV1().Pods("mesh").UpdateStatus(context.Background(), p, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the close did not end once the pod was admitted")
	}

	// With nothing bound, the settle time alone.
	client, c = closeWorld(t)
	done, start = runClose(c, time.Minute)
	if err := <-done; err != nil || time.Since(start) < c.settle {
		t.Fatalf("close with nothing bound: %v after %s, want nil after at least %s", err, time.Since(start), c.settle)
	}
	if n := allocatableOf(t, client); n != 0 {
		t.Fatalf("the Node's count %d after the close, want 0", n)
	}
}

// A list that fails (throttled, timed out) keeps what was last seen: a pod
// seen waiting still holds the close, which ends incomplete at its
// deadline, naming why.
func TestCloseKeepsTheLastListWhenListingFails(t *testing.T) {
	client, c := closeWorld(t, boundPod("waiting", true))
	var lists atomic.Int32
	client.PrependReactor("list", "pods", func(k8stesting.Action) (bool, runtime.Object, error) {
		if lists.Add(1) > 1 {
			return true, nil, errors.New("the server has received too many requests")
		}
		return false, nil, nil
	})
	done, _ := runClose(c, 500*time.Millisecond)
	err := <-done
	if err == nil || !strings.Contains(err.Error(), "mesh/waiting") || !strings.Contains(err.Error(), "too many requests") {
		t.Fatalf("close with failing lists = %v, want incomplete, naming the pod last seen waiting and the list error", err)
	}
}

// The Node's count written back by the kubelet during a close is written 0
// again, and the close reads the Node afresh before it ends.
func TestCloseWritesZeroAgainAfterTheKubeletsSync(t *testing.T) {
	client, c := closeWorld(t)
	var patches atomic.Int32
	client.PrependReactor("patch", "nodes", func(k8stesting.Action) (bool, runtime.Object, error) {
		patches.Add(1)
		return false, nil, nil
	})
	// The kubelet's sync lands as the close reads the Node for the last
	// time: the first read after the settle time sees 4.
	var restored atomic.Bool
	client.PrependReactor("get", "nodes", func(k8stesting.Action) (bool, runtime.Object, error) {
		if patches.Load() == 1 && !restored.Load() {
			restored.Store(true)
			n, _ := client.Tracker().Get(corev1.SchemeGroupVersion.WithResource("nodes"), "", "node-a")
			node := n.(*corev1.Node).DeepCopy()
			node.Status.Allocatable[closeRes] = resource.MustParse("4")
			client.Tracker().Update(corev1.SchemeGroupVersion.WithResource("nodes"), node, "")
		}
		return false, nil, nil
	})
	done, _ := runClose(c, time.Minute)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if n := allocatableOf(t, client); n != 0 || patches.Load() != 2 {
		t.Fatalf("after the close: count %d, %d writes; want 0 after writing it again", n, patches.Load())
	}
}
