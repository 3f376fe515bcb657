//go:build e2e

package e2e

import (
	"context"
	"fmt"
	"os"
	osexec "os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/kubernetes"

	"github.com/inpod-dev/inpod/e2e/chart"
	"github.com/inpod-dev/inpod/e2e/cluster"
	"github.com/inpod-dev/inpod/e2e/cluster/clustertest"
	"github.com/inpod-dev/inpod/e2e/images"
	"github.com/inpod-dev/inpod/enrollment"
	"github.com/inpod-dev/inpod/internal/testkit"
	"github.com/inpod-dev/inpod/release"
)

// TestE2EChartInstallUpgradeUninstall installs inpod with its Helm chart on
// the real node (the agent is a DaemonSet pod from the agent image, the
// stand-in a DaemonSet too): the gate opens and an enrolled pod, which asked
// for nothing, runs redirected (a connection to it lands on ztunnel's inbound
// listener); helm upgrade to a changed image replaces the agent while the
// plugin stays in the conflist throughout and the pod keeps running
// redirected; helm uninstall (its pre-delete hook first) removes the plugin
// from the conflist, both
// binaries, the host table and the pod's annotation.
func TestE2EChartInstallUpgradeUninstall(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	repo := testkit.RepoDir(t)
	node := clustertest.Node(ctx, t, cluster.NodeConfig{Config: cluster.Config{Root: "/var/lib/inpod-e2e-chart"}, RepoDir: repo})
	client := node.Client
	target := chart.NodeTarget(node)
	if err := chart.PrepareHost(); err != nil {
		t.Fatal(err)
	}

	imgDir := t.TempDir()
	if err := images.BuildForChart(ctx, repo, release.DevTag, imgDir); err != nil {
		t.Fatal(err)
	}
	// The upgrade's image: the same agent with another digest.
	spec, err := release.Agent(ctx, repo, "upgrade", runtime.GOARCH)
	if err != nil {
		t.Fatal(err)
	}
	spec.Labels["dev.inpod.e2e-build"] = "upgrade"
	if _, err := release.Write(spec, filepath.Join(imgDir, "inpod-agent-upgrade.tar")); err != nil {
		t.Fatal(err)
	}
	if err := target.ImportImages(ctx, filepath.Join(imgDir, "inpod-agent.tar"), filepath.Join(imgDir, images.StandInFile),
		filepath.Join(imgDir, "inpod-agent-upgrade.tar")); err != nil {
		t.Fatal(err)
	}
	if err := target.Install(ctx, repo, release.DevTag); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { target.Helm(context.Background(), repo, "uninstall", chart.Release, "-n", chart.Namespace) })
	if _, err := client.AppsV1().DaemonSets(chart.Namespace).Create(ctx, chart.StandIn(release.DevTag, target.ZDSSocket()), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	conflist := filepath.Join(node.CNIConf, "10-e2e.conflist")
	chained := func() bool { return testkit.RuntimeChainEndsWith(node.CNIConf, "inpod-cni") }
	inAnyFile := func() bool {
		data, err := os.ReadFile(conflist)
		_, owned := os.Stat(filepath.Join(node.CNIConf, ownedConflist))
		return owned == nil || (err == nil && strings.Contains(string(data), `"inpod-cni"`))
	}
	testkit.Eventually(t, 2*time.Minute, "the agent pod Ready with the plugin chained", func() bool { return agentReady(t, ctx, node) != "" && chained() })
	resource := corev1.ResourceName("inpod.dev/redirection")
	testkit.Eventually(t, time.Minute, "the gate open on the Node", func() bool {
		n, err := client.CoreV1().Nodes().Get(ctx, node.Name, metav1.GetOptions{})
		if err != nil {
			return false
		}
		q := n.Status.Allocatable[resource]
		return q.Value() > 0
	})

	for name, labels := range map[string]map[string]string{"mesh": {enrollment.DataplaneModeLabel: enrollment.DataplaneAmbient}, "plain": nil} {
		if _, err := client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: labels}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	app := runTestApp(t, ctx, node, "mesh", "app")
	if q := app.Spec.Containers[0].Resources.Limits[resource]; q.Value() != 1 {
		t.Fatalf("the enrolled pod has no %s: the chart's admission policy did not add it", resource)
	}
	inbound := func(client string) {
		t.Helper()
		reply := dialFrom(t, ctx, node, "plain", client, app.Status.PodIP+":8080")
		if want := "ztunnel-standin port=15006 orig=" + app.Status.PodIP + ":8080"; !strings.Contains(reply, want) {
			t.Fatalf("a connection to the enrolled pod got %q, want ztunnel's inbound listener (%s)", reply, want)
		}
	}
	inbound("client-before")

	// Upgrade: a changed image, under a stream of enrolled pods. The new
	// agent starts beside the old one and takes the node over: the plugin
	// stays chained throughout, no enrolled pod's CNI ADD fails, none is
	// rejected, and each runs redirected.
	oldAgent := agentReady(t, ctx, node)
	churn := startChurn(ctx, client, "mesh", 500*time.Millisecond, 30)
	if err := target.Install(ctx, repo, "upgrade"); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(3 * time.Minute)
	for {
		if !chained() {
			t.Fatal("the plugin left the conflist during the upgrade")
		}
		if name := agentReady(t, ctx, node); name != "" && name != oldAgent {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for the upgraded agent Ready; the agent pods:\n%s", agentPodsReport(client))
		}
		time.Sleep(20 * time.Millisecond) // sampling the conflist, not synchronising
	}
	churned := churn.stopAfterHandOver(t, ctx, client, oldAgent, func() {
		if !chained() {
			t.Fatal("the plugin left the conflist during the upgrade")
		}
	})
	for _, name := range churned {
		p := waitReady(t, ctx, node, "mesh", name)
		if got := listenersAtStart(t, ctx, node, "mesh", name); got != allListeners {
			t.Errorf("%s, created during the upgrade, started with ztunnel's listeners %s, want %s", name, got, allListeners)
		}
		if p.Annotations[enrollment.RedirectionAnnotation] != "enabled" {
			testkit.Eventually(t, time.Minute, name+" annotated enabled", func() bool {
				got, err := client.CoreV1().Pods("mesh").Get(ctx, name, metav1.GetOptions{})
				return err == nil && got.Annotations[enrollment.RedirectionAnnotation] == "enabled"
			})
		}
	}
	if evs, err := client.CoreV1().Events("mesh").List(ctx, metav1.ListOptions{FieldSelector: "reason=FailedCreatePodSandBox"}); err != nil {
		t.Fatal(err)
	} else if len(evs.Items) > 0 {
		t.Errorf("%d failed CNI ADDs during the upgrade, want 0; first: %s: %s", len(evs.Items), evs.Items[0].InvolvedObject.Name, evs.Items[0].Message)
	}
	const taken = `inpod_agent_handovers_total{role="taken"}`
	if got := agentSample(agentMetricsPort, taken); got != 1 {
		t.Errorf("the upgraded agent's %s is %v, want 1: it did not take the node over", taken, got)
	}
	t.Logf("%d enrolled pods created during the upgrade: every one redirected, no failed ADD", len(churned))
	for _, name := range churned {
		client.CoreV1().Pods("mesh").Delete(ctx, name, metav1.DeleteOptions{})
	}
	p, err := client.CoreV1().Pods("mesh").Get(ctx, "app", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if p.UID != app.UID || p.Status.Phase != corev1.PodRunning || p.Status.ContainerStatuses[0].RestartCount != 0 || p.Annotations[enrollment.RedirectionAnnotation] != "enabled" {
		t.Fatalf("the enrolled pod was disturbed by the upgrade: phase %s, restarts %d, annotation %q", p.Status.Phase, p.Status.ContainerStatuses[0].RestartCount, p.Annotations[enrollment.RedirectionAnnotation])
	}
	inbound("client-after-upgrade")

	// Uninstall: each agent removes inpod from its node.
	if _, err := target.Helm(ctx, repo, "uninstall", chart.Release, "-n", chart.Namespace, "--wait", "--timeout", "3m"); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, 2*time.Minute, "the plugin out of the conflist and both binaries removed", func() bool {
		_, e1 := os.Stat(filepath.Join(node.CNIBin, "inpod-cni"))
		_, e2 := os.Stat(filepath.Join(node.CNIBin, "inpod-cni-apicheck"))
		return !chained() && !inAnyFile() && os.IsNotExist(e1) && os.IsNotExist(e2)
	})
	testkit.Eventually(t, 30*time.Second, "the host table removed", func() bool {
		out, err := osexec.Command("nft", "list", "tables").Output()
		return err == nil && !strings.Contains(string(out), "inpod-host")
	})
	// The pre-delete hook kept the agent's RBAC until the agent was done,
	// so its last step, the annotations, went through too.
	p, err = client.CoreV1().Pods("mesh").Get(ctx, "app", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if v, has := p.Annotations[enrollment.RedirectionAnnotation]; has {
		t.Errorf("after uninstall the pod still carries %s=%q", enrollment.RedirectionAnnotation, v)
	}
}

// churn creates pods, paced, until stopped or max.
type churn struct {
	mu    sync.Mutex
	names []string
	done  chan struct{}
	over  chan struct{}
}

func startChurn(ctx context.Context, client kubernetes.Interface, ns string, every time.Duration, max int) *churn {
	c := &churn{done: make(chan struct{}), over: make(chan struct{})}
	go func() {
		defer close(c.over)
		for i := 0; i < max; i++ {
			name := fmt.Sprintf("churn-%d", i)
			if _, err := client.CoreV1().Pods(ns).Create(ctx, testAppPod(ns, name), metav1.CreateOptions{}); err == nil {
				c.mu.Lock()
				c.names = append(c.names, name)
				c.mu.Unlock()
			}
			select {
			case <-c.done:
				return
			case <-time.After(every): // pacing the stream
			}
		}
	}()
	return c
}

// stop ends the stream and returns the pods it created.
func (c *churn) stop() []string {
	close(c.done)
	<-c.over
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.names
}

// minChurned is how many pods a stream must create during an upgrade to
// prove anything about it.
const minChurned = 5

// stopAfterHandOver ends the stream once the old agent's pod is gone from
// the API and at least minChurned pods were created: the whole hand-over
// ran under it, the retired agent's kubelet plugin lingering until the
// kubelet uses the successor's included. On a quiet node the successor is
// Ready within a second or two, fewer pods than that (seen in make test).
// during runs at every poll: what must hold until then.
func (c *churn) stopAfterHandOver(t *testing.T, ctx context.Context, client kubernetes.Interface, oldAgent string, during func()) []string {
	t.Helper()
	testkit.Eventually(t, 3*time.Minute, fmt.Sprintf("the old agent pod %s gone, and %d pods created", oldAgent, minChurned), func() bool {
		during()
		_, err := client.CoreV1().Pods(chart.Namespace).Get(ctx, oldAgent, metav1.GetOptions{})
		c.mu.Lock()
		created := len(c.names)
		c.mu.Unlock()
		return apierrors.IsNotFound(err) && created >= minChurned
	})
	return c.stop()
}

// agentReady is the name of the Ready agent pod, or "".
func agentReady(t testing.TB, ctx context.Context, node *cluster.Node) string {
	t.Helper()
	pods, err := node.Client.CoreV1().Pods(chart.Namespace).List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/component=agent"})
	if err != nil {
		return ""
	}
	for _, p := range pods.Items {
		if p.DeletionTimestamp != nil {
			continue
		}
		for _, c := range p.Status.Conditions {
			if c.Type == corev1.PodReady && c.Status == corev1.ConditionTrue {
				return p.Name
			}
		}
	}
	return ""
}

// testAppPod is testapp serving :8080 (one line naming the connection's
// original destination) and an echo on :8081, labelled app=name, with a
// kubelet TCP readiness probe on :8080 (the probe's SNAT path).
func testAppPod(ns, name string) *corev1.Pod {
	grace := int64(1)
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, Labels: map[string]string{"app": name}},
		Spec: corev1.PodSpec{TerminationGracePeriodSeconds: &grace, Containers: []corev1.Container{{
			Name: "app", Image: images.TestAppRef, ImagePullPolicy: corev1.PullNever, Args: []string{"--listen", ":8080", "--echo", ":8081"},
			ReadinessProbe: &corev1.Probe{PeriodSeconds: 1, ProbeHandler: corev1.ProbeHandler{
				TCPSocket: &corev1.TCPSocketAction{Port: intstr.FromInt32(8080)}}},
		}}},
	}
}

// runTestApp runs testAppPod and returns it once Ready.
func runTestApp(t *testing.T, ctx context.Context, node *cluster.Node, ns, name string) *corev1.Pod {
	t.Helper()
	if _, err := node.Client.CoreV1().Pods(ns).Create(ctx, testAppPod(ns, name), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	return waitReady(t, ctx, node, ns, name)
}

// waitReady waits for the pod's Ready condition and returns the pod.
func waitReady(t *testing.T, ctx context.Context, node *cluster.Node, ns, name string) *corev1.Pod {
	t.Helper()
	var got *corev1.Pod
	// On a timeout here, say where the pod was: its node, phase, conditions
	// and events (otherwise the failure says nothing of why).
	returned := false
	t.Cleanup(func() {
		if returned || !t.Failed() {
			return
		}
		dctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if p, err := node.Client.CoreV1().Pods(ns).Get(dctx, name, metav1.GetOptions{}); err == nil {
			t.Logf("%s/%s at the failure: node %q phase %s conditions %+v", ns, name, p.Spec.NodeName, p.Status.Phase, p.Status.Conditions)
		}
		if evs, err := node.Client.CoreV1().Events(ns).List(dctx, metav1.ListOptions{FieldSelector: "involvedObject.name=" + name}); err == nil {
			for _, e := range evs.Items {
				t.Logf("  event %s %s (x%d): %s", e.Type, e.Reason, e.Count, e.Message)
			}
		}
	})
	testkit.Eventually(t, 2*time.Minute, ns+"/"+name+" Ready", func() bool {
		p, err := node.Client.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil || p.Status.Phase != corev1.PodRunning || p.Status.PodIP == "" {
			return false
		}
		got = p
		for _, c := range p.Status.Conditions {
			if c.Type == corev1.PodReady && c.Status == corev1.ConditionTrue {
				return true
			}
		}
		return false
	})
	returned = true
	return got
}

// dialFrom runs a pod that connects once to addr and returns what it was
// answered.
func dialFrom(t *testing.T, ctx context.Context, node *cluster.Node, ns, name, addr string) string {
	t.Helper()
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
		Spec: corev1.PodSpec{RestartPolicy: corev1.RestartPolicyNever, Containers: []corev1.Container{{
			Name: "dial", Image: images.TestAppRef, ImagePullPolicy: corev1.PullNever, Args: []string{"--dial", addr}}}},
	}
	if _, err := node.Client.CoreV1().Pods(ns).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, 2*time.Minute, ns+"/"+name+" finished", func() bool {
		p, err := node.Client.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		return err == nil && (p.Status.Phase == corev1.PodSucceeded || p.Status.Phase == corev1.PodFailed)
	})
	out, err := node.Client.CoreV1().Pods(ns).GetLogs(name, &corev1.PodLogOptions{}).DoRaw(ctx)
	if err != nil {
		t.Fatal(err)
	}
	return string(out)
}
