package enroll_test

import (
	"context"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/inpod-dev/inpod/agent/enroll"
	"github.com/inpod-dev/inpod/cnievent"
	"github.com/inpod-dev/inpod/netns/netnstest"
	ztunnel "github.com/inpod-dev/inpod/zds/zdstest"
)

// mirror is the mirror pod the kubelet creates in the API for a static pod
// whose UID (its manifest's hash) is hash.
func mirror(namespace, name, apiUID, hash string) *corev1.Pod {
	return &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: namespace, Name: name, UID: types.UID(apiUID),
		Annotations: map[string]string{
			enroll.MirrorAnnotation:       hash,
			"kubernetes.io/config.hash":   hash,
			"kubernetes.io/config.source": "file",
		}}}
}

// A static pod's sandbox is named by its manifest's hash, not by its mirror
// pod's API UID: the decision must follow the mirror pod, as for any pod.
// The enrolled case runs the real pipeline: nftables rules in a real pod
// netns, the netns handed to the ztunnel stand-in over ZDS.
func TestStaticPodsAreDecidedByTheirMirrorPod(t *testing.T) {
	f := newFixture(t)
	f.cache.pods["plain/web-node1"] = mirror("plain", "web-node1", "0b5e1c2a-1111-4c3d-9e8f-000000000001", "6f1c0ffee6f1c0ffee6f1c0ffee00001")
	f.cache.pods["mesh/web-node1"] = mirror("mesh", "web-node1", "0b5e1c2a-2222-4c3d-9e8f-000000000002", "6f1c0ffee6f1c0ffee6f1c0ffee00002")
	standin, _ := f.standin(ztunnel.Config{})
	p, c, ctx := f.p, f.cache, context.Background()

	add := func(namespace, uid string) (cnievent.Outcome, error) {
		pod := netnstest.New(t)
		return p.Add(ctx, &cnievent.Request{Command: cnievent.Add, PodNamespace: namespace, PodName: "web-node1",
			PodUID: uid, ContainerID: "c-" + namespace, Netns: pod.Path, IPs: []string{"198.18.0.9"}})
	}

	if out, err := add("plain", "6f1c0ffee6f1c0ffee6f1c0ffee00001"); out != cnievent.NotEnrolled || err != nil {
		t.Errorf("static pod in a plain namespace: %s, %v; want not-enrolled", out, err)
	}
	if out, err := add("mesh", "6f1c0ffee6f1c0ffee6f1c0ffee00002"); out != cnievent.Redirected || err != nil {
		t.Fatalf("static pod in an enrolled namespace: %s, %v; want redirected", out, err)
	}
	// ztunnel knows the pod by its API UID, as Istio's node agent sends it.
	if _, ok := standin.Workloads()["0b5e1c2a-2222-4c3d-9e8f-000000000002"]; !ok {
		t.Errorf("ztunnel was not handed the static pod under its mirror's UID: %v", standin.Workloads())
	}
	// Its CHECK and DEL carry the static pod's UID too (the hash): they
	// must find the pod, or a deleted static pod would keep its rules and
	// ztunnel its proxy until the pod watch noticed.
	meshDel := &cnievent.Request{Command: cnievent.Del, PodNamespace: "mesh", PodName: "web-node1",
		PodUID: "6f1c0ffee6f1c0ffee6f1c0ffee00002", ContainerID: "c-mesh"}
	if out, err := p.Del(ctx, meshDel); out != cnievent.Redirected || err != nil {
		t.Errorf("DEL of the static pod's sandbox: %s, %v; want redirected (unenrolled)", out, err)
	}
	if p.IsEnrolled("0b5e1c2a-2222-4c3d-9e8f-000000000002") {
		t.Error("the static pod is still enrolled after its sandbox's DEL")
	}
	if out, err := add("mesh", "6f1c0ffee6f1c0ffee6f1c0ffee00002"); out != cnievent.Redirected || err != nil {
		t.Fatalf("static pod in an enrolled namespace, again: %s, %v; want redirected", out, err)
	}
	// The manifest changed and the kubelet has not replaced the mirror
	// yet: its labels may be the old manifest's.
	if out, err := add("mesh", "0000000000000000000000000000beef"); out != cnievent.Failed || err == nil {
		t.Errorf("sandbox of another version of the static pod: %s, %v; want failed", out, err)
	}
	// No mirror pod in the API yet: its labels are unknown.
	delete(c.pods, "plain/web-node1")
	out, err := add("plain", "6f1c0ffee6f1c0ffee6f1c0ffee00001")
	if out != cnievent.Failed || err == nil || !strings.Contains(err.Error(), "not in the API server") {
		t.Errorf("static pod without its mirror pod: %s, %v; want failed (not known not to be enrolled)", out, err)
	}
}

func TestSandboxUIDOfMirrorPods(t *testing.T) {
	if got := enroll.SandboxUID(mirror("a", "b", "api-uid", "hash")); got != "hash" {
		t.Errorf("mirror pod: %q, want the static pod's hash", got)
	}
	plain := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{UID: "api-uid"}}
	if got := enroll.SandboxUID(plain); got != "api-uid" {
		t.Errorf("API pod: %q, want its UID", got)
	}
}
