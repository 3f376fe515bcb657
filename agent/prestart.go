package agent

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"k8s.io/apimachinery/pkg/types"
	podresourcesapi "k8s.io/kubelet/pkg/apis/podresources/v1"
)

// DefaultPodResourcesSocket is the kubelet's pod-resources API.
const DefaultPodResourcesSocket = "/var/lib/kubelet/pod-resources/kubelet.sock"

// preStartCheck answers the device plugin's PreStartContainer: it names the
// pod holding the devices (the kubelet's pod-resources API; the request
// carries only device IDs, which the kubelet allocates to one container
// alone) and asks the pipeline whether that pod runs redirected in its
// current sandbox (enroll.Pipeline.MayStart).
type preStartCheck struct {
	resource string
	lister   podresourcesapi.PodResourcesListerClient
	// mayStart and requeue are the agent's, set once it has built them;
	// until then every container start of a gated pod waits.
	mayStart func(ctx context.Context, namespace, name string) error
	requeue  func(types.NamespacedName)
}

func newPreStartCheck(socket, resource string) (*preStartCheck, error) {
	// Dialled lazily: the kubelet may start after the agent.
	conn, err := grpc.NewClient("unix://"+socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, fmt.Errorf("agent: the kubelet's pod-resources API at %s: %w", socket, err)
	}
	return &preStartCheck{resource: resource, lister: podresourcesapi.NewPodResourcesListerClient(conn)}, nil
}

func (c *preStartCheck) check(ctx context.Context, deviceIDs []string) error {
	if c.mayStart == nil {
		return errors.New("the agent is starting; holding the container until it can tell whether its pod runs redirected")
	}
	key, err := c.podOf(ctx, deviceIDs)
	if err != nil {
		return err
	}
	if err := c.mayStart(ctx, key.Namespace, key.Name); err != nil {
		// The pod update that shows its sandbox's IPs reconciles it
		// too; this covers an update that came before.
		if c.requeue != nil {
			c.requeue(key)
		}
		return err
	}
	return nil
}

// podOf names the pod one of whose containers holds the devices.
func (c *preStartCheck) podOf(ctx context.Context, deviceIDs []string) (types.NamespacedName, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	resp, err := c.lister.List(ctx, &podresourcesapi.ListPodResourcesRequest{})
	if err != nil {
		return types.NamespacedName{}, fmt.Errorf("ask the kubelet which pod holds %s devices %v: %w", c.resource, deviceIDs, err)
	}
	for _, pod := range resp.GetPodResources() {
		for _, ctr := range pod.GetContainers() {
			for _, dev := range ctr.GetDevices() {
				if dev.GetResourceName() != c.resource {
					continue
				}
				for _, id := range dev.GetDeviceIds() {
					if slices.Contains(deviceIDs, id) {
						return types.NamespacedName{Namespace: pod.GetNamespace(), Name: pod.GetName()}, nil
					}
				}
			}
		}
	}
	return types.NamespacedName{}, fmt.Errorf("the kubelet names no pod holding %s devices %v", c.resource, deviceIDs)
}
