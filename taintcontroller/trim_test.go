package taintcontroller

import (
	"reflect"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/inpod-dev/inpod/nodecondition"
)

// TestTrimmedObjectsDecideAlike: for every combination of taints, done
// annotation, condition and agent pods, the controller observes a trimmed
// Node and trimmed pods exactly as it observes the whole objects; and the
// trimmed ones keep nothing else of size (images, other conditions,
// managedFields, other annotations).
func TestTrimmedObjectsDecideAlike(t *testing.T) {
	now := metav1.Now()
	previous := []corev1.Taint{{Key: "example.com/old", Effect: corev1.TaintEffectNoSchedule}}
	var nodes []*corev1.Node
	for _, taints := range [][]corev1.Taint{nil,
		{{Key: DefaultTaintKey, Effect: DefaultTaintEffect}},
		{{Key: DefaultTaintKey, Effect: corev1.TaintEffectPreferNoSchedule}, {Key: "other", Effect: DefaultTaintEffect}},
		{previous[0], {Key: DefaultTaintKey, Effect: DefaultTaintEffect}},
	} {
		for _, done := range []string{"", doneValue(now.Time, DefaultTaintKey, DefaultTaintEffect), doneValue(now.Time, "example.com/old", corev1.TaintEffectNoSchedule)} {
			for _, cond := range []corev1.ConditionStatus{"", corev1.ConditionTrue, corev1.ConditionFalse, corev1.ConditionUnknown} {
				n := &corev1.Node{
					ObjectMeta: metav1.ObjectMeta{Name: "n", UID: "u", ResourceVersion: "7", Labels: map[string]string{"mesh": "yes"},
						Annotations:   map[string]string{"node.alpha.kubernetes.io/ttl": "0"},
						ManagedFields: []metav1.ManagedFieldsEntry{{Manager: "kubelet"}}},
					Spec: corev1.NodeSpec{Taints: taints, PodCIDR: "10.0.0.0/24"},
					Status: corev1.NodeStatus{
						Conditions: []corev1.NodeCondition{{Type: corev1.NodeReady, Status: corev1.ConditionTrue}},
						Images:     []corev1.ContainerImage{{Names: []string{"registry.example/app@sha256:0"}, SizeBytes: 1}},
					},
				}
				if done != "" {
					n.Annotations[DoneAnnotation] = done
				}
				if cond != "" {
					n.Status.Conditions = append(n.Status.Conditions, corev1.NodeCondition{Type: nodecondition.ConditionType, Status: cond, LastTransitionTime: now})
				}
				nodes = append(nodes, n)
			}
		}
	}
	pod := func(ready corev1.ConditionStatus, terminating bool) *corev1.Pod {
		p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "agent", Namespace: DefaultNamespace, UID: "p",
			ManagedFields: []metav1.ManagedFieldsEntry{{Manager: "kubelet"}}},
			Spec: corev1.PodSpec{NodeName: "n", Containers: []corev1.Container{{Name: "agent", Image: "inpod-agent"}}},
			Status: corev1.PodStatus{Phase: corev1.PodRunning, Conditions: []corev1.PodCondition{
				{Type: corev1.PodScheduled, Status: corev1.ConditionTrue}, {Type: corev1.PodReady, Status: ready}}}}
		if terminating {
			p.DeletionTimestamp = &now
		}
		return p
	}
	podSets := [][]*corev1.Pod{nil, {pod(corev1.ConditionTrue, false)}, {pod(corev1.ConditionFalse, false)}, {pod(corev1.ConditionTrue, true)}}
	for _, n := range nodes {
		tn, _ := trimNode(n)
		trimmed := tn.(*corev1.Node)
		for _, pods := range podSets {
			var tpods []*corev1.Pod
			for _, p := range pods {
				tp, _ := trimAgentPod(p)
				tpods = append(tpods, tp.(*corev1.Pod))
			}
			whole := observe(n, DefaultTaintKey, DefaultTaintEffect, previous, pods)
			if got := observe(trimmed, DefaultTaintKey, DefaultTaintEffect, previous, tpods); !reflect.DeepEqual(got, whole) {
				t.Errorf("node %+v, pods %d: trimmed observed %+v, whole %+v", n, len(pods), got, whole)
			}
		}
		if trimmed.Status.Images != nil || trimmed.ManagedFields != nil || len(trimmed.Status.Conditions) > 1 ||
			trimmed.Annotations["node.alpha.kubernetes.io/ttl"] != "" || trimmed.Spec.PodCIDR != "" {
			t.Errorf("trimmed node keeps what the controller never reads: %+v", trimmed)
		}
		if trimmed.Name != n.Name || trimmed.UID != n.UID || trimmed.ResourceVersion != n.ResourceVersion || !reflect.DeepEqual(trimmed.Labels, n.Labels) {
			t.Errorf("trimmed node lost its identity or labels: %+v", trimmed.ObjectMeta)
		}
	}
	tp, _ := trimAgentPod(pod(corev1.ConditionTrue, false))
	if p := tp.(*corev1.Pod); p.Spec.Containers != nil || p.ManagedFields != nil || len(p.Status.Conditions) != 1 || p.Spec.NodeName != "n" {
		t.Errorf("trimmed agent pod: %+v", p)
	}
	// Tombstones and other objects pass through.
	if obj, _ := trimNode("x"); obj != "x" {
		t.Error("trimNode changed a non-Node")
	}
}
