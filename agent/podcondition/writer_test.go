package podcondition

import (
	"context"
	"encoding/json"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	"github.com/inpod-dev/inpod/internal/testkit"
)

// statusPatches records the status of every pods/status patch, and can
// hold the next one until released.
type statusPatches struct {
	mu      sync.Mutex
	got     []string
	hold    chan struct{} // non-nil: the next patch waits for it
	entered chan struct{}
}

func (s *statusPatches) all() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.got...)
}

func fakeClient(t *testing.T, s *statusPatches) *fake.Clientset {
	c := fake.NewClientset()
	c.PrependReactor("patch", "pods", func(a k8stesting.Action) (bool, runtime.Object, error) {
		p := a.(k8stesting.PatchAction)
		if p.GetSubresource() != "status" || p.GetPatchType() != types.StrategicMergePatchType {
			t.Errorf("patch of %q as %s, want a strategic merge patch of status", p.GetSubresource(), p.GetPatchType())
		}
		var body struct {
			Metadata struct{ UID types.UID } `json:"metadata"`
			Status   struct {
				Conditions []corev1.PodCondition `json:"conditions"`
			} `json:"status"`
		}
		if err := json.Unmarshal(p.GetPatch(), &body); err != nil || len(body.Status.Conditions) != 1 || body.Metadata.UID == "" {
			t.Errorf("patch %s: want the pod's UID and one condition (%v)", p.GetPatch(), err)
		}
		s.mu.Lock()
		hold := s.hold
		s.hold = nil
		s.got = append(s.got, string(body.Status.Conditions[0].Status))
		s.mu.Unlock()
		if hold != nil {
			s.entered <- struct{}{}
			<-hold
		}
		return true, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: p.GetName(), Namespace: p.GetNamespace()}}, nil
	})
	return c
}

// A Set that arrives while the previous value is being written must be
// written after it, even when it says what the pod carried before: the
// write in flight is about to change that.
func TestSetDuringWriteInFlightIsNotLost(t *testing.T) {
	s := &statusPatches{entered: make(chan struct{}, 1)}
	w := New(Config{Client: fakeClient(t, s), Current: func(types.NamespacedName) *corev1.Pod { return nil }})
	pod, uid := types.NamespacedName{Namespace: "mesh", Name: "web-0"}, types.UID("u1")
	ctx := context.Background()
	w.Set(pod, uid, true, "Redirected", "")
	if err := w.Flush(ctx); err != nil {
		t.Fatal(err)
	}

	rctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Go(func() { w.Run(rctx) })
	defer func() { cancel(); wg.Wait() }()
	release := make(chan struct{})
	s.mu.Lock()
	s.hold = release
	s.mu.Unlock()
	w.Set(pod, uid, false, "RulesLost", "")
	select {
	case <-s.entered:
	case <-time.After(10 * time.Second):
		t.Fatal("the False was never written")
	}
	// True again while False is on the wire: what the writer last wrote,
	// but not what the pod will carry.
	w.Set(pod, uid, true, "Redirected", "")
	close(release)
	testkit.Eventually(t, 10*time.Second, "True written after the False", func() bool {
		got := s.all()
		return len(got) == 3 && got[2] == "True" && w.Pending() == 0
	})
	// And nothing more: the pod carries what was asked.
	w.Set(pod, uid, true, "Redirected", "")
	if w.Pending() != 0 {
		t.Fatalf("a Set of what the pod carries is pending")
	}
}

// A Set without a UID would land on whatever pod has the name: refused.
// Forget drops what the writer holds for a pod, so a deleted pod costs
// nothing more.
func TestSetWithoutUIDAndForget(t *testing.T) {
	s := &statusPatches{}
	w := New(Config{Client: fakeClient(t, s), Current: func(types.NamespacedName) *corev1.Pod { return nil }})
	pod := types.NamespacedName{Namespace: "mesh", Name: "web-0"}
	w.Set(pod, "", true, "Redirected", "")
	if w.Pending() != 0 {
		t.Fatal("a Set without a UID is pending")
	}
	w.Set(pod, "u1", true, "Redirected", "")
	if err := w.Flush(context.Background()); err != nil {
		t.Fatal(err)
	}
	w.Set(pod, "u1", false, "RulesLost", "")
	w.Forget(pod, "u1")
	if err := w.Flush(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got := s.all(); len(got) != 1 || w.Pending() != 0 || len(w.last) != 0 {
		t.Fatalf("patches %v, pending %d, known %d: want the first only, and nothing held after Forget", got, w.Pending(), len(w.last))
	}
}

// A patch that fails after the API server applied it (the client timed
// out): the writer cannot tell, so it must not go on believing the pod
// carries what it carried before. Labelled out (NotEnrolled, the patch
// "fails" but lands) and back (Redirected, what it carried before) before
// the retry: Redirected must still be written, even though a cache that has
// not seen the write says the pod carries it.
func TestWriteThatFailedButLandedIsNotTakenForUnwritten(t *testing.T) {
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "mesh", Name: "web-0", UID: "u1"},
		Status: corev1.PodStatus{Conditions: []corev1.PodCondition{{Type: ConditionType, Status: corev1.ConditionTrue, Reason: "Redirected", Message: "m"}}}}
	stale := pod.DeepCopy()
	c := fake.NewClientset(pod.DeepCopy())
	var patches []string
	c.PrependReactor("patch", "pods", func(a k8stesting.Action) (bool, runtime.Object, error) {
		var body struct {
			Status struct {
				Conditions []corev1.PodCondition `json:"conditions"`
			} `json:"status"`
		}
		if err := json.Unmarshal(a.(k8stesting.PatchAction).GetPatch(), &body); err != nil {
			t.Fatal(err)
		}
		got := body.Status.Conditions[0]
		patches = append(patches, got.Reason)
		stored, err := c.Tracker().Get(corev1.SchemeGroupVersion.WithResource("pods"), "mesh", "web-0")
		if err != nil {
			t.Fatal(err)
		}
		p := stored.(*corev1.Pod).DeepCopy()
		p.Status.Conditions = []corev1.PodCondition{{Type: ConditionType, Status: got.Status, Reason: got.Reason, Message: got.Message}}
		if err := c.Tracker().Update(corev1.SchemeGroupVersion.WithResource("pods"), p, "mesh"); err != nil {
			t.Fatal(err)
		}
		if len(patches) == 1 {
			return true, nil, context.DeadlineExceeded // applied, but the client gave up
		}
		return true, p, nil
	})
	w := New(Config{Client: c, Current: func(types.NamespacedName) *corev1.Pod { return stale }})
	key := types.NamespacedName{Namespace: "mesh", Name: "web-0"}
	ctx := context.Background()
	w.Set(key, "u1", true, "NotEnrolled", "m")
	if err := w.Flush(ctx); err == nil {
		t.Fatal("the failed patch was reported written")
	}
	w.Set(key, "u1", true, "Redirected", "m")
	if err := w.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	got, err := c.CoreV1().Pods("mesh").Get(ctx, "web-0", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if r := got.Status.Conditions[0].Reason; r != "Redirected" {
		t.Fatalf("the pod carries %s after patches %v; want Redirected", r, patches)
	}
	// Written once and known again: the same Set costs nothing.
	w.Set(key, "u1", true, "Redirected", "m")
	if w.Pending() != 0 || len(patches) != 2 {
		t.Fatalf("after the write: pending %d, patches %v", w.Pending(), patches)
	}
}
