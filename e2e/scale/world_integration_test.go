//go:build integration

package scale

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/utils/ptr"

	"github.com/inpod-dev/inpod/dra"
	"github.com/inpod-dev/inpod/e2e/cluster"
	"github.com/inpod-dev/inpod/e2e/cluster/clustertest"
	"github.com/inpod-dev/inpod/internal/testkit"
	"github.com/inpod-dev/inpod/nodecondition"
	"github.com/inpod-dev/inpod/taintcontroller"
)

// The sizes, overridable to iterate quickly or to try a bigger cluster.
func sizeFromEnv(tb testing.TB, name string, def int) int {
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	n, err := strconv.Atoi(v)
	if err != nil || n <= 0 {
		tb.Fatalf("%s=%q: want a positive number", name, v)
	}
	return n
}

const (
	resourceName = corev1.ResourceName("inpod.dev/redirection")
	benchNS      = "bench"
	agentNS      = "inpod-system"
	// The device plugin advertises one device per pod the node can hold.
	devicesPerNode = "110"
)

// world is one control plane with simulated nodes.
type world struct {
	cp *cluster.ControlPlane
	// cs is the benchmark's own client, with limits high enough that the
	// benchmark's writes are paced by the API server, not by client-go.
	cs    kubernetes.Interface
	nodes []string
	gate  gate
	// slices holds the DRA gate's ResourceSlice per node, as last written.
	mu     sync.Mutex
	slices map[string]*resourceapi.ResourceSlice
}

func newWorld(b *testing.B, g gate) *world {
	cp := clustertest.ControlPlane(b, cluster.Config{Root: filepath.Join(b.TempDir(), "cp")})
	cfg := rest.CopyConfig(cp.Rest)
	cfg.QPS, cfg.Burst = 5000, 10000
	cfg.ContentType = "application/vnd.kubernetes.protobuf"
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		b.Fatal(err)
	}
	w := &world{cp: cp, cs: cs, gate: g, slices: map[string]*resourceapi.ResourceSlice{}}
	for _, ns := range []string{benchNS, agentNS} {
		if _, err := cs.CoreV1().Namespaces().Create(context.Background(), &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
			b.Fatal(err)
		}
	}
	return w
}

// parallel runs fn(0..n-1) on workers goroutines and returns the first
// error.
func parallel(n, workers int, fn func(i int) error) error {
	var (
		next  atomic.Int64
		first error
		once  sync.Once
		wg    sync.WaitGroup
	)
	for range workers {
		wg.Go(func() {
			for {
				i := int(next.Add(1) - 1)
				if i >= n {
					return
				}
				if err := fn(i); err != nil {
					once.Do(func() { first = err })
					return
				}
			}
		})
	}
	wg.Wait()
	return first
}

const workers = 32

// addNodes creates n Nodes as a kubelet registers them (a 4-CPU, 16 GiB
// node for 110 pods, Ready), prepared by the gate (taint mode: the startup
// taint the chart's node-taint policy adds at registration).
func (w *world) addNodes(b *testing.B, n int) {
	ctx := context.Background()
	start := time.Now()
	w.nodes = make([]string, n)
	err := parallel(n, workers, func(i int) error {
		name := fmt.Sprintf("node-%05d", i)
		w.nodes[i] = name
		node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{
			corev1.LabelHostname: name, corev1.LabelOSStable: "linux", corev1.LabelArchStable: "amd64",
			corev1.LabelTopologyZone: fmt.Sprintf("zone-%d", i%3),
		}}}
		w.gate.prepareNode(node)
		created, err := w.cs.CoreV1().Nodes().Create(ctx, node, metav1.CreateOptions{})
		if err != nil {
			return err
		}
		capacity := corev1.ResourceList{
			corev1.ResourceCPU: resource.MustParse("4"), corev1.ResourceMemory: resource.MustParse("16Gi"),
			corev1.ResourcePods: resource.MustParse("110"), corev1.ResourceEphemeralStorage: resource.MustParse("100Gi"),
		}
		created.Status = corev1.NodeStatus{
			Capacity: capacity, Allocatable: capacity.DeepCopy(),
			Conditions: []corev1.NodeCondition{{Type: corev1.NodeReady, Status: corev1.ConditionTrue, Reason: "KubeletReady",
				LastHeartbeatTime: metav1.Now(), LastTransitionTime: metav1.Now()}},
			Phase: corev1.NodeRunning,
		}
		updated, err := w.cs.CoreV1().Nodes().UpdateStatus(ctx, created, metav1.UpdateOptions{})
		if err != nil {
			return err
		}
		// The admission plugin TaintNodesByCondition taints every new Node
		// not-ready; the node lifecycle controller (not run here) removes
		// the taint once the node reports Ready.
		updated.Spec.Taints = slices.DeleteFunc(updated.Spec.Taints, func(t corev1.Taint) bool { return t.Key == corev1.TaintNodeNotReady })
		_, err = w.cs.CoreV1().Nodes().Update(ctx, updated, metav1.UpdateOptions{})
		return err
	})
	if err != nil {
		b.Fatal(err)
	}
	b.Logf("%d Nodes created in %s", n, time.Since(start).Round(time.Millisecond))
}

// setReady writes every listed node's readiness as the gate publishes it.
// It returns, per node, when its write was sent: latencies count from the
// agent's act (a watch often sees the change before the write's reply).
func (w *world) setReady(b *testing.B, nodes []string, ready bool) []time.Time {
	sent := make([]time.Time, len(nodes))
	err := parallel(len(nodes), workers, func(i int) error {
		sent[i] = time.Now()
		if err := w.gate.setReady(context.Background(), w, nodes[i], ready); err != nil {
			return fmt.Errorf("%s: node %s ready=%t: %w", w.gate.name, nodes[i], ready, err)
		}
		return nil
	})
	if err != nil {
		b.Fatal(err)
	}
	return sent
}

// enrolledPod is a pod as the admission policy leaves it: with the gate's
// request (none in taint mode, nor without inpod). pin, when set, keeps it
// to one node, as a probe of that node.
func (w *world) enrolledPod(name, pin string) *corev1.Pod {
	p := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: benchNS, Labels: map[string]string{"app": "bench"}},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{
			Name: "app", Image: "registry.k8s.io/pause:3.10",
			Resources: corev1.ResourceRequirements{Requests: corev1.ResourceList{
				corev1.ResourceCPU: resource.MustParse("10m"), corev1.ResourceMemory: resource.MustParse("16Mi"),
			}},
		}}},
	}
	if pin != "" {
		p.Spec.NodeSelector = map[string]string{corev1.LabelHostname: pin}
	}
	if w.gate.request {
		c := &p.Spec.Containers[0]
		c.Resources.Requests[resourceName] = resource.MustParse("1")
		c.Resources.Limits = corev1.ResourceList{resourceName: resource.MustParse("1")}
	}
	return p
}

// createPods creates the pods on workers goroutines and returns, per pod,
// when its create returned.
func (w *world) createPods(b *testing.B, pods []*corev1.Pod) []time.Time {
	created := make([]time.Time, len(pods))
	err := parallel(len(pods), workers, func(i int) error {
		_, err := w.cs.CoreV1().Pods(pods[i].Namespace).Create(context.Background(), pods[i], metav1.CreateOptions{})
		created[i] = time.Now()
		return err
	})
	if err != nil {
		b.Fatal(err)
	}
	return created
}

// addAgentPods creates one Running, Ready agent pod per node, as the
// DaemonSet and the kubelets would: taint mode's second piece of evidence.
func (w *world) addAgentPods(b *testing.B) {
	ctx := context.Background()
	err := parallel(len(w.nodes), workers, func(i int) error {
		p := &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: "agent-" + w.nodes[i], Namespace: agentNS, Labels: map[string]string{
				"app.kubernetes.io/name": "inpod", "app.kubernetes.io/component": "agent"}},
			Spec: corev1.PodSpec{NodeName: w.nodes[i], Containers: []corev1.Container{{Name: "agent", Image: "inpod-agent"}},
				Tolerations: []corev1.Toleration{{Operator: corev1.TolerationOpExists}}},
		}
		created, err := w.cs.CoreV1().Pods(agentNS).Create(ctx, p, metav1.CreateOptions{})
		if err != nil {
			return err
		}
		created.Status = corev1.PodStatus{Phase: corev1.PodRunning, Conditions: []corev1.PodCondition{
			{Type: corev1.PodReady, Status: corev1.ConditionTrue, LastTransitionTime: metav1.Now()}}}
		_, err = w.cs.CoreV1().Pods(agentNS).UpdateStatus(ctx, created, metav1.UpdateOptions{})
		return err
	})
	if err != nil {
		b.Fatal(err)
	}
}

// gate is one of inpod's gates as the cluster's shared parts see it.
type gate struct {
	name string
	// request: enrolled pods request inpod.dev/redirection (the admission
	// policy adds it).
	request bool
	// prepareNode edits a Node before it registers.
	prepareNode func(*corev1.Node)
	// setReady writes what the node's agent (or kubelet) writes when the
	// node turns ready or not.
	setReady func(ctx context.Context, w *world, node string, ready bool) error
	// install creates the cluster-wide objects the chart installs.
	install func(b *testing.B, w *world)
	// closed reports, for a Node or ResourceSlice the scheduler reads,
	// whether it keeps new enrolled pods off the node, and which node;
	// ok is false for an object this gate does not decide by.
	closed func(obj any) (node string, isClosed, ok bool)
}

func noInstall(*testing.B, *world) {}

var (
	startupTaint = corev1.Taint{Key: taintcontroller.DefaultTaintKey, Effect: taintcontroller.DefaultTaintEffect}

	// noGate is the floor: the cluster without inpod. Its "readiness flip"
	// is a cordon, the nearest thing a cluster without inpod does to stop
	// and resume placing pods on a node.
	noGate = gate{
		name:        "no inpod",
		prepareNode: func(*corev1.Node) {},
		setReady: func(ctx context.Context, w *world, node string, ready bool) error {
			_, err := w.cs.CoreV1().Nodes().Patch(ctx, node, types.StrategicMergePatchType,
				fmt.Appendf(nil, `{"spec":{"unschedulable":%t}}`, !ready), metav1.PatchOptions{})
			return err
		},
		install: noInstall,
		closed: func(obj any) (string, bool, bool) {
			n, ok := obj.(*corev1.Node)
			if !ok {
				return "", false, false
			}
			return n.Name, n.Spec.Unschedulable, true
		},
	}

	// devicePluginGate: the Node's allocatable inpod.dev/redirection.
	// Closing, the agent itself sets it to 0 at once (agent/schedclose.go);
	// opening, the kubelet publishes the plugin's healthy devices in its
	// node-status sync, up to 10 s later, which is not simulated here: the
	// benchmark writes what the kubelet would, when it would.
	devicePluginGate = gate{
		name:        "deviceplugin",
		request:     true,
		prepareNode: func(*corev1.Node) {},
		setReady: func(ctx context.Context, w *world, node string, ready bool) error {
			n := "0"
			if ready {
				n = devicesPerNode
			}
			_, err := w.cs.CoreV1().Nodes().Patch(ctx, node, types.StrategicMergePatchType,
				fmt.Appendf(nil, `{"status":{"capacity":{%q:%q},"allocatable":{%q:%q}}}`, resourceName, devicesPerNode, resourceName, n),
				metav1.PatchOptions{}, "status")
			return err
		},
		install: noInstall,
		closed: func(obj any) (string, bool, bool) {
			n, ok := obj.(*corev1.Node)
			if !ok {
				return "", false, false
			}
			q, has := n.Status.Allocatable[resourceName]
			return n.Name, !has || q.IsZero(), true
		},
	}

	// draGate: the agent's DRA driver publishes one ResourceSlice per node
	// (dra.Resources: one shared device), tainted while not ready; pods
	// keep requesting inpod.dev/redirection through the chart's
	// DeviceClass with extendedResourceName.
	draGate = gate{
		name:        "dra",
		request:     true,
		prepareNode: func(*corev1.Node) {},
		setReady: func(ctx context.Context, w *world, node string, ready bool) error {
			return w.writeSlice(ctx, node, ready)
		},
		install: func(b *testing.B, w *world) {
			f, err := os.Open(filepath.Join(testkit.RepoDir(b), "deploy", "dra", "deviceclass.yaml"))
			if err != nil {
				b.Fatal(err)
			}
			defer f.Close()
			var dc resourceapi.DeviceClass
			if err := yaml.NewYAMLOrJSONDecoder(f, 4096).Decode(&dc); err != nil {
				b.Fatal(err)
			}
			if _, err := w.cs.ResourceV1().DeviceClasses().Create(context.Background(), &dc, metav1.CreateOptions{}); err != nil {
				b.Fatal(err)
			}
		},
		closed: func(obj any) (string, bool, bool) {
			s, ok := obj.(*resourceapi.ResourceSlice)
			if !ok || s.Spec.NodeName == nil {
				return "", false, false
			}
			for _, d := range s.Spec.Devices {
				if len(d.Taints) == 0 {
					return *s.Spec.NodeName, false, true
				}
			}
			return *s.Spec.NodeName, true, true
		},
	}

	// taintGate: the agent writes the Node condition; the real
	// inpod-controller (continuous mode) owns the startup taint, which the
	// node carries from its registration.
	taintGate = gate{
		name: "taint",
		prepareNode: func(n *corev1.Node) {
			n.Spec.Taints = append(n.Spec.Taints, startupTaint)
		},
		setReady: func(ctx context.Context, w *world, node string, ready bool) error {
			status, reason := corev1.ConditionFalse, "ZtunnelDisconnected"
			if ready {
				status, reason = corev1.ConditionTrue, "Ready"
			}
			now := metav1.Now().UTC().Format(time.RFC3339)
			_, err := w.cs.CoreV1().Nodes().Patch(ctx, node, types.StrategicMergePatchType,
				fmt.Appendf(nil, `{"status":{"conditions":[{"type":%q,"status":%q,"reason":%q,"lastHeartbeatTime":%q,"lastTransitionTime":%q}]}}`,
					nodecondition.ConditionType, status, reason, now, now),
				metav1.PatchOptions{}, "status")
			return err
		},
		install: noInstall,
		closed: func(obj any) (string, bool, bool) {
			n, ok := obj.(*corev1.Node)
			if !ok {
				return "", false, false
			}
			return n.Name, slices.ContainsFunc(n.Spec.Taints, func(t corev1.Taint) bool {
				return t.Key == startupTaint.Key && t.Effect == startupTaint.Effect
			}), true
		},
	}
)

// writeSlice publishes the node's ResourceSlice as the DRA gate does:
// created once, then updated in place with the device's taints.
func (w *world) writeSlice(ctx context.Context, node string, ready bool) error {
	var taints []string
	if !ready {
		taints = []string{"inpod.dev/ztunnel-disconnected"}
	}
	pool := dra.Resources(node, taints).Pools[node]
	w.mu.Lock()
	s := w.slices[node]
	w.mu.Unlock()
	var err error
	if s == nil {
		s, err = w.cs.ResourceV1().ResourceSlices().Create(ctx, &resourceapi.ResourceSlice{
			ObjectMeta: metav1.ObjectMeta{Name: node + "-" + dra.DefaultDriverName},
			Spec: resourceapi.ResourceSliceSpec{
				Driver: dra.DefaultDriverName, NodeName: ptr.To(node),
				Pool:    resourceapi.ResourcePool{Name: node, ResourceSliceCount: 1},
				Devices: pool.Slices[0].Devices,
			},
		}, metav1.CreateOptions{})
	} else {
		s = s.DeepCopy()
		s.Spec.Devices = pool.Slices[0].Devices
		s, err = w.cs.ResourceV1().ResourceSlices().Update(ctx, s, metav1.UpdateOptions{})
	}
	if err != nil {
		return err
	}
	w.mu.Lock()
	w.slices[node] = s
	w.mu.Unlock()
	return nil
}

// controllerBinary builds inpod-controller once per benchmark run.
func controllerBinary(b *testing.B) string {
	b.Helper()
	out := filepath.Join(b.TempDir(), "inpod-controller")
	cmd := exec.Command("go", "build", "-o", out, "./cmd/inpod-controller")
	cmd.Dir = testkit.RepoDir(b)
	if msg, err := cmd.CombinedOutput(); err != nil {
		b.Fatalf("build inpod-controller: %v\n%s", err, msg)
	}
	return out
}

// startController runs the real inpod-controller in continuous mode
// against the world's control plane, with the production leader-election
// timings and client limits; INPOD_SCALE_CONTROLLER_QPS sets its
// --kube-api-qps (the chart's controller.kubeAPI.qps) instead.
func (w *world) startController(b *testing.B, bin, identity string) *cluster.Component {
	b.Helper()
	kubeconfig := w.cp.Kubeconfig
	args := []string{
		"--kubeconfig", kubeconfig, "--mode", "continuous", "--identity", identity,
		"--lease-namespace", agentNS, "--agent-namespace", agentNS,
		"--health-addr", "127.0.0.1:0", "--metrics-addr", "127.0.0.1:0", "--log-level", "warn",
	}
	if os.Getenv("INPOD_SCALE_CONTROLLER_QPS") != "" {
		args = append(args, "--kube-api-qps", strconv.Itoa(sizeFromEnv(b, "INPOD_SCALE_CONTROLLER_QPS", 0)))
	}
	c, err := w.cp.StartComponent("inpod-controller-"+identity, bin, args, nil)
	if err != nil {
		b.Fatal(err)
	}
	return c
}

// leader is the holder of the controller's Lease, or "".
func (w *world) leader(ctx context.Context) string {
	l, err := w.cs.CoordinationV1().Leases(agentNS).Get(ctx, taintcontroller.DefaultLeaseName, metav1.GetOptions{})
	if err != nil || l.Spec.HolderIdentity == nil {
		return ""
	}
	return *l.Spec.HolderIdentity
}

func newRequest(ctx context.Context, url string) (*http.Request, error) {
	return http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
}

// rss reads a process's resident set (VmRSS) and its peak (VmHWM), MiB.
func rss(pid int) (now, peak float64, err error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, 0, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		k, v, _ := strings.Cut(sc.Text(), ":")
		var kb float64
		fmt.Sscan(strings.TrimSuffix(strings.TrimSpace(v), " kB"), &kb)
		switch k {
		case "VmRSS":
			now = kb / 1024
		case "VmHWM":
			peak = kb / 1024
		}
	}
	if now == 0 {
		return 0, 0, errors.New("no VmRSS")
	}
	return now, peak, sc.Err()
}
