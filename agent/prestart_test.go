package agent

import (
	"context"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"k8s.io/apimachinery/pkg/types"
	podresourcesapi "k8s.io/kubelet/pkg/apis/podresources/v1"

	"github.com/inpod-dev/inpod/internal/testkit"
)

// The kubelet's answer as listed; the real API is exercised by the e2e
// test of the gate (TestE2EPreStartHoldsASandboxSetUpWithoutInpod).
type listedPods struct {
	podresourcesapi.PodResourcesListerClient
	pods []*podresourcesapi.PodResources
}

func (l listedPods) List(context.Context, *podresourcesapi.ListPodResourcesRequest, ...grpc.CallOption) (*podresourcesapi.ListPodResourcesResponse, error) {
	return &podresourcesapi.ListPodResourcesResponse{PodResources: l.pods}, nil
}

func TestPreStartNamesThePodHoldingTheDevices(t *testing.T) {
	const res = "inpod.dev/redirection"
	pods := []*podresourcesapi.PodResources{
		{Namespace: "gpu", Name: "train", Containers: []*podresourcesapi.ContainerResources{{Name: "main",
			Devices: []*podresourcesapi.ContainerDevices{{ResourceName: "example.com/gpu", DeviceIds: []string{"dev-7"}}}}}},
		{Namespace: "mesh", Name: "web", Containers: []*podresourcesapi.ContainerResources{
			{Name: "sidecar"},
			{Name: "app", Devices: []*podresourcesapi.ContainerDevices{{ResourceName: res, DeviceIds: []string{"dev-7"}}}}}},
	}
	var asked []types.NamespacedName
	hold := errors.New("not redirected yet")
	var requeued []types.NamespacedName
	c := &preStartCheck{resource: res, lister: listedPods{pods: pods},
		mayStart: func(_ context.Context, ns, name string) error {
			asked = append(asked, types.NamespacedName{Namespace: ns, Name: name})
			return hold
		},
		requeue: func(k types.NamespacedName) { requeued = append(requeued, k) }}
	web := types.NamespacedName{Namespace: "mesh", Name: "web"}
	// Another resource's device of the same ID is not ours.
	if err := c.check(context.Background(), []string{"dev-7"}); !errors.Is(err, hold) {
		t.Fatalf("check = %v, want the pipeline's answer", err)
	}
	if len(asked) != 1 || asked[0] != web || len(requeued) != 1 || requeued[0] != web {
		t.Fatalf("asked %v, requeued %v; want mesh/web once each", asked, requeued)
	}
	// A plain init container's devices: the kubelet does not list it, so
	// no pod can be named, and holding it would hold that pod for good.
	if err := c.check(context.Background(), []string{"dev-9"}); err != nil || len(asked) != 1 {
		t.Fatalf("check of devices no listed container holds = %v (asked %v), want let through", err, asked)
	}
	starting := &preStartCheck{resource: res, lister: listedPods{pods: pods}}
	if err := starting.check(context.Background(), []string{"dev-7"}); err == nil || !strings.Contains(err.Error(), "starting") {
		t.Fatalf("check before the agent has built its pipeline = %v, want held", err)
	}
}

// A pod-resources socket that is there but does not answer turns the check
// off: on, it would hold every gated container for good.
func TestPreStartCheckOffWhenThePodResourcesAPIDoesNotAnswer(t *testing.T) {
	path := filepath.Join(t.TempDir(), "kubelet.sock")
	if err := os.WriteFile(path, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	a := &Agent{cfg: Config{PodResourcesSocket: path}, log: slog.New(slog.DiscardHandler)}
	c, err := a.newPreStartCheck("")
	if err != nil || c != nil {
		t.Fatalf("newPreStartCheck with a dead socket = %v, %v; want no check and no error", c, err)
	}
	a.cfg.PodResourcesSocket = filepath.Join(t.TempDir(), "missing.sock")
	if c, err := a.newPreStartCheck(""); err != nil || c != nil {
		t.Fatalf("newPreStartCheck with no socket = %v, %v; want no check and no error", c, err)
	}
}

// A start the pipeline would refuse is reconciled at once and asked again:
// a refusal costs the pod the kubelet's sync back-off even when the agent
// can redirect it now.
func TestPreStartReconcilesBeforeItRefuses(t *testing.T) {
	const res = "inpod.dev/redirection"
	web := types.NamespacedName{Namespace: "mesh", Name: "web"}
	pods := []*podresourcesapi.PodResources{{Namespace: web.Namespace, Name: web.Name, Containers: []*podresourcesapi.ContainerResources{
		{Name: "app", Devices: []*podresourcesapi.ContainerDevices{{ResourceName: res, DeviceIds: []string{"dev-1"}}}}}}}
	for _, redirects := range []bool{true, false} {
		redirected := false
		var reconciled, requeued []types.NamespacedName
		c := &preStartCheck{resource: res, lister: listedPods{pods: pods},
			mayStart: func(context.Context, string, string) error {
				if redirected {
					return nil
				}
				return errors.New("not redirected yet")
			},
			reconcile: func(_ context.Context, k types.NamespacedName) {
				reconciled = append(reconciled, k)
				redirected = redirects
			},
			requeue: func(k types.NamespacedName) { requeued = append(requeued, k) }}
		err := c.check(context.Background(), []string{"dev-1"})
		if len(reconciled) != 1 || reconciled[0] != web {
			t.Fatalf("reconciled %v, want mesh/web once", reconciled)
		}
		// Requeued either way: the reconcile read the pod before its lock.
		switch {
		case redirects && (err != nil || len(requeued) != 1):
			t.Fatalf("redirected by the reconcile: check = %v, requeued %v; want let through, requeued", err, requeued)
		case !redirects && (err == nil || len(requeued) != 1):
			t.Fatalf("still not redirected: check = %v, requeued %v; want held and requeued", err, requeued)
		}
	}
}

// Nothing of an agent acts on the node once it hands it over or stops,
// also not a container start's reconcile already under way: stopActing
// waits for it, and none runs after.
func TestNothingActsOnceQuiet(t *testing.T) {
	a := &Agent{}
	if a.whileServing(func() { t.Fatal("acted before serving the node") }) {
		t.Fatal("whileServing ran before the agent served")
	}
	a.serving.Store(true)
	inFlight, release := make(chan struct{}), make(chan struct{})
	done := make(chan bool)
	go func() { done <- a.whileServing(func() { close(inFlight); <-release }) }()
	<-inFlight
	stopped := make(chan struct{})
	go func() { a.stopActing(); close(stopped) }()
	// Until the stop waits for the lock (a reader is then refused) or
	// has, wrongly, not waited at all.
	testkit.Eventually(t, 10*time.Second, "the stop under way", func() bool {
		select {
		case <-stopped:
			return true
		default:
		}
		if a.acting.TryRLock() {
			a.acting.RUnlock()
			return false
		}
		return true
	})
	select {
	case <-stopped:
		t.Fatal("stopActing returned while a reconcile was acting on the node")
	default:
	}
	close(release)
	if !<-done {
		t.Fatal("the reconcile under way did not run")
	}
	<-stopped
	if a.whileServing(func() { t.Fatal("acted after stopActing") }) {
		t.Fatal("whileServing ran after stopActing")
	}
}
