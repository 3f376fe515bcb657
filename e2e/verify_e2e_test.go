//go:build e2e

package e2e

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"net/http"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"

	"github.com/inpod-dev/inpod/agent"
	"github.com/inpod-dev/inpod/agent/enroll"
	"github.com/inpod-dev/inpod/agent/redirect"
	"github.com/inpod-dev/inpod/enrollment"
	"github.com/inpod-dev/inpod/netns"
)

// The verifier from outside inpod: a pod's netfilter tables flushed from
// inside its netns (as a process in the pod with NET_ADMIN, or an operator,
// could) must be back, identical, within one verification period plus
// slack, with an Event on the pod, the repair counted, and traffic at
// ztunnel again.

// repairBound is how long a tampered pod may run without its rules: the
// verifier re-proves every pod every period (the chart sets none, so the
// agent's default), jittered by ±10 %, and 5 s cover the jitter and the
// round's own work on a loaded two-core node. Not read from the agent: an
// agent whose verifier runs late (or not at all) must fail the check, not
// move its bound.
const repairBound = agent.DefaultVerifyPeriod + 5*time.Second

var nftHandle = regexp.MustCompile(` # handle [0-9]+`)

// withoutHandles is an `nft -a` listing without its handles: rules
// re-applied after a flush are new objects with new handles, the same
// rules otherwise.
func withoutHandles(rules string) string {
	return strings.TrimSpace(nftHandle.ReplaceAllString(rules, ""))
}

// hasInpodRules reports whether a netns listing holds anything of inpod's:
// its nftables table, its iptables chains, or its redirections.
func hasInpodRules(rules string) bool {
	for _, s := range []string{"table inet inpod", "INPOD", "15001", "15006"} {
		if strings.Contains(rules, s) {
			return true
		}
	}
	return false
}

// flushNetfilter flushes every netfilter table in the netns /run/netns/name
// (nft flush ruleset: the agent's nftables table and iptables-nft's tables
// alike; the e2e checks read rules through nft, so an iptables-legacy
// backend already fails c.enrolled).
func flushNetfilter(name string) error {
	out, err := exec.Command("nsenter", "--net="+filepath.Join("/run/netns", name), "nft", "flush", "ruleset").CombinedOutput()
	if err != nil {
		return fmt.Errorf("nft flush ruleset in %s: %v: %s", name, err, out)
	}
	return nil
}

// dialIn connects from inside the netns /run/netns/name to addr, as a
// process of that pod would (no mark: inpod's rules apply to it), and
// returns the first line it is answered.
func dialIn(name, addr string) (string, error) {
	var reply string
	err := netns.DoPath(filepath.Join("/run/netns", name), func() error {
		// The socket is created here, on the thread in the pod's netns.
		conn, err := net.DialTimeout("tcp", addr, 5*time.Second)
		if err != nil {
			return err
		}
		defer conn.Close()
		conn.SetDeadline(time.Now().Add(5 * time.Second))
		reply, err = bufio.NewReader(conn).ReadString('\n')
		return err
	})
	return strings.TrimSpace(reply), err
}

// agentSample is the value of one exact series (name{labels}) on the
// agent's metrics port: 0 when absent, -1 when unreadable.
func agentSample(port int, series string) float64 {
	c := http.Client{Timeout: 2 * time.Second}
	resp, err := c.Get(fmt.Sprintf("http://127.0.0.1:%d/metrics", port))
	if err != nil {
		return -1
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), series+" "); ok {
			f, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
			if err != nil {
				return -1
			}
			return f
		}
	}
	return 0
}

// eventCount counts the occurrences of Events of reason on the pod object
// (its UID) whose message holds substr.
func eventCount(ctx context.Context, c *chartNode, p *corev1.Pod, reason, substr string) (int, string, error) {
	evs, err := c.Client.CoreV1().Events(p.Namespace).List(ctx, metav1.ListOptions{FieldSelector: "involvedObject.name=" + p.Name})
	if err != nil {
		return 0, "", err
	}
	n, msg := 0, ""
	for _, e := range evs.Items {
		if e.InvolvedObject.UID != p.UID || e.Reason != reason || !strings.Contains(e.Message, substr) {
			continue
		}
		n += max(int(e.Count), 1)
		msg = e.Type + " " + e.Message
	}
	return n, msg, nil
}

// conditionTrail watches a pod from resourceVersion rv and records each
// change of its condition ct (status and reason), in order: a dip that
// lasts a second is in it even if the pod is read only later.
type conditionTrail struct {
	mu    sync.Mutex
	steps []string
	stop  func()
}

func watchCondition(t *testing.T, ctx context.Context, c *chartNode, p *corev1.Pod, ct corev1.PodConditionType) *conditionTrail {
	t.Helper()
	w, err := c.Client.CoreV1().Pods(p.Namespace).Watch(ctx, metav1.ListOptions{FieldSelector: "metadata.name=" + p.Name, ResourceVersion: p.ResourceVersion})
	if err != nil {
		t.Fatal(err)
	}
	tr := &conditionTrail{stop: w.Stop}
	last := conditionOf(p, ct)
	go func() {
		for ev := range w.ResultChan() {
			got, ok := ev.Object.(*corev1.Pod)
			if !ok || ev.Type != watch.Modified {
				continue
			}
			if now := conditionOf(got, ct); now != last {
				last = now
				tr.mu.Lock()
				tr.steps = append(tr.steps, now)
				tr.mu.Unlock()
			}
		}
	}()
	return tr
}

func conditionOf(p *corev1.Pod, ct corev1.PodConditionType) string {
	for _, c := range p.Status.Conditions {
		if c.Type == ct {
			return string(c.Status) + "/" + c.Reason
		}
	}
	return "absent"
}

// dippedAndBack reports whether the trail went to want[0], then want[1],
// ... in that order (other steps in between allowed).
func (tr *conditionTrail) dippedAndBack(want ...string) bool {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	i := 0
	for _, s := range tr.steps {
		if i < len(want) && s == want[i] {
			i++
		}
	}
	return i == len(want)
}

func (tr *conditionTrail) String() string {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	return "[" + strings.Join(tr.steps, " → ") + "]"
}

// rulesWatch polls a netns's ruleset until stopped, remembering every
// sample that held inpod's rules: a plain pod's netns must never hold any.
type rulesWatch struct {
	mu      sync.Mutex
	samples int
	bad     []string
	done    chan struct{}
	wg      sync.WaitGroup
}

func watchNoInpodRules(name string, every time.Duration) *rulesWatch {
	rw := &rulesWatch{done: make(chan struct{})}
	rw.wg.Add(1)
	go func() {
		defer rw.wg.Done()
		for {
			rules, _, err := netnsRules(name)
			rw.mu.Lock()
			switch {
			case err != nil:
				rw.bad = append(rw.bad, fmt.Sprintf("%s: %v", time.Now().UTC().Format("15:04:05.000"), err))
			case hasInpodRules(rules):
				rw.bad = append(rw.bad, fmt.Sprintf("%s:\n%s", time.Now().UTC().Format("15:04:05.000"), rules))
			}
			rw.samples++
			rw.mu.Unlock()
			select {
			case <-rw.done:
				return
			case <-time.After(every): // sampling, not synchronising
			}
		}
	}()
	return rw
}

func (rw *rulesWatch) stop() (samples int, bad []string) {
	close(rw.done)
	rw.wg.Wait()
	return rw.samples, rw.bad
}

// verifierRepairs is the mission's verifier scenario on the running
// enrolled pod app, with the plain pod peer on the same node:
//   - app's netfilter tables flushed from inside its netns: the same rules
//     back within repairBound, a RedirectionRepaired Event on app naming
//     the rules, inpod_redirection_repairs_total{kind="rules"} up, app's
//     outbound traffic at ztunnel's 15001 and inbound at 15006 again; on a
//     pod with the readiness gate, its condition False (Repaired), then
//     True (Redirected);
//   - meanwhile, over at least two verification periods and two rounds of
//     the verifier, peer's netns never holds any of inpod's rules.
//
// Every check runs to its bound and reports on its own (Errorf), so a
// verifier that does not run shows which of them it fails.
func (c *chartNode) verifierRepairs(t *testing.T, app, peer *corev1.Pod) {
	ctx := c.ctx
	start := time.Now()
	period := agent.DefaultVerifyPeriod
	appNS, peerNS := podNetns(t, app.Status.PodIP), podNetns(t, peer.Status.PodIP)
	plain := watchNoInpodRules(peerNS, 200*time.Millisecond)
	rounds := mustAgentMetric(t, agentMetricsPort, "inpod_verifications_total")
	const rulesRepairs = `inpod_redirection_repairs_total{kind="rules"}`
	repairs := agentSample(agentMetricsPort, rulesRepairs)
	if repairs < 0 {
		t.Fatalf("the agent's metrics could not be read")
	}
	const eventSubstr = "redirection rules"
	events, _, err := eventCount(ctx, c, app, enroll.EventRepaired, eventSubstr)
	if err != nil {
		t.Fatal(err)
	}
	cur, err := c.Client.CoreV1().Pods(app.Namespace).Get(ctx, app.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	gated := enrollment.HasRedirectedGate(cur)
	var trail *conditionTrail
	if gated {
		trail = watchCondition(t, ctx, c, cur, enrollment.RedirectedCondition)
		defer trail.stop()
	}
	before := netnsRuleset(t, appNS)
	if !hasInpodRules(before) {
		t.Fatalf("enrolled %s has no redirection rules before the tamper:\n%s", app.Name, before)
	}

	// The tamper.
	flushed := time.Now()
	if err := flushNetfilter(appNS); err != nil {
		t.Fatal(err)
	}
	var back time.Duration
	var seenGone bool
	last := ""
	for time.Since(flushed) <= repairBound {
		rules, _, err := netnsRules(appNS)
		if err != nil {
			t.Fatal(err)
		}
		last = rules
		if withoutHandles(rules) == withoutHandles(before) {
			back = time.Since(flushed)
			break
		}
		seenGone = true
		time.Sleep(50 * time.Millisecond) // sampling the kernel's ruleset
	}
	if back == 0 {
		t.Errorf("the flushed rules of %s were not back within %s (verify period %s + 5 s); its netns now:\n%s\nbefore:\n%s",
			app.Name, repairBound, period, last, before)
	} else {
		t.Logf("rules flushed in %s's netns: the same rules back after %s (seen gone: %v; bound %s)",
			app.Name, back.Round(10*time.Millisecond), seenGone, repairBound)
	}

	// Traffic from the pod, and to it, at ztunnel again.
	if reply, err := dialIn(appNS, peer.Status.PodIP+":8080"); err != nil ||
		!strings.Contains(reply, "ztunnel-standin port=15001 orig="+peer.Status.PodIP+":8080") {
		t.Errorf("after the repair, %s's own connection to %s:8080 got %q (%v), want ztunnel's outbound listener", app.Name, peer.Status.PodIP, reply, err)
	}
	if reply, err := dialIn(peerNS, app.Status.PodIP+":8080"); err != nil ||
		!strings.Contains(reply, "ztunnel-standin port=15006 orig="+app.Status.PodIP+":8080") {
		t.Errorf("after the repair, a plain pod's connection to %s got %q (%v), want ztunnel's inbound listener", app.Name, reply, err)
	}

	// The repair as the agent reports it: counted, and an Event on the pod.
	var got float64
	if err := pollFor(5*time.Second, func() bool {
		got = agentSample(agentMetricsPort, rulesRepairs)
		return got > repairs
	}); err != nil {
		t.Errorf("%s stayed %v (was %v before the tamper)", rulesRepairs, got, repairs)
	}
	var msg string
	if err := pollFor(10*time.Second, func() bool {
		var n int
		n, msg, err = eventCount(ctx, c, app, enroll.EventRepaired, eventSubstr)
		return err == nil && n > events
	}); err != nil {
		t.Errorf("no new %s Event on %s naming the %s (had %d before the tamper; newest: %q)", enroll.EventRepaired, app.Name, eventSubstr, events, msg)
	} else {
		t.Logf("Event on %s: %s %s", app.Name, enroll.EventRepaired, msg)
	}

	// The readiness gate: the condition dipped and came back.
	if gated {
		down, up := "False/Repaired", "True/"+enrollment.ReasonRedirected
		if err := pollFor(repairBound, func() bool { return trail.dippedAndBack(down, up) }); err != nil {
			t.Errorf("%s's condition %s went %s, want %s then %s", app.Name, enrollment.RedirectedCondition, trail, down, up)
		} else {
			t.Logf("%s's condition %s went %s", app.Name, enrollment.RedirectedCondition, trail)
		}
	} else {
		// Starts checking by itself once the chart's admission policy gives
		// enrolled pods the gate (and the agent writes the condition).
		t.Logf("SKIPPED the readiness-gate check: %s has no readiness gate %s", app.Name, enrollment.RedirectedCondition)
	}

	// Sequence 1 of issue 35, on the same pod while the plain pod is
	// still watched.
	c.relabelAfterStalledDel(t, app, appNS, before)

	// The plain pod, watched from the start over at least two periods and
	// two rounds of the verifier.
	var now float64
	if err := pollFor(2*period+repairBound, func() bool {
		now = agentMetric(agentMetricsPort, "inpod_verifications_total")
		return time.Since(start) >= 2*period && now >= rounds+2
	}); err != nil {
		t.Errorf("the verifier ran %v rounds in %s (want at least 2 while the plain pod was watched)", now-rounds, time.Since(start).Round(time.Second))
	}
	samples, bad := plain.stop()
	if len(bad) > 0 {
		t.Errorf("the plain pod %s's netns held inpod's rules (or could not be read) in %d of %d samples over %s; first:\n%s",
			peer.Name, len(bad), samples, time.Since(start).Round(time.Second), bad[0])
	} else {
		t.Logf("the plain pod %s's netns: none of inpod's rules in %d samples over %s (%v verifier rounds)",
			peer.Name, samples, time.Since(start).Round(time.Second), now-rounds)
	}
}

// relabelAfterStalledDel is a partly failed unenroll followed by a relabel:
// with ztunnel (the stand-in) frozen, app is labelled out of the mesh, so
// the agent takes its rules out and its ZDS Del stalls; the label comes
// off again (a GitOps self-heal) before the Del has timed out; then ztunnel
// runs again. app must be redirected again (the same rules, traffic at
// ztunnel's listener) within repairBound of ztunnel's return: it is in the
// mesh, and nothing else will restart it.
func (c *chartNode) relabelAfterStalledDel(t *testing.T, app *corev1.Pod, appNS, rules string) {
	ctx := c.ctx
	label := func(value string) {
		t.Helper()
		patch := fmt.Sprintf(`{"metadata":{"labels":{%q:%s}}}`, enrollment.DataplaneModeLabel, value)
		if _, err := c.Client.CoreV1().Pods(app.Namespace).Patch(ctx, app.Name, types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	_, resume, err := freezeProcs(c.Containerd, "ztunnel-standin")
	t.Cleanup(resume)
	if err != nil {
		t.Fatal(err)
	}
	label(strconv.Quote(enrollment.DataplaneNone))
	unlabelled := time.Now()
	if err := pollFor(5*time.Second, func() bool {
		r, _, err := netnsRules(appNS)
		return err == nil && !hasInpodRules(r)
	}); err != nil {
		t.Fatalf("%s labelled %s=%s: its rules still there after 5 s; the sequence needs them gone while ztunnel stalls the Del", app.Name, enrollment.DataplaneModeLabel, enrollment.DataplaneNone)
	}
	label("null")
	relabelled := time.Since(unlabelled)
	// The Del stalls until the agent gives up on ztunnel and drops the
	// connection: the failure the sequence is about.
	if err := pollFor(30*time.Second, func() bool { return agentMetric(agentMetricsPort, "inpod_ztunnel_connections") == 0 }); err != nil {
		t.Fatalf("the agent kept its connection to the frozen ztunnel: the Del did not fail")
	}
	resume()
	resumed := time.Now()
	t.Logf("%s unlabelled with ztunnel frozen, its rules gone, relabelled after %s; the Del failed; ztunnel resumed after %s",
		app.Name, relabelled.Round(10*time.Millisecond), resumed.Sub(unlabelled).Round(10*time.Millisecond))

	last := ""
	if err := pollFor(repairBound, func() bool {
		r, _, err := netnsRules(appNS)
		last = r
		return err == nil && withoutHandles(r) == withoutHandles(rules)
	}); err != nil {
		t.Errorf("relabelled %s not redirected again within %s of ztunnel's return; its netns:\n%s", app.Name, repairBound, last)
		return
	}
	t.Logf("relabelled %s: its rules back %s after ztunnel's return", app.Name, time.Since(resumed).Round(10*time.Millisecond))
	// ztunnel's listeners are bound in it again once ztunnel has its
	// snapshot: the pod's own connections reach them.
	var reply string
	if err := pollFor(repairBound, func() bool {
		var err error
		reply, err = dialIn(appNS, "192.0.2.1:8080")
		return err == nil && strings.Contains(reply, "ztunnel-standin port=15001")
	}); err != nil {
		t.Errorf("relabelled %s's own connection got %q, want ztunnel's outbound listener", app.Name, reply)
	}
}

// strayRules writes inpod's rules into the netns /run/netns/to with the
// backend the agent uses in /run/netns/from (an enrolled pod's): what a
// path that failed to take a pod's rules out leaves.
func strayRules(t *testing.T, from, to string) {
	t.Helper()
	name := "iptables-nft"
	if strings.Contains(netnsRuleset(t, from), "table inet inpod") {
		name = "nftables"
	}
	backend, _, err := redirect.NewBackend(name, nil)
	if err != nil {
		t.Fatal(err)
	}
	ns, err := netns.Open(filepath.Join("/run/netns", to))
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	if _, err := redirect.NewEngine(backend).Apply(ns, redirect.Options{}); err != nil {
		t.Fatalf("write inpod's rules (%s) into %s: %v", name, to, err)
	}
	if r, _, err := netnsRules(to); err != nil || !hasInpodRules(r) {
		t.Fatalf("the stray rules did not take in %s (%v)", to, err)
	}
}

// sweptAtStart checks that an agent that has just started has swept the
// plain pod peer's netns (/run/netns/peerNS) free of inpod's rules, with
// an Event on peer saying so.
func (c *chartNode) sweptAtStart(t *testing.T, peer *corev1.Pod, peerNS string) {
	last := ""
	if err := pollFor(repairBound, func() bool {
		r, _, err := netnsRules(peerNS)
		last = r
		return err == nil && !hasInpodRules(r)
	}); err != nil {
		t.Errorf("the plain pod %s still holds inpod's rules %s after the new agent was Ready:\n%s", peer.Name, repairBound, last)
		return
	}
	var msg string
	if err := pollFor(10*time.Second, func() bool {
		n, m, err := eventCount(c.ctx, c, peer, enroll.EventRemovedOutside, "")
		msg = m
		return err == nil && n > 0
	}); err != nil {
		t.Errorf("no %s Event on the plain pod %s", enroll.EventRemovedOutside, peer.Name)
		return
	}
	t.Logf("the new agent swept the plain pod %s: %s", peer.Name, msg)
}

// pollFor is testkit.Poll for a check that reports its own failure.
func pollFor(timeout time.Duration, cond func() bool) error {
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			return fmt.Errorf("timed out after %s", timeout)
		}
		time.Sleep(50 * time.Millisecond)
	}
	return nil
}
