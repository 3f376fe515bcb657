package enroll_test

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/inpod-dev/inpod/agent/enroll"
	"github.com/inpod-dev/inpod/agent/redirect"
	"github.com/inpod-dev/inpod/cnievent"
	"github.com/inpod-dev/inpod/enrollment"
	"github.com/inpod-dev/inpod/internal/testkit"
	"github.com/inpod-dev/inpod/netns/netnstest"
	"github.com/inpod-dev/inpod/zds"
	ztunnel "github.com/inpod-dev/inpod/zds/zdstest"
)

// The verifier against the same real pieces as the pipeline: rules read
// back from the kernel, ztunnel's listeners read through sock_diag in the
// pod's netns, the stand-in's Acks on a real ZDS connection.

type condition struct {
	proven bool
	reason string
}

// conditions records the pod conditions asked for, in order.
type conditions struct {
	mu      sync.Mutex
	last    map[types.UID]condition
	history map[types.UID][]condition
}

func (c *conditions) Set(_ types.NamespacedName, uid types.UID, proven bool, reason, _ string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.last[uid] = condition{proven, reason}
	if c.history == nil {
		c.history = map[types.UID][]condition{}
	}
	c.history[uid] = append(c.history[uid], condition{proven, reason})
}

func (c *conditions) of(uid types.UID) (condition, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	v, ok := c.last[uid]
	return v, ok
}

// standinListeners are the ports the stand-in binds without DNS.
type standinListeners struct{}

func (standinListeners) Missing(ns *os.File, _ enroll.Variant) ([]uint16, error) {
	return redirect.Listening(ns, []uint16{ztunnel.PortOutbound, ztunnel.PortInbound, ztunnel.PortHBONE})
}

// gated gives the pod the readiness gate the admission policy adds.
func (f *fixture) gated(pod *corev1.Pod) *corev1.Pod {
	p := pod.DeepCopy()
	p.Spec.ReadinessGates = []corev1.PodReadinessGate{{ConditionType: enrollment.RedirectedCondition}}
	f.cache.mu.Lock()
	f.cache.pods[p.Namespace+"/"+p.Name] = p
	f.cache.mu.Unlock()
	return p
}

func (f *fixture) cached(key types.NamespacedName) *corev1.Pod {
	f.cache.mu.Lock()
	defer f.cache.mu.Unlock()
	return f.cache.pods[key.Namespace+"/"+key.Name]
}

func (f *fixture) verifyAll() enroll.Verification {
	f.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	return f.p.VerifyAll(ctx, f.cached)
}

// enrolledRunning starts an enrolled, gated pod through its CNI ADD.
func (f *fixture) enrolledRunning(name string) (*corev1.Pod, sandbox) {
	f.t.Helper()
	pod, sb := f.gated(f.pod("mesh", name, nil)), f.sandbox()
	if out, err := f.add(pod, sb, name+"-c1"); out != cnievent.Redirected {
		f.t.Fatalf("ADD = %q, %v", out, err)
	}
	return f.running(pod, sb), sb
}

// Tamper: the pod's netfilter tables flushed from inside its netns. The
// verifier finds the set gone, writes it again, says so in an Event, and
// the condition dips until the next verification finds the repair holding.
func TestVerifierRepairsRulesFlushedInThePod(t *testing.T) {
	f := newFixture(t)
	f.standin(ztunnel.Config{})
	pod, sb := f.enrolledRunning("tampered")
	if c, ok := f.conds.of(pod.UID); !ok || !c.proven {
		t.Fatalf("condition after the ADD = %+v (%v); want proven", c, ok)
	}
	if v := f.verifyAll(); len(v.Repaired) != 0 || len(v.Unproven) != 0 {
		t.Fatalf("an intact pod's verification = %+v; want nothing repaired", v)
	}
	sb.Exec(t, "nft", "flush", "ruleset")
	if hasRules(t, sb) {
		t.Fatal("the tamper did not take")
	}
	if v := f.verifyAll(); v.Repaired[enroll.RepairRules] != 1 {
		t.Fatalf("verification after the flush = %+v; want the rules repaired", v)
	}
	if !hasRules(t, sb) {
		t.Fatal("the rules are still gone after the verification")
	}
	if !slices.Contains(f.rec.reasons(), enroll.EventRepaired) {
		t.Fatalf("events %v; want %s", f.rec.reasons(), enroll.EventRepaired)
	}
	if c, _ := f.conds.of(pod.UID); c.proven {
		t.Fatalf("condition right after a repair = %+v; want it False until a verification finds the repair holding", c)
	}
	if f.verifySoon.Load() == 0 {
		t.Fatal("a repair asked for no verification soon")
	}
	f.verifyAll()
	if c, _ := f.conds.of(pod.UID); !c.proven || c.reason != enrollment.ReasonRedirected {
		t.Fatalf("condition after the repair held = %+v; want proven", c)
	}
}

// ztunnel forgot the pod (a Del nobody asked the agent for; its proxy
// gone): the verifier hands the pod over again and the listeners are back.
func TestVerifierHandsAPodZtunnelDroppedOverAgain(t *testing.T) {
	f := newFixture(t)
	z, _ := f.standin(ztunnel.Config{})
	pod, sb := f.enrolledRunning("dropped")
	if missing, err := (standinListeners{}).Missing(sb.Open(t), enroll.Variant{}); err != nil || len(missing) != 0 {
		t.Fatalf("listeners missing after the ADD: %v, %v", missing, err)
	}
	if err := f.srv.Del(context.Background(), string(pod.UID)); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, waitFor, "the stand-in to drop the pod", func() bool { _, ok := inZtunnel(z, pod); return !ok })
	if v := f.verifyAll(); v.Repaired[enroll.RepairZtunnel] != 1 {
		t.Fatalf("verification = %+v; want ztunnel repaired", v)
	}
	if _, ok := inZtunnel(z, pod); !ok {
		t.Fatal("ztunnel does not run the pod after the repair")
	}
	if missing, err := (standinListeners{}).Missing(sb.Open(t), enroll.Variant{}); err != nil || len(missing) != 0 {
		t.Fatalf("listeners missing after the repair: %v, %v", missing, err)
	}
}

// A ztunnel connection that ends while the verifier hands it a pod again
// (a hand-over's pause, a ztunnel restart) is no loss: the ztunnel that
// connects next gets the pod in its snapshot. No Warning, no condition
// turned False (a readiness gate would flap); the next round judges.
func TestVerifierConcludesNothingWhenZtunnelLeavesMidRepair(t *testing.T) {
	f := newFixture(t)
	z, _ := f.standin(ztunnel.Config{})
	pod, _ := f.enrolledRunning("mid-repair")
	if err := f.srv.Del(context.Background(), string(pod.UID)); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, waitFor, "the stand-in to drop the pod", func() bool { _, ok := inZtunnel(z, pod); return !ok })
	for _, closed := range []error{zds.ErrConnectionClosed, zds.ErrNoConnection} {
		f.failAdd.Store(&closed)
		if v := f.verifyAll(); len(v.Unproven) != 0 {
			t.Fatalf("%v during the repair: verification = %+v; want nothing concluded", closed, v)
		}
		if c, _ := f.conds.of(pod.UID); !c.proven {
			t.Fatalf("%v during the repair: condition %+v; want it left proven", closed, c)
		}
		if got := f.rec.reasons(); len(got) != 0 {
			t.Fatalf("%v during the repair: events %v; want none", closed, got)
		}
	}
	f.failAdd.Store(nil)
	if v := f.verifyAll(); v.Repaired[enroll.RepairZtunnel] != 1 {
		t.Fatalf("verification once ztunnel answers = %+v; want ztunnel repaired", v)
	}
}

// With no ztunnel for longer than the grace, every pod is unproven, with
// one Warning each, not one per round; back, they are proven again.
func TestVerifierReportsAPodWithoutZtunnelOnce(t *testing.T) {
	f := newFixture(t)
	_, stop := f.standin(ztunnel.Config{})
	pod, _ := f.enrolledRunning("alone")
	stop()
	f.zt.Store(int32(enroll.ZtunnelAway))
	for range 3 {
		f.verifyAll()
	}
	if c, _ := f.conds.of(pod.UID); c.proven || c.reason != "ZtunnelNotConnected" {
		t.Fatalf("condition without ztunnel = %+v", c)
	}
	if n := countOf(f.rec.reasons(), enroll.EventFailed); n != 1 {
		t.Fatalf("%d %s events over three rounds; want one", n, enroll.EventFailed)
	}
	f.standin(ztunnel.Config{})
	f.zt.Store(int32(enroll.ZtunnelReady))
	if v := f.verifyAll(); len(v.Unproven) != 0 {
		t.Fatalf("verification with ztunnel back = %+v", v)
	}
	if c, _ := f.conds.of(pod.UID); !c.proven {
		t.Fatalf("condition with ztunnel back = %+v", c)
	}
}

// Sequence 1 of issue 35: the namespace is unlabelled, the rules come out,
// ztunnel's Del fails (stalled past its Ack timeout), so the entry goes
// back; the label returns before the retry. The relabelled pod must be
// redirected again, not trusted on its stale entry.
func TestRelabelAfterAPartlyFailedRemovalRedirectsAgain(t *testing.T) {
	f := newFixture(t)
	f.standin(ztunnel.Config{})
	pod, sb := f.enrolledRunning("relabelled")
	f.failDel.Store(true)
	f.labelNamespace("mesh", false)
	if err := f.p.Reconcile(context.Background(), f.cached(types.NamespacedName{Namespace: "mesh", Name: pod.Name})); err == nil {
		t.Fatal("the removal whose Del failed reported success")
	}
	if hasRules(t, sb) {
		t.Fatal("the rules stayed in the pod taken out of the mesh (the fault is not the one under test)")
	}
	f.labelNamespace("mesh", true)
	f.failDel.Store(false)
	if err := f.p.Reconcile(context.Background(), f.cached(types.NamespacedName{Namespace: "mesh", Name: pod.Name})); err != nil {
		t.Logf("reconcile after the relabel: %v", err)
	}
	if !hasRules(t, sb) {
		t.Fatal("the relabelled pod runs without rules while its entry says enrolled")
	}
}

// Sequence 2 of issue 35: a pod held from the previous agent with IP A
// starts a new sandbox with IP B. The exemption of A must go: the next pod
// given A may be outside the mesh, and its probes would be SNATed.
func TestHeldPodsOldExemptionGoesWithItsNewSandbox(t *testing.T) {
	f := newFixture(t)
	z, _ := f.standin(ztunnel.Config{})
	pod := f.pod("mesh", "moved", nil)
	old := f.sandbox()
	// Enrolled by the previous agent: annotated, exempted; its sandbox is
	// not found now (no process of the pod holds it).
	if err := f.probes.Add(old.ip); err != nil {
		t.Fatal(err)
	}
	f.annotate(f.running(pod, old), enrollment.AnnotationEnabled)
	f.restart(z)
	if !f.exempted(old.ip) {
		t.Fatal("the held pod lost its exemption at the restart (setup)")
	}
	fresh := f.sandbox()
	if out, err := f.add(pod, fresh, "c2"); out != cnievent.Redirected {
		t.Fatalf("ADD of the new sandbox = %q, %v", out, err)
	}
	if f.exempted(old.ip) {
		t.Fatalf("the old sandbox's IP %s is still exempted after the pod moved to %s", old.ip, fresh.ip)
	}
	if !f.exempted(fresh.ip) {
		t.Fatal("the new sandbox is not exempted")
	}
}

// Sequence 3 of issue 35: a running pod enrolled by reconcile whose probe
// exemption fails after its rules went in. Left out of the table, its rules
// would stay when it leaves the mesh, black-holing a pod outside it.
func TestReconcileFailureAfterTheRulesKeepsThePodRemovable(t *testing.T) {
	f := newFixture(t)
	f.standin(ztunnel.Config{})
	pod, sb := f.pod("plain", "late", nil), f.sandbox()
	sb.RunAsPod(t, string(pod.UID))
	pod = f.running(pod, sb)
	pod.Labels = map[string]string{enrollment.DataplaneModeLabel: enrollment.DataplaneAmbient}
	f.probes.failAdd.Store(true)
	if err := f.p.Reconcile(context.Background(), pod); err == nil {
		t.Fatal("a reconcile whose probe exemption failed reported success")
	}
	f.probes.failAdd.Store(false)
	if !hasRules(t, sb) {
		t.Fatal("setup: the rules did not go in")
	}
	out := pod.DeepCopy()
	out.Labels = nil
	if err := f.p.Reconcile(context.Background(), out); err != nil {
		t.Fatal(err)
	}
	if hasRules(t, sb) {
		t.Fatal("the pod left the mesh with its rules in place: it is black-holed")
	}
}

// Sequence 4 of issue 35: a sandbox recreated with the same IP in the same
// second as the last check: the kubelet's whole-second transition time is
// before the check, yet the sandbox changed, and must be found at the next
// reconcile, not at the 5-minute sweep.
func TestSandboxRecreatedInTheSecondOfTheLastCheckIsFound(t *testing.T) {
	f := newFixture(t)
	f.standin(ztunnel.Config{})
	pod, first := f.pod("mesh", "quick", nil), f.sandbox()
	// The ADD early in a second, so its check and the recreation below
	// share that second whatever this machine's speed.
	testkit.Eventually(t, 2*time.Second, "the start of a second", func() bool { return time.Now().Nanosecond() < 100e6 })
	second0 := time.Now().Truncate(time.Second)
	if out, err := f.add(pod, first, "c1"); out != cnievent.Redirected {
		t.Fatalf("ADD = %q, %v", out, err)
	}
	// The old sandbox's DEL took its interface; the new one has the IP.
	first.Exec(t, "ip", "addr", "del", first.ip.String()+"/32", "dev", "lo")
	second := sandbox{netnstest.New(t), first.ip}
	second.Exec(t, "ip", "addr", "add", first.ip.String()+"/32", "dev", "lo")
	second.RunAsPod(t, string(pod.UID))
	status := f.running(pod, first)
	status.Status.Conditions = []corev1.PodCondition{{Type: corev1.PodReadyToStartContainers, Status: corev1.ConditionTrue,
		LastTransitionTime: metav1.NewTime(second0)}}
	if err := f.p.Reconcile(context.Background(), status); err != nil {
		t.Fatal(err)
	}
	if !hasRules(t, second) {
		t.Fatal("the sandbox recreated in the second of the last check runs unredirected")
	}
}

// A pod with the readiness gate that the mesh does not take (its namespace
// was unlabelled before it started) is let through: the gate never holds
// back a pod outside the mesh.
func TestGateOfAPodOutsideTheMeshIsReleased(t *testing.T) {
	f := newFixture(t)
	pod, sb := f.pod("plain", "outside", nil), f.sandbox()
	pod = f.gated(f.running(pod, sb))
	if err := f.p.Reconcile(context.Background(), pod); err != nil {
		t.Fatal(err)
	}
	if c, ok := f.conds.of(pod.UID); !ok || !c.proven || c.reason != enrollment.ReasonNotEnrolled {
		t.Fatalf("condition of a gated pod outside the mesh = %+v (%v); want True/%s", c, ok, enrollment.ReasonNotEnrolled)
	}
}

// The node's probe exemptions are made exactly the enrolled pods' IPs.
func TestVerifierMakesProbeExemptionsTheEnrolledIPs(t *testing.T) {
	f := newFixture(t)
	f.standin(ztunnel.Config{})
	_, sb := f.enrolledRunning("probed")
	stray := netip.MustParseAddr("198.51.100.250")
	if err := f.probes.Add(stray); err != nil {
		t.Fatal(err)
	}
	if err := f.probes.Remove(sb.ip); err != nil {
		t.Fatal(err)
	}
	if v := f.verifyAll(); v.Repaired[enroll.RepairProbes] != 2 {
		t.Fatalf("verification = %+v; want two probe exemptions repaired", v)
	}
	if f.exempted(stray) || !f.exempted(sb.ip) {
		t.Fatalf("exemptions after the verification: stray %v, enrolled %v", f.exempted(stray), f.exempted(sb.ip))
	}
}

func countOf(s []string, v string) int {
	n := 0
	for _, x := range s {
		if x == v {
			n++
		}
	}
	return n
}

// labelNamespace labels the namespace into the mesh, or takes the label
// off, in the cache.
func (f *fixture) labelNamespace(name string, ambient bool) {
	f.cache.mu.Lock()
	defer f.cache.mu.Unlock()
	ns := f.cache.namespaces[name].DeepCopy()
	ns.Labels = nil
	if ambient {
		ns.Labels = map[string]string{enrollment.DataplaneModeLabel: enrollment.DataplaneAmbient}
	}
	f.cache.namespaces[name] = ns
}

func (f *fixture) listenersOrDefault() enroll.Listeners {
	if f.listeners != nil {
		return f.listeners
	}
	return standinListeners{}
}

// recorded counts the events of a kind in a stand-in's record
// (Config.Record).
func recorded(rec *testkit.Buffer, event string) int {
	return strings.Count(rec.String(), `"event":"`+event+`"`)
}

// A removal that failed half-way (ztunnel's Del timed out) puts the entry
// back; the pod is not labelled back. The verifier leaves it to the
// reconciler's retry: repaired, it would be put back into the mesh it is
// leaving, its gate held False. (Review finding.)
func TestVerifierLeavesAPodWhoseRemovalFailedAlone(t *testing.T) {
	f := newFixture(t)
	f.standin(ztunnel.Config{})
	pod, sb := f.enrolledRunning("leaving")
	f.failDel.Store(true)
	f.labelNamespace("mesh", false)
	if err := f.p.Reconcile(context.Background(), f.cached(types.NamespacedName{Namespace: "mesh", Name: pod.Name})); err == nil {
		t.Fatal("the removal whose Del failed reported success")
	}
	f.failDel.Store(false)
	f.verifyAll()
	if hasRules(t, sb) {
		t.Error("the verifier put the rules back into a pod whose namespace left the mesh")
	}
	if c, _ := f.conds.of(pod.UID); !c.proven {
		t.Errorf("the gate of a pod leaving the mesh is held: %+v", c)
	}
}

// While ztunnel reconnects, nothing is concluded about it: a pod found
// unproven (ztunnel rejected it) stays so, and is not proven by a round
// that could not ask ztunnel. (Review finding.)
func TestVerifierConcludesNothingWhileZtunnelReconnects(t *testing.T) {
	f := newFixture(t)
	var reject atomic.Bool
	_, stop := f.standin(ztunnel.Config{Reject: func(string) string {
		if reject.Load() {
			return "refused"
		}
		return ""
	}})
	pod, _ := f.enrolledRunning("rejected")
	if err := f.srv.Del(context.Background(), string(pod.UID)); err != nil {
		t.Fatal(err)
	}
	reject.Store(true)
	f.verifyAll()
	if c, _ := f.conds.of(pod.UID); c.proven {
		t.Fatalf("condition after ztunnel rejected the pod = %+v; want False", c)
	}
	stop()
	f.zt.Store(int32(enroll.ZtunnelReconnecting))
	f.verifyAll()
	if c, _ := f.conds.of(pod.UID); c.proven {
		t.Errorf("no ztunnel holds the pod, yet a round within the grace turned its condition %+v", c)
	}
}

// dnsListeners expects ztunnel's DNS proxy too, which the stand-in runs
// without.
type dnsListeners struct{}

func (dnsListeners) Missing(ns *os.File, _ enroll.Variant) ([]uint16, error) {
	return redirect.Listening(ns, []uint16{ztunnel.PortOutbound, ztunnel.PortInbound, ztunnel.PortHBONE, ztunnel.PortDNS})
}

// unboundListeners expects a port no stand-in binds: a proxy that comes
// back without one of its listeners.
type unboundListeners struct{}

func (unboundListeners) Missing(ns *os.File, _ enroll.Variant) ([]uint16, error) {
	return redirect.Listening(ns, []uint16{ztunnel.PortOutbound, ztunnel.PortInbound, ztunnel.PortHBONE, 15999})
}

// verifiedWith enrolls a running pod under listeners, with a stand-in that
// records its proxies, and runs three verification rounds; proxyRestarts
// counts the proxies dropped since the pod's ADD.
func verifiedWith(t *testing.T, listeners enroll.Listeners) (f *fixture, pod *corev1.Pod, proxyRestarts func() int) {
	t.Helper()
	f = newFixture(t)
	f.stopServer()
	f.listeners = listeners
	f.startAgent(nil)
	rec := &testkit.Buffer{}
	f.standin(ztunnel.Config{Record: rec})
	pod, _ = f.enrolledRunning("dns")
	before := recorded(rec, "del")
	for range 3 {
		f.verifyAll()
	}
	return f, pod, func() int { return recorded(rec, "del") - before }
}

// Listeners a restart of the pod's proxy does not bring back: the proxy is
// restarted once, then not again within the backoff, never by a reconcile,
// and no repair is claimed. Each restart interrupts the pod's connections.
// (Review finding.)
func TestVerifierBacksOffAListenerRepairThatDoesNotHold(t *testing.T) {
	f, pod, proxyRestarts := verifiedWith(t, unboundListeners{})
	for range 3 {
		_ = f.p.Reconcile(context.Background(), f.cached(types.NamespacedName{Namespace: "mesh", Name: pod.Name}))
	}
	if dels := proxyRestarts(); dels != 1 {
		t.Errorf("the pod's proxy was restarted %d times by 3 rounds and 3 reconciles; want once", dels)
	}
	if n := countOf(f.rec.reasons(), enroll.EventRepaired); n != 0 {
		t.Errorf("%d %s events for a repair that did not hold", n, enroll.EventRepaired)
	}
	if c, _ := f.conds.of(pod.UID); c.proven || c.reason != "ListenersMissing" {
		t.Errorf("condition = %+v; want False/ListenersMissing", c)
	}
}

// DNS captured, ztunnel without its DNS proxy: the pod is reported, naming
// what to set, and its proxy is never restarted (that would cut its
// connections and bring no DNS proxy). (Review finding.)
func TestVerifierNeverRestartsAProxyForWantOfTheDNSProxy(t *testing.T) {
	f, pod, proxyRestarts := verifiedWith(t, dnsListeners{})
	if dels := proxyRestarts(); dels != 0 {
		t.Errorf("the pod's proxy was restarted %d times for want of ztunnel's DNS proxy; want never", dels)
	}
	if c, _ := f.conds.of(pod.UID); c.proven || c.reason != "DNSProxyMissing" {
		t.Errorf("condition = %+v; want False/DNSProxyMissing", c)
	}
}

// A rolling upgrade of ztunnel: the new one's snapshot is still being
// acknowledged when a round runs. A pod both hold is no loss. (Review
// finding.)
func TestVerifierWaitsForTheNewZtunnelsSnapshot(t *testing.T) {
	f := newFixture(t)
	f.standin(ztunnel.Config{})
	pod, _ := f.enrolledRunning("upgraded")
	ztunnel.Start(t, ztunnel.Config{SocketPath: f.sock, AckDelay: 500 * time.Millisecond})
	testkit.Eventually(t, waitFor, "the new ztunnel to connect", func() bool { return f.srv.State().Connections == 2 })
	f.verifyAll()
	if c, _ := f.conds.of(pod.UID); !c.proven {
		t.Errorf("a pod held by both ztunnels turned %+v during the upgrade", c)
	}
	if got := f.rec.reasons(); slices.Contains(got, enroll.EventRepaired) {
		t.Errorf("events %v: a repair claimed during the upgrade", got)
	}
}

// A sandbox recreated without inpod in the chain, found by the verifier,
// whose probe exemption fails after its rules went in: ztunnel still gets
// it, or its rules would point at listeners nobody binds. (Review finding.)
func TestProbeFailureOnARecreatedSandboxStillHandsItToZtunnel(t *testing.T) {
	f := newFixture(t)
	f.standin(ztunnel.Config{})
	pod, first := f.enrolledRunning("moved")
	first.Exec(t, "ip", "addr", "del", first.ip.String()+"/32", "dev", "lo")
	second := f.sandbox()
	second.RunAsPod(t, string(pod.UID))
	f.recreated(pod, second)
	f.probes.failAdd.Store(true)
	f.verifyAll()
	if !hasRules(t, second) {
		t.Fatal("the verifier did not redirect the recreated sandbox")
	}
	if missing, err := (standinListeners{}).Missing(second.Open(t), enroll.Variant{}); err != nil || len(missing) > 0 {
		t.Errorf("the recreated sandbox has inpod's rules but ztunnel's listeners %v are missing (%v): its traffic is black-holed", missing, err)
	}
}

// A round over pods whose rules nobody touched reads each netns's
// nf_tables generation, not the whole rule set.
func TestVerifierTrustsAnUnchangedGeneration(t *testing.T) {
	f := newFixture(t)
	f.standin(ztunnel.Config{})
	for i := range 3 {
		f.enrolledRunning(fmt.Sprintf("quiet-%d", i))
	}
	f.verifyAll() // proves each set once, remembering its generation
	_, sb := f.enrolledRunning("touched")
	f.verifyAll()
	sb.Exec(t, "nft", "add", "table", "inet", "unrelated")
	before := sb.Exec(t, "nft", "list", "ruleset")
	if v := f.verifyAll(); len(v.Repaired) != 0 {
		t.Fatalf("an unrelated table was taken for a loss: %+v", v)
	}
	if after := sb.Exec(t, "nft", "list", "ruleset"); after != before {
		t.Fatal("an unrelated change made the verifier rewrite the rules")
	}
	sb.Exec(t, "nft", "delete", "chain", "inet", "inpod", "nat_output")
	if v := f.verifyAll(); v.Repaired[enroll.RepairRules] != 1 {
		t.Fatalf("a chain deleted after the generation was remembered went unseen: %+v", v)
	}
}

// The readiness gate is released (True/NotEnrolled) for a pod that keeps
// running outside the mesh, and only then: not at its sandbox's DEL (the
// pod is going, or its next sandbox is enrolled or released on its own),
// which cost one API write per deleted enrolled pod.
func TestGateIsReleasedOnlyForAPodThatRunsOn(t *testing.T) {
	f := newFixture(t)
	f.standin(ztunnel.Config{})
	pod, sb := f.pod("mesh", "gated", nil), f.sandbox()
	pod = f.gated(pod)
	if out, err := f.add(pod, sb, "c1"); out != cnievent.Redirected {
		t.Fatalf("ADD = %q, %v", out, err)
	}
	testkit.Eventually(t, waitFor, "the condition True/Redirected", func() bool {
		c, ok := f.conds.of(pod.UID)
		return ok && c.proven && c.reason == enrollment.ReasonRedirected
	})
	if out, err := f.p.Del(context.Background(), request(cnievent.Del, pod, sb, "c1")); out != cnievent.Redirected || err != nil {
		t.Fatalf("DEL = %q, %v", out, err)
	}
	if c, _ := f.conds.of(pod.UID); c.reason == enrollment.ReasonNotEnrolled {
		t.Fatal("a deleted sandbox's pod was written NotEnrolled: one more API write per pod deletion")
	}

	// Labelled out while it runs: released.
	other, osb := f.pod("mesh", "leaving", nil), f.sandbox()
	other = f.gated(other)
	if out, err := f.add(other, osb, "c2"); out != cnievent.Redirected {
		t.Fatalf("ADD = %q, %v", out, err)
	}
	out := f.running(other, osb)
	out.Labels = map[string]string{enrollment.DataplaneModeLabel: "none"}
	out.Spec.ReadinessGates = other.Spec.ReadinessGates
	if err := f.p.Reconcile(context.Background(), out); err != nil {
		t.Fatal(err)
	}
	if c, ok := f.conds.of(other.UID); !ok || !c.proven || c.reason != enrollment.ReasonNotEnrolled {
		t.Fatalf("condition of a pod labelled out while it runs = %+v (%v); want True/%s", c, ok, enrollment.ReasonNotEnrolled)
	}
}

// The soak's namespace flip: a gated pod labelled out of the mesh and back
// while it runs. Taken out, it says True/NotEnrolled; taken back in, its
// condition must say Redirected again, whatever the agent's cache shows of
// it meanwhile: the NotEnrolled it was written (the cache caught up), or
// the Redirected from before (the NotEnrolled write still on its way).
func TestPodLabelledOutAndBackSaysRedirectedAgain(t *testing.T) {
	for _, cachedReason := range []string{enrollment.ReasonNotEnrolled, enrollment.ReasonRedirected} {
		t.Run("cached "+cachedReason, func(t *testing.T) {
			f := newFixture(t)
			f.standin(ztunnel.Config{})
			pod, sb := f.gated(f.pod("mesh", "flipped", nil)), f.sandbox()
			sb.RunAsPod(t, string(pod.UID))
			if out, err := f.add(pod, sb, "c1"); out != cnievent.Redirected {
				t.Fatalf("ADD = %q, %v", out, err)
			}
			f.running(pod, sb)
			testkit.Eventually(t, waitFor, "the condition True/Redirected", func() bool {
				c, ok := f.conds.of(pod.UID)
				return ok && c.proven && c.reason == enrollment.ReasonRedirected
			})
			key := types.NamespacedName{Namespace: "mesh", Name: pod.Name}
			f.labelNamespace("mesh", false)
			if err := f.p.Reconcile(context.Background(), f.cached(key)); err != nil {
				t.Fatal(err)
			}
			if c, _ := f.conds.of(pod.UID); !c.proven || c.reason != enrollment.ReasonNotEnrolled {
				t.Fatalf("condition of the pod labelled out = %+v; want True/%s", c, enrollment.ReasonNotEnrolled)
			}

			f.labelNamespace("mesh", true)
			back := f.running(f.cached(key), sb)
			back.Status.Conditions = []corev1.PodCondition{{Type: enrollment.RedirectedCondition, Status: corev1.ConditionTrue, Reason: cachedReason}}
			if err := f.p.Reconcile(context.Background(), back); err != nil {
				t.Fatal(err)
			}
			if !hasRules(t, sb) {
				t.Fatal("the pod labelled back runs without rules")
			}
			testkit.Eventually(t, waitFor, "the condition True/Redirected again", func() bool {
				c, ok := f.conds.of(pod.UID)
				return ok && c.proven && c.reason == enrollment.ReasonRedirected
			})
		})
	}
}

// At a removal, the gate is released for every gated pod it still holds
// back, and only for those: a pod whose condition is True already is Ready,
// and rewriting its reason would cost an API write per enrolled pod.
func TestReleaseGatesAtRemovalWritesOnlyForPodsHeldBack(t *testing.T) {
	f := newFixture(t)
	withCondition := func(name string, status corev1.ConditionStatus, reason string) *corev1.Pod {
		p := f.gated(f.pod("mesh", name, nil))
		p.Status.Phase = corev1.PodRunning
		if status != "" {
			p.Status.Conditions = []corev1.PodCondition{{Type: enrollment.RedirectedCondition, Status: status, Reason: reason}}
		}
		return p
	}
	proven := withCondition("proven", corev1.ConditionTrue, enrollment.ReasonRedirected)
	lost := withCondition("lost", corev1.ConditionFalse, "RulesNotRepaired")
	fresh := withCondition("fresh", "", "")
	ungated := f.pod("mesh", "ungated", nil)
	f.p.ReleaseGates([]*corev1.Pod{proven, lost, fresh, ungated})
	for _, p := range []*corev1.Pod{lost, fresh} {
		if c, ok := f.conds.of(p.UID); !ok || !c.proven || c.reason != enrollment.ReasonNotEnrolled {
			t.Errorf("%s: condition %+v (%v), want True/%s", p.Name, c, ok, enrollment.ReasonNotEnrolled)
		}
	}
	for _, p := range []*corev1.Pod{proven, ungated} {
		if c, ok := f.conds.of(p.UID); ok {
			t.Errorf("%s: condition written (%+v), want none", p.Name, c)
		}
	}
}
