package enroll

import (
	"context"
	"time"

	corev1 "k8s.io/api/core/v1"
)

// RepairOutside is the repair kind of inpod's rules found in the netns of a
// pod outside the mesh, and removed.
const RepairOutside = "outside-mesh-rules"

// EventRemovedOutside is the Event on a pod outside the mesh whose netns
// held inpod's rules, which are removed.
const EventRemovedOutside = "RedirectionRemoved"

// DefaultSweepEvery is how often the agent sweeps the pods outside the mesh
// (SweepOutside): every pod's netns is found through procfs, which costs
// far more than a verification round; the enrolled pods' proof does not
// wait for it.
const DefaultSweepEvery = DefaultSandboxCheckEvery

// SweepOutside proves that none of pods (the node's) that is outside the
// mesh carries inpod's rules, and removes those it finds. Such rules can
// only be left by a path that failed to take them out (an agent killed
// between writing a pod's rules and recording it, a removal that failed
// with no entry left to retry it); they send a pod's traffic to listeners
// ztunnel does not serve for it, or to none.
//
// A pod is swept only when, under its lock, the policy keeps it out of the
// mesh, the table holds no entry for it (a removal still to retry is the
// reconciler's) and it is not held: a pod whose enrollment is in flight
// holds the lock, and one the policy wants is never touched here, so this
// can never take the rules from a pod in the mesh. Host-network pods and
// pods without IPs (no sandbox yet, or finished) have no netns of their
// own to look at. It returns how many pods it looked at and how many it
// cleaned.
func (p *Pipeline) SweepOutside(ctx context.Context, pods []*corev1.Pod) (checked, removed int) {
	start := time.Now()
	for _, pod := range pods {
		if ctx.Err() != nil {
			break
		}
		if p.sweepOne(ctx, pod, &checked) {
			removed++
		}
	}
	if removed > 0 {
		p.log.Warn("removed inpod's rules from pods outside the mesh", "pods", removed, "checked", checked, "took", time.Since(start))
	} else {
		p.log.Debug("no pod outside the mesh carries inpod's rules", "checked", checked, "took", time.Since(start))
	}
	return checked, removed
}

func (p *Pipeline) sweepOne(ctx context.Context, pod *corev1.Pod, checked *int) bool {
	ips := podIPs(pod)
	finished := pod.Status.Phase == corev1.PodSucceeded || pod.Status.Phase == corev1.PodFailed
	if pod.Spec.HostNetwork || len(ips) == 0 || finished {
		return false
	}
	defer p.lock(pod.UID)()
	if p.entry(pod.UID) != nil || p.heldPod(pod.UID) != nil {
		return false
	}
	if want, err := p.wants(ctx, pod); err != nil || want {
		return false
	}
	// By the sandbox's UID: a static pod's processes are in cgroups named
	// by its config hash, not by its mirror pod's UID.
	ns, err := p.cfg.Finder.Find(SandboxUID(pod), ips)
	if err != nil {
		return false // not running (any more): nothing to clean
	}
	defer ns.Close()
	*checked++
	key := pod.Namespace + "/" + pod.Name
	// Only where inpod's netfilter rules are: the policy route has
	// Istio's values (table 100, fwmark 0x111), so a pod Istio's own CNI
	// redirected, or one that routes with table 100 itself, has the like
	// and must keep it.
	if present, err := p.cfg.Rules.Present(ns); err != nil {
		p.log.Warn("cannot tell whether a pod outside the mesh carries inpod's rules", "pod", key, "uid", pod.UID, "err", err)
		return false
	} else if !present {
		return false
	}
	changed, err := p.cfg.Rules.Remove(ns)
	if err != nil {
		p.log.Error("could not remove inpod's rules from a pod outside the mesh", "pod", key, "uid", pod.UID, "err", err)
		p.cfg.Events.Warn(pod, EventFailed, "inpod's redirection rules could not be removed from this pod, which is not in the mesh: "+err.Error())
		return false
	}
	if !changed {
		return false
	}
	p.log.Warn("removed inpod's rules from a pod outside the mesh", "pod", key, "uid", pod.UID)
	p.cfg.Events.Warn(pod, EventRemovedOutside, "inpod's redirection rules were found in this pod's network namespace, but the pod is not in the mesh: removed")
	if o := p.cfg.VerifyObserver; o != nil {
		o.Repaired(RepairOutside)
	}
	return true
}
