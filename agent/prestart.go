package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
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
	log      *slog.Logger
	resource string
	lister   podresourcesapi.PodResourcesListerClient
	// mayStart and requeue are the agent's, set once it has built them;
	// until then every container start of a gated pod waits.
	mayStart func(ctx context.Context, namespace, name string) error
	requeue  func(types.NamespacedName)
	// reconcile, when set, reconciles the pod at once before a refusal
	// is final (reconcileNow).
	reconcile func(ctx context.Context, key types.NamespacedName)
}

// newPreStartCheck connects to the pod-resources API and lists once: an
// API that does not answer would hold every gated container for good, so
// the caller runs without the check then.
func newPreStartCheck(ctx context.Context, socket, resource string, log *slog.Logger) (*preStartCheck, error) {
	conn, err := grpc.NewClient("unix://"+socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, err
	}
	lister := podresourcesapi.NewPodResourcesListerClient(conn)
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if _, err := lister.List(ctx, &podresourcesapi.ListPodResourcesRequest{}); err != nil {
		conn.Close()
		return nil, err
	}
	return &preStartCheck{log: log, resource: resource, lister: lister}, nil
}

func (c *preStartCheck) check(ctx context.Context, deviceIDs []string) error {
	if c.mayStart == nil {
		return errors.New("the agent is starting; holding the container until it can tell whether its pod runs redirected")
	}
	key, found, err := c.podOf(ctx, deviceIDs)
	if err != nil {
		return err
	}
	if !found {
		// The kubelet lists app and sidecar containers, not plain init
		// containers: a request written by hand on one cannot be traced
		// to a pod, and holding it would hold that pod for good. The
		// chart's policy puts the request on the first app container.
		if c.log != nil {
			c.log.Info("letting a container start: the kubelet names no pod holding its devices (a plain init container?)", "resource", c.resource, "devices", deviceIDs)
		}
		return nil
	}
	err = c.mayStart(ctx, key.Namespace, key.Name)
	if err != nil && c.reconcile != nil {
		// A refusal costs the pod the kubelet's sync back-off (10 s
		// and more) even when the agent could redirect it now.
		c.reconcile(ctx, key)
		err = c.mayStart(ctx, key.Namespace, key.Name)
	}
	// The reconciler looks again in any case: the pod update that shows
	// its sandbox's IPs reconciles it too, but may have come before, and
	// the reconcile here read the pod from the cache before its lock.
	if err != nil || c.reconcile != nil {
		if c.requeue != nil {
			c.requeue(key)
		}
	}
	return err
}

// mayStart is the pipeline's answer; a retired agent's names itself: its
// table stopped at the hand-over, so it holds pods its successor enrolled
// until the successor's plugin is registered and answers instead.
func (a *Agent) mayStart(p *pieces) func(context.Context, string, string) error {
	return func(ctx context.Context, namespace, name string) error {
		err := p.pipeline.MayStart(ctx, namespace, name)
		if err != nil && a.retired.Load() {
			return fmt.Errorf("%w (answered by an agent that handed the node over; its successor answers once its device plugin is registered)", err)
		}
		return err
	}
}

// preStartReconcileWait bounds a reconcile for a container start once it
// runs (the kubelet waits for the answer); one that would wait for the
// pod's lock does not run (Pipeline.ReconcileIfFree).
const preStartReconcileWait = 2 * time.Second

// reconcileNow reconciles a pod whose container start would be refused:
// one the agent before this one enrolled, held until its netns is found,
// or one whose sandbox was set up without inpod. The reconciler would get
// to it too, but the kubelet asks again only at its next sync. Only while
// this agent acts on the node (whileServing).
func (a *Agent) reconcileNow(p *pieces) func(context.Context, types.NamespacedName) {
	return func(ctx context.Context, key types.NamespacedName) {
		a.whileServing(func() {
			pod, err := p.pods.pods.Pods(key.Namespace).Get(key.Name)
			if err != nil {
				return
			}
			ctx, cancel := context.WithTimeout(ctx, preStartReconcileWait)
			defer cancel()
			if ran, err := a.pipeline.ReconcileIfFree(ctx, pod); ran && err != nil {
				a.log.Info("a container start's reconcile did not redirect its pod yet", "pod", key, "err", err)
			}
		})
	}
}

// whileServing runs act if this agent acts on the node (it serves it, and
// has neither handed it over nor begun to stop), and keeps stopActing
// waiting until act returns; it says whether act ran.
func (a *Agent) whileServing(act func()) bool {
	a.acting.RLock()
	defer a.acting.RUnlock()
	if !a.serving.Load() || a.quiet.Load() {
		return false
	}
	act()
	return true
}

// stopActing ends whileServing's acts: none starts after it began, and it
// returns once none runs. The caller bounds the wait (each act is short,
// see reconcileNow).
func (a *Agent) stopActing() {
	a.quiet.Store(true)
	a.acting.Lock()
	defer a.acting.Unlock()
}

// podOf names the pod one of whose containers holds the devices; found is
// false when the kubelet lists none.
func (c *preStartCheck) podOf(ctx context.Context, deviceIDs []string) (_ types.NamespacedName, found bool, _ error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	resp, err := c.lister.List(ctx, &podresourcesapi.ListPodResourcesRequest{})
	if err != nil {
		return types.NamespacedName{}, false, fmt.Errorf("ask the kubelet which pod holds %s devices %v: %w", c.resource, deviceIDs, err)
	}
	for _, pod := range resp.GetPodResources() {
		for _, ctr := range pod.GetContainers() {
			for _, dev := range ctr.GetDevices() {
				if dev.GetResourceName() != c.resource {
					continue
				}
				for _, id := range dev.GetDeviceIds() {
					if slices.Contains(deviceIDs, id) {
						return types.NamespacedName{Namespace: pod.GetNamespace(), Name: pod.GetName()}, true, nil
					}
				}
			}
		}
	}
	return types.NamespacedName{}, false, nil
}
