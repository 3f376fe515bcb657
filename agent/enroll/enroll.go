package enroll

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"slices"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/inpod-dev/inpod/enrollment"
	"github.com/inpod-dev/inpod/netns"
	"github.com/inpod-dev/inpod/zds"
)

// Enrolling a sandbox (record, rules, probe exemptions, table, ztunnel,
// annotation), undoing it when a new sandbox's start fails, and taking a
// pod out of the mesh again.

// sandbox is one pod sandbox as enroll takes it.
type sandbox struct {
	netns *os.File
	ips   []netip.Addr
	// containerID is the runtime's sandbox id from the CNI request; ""
	// when the sandbox was found through procfs, which does not tell it.
	containerID string
	// unrecorded: found by an agent at its start, for a pod no agent
	// recorded or annotated. If its rules are missing too, it ran
	// without redirection until now (see ranUnredirected).
	unrecorded bool
}

// enroll takes ownership of sb.netns: it is kept on success, closed on
// error. The caller holds the pod's lock.
//
// The pod is in the table, and so in every snapshot a ztunnel that connects
// meanwhile receives, before its Add goes out (ZDS.Add picks the newest
// connection, which may not be the one that got the snapshot).
//
// For a new sandbox (fromCNI) every failure fails the pod's start and is
// rolled back: rules this call installed, and the table entry. For a running
// pod (reconcile, restart) its rules are never removed on a ztunnel problem:
// the pod stays in the table and reaches ztunnel through the next snapshot.
func (p *Pipeline) enroll(ctx context.Context, pod *corev1.Pod, sb sandbox, fromCNI bool) error {
	key := types.NamespacedName{Namespace: pod.Namespace, Name: pod.Name}
	id, err := netns.IdentityOf(int(sb.netns.Fd()))
	if err != nil {
		sb.netns.Close()
		return p.report(pod, fail("NetnsUnavailable", "%v", err))
	}
	old := p.entry(pod.UID)
	sameSandbox := old != nil && old.id == id
	if sb.containerID == "" && sameSandbox {
		sb.containerID = old.containerID
	}
	// Every failure below goes through rb.abort, which undoes what this call
	// did to a new sandbox and reports why.
	rb := &rollback{p: p, ctx: ctx, pod: pod, key: key, netns: sb.netns, old: old, fromCNI: fromCNI, sameSandbox: sameSandbox}

	switch {
	case old == nil:
		if err := p.record(pod.UID, sb.ips); err != nil {
			return rb.abort(fail("RecordFailed", "record the pod as enrolled on the node before its rules: %v", err))
		}
		rb.recorded = true
		p.cfg.Annotations.Set(key, pod.UID, enrollment.AnnotationPending)
	case !sameSandbox:
		// The pod's record stays (its old sandbox's rules may too); its
		// IPs are the new sandbox's. Written or not, the next agent finds
		// the pod, sooner with them.
		if err := p.record(pod.UID, sb.ips); err != nil {
			p.log.Warn("could not record the pod's new sandbox IPs", "pod", key, "err", err)
		}
	}
	rb.applied = true
	// A running pod (reconcile, restart) keeps what this call applied when
	// a later step fails: it is enrolled unproven, so a removal finds its
	// rules and the verifier retries. Rolled back like a new sandbox's, it
	// would keep rules that no entry names, and a pod that then left the
	// mesh would be black-holed.
	loss, lossDetail := "", ""
	var variant Variant
	if p.cfg.VariantOf != nil {
		variant = p.cfg.VariantOf(pod)
	}
	changed, err := p.cfg.Rules.Apply(sb.netns, variant)
	rb.rulesWritten = changed
	if changed && sb.unrecorded {
		p.ranUnredirected(pod)
	}
	if err != nil {
		f := fail("RedirectionFailed", "apply redirection rules: %v", err)
		if fromCNI {
			return rb.abort(f)
		}
		loss, lossDetail = "RulesNotRepaired", p.report(pod, f).Error()
	}
	p.probeMu.RLock()
	for _, ip := range sb.ips {
		if err := p.cfg.Probes.Add(ip); err != nil {
			f := fail("ProbeExemptionFailed", "exempt kubelet probes to %s: %v", ip, err)
			if fromCNI {
				p.probeMu.RUnlock()
				return rb.abort(f)
			}
			if loss == "" {
				loss, lossDetail = "ProbeExemptionFailed", p.report(pod, f).Error()
			}
			continue
		}
		rb.exempted = append(rb.exempted, ip)
	}
	info := zds.Workload{UID: string(pod.UID), Name: pod.Name, Namespace: pod.Namespace, ServiceAccount: pod.Spec.ServiceAccountName, NetNS: sb.netns}
	ne := &entry{pod: key, variant: variant, netns: sb.netns, id: id, containerID: sb.containerID, sandboxUID: SandboxUID(pod), ips: sb.ips, info: info,
		checkedAt: time.Now(), gated: enrollment.HasRedirectedGate(pod)}
	if old != nil && sameSandbox {
		// The pod's condition as this agent last set it.
		ne.proven, ne.loss, ne.conditionKnown = old.proven, old.loss, old.conditionKnown
	}
	p.setEntry(pod.UID, ne)
	p.probeMu.RUnlock()
	rb.published = true
	ztunnelLoss, ztunnelDetail := "", ""
	if loss == "RulesNotRepaired" {
		// Rules that may not be in place: ztunnel gets the pod from the
		// verifier once they are.
	} else if err := p.cfg.Ztunnel.Add(ctx, info); err != nil {
		reason := ztunnelReason(err)
		if fromCNI {
			// Rules without ztunnel's listeners would black-hole the
			// pod's traffic; the pod does not start anyway.
			return rb.abort(fail(reason, "hand the pod to ztunnel: %v", err))
		}
		// Not an error for the caller: the pod is in the table, so in
		// every snapshot. With no ztunnel connected (an agent that starts
		// restores its pods before ztunnel is served) that is all there
		// is to do; the verifier judges ztunnel's absence on its own.
		if !errors.Is(err, zds.ErrNoConnection) {
			ztunnelLoss, ztunnelDetail = reason, p.report(pod, fail(reason, "hand the running pod to ztunnel (it stays enrolled and is in every snapshot): %v", err)).Error()
		}
	}
	if old != nil && old.netns != sb.netns {
		old.netns.Close()
		if !sameSandbox {
			p.log.Info("pod sandbox was recreated; re-enrolled with the new netns", "pod", key, "old", old.id, "new", id)
			// What else changed with it (the old sandbox's DEL, its
			// exemptions) is for a verification to find.
			p.verifySoon()
		}
		p.dropExemptions(pod.UID, key, old.ips, sb.ips)
	}
	if h := p.heldPod(pod.UID); h != nil {
		// The previous agent exempted the IPs of the sandbox it
		// enrolled; those this one does not have may go to a pod
		// outside the mesh next.
		p.dropExemptions(pod.UID, key, h.ips, sb.ips)
	}
	// Enrolled with a netns now: its Add has replaced the Keep.
	p.setHeld(pod.UID, nil)
	p.forgetEnded(pod)
	if loss != "" {
		p.settle(pod, ne, loss, lossDetail)
	} else {
		p.settle(pod, ne, ztunnelLoss, ztunnelDetail)
	}
	// The condition is asked for first: see AnnotationWriter.WriteAfter.
	p.cfg.Annotations.Set(key, pod.UID, enrollment.AnnotationEnabled)
	if loss != "" {
		p.verifySoon()
		return fmt.Errorf("pod %s enrolled, but its redirection is not proven: %s", key, lossDetail)
	}
	if ztunnelLoss != "" {
		p.verifySoon()
	}
	p.log.Info("pod enrolled", "pod", key, "uid", pod.UID, "netns", id, "containerID", sb.containerID, "ips", sb.ips)
	return nil
}

// rollback undoes what one enroll did before a step failed. enroll notes
// each step in it as the step is taken; abort takes back, from those notes,
// what the failure leaves wrong. For a new sandbox (a CNI ADD whose netns is
// not the enrolled one) that is everything the call did; for a CNI ADD of
// the sandbox already enrolled, the probe exemptions the old entry did not
// have, and the old entry comes back. A running pod (reconcile, restart)
// aborts only when it cannot be recorded, before any other step; a later
// failure leaves it enrolled unproven (see enroll).
type rollback struct {
	p     *Pipeline
	ctx   context.Context
	pod   *corev1.Pod
	key   types.NamespacedName
	netns *os.File // the sandbox's: abort closes it
	// old is the pod's entry before this call (nil: none), sameSandbox
	// whether it holds this call's netns.
	old                  *entry
	fromCNI, sameSandbox bool

	// The steps taken so far.
	recorded     bool         // the pod recorded on the node by this call
	applied      bool         // its rules applied (or tried: a failed Apply may leave some)
	rulesWritten bool         // the rules Apply changed in the netns
	exempted     []netip.Addr // probe exemptions this call added
	published    bool         // this call's entry in the table
}

// abort undoes the steps taken, closes the sandbox's netns and reports f.
func (r *rollback) abort(f error) error {
	if r.fromCNI && !r.sameSandbox {
		r.undoNewSandbox()
	}
	// An exemption left behind would SNAT the node's probes to the
	// next pod given this IP, which may be outside the mesh.
	for _, ip := range r.exempted {
		if r.old != nil && slices.Contains(r.old.ips, ip) {
			continue
		}
		if err := r.p.cfg.Probes.Remove(ip); err != nil {
			r.p.log.Error("could not drop the probe exemption of a sandbox whose start failed; pruned at the next restart", "pod", r.key, "ip", ip, "err", err)
		}
	}
	if r.fromCNI && r.sameSandbox && r.published {
		r.p.setEntry(r.pod.UID, r.old)
	}
	r.netns.Close()
	return r.p.report(r.pod, f)
}

// undoNewSandbox takes a new sandbox whose start failed out of the table
// (and ztunnel) again, the rules this call wrote out of its netns, and the
// pod's record off the node.
func (r *rollback) undoNewSandbox() {
	if r.published {
		r.p.unpublish(r.ctx, r.pod.UID, r.old)
	}
	// The record goes only once no rules can be in the netns: none
	// applied, or this call's taken out again. Rules that were
	// there already (an intact set is not rewritten) stay, and so
	// does the record.
	rulesOut := !r.applied
	if r.rulesWritten {
		if _, err := r.p.cfg.Rules.Remove(r.netns); err != nil {
			r.p.log.Error("could not take the rules out of a sandbox whose start failed", "pod", r.key, "err", err)
		} else {
			rulesOut = true
		}
	}
	// A pod held from the previous agent keeps its record: the
	// sandbox whose rules it stands for is not this one.
	if r.recorded && rulesOut && r.p.heldPod(r.pod.UID) == nil {
		if err := r.p.forget(r.pod.UID); err != nil {
			r.p.log.Warn("could not drop the record of a sandbox whose start failed; the next agent takes the pod for enrolled before", "pod", r.key, "err", err)
		}
	}
}

// ranUnredirected tells the user that an enrolled pod ran without
// redirection while no agent could act: its sandbox started with inpod-cni
// out of the chain the runtime used (chained mode, the primary CNI
// rewriting its file while the agent was away) and no gate held it, or it
// joined the mesh while no agent ran. Said before it is redirected in
// place, with how long it ran so.
func (p *Pipeline) ranUnredirected(pod *corev1.Pod) {
	p.cfg.Observer.RanUnredirected()
	since, how := SandboxStarted(pod)
	msg := "no agent recorded this pod, and its sandbox had no redirection rules: it ran outside the mesh"
	if !since.IsZero() {
		msg += fmt.Sprintf(" for %s (%s %s)", time.Since(since).Round(time.Second), how, since.UTC().Format(time.RFC3339))
	}
	msg += ", its sandbox set up while inpod-cni was not in the runtime's chain, or the pod joined the mesh while no inpod agent ran; redirecting it in place now"
	p.cfg.Events.Warn(pod, "RanUnredirected", msg)
	p.log.Warn("an enrolled pod ran without redirection while no agent ran", "pod", pod.Namespace+"/"+pod.Name, "uid", pod.UID, "since", since)
}

// SandboxStarted is when the pod's current sandbox started, as the
// kubelet reports it, and what that time is.
func SandboxStarted(pod *corev1.Pod) (time.Time, string) {
	for _, c := range pod.Status.Conditions {
		if c.Type == corev1.PodReadyToStartContainers && c.Status == corev1.ConditionTrue && !c.LastTransitionTime.IsZero() {
			return c.LastTransitionTime.Time, "since its sandbox became ready at"
		}
	}
	if pod.Status.StartTime != nil {
		return pod.Status.StartTime.Time, "since the pod started at"
	}
	return time.Time{}, ""
}

// dropExemptions ends the probe exemptions of a sandbox's IPs that the
// pod's current sandbox (keep) does not have: left behind they would SNAT
// the node's probes of the next pod given the IP, which may be outside the
// mesh (a default-deny NetworkPolicy then fails its probes).
func (p *Pipeline) dropExemptions(uid types.UID, pod types.NamespacedName, ips, keep []netip.Addr) {
	owned := p.ipsOfOthers(uid)
	for _, ip := range ips {
		// Another enrolled pod may have the IP by now.
		if slices.Contains(keep, ip) || slices.Contains(owned, ip) {
			continue
		}
		if err := p.cfg.Probes.Remove(ip); err != nil {
			p.log.Warn("could not drop an old sandbox's probe exemption; the verifier retries", "pod", pod, "ip", ip, "err", err)
		}
	}
}

// unpublish takes a new sandbox whose start failed out of the table again:
// the previous entry comes back, or the pod leaves the table and every
// ztunnel is told, since a snapshot sent meanwhile named it.
func (p *Pipeline) unpublish(ctx context.Context, uid types.UID, old *entry) {
	p.setEntry(uid, old)
	if old != nil {
		return
	}
	// The ADD's context may be what ran out; the withdrawal still goes.
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	if err := p.cfg.Ztunnel.Del(ctx, string(uid)); err != nil {
		p.log.Warn("could not withdraw a pod whose start failed from ztunnel; its next snapshot drops it", "uid", uid, "err", err)
	}
}

// Unenroll removes a pod from the mesh: rules out of its netns (still open
// through our fd), ztunnel told on every connection, probe exemption and
// annotation dropped.
func (p *Pipeline) Unenroll(ctx context.Context, uid types.UID) error {
	defer p.lock(uid)()
	e := p.entry(uid)
	if e == nil {
		if h := p.heldPod(uid); h != nil {
			// Gone from the API (or inpod is being removed): its netns,
			// if it still exists, is found by its status IPs.
			return p.release(ctx, uid, h, h.ips, false, p.cfg.Finder)
		}
		return nil
	}
	return p.unenroll(ctx, uid, e, false)
}

// unenroll is Unenroll with the pod's lock held. runsOn: the pod keeps
// running outside the mesh (a label took it out), so its readiness gate is
// set NotEnrolled; not after its sandbox's DEL, nor for a pod gone from the
// API (or a removal, which releases every gate after): a write there
// would be one more API write per pod deletion for a pod that is going,
// and a recreated sandbox is enrolled again or released by the reconcile.
func (p *Pipeline) unenroll(ctx context.Context, uid types.UID, e *entry, runsOn bool) error {
	// Out of the table before the Del goes out, the mirror of an Add: a
	// ztunnel that connects in between must not get the pod in its snapshot
	// and then miss the Del, keeping a proxy for a pod that left the mesh.
	// On failure the pod goes back, so a retry and every later snapshot
	// still see it.
	p.setEntry(uid, nil)
	var errs []error
	if _, err := p.cfg.Rules.Remove(e.netns); err != nil {
		errs = append(errs, fmt.Errorf("remove rules: %w", err))
	}
	if err := p.cfg.Ztunnel.Del(ctx, string(uid)); err != nil {
		errs = append(errs, fmt.Errorf("tell ztunnel: %w", err))
	}
	for _, ip := range e.ips {
		if err := p.cfg.Probes.Remove(ip); err != nil {
			errs = append(errs, err)
		}
	}
	if err := errors.Join(errs...); err != nil {
		// Back in the table, but no longer proven: its rules may be gone
		// while ztunnel still holds it, or ztunnel may have dropped it
		// with its rules still there. If the pod is labelled back
		// before the retry, the reconcile re-proves it instead of
		// trusting the entry.
		p.mu.Lock()
		e.proven, e.loss = false, lossRemovalIncomplete
		p.mu.Unlock()
		p.setEntry(uid, e)
		p.verifySoon()
		return err
	}
	e.netns.Close()
	if runsOn && e.gated && p.cfg.Conditions != nil {
		// Out of the mesh, the pod has nothing left to prove; the gate
		// must not keep it from serving.
		p.cfg.Conditions.Set(e.pod, uid, true, enrollment.ReasonNotEnrolled, MessageNotEnrolled)
	}
	if err := p.forget(uid); err != nil {
		p.log.Warn("could not drop the pod's record; the next agent takes it for enrolled before", "pod", e.pod, "err", err)
	}
	p.cfg.Annotations.Set(e.pod, uid, "")
	p.cfg.Observer.Removed()
	p.log.Info("pod removed from the mesh", "pod", e.pod, "uid", uid)
	return nil
}

// UnenrollAll takes every enrolled pod out of the mesh (inpod is being
// removed from the node), going on past failures.
func (p *Pipeline) UnenrollAll(ctx context.Context) error {
	p.mu.Lock()
	uids := make([]types.UID, 0, len(p.enrolled)+len(p.held))
	for uid := range p.enrolled {
		uids = append(uids, uid)
	}
	for uid := range p.held {
		uids = append(uids, uid)
	}
	p.mu.Unlock()
	var errs []error
	for _, uid := range uids {
		if err := p.Unenroll(ctx, uid); err != nil {
			errs = append(errs, fmt.Errorf("pod %s: %w", uid, err))
		}
	}
	return errors.Join(errs...)
}
