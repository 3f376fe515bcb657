package agent

import (
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// Two agent pods on one node, ranked for the hand-over: the newer one must
// rank strictly higher, or the two refuse each other and the rollout stalls
// (the old agent serving on). The API keeps creation times to the second.
func TestHandoverRankOrdersAgentPods(t *testing.T) {
	at := time.Date(2026, 12, 7, 14, 0, 0, 0, time.UTC)
	agentPod := func(created time.Time, generation string) *corev1.Pod {
		p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{CreationTimestamp: metav1.NewTime(created)}}
		if generation != "" {
			p.Labels = map[string]string{templateGenerationLabel: generation}
		}
		return p
	}
	for _, tc := range []struct {
		name         string
		older, newer *corev1.Pod
	}{
		{"created seconds apart", agentPod(at, "3"), agentPod(at.Add(time.Second), "4")},
		{"one second, the newer template", agentPod(at, "3"), agentPod(at, "4")},
		// The DaemonSet deleted and made again: its generation starts over,
		// and the pod created later still serves.
		{"a new DaemonSet a second later", agentPod(at, "9"), agentPod(at.Add(time.Second), "1")},
		{"a pod from before the label", agentPod(at, ""), agentPod(at, "2")},
		// A generation past a second's nanoseconds must not carry into
		// the seconds, above a pod created a second later.
		{"a generation past the second's nanoseconds", agentPod(at, "2000000000"), agentPod(at.Add(time.Second), "1")},
	} {
		t.Run(tc.name, func(t *testing.T) {
			older, ok1 := handoverRankOf(tc.older)
			newer, ok2 := handoverRankOf(tc.newer)
			if !ok1 || !ok2 {
				t.Fatalf("ranks not known: %v %v", ok1, ok2)
			}
			if newer <= older {
				t.Fatalf("the newer pod ranks %d, not above the older one's %d", newer, older)
			}
		})
	}

	// An agent from before the tie-break ranks by the second alone; against
	// it the newer pod's rank still says the same.
	if r, _ := handoverRankOf(agentPod(at, "")); r != at.UnixNano() {
		t.Fatalf("rank of a pod without the label = %d, want its creation time %d", r, at.UnixNano())
	}
	// Garbage in the label is ignored, never a rank below the second.
	if r, _ := handoverRankOf(agentPod(at, "-5")); r != at.UnixNano() {
		t.Fatalf("rank with a negative generation = %d, want %d", r, at.UnixNano())
	}
	if r, _ := handoverRankOf(agentPod(at, "x")); r != at.UnixNano() {
		t.Fatalf("rank with an unreadable generation = %d, want %d", r, at.UnixNano())
	}
	if _, ok := handoverRankOf(&corev1.Pod{}); ok {
		t.Fatal("a pod without a creation time was ranked")
	}
}
