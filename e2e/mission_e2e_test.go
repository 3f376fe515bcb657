//go:build e2e

package e2e

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"net"
	"os"
	osexec "os/exec"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"

	"golang.org/x/sys/unix"

	"github.com/inpod-dev/inpod/e2e/chart"
	"github.com/inpod-dev/inpod/e2e/cluster"
	"github.com/inpod-dev/inpod/internal/testkit"
	"github.com/inpod-dev/inpod/nodecondition"
)

// The agent's metrics port as the chart sets it (ports.metrics).
const agentMetricsPort = 15020

// ownedConflist is inpod's own CNI configuration file as the chart names it
// (cni.ownedConfigFile).
const ownedConflist = "00-inpod.conflist"

// holdLabel keeps the agent DaemonSet off the node while the node does not
// carry it: inpod "not installed here yet", or its agent stopped.
const holdLabel = "inpod-e2e-hold"

// nodeState is what inpod may change on a node and must give back at
// uninstall.
type nodeState struct {
	conflist   []byte
	confFiles  []string
	cniBins    []string
	hostTables []string
	conditions []string
	resources  string
}

func captureNodeState(t *testing.T, ctx context.Context, node *cluster.Node) nodeState {
	t.Helper()
	var s nodeState
	var err error
	if s.conflist, err = os.ReadFile(filepath.Join(node.CNIConf, "10-e2e.conflist")); err != nil {
		t.Fatal(err)
	}
	entries, err := os.ReadDir(node.CNIBin)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		s.cniBins = append(s.cniBins, e.Name())
	}
	if entries, err = os.ReadDir(node.CNIConf); err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		s.confFiles = append(s.confFiles, e.Name())
	}
	out, err := osexec.Command("nft", "list", "tables").Output()
	if err != nil {
		t.Fatal(err)
	}
	s.hostTables = strings.Split(strings.TrimSpace(string(out)), "\n")
	sort.Strings(s.hostTables)
	n, err := node.Client.CoreV1().Nodes().Get(ctx, node.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range n.Status.Conditions {
		s.conditions = append(s.conditions, string(c.Type))
	}
	sort.Strings(s.conditions)
	q := n.Status.Allocatable[gateResource]
	s.resources = fmt.Sprintf("allocatable %s=%d", gateResource, q.Value())
	return s
}

// TestE2EMission proves inpod's promise on the real node the way a platform
// engineer would before trusting it: inpod installed with its chart
// (deviceplugin gate, the shipped admission policy adding the request), the
// ztunnel stand-in as a DaemonSet, and every check on real cluster state
// and real traffic. The scenarios run in order on one node, each starting
// from the state the previous one left.
func TestE2EMission(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 25*time.Minute)
	defer cancel()
	c := newChartNode(ctx, t, "/var/lib/inpod-e2e-mission")
	node, client := c.Node, c.Client
	// A pod outside the mesh and its Service, running before inpod.
	peer := runTestApp(t, ctx, node, "plain", "peer")
	svc, err := client.CoreV1().Services("plain").Create(ctx, &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "peer"},
		Spec: corev1.ServiceSpec{Selector: map[string]string{"app": "peer"},
			Ports: []corev1.ServicePort{{Port: 80, TargetPort: intstr.FromInt32(8080)}}},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	before := captureNodeState(t, ctx, node)
	conflist := filepath.Join(node.CNIConf, "10-e2e.conflist")
	// The chain the runtime would use for a new sandbox ends with
	// inpod-cni (the chart's default: in inpod's own file).
	chained := func() bool { return testkit.RuntimeChainEndsWith(node.CNIConf, "inpod-cni") }
	// hold takes the agent off the node (its DaemonSet selects
	// holdLabel=here), as a drain of the DaemonSet would stop it: SIGTERM,
	// then gone.
	hold := func(t *testing.T, on bool) {
		t.Helper()
		value := "here"
		if on {
			value = "away"
		}
		patch := fmt.Sprintf(`{"metadata":{"labels":{%q:%q}}}`, holdLabel, value)
		if _, err := client.CoreV1().Nodes().Patch(ctx, node.Name, types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	install := func(t *testing.T) { c.install(t, "--set", "agent.nodeSelector."+holdLabel+"=here") }
	// away stops the agent as a bad upgrade does, its DaemonSet still
	// selecting the node: the new template's agent cannot start (its
	// image's plugin directory is wrong), so the old agent is replaced
	// (a restart: inpod stays on the node) and the new one crash-loops.
	// (Taking the node out of the DaemonSet instead is a removal from the
	// node: TestE2ENodeLeavesTheDaemonSet.)
	// away replaces the agent by one that cannot start, or back. The
	// chart's surge would keep the working agent until the new one is
	// ready (never, for this one): the replacement rolls without one.
	away := func(t *testing.T, on bool) {
		t.Helper()
		env, strategy := `{"name":"INPOD_CNI_SOURCE_DIR","value":"/no-such-dir"}`, `{"maxSurge":0,"maxUnavailable":1}`
		if !on {
			env, strategy = `{"name":"INPOD_CNI_SOURCE_DIR","$patch":"delete"}`, `{"maxSurge":1,"maxUnavailable":0}`
		}
		patch := `{"spec":{"updateStrategy":{"rollingUpdate":` + strategy + `},"template":{"spec":{"containers":[{"name":"agent","env":[` + env + `]}]}}}}`
		if _, err := client.AppsV1().DaemonSets(chart.Namespace).Patch(ctx, "inpod-agent", types.StrategicMergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	var app *corev1.Pod

	ok := t.Run("1 gate closed before readiness", func(t *testing.T) {
		// The chart installed, but its agent not on this node yet: the
		// policy adds the request, no node offers it.
		hold(t, true)
		install(t)
		c.waitRequestPolicy(t)
		c.create(t, testAppPod("mesh", "app"))
		testkit.Eventually(t, time.Minute, "the enrolled pod Pending, the scheduler naming "+string(gateResource), func() bool {
			return unschedulableFor(ctx, node, "mesh", "app", string(gateResource))
		})
		p, err := client.CoreV1().Pods("mesh").Get(ctx, "app", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if q := p.Spec.Containers[0].Resources.Limits[gateResource]; q.Value() != 1 {
			t.Fatalf("the enrolled pod has no %s: the chart's admission policy did not add it", gateResource)
		}
		// The agent arrives and chains the plugin; no ztunnel yet, so the
		// node is still not ready and the pod still waits.
		hold(t, false)
		testkit.Eventually(t, 2*time.Minute, "the plugin chained by the agent", chained)
		testkit.Eventually(t, time.Minute, "the agent's metrics: connected to no ztunnel, not ready", func() bool {
			return agentMetric(agentMetricsPort, "inpod_node_ready") == 0
		})
		if !unschedulableFor(ctx, node, "mesh", "app", string(gateResource)) {
			t.Fatalf("the enrolled pod was scheduled before ztunnel connected: %s", podState(t, ctx, node, "mesh", "app"))
		}
		c.standInUp(t)
		app = waitReady(t, ctx, node, "mesh", "app")
		c.enrolled(t, app)
		// The kubelet's readiness probe went through (app Ready) on the
		// probe path: SNATed to 169.254.7.127 and let through, not
		// redirected to ztunnel.
		logs, err := client.CoreV1().Pods("mesh").GetLogs("app", &corev1.PodLogOptions{}).DoRaw(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(string(logs), "connection from 169.254.7.127:") {
			t.Fatalf("the app saw no probe from 169.254.7.127 (the SNATed kubelet probe):\n%s", logs)
		}
		c.inbound(t, app)
		// Outbound from an enrolled pod: to a pod and to a Service IP,
		// both at ztunnel's outbound listener with the original
		// destination (the Service IP, not a backend: no kube-proxy
		// rewrote it first in the pod's netns).
		for _, dst := range []string{peer.Status.PodIP + ":8080", svc.Spec.ClusterIP + ":80"} {
			reply := c.dial(t, "mesh", dst)
			if want := "ztunnel-standin port=15001 orig=" + dst; !strings.Contains(reply, want) {
				t.Fatalf("an enrolled pod's connection to %s got %q, want ztunnel's outbound listener (%s)", dst, reply, want)
			}
		}
		// Outside the mesh: straight to the app, nothing redirected.
		reply := c.dial(t, "plain", peer.Status.PodIP+":8080")
		if want := "testapp host=peer orig=" + peer.Status.PodIP + ":8080"; !strings.Contains(reply, want) {
			t.Fatalf("a plain pod's connection to a plain pod got %q, want the app itself (%s)", reply, want)
		}
		if got := listenersAtStart(t, ctx, node, "plain", "peer"); got != "[]" {
			t.Fatalf("the plain pod had ztunnel listeners %s", got)
		}
		if redirectsInKernel(t, peer.Status.PodIP) {
			t.Fatal("the plain pod has redirection rules")
		}
	})
	if !ok {
		return
	}

	ok = t.Run("2 ztunnel gone", func(t *testing.T) {
		appState := podState(t, ctx, node, "mesh", "app")
		c.standInDown(t)
		closed := testkit.Eventually(t, time.Minute, "the gate closed on the Node (allocatable 0)", func() bool {
			return allocatable(ctx, node, gateResource) == 0
		})
		t.Logf("ztunnel gone → the scheduler sees the gate closed (deviceplugin: Node allocatable 0): %s", closed.Round(10*time.Millisecond))
		// Opted out of DNS capture, as Istio's annotation says: the
		// chart captures DNS by default.
		waitingPod := testAppPod("mesh", "waiting")
		waitingPod.Annotations = map[string]string{"ambient.istio.io/dns-capture": "false"}
		c.create(t, waitingPod)
		testkit.Eventually(t, time.Minute, "a new enrolled pod Pending", func() bool {
			return unschedulableFor(ctx, node, "mesh", "waiting", string(gateResource))
		})
		if got := podState(t, ctx, node, "mesh", "app"); got != appState {
			t.Fatalf("the running enrolled pod was disturbed: %s, was %s", got, appState)
		}
		c.standInUp(t)
		waiting := waitReady(t, ctx, node, "mesh", "waiting")
		c.enrolled(t, waiting)
		if rules := netnsRuleset(t, podNetns(t, waiting.Status.PodIP)); strings.Contains(rules, "15053") || !strings.Contains(rules, "15001") {
			t.Fatalf("the pod opted out of DNS capture has DNS rules, or no outbound rules:\n%s", rules)
		}
		if rules := netnsRuleset(t, podNetns(t, app.Status.PodIP)); !strings.Contains(rules, "15053") {
			t.Fatalf("the enrolled pod without the annotation has no DNS rules (the chart's default captures DNS):\n%s", rules)
		}
		// The new ztunnel got the running pod in its snapshot: it answers
		// in the pod again.
		c.inbound(t, app)
		if got := podState(t, ctx, node, "mesh", "app"); got != appState {
			t.Fatalf("the running enrolled pod was disturbed: %s, was %s", got, appState)
		}
	})
	if !ok {
		return
	}

	ok = t.Run("3 agent restart", func(t *testing.T) {
		netns := podNetns(t, app.Status.PodIP)
		rules := netnsRuleset(t, netns)
		// An open connection to the enrolled pod (from the node: the
		// probe path, straight to the app through the pod's rules).
		conn, err := net.DialTimeout("tcp", app.Status.PodIP+":8081", 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		r := bufio.NewReader(conn)
		echo := func(line string) {
			t.Helper()
			conn.SetDeadline(time.Now().Add(5 * time.Second))
			if _, err := fmt.Fprintln(conn, line); err != nil {
				t.Fatalf("the open connection: %v", err)
			}
			got, err := r.ReadString('\n')
			if err != nil || strings.TrimSpace(got) != line {
				t.Fatalf("the open connection answered %q, %v", got, err)
			}
		}
		echo("before")
		appState := podState(t, ctx, node, "mesh", "app")
		// Rules an agent killed mid-removal could leave: inpod's table, as
		// the enrolled pod has it, in the plain pod's netns. The new agent
		// must sweep them out at its start.
		peerNS := podNetns(t, peer.Status.PodIP)
		strayRules(t, netns, peerNS)
		old := agentReady(t, ctx, node)
		if err := client.CoreV1().Pods(chart.Namespace).Delete(ctx, old, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
		testkit.Eventually(t, 2*time.Minute, "a new agent pod Ready", func() bool {
			name := agentReady(t, ctx, node)
			return name != "" && name != old
		})
		echo("after")
		if got := netnsRuleset(t, netns); got != rules {
			t.Fatalf("the agent's restart rewrote the running pod's rules:\nbefore:\n%s\nafter:\n%s", rules, got)
		}
		if got := podState(t, ctx, node, "mesh", "app"); got != appState {
			t.Fatalf("the enrolled pod was disturbed: %s, was %s", got, appState)
		}
		c.inbound(t, app)
		c.sweptAtStart(t, peer, peerNS)
	})
	if !ok {
		return
	}

	ok = t.Run("4 fail closed with the agent stopped and the gate bypassed", func(t *testing.T) {
		// The request's policy out of the way (as when it failed, with
		// failurePolicy Ignore) and the agent stopped.
		requestBindings := []string{"inpod-redirection-request-pod-label", "inpod-redirection-request-namespace-label"}
		for _, b := range requestBindings {
			if err := client.AdmissionregistrationV1().MutatingAdmissionPolicyBindings().Delete(ctx, b, metav1.DeleteOptions{}); err != nil {
				t.Fatal(err)
			}
		}
		old := agentReady(t, ctx, node)
		away(t, true)
		testkit.Eventually(t, 2*time.Minute, "the agent replaced by one that cannot start", func() bool {
			return podGone(ctx, node, chart.Namespace, old) && agentReady(t, ctx, node) == "" && agentMetric(agentMetricsPort, "inpod_node_ready") < 0
		})
		if !chained() {
			t.Fatal("the stopped agent took the plugin out of the chain: enrolled pods would start unredirected")
		}
		// With the agent away, the primary CNI writes its configuration
		// again, as its installer does at every start (a reboot): the
		// chain the runtime uses must still end with inpod-cni.
		if err := os.WriteFile(conflist, before.conflist, 0o644); err != nil {
			t.Fatal(err)
		}
		if !chained() {
			t.Fatal("the primary's rewrite took inpod-cni out of the runtime's chain while the agent is away")
		}
		p := testAppPod("mesh", "bypassed")
		p.Spec.NodeName = node.Name
		// A policy removed a moment ago may still act for a few seconds:
		// retry until a pod is created without the request.
		testkit.Eventually(t, time.Minute, "an enrolled pod created without the request", func() bool {
			got, err := client.CoreV1().Pods("mesh").Create(ctx, p, metav1.CreateOptions{})
			if err != nil {
				t.Fatal(err)
			}
			if _, has := got.Spec.Containers[0].Resources.Limits[gateResource]; !has {
				return true
			}
			zero := int64(0)
			client.CoreV1().Pods("mesh").Delete(ctx, "bypassed", metav1.DeleteOptions{GracePeriodSeconds: &zero})
			waitPodsGone(t, ctx, node, "mesh", "app=bypassed")
			return false
		})
		var msg string
		testkit.Eventually(t, 2*time.Minute, "an event naming inpod on the waiting pod", func() bool {
			got, err := client.CoreV1().Pods("mesh").Get(ctx, "bypassed", metav1.GetOptions{})
			if err != nil {
				t.Fatal(err)
			}
			if got.Status.Phase == corev1.PodRunning {
				t.Fatalf("an enrolled pod ran while the agent was stopped: %s", podState(t, ctx, node, "mesh", "bypassed"))
			}
			msg = eventFor(ctx, node, "mesh", "bypassed", "FailedCreatePodSandBox", "inpod")
			return msg != ""
		})
		t.Logf("the pod waits: %s", msg)
		away(t, false)
		bypassed := waitReady(t, ctx, node, "mesh", "bypassed")
		c.enrolled(t, bypassed)
		c.inbound(t, bypassed)
		// The policy back, as the chart has it.
		install(t)
		// Named, not counted: the chart's other policies have bindings too.
		testkit.Eventually(t, time.Minute, "the policy's bindings restored by helm", func() bool {
			for _, b := range requestBindings {
				if _, err := client.AdmissionregistrationV1().MutatingAdmissionPolicyBindings().Get(ctx, b, metav1.GetOptions{}); err != nil {
					return false
				}
			}
			return true
		})
	})
	if !ok {
		return
	}

	ok = t.Run("5 kubelet restart", func(t *testing.T) {
		agentPod := agentReady(t, ctx, node)
		agentState := podState(t, ctx, node, chart.Namespace, agentPod)
		registrations := mustAgentMetric(t, agentMetricsPort, "inpod_deviceplugin_registrations_total")
		if err := node.RestartKubelet(ctx); err != nil {
			t.Fatal(err)
		}
		testkit.Eventually(t, time.Minute, "the device plugin registered again", func() bool {
			return agentMetric(agentMetricsPort, "inpod_deviceplugin_registrations_total") > registrations
		})
		// The restarted kubelet knows no device until the plugin
		// registered again: a pod it admits proves the registration.
		c.create(t, testAppPod("mesh", "after-kubelet"))
		c.enrolled(t, waitReady(t, ctx, node, "mesh", "after-kubelet"))
		testkit.Eventually(t, time.Minute, "allocatable back on the Node", func() bool {
			return allocatable(ctx, node, gateResource) > 0
		})
		if got := podState(t, ctx, node, chart.Namespace, agentPod); got != agentState {
			t.Fatalf("the agent restarted: %s, was %s", got, agentState)
		}
	})
	if !ok {
		return
	}

	ok = t.Run("6 conflist clobbered", func(t *testing.T) {
		repairs := mustAgentMetric(t, agentMetricsPort, "inpod_cni_repairs_total")
		transitions := mustAgentMetric(t, agentMetricsPort, "inpod_node_ready_transitions_total")
		// Something cleans the directory of files it does not know
		// (inpod's own) and the primary CNI writes its configuration
		// again: the runtime's chain lacks inpod until the agent's repair;
		// enrolled pods keep being created meanwhile.
		if err := os.Remove(filepath.Join(node.CNIConf, ownedConflist)); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(conflist, before.conflist, 0o644); err != nil {
			t.Fatal(err)
		}
		const n = 4
		for i := range n {
			c.create(t, testAppPod("mesh", fmt.Sprintf("during-clobber-%d", i)))
		}
		testkit.Eventually(t, time.Minute, "the agent repaired the chain", func() bool {
			return chained() && agentMetric(agentMetricsPort, "inpod_cni_repairs_total") > repairs
		})
		testkit.Eventually(t, time.Minute, "readiness dropped and returned", func() bool {
			return agentMetric(agentMetricsPort, "inpod_node_ready_transitions_total") >= transitions+2 &&
				agentMetric(agentMetricsPort, "inpod_node_ready") == 1
		})
		for i := range n {
			c.enrolled(t, waitReady(t, ctx, node, "mesh", fmt.Sprintf("during-clobber-%d", i)))
		}
	})
	if !ok {
		return
	}

	// 7, the taint and DRA gates installed by their chart values:
	// TestE2EChartTaintMode and TestE2EChartDRAMode.

	ok = t.Run("11 tampered rules repaired by the verifier, a plain pod untouched", func(t *testing.T) {
		// The running enrolled pod's netfilter tables flushed from inside
		// its netns; the plain pod watched through the verifier's rounds.
		c.verifierRepairs(t, app, peer)
	})
	if !ok {
		return
	}

	ok = t.Run("12 the node leaves the DaemonSet", func(t *testing.T) {
		// The node relabelled out of the agent's node selector: its
		// DaemonSet is in place, but no agent will run here again. The
		// departing agent removes inpod as an uninstall does; left, the
		// plugin would fail every pod's ADD once its token expired.
		peerState := podState(t, ctx, node, "plain", "peer")
		labelled := func() bool {
			n, err := client.CoreV1().Nodes().Get(ctx, node.Name, metav1.GetOptions{})
			return err == nil && n.Labels["inpod.dev/cni-installed"] == "true"
		}
		if !labelled() {
			t.Fatal("the Node lacks inpod.dev/cni-installed while inpod-cni is in its chain")
		}

		// First an agent that leaves without cleaning: frozen, then killed
		// as its pod is force-deleted while the node leaves the DaemonSet
		// (a node cut off during the removal). inpod stays on the node, the
		// label with it, and helm uninstall names the node instead of
		// deleting the agent's RBAC as if all were well.
		pids, _, err := freezeProcs(node.Containerd, "inpod-agent")
		if err != nil {
			t.Fatal(err)
		}
		hold(t, true)
		zero := int64(0)
		if err := client.CoreV1().Pods(chart.Namespace).DeleteCollection(ctx, metav1.DeleteOptions{GracePeriodSeconds: &zero},
			metav1.ListOptions{LabelSelector: "app.kubernetes.io/component=agent"}); err != nil {
			t.Fatal(err)
		}
		for _, pid := range pids {
			unix.Kill(pid, unix.SIGKILL)
		}
		waitPodsGone(t, ctx, node, chart.Namespace, "app.kubernetes.io/component=agent")
		if !chained() || !labelled() {
			t.Fatal("the killed agent's node lost inpod-cni or its label: nothing ran to remove them")
		}
		if _, err := c.target.Helm(ctx, c.repo, "uninstall", chart.Release, "-n", chart.Namespace, "--wait", "--timeout", "3m"); err == nil {
			t.Fatal("helm uninstall succeeded with a node that still chains inpod-cni and has no agent")
		}
		hookLog := ""
		testkit.Eventually(t, time.Minute, "the uninstall hook's log naming the node", func() bool {
			hookLog = jobLog(ctx, node, chart.Namespace, "app.kubernetes.io/component=uninstall-hook")
			return strings.Contains(hookLog, "node(s) "+node.Name+":") && strings.Contains(hookLog, "inpod.dev/cni-installed") && strings.Contains(hookLog, "--no-hooks")
		})
		t.Logf("helm uninstall stopped by its hook: %s", hookLog)
		// Finished as the hook says (the node is not cleaned by hand here:
		// installed again, the agent back on the node takes over what the
		// killed one left).
		if _, err := c.target.Helm(ctx, c.repo, "uninstall", chart.Release, "-n", chart.Namespace, "--no-hooks", "--wait", "--timeout", "3m"); err != nil {
			t.Fatal(err)
		}
		install(t)
		hold(t, false)
		testkit.Eventually(t, 2*time.Minute, "the agent back", func() bool { return agentReady(t, ctx, node) != "" && chained() })
		c.inbound(t, app)

		// Now a clean departure.
		hold(t, true)
		waitPodsGone(t, ctx, node, chart.Namespace, "app.kubernetes.io/component=agent")
		gone := func(name string) bool { _, err := os.Stat(name); return os.IsNotExist(err) }
		testkit.Eventually(t, 10*time.Second, "inpod removed from the node: chain, inpod's file, access file, binaries, host table", func() bool {
			return !chained() && gone(filepath.Join(node.CNIConf, ownedConflist)) && gone(filepath.Join(node.CNIConf, "inpod-api-access")) &&
				gone(filepath.Join(node.CNIBin, "inpod-cni")) && !strings.Contains(nftTables(t), "inpod-host")
		})
		if redirectsInKernel(t, app.Status.PodIP) {
			t.Fatal("the enrolled pod kept its rules on a node inpod left")
		}
		if labelled() {
			t.Fatal("the Node kept inpod.dev/cni-installed after inpod left it")
		}
		// Nothing of inpod is in a new pod's way: no plugin, no token to
		// expire.
		c.create(t, testAppPod("plain", "after-leaving"))
		waitReady(t, ctx, node, "plain", "after-leaving")
		if got := podState(t, ctx, node, "plain", "peer"); got != peerState {
			t.Fatalf("leaving disturbed the plain pod: %s, was %s", got, peerState)
		}
		// Back on the node: the agent finds the enrolled pod running
		// without redirection since inpod left, says so, and redirects it
		// in place.
		hold(t, false)
		testkit.Eventually(t, 2*time.Minute, "the agent back, the plugin chained", func() bool { return agentReady(t, ctx, node) != "" && chained() })
		testkit.Eventually(t, time.Minute, "a RanUnredirected event on the enrolled pod", func() bool {
			return eventFor(ctx, node, "mesh", "app", "RanUnredirected", "ran outside the mesh") != ""
		})
		testkit.Eventually(t, time.Minute, "the enrolled pod redirected in place", func() bool { return redirectsInKernel(t, app.Status.PodIP) })
		c.inbound(t, app)
	})
	if !ok {
		return
	}

	t.Run("8 uninstall", func(t *testing.T) {
		appState := podState(t, ctx, node, "mesh", "app")
		peerState := podState(t, ctx, node, "plain", "peer")
		c.standInDown(t)
		if _, err := c.target.Helm(ctx, c.repo, "uninstall", chart.Release, "-n", chart.Namespace, "--wait", "--timeout", "3m"); err != nil {
			t.Fatal(err)
		}
		waitPodsGone(t, ctx, node, chart.Namespace, "app.kubernetes.io/component=agent")
		testkit.Eventually(t, time.Minute, "the node as it was before install", func() bool {
			after := captureNodeState(t, ctx, node)
			return bytes.Equal(after.conflist, before.conflist) && strings.Join(after.cniBins, " ") == strings.Join(before.cniBins, " ") &&
				strings.Join(after.confFiles, " ") == strings.Join(before.confFiles, " ") &&
				strings.Join(after.hostTables, ",") == strings.Join(before.hostTables, ",") &&
				strings.Join(after.conditions, ",") == strings.Join(before.conditions, ",") && after.resources == before.resources
		})
		n, err := client.CoreV1().Nodes().Get(ctx, node.Name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		for _, c := range n.Status.Conditions {
			if c.Type == nodecondition.ConditionType {
				t.Fatalf("the Node keeps %s", c.Type)
			}
		}
		if got := podState(t, ctx, node, "mesh", "app"); got != appState {
			t.Fatalf("uninstall disturbed the enrolled pod: %s, was %s", got, appState)
		}
		if got := podState(t, ctx, node, "plain", "peer"); got != peerState {
			t.Fatalf("uninstall disturbed the plain pod: %s, was %s", got, peerState)
		}
		reply := c.dial(t, "plain", peer.Status.PodIP+":8080")
		if !strings.Contains(reply, "testapp host=peer") {
			t.Fatalf("after uninstall a plain pod's connection got %q", reply)
		}
	})
}

// nftTables is the node's nf_tables tables, one per line.
func nftTables(t *testing.T) string {
	t.Helper()
	out, err := osexec.Command("nft", "list", "tables").Output()
	if err != nil {
		t.Fatal(err)
	}
	return string(out)
}

// podGone says whether the pod named is gone from the API.
func podGone(ctx context.Context, node *cluster.Node, ns, name string) bool {
	_, err := node.Client.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
	return apierrors.IsNotFound(err)
}

// jobLog is the log of the first pod selector selects in ns.
func jobLog(ctx context.Context, node *cluster.Node, ns, selector string) string {
	pods, err := node.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: selector})
	if err != nil || len(pods.Items) == 0 {
		return ""
	}
	out, err := node.Client.CoreV1().Pods(ns).GetLogs(pods.Items[0].Name, &corev1.PodLogOptions{}).DoRaw(ctx)
	if err != nil {
		return ""
	}
	return string(out)
}
