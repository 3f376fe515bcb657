package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
)

// Pacing of a device-plugin close.
const (
	// closeSettle is how long a close waits, at least, after the Node's
	// allocatable reads 0: a bind the scheduler decided just before it saw
	// that lands in the API within it.
	closeSettle = time.Second
	// closePoll paces listing the node's pods: a close lasts a second or
	// a few, and the kubelet writes a pod's start time within ms of
	// admitting it.
	closePoll = 200 * time.Millisecond
	// closeNodeRecheck paces reading the Node again: the kubelet writes
	// the count it computes back at its next status sync.
	closeNodeRecheck = 500 * time.Millisecond
)

// schedulingCloser is the device-plugin gate's Closer: it sets the
// resource's allocatable on its Node to 0 (the scheduler reads nothing
// else; the kubelet would write it only at its next status sync, up to
// 10 s later), then waits until every pod bound to the node that requests
// the resource has been through the kubelet's admission. The gate's
// devices stay Healthy meanwhile, so the kubelet admits those pods instead
// of refusing them for good; each one then waits at its CNI ADD.
//
// Until the devices turn Unhealthy the kubelet computes the old count and
// writes it back at its next status sync; the close writes 0 again when it
// sees that.
type schedulingCloser struct {
	client   kubernetes.Interface
	node     string
	resource corev1.ResourceName
	log      *slog.Logger
	settle   time.Duration
	poll     time.Duration
}

func newSchedulingCloser(client kubernetes.Interface, node string, resource corev1.ResourceName, log *slog.Logger) *schedulingCloser {
	return &schedulingCloser{client: client, node: node, resource: resource, log: log, settle: closeSettle, poll: closePoll}
}

// CloseScheduling implements deviceplugin.Closer.
func (c *schedulingCloser) CloseScheduling(ctx context.Context) error {
	var (
		zeroed    bool
		zeroErr   error
		lastCheck time.Time
		settled   time.Time
		listed    bool
		listErr   error
		waiting   []types.NamespacedName
	)
	check := func() {
		lastCheck = time.Now()
		wrote, err := c.zeroAllocatable(ctx)
		if zeroErr = err; err != nil {
			zeroed = false
			return
		}
		if !zeroed || wrote {
			// The scheduler may have bound pods on the count it read
			// before this write.
			settled = time.Now().Add(c.settle)
		}
		zeroed = true
	}
	tick := time.NewTicker(c.poll)
	defer tick.Stop()
	for {
		if !zeroed || time.Since(lastCheck) >= closeNodeRecheck {
			check()
		}
		if now, err := c.unadmitted(ctx); err == nil {
			waiting, listed, listErr = now, true, nil
		} else {
			// Keep what was last seen: a throttled or failed list must
			// not end the close early.
			listErr = err
		}
		if zeroed && listed && listErr == nil && len(waiting) == 0 && !time.Now().Before(settled) {
			// The Node read fresh as the devices turn Unhealthy: a
			// kubelet sync since the last read may have written its
			// count back.
			if check(); zeroed && !time.Now().Before(settled) {
				return nil
			}
		}
		select {
		case <-ctx.Done():
			return c.incomplete(zeroed, zeroErr, listErr, waiting)
		case <-tick.C:
		}
	}
}

// KeepClosed implements deviceplugin.Closer: the Node's count back to 0
// whenever it reads otherwise, until ctx ends.
func (c *schedulingCloser) KeepClosed(ctx context.Context) {
	tick := time.NewTicker(closeNodeRecheck)
	defer tick.Stop()
	for {
		if _, err := c.zeroAllocatable(ctx); err != nil && ctx.Err() == nil {
			c.log.Debug("cannot keep the Node's allocatable at 0", "resource", c.resource, "err", err)
		}
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}

func (c *schedulingCloser) incomplete(zeroed bool, zeroErr, listErr error, waiting []types.NamespacedName) error {
	var errs []error
	if !zeroed {
		errs = append(errs, fmt.Errorf("the Node's allocatable %s is not 0 (the scheduler may still bind pods here): %w", c.resource, zeroErr))
	}
	if listErr != nil {
		errs = append(errs, fmt.Errorf("cannot list the node's pods: %w", listErr))
	}
	if len(waiting) > 0 {
		names := make([]string, len(waiting))
		for i, k := range waiting {
			names[i] = k.String()
		}
		errs = append(errs, fmt.Errorf("%d bound pods not yet admitted by the kubelet: %s", len(waiting), strings.Join(names, ", ")))
	}
	if len(errs) == 0 {
		errs = append(errs, errors.New("timed out while binds decided before the close could still land"))
	}
	return errors.Join(errs...)
}

// zeroAllocatable writes the resource's allocatable on the Node as 0,
// unless it reads 0 or is not there; wrote says whether it wrote.
func (c *schedulingCloser) zeroAllocatable(ctx context.Context) (wrote bool, err error) {
	node, err := c.client.CoreV1().Nodes().Get(ctx, c.node, metav1.GetOptions{})
	if err != nil {
		return false, err
	}
	if q, ok := node.Status.Allocatable[c.resource]; !ok || q.IsZero() {
		return false, nil
	}
	// The resourceVersion read makes the write conditional: a count the
	// kubelet wrote since, as the node turned ready again, is not
	// overwritten.
	patch := fmt.Appendf(nil, `{"metadata":{"resourceVersion":%q},"status":{"allocatable":{%q:"0"}}}`, node.ResourceVersion, c.resource)
	if _, err := c.client.CoreV1().Nodes().PatchStatus(ctx, c.node, patch); err != nil {
		return false, err
	}
	c.log.Info("set the Node's allocatable to 0 so the scheduler binds no more pods here", "resource", c.resource)
	return true, nil
}

// unadmitted lists the pods bound to the node, requesting the resource,
// that the kubelet has not decided on yet: it sets a pod's start time when
// it admits it (or refuses it). It reads the API, not the agent's pod
// watch: at shutdown the watch has stopped, and the watch keeps neither
// field. Served from the API server's watch cache (resourceVersion 0): a
// close lists a few times a second, on every node of a dip at once.
func (c *schedulingCloser) unadmitted(ctx context.Context) ([]types.NamespacedName, error) {
	list, err := c.client.CoreV1().Pods(metav1.NamespaceAll).List(ctx, metav1.ListOptions{
		FieldSelector: fields.OneTermEqualSelector("spec.nodeName", c.node).String(), ResourceVersion: "0"})
	if err != nil {
		return nil, err
	}
	var out []types.NamespacedName
	for i := range list.Items {
		p := &list.Items[i]
		if p.Spec.NodeName != c.node || p.DeletionTimestamp != nil || p.Status.StartTime != nil ||
			(p.Status.Phase != "" && p.Status.Phase != corev1.PodPending) || !requestsResource(p, c.resource) {
			continue
		}
		out = append(out, types.NamespacedName{Namespace: p.Namespace, Name: p.Name})
	}
	return out, nil
}

// requestsResource reports whether any of the pod's containers asks for
// the resource (an extended resource's limit implies its request).
func requestsResource(p *corev1.Pod, resource corev1.ResourceName) bool {
	for _, cs := range [][]corev1.Container{p.Spec.InitContainers, p.Spec.Containers} {
		for _, c := range cs {
			if _, ok := c.Resources.Limits[resource]; ok {
				return true
			}
			if _, ok := c.Resources.Requests[resource]; ok {
				return true
			}
		}
	}
	return false
}
