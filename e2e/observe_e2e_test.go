//go:build e2e

package e2e

import (
	"bufio"
	"context"
	"fmt"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/inpod-dev/inpod/agent/podnetns"
	"github.com/inpod-dev/inpod/e2e/cluster"
	"github.com/inpod-dev/inpod/internal/testkit"
)

// What the end-to-end tests read from outside inpod: the kernel's view of a
// pod's netns, the API's view of a pod, and the agent's metrics.

// podNetns is the name under /run/netns of the netns that holds ip (the
// runtime's cni-… netns of the pod with that address). Addresses are read
// over netlink in this process: other tests on the machine may leave
// hundreds of netns there, and an exec of ip per netns per pod made a check
// of 100 pods take many minutes on a loaded machine.
func podNetns(t testing.TB, ip string) string {
	t.Helper()
	want, err := netip.ParseAddr(ip)
	if err != nil {
		t.Fatalf("pod IP %q: %v", ip, err)
	}
	entries, err := os.ReadDir("/run/netns")
	if err != nil {
		t.Fatal(err)
	}
	var holders []string
	for _, e := range entries {
		if !strings.HasPrefix(e.Name(), "cni-") {
			continue
		}
		if netnsHolds(filepath.Join("/run/netns", e.Name()), want) {
			holders = append(holders, e.Name())
		}
	}
	switch len(holders) {
	case 0:
		t.Fatalf("no cni- netns under /run/netns holds %s", ip)
	case 1:
		return holders[0]
	}
	// Reading whichever came first once made a check judge another pod.
	t.Fatalf("%d netns under /run/netns hold %s (%s): a stale one cannot be told from the pod's", len(holders), ip, strings.Join(holders, " "))
	return ""
}

// netnsHolds reports whether the netns at path has ip on an interface (a
// netns gone meanwhile holds nothing).
func netnsHolds(path string, ip netip.Addr) bool {
	f, err := os.Open(path)
	if err != nil {
		return false
	}
	defer f.Close()
	return podnetns.HoldsAny(f, []netip.Addr{ip})
}

// netnsRuleset is the nf_tables ruleset of a netns with object handles and
// without counters (-s): a table deleted and written again gets new
// handles, so equal output means nothing was rewritten.
func netnsRuleset(t testing.TB, netns string) string {
	t.Helper()
	out, err := exec.Command("ip", "netns", "exec", netns, "nft", "-a", "-s", "list", "ruleset").CombinedOutput()
	if err != nil {
		t.Fatalf("nft in %s: %v: %s", netns, err, out)
	}
	return strings.TrimSpace(string(out))
}

// redirectsInKernel reports whether the pod with ip has inpod's rules in
// its netns (the nat chains that send TCP to 15001 and 15006).
func redirectsInKernel(t *testing.T, ip string) bool {
	t.Helper()
	rules := netnsRuleset(t, podNetns(t, ip))
	return strings.Contains(rules, "15001") && strings.Contains(rules, "15006")
}

// listenersAtStart is what testapp printed at start: which of ztunnel's
// listeners were bound in its netns before the app ran ("[15001 15006
// 15008]" for a redirected pod, "[]" otherwise).
func listenersAtStart(t *testing.T, ctx context.Context, node *cluster.Node, ns, name string) string {
	t.Helper()
	out, err := node.Client.CoreV1().Pods(ns).GetLogs(name, &corev1.PodLogOptions{}).DoRaw(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(out), "\n") {
		if v, ok := strings.CutPrefix(line, "ztunnel listeners at start: "); ok {
			return v
		}
	}
	t.Fatalf("%s/%s logged no listeners line:\n%s", ns, name, out)
	return ""
}

const allListeners = "[15001 15006 15008]"

// unschedulableFor reports whether the scheduler left the pod Pending with
// a message naming what.
func unschedulableFor(ctx context.Context, node *cluster.Node, ns, name, what string) bool {
	p, err := node.Client.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
	if err != nil || p.Spec.NodeName != "" {
		return false
	}
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodScheduled && c.Status == corev1.ConditionFalse && strings.Contains(c.Message, what) {
			return true
		}
	}
	return false
}

// eventFor is the message of the first Event on the pod with reason whose
// message contains substr, or "".
func eventFor(ctx context.Context, node *cluster.Node, ns, name, reason, substr string) string {
	evs, err := node.Client.CoreV1().Events(ns).List(ctx, metav1.ListOptions{FieldSelector: "involvedObject.name=" + name})
	if err != nil {
		return ""
	}
	for _, e := range evs.Items {
		if e.Reason == reason && strings.Contains(e.Message, substr) {
			return e.Message
		}
	}
	return ""
}

// podState is the pod's phase, the restarts of its first container and its
// UID, for "not disturbed" checks.
func podState(t *testing.T, ctx context.Context, node *cluster.Node, ns, name string) string {
	t.Helper()
	p, err := node.Client.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	restarts := int32(-1)
	if len(p.Status.ContainerStatuses) > 0 {
		restarts = p.Status.ContainerStatuses[0].RestartCount
	}
	return fmt.Sprintf("%s uid=%s restarts=%d", p.Status.Phase, p.UID, restarts)
}

// agentMetric sums the samples of a series on the agent's metrics port
// (the agent runs in the host netns); -1 when it cannot be read.
func agentMetric(port int, name string) float64 {
	c := http.Client{Timeout: 2 * time.Second}
	resp, err := c.Get(fmt.Sprintf("http://127.0.0.1:%d/metrics", port))
	if err != nil {
		return -1
	}
	defer resp.Body.Close()
	sum, seen := 0.0, false
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, name+" ") && !strings.HasPrefix(line, name+"{") {
			continue
		}
		f := strings.Fields(line)
		v, err := strconv.ParseFloat(f[len(f)-1], 64)
		if err == nil {
			sum, seen = sum+v, true
		}
	}
	if !seen {
		return 0
	}
	return sum
}

// mustAgentMetric is agentMetric for a baseline a later check compares
// against: one that could not be read fails the test, or any later value
// would pass.
func mustAgentMetric(t *testing.T, port int, name string) float64 {
	t.Helper()
	v := agentMetric(port, name)
	if v < 0 {
		t.Fatalf("the agent's metric %s could not be read on :%d", name, port)
	}
	return v
}

// nodeCondition is the status of the Node's condition of type ct, or "".
func nodeCondition(ctx context.Context, node *cluster.Node, ct corev1.NodeConditionType) corev1.ConditionStatus {
	n, err := node.Client.CoreV1().Nodes().Get(ctx, node.Name, metav1.GetOptions{})
	if err != nil {
		return ""
	}
	for _, c := range n.Status.Conditions {
		if c.Type == ct {
			return c.Status
		}
	}
	return ""
}

// allocatable is the Node's allocatable count of resource (-1 when the
// Node cannot be read).
func allocatable(ctx context.Context, node *cluster.Node, resource corev1.ResourceName) int64 {
	n, err := node.Client.CoreV1().Nodes().Get(ctx, node.Name, metav1.GetOptions{})
	if err != nil {
		return -1
	}
	q := n.Status.Allocatable[resource]
	return q.Value()
}

// waitPodsGone waits until no pod matches the selector in ns.
func waitPodsGone(t *testing.T, ctx context.Context, node *cluster.Node, ns, selector string) {
	t.Helper()
	testkit.Eventually(t, 2*time.Minute, "no pod "+selector+" in "+ns, func() bool {
		l, err := node.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: selector})
		return err == nil && len(l.Items) == 0
	})
}
