//go:build integration

package agent_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"syscall"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/inpod-dev/inpod/enrollment"
	"github.com/inpod-dev/inpod/netns"
	"github.com/inpod-dev/inpod/netns/netnstest"
	ztunnel "github.com/inpod-dev/inpod/zds/zdstest"
)

// A CNI request naming a pod that is bound to another node is refused: the
// agent never writes rules for it into the netns the request names, nor
// tells ztunnel about it. The agent's pod cache holds this node's pods
// only; before the fix its direct API read (for a pod the watch has not
// delivered yet) found the other node's pod and enrolled it here.
func TestIntegrationADDForAPodOnAnotherNodeIsRefused(t *testing.T) {
	w := newWorld(t)
	w.startInProcessAgent()
	pod, err := w.client.CoreV1().Pods("mesh").Create(context.Background(), &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "elsewhere"},
		Spec:       corev1.PodSpec{NodeName: "another-node", Containers: []corev1.Container{{Name: "app", Image: "testapp"}}},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	sandbox := netnstest.New(t)
	_, err = w.cniAdd(pod, sandbox)
	if err == nil || !strings.Contains(err.Error(), "another-node") {
		t.Fatalf("ADD for a pod on another node: %v; want a refusal naming its node", err)
	}
	if hasRules(t, sandbox) {
		t.Fatal("rules written into the netns named by a request for another node's pod")
	}
	if _, ok := w.standin.Workloads()[string(pod.UID)]; ok {
		t.Fatal("ztunnel was told about another node's pod")
	}
	if !w.agent.Ready.State().Ready {
		t.Fatal("the agent is not ready after the refusal")
	}
}

// Nothing a pod controls in its own object steers the agent: names at the
// API's limits, labels and annotations at their limits, and inpod's own
// state annotation set by the pod itself. Each enrolled pod is redirected
// in its own netns and only there (ztunnel's workload holds that netns),
// each pod outside the mesh passes untouched, and the agent stays ready.
func TestIntegrationPodControlledFieldsAtTheirLimits(t *testing.T) {
	w := newWorld(t)
	ctx := context.Background()
	longNS := strings.Repeat("n", 63)
	if _, err := w.client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: longNS,
		Labels: map[string]string{enrollment.DataplaneModeLabel: enrollment.DataplaneAmbient}}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	w.startInProcessAgent()

	// Label keys: a 253-byte DNS prefix and a 63-byte name; values 63 bytes.
	prefix := strings.Repeat(strings.Repeat("p", 62)+".", 4)[:252] + "x"
	bigLabels := map[string]string{}
	for i := range 20 {
		bigLabels[fmt.Sprintf("%s/%s%02d", prefix, strings.Repeat("k", 61), i)] = strings.Repeat("v", 61) + fmt.Sprintf("%02d", i)
	}
	// Annotations: just under the API's 256 KiB total, one of them huge.
	bigAnnotations := map[string]string{
		"example.com/blob":    strings.Repeat("a", 256*1024-4096),
		prefix + "/" + "note": strings.Repeat("b", 2000),
	}
	withLabels := func(extra map[string]string) map[string]string {
		out := map[string]string{}
		for k, v := range bigLabels {
			out[k] = v
		}
		for k, v := range extra {
			out[k] = v
		}
		return out
	}
	type tc struct {
		ns, name    string
		labels      map[string]string
		annotations map[string]string
		sa          string
		enrolled    bool
	}
	longName := strings.Repeat(strings.Repeat("a", 62)+".", 4)[:252] + "z"
	cases := []tc{
		{ns: "mesh", name: longName, enrolled: true},
		{ns: longNS, name: longName, sa: strings.Repeat("s", 253), enrolled: true},
		{ns: "mesh", name: "big-labels", labels: withLabels(nil), annotations: bigAnnotations, enrolled: true},
		{ns: "plain", name: "big-labels-plain", labels: withLabels(nil), annotations: bigAnnotations},
		// The pod claims the state annotation itself: it decides nothing.
		{ns: "plain", name: "claims-enabled", annotations: map[string]string{enrollment.RedirectionAnnotation: "enabled"}},
		{ns: "mesh", name: "claims-enabled-mesh", annotations: map[string]string{enrollment.RedirectionAnnotation: "enabled"}, enrolled: true},
		{ns: "mesh", name: "claims-pending", annotations: map[string]string{enrollment.RedirectionAnnotation: strings.Repeat("x", 4096)}, enrolled: true},
		// Opting out by label in an enrolled namespace, and in by label in
		// a plain one, also with the big labels around.
		{ns: "mesh", name: "opts-out", labels: withLabels(map[string]string{enrollment.DataplaneModeLabel: "none"})},
		{ns: "plain", name: "opts-in", labels: withLabels(map[string]string{enrollment.DataplaneModeLabel: enrollment.DataplaneAmbient}), enrolled: true},
		// Odd-but-valid values of the enrollment label: not "ambient".
		{ns: "plain", name: "odd-label", labels: map[string]string{enrollment.DataplaneModeLabel: "Ambient"}},
	}
	type started struct {
		tc
		pod     *corev1.Pod
		sandbox *netnstest.NetNS
	}
	var all []started
	for _, c := range cases {
		p := &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: c.name, Labels: c.labels, Annotations: c.annotations},
			Spec:       corev1.PodSpec{NodeName: nodeName, Containers: []corev1.Container{{Name: "app", Image: "testapp"}}},
		}
		if c.sa != "" {
			if _, err := w.client.CoreV1().ServiceAccounts(c.ns).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: c.sa}}, metav1.CreateOptions{}); err != nil {
				t.Fatal(err)
			}
			p.Spec.ServiceAccountName = c.sa
		}
		pod, err := w.client.CoreV1().Pods(c.ns).Create(ctx, p, metav1.CreateOptions{})
		if err != nil {
			t.Fatalf("create pod %s/%.20s…: %v", c.ns, c.name, err)
		}
		all = append(all, started{c, pod, netnstest.New(t)})
	}
	for i, s := range all {
		// The container id names libcni's cache file; a 253-byte pod name
		// in it would pass the file name limit.
		if _, err := w.cni("ADD", s.pod, s.sandbox, fmt.Sprintf("c%d", i)); err != nil {
			t.Fatalf("ADD of %s/%.40s (enrolled %v): %v", s.ns, s.name, s.enrolled, err)
		}
	}
	ws := w.standin.Workloads()
	for _, s := range all {
		id, err := netns.IdentityOfPath(s.sandbox.Path)
		if err != nil {
			t.Fatal(err)
		}
		wl, known := ws[string(s.pod.UID)]
		switch {
		case s.enrolled && (!hasRules(t, s.sandbox) || !known || wl.NetNS != id):
			t.Errorf("%s/%.40s: enrolled but rules %v, ztunnel workload %+v (want netns %v)", s.ns, s.name, hasRules(t, s.sandbox), wl, id)
		case !s.enrolled && (hasRules(t, s.sandbox) || known):
			t.Errorf("%s/%.40s: outside the mesh but rules %v, ztunnel knows it %v", s.ns, s.name, hasRules(t, s.sandbox), known)
		}
		if s.enrolled && known && (wl.Name != s.name || wl.Namespace != s.ns) {
			t.Errorf("ztunnel's workload for %s/%.40s is named %s/%.40s", s.ns, s.name, wl.Namespace, wl.Name)
		}
	}
	if strings.Contains(w.node.Exec(t, "nft", "list", "ruleset"), "table inet inpod {") { // inpod-host is the node's own
		t.Error("pod rules written into the node's netns")
	}
	for _, s := range all {
		if s.enrolled {
			w.eventually(fmt.Sprintf("%s/%.40s annotated enabled", s.ns, s.name), func() bool { return w.annotation(s.pod) == enrollment.AnnotationEnabled })
		}
	}
	if !w.agent.Ready.State().Ready {
		t.Fatal("the agent is not ready after the pods")
	}
}

// The pod's own app listening on ztunnel's outbound port. Before
// enrolment (the app's socket holds 15001 without SO_REUSEPORT), ztunnel
// cannot start the proxy: the ADD fails closed with ztunnel's reason in the
// error, nothing crashes, and once the port is free the runtime's retry
// redirects the pod. After enrolment, the app cannot take the port from
// ztunnel and the redirection stays.
func TestIntegrationAppBindingZtunnelsPortDoesNotUnredirect(t *testing.T) {
	w := newWorld(t)
	w.startInProcessAgent()
	listen := func(sandbox *netnstest.NetNS) (net.Listener, error) {
		f := sandbox.Open(t)
		var ln net.Listener
		err := netns.Do(f, func() error {
			var err error
			ln, err = net.Listen("tcp4", fmt.Sprintf("0.0.0.0:%d", ztunnel.PortOutbound))
			return err
		})
		return ln, err
	}

	before, sbBefore := w.pod("mesh", "app-binds-first")
	app, err := listen(sbBefore)
	if err != nil {
		t.Fatal(err)
	}
	_, err = w.cniAdd(before, sbBefore)
	if err == nil {
		t.Fatal("ADD succeeded while the app holds 15001: ztunnel cannot have bound its listener")
	}
	if !strings.Contains(err.Error(), "15001") {
		t.Errorf("the ADD's error does not say what went wrong: %v", err)
	}
	if hasRules(t, sbBefore) {
		t.Error("a failed ADD left rules behind")
	}
	t.Logf("ADD with the app on 15001: %v", err)
	app.Close()
	if _, err := w.cni("DEL", before, sbBefore, "c-"+before.Name); err != nil {
		t.Fatal(err)
	}
	if _, err := w.cniAdd(before, sbBefore); err != nil {
		t.Fatalf("retried ADD once the port is free: %v", err)
	}
	if !hasRules(t, sbBefore) {
		t.Fatal("retried ADD returned without rules")
	}

	after, sbAfter := w.pod("mesh", "app-binds-later")
	if _, err := w.cniAdd(after, sbAfter); err != nil {
		t.Fatal(err)
	}
	if _, err := listen(sbAfter); !errors.Is(err, syscall.EADDRINUSE) {
		t.Fatalf("the app binding 15001 after enrolment: %v; want EADDRINUSE (ztunnel holds it)", err)
	}
	if !hasRules(t, sbAfter) {
		t.Fatal("rules gone after the app's attempt")
	}
	if _, ok := w.standin.Workloads()[string(after.UID)]; !ok {
		t.Fatal("ztunnel lost the workload")
	}
	if !w.agent.Ready.State().Ready {
		t.Fatal("the agent is not ready")
	}
}
