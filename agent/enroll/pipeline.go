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
	}
	// ProbeSet exempts kubelet probes to enrolled IPs (redirect.HostProbes).
	ProbeSet interface {
		Add(netip.Addr) error
		Remove(netip.Addr) error
		Prune([]netip.Addr) error
	}
	// Ztunnel receives the pods (zds.Server).
	Ztunnel interface {
		Add(ctx context.Context, w zds.Workload) error
		Del(ctx context.Context, uid string) error
	}
	// Pods reads the informer cache, and the API once for a pod the cache
	// has not seen yet.
	Pods interface {
		Pod(ctx context.Context, namespace, name string) (*corev1.Pod, error)
		Namespace(name string) (*corev1.Namespace, error)
	}
	// NetnsFinder locates a running pod's netns (podnetns.Finder).
	NetnsFinder interface {
		Find(uid string, ips []netip.Addr) (*os.File, error)
	}
	// Annotations converge the pod's redirection annotation, off the
	// critical path; "" removes it.
	Annotations interface {
		Set(pod types.NamespacedName, value string)
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
	}
)

// Config wires a Pipeline.
type Config struct {
	Policy      Policy
	Rules       Rules
	Probes      ProbeSet
	Ztunnel     Ztunnel
	Pods        Pods
	Finder      NetnsFinder
	Annotations Annotations
	Events      Events
	Observer    Observer
	Logger      *slog.Logger
}

// Pipeline is the enrolled-pod table and the operations on it. Operations
// on one pod are serialised; different pods proceed in parallel.
type Pipeline struct {
	cfg Config
	log *slog.Logger

	mu       sync.Mutex
	enrolled map[types.UID]*entry
	locks    map[types.UID]*sync.Mutex
}

type entry struct {
	pod   types.NamespacedName
	netns *os.File
	id    netns.Identity
	ips   []netip.Addr
	info  zds.Workload
}

// New returns an empty pipeline.
func New(cfg Config) *Pipeline {
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	return &Pipeline{cfg: cfg, log: log.With("component", "enroll"),
		enrolled: map[types.UID]*entry{}, locks: map[types.UID]*sync.Mutex{}}
}

func (p *Pipeline) lock(uid types.UID) func() {
	p.mu.Lock()
	l, ok := p.locks[uid]
	if !ok {
		l = &sync.Mutex{}
		p.locks[uid] = l
	}
	p.mu.Unlock()
	l.Lock()
	return l.Unlock
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

// Add handles the plugin's ADD: the pod is enrolled (by the informer cache)
// or not; when it is, its rules are applied and ztunnel has acknowledged it
// before Redirected is answered.
func (p *Pipeline) Add(ctx context.Context, req *cnievent.Request) (cnievent.Outcome, error) {
	start := time.Now()
	pod, err := p.cfg.Pods.Pod(ctx, req.PodNamespace, req.PodName)
	if err != nil {
		if apierrors.IsNotFound(err) {
			// The pod is gone already; nothing will run in this sandbox.
			return cnievent.NotEnrolled, nil
		}
		p.observeFailure("PodLookupFailed")
		return cnievent.Failed, fmt.Errorf("look up pod %s: %w", req.Pod(), err)
	}
	if req.PodUID != "" && string(pod.UID) != req.PodUID {
		p.observeFailure("StalePod")
		return cnievent.Failed, fmt.Errorf("pod %s has uid %s, the runtime named %s; refusing a stale sandbox", req.Pod(), pod.UID, req.PodUID)
	}
	ns, _ := p.cfg.Pods.Namespace(pod.Namespace)
	if !p.cfg.Policy.Enrolled(pod, ns) {
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
		p.report(pod, fail("NetnsUnavailable", "open the pod's netns %s: %v", req.Netns, err))
		return cnievent.Failed, err
	}
	if err := p.enroll(ctx, pod, nsFile, ips, true); err != nil {
		return cnievent.Failed, err
	}
	p.cfg.Observer.Enrolled("cni", time.Since(start))
	return cnievent.Redirected, nil
}

// enroll takes ownership of nsFile: it is kept on success, closed on error.
//
// For a new sandbox (fromCNI) every failure fails the pod's start, and
// rules this call installed are taken out again. For a running pod
// (reconcile, restart) its rules are never removed on a ztunnel problem: the
// pod stays in the table and reaches ztunnel through the next snapshot.
func (p *Pipeline) enroll(ctx context.Context, pod *corev1.Pod, nsFile *os.File, ips []netip.Addr, fromCNI bool) error {
	defer p.lock(pod.UID)()
	key := types.NamespacedName{Namespace: pod.Namespace, Name: pod.Name}
	id, err := netns.IdentityOf(int(nsFile.Fd()))
	if err != nil {
		nsFile.Close()
		return p.report(pod, fail("NetnsUnavailable", "%v", err))
	}
	p.mu.Lock()
	old := p.enrolled[pod.UID]
	p.mu.Unlock()
	if old == nil {
		p.cfg.Annotations.Set(key, AnnotationPending)
	}
	applied, err := p.cfg.Rules.Apply(nsFile)
	if err != nil {
		nsFile.Close()
		return p.report(pod, fail("RedirectionFailed", "apply redirection rules: %v", err))
	}
	// Only a fresh sandbox whose rules this call wrote is rolled back.
	rollback := func() {
		if fromCNI && applied && (old == nil || old.id != id) {
			p.cfg.Rules.Remove(nsFile)
		}
	}
	for _, ip := range ips {
		if err := p.cfg.Probes.Add(ip); err != nil {
			rollback()
			nsFile.Close()
			return p.report(pod, fail("ProbeExemptionFailed", "exempt kubelet probes to %s: %v", ip, err))
		}
	}
	info := zds.Workload{UID: string(pod.UID), Name: pod.Name, Namespace: pod.Namespace, ServiceAccount: pod.Spec.ServiceAccountName, NetNS: nsFile}
	if err := p.cfg.Ztunnel.Add(ctx, info); err != nil {
		reason := "ZtunnelRejected"
		if errors.Is(err, zds.ErrNoConnection) {
			reason = "ZtunnelNotConnected"
		} else if errors.Is(err, zds.ErrAckTimeout) || errors.Is(err, context.DeadlineExceeded) {
			reason = "ZtunnelTimeout"
		}
		if fromCNI {
			// Rules without ztunnel's listeners would black-hole the
			// pod's traffic; the pod does not start anyway.
			rollback()
			nsFile.Close()
			return p.report(pod, fail(reason, "hand the pod to ztunnel: %v", err))
		}
		if !errors.Is(err, zds.ErrNoConnection) {
			p.report(pod, fail(reason, "hand the running pod to ztunnel (it stays enrolled and is in every snapshot): %v", err))
		}
	}
	p.mu.Lock()
	p.enrolled[pod.UID] = &entry{pod: key, netns: nsFile, id: id, ips: ips, info: info}
	p.mu.Unlock()
	if old != nil && old.netns != nsFile {
		old.netns.Close()
		if old.id != id {
			p.log.Info("pod sandbox was recreated; re-enrolled with the new netns", "pod", key, "old", old.id, "new", id)
		}
	}
	p.cfg.Annotations.Set(key, AnnotationEnabled)
	p.log.Info("pod enrolled", "pod", key, "uid", pod.UID, "netns", id, "ips", ips)
	return nil
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

// Del handles the plugin's DEL: the sandbox is going away.
func (p *Pipeline) Del(ctx context.Context, req *cnievent.Request) (cnievent.Outcome, error) {
	uid, ok := p.uidFor(req)
	if !ok {
		return cnievent.NotEnrolled, nil
	}
	if req.Netns != "" {
		// A DEL for an older sandbox of a re-enrolled pod must not undo
		// the current one.
		if id, err := netns.IdentityOfPath(req.Netns); err == nil {
			p.mu.Lock()
			e := p.enrolled[uid]
			p.mu.Unlock()
			if e != nil && e.id != id {
				return cnievent.NotEnrolled, nil
			}
		}
	}
	if err := p.Unenroll(ctx, uid); err != nil {
		return cnievent.Failed, err
	}
	return cnievent.Redirected, nil
}

// Check verifies an enrolled pod's rules by re-applying them: an intact set
// writes nothing; a repaired one is reported, since something changed it.
func (p *Pipeline) Check(ctx context.Context, req *cnievent.Request) (cnievent.Outcome, error) {
	uid, ok := p.uidFor(req)
	if !ok {
		return cnievent.NotEnrolled, nil
	}
	defer p.lock(uid)()
	p.mu.Lock()
	e := p.enrolled[uid]
	p.mu.Unlock()
	if e == nil {
		return cnievent.NotEnrolled, nil
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

func (p *Pipeline) uidFor(req *cnievent.Request) (types.UID, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if req.PodUID != "" {
		_, ok := p.enrolled[types.UID(req.PodUID)]
		return types.UID(req.PodUID), ok
	}
	for uid, e := range p.enrolled {
		if e.pod.Namespace == req.PodNamespace && e.pod.Name == req.PodName {
			return uid, true
		}
	}
	return "", false
}

// Unenroll removes a pod from the mesh: rules out of its netns (still open
// through our fd), ztunnel told on every connection, probe exemption and
// annotation dropped.
func (p *Pipeline) Unenroll(ctx context.Context, uid types.UID) error {
	defer p.lock(uid)()
	p.mu.Lock()
	e := p.enrolled[uid]
	p.mu.Unlock()
	if e == nil {
		return nil
	}
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
		return err
	}
	p.mu.Lock()
	delete(p.enrolled, uid)
	delete(p.locks, uid)
	p.mu.Unlock()
	e.netns.Close()
	p.cfg.Annotations.Set(e.pod, "")
	p.cfg.Observer.Removed()
	p.log.Info("pod removed from the mesh", "pod", e.pod, "uid", uid)
	return nil
}

// UnenrollAll takes every enrolled pod out of the mesh (inpod is being
// removed from the node), going on past failures.
func (p *Pipeline) UnenrollAll(ctx context.Context) error {
	p.mu.Lock()
	uids := make([]types.UID, 0, len(p.enrolled))
	for uid := range p.enrolled {
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
// (re)connects.
func (p *Pipeline) Snapshot(context.Context) ([]zds.Workload, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make([]zds.Workload, 0, len(p.enrolled))
	for _, e := range p.enrolled {
		out = append(out, e.info)
	}
	return out, nil
}

// IsEnrolled reports whether the pod is in the table.
func (p *Pipeline) IsEnrolled(uid types.UID) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	_, ok := p.enrolled[uid]
	return ok
}

// EnrolledIPs lists every enrolled pod's IPs, for pruning the probe set.
func (p *Pipeline) EnrolledIPs() []netip.Addr {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []netip.Addr
	for _, e := range p.enrolled {
		out = append(out, e.ips...)
	}
	return out
}

// Reconcile brings one running pod to what the policy says: enrolled pods
// found through procfs get their rules (an intact set is left alone, so a
// restarted agent never disturbs running traffic), unenrolled or finished
// ones are removed.
func (p *Pipeline) Reconcile(ctx context.Context, pod *corev1.Pod) error {
	ns, _ := p.cfg.Pods.Namespace(pod.Namespace)
	want := p.cfg.Policy.Enrolled(pod, ns) && pod.DeletionTimestamp == nil &&
		pod.Status.Phase != corev1.PodSucceeded && pod.Status.Phase != corev1.PodFailed
	have := p.IsEnrolled(pod.UID)
	switch {
	case want && !have:
		ips := podIPs(pod)
		if len(ips) == 0 {
			// No sandbox network yet: the CNI ADD will enroll it.
			return nil
		}
		f, err := p.cfg.Finder.Find(string(pod.UID), ips)
		if err != nil {
			return p.report(pod, fail("NetnsNotFound", "find the running pod's netns: %v", err))
		}
		start := time.Now()
		if err := p.enroll(ctx, pod, f, ips, false); err != nil {
			return err
		}
		p.cfg.Observer.Enrolled("reconcile", time.Since(start))
		return nil
	case !want && have:
		return p.Unenroll(ctx, pod.UID)
	case want && have:
		// Converge the annotation (a crash between the reply and the
		// patch must heal).
		p.cfg.Annotations.Set(types.NamespacedName{Namespace: pod.Namespace, Name: pod.Name}, AnnotationEnabled)
	}
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

// UIDOf finds an enrolled pod by name (after it left the cache).
func (p *Pipeline) UIDOf(pod types.NamespacedName) (types.UID, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for uid, e := range p.enrolled {
		if e.pod == pod {
			return uid, true
		}
	}
	return "", false
}
