package enroll

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/inpod-dev/inpod/enrollment"
	"github.com/inpod-dev/inpod/zds"
)

// The verifier: a pod's redirection is proven when its sandbox starts (rules
// applied, ztunnel's Ack), and then re-proven, because anything may take it
// away later while the pod's annotation still says "enabled": a process in
// the pod (or an operator) flushing its netfilter tables, a ztunnel whose
// proxy for the pod died, a partly failed removal followed by a relabel, a
// probe exemption left behind for an IP a pod outside the mesh now has.
// Each verification of an enrolled pod proves, in this order:
//
//   - its sandbox is the one enrolled: the held netns still holds the IPs
//     the pod's status reports, else procfs is asked which netns is the
//     pod's now (and a new one is redirected);
//   - its netns holds exactly inpod's rule set, read from the kernel and
//     compared with what the engine writes (Rules.Apply: an intact set is
//     left alone, anything else is replaced in one transaction);
//   - the ztunnel that Adds go to has acknowledged the pod on its current
//     connection (else it is Added again), and ztunnel's listeners are bound
//     in the netns (else ztunnel is asked to start the pod's proxy anew:
//     a Del, then an Add).
//
// Once per round, the node's probe exemptions are made exactly the enrolled
// pods' current IPs. What it cannot repair at once it reports: a Warning
// Event and, on pods that carry the readiness gate, the condition
// inpod.dev/redirected turned False, so a Service sends them nothing until a
// verification finds everything intact again. A repair also turns the
// condition False until the next verification (scheduled at once) finds
// the repair holding: the pod ran unredirected for a while, and what broke
// it may break it again.

// Reasons of the pod condition and the verifier's Events.
const (
	// lossRemovalIncomplete: a removal that failed half-way put the
	// entry back.
	lossRemovalIncomplete = "RemovalIncomplete"
	// EventRepaired is the Event of a loss found and repaired.
	EventRepaired = "RedirectionRepaired"
	// EventFailed is the Event of a loss the verifier cannot repair.
	EventFailed = "RedirectionFailed"
)

// The verifier's collaborators, as it uses them; each may be nil (that
// check or report is then skipped).
type (
	// Listeners reports which of ztunnel's in-pod listeners a netns lacks
	// (redirect.Listening with the ports ztunnel binds for a pod of that
	// variant).
	Listeners interface {
		Missing(ns *os.File, v Variant) ([]uint16, error)
	}
	// ZtunnelAcks says whether the ztunnel connection Adds go to has
	// acknowledged the pod (zds.Server.Acked).
	ZtunnelAcks interface {
		Acked(uid string) bool
		// Settled: the newest connection has acknowledged its snapshot
		// (before that, a pod it has not acknowledged may just not have
		// come up yet).
		Settled() bool
	}
	// Conditions converge a pod's enrollment.RedirectedCondition, off the critical
	// path (podcondition.Writer). A Set of what the pod carries already
	// must cost no API write: the pipeline asks again freely.
	Conditions interface {
		Set(pod types.NamespacedName, uid types.UID, proven bool, reason, message string)
	}
	// VerifyObserver counts the verifier's work for metrics.
	VerifyObserver interface {
		Verified(took time.Duration)
		Repaired(kind string)
		Unproven(n int)
	}
)

// The messages of the condition's True reasons: the same text each time,
// so an agent restart finds them already there and writes nothing.
const (
	MessageRedirected  = "redirection rules in place and ztunnel holds the pod"
	MessageNotEnrolled = "the pod is not in the mesh"
)

// Repair kinds, for metrics and Events.
const (
	RepairSandbox   = "sandbox"
	RepairRules     = "rules"
	RepairZtunnel   = "ztunnel"
	RepairListeners = "listeners"
	RepairProbes    = "probe-exemption"
)

// ZtunnelPresence is what a verification may conclude from ztunnel's state.
type ZtunnelPresence int

const (
	// ZtunnelReady: a ztunnel has acknowledged its snapshot; each pod's
	// Ack and listeners are checked.
	ZtunnelReady ZtunnelPresence = iota
	// ZtunnelReconnecting: no ztunnel is ready, for less than the grace the
	// agent gives a restarting ztunnel; the ztunnel checks are skipped
	// (an agent or ztunnel restart must not flip every pod's condition).
	ZtunnelReconnecting
	// ZtunnelAway: none for longer; every pod is unproven.
	ZtunnelAway
)

// Verification is what one round found.
type Verification struct {
	Pods     int
	Repaired map[string]int
	// Unproven are the pods left with a loss the round could not repair.
	Unproven []types.NamespacedName
}

// VerifyAll re-proves every enrolled pod; pod returns the pod the agent's
// cache holds under a name (nil if none). A pod whose cached object is
// another incarnation is left to the reconciler. It then makes the probe
// exemptions exactly the enrolled pods' IPs.
func (p *Pipeline) VerifyAll(ctx context.Context, pod func(types.NamespacedName) *corev1.Pod) Verification {
	start := time.Now()
	zt := p.presence()
	p.mu.Lock()
	uids := make([]types.UID, 0, len(p.enrolled))
	for uid := range p.enrolled {
		uids = append(uids, uid)
	}
	p.mu.Unlock()
	v := Verification{Repaired: map[string]int{}}
	for _, uid := range uids {
		if ctx.Err() != nil {
			break
		}
		unlock := p.lock(uid)
		e := p.entry(uid)
		var cached *corev1.Pod
		if e != nil {
			cached = pod(e.pod)
		}
		// A pod whose removal failed half-way is the reconciler's to
		// retry (or, labelled back, to re-prove): repaired here it would
		// be put back into the mesh it is leaving.
		if cached != nil && cached.UID == uid && e.loss != lossRemovalIncomplete {
			v.Pods++
			repairs := p.verify(ctx, cached, e, zt, true)
			for _, r := range repairs {
				v.Repaired[r]++
			}
			if e := p.entry(uid); e != nil && !e.proven {
				v.Unproven = append(v.Unproven, e.pod)
			}
		}
		unlock()
	}
	if n := p.syncProbes(); n > 0 {
		v.Repaired[RepairProbes] += n
	}
	if o := p.cfg.VerifyObserver; o != nil {
		o.Verified(time.Since(start))
		o.Unproven(p.unprovenCount())
	}
	return v
}

// verify proves one enrolled pod, repairing what it can, and settles its
// proof. The pod's lock is held. disruptive allows the one repair that
// interrupts the pod's connections (ztunnel told to restart its proxy for
// the pod); the reconciler, which runs on every update of the pod and
// every retry, never does it. It returns the kinds repaired.
func (p *Pipeline) verify(ctx context.Context, pod *corev1.Pod, e *entry, zt ZtunnelPresence, disruptive bool) []string {
	var repairs []string
	// keep: nothing can be concluded about ztunnel now (it is
	// reconnecting, the newest one has not acknowledged its snapshot
	// yet, or its connection ended during the round); the pod's proof
	// stays as it was unless its sandbox or rules were lost.
	keep := false
	loss, detail := func() (string, string) {
		// The sandbox.
		if ips := podIPs(pod); p.sandboxMayHaveChanged(pod, e) || len(ips) > 0 && !p.cfg.Finder.Holds(e.netns, ips) {
			if err := p.verifySandbox(ctx, pod, e); err != nil {
				return "SandboxNotRedirected", err.Error()
			}
			if now := p.entry(pod.UID); now != e {
				if now == nil {
					return "", ""
				}
				repairs = append(repairs, RepairSandbox)
				e = now
			}
		}
		// The rules.
		changed, err := p.checkRules(e)
		if err != nil {
			return "RulesNotRepaired", fmt.Sprintf("the pod's redirection rules could not be verified or re-applied: %v", err)
		}
		if changed {
			repairs = append(repairs, RepairRules)
		}
		// ztunnel.
		switch zt {
		case ZtunnelReconnecting:
			keep = true
			return "", ""
		case ZtunnelAway:
			return "ZtunnelNotConnected", "no ztunnel is connected to proxy the pod's traffic"
		}
		if p.cfg.Acks != nil && !p.cfg.Acks.Acked(string(pod.UID)) {
			if !p.cfg.Acks.Settled() {
				keep = true
				return "", ""
			}
			if err := p.cfg.Ztunnel.Add(ctx, e.info); err != nil {
				if errors.Is(err, zds.ErrConnectionClosed) || errors.Is(err, zds.ErrNoConnection) {
					// The connection ended during this round (a
					// hand-over's pause, a ztunnel restart): the
					// ztunnel that connects next gets the pod in its
					// snapshot. The next round judges.
					keep = true
					return "", ""
				}
				return ztunnelReason(err), fmt.Sprintf("ztunnel does not hold the pod, and handing it over again failed: %v", err)
			}
			repairs = append(repairs, RepairZtunnel)
		}
		return p.checkListeners(ctx, e, disruptive, &repairs)
	}()
	if e = p.entry(pod.UID); e == nil {
		return repairs
	}
	for _, r := range repairs {
		if o := p.cfg.VerifyObserver; o != nil {
			o.Repaired(r)
		}
	}
	if len(repairs) > 0 && loss == "" {
		// Proven again only by a verification that finds the repair
		// holding; a repair that did not hold is reported as the loss
		// it left.
		msg := "found and repaired: " + describeRepairs(repairs)
		p.log.Warn("pod's redirection was lost and is repaired", "pod", e.pod, "uid", pod.UID, "repaired", repairs)
		p.cfg.Events.Warn(pod, EventRepaired, msg)
		loss, detail = "Repaired", msg+"; re-verifying"
		p.verifySoon()
	}
	if keep && loss == "" {
		return repairs
	}
	p.settle(pod, e, loss, detail)
	return repairs
}

// fullRulesCheckEvery bounds how long the verifier trusts the nf_tables
// generation alone: it says nothing of the policy routing, nor of
// iptables-legacy's tables. As long as the sandbox check's backstop: a
// full read-back of every pod costs ~1.5 ms of CPU each, which at a
// shorter interval would cost more than the rest of the verifier.
const fullRulesCheckEvery = DefaultSandboxCheckEvery

// checkRules proves the rules in the pod's netns, re-applying them when
// they are not intact. Reading the whole set back costs a dozen netlink
// requests (and an iptables-save per family with an iptables backend);
// while the netns's nf_tables generation has not moved since the set was
// last proven, no table there has changed, so that read is skipped, up to
// fullRulesCheckEvery.
func (p *Pipeline) checkRules(e *entry) (changed bool, err error) {
	var gen uint32
	genOK := false
	if p.cfg.Generation != nil {
		gen, err = p.cfg.Generation(e.netns)
		genOK = err == nil
	}
	p.mu.Lock()
	recent := !e.rulesCheckedAt.IsZero() && time.Since(e.rulesCheckedAt) < fullRulesCheckEvery
	// Without a generation (iptables-legacy) the read-back, an
	// iptables-save per family, costs ~20 ms per pod: every round, that
	// would be half a core at 250 pods, so it runs at the backstop's pace.
	trusted := recent && (genOK && e.rulesGenKnown && e.rulesGen == gen || p.cfg.Generation == nil)
	p.mu.Unlock()
	if trusted {
		return false, nil
	}
	changed, err = p.cfg.Rules.Apply(e.netns, e.variant)
	if err != nil {
		p.mu.Lock()
		e.rulesGenKnown = false
		p.mu.Unlock()
		return changed, err
	}
	if changed && genOK {
		// Our own write moved it.
		gen, err = p.cfg.Generation(e.netns)
		genOK = err == nil
	}
	p.mu.Lock()
	e.rulesGen, e.rulesGenKnown, e.rulesCheckedAt = gen, genOK, time.Now()
	p.mu.Unlock()
	return changed, nil
}

// Listener repairs that did not hold are retried no sooner than this,
// doubling up to maxListenerBackoff: each one interrupts the pod's
// connections.
const (
	minListenerBackoff = 30 * time.Second
	maxListenerBackoff = 10 * time.Minute
)

// DNSProxyPort is ztunnel's DNS proxy in a pod whose DNS is captured
// (Variant.DNSCapture).
const DNSProxyPort = 15053

// checkListeners proves ztunnel's listeners are bound in the pod. ztunnel
// holding the pod with no listeners there means its proxy for the pod
// failed; an Add for a pod it holds changes nothing, so (when disruptive,
// and not within the backoff of a repair that did not hold) it is told to
// forget the pod and then Added again. The pod stays in the table, and so
// in every snapshot, throughout.
//
// Only the DNS proxy missing is another story: the proxy is up, and
// ztunnel runs without its DNS proxy (its own setting). Restarting the
// proxy would cut the pod's connections and bring nothing back, so the
// pod is only reported, with what to set.
func (p *Pipeline) checkListeners(ctx context.Context, e *entry, disruptive bool, repairs *[]string) (string, string) {
	if p.cfg.Listeners == nil {
		return "", ""
	}
	missing, err := p.cfg.Listeners.Missing(e.netns, e.variant)
	if err != nil {
		return "ListenersUnknown", fmt.Sprintf("could not read the sockets in the pod's netns: %v", err)
	}
	if len(missing) == 0 {
		p.mu.Lock()
		e.listenerBackoff = 0
		p.mu.Unlock()
		return "", ""
	}
	if len(missing) == 1 && missing[0] == DNSProxyPort {
		return "DNSProxyMissing", fmt.Sprintf("the pod's DNS is captured, but ztunnel's DNS proxy (%d) is not listening in the pod's netns: run ztunnel with its DNS proxy, or turn DNS capture off for the node (redirection.dnsCapture=false) or for the pod (annotation ambient.istio.io/dns-capture: \"false\")", DNSProxyPort)
	}
	p.mu.Lock()
	due := time.Now().After(e.listenerRetryAt)
	p.mu.Unlock()
	detail := fmt.Sprintf("ztunnel holds the pod, but its listeners %v are missing from the pod's netns", missing)
	if !disruptive || !due {
		return "ListenersMissing", detail
	}
	uid := e.info.UID
	if err := p.cfg.Ztunnel.Del(ctx, uid); err != nil {
		return ztunnelReason(err), fmt.Sprintf("%s, and ztunnel could not be asked to drop its proxy: %v", detail, err)
	}
	if err := p.cfg.Ztunnel.Add(ctx, e.info); err != nil {
		return ztunnelReason(err), fmt.Sprintf("%s, and ztunnel could not be asked to start it again: %v", detail, err)
	}
	if again, err := p.cfg.Listeners.Missing(e.netns, e.variant); err != nil || len(again) > 0 {
		p.mu.Lock()
		e.listenerBackoff = min(max(2*e.listenerBackoff, minListenerBackoff), maxListenerBackoff)
		e.listenerRetryAt = time.Now().Add(e.listenerBackoff)
		p.mu.Unlock()
		return "ListenersMissing", fmt.Sprintf("ztunnel restarted its proxy for the pod, but its listeners %v are still missing from the pod's netns (err: %v); next try after %s", again, err, e.listenerBackoff)
	}
	*repairs = append(*repairs, RepairListeners)
	return "", ""
}

func describeRepairs(kinds []string) string {
	var parts []string
	for _, k := range kinds {
		switch k {
		case RepairSandbox:
			parts = append(parts, "the pod ran in a sandbox inpod had not redirected (now redirected)")
		case RepairRules:
			parts = append(parts, "the redirection rules in the pod's netns were missing or altered (re-applied)")
		case RepairZtunnel:
			parts = append(parts, "ztunnel did not hold the pod (handed over again)")
		case RepairListeners:
			parts = append(parts, "ztunnel's listeners were missing from the pod's netns (its proxy restarted)")
		default:
			parts = append(parts, k)
		}
	}
	return strings.Join(parts, "; ")
}

func ztunnelReason(err error) string {
	switch {
	case errors.Is(err, zds.ErrNoConnection):
		return "ZtunnelNotConnected"
	case errors.Is(err, zds.ErrAckTimeout), errors.Is(err, context.DeadlineExceeded):
		return "ZtunnelTimeout"
	}
	return "ZtunnelRejected"
}

// settle records whether the pod's redirection is proven (loss "") and
// reports a change: a Warning Event when a proven pod loses it (a failed
// enrollment reports its own), and the pod condition either way. A
// verification with the same outcome as the last writes nothing. The first
// one of this agent always asks: the writer skips what the pod already
// carries (an agent restart costs no API writes). Only the writer can tell:
// it knows what it wrote that the cache does not show yet, and the cached
// status alone took a pod labelled out and back (True/NotEnrolled from its
// removal) for proven.
func (p *Pipeline) settle(pod *corev1.Pod, e *entry, loss, detail string) {
	proven := loss == ""
	p.mu.Lock()
	was, wasLoss, known := e.proven, e.loss, e.conditionKnown
	e.proven, e.loss, e.conditionKnown = proven, loss, true
	p.mu.Unlock()
	if known && was && !proven && loss != "Repaired" {
		p.log.Error("pod's redirection is not proven", "pod", e.pod, "uid", pod.UID, "reason", loss, "detail", detail)
		p.cfg.Events.Warn(pod, EventFailed, detail)
	}
	if known && was == proven && wasLoss == loss {
		return
	}
	if proven {
		if known {
			p.log.Info("pod's redirection is proven again", "pod", e.pod, "uid", pod.UID)
		}
		p.setCondition(pod, true, enrollment.ReasonRedirected, MessageRedirected)
		return
	}
	p.setCondition(pod, false, loss, detail)
}

// setCondition converges the pod's condition, only on pods whose
// readiness gate reads it: for the others it would be an API write per pod
// start that nothing waits for.
func (p *Pipeline) setCondition(pod *corev1.Pod, proven bool, reason, message string) {
	if p.cfg.Conditions == nil || !enrollment.HasRedirectedGate(pod) {
		return
	}
	p.cfg.Conditions.Set(types.NamespacedName{Namespace: pod.Namespace, Name: pod.Name}, pod.UID, proven, reason, message)
}

// syncProbes makes the node's probe exemptions exactly the enrolled and
// held pods' IPs (only adding, while a held pod reports none: see
// PruneSafe). It
// holds probeMu, so an enrollment between its exemption and its entry in
// the table is never taken for a stale one. It returns how many exemptions
// it added or removed.
func (p *Pipeline) syncProbes() int {
	p.probeMu.Lock()
	defer p.probeMu.Unlock()
	// While a held pod reports no IPs, the IPs its previous agent exempted
	// are unknown: nothing is removed then, only what is missing added.
	added, removed, err := p.cfg.Probes.Sync(p.EnrolledIPs(), p.PruneSafe())
	if err != nil {
		p.log.Error("could not verify the node's probe exemptions", "err", err)
		return 0
	}
	if len(added)+len(removed) > 0 {
		p.log.Warn("probe exemptions were not the enrolled pods' IPs; repaired", "added", added, "removed", removed)
		if o := p.cfg.VerifyObserver; o != nil {
			for range len(added) + len(removed) {
				o.Repaired(RepairProbes)
			}
		}
	}
	return len(added) + len(removed)
}

func (p *Pipeline) unprovenCount() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for _, e := range p.enrolled {
		if !e.proven {
			n++
		}
	}
	return n
}

// verifySoon asks the agent for a verification round soon: something may
// have broken a pod's redirection.
func (p *Pipeline) verifySoon() {
	if p.cfg.VerifySoon != nil {
		p.cfg.VerifySoon()
	}
}

// releaseGate lets a pod that carries the readiness gate but is not in the
// mesh become ready: the gate must never hold back a pod outside it. The
// caller knows the pod is not enrolled (positive knowledge) and holds its
// lock.
func (p *Pipeline) releaseGate(pod *corev1.Pod) {
	if p.cfg.Conditions == nil || !enrollment.HasRedirectedGate(pod) {
		return
	}
	p.cfg.Conditions.Set(types.NamespacedName{Namespace: pod.Namespace, Name: pod.Name}, pod.UID, true, enrollment.ReasonNotEnrolled, MessageNotEnrolled)
}

// ReleaseGates lets every gated pod that is not Ready for want of the
// condition become ready: inpod is being removed from the node, so none of
// them is in the mesh any more and nobody would set their condition again.
// A pod whose condition is True already is left as it is: rewriting every
// enrolled pod's reason would be one API write per pod within the
// removal's bound, for nothing a pod or a Service reads.
func (p *Pipeline) ReleaseGates(pods []*corev1.Pod) {
	for _, pod := range pods {
		if pod.Status.Phase != corev1.PodSucceeded && pod.Status.Phase != corev1.PodFailed && !conditionTrue(pod) {
			p.releaseGate(pod)
		}
	}
}

// conditionTrue reports whether the pod, as cached, carries
// enrollment.RedirectedCondition True.
func conditionTrue(pod *corev1.Pod) bool {
	for _, c := range pod.Status.Conditions {
		if c.Type == enrollment.RedirectedCondition {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

func (p *Pipeline) isProven(e *entry) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return e.proven
}

func (p *Pipeline) presence() ZtunnelPresence {
	if p.cfg.Presence == nil {
		return ZtunnelReady
	}
	return p.cfg.Presence()
}
