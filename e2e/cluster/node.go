package cluster

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/inpod-dev/inpod/e2e/images"
)

// CNIBinDirEnv names the directory with the reference CNI plugins; the
// Makefile sets it from hack/cni-bins.sh.
const CNIBinDirEnv = "INPOD_TEST_CNI_PLUGINS"

// Names and ranges of the node's networking. The pod range is reserved for
// benchmarking (RFC 2544) so it cannot collide with any real network.
const (
	BridgeName  = "inpodbr0"
	PodCIDR     = "198.18.0.0/24"
	NetworkName = "e2e"
)

// NodeConfig adds what a full node needs to Config.
type NodeConfig struct {
	Config
	// CNIBinDir holds bridge, host-local, loopback, portmap (default:
	// $INPOD_TEST_CNI_PLUGINS).
	CNIBinDir string
	// RepoDir is the inpod module root, for building images.
	RepoDir string
	// ExtraImages are built and imported besides pause and testapp.
	ExtraImages []images.Image
	// StaticPodPath, when set, is the kubelet's staticPodPath: a directory
	// of pod manifests it runs as static pods (with mirror pods in the
	// API). Static pods are not deleted through the API: remove their
	// manifests before Stop.
	StaticPodPath string
	// BeforeKubelet, when set, runs once the control plane is up and
	// before the kubelet starts (and registers its Node): e.g. to install
	// an admission policy the registration must meet.
	BeforeKubelet func(ctx context.Context, cp *ControlPlane) error
}

// Node is a single-node cluster.
type Node struct {
	*ControlPlane
	cfg         NodeConfig
	Name        string
	CNIBin      string // the node's CNI bin dir (plugins are copied here)
	CNIConf     string // the node's CNI conf dir
	KubeletDir  string
	Containerd  string // containerd's socket
	netnsBefore map[string]bool
	// createdKubeletDir: /var/lib/kubelet did not exist before this node.
	createdKubeletDir bool
	// tablesBefore are the host's nf_tables tables before the node started;
	// the kubelet adds its own (KUBE-FIREWALL, canaries), removed at Stop.
	tablesBefore map[string]bool
	// kubeletPorts are the kubelet's port and healthz port, kept for a
	// restart.
	kubeletPorts [2]int
}

// StartNode brings up a full node and waits until it is Ready with its
// images imported. Stop it with Stop.
func StartNode(ctx context.Context, cfg NodeConfig) (*Node, error) {
	if cfg.CNIBinDir == "" {
		cfg.CNIBinDir = os.Getenv(CNIBinDirEnv)
	}
	if cfg.CNIBinDir == "" {
		return nil, fmt.Errorf("cluster: no CNI plugins: set %s (hack/cni-bins.sh prints it)", CNIBinDirEnv)
	}
	for _, b := range []string{"containerd", "containerd-shim-runc-v2", "runc", "ctr"} {
		if _, err := exec.LookPath(b); err != nil {
			return nil, fmt.Errorf("cluster: %s not installed (apt-get install containerd runc): %w", b, err)
		}
	}
	if err := cfg.defaults(); err != nil {
		return nil, err
	}
	if err := clearLeftovers(cfg.Root); err != nil {
		return nil, err
	}
	host, err := os.Hostname()
	if err != nil {
		return nil, err
	}
	if swept := sweepStaleNetns(); len(swept) > 0 {
		fmt.Fprintf(os.Stderr, "cluster: deleted %d netns a killed earlier run left holding addresses of %s: %s\n", len(swept), PodCIDR, strings.Join(swept, " "))
	}
	n := &Node{
		ControlPlane: &ControlPlane{cfg: cfg.Config},
		cfg:          cfg,
		Name:         strings.ToLower(host),
		CNIBin:       filepath.Join(cfg.Root, "cni", "bin"),
		CNIConf:      filepath.Join(cfg.Root, "cni", "net.d"),
		KubeletDir:   filepath.Join(cfg.Root, "kubelet"),
		Containerd:   filepath.Join(cfg.Root, "containerd", "containerd.sock"),
		netnsBefore:  listNetns(),
	}
	if _, err := os.Stat("/var/lib/kubelet"); os.IsNotExist(err) {
		n.createdKubeletDir = true
	}
	n.tablesBefore = hostTables()
	if err := n.start(ctx); err != nil {
		n.Stop()
		return nil, err
	}
	return n, nil
}

func (n *Node) start(ctx context.Context) error {
	if err := n.ControlPlane.start(ctx); err != nil {
		return err
	}
	root := n.cfg.Root
	p := n.pki.path
	if err := n.pki.issue("kubelet", "system:node:"+n.Name, []string{"system:nodes"}, false, nil, nil); err != nil {
		return err
	}
	for _, c := range []string{"controller-manager", "scheduler", "kubelet"} {
		if err := n.writeKubeconfig(filepath.Join(root, c+".kubeconfig"), c); err != nil {
			return err
		}
	}
	if err := writePEMKey(p("ca.key"), n.pki); err != nil {
		return err
	}
	ports, err := freePorts(4)
	if err != nil {
		return err
	}

	cm, err := startProcess(root, "kube-controller-manager", filepath.Join(n.cfg.BinDir, "kube-controller-manager"), []string{
		"--kubeconfig", filepath.Join(root, "controller-manager.kubeconfig"),
		"--authentication-kubeconfig", filepath.Join(root, "controller-manager.kubeconfig"),
		"--authorization-kubeconfig", filepath.Join(root, "controller-manager.kubeconfig"),
		"--bind-address", "127.0.0.1", "--secure-port", strconv.Itoa(ports[0]),
		"--service-account-private-key-file", p("sa.key"),
		"--root-ca-file", p("ca.crt"),
		"--cluster-signing-cert-file", p("ca.crt"), "--cluster-signing-key-file", p("ca.key"),
		"--use-service-account-credentials",
		"--leader-elect=false",
		"--controllers", "*,-nodeipam",
	}, nil)
	if err != nil {
		return err
	}
	n.procs = append(n.procs, cm)
	sched, err := startProcess(root, "kube-scheduler", filepath.Join(n.cfg.BinDir, "kube-scheduler"), []string{
		"--kubeconfig", filepath.Join(root, "scheduler.kubeconfig"),
		"--authentication-kubeconfig", filepath.Join(root, "scheduler.kubeconfig"),
		"--authorization-kubeconfig", filepath.Join(root, "scheduler.kubeconfig"),
		"--bind-address", "127.0.0.1", "--secure-port", strconv.Itoa(ports[1]),
		"--leader-elect=false",
	}, nil)
	if err != nil {
		return err
	}
	n.procs = append(n.procs, sched)

	if err := n.setupCNI(); err != nil {
		return err
	}
	if err := n.startContainerd(ctx); err != nil {
		return err
	}
	if err := n.importImages(ctx); err != nil {
		return err
	}
	if n.cfg.BeforeKubelet != nil {
		if err := n.cfg.BeforeKubelet(ctx, n.ControlPlane); err != nil {
			return err
		}
	}
	// A new node inherits no device-plugin state: the kubelet's checkpoint
	// in the fixed host dir outlives any node (a killed run, or one whose
	// /var/lib/kubelet was there before it), and a resource registered in
	// it with no plugin serving makes the kubelet refuse every container
	// that requests it ("endpoint not found in cache for a registered
	// resource") for its first minutes: a DRA-backed inpod.dev/redirection
	// after a device-plugin node did exactly that.
	if err := os.Remove(filepath.Join(hostDevicePluginDir, kubeletDeviceCheckpoint)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("cluster: remove the kubelet's device-plugin checkpoint: %w", err)
	}
	if err := n.startKubelet(ports[2], ports[3]); err != nil {
		return err
	}
	if err := poll(90*time.Second, "node Ready", func() (bool, error) {
		for _, pr := range n.procs {
			if err := pr.running(); err != nil {
				return false, err
			}
		}
		node, err := n.Client.CoreV1().Nodes().Get(ctx, n.Name, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		for _, c := range node.Status.Conditions {
			if c.Type == corev1.NodeReady {
				return c.Status == corev1.ConditionTrue, fmt.Errorf("node condition Ready=%s: %s", c.Status, c.Message)
			}
		}
		return false, nil
	}); err != nil {
		return err
	}
	// Pods are refused until the controller-manager made the namespace's
	// service account.
	return poll(30*time.Second, "default service account", func() (bool, error) {
		_, err := n.Client.CoreV1().ServiceAccounts("default").Get(ctx, "default", metav1.GetOptions{})
		return err == nil, err
	})
}

func writePEMKey(path string, p *pki) error {
	der, err := marshalECKey(p)
	if err != nil {
		return err
	}
	return writePEM(path, "EC PRIVATE KEY", der)
}

// setupCNI copies the reference plugins into the node's bin dir and writes
// the primary conflist: bridge with host-local, then portmap.
func (n *Node) setupCNI() error {
	for _, d := range []string{n.CNIBin, n.CNIConf} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return err
		}
	}
	for _, plugin := range []string{"bridge", "host-local", "loopback", "portmap"} {
		data, err := os.ReadFile(filepath.Join(n.cfg.CNIBinDir, plugin))
		if err != nil {
			return fmt.Errorf("cluster: CNI plugin %s: %w", plugin, err)
		}
		if err := os.WriteFile(filepath.Join(n.CNIBin, plugin), data, 0o755); err != nil {
			return err
		}
	}
	conflist := primaryConflist(filepath.Join(n.cfg.Root, "cni", "ipam"))
	data, err := json.MarshalIndent(conflist, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(n.CNIConf, "10-e2e.conflist"), data, 0o644)
}

func (n *Node) startContainerd(ctx context.Context) error {
	dir := filepath.Join(n.cfg.Root, "containerd")
	if err := os.MkdirAll(dir, 0o711); err != nil {
		return err
	}
	config := containerdConfig(dir, n.Containerd, n.CNIBin, n.CNIConf)
	cfgPath := filepath.Join(dir, "config.toml")
	if err := os.WriteFile(cfgPath, []byte(config), 0o644); err != nil {
		return err
	}
	ctrd, err := startProcess(n.cfg.Root, "containerd", mustLook("containerd"), []string{"--config", cfgPath}, nil)
	if err != nil {
		return err
	}
	n.procs = append(n.procs, ctrd)
	return poll(30*time.Second, "containerd socket", func() (bool, error) {
		if err := ctrd.running(); err != nil {
			return false, err
		}
		c, err := net.Dial("unix", n.Containerd)
		if err != nil {
			return false, err
		}
		c.Close()
		return true, nil
	})
}

func mustLook(bin string) string {
	p, err := exec.LookPath(bin)
	if err != nil {
		return bin
	}
	return p
}

func (n *Node) importImages(ctx context.Context) error {
	out := filepath.Join(n.cfg.Root, "images")
	if err := os.MkdirAll(out, 0o755); err != nil {
		return err
	}
	imgs := append([]images.Image{
		{Ref: images.PauseRef, Package: "./e2e/images/pause", Dir: n.cfg.RepoDir},
		{Ref: images.TestAppRef, Package: "./e2e/images/testapp", Dir: n.cfg.RepoDir},
	}, n.cfg.ExtraImages...)
	for _, img := range imgs {
		tarPath, err := images.Build(ctx, img, out)
		if err != nil {
			return err
		}
		if err := n.Ctr(ctx, "images", "import", tarPath); err != nil {
			return err
		}
	}
	return nil
}

// Ctr runs ctr against the node's containerd in the k8s.io namespace.
func (n *Node) Ctr(ctx context.Context, args ...string) error {
	cmd := exec.CommandContext(ctx, "ctr", append([]string{"--address", n.Containerd, "-n", "k8s.io"}, args...)...)
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("ctr %s: %v: %s", strings.Join(args, " "), err, out)
	}
	return nil
}

func (n *Node) startKubelet(port, healthzPort int) error {
	n.kubeletPorts = [2]int{port, healthzPort}
	if err := os.MkdirAll(n.KubeletDir, 0o750); err != nil {
		return err
	}
	config := kubeletConfig(n.Containerd, n.cfg.NodeIP, port, healthzPort, n.pki.path("ca.crt"))
	if n.cfg.StaticPodPath != "" {
		config += fmt.Sprintf("staticPodPath: %q\n", n.cfg.StaticPodPath)
	}
	cfgPath := filepath.Join(n.cfg.Root, "kubelet-config.yaml")
	if err := os.WriteFile(cfgPath, []byte(config), 0o644); err != nil {
		return err
	}
	kubelet, err := startProcess(n.cfg.Root, "kubelet", filepath.Join(n.cfg.BinDir, "kubelet"), []string{
		"--config", cfgPath,
		"--kubeconfig", filepath.Join(n.cfg.Root, "kubelet.kubeconfig"),
		"--root-dir", n.KubeletDir,
		"--cert-dir", filepath.Join(n.KubeletDir, "pki"),
		"--hostname-override", n.Name,
		"--node-ip", n.cfg.NodeIP,
		"--v", "2",
	}, nil)
	if err != nil {
		return err
	}
	n.procs = append(n.procs, kubelet)
	return nil
}

// RestartKubelet stops the kubelet (SIGTERM, as systemd does on a restart)
// and starts it again with the same configuration, as after a kubelet
// upgrade: it forgets every device-plugin registration and removes the
// sockets in the device-plugin dir; pods keep running.
func (n *Node) RestartKubelet(ctx context.Context) error {
	i := slices.IndexFunc(n.procs, func(p *process) bool { return p.name == "kubelet" })
	if i < 0 {
		return fmt.Errorf("cluster: no kubelet running")
	}
	n.procs[i].stop(15 * time.Second)
	n.procs = slices.Delete(n.procs, i, i+1)
	return n.startKubelet(n.kubeletPorts[0], n.kubeletPorts[1])
}

// hostDevicePluginDir is fixed in the kubelet, whatever its --root-dir.
const hostDevicePluginDir = "/var/lib/kubelet/device-plugins"

// kubeletDeviceCheckpoint is the kubelet device manager's record of the
// registered resources and their allocations, in hostDevicePluginDir.
const kubeletDeviceCheckpoint = "kubelet_internal_checkpoint"

// DevicePluginDir is where the kubelet expects device plugin sockets.
func (n *Node) DevicePluginDir() string { return hostDevicePluginDir }
