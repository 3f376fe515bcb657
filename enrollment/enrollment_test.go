package enrollment

import (
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

func TestPolicyFollowsIstioLabels(t *testing.T) {
	ambientNS := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "apps", Labels: map[string]string{DataplaneModeLabel: DataplaneAmbient}}}
	plainNS := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "apps"}}
	pod := func(ns string, labels map[string]string, hostNet bool) *corev1.Pod {
		return &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Labels: labels}, Spec: corev1.PodSpec{HostNetwork: hostNet}}
	}
	ambient := map[string]string{DataplaneModeLabel: DataplaneAmbient}
	none := map[string]string{DataplaneModeLabel: DataplaneNone}
	p := Policy{ExcludedNamespaces: []string{"kube-system"}}
	cases := []struct {
		name string
		pod  *corev1.Pod
		ns   *corev1.Namespace
		want bool
	}{
		{"namespace label", pod("apps", nil, false), ambientNS, true},
		{"no label anywhere", pod("apps", nil, false), plainNS, false},
		{"pod label in a plain namespace", pod("apps", ambient, false), plainNS, true},
		{"pod opts out of an ambient namespace", pod("apps", none, false), ambientNS, false},
		{"host network never", pod("apps", ambient, true), ambientNS, false},
		{"excluded namespace never", pod("kube-system", ambient, false), ambientNS, false},
		{"unknown namespace", pod("apps", nil, false), nil, false},
	}
	for _, c := range cases {
		if got := p.Enrolled(c.pod, c.ns); got != c.want {
			t.Errorf("%s: Enrolled = %v, want %v", c.name, got, c.want)
		}
	}
}

func TestPolicyLabelIsConfigurable(t *testing.T) {
	p := Policy{Label: "mesh.example.com/mode"}
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "apps", Labels: map[string]string{"mesh.example.com/mode": DataplaneAmbient}}}
	if !p.Enrolled(pod, nil) {
		t.Fatal("the configured label did not enroll the pod")
	}
	pod.Labels = map[string]string{DataplaneModeLabel: DataplaneAmbient}
	if p.Enrolled(pod, nil) {
		t.Fatal("Istio's label enrolled the pod although another label is configured")
	}
}
