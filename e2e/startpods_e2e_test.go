//go:build e2e

package e2e

import (
	"context"
	"fmt"
	"math"
	"slices"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	watchtools "k8s.io/client-go/tools/watch"

	"github.com/inpod-dev/inpod/e2e/images"
	"github.com/inpod-dev/inpod/internal/testkit"
)

// Starting rounds of pods and timing them: the start-up benchmark and the
// load test share these.

// startPods creates n pods named prefix-i in ns, one after the other
// (each gone before the next starts) or all at once, and returns each one's
// start-up: from its Create call to its Ready condition turning True as a
// watch sees it (client side: the condition's own timestamp has whole
// seconds). Each pod must be Ready within deadline (all at once: all of
// them).
// check, if set, sees each Ready pod (all at once: once all are Ready, so
// its work does not delay the watch and skew the times). The pods are
// deleted, and gone, before it returns.
func startPods(ctx context.Context, b testing.TB, c kubernetes.Interface, ns, prefix string, n int, concurrent bool, deadline time.Duration, check func(*corev1.Pod)) []time.Duration {
	b.Helper()
	return startShapedPods(ctx, b, c, ns, prefix, n, concurrent, deadline, nil, check)
}

// startShapedPods is startPods with shape, if set, changing each pod
// before its creation.
func startShapedPods(ctx context.Context, b testing.TB, c kubernetes.Interface, ns, prefix string, n int, concurrent bool, deadline time.Duration, shape, check func(*corev1.Pod)) []time.Duration {
	b.Helper()
	grace := int64(1)
	newPod := func(name string) *corev1.Pod {
		p := &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, Labels: map[string]string{"round": prefix}},
			Spec: corev1.PodSpec{TerminationGracePeriodSeconds: &grace, Containers: []corev1.Container{{
				Name: "app", Image: images.TestAppRef, ImagePullPolicy: corev1.PullNever, Args: []string{"--listen", ":8080"}}}},
		}
		if shape != nil {
			shape(p)
		}
		return p
	}
	pods := c.CoreV1().Pods(ns)
	ready := func(o any) (*corev1.Pod, bool) {
		p, ok := o.(*corev1.Pod)
		if !ok {
			return nil, false
		}
		for _, cond := range p.Status.Conditions {
			if cond.Type == corev1.PodReady && cond.Status == corev1.ConditionTrue {
				return p, true
			}
		}
		return p, false
	}
	var took []time.Duration
	if !concurrent {
		for i := range n {
			name := fmt.Sprintf("%s-%d", prefix, i)
			w, err := pods.Watch(ctx, metav1.ListOptions{FieldSelector: "metadata.name=" + name})
			if err != nil {
				b.Fatal(err)
			}
			var got *corev1.Pod
			start := time.Now()
			if _, err := pods.Create(ctx, newPod(name), metav1.CreateOptions{}); err != nil {
				b.Fatal(err)
			}
			at := waitEvent(ctx, b, w, deadline, ns+"/"+name+" Ready", func(o any) bool {
				p, ok := ready(o)
				got = p
				return ok
			})
			took = append(took, at.Sub(start))
			if check != nil {
				check(got)
			}
			deletePods(ctx, b, c, ns, prefix)
		}
		return took
	}

	// A watch that resumes where it ended: on a loaded machine the API
	// server ended a plain watch of a 100-pod round minutes in.
	sel := "round=" + prefix
	before, err := pods.List(ctx, metav1.ListOptions{LabelSelector: sel})
	if err != nil {
		b.Fatal(err)
	}
	w, err := watchtools.NewRetryWatcherWithContext(ctx, before.ResourceVersion, &cache.ListWatch{
		WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			o.LabelSelector = sel
			return pods.Watch(ctx, o)
		}})
	if err != nil {
		b.Fatal(err)
	}
	defer w.Stop()
	var (
		mu     sync.Mutex
		starts = map[string]time.Time{}
		wg     sync.WaitGroup
		failed = make(chan error, n)
	)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			name := fmt.Sprintf("%s-%d", prefix, i)
			mu.Lock()
			starts[name] = time.Now()
			mu.Unlock()
			if _, err := pods.Create(ctx, newPod(name), metav1.CreateOptions{}); err != nil {
				failed <- err
			}
		}()
	}
	readyAt := map[string]time.Time{}
	var readyPods []*corev1.Pod
	timeout := time.After(deadline)
	for len(readyAt) < n {
		select {
		case ev, ok := <-w.ResultChan():
			if !ok {
				b.Fatalf("the watch of %s ended", ns)
			}
			if ev.Type == watch.Error {
				b.Logf("the watch of %s: %v", ns, apierrors.FromObject(ev.Object))
				continue
			}
			if p, ok := ready(ev.Object); ok && ev.Type != watch.Deleted {
				if _, seen := readyAt[p.Name]; !seen {
					readyAt[p.Name] = time.Now()
					readyPods = append(readyPods, p)
				}
			}
		case err := <-failed:
			b.Fatal(err)
		case <-timeout:
			b.Fatalf("%d of %d pods in %s Ready after %s", len(readyAt), n, ns, deadline)
		}
	}
	wg.Wait()
	for name, at := range readyAt {
		took = append(took, at.Sub(starts[name]))
	}
	b.Logf("%s, %d at once: first Ready %s, median %s, last %s; %s", ns, n, quantile(took, 0).Round(time.Millisecond),
		quantile(took, 0.5).Round(time.Millisecond), quantile(took, 1).Round(time.Millisecond), phases(readyPods))
	if check != nil {
		for _, p := range readyPods {
			check(p)
		}
	}
	deletePods(ctx, b, c, ns, prefix)
	return took
}

// phases says where the pods' start-up went, by the API's own timestamps
// (whole seconds, so only for rounds that take seconds): median times from
// creation to scheduled, to the sandbox ready (network set up: the CNI ADD,
// inpod's included), to the container started.
func phases(pods []*corev1.Pod) string {
	var scheduled, sandbox, started []time.Duration
	for _, p := range pods {
		created := p.CreationTimestamp.Time
		for _, c := range p.Status.Conditions {
			switch c.Type {
			case corev1.PodScheduled:
				scheduled = append(scheduled, c.LastTransitionTime.Sub(created))
			case corev1.PodReadyToStartContainers:
				sandbox = append(sandbox, c.LastTransitionTime.Sub(created))
			}
		}
		if len(p.Status.ContainerStatuses) > 0 && p.Status.ContainerStatuses[0].State.Running != nil {
			started = append(started, p.Status.ContainerStatuses[0].State.Running.StartedAt.Sub(created))
		}
	}
	med := func(ds []time.Duration) string {
		if len(ds) == 0 {
			return "?"
		}
		return quantile(ds, 0.5).String()
	}
	return fmt.Sprintf("median from creation (API timestamps, 1 s): scheduled %s, sandbox ready %s, container started %s", med(scheduled), med(sandbox), med(started))
}

// deletePods deletes a round's pods and waits until they are gone (their
// sandboxes torn down), so the next round has the node to itself.
func deletePods(ctx context.Context, b testing.TB, c kubernetes.Interface, ns, prefix string) {
	b.Helper()
	grace := int64(1)
	sel := metav1.ListOptions{LabelSelector: "round=" + prefix}
	// One request per pod, not DeleteCollection: the API server deletes a
	// collection within one request, and 100 pods on a loaded 2-core
	// machine outlived its request timeout (the stream was reset).
	pods, err := c.CoreV1().Pods(ns).List(ctx, sel)
	if err != nil {
		b.Fatal(err)
	}
	for _, p := range pods.Items {
		if err := c.CoreV1().Pods(ns).Delete(ctx, p.Name, metav1.DeleteOptions{GracePeriodSeconds: &grace}); err != nil && !apierrors.IsNotFound(err) {
			b.Fatal(err)
		}
	}
	testkit.Eventually(b, 5*time.Minute, ns+" round "+prefix+" pods gone", func() bool {
		l, err := c.CoreV1().Pods(ns).List(ctx, sel)
		return err == nil && len(l.Items) == 0
	})
}

// quantile is the nearest-rank q-quantile of ds.
func quantile(ds []time.Duration, q float64) time.Duration {
	s := slices.Clone(ds)
	slices.Sort(s)
	i := int(math.Ceil(q*float64(len(s)))) - 1
	return s[max(0, min(i, len(s)-1))]
}
