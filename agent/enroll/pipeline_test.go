package enroll_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/uuid"

	"github.com/inpod-dev/inpod/agent/enroll"
	"github.com/inpod-dev/inpod/agent/enrolledrecord"
	"github.com/inpod-dev/inpod/agent/podnetns"
	"github.com/inpod-dev/inpod/agent/redirect"
	"github.com/inpod-dev/inpod/cnievent"
	"github.com/inpod-dev/inpod/enrollment"
	"github.com/inpod-dev/inpod/internal/testkit"
	"github.com/inpod-dev/inpod/netns"
	"github.com/inpod-dev/inpod/netns/netnstest"
	"github.com/inpod-dev/inpod/zds"
	ztunnel "github.com/inpod-dev/inpod/zds/zdstest"
)

// The pipeline against real pieces: the nftables engine in real netns, the
// host probe set in a scratch node netns, a real zds.Server with real
// stand-ins, and procfs. Only the pod cache is a fixture (it can be told to
// lose a namespace), and events are recorded.

const waitFor = 10 * time.Second

// podCache holds the pods and namespaces the test declares.
type podCache struct {
	mu         sync.Mutex
	pods       map[string]*corev1.Pod
	namespaces map[string]*corev1.Namespace
	// nsErr, when set, is what every namespace look-up answers: the cache
	// and the API could not tell.
	nsErr error
	// api holds the pods the API has where they differ from the cache's
	// (a watch that lags); nil, the API has none of that name. liveErr,
	// when set, is what every read of the API answers.
	api     map[string]*corev1.Pod
	liveErr error
}

func (c *podCache) Live(_ context.Context, namespace, name string) (*corev1.Pod, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.liveErr != nil {
		return nil, c.liveErr
	}
	p, ok := c.api[namespace+"/"+name]
	if !ok {
		p, ok = c.pods[namespace+"/"+name]
	}
	if !ok || p == nil {
		return nil, apierrors.NewNotFound(schema.GroupResource{Resource: "pods"}, name)
	}
	return p, nil
}

func (c *podCache) Pod(_ context.Context, namespace, name string) (*corev1.Pod, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if p, ok := c.pods[namespace+"/"+name]; ok {
		return p, nil
	}
	return nil, apierrors.NewNotFound(schema.GroupResource{Resource: "pods"}, name)
}

func (c *podCache) Namespace(_ context.Context, name string) (*corev1.Namespace, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.nsErr != nil {
		return nil, c.nsErr
	}
	if ns, ok := c.namespaces[name]; ok {
		return ns, nil
	}
	return nil, apierrors.NewNotFound(schema.GroupResource{Resource: "namespaces"}, name)
}

func (c *podCache) loseNamespaces(err error) {
	c.mu.Lock()
	c.nsErr = err
	c.mu.Unlock()
}

type event struct{ pod, reason, message string }

type recorder struct {
	mu     sync.Mutex
	events []event
	annots map[types.NamespacedName]string
	// withoutUID counts annotations asked for with no pod UID, which the
	// writer would then write to any pod of that name.
	withoutUID int
	// ranUnredirected counts the Observer's calls.
	ranUnredirected int
}

func (r *recorder) Warn(pod *corev1.Pod, reason, message string) {
	r.mu.Lock()
	r.events = append(r.events, event{pod.Namespace + "/" + pod.Name, reason, message})
	r.mu.Unlock()
}

func (r *recorder) Set(pod types.NamespacedName, uid types.UID, value string) {
	r.mu.Lock()
	if uid == "" {
		r.withoutUID++
	}
	r.annots[pod] = value
	r.mu.Unlock()
}

func (r *recorder) reasons() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []string
	for _, e := range r.events {
		out = append(out, e.reason)
	}
	return out
}

func (r *recorder) Enrolled(string, time.Duration) {}
func (r *recorder) Failed(string)                  {}
func (r *recorder) Removed()                       {}
func (r *recorder) RanUnredirected()               { r.mu.Lock(); r.ranUnredirected++; r.mu.Unlock() }

type fixture struct {
	finder *countingFinder
	t      *testing.T
	p      *enroll.Pipeline
	cache  *podCache
	rec    *recorder
	probes *probes
	// records is the node's record of pods with rules; it outlives a
	// restart, as the agent's directory does.
	records *enrolledrecord.Dir
	sock    string
	log     *slog.Logger
	// stopServer stops the ZDS server of the running pipeline.
	stopServer func()
	// conds records the pod conditions asked for; failDel makes every
	// ZDS Del fail (a ztunnel stalled past the Ack timeout); failAdd,
	// when it holds an error, every ZDS Add.
	conds   *conditions
	failDel atomic.Bool
	failAdd atomic.Pointer[error]
	// verifySoon counts the pipeline's asks for a verification round.
	verifySoon atomic.Int32
	// zt is the ztunnel presence the verifier is told (ZtunnelReady at
	// first); srv the running pipeline's ZDS server.
	zt  atomic.Int32
	srv *zds.Server
	// listeners, when set before startAgent, replaces the verifier's
	// check of the stand-in's listeners; variantOf, each pod's variant.
	listeners enroll.Listeners
	variantOf func(*corev1.Pod) enroll.Variant
}

func newFixture(t *testing.T) *fixture {
	t.Helper()
	netnstest.RequireRoot(t)
	node := netnstest.New(t)
	hostProbes := redirect.NewHostProbes(node.Open(t))
	if err := hostProbes.Ensure(); err != nil {
		t.Fatal(err)
	}
	f := &fixture{t: t, probes: &probes{HostProbes: hostProbes}, finder: &countingFinder{},
		cache: &podCache{pods: map[string]*corev1.Pod{}, api: map[string]*corev1.Pod{}, namespaces: map[string]*corev1.Namespace{
			"mesh":  {ObjectMeta: metav1.ObjectMeta{Name: "mesh", Labels: map[string]string{enrollment.DataplaneModeLabel: enrollment.DataplaneAmbient}}},
			"plain": {ObjectMeta: metav1.ObjectMeta{Name: "plain"}},
		}},
		rec:   &recorder{annots: map[types.NamespacedName]string{}},
		conds: &conditions{last: map[types.UID]condition{}},
		sock:  filepath.Join(testkit.ShortTempDir(t, "enroll-"), "ztunnel.sock"),
	}
	var err error
	if f.records, err = enrolledrecord.Open(filepath.Join(t.TempDir(), "enrolled")); err != nil {
		t.Fatal(err)
	}
	f.log = slog.New(slog.NewTextHandler(tlog{t}, &slog.HandlerOptions{Level: slog.LevelDebug}))
	f.startAgent(nil)
	t.Cleanup(func() {
		f.rec.mu.Lock()
		defer f.rec.mu.Unlock()
		if f.rec.withoutUID > 0 {
			t.Errorf("%d annotations asked for without the pod's UID", f.rec.withoutUID)
		}
	})
	return f
}

// startAgent builds a pipeline and its ZDS server on f's pieces, as the
// agent does at start: restore, when given, runs before ztunnel is served.
func (f *fixture) startAgent(restore func()) {
	t := f.t
	var srv *zds.Server
	f.p = enroll.New(enroll.Config{
		Rules:       nftRules{redirect.NewEngine(redirect.NewNFTables())},
		VariantOf:   f.variantOf,
		Probes:      f.probes,
		Ztunnel:     ztunnelRef{s: &srv, failDel: &f.failDel, failAdd: &f.failAdd},
		Pods:        f.cache,
		Finder:      f.finder,
		Annotations: f.rec,
		Records:     f.records,
		Events:      f.rec,
		Observer:    f.rec,
		Logger:      f.log,
		Listeners:   f.listenersOrDefault(),
		Acks:        ztunnelRef{s: &srv},
		Conditions:  f.conds,
		VerifySoon:  func() { f.verifySoon.Add(1) },
		Presence:    func() enroll.ZtunnelPresence { return enroll.ZtunnelPresence(f.zt.Load()) },
		Generation:  redirect.Generation,
	})
	t.Cleanup(f.p.Close)
	srv, err := zds.NewServer(zds.Config{SocketPath: f.sock, Source: f.p, Logger: f.log})
	if err != nil {
		t.Fatal(err)
	}
	f.srv = srv
	if restore != nil {
		restore()
	}
	if err := srv.Listen(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { srv.Serve(ctx); close(done) }()
	f.stopServer = func() { cancel(); <-done }
	t.Cleanup(f.stopServer)
}

// ztunnelRef lets the pipeline be built before the server that reads it.
type ztunnelRef struct {
	s       **zds.Server
	failDel *atomic.Bool
	failAdd *atomic.Pointer[error]
}

func (z ztunnelRef) Add(ctx context.Context, w zds.Workload) error {
	if z.failAdd != nil {
		if err := z.failAdd.Load(); err != nil {
			return *err
		}
	}
	return (*z.s).Add(ctx, w)
}
func (z ztunnelRef) Acked(uid string) bool { return (*z.s).Acked(uid) }
func (z ztunnelRef) Settled() bool         { return (*z.s).Settled() }

func (z ztunnelRef) Del(ctx context.Context, uid string) error {
	if z.failDel != nil && z.failDel.Load() {
		return zds.ErrAckTimeout
	}
	return (*z.s).Del(ctx, uid)
}

type tlog struct{ t testing.TB }

func (w tlog) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimSpace(string(p)))
	return len(p), nil
}

// standin connects a ztunnel stand-in, waits for its snapshot, and stops it
// at cleanup (or earlier through the returned func).
func (f *fixture) standin(cfg ztunnel.Config) (*ztunnel.Standin, func()) {
	f.t.Helper()
	cfg.SocketPath = f.sock
	z, stop := ztunnel.Start(f.t, cfg)
	testkit.Eventually(f.t, waitFor, "the stand-in's snapshot", z.SnapshotDone)
	return z, stop
}

// sandbox is a pod's netns with an address, as a primary CNI leaves it.
type sandbox struct {
	*netnstest.NetNS
	ip netip.Addr
}

var nextIP = netip.MustParseAddr("198.51.100.10")

func (f *fixture) sandbox() sandbox {
	f.t.Helper()
	ns := netnstest.New(f.t)
	ip := nextIP
	nextIP = nextIP.Next()
	ns.Exec(f.t, "ip", "addr", "add", ip.String()+"/32", "dev", "lo")
	return sandbox{ns, ip}
}

// pod declares a pod in the cache.
func (f *fixture) pod(namespace, name string, labels map[string]string) *corev1.Pod {
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: namespace, Name: name, UID: uuid.NewUUID(), Labels: labels}}
	f.cache.mu.Lock()
	f.cache.pods[namespace+"/"+name] = pod
	f.cache.mu.Unlock()
	return pod
}

func (f *fixture) running(pod *corev1.Pod, sb sandbox) *corev1.Pod {
	p := pod.DeepCopy()
	p.Status.Phase = corev1.PodRunning
	p.Status.PodIP, p.Status.PodIPs = sb.ip.String(), []corev1.PodIP{{IP: sb.ip.String()}}
	f.cache.mu.Lock()
	f.cache.pods[p.Namespace+"/"+p.Name] = p
	f.cache.mu.Unlock()
	return p
}

// recreated is the status the kubelet posts once it has set up a new
// sandbox for the pod: its PodReadyToStartContainers condition turned True
// again (the API keeps seconds, hence a second ahead).
func (f *fixture) recreated(pod *corev1.Pod, sb sandbox) *corev1.Pod {
	p := f.running(pod, sb)
	p.Status.Conditions = []corev1.PodCondition{{Type: corev1.PodReadyToStartContainers, Status: corev1.ConditionTrue,
		LastTransitionTime: metav1.NewTime(time.Now().Add(time.Second))}}
	return p
}

// countingFinder is the real procfs finder, counted.
type countingFinder struct {
	podnetns.Finder
	calls atomic.Int32
}

func (c *countingFinder) Find(uid string, ips []netip.Addr) (*os.File, error) {
	c.calls.Add(1)
	return c.Finder.Find(uid, ips)
}

func request(cmd cnievent.Command, pod *corev1.Pod, sb sandbox, containerID string) *cnievent.Request {
	r := &cnievent.Request{Command: cmd, PodNamespace: pod.Namespace, PodName: pod.Name, PodUID: string(pod.UID),
		ContainerID: containerID, IfName: "eth0"}
	if sb.NetNS != nil {
		r.Netns = sb.Path
		r.IPs = []string{sb.ip.String()}
	}
	return r
}

func (f *fixture) add(pod *corev1.Pod, sb sandbox, containerID string) (cnievent.Outcome, error) {
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	return f.p.Add(ctx, request(cnievent.Add, pod, sb, containerID))
}

func hasRules(t *testing.T, sb sandbox) bool {
	t.Helper()
	return strings.Contains(sb.Exec(t, "nft", "list", "ruleset"), "table inet inpod")
}

func identity(t *testing.T, sb sandbox) netns.Identity {
	t.Helper()
	id, err := netns.IdentityOfPath(sb.Path)
	if err != nil {
		t.Fatal(err)
	}
	return id
}

// inZtunnel reports the netns the stand-in runs the pod in.
func inZtunnel(z *ztunnel.Standin, pod *corev1.Pod) (netns.Identity, bool) {
	w, ok := z.Workloads()[string(pod.UID)]
	return w.NetNS, ok
}

// Invariant 1 (docs/design/invariants.md): an ADD whose pod leaves the
// decision to its namespace, while that namespace cannot be known, fails
// closed (the runtime retries) rather than answering "not enrolled"; a pod
// whose own labels decide needs no namespace.
func TestAddFailsClosedWhileThePodsNamespaceIsUnknown(t *testing.T) {
	f := newFixture(t)
	z, _ := f.standin(ztunnel.Config{})
	f.cache.loseNamespaces(errors.New("namespace watch not synced and the API server unreachable"))

	pod, sb := f.pod("mesh", "by-namespace", nil), f.sandbox()
	out, err := f.add(pod, sb, "c1")
	if out != cnievent.Failed || err == nil {
		t.Fatalf("ADD with the namespace unknown = %q, %v; want failed (never not-enrolled)", out, err)
	}
	if hasRules(t, sb) || f.p.IsEnrolled(pod.UID) {
		t.Fatal("a pod that could not be decided got rules or a table entry")
	}
	if got := f.rec.reasons(); len(got) != 1 || got[0] != "NamespaceUnknown" {
		t.Fatalf("events %v, want one NamespaceUnknown", got)
	}

	// The pod's own label decides without its namespace, either way.
	own, ownSB := f.pod("mesh", "own-label", map[string]string{enrollment.DataplaneModeLabel: enrollment.DataplaneAmbient}), f.sandbox()
	if out, err := f.add(own, ownSB, "c2"); out != cnievent.Redirected {
		t.Fatalf("ADD of a pod labelled ambient = %q, %v; want redirected", out, err)
	}
	if _, ok := inZtunnel(z, own); !ok || !hasRules(t, ownSB) {
		t.Fatal("the pod labelled ambient was answered redirected without rules and ztunnel")
	}
	optOut, optSB := f.pod("mesh", "opted-out", map[string]string{enrollment.DataplaneModeLabel: enrollment.DataplaneNone}), f.sandbox()
	if out, err := f.add(optOut, optSB, "c3"); out != cnievent.NotEnrolled || err != nil {
		t.Fatalf("ADD of a pod labelled none = %q, %v; want not-enrolled", out, err)
	}

	// Once the namespace is known again, the pod enrolls.
	f.cache.loseNamespaces(nil)
	if out, err := f.add(pod, sb, "c1"); out != cnievent.Redirected {
		t.Fatalf("ADD with the namespace known = %q, %v", out, err)
	}
}

// Invariant 1 (docs/design/invariants.md) for reconcile: a namespace missing
// from the cache never unenrolls a running pod.
func TestReconcileKeepsAPodWhoseNamespaceIsUnknown(t *testing.T) {
	f := newFixture(t)
	z, _ := f.standin(ztunnel.Config{})
	pod, sb := f.pod("mesh", "a", nil), f.sandbox()
	if out, err := f.add(pod, sb, "c1"); out != cnievent.Redirected {
		t.Fatalf("ADD = %q, %v", out, err)
	}
	f.cache.loseNamespaces(errors.New("not in the cache, API unreachable"))
	if err := f.p.Reconcile(context.Background(), f.running(pod, sb)); err == nil {
		t.Fatal("Reconcile with the namespace unknown reported success; it must retry")
	}
	if !f.p.IsEnrolled(pod.UID) || !hasRules(t, sb) {
		t.Fatal("Reconcile unenrolled a running pod because its namespace was missing")
	}
	if _, ok := inZtunnel(z, pod); !ok {
		t.Fatal("ztunnel was told to drop the pod")
	}
}

// Invariant 2 (docs/design/invariants.md): a ztunnel that connects while an
// Add is in flight to another (a ztunnel upgrade: the old one is slow to ack)
// gets the pod in its snapshot, so it serves the pod once the old one exits.
func TestZtunnelConnectingDuringAnAddGetsThePodInItsSnapshot(t *testing.T) {
	f := newFixture(t)
	old, stopOld := f.standin(ztunnel.Config{AckDelay: 2 * time.Second})
	pod, sb := f.pod("mesh", "in-flight", nil), f.sandbox()
	type result struct {
		out cnievent.Outcome
		err error
	}
	res := make(chan result, 1)
	go func() { out, err := f.add(pod, sb, "c1"); res <- result{out, err} }()
	testkit.Eventually(t, waitFor, "the Add at the old ztunnel", func() bool { _, ok := inZtunnel(old, pod); return ok })

	upgraded, _ := f.standin(ztunnel.Config{})
	if id, ok := inZtunnel(upgraded, pod); !ok || id != identity(t, sb) {
		t.Fatalf("the ztunnel that connected during the Add has the pod: %v (netns %v); want it with the pod's netns %v", ok, id, identity(t, sb))
	}
	if r := <-res; r.out != cnievent.Redirected {
		t.Fatalf("ADD = %q, %v", r.out, r.err)
	}
	stopOld()
	if _, ok := inZtunnel(upgraded, pod); !ok || !hasRules(t, sb) {
		t.Fatal("after the old ztunnel left, nobody serves the pod")
	}
}

// Invariant 2 (docs/design/invariants.md), the other half: a start that is
// rolled back takes the pod out of the table again, and a ztunnel that got it
// in a snapshot meanwhile is told to drop it.
func TestRolledBackAddLeavesNoTraceInLaterSnapshots(t *testing.T) {
	f := newFixture(t)
	var received atomic.Bool
	f.standin(ztunnel.Config{AckDelay: 2 * time.Second, Reject: func(string) string {
		received.Store(true)
		return "no proxy for you"
	}})
	pod, sb := f.pod("mesh", "rejected", nil), f.sandbox()
	res := make(chan cnievent.Outcome, 1)
	go func() { out, _ := f.add(pod, sb, "c1"); res <- out }()
	testkit.Eventually(t, waitFor, "the Add at the old ztunnel", received.Load)
	meanwhile, _ := f.standin(ztunnel.Config{})
	if _, ok := inZtunnel(meanwhile, pod); !ok {
		t.Fatal("the snapshot sent during the Add lacks the pod")
	}
	if out := <-res; out != cnievent.Failed {
		t.Fatalf("ADD rejected by ztunnel = %q, want failed", out)
	}
	if f.p.IsEnrolled(pod.UID) || hasRules(t, sb) {
		t.Fatal("a rolled-back start left a table entry or rules")
	}
	testkit.Eventually(t, waitFor, "the rolled-back pod withdrawn from the ztunnel that got it in its snapshot", func() bool {
		_, ok := inZtunnel(meanwhile, pod)
		return !ok
	})
	later, _ := f.standin(ztunnel.Config{})
	if _, ok := inZtunnel(later, pod); ok {
		t.Fatal("a later snapshot names the rolled-back pod")
	}
}

// Every rollback branch of a sandbox's start: what it wrote is taken out
// again (rules, table entry, probe exemption), what was there before stays,
// and a failure event names the reason.
func TestFailedStartRollsBackEachStep(t *testing.T) {
	f := newFixture(t)

	// No ztunnel connected: the rules written are removed.
	pod, sb := f.pod("mesh", "no-ztunnel", nil), f.sandbox()
	if out, _ := f.add(pod, sb, "c1"); out != cnievent.Failed {
		t.Fatalf("ADD without ztunnel = %q", out)
	}
	if hasRules(t, sb) || f.p.IsEnrolled(pod.UID) {
		t.Fatal("a start without ztunnel left rules or a table entry")
	}

	var rejecting atomic.Bool
	z, _ := f.standin(ztunnel.Config{Reject: func(string) string {
		if rejecting.Load() {
			return "injected: proxy start failed"
		}
		return ""
	}})

	// The netns is gone before the ADD reaches the agent.
	gone := f.pod("mesh", "gone", nil)
	if out, _ := f.p.Add(context.Background(), &cnievent.Request{Command: cnievent.Add, PodNamespace: "mesh", PodName: "gone",
		PodUID: string(gone.UID), ContainerID: "c2", Netns: "/var/run/netns/inpodtest-does-not-exist"}); out != cnievent.Failed {
		t.Fatalf("ADD with a missing netns = %q", out)
	}

	// The probe exemption fails after the rules were written.
	noProbe, noProbeSB := f.pod("mesh", "no-probe", nil), f.sandbox()
	f.probes.failAdd.Store(true)
	if out, _ := f.add(noProbe, noProbeSB, "c3"); out != cnievent.Failed {
		t.Fatalf("ADD with the probe exemption failing = %q", out)
	}
	f.probes.failAdd.Store(false)
	if hasRules(t, noProbeSB) || f.p.IsEnrolled(noProbe.UID) {
		t.Fatal("a start whose probe exemption failed left rules or a table entry")
	}
	if _, ok := inZtunnel(z, noProbe); ok {
		t.Fatal("ztunnel got a pod whose start had already failed")
	}

	// A recreated sandbox whose start fails: the pod stays enrolled with
	// the sandbox it had, in the table and in ztunnel; the new sandbox
	// keeps no rules.
	live, liveSB := f.pod("mesh", "recreated", nil), f.sandbox()
	if out, err := f.add(live, liveSB, "c4"); out != cnievent.Redirected {
		t.Fatalf("ADD = %q, %v", out, err)
	}
	next := f.sandbox()
	rejecting.Store(true)
	if out, _ := f.add(live, next, "c5"); out != cnievent.Failed {
		t.Fatalf("ADD of the recreated sandbox, rejected by ztunnel = %q", out)
	}
	if hasRules(t, next) || !hasRules(t, liveSB) {
		t.Fatalf("rules after the failed re-enrollment: new sandbox %v (want none), old %v (want kept)", hasRules(t, next), hasRules(t, liveSB))
	}
	// The same sandbox's ADD retried and failing: its rules stay (they
	// belong to the enrollment that succeeded), and so does the pod.
	if out, _ := f.add(live, liveSB, "c4"); out != cnievent.Failed {
		t.Fatalf("retried ADD rejected by ztunnel = %q", out)
	}
	rejecting.Store(false)
	if !hasRules(t, liveSB) || !f.p.IsEnrolled(live.UID) {
		t.Fatal("a failed retry of the enrolled sandbox's ADD undid its enrollment")
	}
	later, _ := f.standin(ztunnel.Config{})
	if id, ok := inZtunnel(later, live); !ok || id != identity(t, liveSB) {
		t.Fatalf("a later snapshot has the pod %v with netns %v; want the enrolled sandbox's %v", ok, id, identity(t, liveSB))
	}
	want := []string{"ZtunnelNotConnected", "NetnsUnavailable", "ProbeExemptionFailed", "ZtunnelRejected", "ZtunnelRejected"}
	if got := f.rec.reasons(); !slices.Equal(got, want) {
		t.Fatalf("events %v, want %v", got, want)
	}
}

// probes fails Add on demand (fault injection) and otherwise uses the real
// set.
type probes struct {
	*redirect.HostProbes
	failAdd atomic.Bool
}

func (p *probes) Add(ip netip.Addr) error {
	if p.failAdd.Load() {
		return errors.New("injected: probe set unavailable")
	}
	return p.HostProbes.Add(ip)
}

// Invariant 6 (docs/design/invariants.md): a DEL acts only on the sandbox it
// names. A DEL for another container ID (an older sandbox's, retried by the
// runtime after the netns is gone) leaves the live sandbox enrolled, whatever
// its netns path says.
func TestStaleDELLeavesTheLiveSandboxEnrolled(t *testing.T) {
	f := newFixture(t)
	z, _ := f.standin(ztunnel.Config{})
	pod, sb := f.pod("mesh", "a", nil), f.sandbox()
	if out, err := f.add(pod, sb, "sandbox-2"); out != cnievent.Redirected {
		t.Fatalf("ADD = %q, %v", out, err)
	}
	for _, netnsPath := range []string{"", "/var/run/netns/inpodtest-gone-long-ago"} {
		req := request(cnievent.Del, pod, sandbox{}, "sandbox-1")
		req.Netns = netnsPath
		if out, err := f.p.Del(context.Background(), req); out != cnievent.NotEnrolled || err != nil {
			t.Fatalf("stale DEL (netns %q) = %q, %v; want not-enrolled", netnsPath, out, err)
		}
		if !hasRules(t, sb) || !f.p.IsEnrolled(pod.UID) {
			t.Fatalf("a stale DEL with netns %q took the live sandbox out of the mesh", netnsPath)
		}
		if _, ok := inZtunnel(z, pod); !ok {
			t.Fatalf("a stale DEL with netns %q made ztunnel drop the live sandbox", netnsPath)
		}
	}
	// The live sandbox's own DEL acts, even with its netns already gone.
	if out, err := f.p.Del(context.Background(), request(cnievent.Del, pod, sandbox{}, "sandbox-2")); out != cnievent.Redirected {
		t.Fatalf("DEL of the enrolled sandbox = %q, %v", out, err)
	}
	if hasRules(t, sb) || f.p.IsEnrolled(pod.UID) {
		t.Fatal("the enrolled sandbox's DEL left it enrolled")
	}
	testkit.Eventually(t, waitFor, "ztunnel told", func() bool { _, ok := inZtunnel(z, pod); return !ok })
}

// A pod enrolled through procfs has no known container ID: a DEL acts only
// when its netns path is the held netns; a CHECK whose netns is the held one
// teaches the container ID.
func TestDELOfAPodEnrolledThroughProcfsNeedsItsNetns(t *testing.T) {
	f := newFixture(t)
	f.standin(ztunnel.Config{})
	pod, sb := f.pod("mesh", "restored", nil), f.sandbox()
	sb.RunAsPod(t, string(pod.UID))
	if err := f.p.Reconcile(context.Background(), f.running(pod, sb)); err != nil {
		t.Fatal(err)
	}
	if !f.p.IsEnrolled(pod.UID) || !hasRules(t, sb) {
		t.Fatal("the running pod was not enrolled through procfs")
	}
	if out, _ := f.p.Del(context.Background(), request(cnievent.Del, pod, sandbox{}, "whatever")); out != cnievent.NotEnrolled || !f.p.IsEnrolled(pod.UID) {
		t.Fatalf("a DEL without a netns for a pod of unknown container ID = %q; want it ignored", out)
	}
	if out, err := f.p.Check(context.Background(), request(cnievent.Check, pod, sb, "sandbox-9")); out != cnievent.Redirected {
		t.Fatalf("CHECK = %q, %v", out, err)
	}
	if out, _ := f.p.Del(context.Background(), request(cnievent.Del, pod, sb, "sandbox-8")); out != cnievent.NotEnrolled || !f.p.IsEnrolled(pod.UID) {
		t.Fatalf("a DEL for another container ID after the CHECK taught sandbox-9 = %q; want it ignored", out)
	}
	if out, _ := f.p.Del(context.Background(), request(cnievent.Del, pod, sandbox{}, "sandbox-9")); out != cnievent.Redirected || f.p.IsEnrolled(pod.UID) {
		t.Fatalf("the DEL of the learnt container ID = %q; want the pod removed", out)
	}
}

// Invariant 6 (docs/design/invariants.md): a sandbox recreated while inpod was
// missing from the CNI chain (no ADD reached the agent) is found by reconcile
// and redirected: rules in the new netns, ztunnel moved to it, an event on the
// pod. The old sandbox's DEL, arriving later, does not undo it.
func TestReconcileRedirectsASandboxRecreatedWithoutItsADD(t *testing.T) {
	f := newFixture(t)
	z, _ := f.standin(ztunnel.Config{})
	pod, first := f.pod("mesh", "recreated", nil), f.sandbox()
	if out, err := f.add(pod, first, "sandbox-1"); out != cnievent.Redirected {
		t.Fatalf("ADD = %q, %v", out, err)
	}
	// The new sandbox has the same IP (the IPAM gave it back), and the
	// pod's processes live there now; the kubelet's status did not change.
	second := sandbox{netnstest.New(t), first.ip}
	second.Exec(t, "ip", "addr", "add", first.ip.String()+"/32", "dev", "lo")
	second.RunAsPod(t, string(pod.UID))

	if err := f.p.Reconcile(context.Background(), f.recreated(pod, first)); err != nil {
		t.Fatal(err)
	}
	if !hasRules(t, second) {
		t.Fatal("the recreated sandbox runs unredirected after reconcile")
	}
	if id, ok := inZtunnel(z, pod); !ok || id != identity(t, second) {
		t.Fatalf("ztunnel runs the pod in netns %v (%v); want the new sandbox's %v", id, ok, identity(t, second))
	}
	if got := f.rec.reasons(); !slices.Contains(got, "SandboxChanged") {
		t.Fatalf("events %v, want a SandboxChanged warning", got)
	}
	later, _ := f.standin(ztunnel.Config{})
	if id, _ := inZtunnel(later, pod); id != identity(t, second) {
		t.Fatalf("a later snapshot sends netns %v; want the new sandbox's %v", id, identity(t, second))
	}
	// The old sandbox's DEL, its netns gone.
	if out, _ := f.p.Del(context.Background(), request(cnievent.Del, pod, sandbox{}, "sandbox-1")); out != cnievent.NotEnrolled || !hasRules(t, second) {
		t.Fatalf("the old sandbox's DEL = %q and took the new sandbox's rules: %v", out, !hasRules(t, second))
	}
	// Reconciling again changes nothing.
	before := second.Exec(t, "nft", "-a", "list", "ruleset")
	if err := f.p.Reconcile(context.Background(), f.running(pod, first)); err != nil {
		t.Fatal(err)
	}
	if after := second.Exec(t, "nft", "-a", "list", "ruleset"); after != before {
		t.Fatal("a second reconcile rewrote the rules")
	}
}

// nftRules is the agent's rule engine as the pipeline sees it: the real
// nftables backend, in the pod's variant.
type nftRules struct{ *redirect.Engine }

func (r nftRules) Apply(ns *os.File, v enroll.Variant) (bool, error) {
	res, err := r.Engine.Apply(ns, redirect.Options{DNSCapture: v.DNSCapture, NoInboundCapture: v.NoInboundCapture})
	return res.Changed, err
}

// A start that fails after the probe exemption was added takes the
// exemption out again: left behind, it would SNAT the node's probes to the
// next pod the IPAM gives that IP, which may be outside the mesh.
func TestFailedStartLeavesNoProbeExemption(t *testing.T) {
	f := newFixture(t)
	pod, sb := f.pod("mesh", "no-ztunnel", nil), f.sandbox()
	if out, _ := f.add(pod, sb, "c1"); out != cnievent.Failed {
		t.Fatalf("ADD without ztunnel = %q", out)
	}
	members, err := f.probes.Members()
	if err != nil {
		t.Fatal(err)
	}
	if slices.Contains(members, sb.ip) {
		t.Fatalf("the probe set still exempts %s after its pod's start failed: %v", sb.ip, members)
	}
}

// A pod being deleted still runs (preStop hooks, draining connections): a
// deletion timestamp alone must not take it out of the mesh; its sandbox's
// DEL, its end, or its removal from the API does.
func TestTerminatingPodStaysRedirected(t *testing.T) {
	f := newFixture(t)
	z, _ := f.standin(ztunnel.Config{})
	pod, sb := f.pod("mesh", "draining", nil), f.sandbox()
	if out, err := f.add(pod, sb, "c1"); out != cnievent.Redirected {
		t.Fatalf("ADD = %q, %v", out, err)
	}
	terminating := f.running(pod, sb)
	now := metav1.Now()
	terminating.DeletionTimestamp = &now
	if err := f.p.Reconcile(context.Background(), terminating); err != nil {
		t.Fatal(err)
	}
	if !hasRules(t, sb) || !f.p.IsEnrolled(pod.UID) {
		t.Fatalf("a terminating pod lost its redirection: rules %v, enrolled %v", hasRules(t, sb), f.p.IsEnrolled(pod.UID))
	}
	if _, ok := inZtunnel(z, pod); !ok {
		t.Fatal("ztunnel was told to drop a pod that still runs")
	}
	finished := terminating.DeepCopy()
	finished.Status.Phase = corev1.PodSucceeded
	if err := f.p.Reconcile(context.Background(), finished); err != nil {
		t.Fatal(err)
	}
	if f.p.IsEnrolled(pod.UID) {
		t.Fatal("a finished pod is still enrolled")
	}
}

// A static pod's recreated sandbox is found by the static pod's UID (its
// cgroup's), not by its mirror pod's API UID.
func TestReconcileRedirectsARecreatedStaticPodSandbox(t *testing.T) {
	f := newFixture(t)
	z, _ := f.standin(ztunnel.Config{})
	const hash = "6f1c0ffee6f1c0ffee6f1c0ffee00003"
	pod := mirror("mesh", "static-web", "0b5e1c2a-3333-4c3d-9e8f-000000000003", hash)
	f.cache.mu.Lock()
	f.cache.pods["mesh/static-web"] = pod
	f.cache.mu.Unlock()
	first := f.sandbox()
	if out, err := f.p.Add(context.Background(), &cnievent.Request{Command: cnievent.Add, PodNamespace: "mesh", PodName: "static-web",
		PodUID: hash, ContainerID: "s1", Netns: first.Path, IPs: []string{first.ip.String()}}); out != cnievent.Redirected {
		t.Fatalf("ADD = %q, %v", out, err)
	}
	second := sandbox{netnstest.New(t), first.ip}
	second.Exec(t, "ip", "addr", "add", first.ip.String()+"/32", "dev", "lo")
	second.RunAsPod(t, hash)
	if err := f.p.Reconcile(context.Background(), f.recreated(pod, first)); err != nil {
		t.Fatal(err)
	}
	if !hasRules(t, second) {
		t.Fatal("the static pod's recreated sandbox runs unredirected after reconcile")
	}
	if id, ok := inZtunnel(z, pod); !ok || id != identity(t, second) {
		t.Fatalf("ztunnel runs the static pod in netns %v (%v); want the new sandbox's %v", id, ok, identity(t, second))
	}
}

// A pod's updates (status, annotations) reconcile it many times while it
// starts; only a sign in its status that the sandbox changed, or a check
// gone stale, costs a procfs scan.
func TestReconcileScansProcfsOnlyWhenTheSandboxMayHaveChanged(t *testing.T) {
	f := newFixture(t)
	f.standin(ztunnel.Config{})
	pod, sb := f.pod("mesh", "steady", nil), f.sandbox()
	if out, err := f.add(pod, sb, "c1"); out != cnievent.Redirected {
		t.Fatalf("ADD = %q, %v", out, err)
	}
	for range 5 {
		if err := f.p.Reconcile(context.Background(), f.running(pod, sb)); err != nil {
			t.Fatal(err)
		}
	}
	if n := f.finder.calls.Load(); n != 0 {
		t.Fatalf("%d procfs scans for updates that say nothing about the sandbox, want 0", n)
	}
	if err := f.p.Reconcile(context.Background(), f.recreated(pod, sb)); err != nil {
		t.Fatal(err)
	}
	if n := f.finder.calls.Load(); n != 1 {
		t.Fatalf("%d procfs scans after the kubelet reported a new sandbox, want 1", n)
	}
}

// drainingRelabelledOut is pod as the API shows it terminating in sb, and
// the same pod with its label taking it out of the mesh.
func (f *fixture) drainingRelabelledOut(pod *corev1.Pod, sb sandbox) (terminating, out *corev1.Pod) {
	now := metav1.Now()
	terminating = f.running(pod, sb)
	terminating.DeletionTimestamp = &now
	out = terminating.DeepCopy()
	out.Labels = map[string]string{enrollment.DataplaneModeLabel: enrollment.DataplaneNone}
	return terminating, out
}

// A pod that a label change took out of the mesh while it drained, and
// that is labelled back before it ends, still runs in its sandbox: it is
// redirected again. Its sandbox's DEL ends that (nothing left to redirect).
func TestTerminatingPodRelabelledBackIsRedirectedAgain(t *testing.T) {
	f := newFixture(t)
	z, _ := f.standin(ztunnel.Config{})
	pod, sb := f.pod("mesh", "draining", nil), f.sandbox()
	sb.RunAsPod(t, string(pod.UID))
	if out, err := f.add(pod, sb, "c1"); out != cnievent.Redirected {
		t.Fatalf("ADD = %q, %v", out, err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	terminating, out := f.drainingRelabelledOut(pod, sb)
	if err := f.p.Reconcile(ctx, out); err != nil {
		t.Fatal(err)
	}
	if f.p.IsEnrolled(pod.UID) || hasRules(t, sb) {
		t.Fatal("a terminating pod labelled out of the mesh stayed in it")
	}
	if err := f.p.Reconcile(ctx, terminating); err != nil {
		t.Fatal(err)
	}
	if !f.p.IsEnrolled(pod.UID) || !hasRules(t, sb) {
		t.Fatal("a terminating pod labelled back into the mesh while its sandbox runs was not redirected again")
	}
	testkit.Eventually(t, waitFor, "ztunnel told again", func() bool { id, ok := inZtunnel(z, pod); return ok && id == identity(t, sb) })

	// Out again, then its sandbox's DEL: labelled back now, nothing is
	// searched for.
	if err := f.p.Reconcile(ctx, out); err != nil {
		t.Fatal(err)
	}
	if out, err := f.p.Del(ctx, request(cnievent.Del, pod, sb, "c1")); err != nil {
		t.Fatalf("DEL = %q, %v", out, err)
	}
	before := f.finder.calls.Load()
	if err := f.p.Reconcile(ctx, terminating); err != nil || f.p.IsEnrolled(pod.UID) || f.finder.calls.Load() != before {
		t.Fatalf("after its DEL: reconcile %v, enrolled %v, netns searched %d times", err, f.p.IsEnrolled(pod.UID), f.finder.calls.Load()-before)
	}

	// A DEL that came before the label change (here one the table did not
	// act on, naming another container) also ends it: no search.
	other, osb := f.pod("mesh", "draining-2", nil), f.sandbox()
	if out, err := f.add(other, osb, "c2"); out != cnievent.Redirected {
		t.Fatalf("ADD = %q, %v", out, err)
	}
	if out, err := f.p.Del(ctx, request(cnievent.Del, other, osb, "c-older")); err != nil || !f.p.IsEnrolled(other.UID) {
		t.Fatalf("DEL of another container = %q, %v; enrolled %v", out, err, f.p.IsEnrolled(other.UID))
	}
	otherTerminating, otherOut := f.drainingRelabelledOut(other, osb)
	if err := f.p.Reconcile(ctx, otherOut); err != nil {
		t.Fatal(err)
	}
	before = f.finder.calls.Load()
	if err := f.p.Reconcile(ctx, otherTerminating); err != nil || f.p.IsEnrolled(other.UID) || f.finder.calls.Load() != before {
		t.Fatalf("labelled back after a DEL: reconcile %v, enrolled %v, netns searched %d times", err, f.p.IsEnrolled(other.UID), f.finder.calls.Load()-before)
	}
}

// A pod being deleted whose sandbox's DEL has come is done with: the
// kubelet gives a terminating pod no new sandbox, so there is nothing to
// redirect. Its later status updates (still Running, IPs still listed
// until the kubelet reports the end) must not send the agent looking for
// a netns again: on the real node under load every deleted enrolled pod
// got ~14 NetnsNotFound failures and Warning events that way.
func TestTerminatingPodAfterItsDELIsNotEnrolledAgain(t *testing.T) {
	f := newFixture(t)
	f.standin(ztunnel.Config{})
	pod, sb := f.pod("mesh", "leaving", nil), f.sandbox()
	if out, err := f.add(pod, sb, "c1"); out != cnievent.Redirected {
		t.Fatalf("ADD = %q, %v", out, err)
	}
	terminating := f.running(pod, sb)
	now := metav1.Now()
	terminating.DeletionTimestamp = &now
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	if out, err := f.p.Del(ctx, request(cnievent.Del, pod, sb, "c1")); err != nil {
		t.Fatalf("DEL = %q, %v", out, err)
	}
	before := f.finder.calls.Load()
	if err := f.p.Reconcile(ctx, terminating); err != nil {
		t.Fatalf("reconciling the terminating pod after its DEL: %v", err)
	}
	if f.p.IsEnrolled(pod.UID) || f.finder.calls.Load() != before {
		t.Fatalf("a terminating pod after its DEL: enrolled %v, netns searched %d times", f.p.IsEnrolled(pod.UID), f.finder.calls.Load()-before)
	}
	if got := f.rec.reasons(); slices.Contains(got, "NetnsNotFound") {
		t.Fatalf("events %v: a pod being deleted reported as failing", got)
	}
}

// An ADD whose runtime names no pod UID (one that does not pass
// K8S_POD_UID) is for the pod the API has under that name now, not for a
// replaced one the cache still holds: enrolled under the old pod's UID, the
// sandbox would reach ztunnel as the wrong workload, and the old pod's
// removal would later take the rules out of the new pod while it runs.
func TestAddWithoutAPodUIDIsForThePodTheAPIHasNow(t *testing.T) {
	f := newFixture(t)
	z, _ := f.standin(ztunnel.Config{})
	withoutUID := func(pod *corev1.Pod, sb sandbox) (cnievent.Outcome, error) {
		return f.withoutUID(cnievent.Add, pod, sb, "sandbox-"+pod.Name)
	}

	old, sb := f.pod("mesh", "web-0", nil), f.sandbox()
	now := f.replacedInAPI(old, "")
	if out, err := withoutUID(old, sb); out != cnievent.Redirected {
		t.Fatalf("ADD = %q, %v", out, err)
	}
	if _, ok := inZtunnel(z, old); ok || f.p.IsEnrolled(old.UID) {
		t.Fatal("the sandbox was enrolled under the replaced pod's UID, the one the cache still held")
	}
	if id, ok := inZtunnel(z, now); !ok || id != identity(t, sb) || !f.p.IsEnrolled(now.UID) {
		t.Fatal("the sandbox was not enrolled as the pod the API has under its name")
	}

	// Gone from the API, or the name now a pod of another node's: this
	// sandbox's pod is gone, and the runtime is told so.
	gone, sbGone := f.pod("mesh", "web-1", nil), f.sandbox()
	f.cache.mu.Lock()
	f.cache.api["mesh/web-1"] = nil
	f.cache.mu.Unlock()
	elsewhere, sbElsewhere := f.pod("mesh", "web-2", nil), f.sandbox()
	f.replacedInAPI(elsewhere, "another-node")
	for _, c := range []struct {
		pod *corev1.Pod
		sb  sandbox
	}{{gone, sbGone}, {elsewhere, sbElsewhere}} {
		if out, err := withoutUID(c.pod, c.sb); out != cnievent.Failed || err == nil {
			t.Fatalf("ADD for %s, whose pod is gone = %q, %v; want it failed", c.pod.Name, out, err)
		}
		if hasRules(t, c.sb) {
			t.Fatalf("the sandbox of %s, whose pod is gone, got rules", c.pod.Name)
		}
	}

	// With the API unreachable the cache stands, as it did before the API
	// was asked: an enrolled pod is redirected, not held back.
	down, sbDown := f.pod("mesh", "web-3", nil), f.sandbox()
	f.cache.mu.Lock()
	f.cache.liveErr = apierrors.NewServiceUnavailable("etcd leader changed")
	f.cache.mu.Unlock()
	if out, err := withoutUID(down, sbDown); out != cnievent.Redirected || !hasRules(t, sbDown) {
		t.Fatalf("ADD with the API away = %q, %v; want the cached pod redirected", out, err)
	}
}

// withoutUID sends a request as a runtime that passes no K8S_POD_UID.
func (f *fixture) withoutUID(cmd cnievent.Command, pod *corev1.Pod, sb sandbox, containerID string) (cnievent.Outcome, error) {
	req := request(cmd, pod, sb, containerID)
	req.PodUID = ""
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	switch cmd {
	case cnievent.Add:
		return f.p.Add(ctx, req)
	case cnievent.Del:
		return f.p.Del(ctx, req)
	default:
		return f.p.Check(ctx, req)
	}
}

// replacedInAPI replaces old in the API, not yet in the cache (a watch
// that lags), with a pod of the same name bound to node.
func (f *fixture) replacedInAPI(old *corev1.Pod, node string) *corev1.Pod {
	now := old.DeepCopy()
	now.UID, now.Spec.NodeName = uuid.NewUUID(), node
	f.cache.mu.Lock()
	f.cache.api[old.Namespace+"/"+old.Name] = now
	f.cache.mu.Unlock()
	return now
}

// Without a pod UID, a DEL names its pod by name and sandbox: with a
// replaced pod and its replacement both enrolled under one name (the
// replacement's ADD came while the watch lagged), the old sandbox's DEL
// takes the old pod out, never the replacement, whichever the table
// yields first (ten pairs, so a pick by name alone fails).
func TestDELWithoutAPodUIDActsOnTheSandboxItNames(t *testing.T) {
	f := newFixture(t)
	f.standin(ztunnel.Config{})
	for i := range 10 {
		old, sbOld := f.pod("mesh", fmt.Sprintf("web-%d", i), nil), f.sandbox()
		if out, err := f.withoutUID(cnievent.Add, old, sbOld, "old"); out != cnievent.Redirected {
			t.Fatalf("ADD of %s = %q, %v", old.Name, out, err)
		}
		now, sbNow := f.replacedInAPI(old, ""), f.sandbox()
		if out, err := f.withoutUID(cnievent.Add, old, sbNow, "new"); out != cnievent.Redirected || !f.p.IsEnrolled(now.UID) {
			t.Fatalf("ADD of %s's replacement = %q, %v", old.Name, out, err)
		}
		if out, err := f.withoutUID(cnievent.Del, old, sandbox{}, "old"); out != cnievent.Redirected {
			t.Fatalf("DEL of %s's old sandbox = %q, %v", old.Name, out, err)
		}
		if f.p.IsEnrolled(old.UID) || !f.p.IsEnrolled(now.UID) || !hasRules(t, sbNow) {
			t.Fatalf("the old sandbox's DEL of %s took the replacement out (old enrolled: %v, new: %v)", old.Name, f.p.IsEnrolled(old.UID), f.p.IsEnrolled(now.UID))
		}
	}
}
