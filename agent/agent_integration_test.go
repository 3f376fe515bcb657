//go:build integration

package agent_test

import (
	"context"
	"encoding/json"

	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	types100 "github.com/containernetworking/cni/pkg/types/100"
	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"

	"github.com/inpod-dev/inpod/agent"
	"github.com/inpod-dev/inpod/deviceplugin"
	"github.com/inpod-dev/inpod/deviceplugin/kubelettest"
	"github.com/inpod-dev/inpod/dra"
	"github.com/inpod-dev/inpod/e2e/cluster"
	"github.com/inpod-dev/inpod/e2e/cluster/clustertest"
	"github.com/inpod-dev/inpod/enrollment"
	"github.com/inpod-dev/inpod/internal/testkit"
	"github.com/inpod-dev/inpod/netns"
	"github.com/inpod-dev/inpod/netns/netnstest"
	"github.com/inpod-dev/inpod/passlist"
	"github.com/inpod-dev/inpod/plugin/plugintest"
	ztunnel "github.com/inpod-dev/inpod/zds/zdstest"
)

const nodeName = "test-node"

// world is a real apiserver, a scratch node netns with a primary CNI
// configuration (bridge + host-local), the agent running in-process against
// both, and the ztunnel stand-in connected to it.
type world struct {
	t       testing.TB
	cp      *cluster.ControlPlane
	client  kubernetes.Interface
	node    *netnstest.NetNS
	nodeNS  *os.File
	confDir string
	binDir  string
	standin *ztunnel.Standin
	agent   *agent.Agent
	cfg     agent.Config
	// stopStandin stops the current stand-in.
	stopStandin func()
	kubelet     *kubelettest.Kubelet
	// agentArgs follow startAgentProcess's own flags (the later wins).
	agentArgs []string
}

func newWorld(t testing.TB) *world {
	t.Helper()
	return newWorldOn(t, clustertest.ControlPlane(t, cluster.Config{}))
}

// newWorldOn is newWorld on a control plane the test started (and may
// have filled).
func newWorldOn(t testing.TB, cp *cluster.ControlPlane) *world {
	t.Helper()
	ctx := context.Background()
	w := &world{t: t, cp: cp, client: cp.Client, node: netnstest.New(t)}
	w.nodeNS = w.node.Open(t)
	dir := t.TempDir()
	w.confDir, w.binDir = filepath.Join(dir, "net.d"), filepath.Join(dir, "bin")
	os.MkdirAll(w.confDir, 0o755)
	os.MkdirAll(w.binDir, 0o755)
	ref := os.Getenv("INPOD_TEST_CNI_PLUGINS")
	if ref == "" {
		t.Fatal("INPOD_TEST_CNI_PLUGINS is not set (make test-integration sets it)")
	}
	for _, p := range []string{"bridge", "host-local", "loopback"} {
		data, err := os.ReadFile(filepath.Join(ref, p))
		if err != nil {
			t.Fatal(err)
		}
		os.WriteFile(filepath.Join(w.binDir, p), data, 0o755)
	}
	primary, _ := json.Marshal(map[string]any{"cniVersion": "1.0.0", "name": "podnet", "plugins": []any{
		map[string]any{"type": "bridge", "bridge": "br-test", "isGateway": true,
			"ipam": map[string]any{"type": "host-local", "subnet": "198.51.100.0/24", "dataDir": filepath.Join(dir, "ipam")}},
	}})
	os.WriteFile(filepath.Join(w.confDir, "10-podnet.conflist"), primary, 0o644)
	image := filepath.Join(dir, "image")
	if err := plugintest.Build(image); err != nil {
		t.Fatal(err)
	}

	for _, ns := range []struct {
		name   string
		labels map[string]string
	}{{"mesh", map[string]string{enrollment.DataplaneModeLabel: enrollment.DataplaneAmbient}}, {"plain", nil}} {
		if _, err := w.client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns.name, Labels: ns.labels}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}

	// Unix socket paths are limited to 108 bytes; test names are long.
	sockDir, err := os.MkdirTemp("", "inpod-it-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(sockDir) })
	w.cfg = agent.Config{
		NodeName: nodeName, Kubeconfig: cp.Kubeconfig,
		ZDSSocket: filepath.Join(sockDir, "zt", "ztunnel.sock"), CNISocket: filepath.Join(sockDir, "inpod", "cni.sock"),
		CNISourceDir: image, CNIBinDir: w.binDir, CNIConfDir: w.confDir, InstallCNI: true,
		StateDir: filepath.Join(dir, "state"), RedirectBackend: "nftables",
		ExcludedNamespaces: []string{"kube-system"}, HostNetNS: w.node.Path,
		HealthAddr: "127.0.0.1:0", MetricsAddr: "127.0.0.1:0",
		DevicePlugin: deviceplugin.Config{PluginDir: filepath.Join(sockDir, "device-plugins"), Devices: 4},
		DRA:          dra.Config{RegistrarDir: filepath.Join(sockDir, "plugins_registry"), PluginDir: filepath.Join(sockDir, "dra")},
	}
	kubelet, err := kubelettest.Start(w.cfg.DevicePlugin.PluginDir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(kubelet.Stop)
	w.kubelet = kubelet
	w.stopStandin = w.startStandin()
	return w
}

// startInProcessAgent runs the agent inside the test until it ends.
func (w *world) startInProcessAgent() {
	w.t.Helper()
	stop := w.runAgent()
	w.t.Cleanup(func() {
		if err := stop(); err != nil {
			w.t.Errorf("agent: %v", err)
		}
	})
}

// runAgent runs the agent inside the test until stop, which returns what
// Run returned (and is safe to call again).
func (w *world) runAgent() (stop func() error) {
	w.t.Helper()
	cfg := w.cfg
	cfg.Logger = slog.New(slog.NewTextHandler(testWriter{w.t}, nil))
	a, err := agent.New(cfg)
	if err != nil {
		w.t.Fatal(err)
	}
	w.agent = a
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx) }()
	var once sync.Once
	var runErr error
	stop = func() error {
		once.Do(func() { cancel(); runErr = <-done })
		return runErr
	}
	w.t.Cleanup(func() { stop() })
	w.eventually("the agent ready", func() bool { return a.Ready.State().Ready })
	return stop
}

// A component failing at runtime ends Run with its error, promptly, having
// stopped everything else: the process exits non-zero and the kubelet restarts
// it, instead of an agent lingering half-alive behind a green /healthz
// (invariant 7, docs/design/invariants.md). Here the device-plugin directory
// vanishes, so the gate cannot serve its socket again.
func TestIntegrationAComponentFailingAtRuntimeEndsRun(t *testing.T) {
	w := newWorld(t)
	cfg := w.cfg
	cfg.Logger = slog.New(slog.NewTextHandler(testWriter{t}, nil))
	a, err := agent.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx) }()
	// A hung Run stops once cancelled: the test then fails instead of
	// hanging.
	t.Cleanup(func() { cancel(); <-done })
	w.eventually("the agent ready", func() bool { return a.Ready.State().Ready })

	failed := time.Now()
	// The plugin may serve again into the directory while it is being
	// removed (then the last rmdir finds it not empty): remove until gone.
	w.eventually("the device-plugin directory removed", func() bool { return os.RemoveAll(w.cfg.DevicePlugin.PluginDir) == nil })
	select {
	case err := <-done:
		done <- err // for the cleanup
		if err == nil || !strings.Contains(err.Error(), "deviceplugin") {
			t.Fatalf("Run returned %v, want the device plugin's failure", err)
		}
		t.Logf("Run returned %s after the failure: %v", time.Since(failed).Round(time.Millisecond), err)
	case <-time.After(5 * time.Second):
		t.Fatal("Run did not return within 5 s of the device plugin failing: the agent hangs half-alive")
	}
}

// startStandin connects a fresh ztunnel stand-in; the returned func stops it.
func (w *world) startStandin() func() {
	z, stop := ztunnel.Start(w.t, ztunnel.Config{SocketPath: w.cfg.ZDSSocket})
	w.standin = z
	return stop
}

type testWriter struct{ t testing.TB }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimSpace(string(p)))
	return len(p), nil
}

func (w *world) eventually(what string, cond func() bool) {
	w.t.Helper()
	testkit.Eventually(w.t, 20*time.Second, what, cond)
}

// pod creates a pod object bound to the node and a netns for its sandbox.
func (w *world) pod(namespace, name string) (*corev1.Pod, *netnstest.NetNS) {
	w.t.Helper()
	pod, err := w.client.CoreV1().Pods(namespace).Create(context.Background(), &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec:       corev1.PodSpec{NodeName: nodeName, Containers: []corev1.Container{{Name: "app", Image: "testapp"}}},
	}, metav1.CreateOptions{})
	if err != nil {
		w.t.Fatal(err)
	}
	return pod, netnstest.New(w.t)
}

// cniAdd runs the node's installed chain for the pod through libcni, in the
// node netns, as a runtime would.
func (w *world) cniAdd(pod *corev1.Pod, sandbox *netnstest.NetNS) (*types100.Result, error) {
	w.t.Helper()
	return w.cni("ADD", pod, sandbox, "c-"+pod.Name)
}

// cni runs ADD or DEL of the node's installed chain for one sandbox of the
// pod, in the node netns, as a runtime would.
func (w *world) cni(op string, pod *corev1.Pod, sandbox *netnstest.NetNS, containerID string) (*types100.Result, error) {
	w.t.Helper()
	list, _, err := testkit.RuntimeConfig(w.confDir)
	if err != nil {
		w.t.Fatal(err)
	}
	return w.runChain(list, op, pod, sandbox, containerID)
}

// runChain runs ADD or DEL of list (off the test's goroutine too).
func (w *world) runChain(list *libcni.NetworkConfigList, op string, pod *corev1.Pod, sandbox *netnstest.NetNS, containerID string) (*types100.Result, error) {
	cni := libcni.NewCNIConfigWithCacheDir([]string{w.binDir}, filepath.Join(w.confDir, "..", "cni-cache"), nil)
	rt := &libcni.RuntimeConf{ContainerID: containerID, NetNS: sandbox.Path, IfName: "eth0",
		Args: [][2]string{{"IgnoreUnknown", "1"}, {"K8S_POD_NAMESPACE", pod.Namespace}, {"K8S_POD_NAME", pod.Name}, {"K8S_POD_UID", string(pod.UID)}}}
	var res *types100.Result
	err := netns.Do(w.nodeNS, func() error {
		if op == "DEL" {
			return cni.DelNetworkList(context.Background(), list, rt)
		}
		r, err := cni.AddNetworkList(context.Background(), list, rt)
		if err != nil {
			return err
		}
		res, err = types100.NewResultFromResult(r)
		return err
	})
	return res, err
}

// setRunning reports the pod running with ip, as the kubelet would.
func (w *world) setRunning(pod *corev1.Pod, ip string) {
	w.t.Helper()
	ctx := context.Background()
	for attempt := 0; ; attempt++ {
		p, err := w.client.CoreV1().Pods(pod.Namespace).Get(ctx, pod.Name, metav1.GetOptions{})
		if err != nil {
			w.t.Fatal(err)
		}
		p.Status.PodIP, p.Status.PodIPs, p.Status.Phase = ip, []corev1.PodIP{{IP: ip}}, corev1.PodRunning
		_, err = w.client.CoreV1().Pods(pod.Namespace).UpdateStatus(ctx, p, metav1.UpdateOptions{})
		if err == nil {
			return
		}
		if attempt > 10 {
			w.t.Fatal(err)
		}
	}
}

func hasRules(t *testing.T, sandbox *netnstest.NetNS) bool {
	return strings.Contains(sandbox.Exec(t, "nft", "list", "ruleset"), "table inet inpod")
}

func (w *world) annotation(pod *corev1.Pod) string {
	p, err := w.client.CoreV1().Pods(pod.Namespace).Get(context.Background(), pod.Name, metav1.GetOptions{})
	if err != nil {
		return "error: " + err.Error()
	}
	return p.Annotations[enrollment.RedirectionAnnotation]
}

// Unless told otherwise, the gate advertises one device per pod the Node
// can run, so it never caps a node whose maxPods is above the default.
func TestIntegrationDevicesFollowTheNodesPodCapacity(t *testing.T) {
	w := newWorld(t)
	ctx := context.Background()
	node, err := w.client.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: nodeName}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	node.Status.Capacity = corev1.ResourceList{corev1.ResourcePods: resource.MustParse("250")}
	if _, err := w.client.CoreV1().Nodes().UpdateStatus(ctx, node, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	w.cfg.DevicePlugin.Devices = 0
	w.startInProcessAgent()
	res := deviceplugin.DefaultResourceName
	w.eventually("250 devices advertised", func() bool { return w.kubelet.Capacity(res) == 250 && w.kubelet.Allocatable(res) == 250 })
}

// A pod whose sandbox is recreated (the runtime's ADD for the new one, then
// the DEL for the old one, which may come in either order) stays enrolled
// with the new netns; the old sandbox's DEL must not undo it.
func TestIntegrationRecreatedSandboxSurvivesTheOldSandboxesDEL(t *testing.T) {
	w := newWorld(t)
	w.startInProcessAgent()
	pod, first := w.pod("mesh", "recreated")
	if _, err := w.cni("ADD", pod, first, "sandbox-1"); err != nil {
		t.Fatal(err)
	}
	second := netnstest.New(t)
	if _, err := w.cni("ADD", pod, second, "sandbox-2"); err != nil {
		t.Fatalf("ADD for the recreated sandbox: %v", err)
	}
	secondID, err := netns.IdentityOfPath(second.Path)
	if err != nil {
		t.Fatal(err)
	}
	inZtunnel := func() (netns.Identity, bool) {
		wl, ok := w.standin.Workloads()[string(pod.UID)]
		return wl.NetNS, ok
	}
	if id, ok := inZtunnel(); !ok || id != secondID || !hasRules(t, second) {
		t.Fatalf("after the second ADD ztunnel has netns %v (%v), want the new sandbox's %v; rules there: %v", id, ok, secondID, hasRules(t, second))
	}
	if _, err := w.cni("DEL", pod, first, "sandbox-1"); err != nil {
		t.Fatalf("DEL of the old sandbox: %v", err)
	}
	if id, ok := inZtunnel(); !ok || id != secondID || !hasRules(t, second) {
		t.Fatalf("the old sandbox's DEL undid the pod's enrollment (ztunnel: %v %v; rules: %v)", id, ok, hasRules(t, second))
	}
	if _, err := w.cni("DEL", pod, second, "sandbox-2"); err != nil {
		t.Fatalf("DEL of the current sandbox: %v", err)
	}
	if _, ok := inZtunnel(); ok || hasRules(t, second) {
		t.Fatal("the current sandbox's DEL left the pod enrolled")
	}
}

func TestIntegrationAgentEnrollsFollowsLabelsAndRemoves(t *testing.T) {
	w := newWorld(t)
	w.startInProcessAgent()
	ctx := context.Background()

	// An enrolled pod: rules, ztunnel's Add, and the annotation.
	meshPod, meshNS := w.pod("mesh", "a")
	if _, err := w.cniAdd(meshPod, meshNS); err != nil {
		t.Fatalf("CNI ADD of an enrolled pod: %v", err)
	}
	if _, ok := w.standin.Workloads()[string(meshPod.UID)]; !ok {
		t.Fatal("ADD returned before ztunnel had the pod")
	}
	if !hasRules(t, meshNS) {
		t.Fatal("ADD returned before the pod's rules were in place")
	}
	w.eventually("the enabled annotation", func() bool { return w.annotation(meshPod) == enrollment.AnnotationEnabled })

	// A pod in a namespace that is not enrolled gets nothing. The agent
	// lists it for the plugin as not enrolled, so its ADD asks nobody;
	// the enrolled pod is never listed.
	plainPod, plainNS := w.pod("plain", "b")
	passList := filepath.Join(filepath.Dir(w.cfg.CNISocket), "not-enrolled")
	w.eventually("the plain pod on the pass list", func() bool { return passlist.Passes(passList, "plain", "b", string(plainPod.UID)) })
	if passlist.Passes(passList, "mesh", "a", string(meshPod.UID)) {
		t.Fatal("an enrolled pod is on the pass list")
	}
	res, err := w.cniAdd(plainPod, plainNS)
	if err != nil {
		t.Fatalf("CNI ADD of a pod that is not enrolled: %v", err)
	}
	if hasRules(t, plainNS) || w.annotation(plainPod) != "" {
		t.Fatal("a pod that is not enrolled got rules or an annotation")
	}
	if _, ok := w.standin.Workloads()[string(plainPod.UID)]; ok {
		t.Fatal("ztunnel was told about a pod that is not enrolled")
	}

	// Labelling its namespace enrolls the running pod: its netns is found
	// through procfs (a process in the pod's cgroup, in a netns holding the
	// pod's IP).
	w.setRunning(plainPod, res.IPs[0].Address.IP.String())
	plainNS.RunAsPod(t, string(plainPod.UID))
	ns, _ := w.client.CoreV1().Namespaces().Get(ctx, "plain", metav1.GetOptions{})
	ns.Labels = map[string]string{enrollment.DataplaneModeLabel: enrollment.DataplaneAmbient}
	if _, err := w.client.CoreV1().Namespaces().Update(ctx, ns, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	w.eventually("the labelled namespace's pod enrolled and off the pass list", func() bool {
		_, ok := w.standin.Workloads()[string(plainPod.UID)]
		return ok && hasRules(t, plainNS) && !passlist.Passes(passList, "plain", "b", string(plainPod.UID))
	})
	w.eventually("its annotation", func() bool { return w.annotation(plainPod) == enrollment.AnnotationEnabled })

	// The pod opts out by its own label: removed live.
	p, _ := w.client.CoreV1().Pods("plain").Get(ctx, "b", metav1.GetOptions{})
	p.Labels = map[string]string{enrollment.DataplaneModeLabel: enrollment.DataplaneNone}
	if _, err := w.client.CoreV1().Pods("plain").Update(ctx, p, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	w.eventually("the opted-out pod removed", func() bool {
		_, ok := w.standin.Workloads()[string(plainPod.UID)]
		return !ok && !hasRules(t, plainNS) && w.annotation(plainPod) == ""
	})

	// The scheduling gate follows readiness: ztunnel gone → Unhealthy.
	res4 := deviceplugin.DefaultResourceName
	w.eventually("the gate open", func() bool { return w.kubelet.Allocatable(res4) == 4 })
	w.stopStandin()
	w.eventually("the gate closed without ztunnel", func() bool { return w.kubelet.Allocatable(res4) == 0 && w.kubelet.Capacity(res4) == 4 })
	// Without ztunnel an enrolled pod fails closed, with an event saying why.
	lonely, lonelyNS := w.pod("mesh", "lonely")
	if _, err := w.cniAdd(lonely, lonelyNS); err == nil || !strings.Contains(err.Error(), "no ztunnel connected") {
		t.Fatalf("ADD without ztunnel = %v, want a failure naming the cause", err)
	}
	if hasRules(t, lonelyNS) {
		t.Fatal("a pod that failed to enroll kept its rules")
	}
	w.eventually("a ZtunnelNotConnected event on the pod", func() bool {
		evs, err := w.client.CoreV1().Events("mesh").List(ctx, metav1.ListOptions{FieldSelector: "involvedObject.name=lonely"})
		if err != nil {
			return false
		}
		for _, e := range evs.Items {
			if e.Reason == "ZtunnelNotConnected" && e.Type == corev1.EventTypeWarning {
				return true
			}
		}
		return false
	})
	w.stopStandin = w.startStandin()
	w.eventually("the gate open again", func() bool { return w.kubelet.Allocatable(res4) == 4 })

	// The pod gone from the API removes everything. (A graceful delete
	// only marks it terminating: it still runs and stays in the mesh
	// until its sandbox's DEL or its removal, which the kubelet makes once
	// its containers stopped; there is no kubelet here, so the test
	// removes it at once.)
	zero := int64(0)
	if err := w.client.CoreV1().Pods("mesh").Delete(ctx, "a", metav1.DeleteOptions{GracePeriodSeconds: &zero}); err != nil {
		t.Fatal(err)
	}
	w.eventually("the deleted pod removed", func() bool {
		_, ok := w.standin.Workloads()[string(meshPod.UID)]
		return !ok && !hasRules(t, meshNS) && !w.agent.Pipeline().IsEnrolled(types.UID(meshPod.UID))
	})
}

// buildAgent builds cmd/inpod-agent for the test.
func buildAgent(t testing.TB) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "inpod-agent")
	if out, err := exec.Command("go", "build", "-o", bin, "../cmd/inpod-agent").CombinedOutput(); err != nil {
		t.Fatalf("build inpod-agent: %v: %s", err, out)
	}
	return bin
}

// agentProcess runs cmd/inpod-agent as its own process, so it can be killed.
type agentProcess struct {
	cmd     *exec.Cmd
	health  string
	metrics string
}

func (w *world) startAgentProcess(bin string) *agentProcess {
	w.t.Helper()
	p := w.startAgentProcessNoWait(bin)
	// A minute, not w.eventually's 20 s: a restart with hundreds of
	// running pods restores them all before it is ready (the enrollment
	// benchmark times that).
	testkit.Eventually(w.t, time.Minute, "the agent process ready", func() bool { return ready(p) })
	return p
}

// ready reports whether the agent process answers /readyz with 200.
func ready(p *agentProcess) bool {
	resp, err := http.Get("http://" + p.health + "/readyz")
	if err != nil {
		return false
	}
	resp.Body.Close()
	return resp.StatusCode == http.StatusOK
}

// startAgentProcessNoWait starts the agent process without waiting for it
// to be ready (safe off the test's goroutine).
func (w *world) startAgentProcessNoWait(bin string) *agentProcess {
	health, metrics := freeAddr(w.t), freeAddr(w.t)
	c := w.cfg
	cmd := exec.Command(bin,
		"--node-name", c.NodeName, "--kubeconfig", c.Kubeconfig,
		"--zds-socket", c.ZDSSocket, "--cni-socket", c.CNISocket,
		"--cni-source-dir", c.CNISourceDir, "--cni-bin-dir", c.CNIBinDir, "--cni-conf-dir", c.CNIConfDir,
		"--state-dir", c.StateDir, "--redirect-backend", c.RedirectBackend,
		"--host-netns", c.HostNetNS, "--device-plugin-dir", c.DevicePlugin.PluginDir, "--devices", "4",
		"--gate", c.Gate, "--dra-registrar-dir", c.DRA.RegistrarDir, "--dra-plugin-dir", c.DRA.PluginDir,
		"--health-addr", health, "--metrics-addr", metrics, "--log-level", "debug")
	cmd.Args = append(cmd.Args, w.agentArgs...)
	cmd.Stdout, cmd.Stderr = testWriter{w.t}, testWriter{w.t}
	if err := cmd.Start(); err != nil {
		w.t.Error(err)
		return &agentProcess{cmd: cmd, health: health, metrics: metrics}
	}
	w.t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	return &agentProcess{cmd: cmd, health: health, metrics: metrics}
}

func freeAddr(t testing.TB) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

func TestIntegrationAgentKilledAndRestartedLeavesRulesAndResendsSnapshot(t *testing.T) {
	w := newWorld(t)
	bin := buildAgent(t)
	// As shipped, the agent gives back its code's pages once ready and
	// quiet (here after 100 ms, not 30 s): what follows (an enrollment, a
	// SIGKILL and restore) runs on code read back from the binary.
	w.agentArgs = []string{"--release-startup-memory-quiet", "100ms"}
	syscall.Sync()
	first := w.startAgentProcess(bin)
	var binFS unix.Statfs_t
	if unix.Statfs(bin, &binFS) == nil && binFS.Type == unix.TMPFS_MAGIC {
		t.Log("the agent binary is on tmpfs, where there is no page cache to give back")
	} else {
		w.eventually("the agent released its start-up pages", func() bool {
			return first.metric(t, "inpod_startup_memory_released_bytes") > 0
		})
	}

	pod, sandbox := w.pod("mesh", "long-lived")
	res, err := w.cniAdd(pod, sandbox)
	if err != nil {
		t.Fatal(err)
	}
	// What the kubelet would report, and a container process, so the
	// restarted agent can find the pod again.
	w.setRunning(pod, res.IPs[0].Address.IP.String())
	sandbox.RunAsPod(t, string(pod.UID))
	// Rule handles change whenever a rule is rewritten: equal listings
	// (handles included) prove the rules were never touched.
	rulesBefore := sandbox.Exec(t, "nft", "-a", "list", "ruleset")
	connectsBefore := w.standin.Connects()

	first.cmd.Process.Signal(syscall.SIGKILL)
	first.cmd.Wait()
	w.startAgentProcess(bin)

	w.eventually("ztunnel reconnected and re-snapshotted", func() bool {
		return w.standin.Connects() > connectsBefore && w.standin.SnapshotDone()
	})
	if _, ok := w.standin.Workloads()[string(pod.UID)]; !ok {
		t.Fatal("the restarted agent's snapshot dropped the running pod")
	}
	if errs := w.standin.ProtocolErrors(); len(errs) > 0 {
		t.Fatalf("protocol errors: %v", errs)
	}
	if after := sandbox.Exec(t, "nft", "-a", "list", "ruleset"); after != rulesBefore {
		t.Fatalf("the restart rewrote the pod's rules:\nbefore:\n%s\nafter:\n%s", rulesBefore, after)
	}

	// A ztunnel restart (a new process: it knows nothing) gets the full
	// snapshot, with the pod's netns.
	w.restartStandin()
	w.eventually("the new ztunnel's snapshot", func() bool {
		_, ok := w.standin.Workloads()[string(pod.UID)]
		return ok && w.standin.SnapshotDone()
	})
	want, _ := netns.IdentityOfPath(sandbox.Path)
	if got := w.standin.Workloads()[string(pod.UID)].NetNS; got != want {
		t.Fatalf("new ztunnel got netns %v, want the pod's %v", got, want)
	}
}

// restartStandin stops the current stand-in and connects a new one.
func (w *world) restartStandin() {
	w.stopStandin()
	w.stopStandin = w.startStandin()
}

func TestIntegrationAgentRidesOutAnAPIServerOutage(t *testing.T) {
	w := newWorld(t)
	w.startInProcessAgent()
	ctx := context.Background()

	before, beforeNS := w.pod("mesh", "before")
	if _, err := w.cniAdd(before, beforeNS); err != nil {
		t.Fatal(err)
	}
	w.eventually("the first pod's annotation", func() bool { return w.annotation(before) == enrollment.AnnotationEnabled })
	rulesBefore := beforeNS.Exec(t, "nft", "-a", "list", "ruleset")
	during, duringNS := w.pod("mesh", "during")
	w.eventually("the pod in the agent's cache", func() bool { return w.agent.PodCached("mesh", "during") })

	w.cp.StopAPIServer()
	// A pod the agent knows enrolls without the API server.
	if _, err := w.cniAdd(during, duringNS); err != nil {
		t.Fatalf("ADD of a cached pod during the outage: %v", err)
	}
	if !hasRules(t, duringNS) {
		t.Fatal("no rules for the pod enrolled during the outage")
	}
	// A pod the agent has never seen cannot be decided: it fails closed.
	ghost := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "mesh", Name: "ghost", UID: "0f0f0f0f-0000-4000-8000-000000000000"}}
	ghostNS := netnstest.New(t)
	if _, err := w.cniAdd(ghost, ghostNS); err == nil {
		t.Fatal("ADD of a pod unknown to the agent succeeded while the API server was down")
	}
	if hasRules(t, ghostNS) {
		t.Fatal("the undecidable pod got rules")
	}
	// Nothing already enrolled was touched.
	if after := beforeNS.Exec(t, "nft", "-a", "list", "ruleset"); after != rulesBefore {
		t.Fatal("the outage disturbed an enrolled pod's rules")
	}
	if _, ok := w.standin.Workloads()[string(before.UID)]; !ok {
		t.Fatal("the outage removed an enrolled pod from ztunnel")
	}

	if err := w.cp.StartAPIServer(ctx); err != nil {
		t.Fatal(err)
	}
	// The agent catches up: the annotation written late, new pods enroll.
	w.eventually("the outage pod's annotation after the API returned", func() bool {
		return w.annotation(during) == enrollment.AnnotationEnabled
	})
	after, afterNS := w.pod("mesh", "after")
	if _, err := w.cniAdd(after, afterNS); err != nil {
		t.Fatalf("ADD after the outage: %v", err)
	}
}
