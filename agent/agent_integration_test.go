//go:build integration

package agent_test

import (
	"context"
	"encoding/json"

	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	types100 "github.com/containernetworking/cni/pkg/types/100"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"

	"github.com/inpod-dev/inpod/agent"
	"github.com/inpod-dev/inpod/agent/enroll"
	"github.com/inpod-dev/inpod/e2e/cluster"
	"github.com/inpod-dev/inpod/e2e/ztunnel"
	"github.com/inpod-dev/inpod/netns"
	"github.com/inpod-dev/inpod/netns/netnstest"
)

const nodeName = "test-node"

// world is a real apiserver, a scratch node netns with a primary CNI
// configuration (bridge + host-local), the agent running in-process against
// both, and the ztunnel stand-in connected to it.
type world struct {
	t       *testing.T
	client  kubernetes.Interface
	node    *netnstest.NetNS
	nodeNS  *os.File
	confDir string
	binDir  string
	standin *ztunnel.Standin
	agent   *agent.Agent
}

func newWorld(t *testing.T) *world {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	cp, err := cluster.StartControlPlane(ctx, cluster.Config{Root: filepath.Join(t.TempDir(), "cp")})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cp.Stop() })

	w := &world{t: t, client: cp.Client, node: netnstest.New(t)}
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
	pluginBin := filepath.Join(dir, "inpod-cni")
	if out, err := exec.Command("go", "build", "-o", pluginBin, "../cmd/inpod-cni").CombinedOutput(); err != nil {
		t.Fatalf("build inpod-cni: %v: %s", err, out)
	}

	for _, ns := range []struct {
		name   string
		labels map[string]string
	}{{"mesh", map[string]string{enroll.DataplaneModeLabel: enroll.DataplaneAmbient}}, {"plain", nil}} {
		if _, err := w.client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns.name, Labels: ns.labels}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}

	zdsSocket := filepath.Join(dir, "zt", "ztunnel.sock")
	a, err := agent.New(agent.Config{
		NodeName: nodeName, Kubeconfig: cp.Kubeconfig,
		ZDSSocket: zdsSocket, CNISocket: filepath.Join(dir, "inpod", "cni.sock"),
		CNIBinarySource: pluginBin, CNIBinDir: w.binDir, CNIConfDir: w.confDir, InstallCNI: true,
		StateDir: filepath.Join(dir, "state"), RedirectBackend: "nftables",
		ExcludedNamespaces: []string{"kube-system"}, HostNetNS: w.node.Path,
		HealthAddr: "127.0.0.1:0", MetricsAddr: "127.0.0.1:0",
		Logger: slog.New(slog.NewTextHandler(testWriter{t}, nil)),
	})
	if err != nil {
		t.Fatal(err)
	}
	w.agent = a
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("agent: %v", err)
		}
	})
	w.standin = ztunnel.New(ztunnel.Config{SocketPath: zdsSocket, Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
		MinBackoff: 10 * time.Millisecond, MaxBackoff: 100 * time.Millisecond})
	sctx, scancel := context.WithCancel(context.Background())
	sdone := make(chan struct{})
	go func() { w.standin.Run(sctx); close(sdone) }()
	t.Cleanup(func() { scancel(); <-sdone })

	w.eventually("the agent ready", func() bool { return a.Ready.State().Ready })
	return w
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimSpace(string(p)))
	return len(p), nil
}

func (w *world) eventually(what string, cond func() bool) {
	w.t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			w.t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
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
	files, _ := filepath.Glob(filepath.Join(w.confDir, "*.conflist"))
	if len(files) != 1 {
		w.t.Fatalf("conflists: %v", files)
	}
	list, err := libcni.ConfListFromFile(files[0])
	if err != nil {
		w.t.Fatal(err)
	}
	cni := libcni.NewCNIConfigWithCacheDir([]string{w.binDir}, filepath.Join(w.t.TempDir(), "cache"), nil)
	rt := &libcni.RuntimeConf{ContainerID: "c-" + pod.Name, NetNS: sandbox.Path, IfName: "eth0",
		Args: [][2]string{{"IgnoreUnknown", "1"}, {"K8S_POD_NAMESPACE", pod.Namespace}, {"K8S_POD_NAME", pod.Name}, {"K8S_POD_UID", string(pod.UID)}}}
	var res *types100.Result
	err = netns.Do(w.nodeNS, func() error {
		r, err := cni.AddNetworkList(context.Background(), list, rt)
		if err != nil {
			return err
		}
		res, err = types100.NewResultFromResult(r)
		return err
	})
	return res, err
}

func hasRules(t *testing.T, sandbox *netnstest.NetNS) bool {
	return strings.Contains(sandbox.Exec(t, "nft", "list", "ruleset"), "table inet inpod")
}

func (w *world) annotation(pod *corev1.Pod) string {
	p, err := w.client.CoreV1().Pods(pod.Namespace).Get(context.Background(), pod.Name, metav1.GetOptions{})
	if err != nil {
		return "error: " + err.Error()
	}
	return p.Annotations[enroll.RedirectionAnnotation]
}

func TestIntegrationAgentEnrollsFollowsLabelsAndRemoves(t *testing.T) {
	w := newWorld(t)
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
	w.eventually("the enabled annotation", func() bool { return w.annotation(meshPod) == enroll.AnnotationEnabled })

	// A pod in a namespace that is not enrolled gets nothing.
	plainPod, plainNS := w.pod("plain", "b")
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
	plainPod.Status.PodIP = res.IPs[0].Address.IP.String()
	plainPod.Status.PodIPs = []corev1.PodIP{{IP: plainPod.Status.PodIP}}
	plainPod.Status.Phase = corev1.PodRunning
	if _, err := w.client.CoreV1().Pods("plain").UpdateStatus(ctx, plainPod, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	runInPodCgroup(t, plainNS, string(plainPod.UID))
	ns, _ := w.client.CoreV1().Namespaces().Get(ctx, "plain", metav1.GetOptions{})
	ns.Labels = map[string]string{enroll.DataplaneModeLabel: enroll.DataplaneAmbient}
	if _, err := w.client.CoreV1().Namespaces().Update(ctx, ns, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	w.eventually("the labelled namespace's pod enrolled", func() bool {
		_, ok := w.standin.Workloads()[string(plainPod.UID)]
		return ok && hasRules(t, plainNS)
	})
	w.eventually("its annotation", func() bool { return w.annotation(plainPod) == enroll.AnnotationEnabled })

	// The pod opts out by its own label: removed live.
	p, _ := w.client.CoreV1().Pods("plain").Get(ctx, "b", metav1.GetOptions{})
	p.Labels = map[string]string{enroll.DataplaneModeLabel: enroll.DataplaneNone}
	if _, err := w.client.CoreV1().Pods("plain").Update(ctx, p, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	w.eventually("the opted-out pod removed", func() bool {
		_, ok := w.standin.Workloads()[string(plainPod.UID)]
		return !ok && !hasRules(t, plainNS) && w.annotation(plainPod) == ""
	})

	// Deleting the enrolled pod removes everything.
	if err := w.client.CoreV1().Pods("mesh").Delete(ctx, "a", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	w.eventually("the deleted pod removed", func() bool {
		_, ok := w.standin.Workloads()[string(meshPod.UID)]
		return !ok && !hasRules(t, meshNS) && !w.agent.Pipeline().IsEnrolled(types.UID(meshPod.UID))
	})
}

// runInPodCgroup starts a process in the sandbox netns inside a cgroup named
// as the kubelet names pod cgroups, and cleans both up.
func runInPodCgroup(t *testing.T, sandbox *netnstest.NetNS, uid string) {
	t.Helper()
	dir := filepath.Join("/sys/fs/cgroup/pids", "inpod-it-kubepods", "pod"+uid)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatalf("pod cgroup: %v", err)
	}
	cmd := exec.Command("ip", "netns", "exec", sandbox.Name, "sleep", "300")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
		os.Remove(dir)
		os.Remove(filepath.Dir(dir))
	})
	if err := os.WriteFile(filepath.Join(dir, "cgroup.procs"), []byte(strconv.Itoa(cmd.Process.Pid)), 0o644); err != nil {
		t.Fatal(err)
	}

}
