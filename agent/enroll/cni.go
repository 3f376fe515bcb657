package enroll

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"

	"github.com/inpod-dev/inpod/cnievent"
	"github.com/inpod-dev/inpod/netns"
)

// The CNI verbs: ADD enrolls a new sandbox, DEL unenrolls the sandbox a
// pod is enrolled with, CHECK re-applies an enrolled pod's rules.

// Add handles the plugin's ADD: the pod is enrolled or not, decided from
// positive knowledge of the pod and, where the pod's labels leave it open,
// its namespace; when it is, its rules are applied and ztunnel has
// acknowledged it before Redirected is answered.
func (p *Pipeline) Add(ctx context.Context, req *cnievent.Request) (cnievent.Outcome, error) {
	start := time.Now()
	pod, err := p.cfg.Pods.Pod(ctx, req.PodNamespace, req.PodName)
	if err != nil {
		if apierrors.IsNotFound(err) {
			p.observeFailure("PodNotInAPI")
			return podNotInAPI(req)
		}
		p.observeFailure("PodLookupFailed")
		return cnievent.Failed, fmt.Errorf("look up pod %s: %w", req.Pod(), err)
	}
	if !sandboxOf(pod, req.PodUID) {
		p.observeFailure("StalePod")
		return cnievent.Failed, fmt.Errorf("pod %s has uid %s, the runtime named %s; refusing a stale sandbox", req.Pod(), pod.UID, req.PodUID)
	}
	if req.PodUID == "" {
		if pod, err = p.podWithoutUID(ctx, req, pod); err != nil {
			return cnievent.Failed, err
		}
	}
	want, err := p.wants(ctx, pod)
	if err != nil {
		// Unknown is not "not enrolled": the runtime retries the ADD.
		return cnievent.Failed, p.report(pod, fail("NamespaceUnknown", "%v", err))
	}
	if !want {
		return cnievent.NotEnrolled, nil
	}
	var ips []netip.Addr
	for _, s := range req.IPs {
		if ip, err := netip.ParseAddr(s); err == nil {
			ips = append(ips, ip.Unmap())
		}
	}
	nsFile, err := netns.Open(req.Netns)
	if err != nil {
		return cnievent.Failed, p.report(pod, fail("NetnsUnavailable", "open the pod's netns %s: %v", req.Netns, err))
	}
	defer p.lock(pod.UID)()
	if err := p.enroll(ctx, pod, sandbox{netns: nsFile, ips: ips, containerID: req.ContainerID}, true); err != nil {
		return cnievent.Failed, err
	}
	p.cfg.Observer.Enrolled("cni", time.Since(start))
	return cnievent.Redirected, nil
}

// podWithoutUID is the pod an ADD without a pod UID is for (a runtime
// that does not pass K8S_POD_UID). The cache may still hold a pod of that
// name that has since been replaced (a StatefulSet's pod, force-deleted
// and recreated): enrolled under that pod's UID, the sandbox would reach
// ztunnel as the wrong workload, and the old pod's removal would later
// take the rules out of the new pod while it runs. The API knows which pod
// the name belongs to now; while it cannot be reached the cached pod
// stands, as it did before the API was asked.
func (p *Pipeline) podWithoutUID(ctx context.Context, req *cnievent.Request, cached *corev1.Pod) (*corev1.Pod, error) {
	ctx, cancel := context.WithTimeout(ctx, liveReadTimeout)
	defer cancel()
	live, err := p.cfg.Pods.Live(ctx, req.PodNamespace, req.PodName)
	switch {
	case apierrors.IsNotFound(err):
		p.observeFailure("PodNotInAPI")
		_, err := podNotInAPI(req)
		return nil, err
	case err != nil:
		p.log.Warn("the runtime named no pod UID and the API could not say which pod the name belongs to now; going by the cache", "pod", req.Pod(), "err", err)
		return cached, nil
	case live.Spec.NodeName != cached.Spec.NodeName:
		// The name now belongs to a pod bound elsewhere: this sandbox's
		// pod is gone.
		p.observeFailure("StalePod")
		return nil, fmt.Errorf("pod %s is now bound to node %q, not this sandbox's %q; refusing a stale sandbox", req.Pod(), live.Spec.NodeName, cached.Spec.NodeName)
	}
	return live, nil
}

// liveReadTimeout bounds a read past the cache on the ADD's path.
const liveReadTimeout = 5 * time.Second

// wants applies the policy, reading the pod's namespace only when the pod's
// own labels leave the answer to it. An error means the namespace is not
// known (the look-up waits, bounded, and reads the API once): the caller
// must not take that for "not enrolled".
func (p *Pipeline) wants(ctx context.Context, pod *corev1.Pod) (bool, error) {
	if enrolled, decided := p.cfg.Policy.ByPod(pod); decided {
		return enrolled, nil
	}
	ns, err := p.cfg.Pods.Namespace(ctx, pod.Namespace)
	if err != nil {
		return false, fmt.Errorf("namespace %s of pod %s/%s is not known, so its enrollment cannot be decided: %w", pod.Namespace, pod.Namespace, pod.Name, err)
	}
	return p.cfg.Policy.Enrolled(pod, ns), nil
}

// Del handles the plugin's DEL: the sandbox is going away. It acts only on
// the sandbox the pod is enrolled with: the same container ID, or, for a pod
// enrolled through procfs (its container ID unknown), a netns path that
// resolves to the held netns. Anything else (an older sandbox's DEL, with
// its netns already gone or not) is ignored: acting on it would leave the
// live sandbox unredirected, while ignoring a real one only leaves the pod in
// the table until its pod watch or the sandbox check removes it.
func (p *Pipeline) Del(ctx context.Context, req *cnievent.Request) (cnievent.Outcome, error) {
	// A sandbox of the pod going away, whatever this DEL is taken for
	// below: a pod relabelled out while it drains has nothing left to
	// redirect once its DEL came.
	key := types.NamespacedName{Namespace: req.PodNamespace, Name: req.PodName}
	p.sawDel(types.UID(req.PodUID), key)
	uid, ok := p.lookup(req)
	if !ok {
		return cnievent.NotEnrolled, nil
	}
	p.sawDel(uid, key)
	defer p.lock(uid)()
	e := p.entry(uid)
	if e == nil {
		return cnievent.NotEnrolled, nil
	}
	if !e.names(req) {
		p.log.Info("ignoring a DEL for a sandbox the pod is not enrolled with", "pod", e.pod, "containerID", req.ContainerID, "enrolledContainerID", e.containerID, "netns", req.Netns)
		// Another sandbox of an enrolled pod went: whether the one
		// enrolled is still the pod's is for a verification to say.
		p.verifySoon()
		return cnievent.NotEnrolled, nil
	}
	if err := p.unenroll(ctx, uid, e, false); err != nil {
		return cnievent.Failed, err
	}
	return cnievent.Redirected, nil
}

// Check verifies an enrolled pod's rules by re-applying them: an intact set
// writes nothing; a repaired one is reported, since something changed it. A
// CHECK whose netns is the held one also tells a pod enrolled through procfs
// its container ID.
func (p *Pipeline) Check(ctx context.Context, req *cnievent.Request) (cnievent.Outcome, error) {
	uid, ok := p.lookup(req)
	if !ok {
		return cnievent.NotEnrolled, nil
	}
	defer p.lock(uid)()
	e := p.entry(uid)
	if e == nil {
		return cnievent.NotEnrolled, nil
	}
	if e.containerID == "" && req.ContainerID != "" && e.holds(req.Netns) {
		p.mu.Lock()
		e.containerID = req.ContainerID
		p.mu.Unlock()
	}
	changed, err := p.cfg.Rules.Apply(e.netns, e.variant)
	if err != nil {
		return cnievent.Failed, fmt.Errorf("verify rules: %w", err)
	}
	if changed {
		return cnievent.Failed, errors.New("redirection rules were not intact (now repaired)")
	}
	return cnievent.Redirected, nil
}
