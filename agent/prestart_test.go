package agent

import (
	"context"
	"errors"
	"strings"
	"testing"

	"google.golang.org/grpc"
	"k8s.io/apimachinery/pkg/types"
	podresourcesapi "k8s.io/kubelet/pkg/apis/podresources/v1"
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
	if err := c.check(context.Background(), []string{"dev-9"}); err == nil || !strings.Contains(err.Error(), "names no pod") {
		t.Fatalf("check of devices no pod holds = %v, want held", err)
	}
	starting := &preStartCheck{resource: res, lister: listedPods{pods: pods}}
	if err := starting.check(context.Background(), []string{"dev-7"}); err == nil || !strings.Contains(err.Error(), "starting") {
		t.Fatalf("check before the agent has built its pipeline = %v, want held", err)
	}
}
