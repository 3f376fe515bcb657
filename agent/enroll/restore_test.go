package enroll_test

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/inpod-dev/inpod/agent/redirect"
	"github.com/inpod-dev/inpod/cnievent"
	"github.com/inpod-dev/inpod/enrollment"
	"github.com/inpod-dev/inpod/internal/testkit"
	ztunnel "github.com/inpod-dev/inpod/zds/zdstest"
)

// restart replaces the agent as a restart does (agent.restore): the old
// pipeline's ZDS server stops and its fds close (rules and ztunnel's proxies
// stay), a new pipeline restores every pod of the cache from one procfs
// snapshot, prunes the records
// of pods gone from it and the probe set when it may, and
// only then is ztunnel served again. It waits for z's snapshot from the new
// agent.
func (f *fixture) restart(z *ztunnel.Standin) {
	f.t.Helper()
	f.stopServer()
	f.p.Close()
	connects := z.Connects()
	f.startAgent(func() {
		f.cache.mu.Lock()
		pods := make([]*corev1.Pod, 0, len(f.cache.pods))
		for _, p := range f.cache.pods {
			pods = append(pods, p)
		}
		f.cache.mu.Unlock()
		inCache := map[types.UID]bool{}
		// One procfs snapshot for all, as the agent restores.
		snap, err := f.finder.Snapshot()
		if err != nil {
			f.t.Fatal(err)
		}
		for _, p := range pods {
			inCache[p.UID] = true
			if err := f.p.RestoreWith(context.Background(), p, snap); err != nil {
				f.t.Logf("restore %s/%s: %v", p.Namespace, p.Name, err)
			}
		}
		if err := f.p.PruneRecords(func(uid types.UID) bool { return inCache[uid] }); err != nil {
			f.t.Fatal(err)
		}
		if !f.p.PruneSafe() {
			return
		}
		if err := f.probes.Prune(f.p.EnrolledIPs()); err != nil {
			f.t.Fatal(err)
		}
	})
	testkit.Eventually(f.t, waitFor, "the stand-in's snapshot from the restarted agent", func() bool {
		return z.Connects() > connects && z.SnapshotDone()
	})
}

// checkKept checks that a pod the previous agent enrolled kept, across the
// restart, what its rules point at: ztunnel's proxy and its probe
// exemption, and the rules themselves.
func (f *fixture) checkKept(z *ztunnel.Standin, pod *corev1.Pod, sb sandbox) {
	f.t.Helper()
	if _, ok := inZtunnel(z, pod); !ok {
		f.t.Errorf("ztunnel dropped the proxy of %s, whose rules are in place: its traffic is black-holed", pod.Name)
	}
	if !hasRules(f.t, sb) {
		f.t.Errorf("the rules of %s are gone", pod.Name)
	}
	if !f.exempted(sb.ip) {
		f.t.Errorf("the probe exemption of %s (%s) was pruned: its probes go to a proxy", pod.Name, sb.ip)
	}
}

// checkReleased checks that a pod that left the mesh while no agent ran
// is out of it after the restart: no rules, no proxy, no exemption.
func (f *fixture) checkReleased(z *ztunnel.Standin, pod *corev1.Pod, sb sandbox) {
	f.t.Helper()
	if hasRules(f.t, sb) {
		f.t.Fatal("the pod left the mesh while no agent ran, and still has its rules after the restart: it is blocked")
	}
	if _, ok := inZtunnel(z, pod); ok {
		f.t.Error("ztunnel still runs a proxy for a pod outside the mesh")
	}
	if f.exempted(sb.ip) {
		f.t.Error("the pod outside the mesh keeps its probe exemption")
	}
}

// recorded says whether the node's record names uid.
func (f *fixture) recorded(uid types.UID) bool {
	f.t.Helper()
	ok, err := f.records.Recorded(string(uid))
	if err != nil {
		f.t.Fatal(err)
	}
	return ok
}

// annotate sets the pod's redirection annotation in the cache, as the
// previous agent's patch left it.
func (f *fixture) annotate(pod *corev1.Pod, value string) *corev1.Pod {
	p := pod.DeepCopy()
	if p.Annotations == nil {
		p.Annotations = map[string]string{}
	}
	p.Annotations[enrollment.RedirectionAnnotation] = value
	f.cache.mu.Lock()
	f.cache.pods[p.Namespace+"/"+p.Name] = p
	f.cache.mu.Unlock()
	return p
}

func (f *fixture) exempted(ip netip.Addr) bool {
	f.t.Helper()
	members, err := f.probes.Members()
	if err != nil {
		f.t.Fatal(err)
	}
	return slices.Contains(members, ip)
}

// Invariant 2 (docs/design/invariants.md) across a restart: a pod the previous
// agent enrolled, whose netns the new one cannot find yet (procfs finds no
// process of it; or its status has no IPs yet, right after the ADD), keeps
// ztunnel's proxy (the snapshot names it with Keep) and its probe exemption,
// since its rules still point at both. Once its netns is found it is restored
// for real.
func TestRestartKeepsAnEnrolledPodWhoseNetnsIsNotFound(t *testing.T) {
	f := newFixture(t)
	z, _ := f.standin(ztunnel.Config{})
	pod, sb := f.pod("mesh", "unfound", nil), f.sandbox()
	if out, err := f.add(pod, sb, "c1"); out != cnievent.Redirected {
		t.Fatalf("ADD = %q, %v", out, err)
	}
	// No process of the pod runs in sb: procfs cannot find its netns.
	running := f.annotate(f.running(pod, sb), enrollment.AnnotationEnabled)
	fresh, freshSB := f.pod("mesh", "no-ips-yet", nil), f.sandbox()
	if out, err := f.add(fresh, freshSB, "c2"); out != cnievent.Redirected {
		t.Fatalf("ADD = %q, %v", out, err)
	}
	// The kubelet has not reported its IPs yet.
	f.annotate(fresh, enrollment.AnnotationPending)

	f.restart(z)
	f.checkKept(z, pod, sb)
	f.checkKept(z, fresh, freshSB)
	if errs := z.ProtocolErrors(); len(errs) != 0 {
		t.Fatalf("protocol errors: %v", errs)
	}

	// Its netns turns up: the reconciler's retry restores it with its fd.
	sb.RunAsPod(t, string(pod.UID))
	if err := f.p.Reconcile(context.Background(), running); err != nil {
		t.Fatal(err)
	}
	if !f.p.IsEnrolled(pod.UID) {
		t.Fatal("the held pod was not restored once its netns was found")
	}
	later, _ := f.standin(ztunnel.Config{})
	if id, ok := inZtunnel(later, pod); !ok || id != identity(t, sb) {
		t.Fatalf("a later snapshot sends netns %v (%v); want the pod's %v", id, ok, identity(t, sb))
	}
	// The other one finishes: it leaves the snapshots.
	done := fresh.DeepCopy()
	done.Status.Phase = corev1.PodSucceeded
	if err := f.p.Reconcile(context.Background(), done); err != nil {
		t.Fatal(err)
	}
	if slices.Contains(f.p.Enrolled(), types.NamespacedName{Namespace: "mesh", Name: "no-ips-yet"}) {
		t.Fatal("a finished held pod is still held")
	}
}

// A pod the previous agent enrolled just before it stopped, whose sandbox
// runs but whose status shows no IPs yet (the kubelet writes them seconds
// later on a busy node, after the next agent's restore), is restored at once
// from the IPs the node's record kept: in the table with its netns, so its
// containers may start (MayStart), not held until the status catches up.
// Found only through a process of the pod: the record's IPs alone prove
// nothing.
func TestRestartFindsAPodWithNoIPsInItsStatusByItsRecord(t *testing.T) {
	f := newFixture(t)
	z, _ := f.standin(ztunnel.Config{})
	pod, sb := f.pod("mesh", "no-ips-yet", nil), f.sandbox()
	if out, err := f.add(pod, sb, "c1"); out != cnievent.Redirected {
		t.Fatalf("ADD = %q, %v", out, err)
	}
	if ips, err := f.records.IPs(string(pod.UID)); err != nil || !slices.Equal(ips, []netip.Addr{sb.ip}) {
		t.Fatalf("the record holds IPs %v (%v), want the sandbox's %s", ips, err, sb.ip)
	}
	other, otherSB := f.pod("mesh", "no-process", nil), f.sandbox()
	if out, err := f.add(other, otherSB, "c2"); out != cnievent.Redirected {
		t.Fatalf("ADD = %q, %v", out, err)
	}
	// The pod's pause process runs in its sandbox; the other's does not
	// (procfs cannot tie its recorded IPs to it).
	sb.RunAsPod(t, string(pod.UID))

	f.restart(z)
	if !f.p.IsEnrolled(pod.UID) {
		t.Fatal("the running pod with no IPs in its status was held, not restored from its record's IPs")
	}
	if id, ok := inZtunnel(z, pod); !ok || id != identity(t, sb) {
		t.Fatalf("ztunnel got netns %v (%v) for the pod; want its sandbox's %v", id, ok, identity(t, sb))
	}
	if err := f.p.MayStart(context.Background(), pod.Namespace, pod.Name); err != nil {
		t.Fatalf("MayStart of the restored pod: %v", err)
	}
	f.checkKept(z, pod, sb)
	// The other is held as before: kept in ztunnel, its containers wait.
	if f.p.IsEnrolled(other.UID) {
		t.Fatal("a pod whose recorded IPs no process of it holds was restored")
	}
	f.checkKept(z, other, otherSB)
	if err := f.p.MayStart(context.Background(), other.Namespace, other.Name); err == nil || !strings.Contains(err.Error(), "agent before this one") {
		t.Fatalf("MayStart of a held pod = %v, want it held with the reason", err)
	}
	// Right after its ADD a sandbox may have no process yet: no Warning
	// for that.
	if got := f.rec.reasons(); slices.Contains(got, "NetnsNotFound") {
		t.Fatalf("events %v: a NetnsNotFound warning for a pod whose status shows no IPs yet", got)
	}
}

// enrolledThenUnlabelled enrolls a running pod in namespace "leaving",
// annotated as given ("" for an annotation that never landed), and takes
// the namespace's label away, as if no agent ran.
func enrolledThenUnlabelled(t *testing.T, annotation string) (*fixture, *ztunnel.Standin, *corev1.Pod, sandbox) {
	f := newFixture(t)
	f.cache.mu.Lock()
	f.cache.namespaces["leaving"] = &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "leaving",
		Labels: map[string]string{enrollment.DataplaneModeLabel: enrollment.DataplaneAmbient}}}
	f.cache.mu.Unlock()
	z, _ := f.standin(ztunnel.Config{})
	pod, sb := f.pod("leaving", "app", nil), f.sandbox()
	if out, err := f.add(pod, sb, "c1"); out != cnievent.Redirected {
		t.Fatalf("ADD = %q, %v", out, err)
	}
	sb.RunAsPod(t, string(pod.UID))
	running := f.running(pod, sb)
	if annotation != "" {
		f.annotate(running, annotation)
	}
	f.cache.mu.Lock()
	f.cache.namespaces["leaving"] = &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "leaving"}}
	f.cache.mu.Unlock()
	return f, z, pod, sb
}

// A pod enrolled by the previous agent whose namespace lost its label while
// no agent ran leaves the mesh at restart: rules out of its netns (found
// through procfs), annotation removed, proxy and exemption gone. Left alone,
// its rules would point at a proxy the new snapshot drops.
func TestRestartRemovesAPodUnlabelledWhileNoAgentRan(t *testing.T) {
	f, z, pod, sb := enrolledThenUnlabelled(t, enrollment.AnnotationEnabled)
	f.restart(z)
	f.checkReleased(z, pod, sb)
	f.rec.mu.Lock()
	got, ok := f.rec.annots[types.NamespacedName{Namespace: "leaving", Name: "app"}]
	f.rec.mu.Unlock()
	if !ok || got != "" {
		t.Errorf("annotation left at %q (%v); want it removed", got, ok)
	}
	if f.p.IsEnrolled(pod.UID) || len(f.p.Enrolled()) != 0 {
		t.Errorf("pod still tracked: %v", f.p.Enrolled())
	}
}

// A new sandbox of an enrolled pod replaces the IPs its record holds: the
// next agent looks for the sandbox that runs.
func TestRecordFollowsTheSandboxIPs(t *testing.T) {
	f := newFixture(t)
	f.standin(ztunnel.Config{})
	pod, first := f.pod("mesh", "app", nil), f.sandbox()
	if out, err := f.add(pod, first, "c1"); out != cnievent.Redirected {
		t.Fatalf("ADD = %q, %v", out, err)
	}
	second := f.sandbox()
	if out, err := f.add(pod, second, "c2"); out != cnievent.Redirected {
		t.Fatalf("ADD of a new sandbox = %q, %v", out, err)
	}
	if ips, err := f.records.IPs(string(pod.UID)); err != nil || !slices.Equal(ips, []netip.Addr{second.ip}) {
		t.Fatalf("the record holds %v (%v), want the new sandbox's %s (the first's was %s)", ips, err, second.ip, first.ip)
	}
}

// The same with the pod's status showing no IPs yet: its rules are found
// by the IPs the node's record kept and taken out at once, not left
// pointing at a proxy until the kubelet reports them.
func TestRestartRemovesAPodUnlabelledWhileNoAgentRanByItsRecord(t *testing.T) {
	f, z, pod, sb := enrolledThenUnlabelled(t, "")
	noIPs := pod.DeepCopy()
	noIPs.Status.Phase = corev1.PodRunning
	f.cache.mu.Lock()
	f.cache.pods[noIPs.Namespace+"/"+noIPs.Name] = noIPs
	f.cache.mu.Unlock()
	f.restart(z)
	f.checkReleased(z, pod, sb)
	if f.recorded(pod.UID) {
		t.Error("the released pod's record stays")
	}
}

// Invariant 1 (docs/design/invariants.md) at restart: a pod the previous agent
// enrolled whose namespace cannot be known yet is held (ztunnel keeps its
// proxy) rather than dropped or taken for unenrolled, and restored once the
// namespace is known.
func TestRestartHoldsAPodWhoseNamespaceIsUnknown(t *testing.T) {
	f := newFixture(t)
	z, _ := f.standin(ztunnel.Config{})
	pod, sb := f.pod("mesh", "undecided", nil), f.sandbox()
	if out, err := f.add(pod, sb, "c1"); out != cnievent.Redirected {
		t.Fatalf("ADD = %q, %v", out, err)
	}
	sb.RunAsPod(t, string(pod.UID))
	running := f.annotate(f.running(pod, sb), enrollment.AnnotationEnabled)
	f.cache.loseNamespaces(errors.New("namespace watch not synced and the API server unreachable"))

	f.restart(z)
	if _, ok := inZtunnel(z, pod); !ok || !hasRules(t, sb) || !f.exempted(sb.ip) {
		t.Fatalf("a pod whose namespace is unknown lost its proxy (%v), rules (%v) or probe exemption (%v) at restart", ok, hasRules(t, sb), f.exempted(sb.ip))
	}
	f.cache.loseNamespaces(nil)
	if err := f.p.Reconcile(context.Background(), running); err != nil {
		t.Fatal(err)
	}
	if id, ok := inZtunnel(z, pod); !ok || id != identity(t, sb) || !f.p.IsEnrolled(pod.UID) {
		t.Fatalf("not restored once the namespace is known: ztunnel %v (%v), enrolled %v", id, ok, f.p.IsEnrolled(pod.UID))
	}
}

// A pod the previous agent enrolled whose annotation patch never landed (the
// agent died between its reply and the patch, which must heal:
// docs/design/agent.md, Annotations) and which is being deleted when the new
// agent starts: its sandbox still runs (preStop, draining) with the rules in
// place, so the restart must find it and keep it in ztunnel's snapshot.
// Skipping it as "after its DEL" would drop its proxy while its rules still
// point there: its traffic is black-holed for the rest of its grace period.
func TestRestartKeepsATerminatingEnrolledPodWithoutAnnotation(t *testing.T) {
	f := newFixture(t)
	z, _ := f.standin(ztunnel.Config{})
	pod, sb := f.pod("mesh", "draining", nil), f.sandbox()
	if out, err := f.add(pod, sb, "c1"); out != cnievent.Redirected {
		t.Fatalf("ADD = %q, %v", out, err)
	}
	sb.RunAsPod(t, string(pod.UID))
	terminating := f.running(pod, sb)
	now := metav1.Now()
	terminating.DeletionTimestamp = &now
	f.cache.mu.Lock()
	f.cache.pods[pod.Namespace+"/"+pod.Name] = terminating
	f.cache.mu.Unlock()

	f.restart(z)
	if _, ok := inZtunnel(z, pod); !ok {
		t.Fatal("ztunnel dropped the proxy of a terminating enrolled pod whose rules are in place: its traffic is black-holed")
	}
	if !f.p.IsEnrolled(pod.UID) {
		t.Fatal("the restarted agent does not hold the terminating enrolled pod")
	}
	if !hasRules(t, sb) {
		t.Fatal("the rules of the terminating pod are gone")
	}
}

// The same restart with neither pod's annotation landed (the previous agent
// died between its answer and its patch, or before a burst's patches went
// out): the node's record names them, so they are held as annotated ones
// are, not taken for pods that were never enrolled.
func TestRestartKeepsARecordedPodWhoseAnnotationNeverLanded(t *testing.T) {
	f := newFixture(t)
	z, stopZtunnel := f.standin(ztunnel.Config{})
	pod, sb := f.pod("mesh", "unfound", nil), f.sandbox()
	if out, err := f.add(pod, sb, "c1"); out != cnievent.Redirected {
		t.Fatalf("ADD = %q, %v", out, err)
	}
	f.running(pod, sb) // no process in sb: procfs cannot find it
	fresh, freshSB := f.pod("mesh", "no-ips-yet", nil), f.sandbox()
	if out, err := f.add(fresh, freshSB, "c2"); out != cnievent.Redirected {
		t.Fatalf("ADD = %q, %v", out, err)
	}
	for _, p := range []*corev1.Pod{pod, fresh} {
		if !f.recorded(p.UID) {
			t.Fatalf("%s enrolled without a record", p.Name)
		}
	}

	f.restart(z)
	for _, c := range []struct {
		pod *corev1.Pod
		sb  sandbox
	}{{pod, sb}, {fresh, freshSB}} {
		f.checkKept(z, c.pod, c.sb)
		if !f.recorded(c.pod.UID) {
			t.Errorf("the record of held pod %s was pruned", c.pod.Name)
		}
	}
	// Held, so their records stay even when the cache no longer shows them
	// (a lagging watch); only pods neither enrolled nor held lose theirs.
	if err := f.p.PruneRecords(func(types.UID) bool { return false }); err != nil {
		t.Fatal(err)
	}
	if !f.recorded(pod.UID) || !f.recorded(fresh.UID) {
		t.Error("pruning dropped the record of a held pod")
	}

	// A new sandbox of the held pod fails to start (ztunnel gone): the
	// start is rolled back, but the record stands for the held sandbox's
	// rules, not this one's, and stays.
	stopZtunnel()
	if out, _ := f.add(fresh, f.sandbox(), "c3"); out != cnievent.Failed {
		t.Fatalf("ADD without ztunnel = %q, want failed", out)
	}
	if !f.recorded(fresh.UID) {
		t.Error("a failed start of a new sandbox dropped the held pod's record")
	}
}

// A pod in the mesh whose record cannot be written does not start (its ADD
// fails before any rule, with a reason on the pod); a pod outside the mesh
// starts as ever, the record is never consulted for it.
func TestAddFailsClosedWhenThePodCannotBeRecorded(t *testing.T) {
	f := newFixture(t)
	f.standin(ztunnel.Config{})
	dir := f.records.Path()
	if err := os.RemoveAll(dir); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(dir, nil, 0o600); err != nil { // every record now fails
		t.Fatal(err)
	}
	pod, sb := f.pod("mesh", "app", nil), f.sandbox()
	if out, err := f.add(pod, sb, "c1"); out != cnievent.Failed || err == nil {
		t.Fatalf("ADD of an enrolled pod that cannot be recorded = %q, %v; want failed", out, err)
	}
	if hasRules(t, sb) {
		t.Fatal("rules applied to a pod the node could not record")
	}
	if !slices.Contains(f.rec.reasons(), "RecordFailed") {
		t.Errorf("events %v, want RecordFailed", f.rec.reasons())
	}
	f.rec.mu.Lock()
	_, annotated := f.rec.annots[types.NamespacedName{Namespace: "mesh", Name: "app"}]
	f.rec.mu.Unlock()
	if annotated {
		t.Error("a pod that never had rules was annotated")
	}
	plain, plainSB := f.pod("plain", "web", nil), f.sandbox()
	if out, err := f.add(plain, plainSB, "c2"); out != cnievent.NotEnrolled || err != nil {
		t.Fatalf("ADD of a pod outside the mesh = %q, %v; want not-enrolled", out, err)
	}
}

// A pod the previous agent enrolled, unannotated, whose namespace lost its
// label while no agent ran: the record tells the new agent its rules are
// there, and they come out. Without it the pod would keep rules pointing at
// a proxy ztunnel no longer runs: outside the mesh, and blocked.
func TestRestartRemovesARecordedPodUnlabelledWhileNoAgentRan(t *testing.T) {
	f, z, pod, sb := enrolledThenUnlabelled(t, "")
	f.restart(z)
	f.checkReleased(z, pod, sb)
	if f.recorded(pod.UID) {
		t.Error("the record of a pod taken out of the mesh is still there")
	}
}

// A pod has a record exactly while rules of it may be in place: from before
// its rules are applied, gone with a start that failed and was rolled back,
// with its DEL, and with the pod (pruned at restart once it is gone from
// the API).
func TestEnrolledRecordFollowsThePodsRules(t *testing.T) {
	f := newFixture(t)
	recorded := func(p *corev1.Pod) bool { return f.recorded(p.UID) }

	// No ztunnel: the start fails after the rules were applied, and is
	// rolled back.
	failed, failedSB := f.pod("mesh", "failed", nil), f.sandbox()
	if out, _ := f.add(failed, failedSB, "c0"); out != cnievent.Failed {
		t.Fatalf("ADD without ztunnel = %q, want failed", out)
	}
	if hasRules(t, failedSB) || recorded(failed) {
		t.Fatalf("a rolled-back start left rules (%v) or its record (%v)", hasRules(t, failedSB), recorded(failed))
	}

	z, _ := f.standin(ztunnel.Config{})
	deleted, deletedSB := f.pod("mesh", "deleted", nil), f.sandbox()
	gone, goneSB := f.pod("mesh", "gone", nil), f.sandbox()
	for i, c := range []struct {
		pod *corev1.Pod
		sb  sandbox
	}{{deleted, deletedSB}, {gone, goneSB}} {
		if out, err := f.add(c.pod, c.sb, fmt.Sprintf("c%d", i+1)); out != cnievent.Redirected {
			t.Fatalf("ADD = %q, %v", out, err)
		}
		if !recorded(c.pod) {
			t.Fatalf("%s enrolled without a record", c.pod.Name)
		}
	}
	if out, err := f.p.Del(context.Background(), request(cnievent.Del, deleted, deletedSB, "c1")); out != cnievent.Redirected {
		t.Fatalf("DEL = %q, %v", out, err)
	}
	if recorded(deleted) {
		t.Fatal("the record outlived the pod's DEL")
	}

	// "gone" leaves the API while no agent runs (its DEL missed).
	f.cache.mu.Lock()
	delete(f.cache.pods, "mesh/gone")
	delete(f.cache.pods, "mesh/deleted")
	delete(f.cache.pods, "mesh/failed")
	f.cache.mu.Unlock()
	f.restart(z)
	if recorded(gone) {
		t.Fatal("the record of a pod gone from the API survived the restart")
	}
}

// A start that fails on a sandbox whose rules were already in place (an
// intact set is not rewritten, so the rollback leaves it) keeps the pod's
// record: every netns with rules has one, or the next agent could take
// the pod for never enrolled.
func TestFailedStartKeepsTheRecordOfRulesItFoundInPlace(t *testing.T) {
	f := newFixture(t)
	pod, sb := f.pod("mesh", "found", nil), f.sandbox()
	if _, err := redirect.NewEngine(redirect.NewNFTables()).Apply(sb.Open(t), redirect.Options{}); err != nil {
		t.Fatal(err)
	}
	// No ztunnel: the start fails after the rules step.
	if out, _ := f.add(pod, sb, "c0"); out != cnievent.Failed {
		t.Fatalf("ADD without ztunnel = %q, want failed", out)
	}
	if !hasRules(t, sb) {
		t.Fatal("the rollback took out rules it had not written")
	}
	if !f.recorded(pod.UID) {
		t.Fatal("the sandbox kept its rules but the pod lost its record")
	}
}

// The agent was away and an enrolled pod's sandbox started without inpod
// (chained mode, the primary's file rewritten meanwhile, no gate): at its
// start the agent finds the pod running, with no record, no annotation and
// no rules. The user is told, on the pod and in a counter, before the pod
// is redirected in place. A pod the previous agent enrolled (record and
// rules) gets no such word.
func TestRestartReportsAPodThatRanUnredirected(t *testing.T) {
	f := newFixture(t)
	z, _ := f.standin(ztunnel.Config{})
	kept, keptSB := f.pod("mesh", "kept", nil), f.sandbox()
	if out, err := f.add(kept, keptSB, "c1"); out != cnievent.Redirected {
		t.Fatalf("ADD = %q, %v", out, err)
	}
	keptSB.RunAsPod(t, string(kept.UID))
	f.running(kept, keptSB)

	bare, bareSB := f.pod("mesh", "bare", nil), f.sandbox()
	bareSB.RunAsPod(t, string(bare.UID))
	running := f.running(bare, bareSB)
	running.Status.Conditions = []corev1.PodCondition{{Type: corev1.PodReadyToStartContainers, Status: corev1.ConditionTrue,
		LastTransitionTime: metav1.NewTime(time.Now().Add(-90 * time.Second))}}
	f.cache.mu.Lock()
	f.cache.pods["mesh/bare"] = running
	f.cache.mu.Unlock()

	f.restart(z)
	if !hasRules(t, bareSB) {
		t.Fatal("the pod that ran unredirected was not redirected in place")
	}
	var msgs []string
	f.rec.mu.Lock()
	for _, e := range f.rec.events {
		if e.reason == "RanUnredirected" {
			msgs = append(msgs, e.pod+": "+e.message)
		}
	}
	counted := f.rec.ranUnredirected
	f.rec.mu.Unlock()
	if len(msgs) != 1 || !strings.HasPrefix(msgs[0], "mesh/bare: ") || !strings.Contains(msgs[0], "for 1m3") {
		t.Fatalf("RanUnredirected events %q; want one, on mesh/bare, saying it ran so for about 1m30s", msgs)
	}
	if counted != 1 {
		t.Fatalf("the observer counted %d pods that ran unredirected, want 1", counted)
	}
	f.checkKept(z, f.running(kept, keptSB), keptSB)
}
