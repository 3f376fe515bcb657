// Package chart installs inpod with its Helm chart on the local test node
// (the harness's e2e/cluster node, in-process or brought up by make
// cluster-up), for the demo and the end-to-end tests: images imported into
// the node's containerd, the chart's values pointed at the node's paths.
package chart

import (
	"bytes"
	"context"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/inpod-dev/inpod/e2e/cluster"
	"github.com/inpod-dev/inpod/e2e/images"
	"github.com/inpod-dev/inpod/release"
)

// Namespace and release the demo and tests install into.
const (
	Namespace = "inpod-system"
	Release   = "inpod"
)

// Target is a local node to install on.
type Target struct {
	// Root is the node's state root: the agent's sockets and state go
	// under it too, so the node's teardown removes them.
	Root       string
	Kubeconfig string
	// Containerd is the node's containerd socket (for image import).
	Containerd string
	// CNIBin and CNIConf are the node's CNI dirs (the harness keeps its
	// own, not /opt/cni/bin and /etc/cni/net.d).
	CNIBin, CNIConf string
	// KubeletDir is the kubelet's --root-dir (its plugin registry is
	// under it; the device-plugin dir is fixed on the host whatever it is).
	KubeletDir string
}

// LocalNode is the node `make cluster-up` runs under root.
func LocalNode(root string) Target {
	return Target{
		Root:       root,
		Kubeconfig: filepath.Join(root, "admin.kubeconfig"),
		Containerd: filepath.Join(root, "containerd", "containerd.sock"),
		CNIBin:     filepath.Join(root, "cni", "bin"),
		CNIConf:    filepath.Join(root, "cni", "net.d"),
		KubeletDir: filepath.Join(root, "kubelet"),
	}
}

// ImportImages imports image tarballs into the node's containerd.
func (t Target) ImportImages(ctx context.Context, tarballs ...string) error {
	for _, tb := range tarballs {
		out, err := exec.CommandContext(ctx, "ctr", "--address", t.Containerd, "-n", "k8s.io", "images", "import", tb).CombinedOutput()
		if err != nil {
			return fmt.Errorf("import %s: %v: %s", tb, err, out)
		}
	}
	return nil
}

// ImportReleased imports an image archive of make release's (an OCI index)
// into the node's containerd under its repository, by tag and by digest:
// a chart pinning it by digest runs it without a registry. containerd's
// CRI resolves <repository>@<digest> only as an image of that name, which
// a pull creates and a plain import does not (--digests does).
func (t Target) ImportReleased(ctx context.Context, archive, repository string) error {
	out, err := exec.CommandContext(ctx, "ctr", "--address", t.Containerd, "-n", "k8s.io", "images", "import",
		"--base-name", repository, "--digests", archive).CombinedOutput()
	if err != nil {
		return fmt.Errorf("import %s: %v: %s", archive, err, out)
	}
	return nil
}

// Values are the chart values for this node (NodeValues) and the agent's
// image by tag as imported (never pulled).
func (t Target) Values(tag string) ([]string, error) {
	vals, err := t.NodeValues()
	if err != nil {
		return nil, err
	}
	return append(vals,
		"--set", "agent.image.repository="+release.AgentRepository,
		"--set", "agent.image.tag="+tag,
		"--set", "agent.image.pullPolicy=Never",
	), nil
}

// NodeValues are the chart values for this node: its CNI dirs and the API
// server's address, since the node runs no kube-proxy for the
// `kubernetes` Service.
func (t Target) NodeValues() ([]string, error) {
	cfg, err := clientcmd.LoadFromFile(t.Kubeconfig)
	if err != nil {
		return nil, err
	}
	ctx := cfg.Contexts[cfg.CurrentContext]
	if ctx == nil || cfg.Clusters[ctx.Cluster] == nil {
		return nil, fmt.Errorf("%s: no current cluster", t.Kubeconfig)
	}
	u, err := url.Parse(cfg.Clusters[ctx.Cluster].Server)
	if err != nil {
		return nil, err
	}
	return []string{
		"--set", "paths.zdsSocket=" + t.ZDSSocket(),
		"--set", "paths.cniSocket=" + filepath.Join(t.Root, "inpod", "run", "cni.sock"),
		"--set", "paths.stateDir=" + filepath.Join(t.Root, "inpod", "state"),
		"--set", "paths.cniBinDir=" + t.CNIBin,
		"--set", "paths.cniConfDir=" + t.CNIConf,
		"--set", "paths.podResourcesSocket=" + filepath.Join(t.KubeletDir, "pod-resources", "kubelet.sock"),
		"--set", "paths.draPluginRegistryDir=" + filepath.Join(t.KubeletDir, "plugins_registry"),
		"--set", "paths.draPluginDir=" + filepath.Join(t.KubeletDir, "plugins", "redirection.inpod.dev"),
		"--set", "agent.apiServer.host=" + u.Hostname(),
		"--set-string", "agent.apiServer.port=" + u.Port(),
	}, nil
}

// ZDSSocket is where the agent serves ztunnel on this node.
func (t Target) ZDSSocket() string { return filepath.Join(t.Root, "inpod", "ztunnel", "ztunnel.sock") }

// Helm runs the chart's pinned helm (./bin/helm, make deps) against the
// node and returns its output.
func (t Target) Helm(ctx context.Context, repo string, args ...string) (string, error) {
	helm := filepath.Join(repo, "bin", "helm")
	if _, err := os.Stat(helm); err != nil {
		return "", fmt.Errorf("no %s: run make deps", helm)
	}
	cmd := exec.CommandContext(ctx, helm, append([]string{"--kubeconfig", t.Kubeconfig}, args...)...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	if err != nil {
		return out.String(), fmt.Errorf("helm %s: %v: %s", strings.Join(args, " "), err, out.String())
	}
	return out.String(), nil
}

// Install installs (or upgrades) the chart from repo with the node's
// values plus extra.
func (t Target) Install(ctx context.Context, repo, tag string, extra ...string) error {
	vals, err := t.Values(tag)
	if err != nil {
		return err
	}
	args := append([]string{"upgrade", "--install", Release, filepath.Join(repo, "deploy", "helm", "inpod"),
		"-n", Namespace, "--create-namespace"}, vals...)
	_, err = t.Helm(ctx, repo, append(args, extra...)...)
	return err
}

// InstallRelease installs (or upgrades) the chart as make release
// publishes it: the packaged chart pkg with the values file that pins the
// images by digest, plus the node's values (NodeValues) and extra. The
// images must be imported (ImportImages) under the repositories the chart
// defaults to; the kubelet finds them by digest and pulls nothing.
func (t Target) InstallRelease(ctx context.Context, repo, pkg, valuesFile string, extra ...string) error {
	vals, err := t.NodeValues()
	if err != nil {
		return err
	}
	args := append([]string{"upgrade", "--install", Release, pkg, "-n", Namespace, "--create-namespace", "-f", valuesFile}, vals...)
	_, err = t.Helm(ctx, repo, append(args, extra...)...)
	return err
}

// StandIn is the ztunnel stand-in as a DaemonSet: a TEST PEER that plays
// ztunnel on the node's ZDS socket (it binds real listeners in each pod's
// netns and answers with the original destination; it proxies nothing).
// Like ztunnel it runs as root (the agent accepts only root peers), with
// SYS_ADMIN to enter pod netns from the fds it receives and NET_ADMIN to
// mark its sockets (SO_MARK 0x539, exempt from redirection). Like Istio's
// ztunnel chart it is node-critical with a CPU request: the agent gives
// each Add 5 s for ztunnel's ack, and a BestEffort peer (cpu.shares 2,
// level with every BestEffort app pod) starved by a burst of pod start-ups
// misses that, which fails the burst's ADDs and tests nothing of inpod.
func StandIn(tag, zdsSocket string) *appsv1.DaemonSet {
	labels := map[string]string{"app.kubernetes.io/name": "ztunnel-standin", "app.kubernetes.io/part-of": "inpod"}
	root := int64(0)
	grace := int64(5)
	hostDir := corev1.HostPathDirectoryOrCreate
	return &appsv1.DaemonSet{
		ObjectMeta: metav1.ObjectMeta{Name: "ztunnel-standin", Namespace: Namespace, Labels: labels},
		Spec: appsv1.DaemonSetSpec{
			Selector: &metav1.LabelSelector{MatchLabels: labels},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: labels},
				Spec: corev1.PodSpec{
					TerminationGracePeriodSeconds: &grace,
					PriorityClassName:             "system-node-critical",
					Tolerations:                   []corev1.Toleration{{Operator: corev1.TolerationOpExists}},
					Containers: []corev1.Container{{
						Name: "ztunnel-standin", Image: images.StandInRepository + ":" + tag, ImagePullPolicy: corev1.PullNever,
						SecurityContext: &corev1.SecurityContext{
							RunAsUser:    &root,
							Capabilities: &corev1.Capabilities{Drop: []corev1.Capability{"ALL"}, Add: []corev1.Capability{"SYS_ADMIN", "NET_ADMIN"}},
						},
						// ztunnel's DNS proxy, as Istio runs it by default
						// since 1.25: the chart captures DNS by default.
						Env:          []corev1.EnvVar{{Name: "INPOD_UDS", Value: zdsSocket}, {Name: "INPOD_DNS", Value: "true"}},
						VolumeMounts: []corev1.VolumeMount{{Name: "zds", MountPath: filepath.Dir(zdsSocket)}},
						Resources: corev1.ResourceRequirements{Requests: corev1.ResourceList{
							corev1.ResourceCPU: resource.MustParse("100m"), corev1.ResourceMemory: resource.MustParse("32Mi")}},
					}},
					Volumes: []corev1.Volume{{Name: "zds", VolumeSource: corev1.VolumeSource{
						HostPath: &corev1.HostPathVolumeSource{Path: filepath.Dir(zdsSocket), Type: &hostDir}}}},
				},
			},
		},
	}
}

// PrepareHost makes the host's /run/netns a shared mount, as `ip netns`
// does, when it is not one yet: the agent's container sees the netns the
// runtime creates later only through mount propagation, and the runtime
// refuses HostToContainer on a private mount (a host without systemd has
// a private /). Harmless to repeat; left in place like ip netns leaves it.
func PrepareHost() error {
	const dir = "/run/netns"
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	info, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return err
	}
	mounted, shared := false, false
	for _, line := range strings.Split(string(info), "\n") {
		f := strings.Fields(line)
		if len(f) > 6 && f[4] == dir {
			mounted = true
			shared = strings.Contains(strings.Join(f[6:], " "), "shared:")
		}
	}
	if !mounted {
		if err := unix.Mount(dir, dir, "", unix.MS_BIND|unix.MS_REC, ""); err != nil {
			return fmt.Errorf("bind %s: %w", dir, err)
		}
	}
	if !shared {
		if err := unix.Mount("", dir, "", unix.MS_SHARED|unix.MS_REC, ""); err != nil {
			return fmt.Errorf("make %s shared: %w", dir, err)
		}
	}
	return nil
}

// NodeTarget is an in-process test node.
func NodeTarget(n *cluster.Node) Target {
	return Target{Root: filepath.Dir(n.Kubeconfig), Kubeconfig: n.Kubeconfig, Containerd: n.Containerd, CNIBin: n.CNIBin, CNIConf: n.CNIConf, KubeletDir: n.KubeletDir}
}
