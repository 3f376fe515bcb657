package agent

import (
	"log/slog"
	"reflect"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/inpod-dev/inpod/agent/enroll"
)

// Istio's per-pod overrides, as its node agent reads them: a valid boolean
// overrides the node's default either way; anything else is ignored, with
// a warning naming the pod. Virtual interfaces are a comma-separated list;
// a name that is no interface name is left out, with a warning.
func TestPodAnnotationsOverrideTheNodesVariant(t *testing.T) {
	for _, tc := range []struct {
		name        string
		nodeDNS     bool
		annotations map[string]string
		want        enroll.Variant
		warns       bool
	}{
		{name: "node default, captured", nodeDNS: true, want: enroll.Variant{DNSCapture: true}},
		{name: "node default, not captured", want: enroll.Variant{}},
		{name: "opted out", nodeDNS: true, annotations: map[string]string{AnnotationDNSCapture: "false"}, want: enroll.Variant{}},
		{name: "opted in", annotations: map[string]string{AnnotationDNSCapture: "true"}, want: enroll.Variant{DNSCapture: true}},
		{name: "ParseBool spellings", nodeDNS: true, annotations: map[string]string{AnnotationDNSCapture: "0", AnnotationBypassInboundCapture: "T"},
			want: enroll.Variant{NoInboundCapture: true}},
		{name: "ingress mode", nodeDNS: true, annotations: map[string]string{AnnotationBypassInboundCapture: "true"},
			want: enroll.Variant{DNSCapture: true, NoInboundCapture: true}},
		{name: "not a boolean", nodeDNS: true, annotations: map[string]string{AnnotationDNSCapture: "no", AnnotationBypassInboundCapture: "yes"},
			want: enroll.Variant{DNSCapture: true}, warns: true},
		{name: "empty", annotations: map[string]string{AnnotationBypassInboundCapture: ""}, want: enroll.Variant{}, warns: true},
		{name: "virtual interfaces", annotations: map[string]string{AnnotationRerouteVirtualInterfaces: " virt0, tap0_kata ,,virt0"},
			want: enroll.Variant{VirtualInterfaces: []string{"virt0", "tap0_kata"}}},
		{name: "a virtual interface that is no interface name", annotations: map[string]string{AnnotationRerouteVirtualInterfaces: "virt0,eth0 -j ACCEPT,net+"},
			want: enroll.Variant{VirtualInterfaces: []string{"virt0"}}, warns: true},
		{name: "no virtual interface", annotations: map[string]string{AnnotationRerouteVirtualInterfaces: " , "}, want: enroll.Variant{}},
		{name: "the pod's own interface", annotations: map[string]string{AnnotationRerouteVirtualInterfaces: "eth0"},
			want: enroll.Variant{VirtualInterfaces: []string{"eth0"}}, warns: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var logged strings.Builder
			of := variantOf(enroll.Variant{DNSCapture: tc.nodeDNS}, slog.New(slog.NewTextHandler(&logged, nil)))
			pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "mesh", Name: "p", Annotations: tc.annotations}}
			if got := of(pod); !reflect.DeepEqual(got, tc.want) {
				t.Errorf("variant = %v; want %v", got, tc.want)
			}
			if warned := strings.Contains(logged.String(), "mesh/p"); warned != tc.warns {
				t.Errorf("warned = %t; want %t: %s", warned, tc.warns, logged.String())
			}
		})
	}
}
