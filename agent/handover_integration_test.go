//go:build integration

package agent_test

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/inpod-dev/inpod/internal/testkit"
	"github.com/inpod-dev/inpod/netns/netnstest"
)

// addStream runs the node's chain for pods one after the other, paced,
// off the test's goroutine, remembering every failure.
type addStream struct {
	mu     sync.Mutex
	done   int
	failed []string
	over   chan struct{}
}

func (w *world) streamAdds(t *testing.T, pods []*corev1.Pod, sandboxes []*netnstest.NetNS, every time.Duration) *addStream {
	list, _, err := testkit.RuntimeConfig(w.confDir)
	if err != nil {
		t.Fatal(err)
	}
	s := &addStream{over: make(chan struct{})}
	go func() {
		defer close(s.over)
		for i, pod := range pods {
			_, err := w.runChain(list, "ADD", pod, sandboxes[i], "c-"+pod.Name)
			s.mu.Lock()
			s.done++
			if err != nil {
				s.failed = append(s.failed, fmt.Sprintf("%s: %v", pod.Name, err))
			}
			s.mu.Unlock()
			time.Sleep(every) // pacing the stream, not synchronising
		}
	}()
	return s
}

func (s *addStream) progress() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.done
}

func (s *addStream) wait(t *testing.T) []string {
	t.Helper()
	select {
	case <-s.over:
	case <-time.After(5 * time.Minute):
		t.Fatal("the stream of ADDs did not end")
	}
	return s.failed
}

func enrolledPods(w *world, prefix string, n int) ([]*corev1.Pod, []*netnstest.NetNS) {
	pods := make([]*corev1.Pod, n)
	sandboxes := make([]*netnstest.NetNS, n)
	for i := range n {
		pods[i], sandboxes[i] = w.pod("mesh", fmt.Sprintf("%s-%d", prefix, i))
	}
	return pods, sandboxes
}

func (p *agentProcess) exited() bool {
	return p.cmd.ProcessState != nil || p.cmd.Process.Signal(syscall.Signal(0)) != nil
}

// stop sends SIGTERM and waits for a clean exit.
func (p *agentProcess) stop(t *testing.T) {
	t.Helper()
	p.cmd.Process.Signal(syscall.SIGTERM)
	done := make(chan error, 1)
	go func() { done <- p.cmd.Wait() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("the agent exited with %v after SIGTERM", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the agent did not exit within 30 s of SIGTERM")
	}
}

func portClosed(addr string) bool {
	c, err := net.DialTimeout("tcp", addr, time.Second)
	if err == nil {
		c.Close()
	}
	return err != nil
}

// A rollout's surge on one node: a second agent starts while the first
// serves a stream of enrolled pods' ADDs. It takes the node over; not one
// ADD fails, ztunnel reconnects to it and holds every pod, a pod enrolled
// before keeps its rules untouched, and the first agent, retired, stops
// serving its ports and exits cleanly when stopped, leaving the sockets to
// the second.
func TestIntegrationHandOverUnderAStreamOfADDs(t *testing.T) {
	w := newWorld(t)
	bin := buildAgent(t)
	first := w.startAgentProcess(bin)

	// Running, so the successor restores it (what it restores must not
	// wait for ztunnel as a CNI ADD does).
	before, beforeNS := w.pod("mesh", "before")
	res, err := w.cniAdd(before, beforeNS)
	if err != nil {
		t.Fatal(err)
	}
	w.setRunning(before, res.IPs[0].Address.IP.String())
	beforeNS.RunAsPod(t, string(before.UID))
	rulesBefore := beforeNS.Exec(t, "nft", "-a", "list", "ruleset")
	connects := w.standin.Connects()

	pods, sandboxes := enrolledPods(w, "surge", 40)
	stream := w.streamAdds(t, pods, sandboxes, 50*time.Millisecond)
	w.eventually("the stream under way", func() bool { return stream.progress() >= 5 })
	second := w.startAgentProcess(bin)
	if at := stream.progress(); at >= len(pods) {
		t.Fatalf("the stream ended (%d ADDs) before the hand-over: it proves nothing", at)
	}
	if failed := stream.wait(t); len(failed) > 0 {
		t.Fatalf("%d of %d ADDs failed across the hand-over:\n%v", len(failed), len(pods), failed)
	}
	if n := second.metric(t, `inpod_agent_handovers_total{role="taken"}`); n != 1 {
		t.Fatalf("the second agent took the node over %v times, want 1", n)
	}
	w.eventually("the first agent's ports closed", func() bool { return portClosed(first.health) && portClosed(first.metrics) })
	if first.exited() {
		t.Fatal("the retired agent exited on its own: the kubelet would restart it")
	}
	w.eventually("ztunnel reconnected to the second agent with every pod", func() bool {
		if w.standin.Connects() <= connects || !w.standin.SnapshotDone() {
			return false
		}
		got := w.standin.Workloads()
		for _, p := range append(pods, before) {
			if _, ok := got[string(p.UID)]; !ok {
				return false
			}
		}
		return true
	})
	if after := beforeNS.Exec(t, "nft", "-a", "list", "ruleset"); after != rulesBefore {
		t.Fatalf("the hand-over rewrote an enrolled pod's rules:\nbefore:\n%s\nafter:\n%s", rulesBefore, after)
	}

	first.stop(t)
	for _, path := range []string{w.cfg.CNISocket, w.cfg.ZDSSocket, handoverSocket(w)} {
		if _, err := os.Stat(path); err != nil {
			t.Fatalf("the retired agent's exit removed %s: %v", path, err)
		}
	}
	late, lateNS := w.pod("mesh", "after")
	if _, err := w.cniAdd(late, lateNS); err != nil {
		t.Fatalf("an ADD after the retired agent exited: %v", err)
	}
	if w.kubelet.Allocatable("inpod.dev/redirection") != 4 {
		t.Fatalf("the kubelet sees %d Healthy devices after the hand-over, want 4", w.kubelet.Allocatable("inpod.dev/redirection"))
	}
}

func handoverSocket(w *world) string {
	return filepath.Join(filepath.Dir(w.cfg.CNISocket), "handover.sock")
}

// A successor killed once it holds the node leaves nobody serving: an
// enrolled pod's ADD fails closed, and the next agent binds the sockets
// afresh and serves. Two agents started at once on a served node end with
// exactly one serving: the newest, after the first passes the node on.
func TestIntegrationHandOverFailuresLeaveOneAgentServing(t *testing.T) {
	w := newWorld(t)
	bin := buildAgent(t)
	first := w.startAgentProcess(bin)
	second := w.startAgentProcess(bin)
	if n := second.metric(t, `inpod_agent_handovers_total{role="taken"}`); n != 1 {
		t.Fatalf("the second agent took the node over %v times, want 1", n)
	}
	second.cmd.Process.Signal(syscall.SIGKILL)
	second.cmd.Wait()
	pod, sandbox := w.pod("mesh", "nobody")
	if _, err := w.cniAdd(pod, sandbox); err == nil {
		t.Fatal("an enrolled pod's ADD succeeded with no agent serving")
	}
	if hasRules(t, sandbox) {
		t.Fatal("a failed ADD left rules")
	}
	third := w.startAgentProcess(bin)
	if n := third.metric(t, `inpod_agent_handovers_total{role="taken"}`); n != 0 {
		t.Fatalf("the third agent took over %v times from nobody", n)
	}
	// As a runtime retries: DEL, then ADD.
	if _, err := w.cni("DEL", pod, sandbox, "c-"+pod.Name); err != nil {
		t.Fatalf("the DEL after the failed ADD: %v", err)
	}
	if _, err := w.cniAdd(pod, sandbox); err != nil {
		t.Fatalf("the ADD retried once the third agent serves: %v", err)
	}
	if first.exited() {
		t.Fatal("the retired first agent exited on its own")
	}

	// Two at once: each asks the third; whichever it serves first passes
	// the node on to the other if that one is newer, or refuses it.
	fourth, fifth := w.startAgentProcessNoWait(bin), w.startAgentProcessNoWait(bin)
	w.eventually("one of the two serving", func() bool { return ready(fourth) || ready(fifth) })
	serving := 0
	for _, p := range []*agentProcess{third, fourth, fifth} {
		if !portClosed(p.health) && ready(p) {
			serving++
		}
	}
	if serving != 1 {
		t.Fatalf("%d agents serve, want 1", serving)
	}
	late, lateNS := w.pod("mesh", "late")
	if _, err := w.cniAdd(late, lateNS); err != nil {
		t.Fatalf("an ADD after two agents started at once: %v", err)
	}
}

// Two agent pods of one node created within one second (an upgrade right
// after the install, or two in a row): the API keeps creation times to the
// second, so without a tie-break the two would rank equal, refuse each
// other, and the rollout would stall. The pod of the newer DaemonSet
// template (its pod-template-generation label) takes the node over.
func TestIntegrationHandOverTieWithinASecondGoesToTheNewerTemplate(t *testing.T) {
	w := newWorld(t)
	w.applyRBAC()
	bin := buildAgent(t)
	ds, _ := w.agentDaemonSet("inpod-agent")
	var older, newer *corev1.Pod
	testkit.Eventually(t, 20*time.Second, "two agent pods created within one second", func() bool {
		older, newer = w.agentPodOfGeneration(ds, 1), w.agentPodOfGeneration(ds, 2)
		if older.CreationTimestamp.Equal(&newer.CreationTimestamp) {
			return true
		}
		for _, p := range []*corev1.Pod{older, newer} {
			if err := w.client.CoreV1().Pods(p.Namespace).Delete(context.Background(), p.Name, metav1.DeleteOptions{}); err != nil {
				t.Fatal(err)
			}
		}
		return false
	})
	w.agentArgs = []string{"--pod-name", older.Name, "--pod-namespace", older.Namespace}
	first := w.startAgentProcess(bin)
	w.agentArgs = []string{"--pod-name", newer.Name, "--pod-namespace", newer.Namespace}
	second := w.startAgentProcess(bin)
	if n := second.metric(t, `inpod_agent_handovers_total{role="taken"}`); n != 1 {
		t.Fatalf("the newer template's agent took the node over %v times, want 1", n)
	}
	w.eventually("the older agent's ports closed", func() bool { return portClosed(first.health) && portClosed(first.metrics) })
	pod, sandbox := w.pod("mesh", "after-tie")
	if _, err := w.cniAdd(pod, sandbox); err != nil {
		t.Fatalf("an ADD after the hand-over: %v", err)
	}
}

// agentPodOfGeneration is an agent pod of ds on this node as the DaemonSet
// controller makes it from the template of that generation.
func (w *world) agentPodOfGeneration(ds *appsv1.DaemonSet, generation int) *corev1.Pod {
	w.t.Helper()
	return w.agentPodLabelled(ds, nodeName, withLabel(ds.Spec.Template.Labels, "pod-template-generation", strconv.Itoa(generation)))
}
