package enroll

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/inpod-dev/inpod/enrollment"
	"github.com/inpod-dev/inpod/netns"
	"github.com/inpod-dev/inpod/zds"
)

// Running pods: Reconcile brings one to what the policy says, Restore does
// so for an agent that starts (with the node's records of pods with rules),
// and the procfs check of an enrolled pod's sandbox.

// Reconcile brings one running pod to what the policy says: enrolled pods
// found through procfs get their rules (an intact set is left alone, so a
// restarted agent never disturbs running traffic), unenrolled or finished
// ones are removed, and an enrolled pod whose sandbox changed without a CNI
// ADD reaching inpod is re-enrolled with its new netns. A pod whose
// namespace is not known is left as it is (the error retries it). A held
// pod (see Restore) stays held until it is restored or removed; every
// reconcile of it that does not settle it returns an error, so it retries.
func (p *Pipeline) Reconcile(ctx context.Context, pod *corev1.Pod) error {
	return p.reconcile(ctx, pod, false, p.cfg.Finder)
}

// Restore is Reconcile for an agent that starts: a pod carrying the
// redirection annotation was enrolled by a previous agent, so its rules
// point at a proxy ztunnel still runs. If it is (or may be) still wanted
// but cannot be restored yet (netns not found, no IPs in its status yet,
// namespace not known), it is held: in every snapshot as Keep, so ztunnel
// keeps its proxy, and its IPs kept out of the probe prune. If it is known
// to be unwanted now (un-labelled while no agent ran), its rules come out,
// ztunnel is told and the annotation goes; while its netns cannot be found
// it is held as well, since dropping the proxy under its rules would
// black-hole a pod outside the mesh.
func (p *Pipeline) Restore(ctx context.Context, pod *corev1.Pod) error {
	return p.reconcile(ctx, pod, true, p.cfg.Finder)
}

// RestoreWith is Restore finding running pods' netns with finder: one
// procfs snapshot for a restore of every pod on the node
// (podnetns.Snapshot), not a scan per pod. A pod it cannot find is held,
// as with the Finder, and retried by the reconciler.
func (p *Pipeline) RestoreWith(ctx context.Context, pod *corev1.Pod, finder NetnsFinder) error {
	return p.reconcile(ctx, pod, true, finder)
}

// reconcile is Reconcile, or Restore when restoring. A wanted pod that is
// not in the table is enrolled in place (enrollRunning) unless nothing of it
// runs to redirect; one in the table is re-proven when unproven, else its
// sandbox is checked and its annotation converged (keepEnrolled). A pod not
// wanted, or finished, is unenrolled when in the table, released when a
// previous agent enrolled it (releaseUnwanted), and otherwise has its
// readiness gate released unless it has finished.
func (p *Pipeline) reconcile(ctx context.Context, pod *corev1.Pod, restoring bool, finder NetnsFinder) error {
	defer p.lock(pod.UID)()
	return p.reconcileLocked(ctx, pod, restoring, finder)
}

// ReconcileIfFree is Reconcile unless something holds the pod's lock (its
// CNI ADD, which may wait for ztunnel, or a reconcile): then it does
// nothing and says so. For a caller that must not wait: a container start
// the kubelet holds, which a hand-over or a stop waits for in turn.
func (p *Pipeline) ReconcileIfFree(ctx context.Context, pod *corev1.Pod) (ran bool, err error) {
	unlock, ok := p.lockIfFree(pod.UID)
	if !ok {
		return false, nil
	}
	defer unlock()
	return true, p.reconcileLocked(ctx, pod, false, p.cfg.Finder)
}

func (p *Pipeline) reconcileLocked(ctx context.Context, pod *corev1.Pod, restoring bool, finder NetnsFinder) error {
	r := &reconciliation{p: p, pod: pod, restoring: restoring, held: p.heldPod(pod.UID), finder: finder}
	// A terminating pod still runs (preStop hooks, draining) and stays in
	// the mesh until it has finished, its sandbox's DEL comes, or it is
	// gone from the API.
	r.finished = pod.Status.Phase == corev1.PodSucceeded || pod.Status.Phase == corev1.PodFailed
	want := false
	if !r.finished {
		var err error
		if want, err = p.wants(ctx, pod); err != nil {
			r.hold(podIPs(pod))
			return err
		}
	}
	e := p.entry(pod.UID)
	if want {
		switch {
		case e == nil && r.nothingRunsToRedirect():
			return nil
		case e == nil:
			return r.enrollRunning(ctx)
		case !p.isProven(e):
			// Something may have broken it (a removal that failed half-way
			// before the pod was labelled back, a failed repair): proven
			// again, or repaired, before it is trusted.
			p.verify(ctx, pod, e, p.presence(), false)
			if e := p.entry(pod.UID); e != nil && !p.isProven(e) {
				return fmt.Errorf("pod %s/%s: redirection not proven: %s", pod.Namespace, pod.Name, e.loss)
			}
			return nil
		default:
			return r.keepEnrolled(ctx, e)
		}
	}
	switch {
	case e != nil:
		if err := p.unenroll(ctx, pod.UID, e, true); err != nil {
			return err
		}
		if pod.DeletionTimestamp != nil && !r.finished {
			p.markRelabelledOut(pod)
		}
		return nil
	case !r.enrolledByPreviousAgent():
		if !r.finished {
			p.releaseGate(pod)
		}
		return nil
	case r.enrolledByPreviousAgent():
		// Not a default: enrolledBefore reads the record again; should
		// the two reads disagree, neither case runs.
		return r.releaseUnwanted(ctx)
	}
	return nil
}

// reconciliation is one reconcile of a pod, under the pod's lock.
type reconciliation struct {
	p         *Pipeline
	pod       *corev1.Pod
	restoring bool
	// held is the pod as the table held it when the reconcile began
	// (see Restore); nil: not held.
	held *heldPod
	// finished: the pod has Succeeded or Failed.
	finished bool
	// finder finds the netns of a pod not in the table.
	finder NetnsFinder
}

// enrolledByPreviousAgent says whether a previous agent may have left rules
// in the pod's netns that this agent's table does not name: the pod is
// held, or this agent is restoring and the pod is annotated or recorded
// (enrolledBefore, which may read the node's record, on each call).
func (r *reconciliation) enrolledByPreviousAgent() bool {
	return r.held != nil || r.restoring && r.p.enrolledBefore(r.pod)
}

// nothingRunsToRedirect says whether a wanted pod that is not in the table
// has nothing running to redirect.
//
// Being deleted and not in this agent's table: its sandbox's DEL
// has come (or it never ran redirected under this agent), and the
// kubelet gives a terminating pod no new sandbox. Nothing runs to
// redirect; a netns search would only fail, with a Warning event
// each time, until the pod is gone. Not at restore: the table is
// new then, and a pod the previous agent enrolled may still run
// (draining) with its rules in place, unannotated if that agent
// died before its patch. Not for a pod a label change took out
// while it drained: its sandbox still runs, labelled back it is
// redirected again.
func (r *reconciliation) nothingRunsToRedirect() bool {
	return r.pod.DeletionTimestamp != nil && r.held == nil && !r.restoring && !r.p.mayRedirectAgain(r.pod)
}

// hold keeps a pod that was in the mesh before this agent and is not
// in its table in every snapshot (as Keep) until it is settled.
func (r *reconciliation) hold(ips []netip.Addr) {
	p, pod, h := r.p, r.pod, r.held
	if !r.enrolledByPreviousAgent() || p.entry(pod.UID) != nil {
		return
	}
	if len(ips) == 0 && h != nil {
		ips = h.ips
	}
	if h == nil {
		p.log.Warn("holding a pod a previous agent enrolled until its netns is found: ztunnel keeps its proxy", "pod", pod.Namespace+"/"+pod.Name, "uid", pod.UID, "ips", ips)
	}
	p.setHeld(pod.UID, &heldPod{pod: types.NamespacedName{Namespace: pod.Namespace, Name: pod.Name}, sandboxUID: SandboxUID(pod), ips: ips,
		info: zds.Workload{UID: string(pod.UID), Name: pod.Name, Namespace: pod.Namespace, ServiceAccount: pod.Spec.ServiceAccountName}})
}

// enrollRunning enrolls a wanted pod that is not in the table with the
// netns procfs finds for it by its status IPs; one a previous agent
// enrolled is held while that fails.
func (r *reconciliation) enrollRunning(ctx context.Context) error {
	p, pod := r.p, r.pod
	ips := podIPs(pod)
	fromRecord := false
	if len(ips) == 0 && r.enrolledByPreviousAgent() {
		// Its sandbox's IPs as the agent that enrolled it recorded them;
		// Find ties them to the pod's own processes.
		ips, fromRecord = p.recordedIPs(pod.UID), true
	}
	if len(ips) == 0 {
		if r.enrolledByPreviousAgent() {
			r.hold(nil)
			return fmt.Errorf("pod %s/%s was enrolled but reports no IPs yet, so its netns cannot be found; held (ztunnel keeps its proxy)", pod.Namespace, pod.Name)
		}
		// No sandbox network yet: the CNI ADD will enroll it.
		return nil
	}
	f, err := r.finder.Find(SandboxUID(pod), ips)
	if err != nil {
		if fromRecord {
			// Held as with no IPs at all: a record can be stale (a new
			// sandbox whose start failed, a rewrite that failed), and
			// held IPs keep or drop probe exemptions. No IPs in its
			// status: its sandbox may have no process yet (the ADD
			// comes before the pause container starts); not a failure
			// to tell the pod's owner about.
			r.hold(nil)
			return fmt.Errorf("pod %s/%s was enrolled, reports no IPs yet, and no process of it holds the IPs its record names; held (ztunnel keeps its proxy): %w", pod.Namespace, pod.Name, err)
		}
		r.hold(ips)
		return p.report(pod, fail("NetnsNotFound", "find the running pod's netns: %v", err))
	}
	start := time.Now()
	if err := p.enroll(ctx, pod, sandbox{netns: f, ips: ips, unrecorded: r.restoring && !r.enrolledByPreviousAgent()}, false); err != nil {
		r.hold(ips)
		return err
	}
	p.cfg.Observer.Enrolled("reconcile", time.Since(start))
	return nil
}

// releaseUnwanted takes a pod a previous agent enrolled, and that is not
// wanted now, out of the mesh (see release); while that fails it is held.
func (r *reconciliation) releaseUnwanted(ctx context.Context) error {
	p, pod, h := r.p, r.pod, r.held
	search := podIPs(pod)
	if len(search) == 0 {
		search = p.recordedIPs(pod.UID) // see enrollRunning
	}
	ips := slices.Clone(search)
	if h != nil {
		ips = append(ips, h.ips...)
	}
	if err := p.release(ctx, pod.UID, &heldPod{pod: types.NamespacedName{Namespace: pod.Namespace, Name: pod.Name},
		sandboxUID: SandboxUID(pod), ips: ips}, search, !r.finished, r.finder); err != nil {
		r.hold(ips)
		return err
	}
	p.releaseGate(pod)
	return nil
}

// keepEnrolled checks a proven enrolled pod's sandbox when it may have
// changed, and converges its annotation.
func (r *reconciliation) keepEnrolled(ctx context.Context, e *entry) error {
	p, pod := r.p, r.pod
	if p.sandboxMayHaveChanged(pod, e) {
		if err := p.verifySandbox(ctx, pod, e); err != nil {
			return err
		}
	}
	// Converge the annotation (a crash between the reply and the
	// patch, or someone removing it, must heal), only when the pod
	// lacks it: this runs on every update of every enrolled pod and
	// every sweep, and a patch that changes nothing is still an API
	// write. A stale cache costs one redundant patch. (The writer
	// writes to the pod's UID, so the unenroll of an older pod of
	// the same name, a StatefulSet pod back under a new UID before
	// its old one's DEL, cannot remove it.)
	if pod.Annotations[enrollment.RedirectionAnnotation] != enrollment.AnnotationEnabled {
		p.cfg.Annotations.Set(types.NamespacedName{Namespace: pod.Namespace, Name: pod.Name}, pod.UID, enrollment.AnnotationEnabled)
	}
	return nil
}

func annotated(pod *corev1.Pod) bool {
	v := pod.Annotations[enrollment.RedirectionAnnotation]
	return v == enrollment.AnnotationEnabled || v == enrollment.AnnotationPending
}

// enrolledBefore says whether a previous agent may have left rules in the
// pod's netns: the pod carries the annotation, or the node's record names
// it (its annotation may not have landed before that agent died).
func (p *Pipeline) enrolledBefore(pod *corev1.Pod) bool {
	if annotated(pod) || p.cfg.Records == nil {
		return annotated(pod)
	}
	recorded, err := p.cfg.Records.Recorded(string(pod.UID))
	if err != nil {
		// Unknown is not "never enrolled": held, ztunnel keeps its proxy.
		p.log.Warn("cannot read the pod's record; taking it for enrolled before", "pod", pod.Namespace+"/"+pod.Name, "uid", pod.UID, "err", err)
		return true
	}
	return recorded
}

func (p *Pipeline) record(uid types.UID, ips []netip.Addr) error {
	if p.cfg.Records == nil {
		return nil
	}
	return p.cfg.Records.Record(string(uid), ips)
}

// recordedIPs are the IPs of the sandbox the node's record names for uid:
// a pod a previous agent enrolled is found by them while its status shows
// none yet (the kubelet writes them seconds after the sandbox, on a busy
// node). None when unknown.
func (p *Pipeline) recordedIPs(uid types.UID) []netip.Addr {
	if p.cfg.Records == nil {
		return nil
	}
	ips, err := p.cfg.Records.IPs(string(uid))
	if err != nil {
		p.log.Warn("cannot read the pod's recorded IPs", "uid", uid, "err", err)
		return nil
	}
	return ips
}

func (p *Pipeline) forget(uid types.UID) error {
	if p.cfg.Records == nil {
		return nil
	}
	return p.cfg.Records.Forget(string(uid))
}

// PruneRecords drops the records of pods that are neither enrolled nor
// held, and not in the agent's cache (live): their pods are gone, and so
// are their sandboxes. Run it after restoring, when every pod a record
// names that is still in the API has been restored, held or released.
func (p *Pipeline) PruneRecords(live func(uid types.UID) bool) error {
	if p.cfg.Records == nil {
		return nil
	}
	uids, err := p.cfg.Records.List()
	if err != nil {
		return err
	}
	var errs []error
	for _, s := range uids {
		uid := types.UID(s)
		if live(uid) {
			continue
		}
		unlock := p.lock(uid)
		if p.entry(uid) == nil && p.heldPod(uid) == nil {
			if err := p.cfg.Records.Forget(s); err != nil {
				errs = append(errs, err)
			}
		}
		unlock()
	}
	return errors.Join(errs...)
}

// DefaultSandboxCheckEvery paces the check of a pod's sandbox when nothing
// in its status says it changed: each check is one procfs scan (about 6 ms
// with 100 processes, growing with the node's process count).
const DefaultSandboxCheckEvery = 5 * time.Minute

// sandboxMayHaveChanged says whether a reconcile should look for the pod's
// sandbox through procfs. Looking on every pod update cost a scan per
// status or annotation change, which made a burst of pod starts ~1.5×
// slower; the kubelet's status says when to look: other IPs, or its
// PodReadyToStartContainers condition turning True again (a new sandbox)
// after the last check. The periodic sweep covers a status that did not
// change.
func (p *Pipeline) sandboxMayHaveChanged(pod *corev1.Pod, e *entry) bool {
	if ips := podIPs(pod); len(ips) > 0 && !slices.Equal(ips, e.ips) {
		return true
	}
	p.mu.Lock()
	checkedAt := e.checkedAt
	p.mu.Unlock()
	// The API keeps whole seconds: a sandbox recreated in the second of
	// the last check has a transition time before it. For such a
	// transition the held netns is asked whether it still holds the pod's
	// IPs (a netlink read, not a procfs scan: a torn-down sandbox's DEL
	// took its interface); most pods' first status update lands in the
	// second they were enrolled in.
	for _, c := range pod.Status.Conditions {
		if c.Type != corev1.PodReadyToStartContainers {
			continue
		}
		if t := c.LastTransitionTime.Time; t.After(checkedAt) ||
			!t.Before(checkedAt.Truncate(time.Second)) && !p.cfg.Finder.Holds(e.netns, podIPs(pod)) {
			return true
		}
	}
	every := p.cfg.SandboxCheckEvery
	if every <= 0 {
		every = DefaultSandboxCheckEvery
	}
	return time.Since(checkedAt) >= every
}

// checked records that the pod's sandbox was found to be the enrolled one.
func (p *Pipeline) checked(e *entry) {
	p.mu.Lock()
	e.checkedAt = time.Now()
	p.mu.Unlock()
}

// verifySandbox looks for the enrolled pod's sandbox through procfs (a
// process in the pod's cgroup whose netns holds the IPs its status reports)
// and re-enrolls it when that is not the netns held: the sandbox was
// recreated while inpod was missing from the CNI chain, so it runs
// unredirected and ztunnel holds a dead netns. The pod's lock is held.
func (p *Pipeline) verifySandbox(ctx context.Context, pod *corev1.Pod, e *entry) error {
	ips := podIPs(pod)
	if len(ips) == 0 {
		return nil
	}
	f, err := p.cfg.Finder.Find(SandboxUID(pod), ips)
	if err != nil {
		if slices.Equal(ips, e.ips) {
			// Nothing says the sandbox changed: the pod may be stopping,
			// and the held netns is still the one enrolled.
			p.checked(e)
			return nil
		}
		return p.report(pod, fail("NetnsNotFound", "the pod reports IPs %v, its enrolled sandbox holds %v, and no netns of the pod holds them: %v", ips, e.ips, err))
	}
	id, err := netns.IdentityOf(int(f.Fd()))
	if err != nil || id == e.id {
		f.Close()
		if err == nil {
			p.checked(e)
		}
		return nil
	}
	key := types.NamespacedName{Namespace: pod.Namespace, Name: pod.Name}
	p.log.Warn("enrolled pod runs in a sandbox inpod did not enroll; re-enrolling it", "pod", key, "held", e.id, "found", id)
	p.cfg.Events.Warn(pod, "SandboxChanged", fmt.Sprintf("the pod's sandbox changed (netns %s → %s) without its CNI ADD reaching inpod; redirecting the new sandbox", e.id, id))
	start := time.Now()
	if err := p.enroll(ctx, pod, sandbox{netns: f, ips: ips}, false); err != nil {
		return err
	}
	p.cfg.Observer.Enrolled("sandbox-check", time.Since(start))
	return nil
}

// release takes a pod that is not in the table out of the mesh: its rules
// out of the netns procfs finds for it by ips, ztunnel told, its probe
// exemptions and annotation dropped. With running, a netns that cannot be
// found is an error (the rules may still be there, and ztunnel's proxy
// must stay under them); without, the sandbox is taken to be gone with its
// rules. The pod's lock is held.
func (p *Pipeline) release(ctx context.Context, uid types.UID, h *heldPod, ips []netip.Addr, running bool, finder NetnsFinder) error {
	if len(ips) > 0 {
		f, err := finder.Find(h.sandboxUID, ips)
		switch {
		case err == nil:
			_, err = p.cfg.Rules.Remove(f)
			f.Close()
			if err != nil {
				return fmt.Errorf("remove the rules of pod %s: %w", h.pod, err)
			}
		case running:
			return fmt.Errorf("pod %s left the mesh while no agent ran, and no netns of it holds %v, so its rules cannot be removed yet: %w", h.pod, ips, err)
		}
	} else if running {
		return fmt.Errorf("pod %s left the mesh while no agent ran and reports no IPs yet, so its rules cannot be found", h.pod)
	}
	// Out of the snapshots before the Del goes out, as in unenroll.
	old := p.heldPod(uid)
	p.setHeld(uid, nil)
	var errs []error
	if err := p.cfg.Ztunnel.Del(ctx, string(uid)); err != nil {
		errs = append(errs, fmt.Errorf("tell ztunnel: %w", err))
	}
	// Another pod may hold one of them by now (a record's IPs can be
	// stale).
	owned := p.ipsOfOthers(uid)
	for _, ip := range h.ips {
		if slices.Contains(owned, ip) {
			continue
		}
		if err := p.cfg.Probes.Remove(ip); err != nil {
			errs = append(errs, err)
		}
	}
	if err := errors.Join(errs...); err != nil {
		p.setHeld(uid, old)
		return err
	}
	if err := p.forget(uid); err != nil {
		p.log.Warn("could not drop the pod's record; the next agent takes it for enrolled before", "pod", h.pod, "err", err)
	}
	p.cfg.Annotations.Set(h.pod, uid, "")
	p.cfg.Observer.Removed()
	p.log.Info("pod a previous agent enrolled removed from the mesh", "pod", h.pod, "uid", uid)
	return nil
}

func podIPs(pod *corev1.Pod) []netip.Addr {
	var out []netip.Addr
	for _, ip := range pod.Status.PodIPs {
		if a, err := netip.ParseAddr(ip.IP); err == nil {
			out = append(out, a.Unmap())
		}
	}
	if len(out) == 0 && pod.Status.PodIP != "" {
		if a, err := netip.ParseAddr(pod.Status.PodIP); err == nil {
			out = append(out, a.Unmap())
		}
	}
	return out
}
