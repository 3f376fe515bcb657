// Command demo shows inpod doing its job on a real single node (make demo):
// it brings up the local node (make cluster-up's), imports the agent's
// image (make images) and the ztunnel stand-in's (built here: a test peer),
// installs inpod with its Helm chart, runs the stand-in as a DaemonSet and
// narrates each step with its elapsed time. It exits non-zero
// when a step fails and leaves the node up; `demo down` (make demo-down)
// removes everything.
package main

import (
	"bytes"
	"context"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/inpod-dev/inpod/e2e/chart"
	"github.com/inpod-dev/inpod/e2e/images"
	"github.com/inpod-dev/inpod/enrollment"
	"github.com/inpod-dev/inpod/internal/envflag"
	"github.com/inpod-dev/inpod/internal/testkit"
	"github.com/inpod-dev/inpod/release"
)

const resource = corev1.ResourceName("inpod.dev/redirection")

func main() {
	fs := flag.NewFlagSet("demo", flag.ContinueOnError)
	root := fs.String("root", "/var/lib/inpod-e2e", "state root of the local node")
	repo := fs.String("repo", ".", "the inpod repository")
	imageDir := fs.String("images", "bin/images", "image tarballs (make images)")
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: demo up|down [flags]")
		os.Exit(2)
	}
	err := envflag.Parse(fs, "demo: inpod on a real local node, step by step", os.Args[2:])
	if err == flag.ErrHelp {
		return
	}
	if err == nil {
		d := &demo{start: time.Now(), root: *root, repo: *repo, images: *imageDir, target: chart.LocalNode(*root)}
		switch os.Args[1] {
		case "up":
			err = d.up(context.Background())
		case "down":
			err = d.down(context.Background())
		default:
			err = fmt.Errorf("unknown command %q: want up or down", os.Args[1])
		}
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "demo FAILED:", err)
		os.Exit(1)
	}
}

type demo struct {
	start              time.Time
	step               time.Time
	root, repo, images string
	target             chart.Target
	client             kubernetes.Interface
}

// say narrates: the time since the demo started and since the last step.
func (d *demo) say(format string, args ...any) {
	now := time.Now()
	if d.step.IsZero() {
		d.step = d.start
	}
	fmt.Printf("[%6.1fs +%5.1fs] %s\n", now.Sub(d.start).Seconds(), now.Sub(d.step).Seconds(), fmt.Sprintf(format, args...))
	d.step = now
}

func (d *demo) detail(format string, args ...any) {
	fmt.Printf("                   %s\n", fmt.Sprintf(format, args...))
}

func (d *demo) wait(timeout time.Duration, what string, cond func() (bool, error)) error {
	return testkit.Poll(timeout, what, cond)
}

func (d *demo) up(ctx context.Context) error {
	d.say("inpod demo: one real node (etcd, kube-apiserver, scheduler, kubelet, containerd) on this machine")
	if err := d.node(ctx); err != nil {
		return err
	}
	cfg, err := clientcmd.BuildConfigFromFlags("", d.target.Kubeconfig)
	if err != nil {
		return err
	}
	if d.client, err = kubernetes.NewForConfig(cfg); err != nil {
		return err
	}
	if err := d.clearEarlierRun(ctx); err != nil {
		return err
	}
	if err := chart.PrepareHost(); err != nil {
		return err
	}
	// The stand-in is a test peer, not a release image: make images does
	// not build it.
	tmp, err := os.MkdirTemp("", "inpod-demo-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(tmp)
	standIn, err := images.WriteStandIn(ctx, d.repo, release.DevTag, tmp)
	if err != nil {
		return err
	}
	if err := d.target.ImportImages(ctx, filepath.Join(d.images, "inpod-agent.tar"), standIn); err != nil {
		return err
	}
	d.say("imported the images %s:%s and %s:%s (test peer) into the node's containerd", release.AgentRepository, release.DevTag, images.StandInRepository, release.DevTag)
	if err := d.target.Install(ctx, d.repo, release.DevTag); err != nil {
		return err
	}
	d.say("installed inpod with its chart: helm upgrade --install %s deploy/helm/inpod -n %s", chart.Release, chart.Namespace)
	nodeName, err := d.nodeName(ctx)
	if err != nil {
		return err
	}
	if err := d.wait(2*time.Minute, "the agent running and its resource registered", func() (bool, error) {
		n, err := d.client.CoreV1().Nodes().Get(ctx, nodeName, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		c := n.Status.Capacity[resource]
		return c.Value() > 0, nil
	}); err != nil {
		return fmt.Errorf("%w\n%s", err, d.agentLogs(ctx))
	}
	alloc, capa := d.resource(ctx, nodeName)
	d.say("agent running: installed inpod-cni, registered %s (capacity %d, allocatable %d: no ztunnel yet, the gate is closed)", resource, capa, alloc)

	for name, labels := range map[string]map[string]string{"demo-mesh": {enrollment.DataplaneModeLabel: enrollment.DataplaneAmbient}, "demo-plain": nil} {
		ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: labels}}
		if _, err := d.client.CoreV1().Namespaces().Create(ctx, ns, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
			return err
		}
	}
	// A pod outside the mesh starts at once, gate or not.
	web, err := d.runPod(ctx, testapp("demo-plain", "web", nil))
	if err != nil {
		return err
	}
	d.say("a pod outside the mesh (demo-plain/web, %s) is Running while the gate is closed: nothing asked of it", web.Status.PodIP)

	app := testapp("demo-mesh", "app", nil)
	// Its init container connects to web: by then the pod's traffic is
	// redirected (the CNI ADD returned only after ztunnel's ack).
	app.Spec.InitContainers = []corev1.Container{{Name: "connect", Image: images.TestAppRef, ImagePullPolicy: corev1.PullNever,
		Args: []string{"--dial", web.Status.PodIP + ":8080"}}}
	created, err := d.client.CoreV1().Pods("demo-mesh").Create(ctx, app, metav1.CreateOptions{})
	if err != nil {
		return err
	}
	req := created.Spec.Containers[0].Resources.Limits[resource]
	if req.Value() != 1 {
		return fmt.Errorf("the enrolled pod was created without %s: the MutatingAdmissionPolicy did not add it", resource)
	}
	d.say("created demo-mesh/app (namespace labelled %s=ambient; its manifest requests nothing): the admission policy added %s: 1", enrollment.DataplaneModeLabel, resource)
	var why string
	if err := d.wait(time.Minute, "the enrolled pod Pending as unschedulable", func() (bool, error) {
		p, err := d.client.CoreV1().Pods("demo-mesh").Get(ctx, "app", metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		for _, c := range p.Status.Conditions {
			if c.Type == corev1.PodScheduled && c.Status == corev1.ConditionFalse {
				why = c.Message
				return true, nil
			}
		}
		return false, nil
	}); err != nil {
		return err
	}
	d.say("demo-mesh/app is Pending: %s", why)

	if _, err := d.client.AppsV1().DaemonSets(chart.Namespace).Create(ctx, chart.StandIn(release.DevTag, d.target.ZDSSocket()), metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return err
	}
	d.say("started the ztunnel stand-in (a test peer playing ztunnel) as a DaemonSet")
	if err := d.wait(2*time.Minute, "the agent Ready (ztunnel connected)", func() (bool, error) { return d.agentReady(ctx) }); err != nil {
		return fmt.Errorf("%w\n%s", err, d.agentLogs(ctx))
	}
	d.say("the stand-in connected over ZDS and acked the snapshot: the agent is Ready (/readyz)")
	if err := d.wait(time.Minute, "the gate open on the Node", func() (bool, error) {
		a, _ := d.resource(ctx, nodeName)
		return a > 0, nil
	}); err != nil {
		return err
	}
	alloc, _ = d.resource(ctx, nodeName)
	d.say("the gate opened: %s allocatable %d (the Node shows it at the kubelet's next status sync, ≤10 s)", resource, alloc)

	var ann string
	if err := d.wait(2*time.Minute, "demo-mesh/app Running", func() (bool, error) {
		p, err := d.client.CoreV1().Pods("demo-mesh").Get(ctx, "app", metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		ann = p.Annotations[enrollment.RedirectionAnnotation]
		return p.Status.Phase == corev1.PodRunning, nil
	}); err != nil {
		return fmt.Errorf("%w\n%s", err, d.agentLogs(ctx))
	}
	if ann != "enabled" {
		return fmt.Errorf("demo-mesh/app runs with %s=%q, want enabled", enrollment.RedirectionAnnotation, ann)
	}
	d.say("demo-mesh/app is Running with %s: %s", enrollment.RedirectionAnnotation, ann)

	reply, err := d.logs(ctx, "demo-mesh", "app", "connect")
	if err != nil {
		return err
	}
	want := fmt.Sprintf("port=15001 orig=%s:8080", web.Status.PodIP)
	if !strings.Contains(reply, "ztunnel-standin "+want) {
		return fmt.Errorf("app's connection to %s:8080 got %q, want the stand-in's outbound listener (%s)", web.Status.PodIP, reply, want)
	}
	d.say("app connected to web (%s:8080); the answer came from ztunnel's outbound listener in the pod:", web.Status.PodIP)
	d.detail("%s", strings.TrimSpace(reply))
	webLog, err := d.logs(ctx, "demo-plain", "web", "app")
	if err != nil {
		return err
	}
	w, err := d.client.CoreV1().Pods("demo-plain").Get(ctx, "web", metav1.GetOptions{})
	if err != nil {
		return err
	}
	if _, has := w.Annotations[enrollment.RedirectionAnnotation]; has || strings.Contains(webLog, "connection from") || len(w.Spec.Containers[0].Resources.Limits) != 0 {
		return fmt.Errorf("demo-plain/web was touched: annotations %v, limits %v, log %q", w.Annotations, w.Spec.Containers[0].Resources.Limits, webLog)
	}
	d.say("demo-plain/web is untouched: no resource request, no annotation, and it never saw that connection (the stand-in took it)")

	if err := d.client.AppsV1().DaemonSets(chart.Namespace).Delete(ctx, "ztunnel-standin", metav1.DeleteOptions{}); err != nil {
		return err
	}
	d.say("stopped the stand-in")
	if err := d.wait(time.Minute, "the agent not Ready", func() (bool, error) {
		r, err := d.agentReady(ctx)
		return !r, err
	}); err != nil {
		return err
	}
	d.say("the agent is not Ready (ztunnel not connected); the device plugin reports every device Unhealthy")
	if err := d.wait(time.Minute, "the gate closed on the Node", func() (bool, error) {
		a, _ := d.resource(ctx, nodeName)
		return a == 0, nil
	}); err != nil {
		return err
	}
	p, err := d.client.CoreV1().Pods("demo-mesh").Get(ctx, "app", metav1.GetOptions{})
	if err != nil {
		return err
	}
	d.say("the gate closed: allocatable 0, no new enrolled pod lands here; demo-mesh/app, already running, is %s", p.Status.Phase)
	fmt.Printf("\ndemo passed. The node stays up:\n  export KUBECONFIG=%s\n  %s/kubectl get pods -A\nremove everything with: make demo-down\n", d.target.Kubeconfig, os.Getenv("INPOD_K8S_BIN_DIR"))
	return nil
}

// clearEarlierRun removes what an earlier demo on the same node left.
func (d *demo) clearEarlierRun(ctx context.Context) error {
	var gone []string
	for _, ns := range []string{"demo-mesh", "demo-plain"} {
		err := d.client.CoreV1().Namespaces().Delete(ctx, ns, metav1.DeleteOptions{})
		if err == nil {
			gone = append(gone, ns)
		} else if !apierrors.IsNotFound(err) {
			return err
		}
	}
	if err := d.client.AppsV1().DaemonSets(chart.Namespace).Delete(ctx, "ztunnel-standin", metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
		return err
	}
	if len(gone) == 0 {
		return nil
	}
	err := d.wait(3*time.Minute, "the earlier demo's namespaces gone", func() (bool, error) {
		for _, ns := range gone {
			if _, err := d.client.CoreV1().Namespaces().Get(ctx, ns, metav1.GetOptions{}); !apierrors.IsNotFound(err) {
				return false, nil
			}
		}
		return true, nil
	})
	if err == nil {
		d.say("removed the earlier demo's pods")
	}
	return err
}

// node brings up the local node unless it runs already.
func (d *demo) node(ctx context.Context) error {
	if _, err := os.Stat(d.root + ".holder"); err == nil {
		if _, err := os.Stat(d.target.Kubeconfig); err == nil {
			d.say("the local node is already up (%s)", d.root)
			return nil
		}
	}
	cmd := exec.CommandContext(ctx, filepath.Join(d.repo, "bin", "localnode"), "up", "--root", d.root, "--repo", d.repo)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("localnode up: %v: %s", err, out.String())
	}
	d.say("the local node is up and Ready")
	return nil
}

func (d *demo) nodeName(ctx context.Context) (string, error) {
	nodes, err := d.client.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
	if err != nil {
		return "", err
	}
	if len(nodes.Items) != 1 {
		return "", fmt.Errorf("%d nodes, want the local one", len(nodes.Items))
	}
	return nodes.Items[0].Name, nil
}

func (d *demo) resource(ctx context.Context, node string) (alloc, capa int64) {
	n, err := d.client.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
	if err != nil {
		return -1, -1
	}
	a, c := n.Status.Allocatable[resource], n.Status.Capacity[resource]
	return a.Value(), c.Value()
}

func (d *demo) agentReady(ctx context.Context) (bool, error) {
	pods, err := d.client.CoreV1().Pods(chart.Namespace).List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/component=agent"})
	if err != nil || len(pods.Items) == 0 {
		return false, err
	}
	for _, c := range pods.Items[0].Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue, nil
		}
	}
	return false, nil
}

func (d *demo) agentLogs(ctx context.Context) string {
	pods, err := d.client.CoreV1().Pods(chart.Namespace).List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/component=agent"})
	if err != nil || len(pods.Items) == 0 {
		return "(no agent pod)"
	}
	out, _ := d.logs(ctx, chart.Namespace, pods.Items[0].Name, "agent")
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if len(lines) > 20 {
		lines = lines[len(lines)-20:]
	}
	return "agent log (last lines):\n" + strings.Join(lines, "\n")
}

func (d *demo) logs(ctx context.Context, ns, pod, container string) (string, error) {
	b, err := d.client.CoreV1().Pods(ns).GetLogs(pod, &corev1.PodLogOptions{Container: container}).DoRaw(ctx)
	return string(b), err
}

func testapp(ns, name string, labels map[string]string) *corev1.Pod {
	grace := int64(1)
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, Labels: labels},
		Spec: corev1.PodSpec{
			TerminationGracePeriodSeconds: &grace,
			Containers: []corev1.Container{{Name: "app", Image: images.TestAppRef, ImagePullPolicy: corev1.PullNever,
				Args: []string{"--listen", ":8080"}}},
		},
	}
}

// runPod creates p and waits until it runs with an IP.
func (d *demo) runPod(ctx context.Context, p *corev1.Pod) (*corev1.Pod, error) {
	if _, err := d.client.CoreV1().Pods(p.Namespace).Create(ctx, p, metav1.CreateOptions{}); err != nil {
		return nil, err
	}
	var got *corev1.Pod
	err := d.wait(2*time.Minute, p.Namespace+"/"+p.Name+" Running", func() (bool, error) {
		var err error
		got, err = d.client.CoreV1().Pods(p.Namespace).Get(ctx, p.Name, metav1.GetOptions{})
		return err == nil && got.Status.Phase == corev1.PodRunning && got.Status.PodIP != "", err
	})
	return got, err
}

// down uninstalls inpod (the agent removes itself from the node) and
// stops the node.
func (d *demo) down(ctx context.Context) error {
	if _, err := os.Stat(d.target.Kubeconfig); err == nil {
		// The agent removes inpod from the node when its DaemonSet goes.
		out, err := d.target.Helm(ctx, d.repo, "uninstall", chart.Release, "-n", chart.Namespace, "--wait", "--timeout", "2m")
		switch {
		case err == nil:
			d.say("uninstalled inpod (helm uninstall)")
		case strings.Contains(out, "not found"):
			d.say("inpod was not installed")
		default:
			fmt.Fprintln(os.Stderr, "helm uninstall:", err)
		}
	}
	cmd := exec.CommandContext(ctx, filepath.Join(d.repo, "bin", "localnode"), "down", "--root", d.root)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return fmt.Errorf("localnode down: %v: %s", err, out)
	}
	d.say("the local node is down and removed")
	return nil
}
