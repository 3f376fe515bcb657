package enroll

import (
	"context"
	"fmt"
	"time"

	"github.com/inpod-dev/inpod/netns"
)

// MayStart says whether a container of the pod may start now (nil) or must
// wait (why not). The device plugin asks before every container start of a
// pod that requested the gate's resource (the kubelet's PreStartContainer).
//
// The scheduling gate only keeps such a pod off a node that is not ready.
// Admitted while the node was ready, its sandbox can still be set up
// without inpod: another CNI rewrote the conflist without inpod-cni, and the
// runtime read it before the agent repaired it. Nothing then fails the
// sandbox; without this check its app would start outside the mesh until
// the agent found and redirected it in place.
//
// A pod the policy does not enroll may always start: holding it is not
// inpod's business. An enrolled one may start only when it is in the table
// with the sandbox it runs in now: the netns of the pod's own processes
// (its pause container, before any app runs) that holds the IPs enrolled
// (a procfs scan, as in reconcile), or, with no such process, the netns
// enrolled still holding them. A sandbox set up again without inpod is
// another netns, or has taken the IPs away from the old one. The agent
// reconciles the pod meanwhile; the kubelet asks again at its next sync.
func (p *Pipeline) MayStart(ctx context.Context, namespace, name string) error {
	pod, err := p.cfg.Pods.Pod(ctx, namespace, name)
	if err != nil {
		return fmt.Errorf("pod %s/%s is not known yet, so whether it runs redirected cannot be told: %w", namespace, name, err)
	}
	want, err := p.wants(ctx, pod)
	if err != nil {
		return err
	}
	if !want {
		return nil
	}
	e := p.entry(pod.UID)
	if e == nil && p.heldPod(pod.UID) != nil {
		return fmt.Errorf("pod %s/%s was enrolled by the agent before this one, which has not found its netns yet; holding its containers until it does", namespace, name)
	}
	if e == nil {
		return fmt.Errorf("pod %s/%s is enrolled but not redirected yet (its sandbox was set up without its CNI ADD reaching inpod); holding its containers until the agent redirects it", namespace, name)
	}
	if len(e.ips) == 0 {
		// A CNI result with no IPs: nothing to tell the sandbox by; it
		// was enrolled through its ADD.
		return nil
	}
	f, err := p.cfg.Finder.Find(SandboxUID(pod), e.ips)
	if err != nil {
		// No process of the pod in a netns holding those IPs. Before its
		// first container, that is the normal case on a runtime without
		// an infra process (CRI-O's drop_infra_ctr): the netns enrolled
		// still holding them is the sandbox. One set up again has them
		// no more (the primary CNI's DEL took them out of the old one).
		if p.cfg.Finder.Holds(e.netns, e.ips) {
			return nil
		}
		p.recheck(e)
		return fmt.Errorf("pod %s/%s: the netns it was redirected in no longer holds its IPs %v, and no process of it runs in one that does: its sandbox was set up again without inpod; holding its containers until the agent redirects the new one", namespace, name, e.ips)
	}
	defer f.Close()
	id, err := netns.IdentityOf(int(f.Fd()))
	if err != nil {
		return err
	}
	if id != e.id {
		p.recheck(e)
		return fmt.Errorf("pod %s/%s runs in netns %s, inpod redirected %s: its sandbox was set up again without inpod; holding its containers until the agent redirects the new one", namespace, name, id, e.id)
	}
	return nil
}

// recheck makes the pod's next reconcile look for its sandbox: the status
// of a sandbox set up again with the same IPs may say nothing new.
func (p *Pipeline) recheck(e *entry) {
	p.mu.Lock()
	e.checkedAt = time.Time{}
	p.mu.Unlock()
}
