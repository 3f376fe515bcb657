package enroll

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/inpod-dev/inpod/enrollment"
	"github.com/inpod-dev/inpod/netns"
	"github.com/inpod-dev/inpod/zds"
)

// The pipeline's collaborators, as it uses them.
type (
	// Rules installs and removes the in-pod rules (the agent's
	// redirect.Engine), in the pod's own variant. Apply reports changed
	// false when everything was already in place.
	Rules interface {
		Apply(ns *os.File, v Variant) (changed bool, err error)
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
		Record(uid string, ips []netip.Addr) error
		// IPs are the sandbox IPs a record holds (none when unknown).
		IPs(uid string) ([]netip.Addr, error)
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

// Variant is one pod's variant of the redirection, as the agent decides it
// from the pod (Config.VariantOf). It is fixed when the pod's sandbox is
// enrolled (its CNI ADD, a reconcile, the agent's start): an edit of the
// pod's annotations changes a running pod's rules only then, as Istio's
// node agent does.
type Variant struct {
	// DNSCapture: the pod's DNS goes to ztunnel's DNS proxy, whose
	// listener then proves the redirection too.
	DNSCapture bool
	// NoInboundCapture: only outbound traffic is redirected (Istio's
	// ingress mode).
	NoInboundCapture bool
	// VirtualInterfaces: the pod's interfaces whose incoming TCP is a
	// guest's outbound traffic (Istio's reroute-virtual-interfaces).
	VirtualInterfaces []string
}

// Config wires a Pipeline.
type Config struct {
	Policy enrollment.Policy
	Rules  Rules
	// VariantOf decides a pod's variant of the redirection from the pod
	// (the node's defaults, and the pod's annotations that override them).
	// Nil: the zero Variant for every pod.
	VariantOf func(*corev1.Pod) Variant
	Probes    ProbeSet
	Ztunnel   Ztunnel
	Pods      Pods
	Finder    NetnsFinder
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
	pod types.NamespacedName
	// variant is the pod's, decided when this sandbox was enrolled: the
	// rules re-applied and the listeners proved later are those.
	variant Variant
	netns   *os.File
	id      netns.Identity
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
	// gated: the pod's readiness waits for enrollment.RedirectedCondition.
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
	unlock, _ := p.lockIf(uid, true)
	return unlock
}

// lockIfFree is lock when no one holds the pod's lock; ok is false, and
// nothing held, otherwise.
func (p *Pipeline) lockIfFree(uid types.UID) (unlock func(), ok bool) {
	return p.lockIf(uid, false)
}

func (p *Pipeline) lockIf(uid types.UID, wait bool) (func(), bool) {
	p.mu.Lock()
	l, ok := p.locks[uid]
	if !ok {
		l = &podLock{}
		p.locks[uid] = l
	}
	l.users++
	p.mu.Unlock()
	release := func() {
		p.mu.Lock()
		if l.users--; l.users == 0 {
			delete(p.locks, uid)
		}
		p.mu.Unlock()
	}
	if wait {
		l.Lock()
	} else if !l.TryLock() {
		release()
		return nil, false
	}
	return func() {
		l.Unlock()
		release()
	}, true
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

// failure is an error with a reason a user can act on, for events and
// metrics.
type failure struct {
	reason string
	err    error
}

func (f *failure) Error() string { return f.err.Error() }
func (f *failure) Unwrap() error { return f.err }

func fail(reason string, format string, args ...any) error {
	return &failure{reason: reason, err: fmt.Errorf(format, args...)}
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
