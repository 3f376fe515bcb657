//go:build e2e

package e2e

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"go.yaml.in/yaml/v3"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/ptr"

	"github.com/inpod-dev/inpod/e2e/chart"
	"github.com/inpod-dev/inpod/e2e/cluster"
	"github.com/inpod-dev/inpod/e2e/cluster/clustertest"
	"github.com/inpod-dev/inpod/e2e/images"
	"github.com/inpod-dev/inpod/enrollment"
	"github.com/inpod-dev/inpod/internal/testkit"
	"github.com/inpod-dev/inpod/release"
)

// chartNode is the real node ready for inpod's chart: the product images
// imported into its containerd, the namespaces mesh (enrolled by its label)
// and plain. Its methods take the running (sub)test's t.
type chartNode struct {
	*cluster.Node
	ctx     context.Context
	repo    string
	target  chart.Target
	clients int
	// released is the directory of make release's artifacts the chart is
	// installed from (newReleasedChartNode); empty: from the source tree.
	released string
}

func newChartNode(ctx context.Context, t *testing.T, root string) *chartNode {
	t.Helper()
	c := bareChartNode(ctx, t, root)
	imgDir := t.TempDir()
	if err := images.BuildForChart(ctx, c.repo, release.DevTag, imgDir); err != nil {
		t.Fatal(err)
	}
	if err := c.target.ImportImages(ctx, filepath.Join(imgDir, "inpod-agent.tar"), filepath.Join(imgDir, images.StandInFile),
		filepath.Join(imgDir, "inpod-controller.tar"), filepath.Join(imgDir, "inpod-waitready.tar")); err != nil {
		t.Fatal(err)
	}
	return c
}

// releasedTag is the version newReleasedChartNode releases as: a semantic
// version, so the chart is packaged with it as a release's would be.
const releasedTag = "v0.0.0-e2e"

// newReleasedChartNode is a chartNode whose install takes what a user of a
// release takes: make release's artifacts (its command, every platform),
// the images imported from their OCI archives as a registry would serve
// them, the chart from its package with values-release.yaml, so the agent
// runs the image by the digest the values file pins.
func newReleasedChartNode(ctx context.Context, t *testing.T, root string) *chartNode {
	t.Helper()
	c := bareChartNode(ctx, t, root)
	c.released = t.TempDir()
	cmd := exec.CommandContext(ctx, "go", "run", "./release/cmd/inpod-release", "--out", c.released, "--tag", releasedTag,
		"--chart", "deploy/helm/inpod", "--helm", filepath.Join(c.repo, "bin", "helm"))
	cmd.Dir = c.repo
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("make release's command: %v\n%s", err, out)
	} else {
		t.Logf("make release's command:\n%s", out)
	}
	standIn, err := images.WriteStandIn(ctx, c.repo, release.DevTag, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	if err := c.target.ImportImages(ctx, standIn); err != nil {
		t.Fatal(err)
	}
	for _, s := range release.ShippedImages() {
		if err := c.target.ImportReleased(ctx, filepath.Join(c.released, s.Name+".tar"), s.Repository); err != nil {
			t.Fatal(err)
		}
	}
	return c
}

// agentRunsReleasedImage waits for the agent pod and checks it runs the
// image values-release.yaml pins, by digest: the chart referenced it as
// <repository>@<digest> and the runtime ran the imported index under it.
func (c *chartNode) agentRunsReleasedImage(t *testing.T) {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(c.released, release.ValuesFile))
	if err != nil {
		t.Fatal(err)
	}
	var vals struct {
		Agent struct {
			Image struct{ Digest string } `yaml:"image"`
		} `yaml:"agent"`
	}
	if err := yaml.Unmarshal(data, &vals); err != nil || !strings.HasPrefix(vals.Agent.Image.Digest, "sha256:") {
		t.Fatalf("%s: agent.image.digest %q (%v)", release.ValuesFile, vals.Agent.Image.Digest, err)
	}
	want := release.AgentRepository + "@" + vals.Agent.Image.Digest
	var seen string
	testkit.Eventually(t, 2*time.Minute, "the agent container running "+want, func() bool {
		pods, err := c.Client.CoreV1().Pods(chart.Namespace).List(c.ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/component=agent"})
		if err != nil || len(pods.Items) != 1 {
			return false
		}
		p := pods.Items[0]
		for _, cs := range p.Status.ContainerStatuses {
			if cs.Name == p.Spec.Containers[0].Name && cs.State.Running != nil {
				seen = fmt.Sprintf("image %s, imageID %s", p.Spec.Containers[0].Image, cs.ImageID)
				return p.Spec.Containers[0].Image == want && strings.HasSuffix(cs.ImageID, "@"+vals.Agent.Image.Digest)
			}
		}
		return false
	})
	t.Logf("the agent runs the released image: %s", seen)
}

// bareChartNode is the node with its namespaces, no image imported yet.
func bareChartNode(ctx context.Context, t *testing.T, root string) *chartNode {
	t.Helper()
	repo := testkit.RepoDir(t)
	node := clustertest.Node(ctx, t, cluster.NodeConfig{Config: cluster.Config{Root: root}, RepoDir: repo})
	c := &chartNode{Node: node, ctx: ctx, repo: repo, target: chart.NodeTarget(node)}
	if err := chart.PrepareHost(); err != nil {
		t.Fatal(err)
	}
	for name, labels := range map[string]map[string]string{"mesh": {enrollment.DataplaneModeLabel: enrollment.DataplaneAmbient}, "plain": nil} {
		if _, err := node.Client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: labels}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() { c.target.Helm(context.Background(), repo, "uninstall", chart.Release, "-n", chart.Namespace) })
	// Before the uninstall: a test that failed because the agent went away
	// mid-run (metrics refused, a fault it did not recover from) needs to
	// know why, and the pod's record goes with the uninstall.
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("the agent pods at the failure:\n%s", agentPodsReport(c.Client))
		}
	})
	return c
}

// agentPodsReport is each agent pod's state, restarts and last
// termination, its events, the tail of its log, and of its previous
// container's when it restarted.
func agentPodsReport(client kubernetes.Interface) string {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	pods, err := client.CoreV1().Pods(chart.Namespace).List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/component=agent"})
	if err != nil {
		return fmt.Sprintf("  list: %v", err)
	}
	var b strings.Builder
	for _, p := range pods.Items {
		fmt.Fprintf(&b, "  %s (uid %s) phase %s deleting %v\n", p.Name, p.UID, p.Status.Phase, p.DeletionTimestamp != nil)
		for _, c := range p.Status.Conditions {
			fmt.Fprintf(&b, "    condition %s=%s %s %s\n", c.Type, c.Status, c.Reason, c.Message)
		}
		if evs, err := client.CoreV1().Events(p.Namespace).List(ctx, metav1.ListOptions{FieldSelector: "involvedObject.name=" + p.Name}); err == nil {
			for _, e := range evs.Items {
				fmt.Fprintf(&b, "    event %s %s (x%d): %s\n", e.Type, e.Reason, e.Count, e.Message)
			}
		}
		if logs, err := client.CoreV1().Pods(p.Namespace).GetLogs(p.Name, &corev1.PodLogOptions{TailLines: ptr.To[int64](30)}).DoRaw(ctx); err == nil {
			fmt.Fprintf(&b, "    log's last lines:\n      %s\n", strings.ReplaceAll(strings.TrimSpace(string(logs)), "\n", "\n      "))
		}
		for _, s := range p.Status.ContainerStatuses {
			fmt.Fprintf(&b, "    container %s ready=%v restarts=%d", s.Name, s.Ready, s.RestartCount)
			if t := s.LastTerminationState.Terminated; t != nil {
				fmt.Fprintf(&b, " last terminated: %s exit %d signal %d at %s %s", t.Reason, t.ExitCode, t.Signal, t.FinishedAt.UTC().Format(time.RFC3339), t.Message)
			}
			b.WriteString("\n")
			if s.RestartCount == 0 {
				continue
			}
			// The kubelet keeps the previous container's log next to the
			// current one: /var/log/pods/<ns>_<pod>_<uid>/<container>/<n>.log.
			prev := filepath.Join("/var/log/pods", fmt.Sprintf("%s_%s_%s", p.Namespace, p.Name, p.UID), s.Name, fmt.Sprintf("%d.log", s.RestartCount-1))
			data, err := os.ReadFile(prev)
			if err != nil {
				fmt.Fprintf(&b, "    previous log: %v\n", err)
				continue
			}
			lines := strings.Split(strings.TrimSpace(string(data)), "\n")
			lines = lines[max(0, len(lines)-25):]
			fmt.Fprintf(&b, "    previous log's last lines:\n      %s\n", strings.Join(lines, "\n      "))
		}
	}
	return b.String()
}

// install installs or upgrades the chart with the node's values plus extra:
// from the source tree, or from make release's artifacts for a node made by
// newReleasedChartNode.
func (c *chartNode) install(t *testing.T, extra ...string) {
	t.Helper()
	if c.released == "" {
		if err := c.target.Install(c.ctx, c.repo, release.DevTag, extra...); err != nil {
			t.Fatal(err)
		}
		return
	}
	pkgs, err := filepath.Glob(filepath.Join(c.released, "inpod-*.tgz"))
	if err != nil || len(pkgs) != 1 {
		t.Fatalf("make release's chart package: %v %v, want one inpod-<version>.tgz", pkgs, err)
	}
	if err := c.target.InstallRelease(c.ctx, c.repo, pkgs[0], filepath.Join(c.released, release.ValuesFile), extra...); err != nil {
		t.Fatal(err)
	}
}

// waitRequestPolicy waits until the chart's resource-request policy acts
// (an admission policy takes seconds to load after its creation): a
// dry-run enrolled pod comes back with the request.
func (c *chartNode) waitRequestPolicy(t *testing.T) {
	t.Helper()
	testkit.Eventually(t, time.Minute, "the chart's resource-request policy acting", func() bool {
		p, err := c.Client.CoreV1().Pods("mesh").Create(c.ctx, testAppPod("mesh", "policy-probe"), metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
		if err != nil {
			t.Fatal(err)
		}
		_, has := p.Spec.Containers[0].Resources.Limits[gateResource]
		return has
	})
}

// standInUp starts the ztunnel stand-in DaemonSet; standInDown deletes it,
// as a ztunnel uninstall or crash would take ztunnel away.
func (c *chartNode) standInUp(t *testing.T) {
	t.Helper()
	testkit.Eventually(t, 2*time.Minute, "the previous stand-in DaemonSet gone", func() bool {
		_, err := c.Client.AppsV1().DaemonSets(chart.Namespace).Get(c.ctx, "ztunnel-standin", metav1.GetOptions{})
		return apierrors.IsNotFound(err)
	})
	if _, err := c.Client.AppsV1().DaemonSets(chart.Namespace).Create(c.ctx, chart.StandIn(release.DevTag, c.target.ZDSSocket()), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
}

func (c *chartNode) standInDown(t *testing.T) {
	t.Helper()
	fg := metav1.DeletePropagationForeground
	if err := c.Client.AppsV1().DaemonSets(chart.Namespace).Delete(c.ctx, "ztunnel-standin", metav1.DeleteOptions{PropagationPolicy: &fg}); err != nil {
		t.Fatal(err)
	}
}

func (c *chartNode) create(t *testing.T, p *corev1.Pod) {
	t.Helper()
	if _, err := c.Client.CoreV1().Pods(p.Namespace).Create(c.ctx, p, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// dial connects once to addr from a new pod in ns and returns the reply.
func (c *chartNode) dial(t *testing.T, ns, addr string) string {
	t.Helper()
	c.clients++
	return dialFrom(t, c.ctx, c.Node, ns, fmt.Sprintf("client-%d", c.clients), addr)
}

// inbound checks that a connection from a pod outside the mesh to the
// enrolled pod p arrives at ztunnel's inbound listener in p.
func (c *chartNode) inbound(t *testing.T, p *corev1.Pod) {
	t.Helper()
	reply := c.dial(t, "plain", p.Status.PodIP+":8080")
	if want := "ztunnel-standin port=15006 orig=" + p.Status.PodIP + ":8080"; !strings.Contains(reply, want) {
		t.Fatalf("a connection to enrolled %s got %q, want ztunnel's inbound listener (%s)", p.Name, reply, want)
	}
}

// enrolled checks a running testapp pod from outside inpod: ztunnel's
// listeners were bound in its netns before the app started, its netns has
// the redirection rules, and the agent annotated it.
func (c *chartNode) enrolled(t *testing.T, p *corev1.Pod) {
	t.Helper()
	if got := listenersAtStart(t, c.ctx, c.Node, p.Namespace, p.Name); got != allListeners {
		t.Fatalf("enrolled %s started with ztunnel's listeners %s in its netns, want %s: it ran unredirected", p.Name, got, allListeners)
	}
	if !redirectsInKernel(t, p.Status.PodIP) {
		t.Fatalf("enrolled %s has no redirection rules in its netns", p.Name)
	}
	testkit.Eventually(t, time.Minute, p.Name+" annotated enabled", func() bool {
		got, err := c.Client.CoreV1().Pods(p.Namespace).Get(c.ctx, p.Name, metav1.GetOptions{})
		return err == nil && got.Annotations[enrollment.RedirectionAnnotation] == "enabled"
	})
}

// podLogLines reads a pod's log whole and keeps the lines keep selects.
func podLogLines(ctx context.Context, c kubernetes.Interface, ns, pod string, keep func(string) bool) ([]string, error) {
	raw, err := c.CoreV1().Pods(ns).GetLogs(pod, &corev1.PodLogOptions{}).DoRaw(ctx)
	if err != nil {
		return nil, err
	}
	var lines []string
	for l := range strings.Lines(string(raw)) {
		if l = strings.TrimSpace(l); keep(l) {
			lines = append(lines, l)
		}
	}
	return lines, nil
}

// followPodLog follows a pod's log from now and returns the lines keep
// selected so far: a pod going away takes its log with it.
func followPodLog(ctx context.Context, t testing.TB, c kubernetes.Interface, ns, pod string, keep func(string) bool) func() []string {
	t.Helper()
	since := metav1.Now()
	stream, err := c.CoreV1().Pods(ns).GetLogs(pod, &corev1.PodLogOptions{Follow: true, SinceTime: &since}).Stream(ctx)
	if err != nil {
		// Diagnostics only: the test goes on without them.
		t.Logf("following %s/%s's log: %v", ns, pod, err)
		return func() []string { return nil }
	}
	var (
		mu    sync.Mutex
		lines []string
	)
	go func() {
		defer stream.Close()
		sc := bufio.NewScanner(stream)
		sc.Buffer(make([]byte, 64*1024), 1024*1024)
		for sc.Scan() {
			if l := sc.Text(); keep(l) {
				mu.Lock()
				lines = append(lines, l)
				mu.Unlock()
			}
		}
	}()
	return func() []string {
		mu.Lock()
		defer mu.Unlock()
		return slices.Clone(lines)
	}
}

// containing selects the lines that contain one of words.
func containing(words ...string) func(string) bool {
	return func(l string) bool {
		return slices.ContainsFunc(words, func(w string) bool { return strings.Contains(l, w) })
	}
}
