package agent

import (
	"context"
	"errors"
	"net/netip"
	"os"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
	listersv1 "k8s.io/client-go/listers/core/v1"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/client-go/tools/cache"

	"github.com/inpod-dev/inpod/agent/enroll"
	"github.com/inpod-dev/inpod/cnievent"
	"github.com/inpod-dev/inpod/enrollment"
	"github.com/inpod-dev/inpod/netns/netnstest"
	"github.com/inpod-dev/inpod/zds"
)

// A pod deleted and recreated under its name (a StatefulSet's) whose DEL
// was missed: reconciling the name must drop the old incarnation, or it
// stays in every snapshot with its netns fd and probe exemption, and a
// later removal by name may pick either.
func TestReconcileDropsAnOldIncarnationOfARecreatedPod(t *testing.T) {
	old := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "mesh", Name: "web-0", UID: "uid-old",
		Labels: map[string]string{enrollment.DataplaneModeLabel: enrollment.DataplaneAmbient}}}
	recreated := old.DeepCopy()
	recreated.UID = "uid-new"
	indexer := cache.NewIndexer(cache.MetaNamespaceKeyFunc, cache.Indexers{})
	pods := &podCache{pods: listersv1.NewPodLister(indexer), client: fake.NewClientset(recreated)}

	a, p := agentWithEnrolled(t, old)
	ctx := context.Background()
	if err := indexer.Add(recreated); err != nil {
		t.Fatal(err)
	}
	if err := a.reconcileOne(ctx, types.NamespacedName{Namespace: "mesh", Name: "web-0"}, pods); err != nil {
		t.Fatal(err)
	}
	if p.IsEnrolled("uid-old") {
		t.Fatal("the deleted incarnation of a recreated pod is still enrolled")
	}
}

// An enrolled pod the cache does not show is taken out only once the API
// confirms it is gone: the CNI ADD may have read it from the API while the
// watch lagged, and a sweep must not take a running pod out of the mesh.
func TestReconcileKeepsAnEnrolledPodTheCacheLagsOn(t *testing.T) {
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "mesh", Name: "web-0", UID: "uid-1",
		Labels: map[string]string{enrollment.DataplaneModeLabel: enrollment.DataplaneAmbient}}}
	key := types.NamespacedName{Namespace: "mesh", Name: "web-0"}
	client := fake.NewClientset(pod)
	pods := &podCache{pods: listersv1.NewPodLister(cache.NewIndexer(cache.MetaNamespaceKeyFunc, cache.Indexers{})), client: client}
	a, p := agentWithEnrolled(t, pod)
	ctx := context.Background()

	if err := a.reconcileOne(ctx, key, pods); err != nil {
		t.Fatal(err)
	}
	if !p.IsEnrolled("uid-1") {
		t.Fatal("a running pod the cache had not caught up with was taken out of the mesh")
	}

	// The API unreachable: nothing is decided, and the error retries it.
	client.PrependReactor("get", "pods", func(k8stesting.Action) (bool, runtime.Object, error) {
		return true, nil, errors.New("connection refused")
	})
	if err := a.reconcileOne(ctx, key, pods); err == nil || !p.IsEnrolled("uid-1") {
		t.Fatalf("reconcile with the API down = %v, enrolled %v; want an error and the pod kept", err, p.IsEnrolled("uid-1"))
	}

	// Gone from the API too: out of the table.
	client.ReactionChain = client.ReactionChain[1:]
	if err := client.Tracker().Delete(corev1.SchemeGroupVersion.WithResource("pods"), "mesh", "web-0"); err != nil {
		t.Fatal(err)
	}
	if err := a.reconcileOne(ctx, key, pods); err != nil {
		t.Fatal(err)
	}
	if p.IsEnrolled("uid-1") {
		t.Fatal("a deleted pod whose DEL was missed is still enrolled")
	}
}

// agentWithEnrolled is an agent whose pipeline enrolled pod through its
// CNI ADD (in a scratch netns; rules, probes and ztunnel no-ops).
func agentWithEnrolled(t *testing.T, pod *corev1.Pod) (*Agent, *enroll.Pipeline) {
	t.Helper()
	p := enroll.New(enroll.Config{Rules: noRules{}, Probes: noProbes{}, Ztunnel: noZtunnel{}, Pods: onePod{pod},
		Annotations: nop{}, Events: nop{}, Observer: nop{}})
	t.Cleanup(p.Close)
	sb := netnstest.New(t)
	if out, err := p.Add(context.Background(), &cnievent.Request{Command: cnievent.Add, PodNamespace: pod.Namespace, PodName: pod.Name,
		PodUID: string(pod.UID), ContainerID: "c-" + string(pod.UID), Netns: sb.Path}); out != cnievent.Redirected {
		t.Fatalf("ADD = %q, %v", out, err)
	}
	return &Agent{pipeline: p}, p
}

type noRules struct{}

func (noRules) Apply(*os.File, enroll.Variant) (bool, error) { return true, nil }
func (noRules) Present(*os.File) (bool, error)               { return false, nil }
func (noRules) Remove(*os.File) (bool, error)                { return true, nil }

type noProbes struct{}

func (noProbes) Add(netip.Addr) error    { return nil }
func (noProbes) Remove(netip.Addr) error { return nil }
func (noProbes) Sync([]netip.Addr, bool) (added, removed []netip.Addr, err error) {
	return nil, nil, nil
}

type noZtunnel struct{}

func (noZtunnel) Add(context.Context, zds.Workload) error { return nil }
func (noZtunnel) Del(context.Context, string) error       { return nil }

type onePod struct{ pod *corev1.Pod }

func (o onePod) Pod(context.Context, string, string) (*corev1.Pod, error)  { return o.pod, nil }
func (o onePod) Live(context.Context, string, string) (*corev1.Pod, error) { return o.pod, nil }
func (o onePod) Namespace(_ context.Context, name string) (*corev1.Namespace, error) {
	return &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}, nil
}

type nop struct{}

func (nop) Set(types.NamespacedName, types.UID, string) {}
func (nop) Warn(*corev1.Pod, string, string)            {}
func (nop) Enrolled(string, time.Duration)              {}
func (nop) Failed(string)                               {}
func (nop) Removed()                                    {}
func (nop) RanUnredirected()                            {}
