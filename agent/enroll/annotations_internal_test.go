package enroll

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/validation/field"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	"github.com/inpod-dev/inpod/enrollment"
	"github.com/inpod-dev/inpod/internal/testkit"
)

// fakeActivity plays the agent's CNI event counter: a test opens and ends
// busy spells, and sees when the writer asked.
type fakeActivity struct {
	mu    sync.Mutex
	idle  chan struct{} // nil while quiet
	asked chan struct{} // a value each time Quiet is asked during a spell
}

func newFakeActivity() *fakeActivity { return &fakeActivity{asked: make(chan struct{}, 100)} }

func (a *fakeActivity) begin() {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.idle = make(chan struct{})
}

func (a *fakeActivity) end() {
	a.mu.Lock()
	defer a.mu.Unlock()
	close(a.idle)
	a.idle = nil
}

// waitAsked returns once the writer has asked during a spell, and fails the
// test if it does not within 10 s.
func (a *fakeActivity) waitAsked(t *testing.T) {
	t.Helper()
	select {
	case <-a.asked:
	case <-time.After(10 * time.Second):
		t.Fatal("the writer never asked whether CNI events were in flight")
	}
}

// clearAsked forgets the writer's earlier questions.
func (a *fakeActivity) clearAsked() {
	for {
		select {
		case <-a.asked:
		default:
			return
		}
	}
}

func (a *fakeActivity) Quiet() <-chan struct{} {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.idle == nil {
		return nil
	}
	select {
	case a.asked <- struct{}{}:
	default: // nobody needs more than the buffer holds
	}
	return a.idle
}

// patchLog records the annotation value of every pod patch the writer
// sends.
type patchLog struct {
	mu     sync.Mutex
	values []string
}

func (l *patchLog) all() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string(nil), l.values...)
}

func startWriter(t *testing.T, busy Activity, maxDefer time.Duration, pods ...string) (*AnnotationWriter, *patchLog) {
	var objs []runtime.Object
	for _, name := range pods {
		objs = append(objs, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "mesh", Name: name, UID: uidOf(name)}})
	}
	client := fake.NewClientset(objs...)
	log := &patchLog{}
	client.PrependReactor("patch", "pods", func(action k8stesting.Action) (bool, runtime.Object, error) {
		patch := action.(k8stesting.PatchAction)
		var body struct {
			Metadata struct {
				Annotations map[string]*string `json:"annotations"`
			} `json:"metadata"`
		}
		if err := json.Unmarshal(patch.GetPatch(), &body); err != nil {
			t.Errorf("undecodable patch %s: %v", patch.GetPatch(), err)
		}
		v := "<removed>"
		if p := body.Metadata.Annotations[enrollment.RedirectionAnnotation]; p != nil {
			v = *p
		}
		log.mu.Lock()
		log.values = append(log.values, patch.GetName()+"="+v)
		log.mu.Unlock()
		return false, nil, nil // the tracker applies it
	})
	w := NewAnnotationWriter(client, busy, slog.New(slog.DiscardHandler))
	w.maxDefer = maxDefer
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); w.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	return w, log
}

// While CNI events are in flight the writer sends nothing, so a pod's
// "pending" and then "enabled" (both asked for during its ADD) become one
// patch, sent once the node is quiet; the next busy spell is waited out
// again.
func TestAnnotationWriterWaitsOutCNIEvents(t *testing.T) {
	busy := newFakeActivity()
	w, log := startWriter(t, busy, time.Hour, "a", "b")

	busy.begin()
	w.Set(types.NamespacedName{Namespace: "mesh", Name: "a"}, uidOf("a"), enrollment.AnnotationPending)
	busy.waitAsked(t) // the writer holds "a" and waits
	w.Set(types.NamespacedName{Namespace: "mesh", Name: "a"}, uidOf("a"), enrollment.AnnotationEnabled)
	if got := log.all(); len(got) != 0 {
		t.Fatalf("patched %v while a CNI event was in flight", got)
	}
	busy.end()
	testkit.Eventually(t, 10*time.Second, "a's annotation written", func() bool { return len(log.all()) > 0 })

	busy.begin()
	w.Set(types.NamespacedName{Namespace: "mesh", Name: "b"}, uidOf("b"), enrollment.AnnotationPending)
	busy.waitAsked(t)
	w.Set(types.NamespacedName{Namespace: "mesh", Name: "b"}, uidOf("b"), enrollment.AnnotationEnabled)
	if got := log.all(); !slices.Equal(got, []string{"a=enabled"}) {
		t.Fatalf("patches %v in the second busy spell, want only the first spell's a=enabled", got)
	}
	busy.end()
	testkit.Eventually(t, 10*time.Second, "b's annotation written", func() bool { return len(log.all()) > 1 })
	// Once each: the re-queued pods find nothing left to write.
	w.queue.ShutDownWithDrain()
	if got := log.all(); !slices.Equal(got, []string{"a=enabled", "b=enabled"}) {
		t.Fatalf("patches %v, want one per pod with its last value", got)
	}
}

// A node that never stops serving CNI events still gets its annotations:
// the writer waits at most maxDefer into a busy spell.
func TestAnnotationWriterIsNotStarvedByABusyNode(t *testing.T) {
	busy := newFakeActivity()
	w, log := startWriter(t, busy, 20*time.Millisecond, "a", "b")
	busy.begin()
	defer busy.end()
	w.Set(types.NamespacedName{Namespace: "mesh", Name: "a"}, uidOf("a"), enrollment.AnnotationEnabled)
	w.Set(types.NamespacedName{Namespace: "mesh", Name: "b"}, uidOf("b"), "")
	testkit.Eventually(t, 10*time.Second, "both annotations written while the node stays busy", func() bool {
		return slices.Equal(log.all(), []string{"a=enabled", "b=<removed>"})
	})
}

// Without an activity source the writer writes at once.
func TestAnnotationWriterWithoutActivityWritesAtOnce(t *testing.T) {
	w, log := startWriter(t, nil, time.Hour, "a")
	w.Set(types.NamespacedName{Namespace: "mesh", Name: "a"}, uidOf("a"), enrollment.AnnotationEnabled)
	testkit.Eventually(t, 10*time.Second, "the annotation written", func() bool { return slices.Equal(log.all(), []string{"a=enabled"}) })
}

// A long backlog ends the wait: a node whose busy spells follow each other
// still gets its annotations at the writer's rate, not one per gap.
func TestAnnotationWriterStopsWaitingWithALongBacklog(t *testing.T) {
	busy := newFakeActivity()
	w, log := startWriter(t, busy, time.Hour)
	busy.begin()
	w.Set(types.NamespacedName{Namespace: "mesh", Name: "first"}, uidOf("first"), enrollment.AnnotationEnabled)
	busy.waitAsked(t) // the writer holds "first" and waits
	// A few past the bound: their signals come while the writer drains.
	const n = MaxDeferredBacklog + 5
	for i := range n {
		w.Set(types.NamespacedName{Namespace: "mesh", Name: fmt.Sprintf("p%d", i)}, uidOf(fmt.Sprintf("p%d", i)), enrollment.AnnotationEnabled)
	}
	testkit.Eventually(t, 10*time.Second, "every annotation written while the node stays busy", func() bool {
		return len(log.all()) == n+1
	})
	busy.end()
	busy.clearAsked()

	// The next busy spell is waited out again: nothing of the backlog
	// (its signal, its draining) carries over.
	busy.begin()
	w.Set(types.NamespacedName{Namespace: "mesh", Name: "late"}, uidOf("late"), enrollment.AnnotationPending)
	busy.waitAsked(t)
	w.Set(types.NamespacedName{Namespace: "mesh", Name: "late"}, uidOf("late"), enrollment.AnnotationEnabled)
	busy.end()
	testkit.Eventually(t, 10*time.Second, "the late pod written", func() bool { return len(log.all()) > n+1 })
	w.queue.ShutDownWithDrain()
	if got := log.all()[n+1:]; !slices.Equal(got, []string{"late=enabled"}) {
		t.Fatalf("after the backlog, patches %v; want late=enabled alone (its pending waited out)", got)
	}
}

// Flush writes what the stopped writer still held, and once its context
// ends says how many are left in one error instead of trying each.
func TestAnnotationWriterFlush(t *testing.T) {
	client := fake.NewClientset(&corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "mesh", Name: "a", UID: uidOf("a")}})
	w := NewAnnotationWriter(client, nil, slog.New(slog.DiscardHandler))
	for _, name := range []string{"a", "b", "c"} {
		w.Set(types.NamespacedName{Namespace: "mesh", Name: name}, uidOf(name), enrollment.AnnotationEnabled)
	}
	ended, cancel := context.WithCancel(context.Background())
	cancel()
	if err := w.Flush(ended); err == nil || !strings.Contains(err.Error(), "3 annotations not written") {
		t.Fatalf("Flush with an ended context = %v, want one error naming the 3 left", err)
	}
	if err := w.Flush(context.Background()); err != nil {
		t.Fatal(err)
	}
	pod, err := client.CoreV1().Pods("mesh").Get(context.Background(), "a", metav1.GetOptions{})
	if err != nil || pod.Annotations[enrollment.RedirectionAnnotation] != enrollment.AnnotationEnabled {
		t.Fatalf("pod a annotated %v (%v) after Flush", pod.Annotations, err)
	}
}

// uidOf is the UID the tests give the pod of this name.
func uidOf(name string) types.UID { return types.UID("uid-" + name) }

// A patch the API server refuses as Invalid is either for a pod whose name
// now belongs to another pod (its UID is immutable), and then dropped, or
// refused for another reason, and then kept and retried. The fake
// clientset's tracker applies metadata.uid like any other field, so the
// server's answers are played by reactors here; the integration test
// checks them against a real kube-apiserver.
func TestAnnotationWriterTellsAReplacedPodFromARefusedPatch(t *testing.T) {
	name := types.NamespacedName{Namespace: "mesh", Name: "web-0"}
	refused := apierrors.NewInvalid(corev1.SchemeGroupVersion.WithKind("Pod").GroupKind(), name.Name,
		field.ErrorList{field.Invalid(field.NewPath("metadata", "uid"), "uid-new", "field is immutable")})
	for _, tc := range []struct {
		name     string
		patchErr error
		get      func() (*corev1.Pod, error) // the pod of that name now
		wantKept bool                        // still queued, Flush failing
	}{
		{"replaced by another pod", refused, func() (*corev1.Pod, error) {
			return &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "mesh", Name: name.Name, UID: "uid-new"}}, nil
		}, false},
		{"gone since the patch", refused, func() (*corev1.Pod, error) {
			return nil, apierrors.NewNotFound(corev1.Resource("pods"), name.Name)
		}, false},
		{"gone before the patch", apierrors.NewNotFound(corev1.Resource("pods"), name.Name), nil, false},
		{"the same pod, the patch refused by an admission check", refused, func() (*corev1.Pod, error) {
			return &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "mesh", Name: name.Name, UID: uidOf(name.Name)}}, nil
		}, true},
		{"the same pod, a conflict", apierrors.NewConflict(corev1.Resource("pods"), name.Name, errors.New("try again")), func() (*corev1.Pod, error) {
			return &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "mesh", Name: name.Name, UID: uidOf(name.Name)}}, nil
		}, true},
		{"the API server away when asked which pod it is", refused, func() (*corev1.Pod, error) {
			return nil, apierrors.NewServiceUnavailable("etcd leader changed")
		}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			client := fake.NewClientset()
			var gets int
			client.PrependReactor("patch", "pods", func(k8stesting.Action) (bool, runtime.Object, error) {
				return true, nil, tc.patchErr
			})
			client.PrependReactor("get", "pods", func(k8stesting.Action) (bool, runtime.Object, error) {
				gets++
				if tc.get == nil {
					t.Error("the writer asked for the pod after a patch refused as NotFound")
					return true, nil, apierrors.NewNotFound(corev1.Resource("pods"), name.Name)
				}
				pod, err := tc.get()
				return true, pod, err
			})
			w := NewAnnotationWriter(client, nil, slog.New(slog.DiscardHandler))
			w.Set(name, uidOf(name.Name), enrollment.AnnotationEnabled)
			err := w.Flush(context.Background())
			kept := len(w.want) == 1
			if kept != tc.wantKept || (err != nil) != tc.wantKept {
				t.Fatalf("Flush = %v and the write kept: %v; want kept (and an error): %v", err, kept, tc.wantKept)
			}
			if tc.get != nil && gets != 1 {
				t.Fatalf("the writer asked for the pod %d times, want once", gets)
			}
		})
	}
}

// A write without a UID would land on whatever pod has the name: it is
// refused, not sent.
func TestAnnotationWriterRefusesAWriteWithoutAUID(t *testing.T) {
	client := fake.NewClientset(&corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "mesh", Name: "a", UID: uidOf("a")}})
	w := NewAnnotationWriter(client, nil, slog.New(slog.DiscardHandler))
	w.Set(types.NamespacedName{Namespace: "mesh", Name: "a"}, "", enrollment.AnnotationEnabled)
	if w.queue.Len() != 0 || len(w.want) != 0 {
		t.Fatalf("a write without a UID was queued (%d queued, %d wanted)", w.queue.Len(), len(w.want))
	}
	if err := w.Flush(context.Background()); err != nil {
		t.Fatal(err)
	}
	for _, a := range client.Actions() {
		if a.GetVerb() == "patch" {
			t.Fatalf("a write without a UID was sent: %v", a)
		}
	}
}

// pendingFirst plays the condition writer for WriteAfter: a write pending
// until released, and how often the annotation writer asked.
type pendingFirst struct {
	mu       sync.Mutex
	pending  bool
	askedFor int
}

func (f *pendingFirst) PendingFor(types.NamespacedName, types.UID) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.askedFor++
	return f.pending
}

func (f *pendingFirst) asked() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.askedFor
}

func (f *pendingFirst) release() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.pending = false
}

// The annotation waits for the pod's pending condition (the kubelet must
// see the condition first, or Ready waits for its next relist), and not
// for ever when that write does not land.
func TestAnnotationWriterWritesAfterThePendingCondition(t *testing.T) {
	for _, tc := range []struct {
		name    string
		release bool
	}{{"the condition lands", true}, {"the condition never lands", false}} {
		t.Run(tc.name, func(t *testing.T) {
			client := fake.NewClientset(&corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "mesh", Name: "a", UID: uidOf("a")}})
			w := NewAnnotationWriter(client, nil, slog.New(slog.DiscardHandler))
			first := &pendingFirst{pending: true}
			w.WriteAfter(first)
			if !tc.release {
				w.maxHold = time.Second
			}
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan struct{})
			go func() { defer close(done); w.Run(ctx) }()
			t.Cleanup(func() { cancel(); <-done })
			w.Set(types.NamespacedName{Namespace: "mesh", Name: "a"}, uidOf("a"), enrollment.AnnotationEnabled)
			patched := func() bool {
				for _, a := range client.Actions() {
					if a.GetVerb() == "patch" {
						return true
					}
				}
				return false
			}
			testkit.Eventually(t, 10*time.Second, "the writer looking again", func() bool { return first.asked() >= 3 })
			if patched() {
				t.Fatal("the annotation was written while the condition was pending")
			}
			if tc.release {
				first.release()
			}
			testkit.Eventually(t, 10*time.Second, "the annotation written", patched)
		})
	}
}

// A removal is not held behind the condition: it tells Istio's peers to
// stop sending the pod HBONE, and the kubelet waits on nothing in it.
func TestAnnotationWriterDoesNotHoldARemoval(t *testing.T) {
	client := fake.NewClientset(&corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "mesh", Name: "a", UID: uidOf("a"),
		Annotations: map[string]string{enrollment.RedirectionAnnotation: enrollment.AnnotationEnabled}}})
	w := NewAnnotationWriter(client, nil, slog.New(slog.DiscardHandler))
	first := &pendingFirst{pending: true}
	w.WriteAfter(first)
	w.Set(types.NamespacedName{Namespace: "mesh", Name: "a"}, uidOf("a"), "")
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); w.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	testkit.Eventually(t, 10*time.Second, "the removal written", func() bool {
		pod, err := client.CoreV1().Pods("mesh").Get(ctx, "a", metav1.GetOptions{})
		_, annotated := pod.Annotations[enrollment.RedirectionAnnotation]
		return err == nil && !annotated
	})
	if n := first.asked(); n != 0 {
		t.Fatalf("the removal waited on the condition writer (asked %d times)", n)
	}
}
