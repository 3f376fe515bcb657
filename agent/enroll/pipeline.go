package enroll

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"slices"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"

	"github.com/inpod-dev/inpod/cnievent"
	"github.com/inpod-dev/inpod/netns"
	"github.com/inpod-dev/inpod/zds"
)

// The pipeline's collaborators, as it uses them.
type (
	// Rules installs and removes the in-pod rules (the agent's
	// redirect.Engine, with its options). Apply reports changed false when
	// everything was already in place.
	Rules interface {
		Apply(ns *os.File) (changed bool, err error)
		Remove(ns *os.File) (bool, error)
		// Present says whether the netns holds inpod's netfilter rules
		// (not the policy route, which has Istio's values).
		Present(ns *os.File) (bool, error)
	}
	// ProbeSet exempts kubelet probes to enrolled IPs (redirect.HostProbes).
	ProbeSet interface {
		Add(netip.Addr) error
		Remove(netip.Addr) error
		// Sync makes the exemptions exactly keep (repairing the
		// node's table first) and says what it changed.
		// Without removeStale it only adds.
		Sync(keep []netip.Addr, removeStale bool) (added, removed []netip.Addr, err error)
	}
	// Ztunnel receives the pods (zds.Server).
	Ztunnel interface {
		Add(ctx context.Context, w zds.Workload) error
		Del(ctx context.Context, uid string) error
	}
	// Pods reads the informer cache, and the API once for an object the
	// cache has not delivered within a bounded wait.
	Pods interface {
		Pod(ctx context.Context, namespace, name string) (*corev1.Pod, error)
		// Namespace waits (bounded) for the cache to deliver a
		// namespace it lacks, then reads the API once; an error means
		// the namespace is not known.
		Namespace(ctx context.Context, name string) (*corev1.Namespace, error)
		// Live reads the pod from the API past the cache: for an ADD
		// whose runtime named no pod UID, which pod object the sandbox
		// belongs to.
		Live(ctx context.Context, namespace, name string) (*corev1.Pod, error)
	}
	// NetnsFinder locates a running pod's netns (podnetns.Finder), and
	// tells whether a netns holds one of the IPs.
	NetnsFinder interface {
		Find(uid string, ips []netip.Addr) (*os.File, error)
		Holds(ns *os.File, ips []netip.Addr) bool
	}
	// Annotations converge the pod's redirection annotation, off the
	// critical path; "" removes it.
	Annotations interface {
		Set(pod types.NamespacedName, uid types.UID, value string)
	}
	// Records is the node-local record of pods with rules
	// (enrolledrecord.Dir): written before a pod's rules are applied, so a
	// restarted agent knows every pod with rules, also one whose
	// annotation never landed. See Restore.
	Records interface {
		Record(uid string) error
		Forget(uid string) error
		Recorded(uid string) (bool, error)
		List() ([]string, error)
	}
	// Events reports failures on the pod, where users look.
	Events interface {
		Warn(pod *corev1.Pod, reason, message string)
	}
	// Observer counts outcomes for metrics.
	Observer interface {
		Enrolled(source string, took time.Duration)
		Failed(reason string)
		Removed()
		// RanUnredirected counts enrolled pods an agent found, at its
		// start, running in a sandbox nothing had redirected.
		RanUnredirected()
	}
)

// Config wires a Pipeline.
type Config struct {
	Policy  Policy
	Rules   Rules
	Probes  ProbeSet
	Ztunnel Ztunnel
	Pods    Pods
	Finder  NetnsFinder
	// SandboxCheckEvery is how old a pod's last sandbox check may get
	// before a reconcile looks again without any sign of a change
	// (default DefaultSandboxCheckEvery).
	SandboxCheckEvery time.Duration
	Annotations       Annotations
	// Records may be nil (tests of other parts): the annotation is then
	// the only record.
	Records  Records
	Events   Events
	Observer Observer
	Logger   *slog.Logger

	// The verifier's (see verify.go); each may be nil.
	Listeners      Listeners
	Acks           ZtunnelAcks
	Conditions     Conditions
	VerifyObserver VerifyObserver
	// Presence says what ztunnel's state lets a verification conclude
	// (nil: ZtunnelReady).
	Presence func() ZtunnelPresence
	// VerifySoon asks for a verification round soon (nil: none).
	VerifySoon func()
	// Generation reads a netns's nf_tables generation (redirect.Generation)
	// so the verifier can skip reading back rules that cannot have
	// changed; nil (iptables-legacy): every round reads them back.
	Generation func(*os.File) (uint32, error)
}

// Pipeline is the enrolled-pod table and the operations on it. Operations
// on one pod are serialised; different pods proceed in parallel.
type Pipeline struct {
	cfg Config
	log *slog.Logger

	// probeMu keeps the verifier's sync of the probe exemptions (write
	// side) out of an enrollment between its exemption and its entry in
	// the table (read side), which the sync would take for stale.
	probeMu sync.RWMutex

	mu       sync.Mutex
	enrolled map[types.UID]*entry
	// held are pods a previous agent enrolled (they carry the redirection
	// annotation, so their rules and ztunnel's proxy are in place) that
	// this one could not restore yet: netns not found, no IPs in their
	// status yet, namespace not known. See Restore.
	held  map[types.UID]*heldPod
	locks map[types.UID]*podLock
	// relabelledOut are terminating pods a label change took out of the
	// mesh while their sandbox still ran: the one case where a terminating
	// pod that is not in the table has something to redirect again if it
	// is labelled back. delSeen are pods (by API UID, and by the UID the
	// runtime names them by) a CNI DEL came for, acted on or not: their
	// sandbox is going, so there is nothing to redirect. Both are cleared
	// by enrolling the pod again and once the pod is gone (ForgetGone).
	relabelledOut map[types.UID]types.NamespacedName
	delSeen       map[types.UID]types.NamespacedName
}

// heldPod is an enrolled pod whose netns the agent does not hold. Snapshots
// send it as Keep, so ztunnel keeps the proxy the pod's rules point at; its
// IPs stay exempted from the probe prune.
type heldPod struct {
	pod        types.NamespacedName
	sandboxUID string
	ips        []netip.Addr
	info       zds.Workload // NetNS nil: sent as Keep
}

// podLock serialises the operations on one pod; it lives while someone
// holds or waits for it.
type podLock struct {
	sync.Mutex
	users int
}

type entry struct {
	pod   types.NamespacedName
	netns *os.File
	id    netns.Identity
	// containerID is the sandbox's, from its CNI ADD; "" when unknown
	// (enrolled through procfs).
	containerID string
	// sandboxUID is the UID the runtime names the pod by (a static pod's
	// differs from its mirror's API UID), so its DEL and CHECK find it.
	sandboxUID string
	ips        []netip.Addr
	info       zds.Workload
	// checkedAt is when the sandbox was last known to be this one: at
	// enrollment, and at each procfs check.
	checkedAt time.Time
	// proven is whether the pod's redirection was last found intact (at
	// enrollment, or by the verifier); loss is why not. A removal that
	// failed half-way leaves the entry unproven, so the next reconcile or
	// verification re-proves it before trusting it.
	proven bool
	loss   string
	// conditionKnown: this agent has set the pod's condition, or found it
	// as wanted; until then a verification that agrees with the pod's
	// cached condition writes nothing.
	conditionKnown bool
	// gated: the pod's readiness waits for RedirectedCondition.
	gated bool
	// The verifier's memory: the netns's nf_tables generation when its
	// rules were last proven (see checkRules), and the backoff of
	// listener repairs that did not hold.
	rulesGen        uint32
	rulesGenKnown   bool
	rulesCheckedAt  time.Time
	listenerBackoff time.Duration
	listenerRetryAt time.Time
}

// New returns an empty pipeline.
func New(cfg Config) *Pipeline {
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	return &Pipeline{cfg: cfg, log: log.With("component", "enroll"),
		enrolled: map[types.UID]*entry{}, held: map[types.UID]*heldPod{}, locks: map[types.UID]*podLock{},
		relabelledOut: map[types.UID]types.NamespacedName{}, delSeen: map[types.UID]types.NamespacedName{}}
}

func (p *Pipeline) lock(uid types.UID) func() {
	p.mu.Lock()
	l, ok := p.locks[uid]
	if !ok {
		l = &podLock{}
		p.locks[uid] = l
	}
	l.users++
	p.mu.Unlock()
	l.Lock()
	return func() {
		l.Unlock()
		p.mu.Lock()
		if l.users--; l.users == 0 {
			delete(p.locks, uid)
		}
		p.mu.Unlock()
	}
}

// failure is an error with a reason a user can act on, for events and
// metrics.
type failure struct {
	reason string
	err    error
}

func (f *failure) Error() string { return f.err.Error() }
func (f *failure) Unwrap() error { return f.err }

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

func fail(reason string, format string, args ...any) error {
	return &failure{reason: reason, err: fmt.Errorf(format, args...)}
}

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
	// Every failure below goes through abort, which undoes what this call
	// did to a new sandbox and reports why.
	var applied, rulesWritten, published, recorded bool
	var exempted []netip.Addr // probe exemptions this call added
	abort := func(f error) error {
		if fromCNI && !sameSandbox {
			if published {
				p.unpublish(ctx, pod.UID, old)
			}
			// The record goes only once no rules can be in the netns: none
			// applied, or this call's taken out again. Rules that were
			// there already (an intact set is not rewritten) stay, and so
			// does the record.
			rulesOut := !applied
			if rulesWritten {
				if _, err := p.cfg.Rules.Remove(sb.netns); err != nil {
					p.log.Error("could not take the rules out of a sandbox whose start failed", "pod", key, "err", err)
				} else {
					rulesOut = true
				}
			}
			// A pod held from the previous agent keeps its record: the
			// sandbox whose rules it stands for is not this one.
			if recorded && rulesOut && p.heldPod(pod.UID) == nil {
				if err := p.forget(pod.UID); err != nil {
					p.log.Warn("could not drop the record of a sandbox whose start failed; the next agent takes the pod for enrolled before", "pod", key, "err", err)
				}
			}
		}
		// An exemption left behind would SNAT the node's probes to the
		// next pod given this IP, which may be outside the mesh.
		for _, ip := range exempted {
			if old != nil && slices.Contains(old.ips, ip) {
				continue
			}
			if err := p.cfg.Probes.Remove(ip); err != nil {
				p.log.Error("could not drop the probe exemption of a sandbox whose start failed; pruned at the next restart", "pod", key, "ip", ip, "err", err)
			}
		}
		if fromCNI && sameSandbox && published {
			p.setEntry(pod.UID, old)
		}
		sb.netns.Close()
		return p.report(pod, f)
	}

	if old == nil {
		if err := p.record(pod.UID); err != nil {
			return abort(fail("RecordFailed", "record the pod as enrolled on the node before its rules: %v", err))
		}
		recorded = true
		p.cfg.Annotations.Set(key, pod.UID, AnnotationPending)
	}
	applied = true
	// A running pod (reconcile, restart) keeps what this call applied when
	// a later step fails: it is enrolled unproven, so a removal finds its
	// rules and the verifier retries. Rolled back like a new sandbox's, it
	// would keep rules that no entry names, and a pod that then left the
	// mesh would be black-holed.
	loss, lossDetail := "", ""
	changed, err := p.cfg.Rules.Apply(sb.netns)
	rulesWritten = changed
	if changed && sb.unrecorded {
		p.ranUnredirected(pod)
	}
	if err != nil {
		f := fail("RedirectionFailed", "apply redirection rules: %v", err)
		if fromCNI {
			return abort(f)
		}
		loss, lossDetail = "RulesNotRepaired", p.report(pod, f).Error()
	}
	p.probeMu.RLock()
	for _, ip := range sb.ips {
		if err := p.cfg.Probes.Add(ip); err != nil {
			f := fail("ProbeExemptionFailed", "exempt kubelet probes to %s: %v", ip, err)
			if fromCNI {
				p.probeMu.RUnlock()
				return abort(f)
			}
			if loss == "" {
				loss, lossDetail = "ProbeExemptionFailed", p.report(pod, f).Error()
			}
			continue
		}
		exempted = append(exempted, ip)
	}
	info := zds.Workload{UID: string(pod.UID), Name: pod.Name, Namespace: pod.Namespace, ServiceAccount: pod.Spec.ServiceAccountName, NetNS: sb.netns}
	ne := &entry{pod: key, netns: sb.netns, id: id, containerID: sb.containerID, sandboxUID: SandboxUID(pod), ips: sb.ips, info: info,
		checkedAt: time.Now(), gated: HasRedirectedGate(pod)}
	if old != nil && sameSandbox {
		// The pod's condition as this agent last set it.
		ne.proven, ne.loss, ne.conditionKnown = old.proven, old.loss, old.conditionKnown
	}
	p.setEntry(pod.UID, ne)
	p.probeMu.RUnlock()
	published = true
	ztunnelLoss, ztunnelDetail := "", ""
	if loss == "RulesNotRepaired" {
		// Rules that may not be in place: ztunnel gets the pod from the
		// verifier once they are.
	} else if err := p.cfg.Ztunnel.Add(ctx, info); err != nil {
		reason := ztunnelReason(err)
		if fromCNI {
			// Rules without ztunnel's listeners would black-hole the
			// pod's traffic; the pod does not start anyway.
			return abort(fail(reason, "hand the pod to ztunnel: %v", err))
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
	p.cfg.Annotations.Set(key, pod.UID, AnnotationEnabled)
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

// markRelabelledOut remembers a terminating pod a label change took out
// of the mesh, unless its sandbox's DEL has come.
func (p *Pipeline) markRelabelledOut(pod *corev1.Pod) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if _, gone := p.delSeen[pod.UID]; gone {
		return
	}
	if _, gone := p.delSeen[types.UID(SandboxUID(pod))]; gone {
		return
	}
	p.relabelledOut[pod.UID] = types.NamespacedName{Namespace: pod.Namespace, Name: pod.Name}
}

// mayRedirectAgain: a terminating pod not in the table still runs a
// sandbox to redirect (it was relabelled out while draining, and no DEL
// came since).
func (p *Pipeline) mayRedirectAgain(pod *corev1.Pod) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	_, out := p.relabelledOut[pod.UID]
	_, del := p.delSeen[pod.UID]
	_, sandboxDel := p.delSeen[types.UID(SandboxUID(pod))]
	return out && !del && !sandboxDel
}

func (p *Pipeline) sawDel(uid types.UID, pod types.NamespacedName) {
	if uid == "" {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.delSeen[uid] = pod
}

// forgetEnded drops the marks of a pod enrolled again: a DEL seen before
// was an older sandbox's.
func (p *Pipeline) forgetEnded(pod *corev1.Pod) {
	p.mu.Lock()
	defer p.mu.Unlock()
	delete(p.relabelledOut, pod.UID)
	delete(p.delSeen, pod.UID)
	delete(p.delSeen, types.UID(SandboxUID(pod)))
}

// ForgetGone drops what the pipeline remembers of incarnations of the pod
// named key other than live (zero: the pod is gone from the API).
func (p *Pipeline) ForgetGone(key types.NamespacedName, live types.UID) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, m := range []map[types.UID]types.NamespacedName{p.relabelledOut, p.delSeen} {
		for uid, pod := range m {
			if pod == key && uid != live {
				delete(m, uid)
			}
		}
	}
}

func (p *Pipeline) entry(uid types.UID) *entry {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.enrolled[uid]
}

// setHeld holds the pod, or releases it when h is nil.
func (p *Pipeline) setHeld(uid types.UID, h *heldPod) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if h == nil {
		delete(p.held, uid)
		return
	}
	p.held[uid] = h
}

func (p *Pipeline) heldPod(uid types.UID) *heldPod {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.held[uid]
}

// setEntry puts e in the table, or takes the pod out when e is nil.
func (p *Pipeline) setEntry(uid types.UID, e *entry) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if e == nil {
		delete(p.enrolled, uid)
		return
	}
	p.enrolled[uid] = e
}

func (p *Pipeline) report(pod *corev1.Pod, err error) error {
	var f *failure
	reason := "EnrollmentFailed"
	if errors.As(err, &f) {
		reason = f.reason
	}
	p.observeFailure(reason)
	p.log.Error("enrollment failed", "pod", pod.Namespace+"/"+pod.Name, "reason", reason, "err", err)
	p.cfg.Events.Warn(pod, reason, err.Error())
	return err
}

func (p *Pipeline) observeFailure(reason string) { p.cfg.Observer.Failed(reason) }

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

// names reports whether req is about the sandbox e holds.
func (e *entry) names(req *cnievent.Request) bool {
	if e.containerID != "" {
		return req.ContainerID == e.containerID
	}
	return e.holds(req.Netns)
}

// holds reports whether path resolves to the held netns.
func (e *entry) holds(path string) bool {
	if path == "" {
		return false
	}
	id, err := netns.IdentityOfPath(path)
	return err == nil && id == e.id
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
	changed, err := p.cfg.Rules.Apply(e.netns)
	if err != nil {
		return cnievent.Failed, fmt.Errorf("verify rules: %w", err)
	}
	if changed {
		return cnievent.Failed, errors.New("redirection rules were not intact (now repaired)")
	}
	return cnievent.Redirected, nil
}

// lookup finds the enrolled pod a CNI request names: by the runtime's pod
// UID when it sent one, else by name.
func (p *Pipeline) lookup(req *cnievent.Request) (types.UID, bool) {
	if req.PodUID == "" {
		return p.sandboxNamed(req)
	}
	uid := types.UID(req.PodUID)
	if p.IsEnrolled(uid) {
		return uid, true
	}
	// A static pod: the runtime names it by its sandbox UID, the table by
	// its mirror's API UID.
	p.mu.Lock()
	defer p.mu.Unlock()
	for uid, e := range p.enrolled {
		if e.sandboxUID == req.PodUID && e.pod.Namespace == req.PodNamespace && e.pod.Name == req.PodName {
			return uid, true
		}
	}
	return "", false
}

// sandboxNamed finds the enrolled pod of a request without a pod UID: of
// the pods enrolled under that name (a replaced pod and its replacement,
// while the watch lags), the one whose sandbox the request names, else any
// (the caller then checks the sandbox itself).
func (p *Pipeline) sandboxNamed(req *cnievent.Request) (types.UID, bool) {
	key := types.NamespacedName{Namespace: req.PodNamespace, Name: req.PodName}
	type candidate struct {
		uid types.UID
		e   *entry
	}
	var named []candidate
	p.mu.Lock()
	for uid, e := range p.enrolled {
		if e.pod == key {
			named = append(named, candidate{uid, e})
		}
	}
	p.mu.Unlock()
	if len(named) == 0 {
		return "", false
	}
	// Outside the table's lock: telling the sandbox may stat its netns.
	for _, c := range named {
		if c.e.names(req) {
			return c.uid, true
		}
	}
	return named[0].uid, true
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
			return p.release(ctx, uid, h, h.ips, false)
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
		p.cfg.Conditions.Set(e.pod, uid, true, ReasonNotEnrolled, "the pod is not in the mesh")
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

// Snapshot lists every enrolled pod with its netns, for a ztunnel that
// (re)connects, and every held pod without one (sent as Keep). Each netns is a duplicate the server owns and closes once
// sent: taken under p.mu, where no entry's file is closed, it survives an
// unenroll or a re-enrollment that closes the table's file while the
// snapshot is on its way.
func (p *Pipeline) Snapshot(context.Context) ([]zds.Workload, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make([]zds.Workload, 0, len(p.enrolled))
	for _, e := range p.enrolled {
		w, err := e.info.Dup()
		if err != nil {
			// A snapshot without this pod would let ztunnel drop its
			// proxy, and readiness would claim it knows every pod.
			for _, o := range out {
				o.NetNS.Close()
			}
			return nil, fmt.Errorf("snapshot pod %s: %w", e.pod, err)
		}
		out = append(out, w)
	}
	for uid, h := range p.held {
		// While its enrollment is under way the pod is in both; the
		// Add speaks for it.
		if _, ok := p.enrolled[uid]; !ok {
			out = append(out, h.info)
		}
	}
	return out, nil
}

// PruneSafe reports whether EnrolledIPs names every IP a pod of the mesh
// may have: not while a held pod reports no IPs yet (the previous agent
// exempted the IPs its ADD named, which nothing here knows).
func (p *Pipeline) PruneSafe() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	for uid, h := range p.held {
		if _, ok := p.enrolled[uid]; !ok && len(h.ips) == 0 {
			return false
		}
	}
	return true
}

// ipsOfOthers lists the IPs of every enrolled or held pod but uid.
func (p *Pipeline) ipsOfOthers(uid types.UID) []netip.Addr {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []netip.Addr
	for u, e := range p.enrolled {
		if u != uid {
			out = append(out, e.ips...)
		}
	}
	for u, h := range p.held {
		if u != uid {
			out = append(out, h.ips...)
		}
	}
	return out
}

// IsEnrolled reports whether the pod is in the table.
func (p *Pipeline) IsEnrolled(uid types.UID) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	_, ok := p.enrolled[uid]
	return ok
}

// EnrolledIPs lists every enrolled or held pod's IPs, for pruning the probe
// set: a held pod's rules still send its probes through ztunnel.
func (p *Pipeline) EnrolledIPs() []netip.Addr {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []netip.Addr
	for _, e := range p.enrolled {
		out = append(out, e.ips...)
	}
	for _, h := range p.held {
		out = append(out, h.ips...)
	}
	return out
}

// Reconcile brings one running pod to what the policy says: enrolled pods
// found through procfs get their rules (an intact set is left alone, so a
// restarted agent never disturbs running traffic), unenrolled or finished
// ones are removed, and an enrolled pod whose sandbox changed without a CNI
// ADD reaching inpod is re-enrolled with its new netns. A pod whose
// namespace is not known is left as it is (the error retries it). A held
// pod (see Restore) stays held until it is restored or removed; every
// reconcile of it that does not settle it returns an error, so it retries.
func (p *Pipeline) Reconcile(ctx context.Context, pod *corev1.Pod) error {
	return p.reconcile(ctx, pod, false)
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
	return p.reconcile(ctx, pod, true)
}

func annotated(pod *corev1.Pod) bool {
	v := pod.Annotations[RedirectionAnnotation]
	return v == AnnotationEnabled || v == AnnotationPending
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

func (p *Pipeline) record(uid types.UID) error {
	if p.cfg.Records == nil {
		return nil
	}
	return p.cfg.Records.Record(string(uid))
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

func (p *Pipeline) reconcile(ctx context.Context, pod *corev1.Pod, restoring bool) error {
	defer p.lock(pod.UID)()
	h := p.heldPod(pod.UID)
	// hold keeps a pod that was in the mesh before this agent and is not
	// in its table in every snapshot (as Keep) until it is settled.
	hold := func(ips []netip.Addr) {
		if h == nil && !(restoring && p.enrolledBefore(pod)) || p.entry(pod.UID) != nil {
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
	// A terminating pod still runs (preStop hooks, draining) and stays in
	// the mesh until it has finished, its sandbox's DEL comes, or it is
	// gone from the API.
	finished := pod.Status.Phase == corev1.PodSucceeded || pod.Status.Phase == corev1.PodFailed
	want := false
	if !finished {
		var err error
		if want, err = p.wants(ctx, pod); err != nil {
			hold(podIPs(pod))
			return err
		}
	}
	e := p.entry(pod.UID)
	switch {
	case want && e == nil && pod.DeletionTimestamp != nil && h == nil && !restoring && !p.mayRedirectAgain(pod):
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
		return nil
	case want && e == nil:
		ips := podIPs(pod)
		if len(ips) == 0 {
			if h != nil || restoring && p.enrolledBefore(pod) {
				hold(nil)
				return fmt.Errorf("pod %s/%s was enrolled but reports no IPs yet, so its netns cannot be found; held (ztunnel keeps its proxy)", pod.Namespace, pod.Name)
			}
			// No sandbox network yet: the CNI ADD will enroll it.
			return nil
		}
		f, err := p.cfg.Finder.Find(SandboxUID(pod), ips)
		if err != nil {
			hold(ips)
			return p.report(pod, fail("NetnsNotFound", "find the running pod's netns: %v", err))
		}
		start := time.Now()
		if err := p.enroll(ctx, pod, sandbox{netns: f, ips: ips, unrecorded: restoring && h == nil && !p.enrolledBefore(pod)}, false); err != nil {
			hold(ips)
			return err
		}
		p.cfg.Observer.Enrolled("reconcile", time.Since(start))
		return nil
	case !want && e != nil:
		if err := p.unenroll(ctx, pod.UID, e, true); err != nil {
			return err
		}
		if pod.DeletionTimestamp != nil && !finished {
			p.markRelabelledOut(pod)
		}
		return nil
	case !want && h == nil && !(restoring && p.enrolledBefore(pod)):
		if !finished {
			p.releaseGate(pod)
		}
		return nil
	case !want && (h != nil || restoring && p.enrolledBefore(pod)):
		ips := podIPs(pod)
		if h != nil {
			ips = append(ips, h.ips...)
		}
		if err := p.release(ctx, pod.UID, &heldPod{pod: types.NamespacedName{Namespace: pod.Namespace, Name: pod.Name},
			sandboxUID: SandboxUID(pod), ips: ips}, podIPs(pod), !finished); err != nil {
			hold(ips)
			return err
		}
		p.releaseGate(pod)
		return nil
	case want && e != nil && !p.isProven(e):
		// Something may have broken it (a removal that failed half-way
		// before the pod was labelled back, a failed repair): proven
		// again, or repaired, before it is trusted.
		p.verify(ctx, pod, e, p.presence(), false)
		if e := p.entry(pod.UID); e != nil && !p.isProven(e) {
			return fmt.Errorf("pod %s/%s: redirection not proven: %s", pod.Namespace, pod.Name, e.loss)
		}
	case want && e != nil:
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
		if pod.Annotations[RedirectionAnnotation] != AnnotationEnabled {
			p.cfg.Annotations.Set(types.NamespacedName{Namespace: pod.Namespace, Name: pod.Name}, pod.UID, AnnotationEnabled)
		}
	}
	return nil
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

// release takes a pod that is not in the table out of the mesh: its rules
// out of the netns procfs finds for it by ips, ztunnel told, its probe
// exemptions and annotation dropped. With running, a netns that cannot be
// found is an error (the rules may still be there, and ztunnel's proxy
// must stay under them); without, the sandbox is taken to be gone with its
// rules. The pod's lock is held.
func (p *Pipeline) release(ctx context.Context, uid types.UID, h *heldPod, ips []netip.Addr, running bool) error {
	if len(ips) > 0 {
		f, err := p.cfg.Finder.Find(h.sandboxUID, ips)
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
	for _, ip := range h.ips {
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

// Close releases every netns fd (rules and ztunnel's proxies stay: a
// restarted agent finds the pods again through procfs).
func (p *Pipeline) Close() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, e := range p.enrolled {
		e.netns.Close()
	}
}

// UIDsOf lists the enrolled and held pods of a name: more than one when a pod was
// deleted and recreated under its name (a StatefulSet's) and the old one's
// removal was missed.
func (p *Pipeline) UIDsOf(pod types.NamespacedName) []types.UID {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []types.UID
	for uid, e := range p.enrolled {
		if e.pod == pod {
			out = append(out, uid)
		}
	}
	for uid, h := range p.held {
		if h.pod == pod {
			out = append(out, uid)
		}
	}
	return out
}

// Enrolled lists the enrolled and held pods by name, for the periodic
// sandbox check.
func (p *Pipeline) Enrolled() []types.NamespacedName {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make([]types.NamespacedName, 0, len(p.enrolled)+len(p.held))
	for _, e := range p.enrolled {
		out = append(out, e.pod)
	}
	// A held pod is retried by the same check until it is restored or
	// gone.
	for _, h := range p.held {
		out = append(out, h.pod)
	}
	return out
}
