//go:build e2e

package e2e

import (
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/utils/ptr"

	"github.com/inpod-dev/inpod/dra"
	"github.com/inpod-dev/inpod/e2e/chart"
	"github.com/inpod-dev/inpod/e2e/cluster"
	"github.com/inpod-dev/inpod/e2e/cluster/clustertest"
	"github.com/inpod-dev/inpod/e2e/images"
	"github.com/inpod-dev/inpod/enrollment"
	"github.com/inpod-dev/inpod/internal/benchreport"
	"github.com/inpod-dev/inpod/internal/testkit"
	"github.com/inpod-dev/inpod/release"
	"github.com/inpod-dev/inpod/taintcontroller"
)

// startupPods is how many pods of each kind a round starts.
const startupPods = 20

// gateMode is one way the chart gates scheduling, as the benchmark
// installs and observes it.
type gateMode struct {
	name string
	// values are the chart values beyond the node's own (Target.Values).
	values func(node *cluster.Node) []string
	// startup: measure pod start-up in this mode (taint mode adds no
	// request to enrolled pods: its start-up is the plain pods').
	startup bool
	// open and closed tell from a watched object whether the scheduler
	// sees the node ready (open) or not (closed); other objects say
	// neither.
	open, closed func(node *cluster.Node, obj any) bool
	// watch watches the objects open and closed read.
	watch func(ctx context.Context, c kubernetes.Interface, node *cluster.Node) (watch.Interface, error)
	// seen says what closed means, for the report.
	seen string
	// period, when set, is the period of the loop that publishes a
	// change: each sample starts at a random phase of it, or reopening
	// (published by the same loop) would start every sample right after a
	// publication and measure the worst case only.
	period time.Duration
}

// BenchmarkE2EPodStartup is the report's headline: pod start-up (create →
// Ready) of enrolled pods against pods outside the mesh on the same node,
// inpod installed with its chart and the stand-in as a DaemonSet, 20 pods
// of each kind one at a time and all at once; and, per gate mode, the time
// from the stand-in going away until the scheduler can see the gate closed.
// A fresh node per mode: the device plugin's extended resource stays on the
// Node after an uninstall and would take the DRA mode's pods off the DRA
// path. Run it with -benchtime 1x.
func BenchmarkE2EPodStartup(b *testing.B) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Minute)
	defer cancel()
	repo := testkit.RepoDir(b)
	imgDir := b.TempDir()
	if err := images.BuildForChart(ctx, repo, release.DevTag, imgDir); err != nil {
		b.Fatal(err)
	}
	if err := chart.PrepareHost(); err != nil {
		b.Fatal(err)
	}
	for _, m := range []gateMode{deviceMode(), draMode(), taintMode(), initContainerMode()} {
		b.Run(m.name, func(b *testing.B) { benchGateMode(ctx, b, repo, imgDir, m) })
	}
}

func deviceMode() gateMode {
	return gateMode{
		name:    "deviceplugin",
		values:  func(*cluster.Node) []string { return nil },
		startup: true,
		open:    func(n *cluster.Node, o any) bool { v, ok := allocatableIn(n, o); return ok && v > 0 },
		closed:  func(n *cluster.Node, o any) bool { v, ok := allocatableIn(n, o); return ok && v == 0 },
		watch:   watchNode,
		seen:    "Node allocatable " + string(gateResource) + " 0",
		// The kubelet publishes allocatable with its node status, every
		// nodeStatusUpdateFrequency (10 s on the harness node, the
		// kubelet's default).
		period: 10 * time.Second,
	}
}

func draMode() gateMode {
	return gateMode{
		name: "dra",
		values: func(n *cluster.Node) []string {
			return []string{"--set", "gates={dra}",
				"--set", "paths.draPluginRegistryDir=" + filepath.Join(n.KubeletDir, "plugins_registry"),
				"--set", "paths.draPluginDir=" + filepath.Join(n.KubeletDir, "plugins", dra.DefaultDriverName)}
		},
		startup: true,
		open:    func(_ *cluster.Node, o any) bool { taints, ok := deviceTaints(o); return ok && len(taints) == 0 },
		closed: func(_ *cluster.Node, o any) bool {
			taints, _ := deviceTaints(o)
			for _, tn := range taints {
				if tn.Effect == resourceapi.DeviceTaintEffectNoSchedule {
					return true
				}
			}
			return false
		},
		watch: func(ctx context.Context, c kubernetes.Interface, _ *cluster.Node) (watch.Interface, error) {
			return c.ResourceV1().ResourceSlices().Watch(ctx, metav1.ListOptions{})
		},
		seen: "ResourceSlice device NoSchedule taint",
	}
}

func taintMode() gateMode {
	hasStartupTaint := func(n *cluster.Node, o any) (bool, bool) {
		node, ok := o.(*corev1.Node)
		if !ok || node.Name != n.Name {
			return false, false
		}
		return hasTaint(node, taintcontroller.DefaultTaintKey), true
	}
	return gateMode{
		name: "taint",
		values: func(*cluster.Node) []string {
			return []string{"--set", "gates={node-condition}", "--set", "controller.enabled=true", "--set", "controller.mode=continuous",
				"--set", "controller.image.repository=" + release.ControllerRepository, "--set", "controller.image.tag=" + release.DevTag,
				"--set", "controller.image.pullPolicy=Never"}
		},
		open:   func(n *cluster.Node, o any) bool { t, ok := hasStartupTaint(n, o); return ok && !t },
		closed: func(n *cluster.Node, o any) bool { t, ok := hasStartupTaint(n, o); return ok && t },
		watch:  watchNode,
		seen:   "Node taint " + taintcontroller.DefaultTaintKey,
	}
}

// initContainerMode guards enrolled pods in the pod itself, not at
// scheduling: no gate for the scheduler to see, only the start-up cost of
// the extra container.
func initContainerMode() gateMode {
	return gateMode{
		name: "initcontainer",
		values: func(*cluster.Node) []string {
			return []string{"--set", "gates={initcontainer}",
				"--set", "initContainer.image.repository=" + release.WaitReadyRepository, "--set", "initContainer.image.tag=" + release.DevTag,
				"--set", "initContainer.image.pullPolicy=Never"}
		},
		startup: true,
	}
}

func watchNode(ctx context.Context, c kubernetes.Interface, n *cluster.Node) (watch.Interface, error) {
	return c.CoreV1().Nodes().Watch(ctx, metav1.ListOptions{FieldSelector: "metadata.name=" + n.Name})
}

func allocatableIn(n *cluster.Node, o any) (int64, bool) {
	node, ok := o.(*corev1.Node)
	if !ok || node.Name != n.Name {
		return 0, false
	}
	q, has := node.Status.Allocatable[gateResource]
	return q.Value(), has
}

// deviceTaints are the taints of inpod's device in a ResourceSlice of the
// gate's driver.
func deviceTaints(o any) ([]resourceapi.DeviceTaint, bool) {
	s, ok := o.(*resourceapi.ResourceSlice)
	if !ok || s.Spec.Driver != dra.DefaultDriverName || len(s.Spec.Devices) != 1 {
		return nil, false
	}
	return s.Spec.Devices[0].Taints, true
}

func benchGateMode(ctx context.Context, b *testing.B, repo, imgDir string, m gateMode) {
	node := clustertest.Node(ctx, b, cluster.NodeConfig{Config: cluster.Config{Root: "/var/lib/inpod-e2e-bench"}, RepoDir: repo})
	// 20 creates at once: the default client's 5 QPS would pace them.
	rc := rest.CopyConfig(node.Rest)
	rc.QPS, rc.Burst = 500, 1000
	client, err := kubernetes.NewForConfig(rc)
	if err != nil {
		b.Fatal(err)
	}
	target := chart.NodeTarget(node)
	if err := target.ImportImages(ctx, filepath.Join(imgDir, "inpod-agent.tar"), filepath.Join(imgDir, "inpod-controller.tar"),
		filepath.Join(imgDir, images.StandInFile), filepath.Join(imgDir, "inpod-waitready.tar")); err != nil {
		b.Fatal(err)
	}
	if err := target.Install(ctx, repo, release.DevTag, m.values(node)...); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { target.Helm(context.Background(), repo, "uninstall", chart.Release, "-n", chart.Namespace) })
	standIn := func() {
		if _, err := client.AppsV1().DaemonSets(chart.Namespace).Create(ctx, chart.StandIn(release.DevTag, target.ZDSSocket()), metav1.CreateOptions{}); err != nil {
			b.Fatal(err)
		}
	}
	standIn()
	testkit.Eventually(b, 3*time.Minute, "the agent pod Ready", func() bool { return agentReady(b, ctx, node) != "" })
	if m.open != nil {
		waitGate(ctx, b, client, node, m, "open", m.open)
	}
	if m.name == "taint" {
		// The controller's first leader takes a Lease: until then nobody
		// would taint, and the first sample would time the election.
		testkit.Eventually(b, 2*time.Minute, "a controller leader", func() bool {
			l, err := client.CoordinationV1().Leases(chart.Namespace).Get(ctx, taintcontroller.DefaultLeaseName, metav1.GetOptions{})
			return err == nil && l.Spec.HolderIdentity != nil && *l.Spec.HolderIdentity != ""
		})
	}

	// Sub-benchmarks, so that -bench 'E2EPodStartup/deviceplugin/rollout'
	// runs one of them on the mode's node and install.
	if m.startup {
		b.Run("startup", func(b *testing.B) { benchStartup(ctx, b, client, node, m.name) })
	}
	if m.name == "deviceplugin" {
		benchTamperRepair(ctx, b, client, m.name)
	}
	if m.name == "deviceplugin" || m.name == "dra" {
		b.Run("rollout", func(b *testing.B) {
			benchRollout(ctx, b, client, node, target, repo, release.DevTag, m.name, m.values(node))
		})
	}
	if m.open == nil {
		return
	}

	// ztunnel gone: the DaemonSet is removed first (its pods orphaned, so
	// nothing recreates the stand-in), then its pod, the moment measured
	// from; back: the DaemonSet again, and the gate open before the next
	// sample.
	const samples = 5
	var took []time.Duration
	for range samples {
		orphan := metav1.DeletePropagationOrphan
		if err := client.AppsV1().DaemonSets(chart.Namespace).Delete(ctx, "ztunnel-standin", metav1.DeleteOptions{PropagationPolicy: &orphan}); err != nil {
			b.Fatal(err)
		}
		testkit.Eventually(b, time.Minute, "the stand-in DaemonSet gone", func() bool {
			_, err := client.AppsV1().DaemonSets(chart.Namespace).Get(ctx, "ztunnel-standin", metav1.GetOptions{})
			return apierrors.IsNotFound(err)
		})
		// The one stand-in pod not already going: a rollout just before
		// (the agent's, in the rollout benchmark) can leave one terminating.
		var standInPod corev1.Pod
		testkit.Eventually(b, time.Minute, "one stand-in pod", func() bool {
			pods, err := client.CoreV1().Pods(chart.Namespace).List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/name=ztunnel-standin"})
			if err != nil {
				return false
			}
			live := slices.DeleteFunc(pods.Items, func(p corev1.Pod) bool { return p.DeletionTimestamp != nil })
			if len(live) != 1 {
				return false
			}
			standInPod = live[0]
			return true
		})
		if m.period > 0 {
			select {
			case <-time.After(rand.N(m.period)): // a random phase, not synchronisation
			case <-ctx.Done():
				b.Fatal(ctx.Err())
			}
		}
		w, err := m.watch(ctx, client, node)
		if err != nil {
			b.Fatal(err)
		}
		one := int64(1) // SIGTERM now: the stand-in exits on it
		left := time.Now()
		if err := client.CoreV1().Pods(chart.Namespace).Delete(ctx, standInPod.Name, metav1.DeleteOptions{GracePeriodSeconds: &one}); err != nil {
			b.Fatal(err)
		}
		seen := waitEvent(ctx, b, w, 2*time.Minute, m.seen, func(o any) bool { return m.closed(node, o) })
		took = append(took, seen.Sub(left))
		b.Logf("%s: stand-in pod deleted → %s: %s", m.name, m.seen, seen.Sub(left).Round(time.Millisecond))
		// The old pod gone first: the next sample deletes the one pod there is.
		testkit.Eventually(b, time.Minute, "the stand-in pod gone", func() bool {
			_, err := client.CoreV1().Pods(chart.Namespace).Get(ctx, standInPod.Name, metav1.GetOptions{})
			return apierrors.IsNotFound(err)
		})
		standIn()
		waitGate(ctx, b, client, node, m, "open again", m.open)
	}
	slices.Sort(took)
	for _, f := range []struct {
		what string
		d    time.Duration
	}{{"median", took[len(took)/2]}, {"max", took[len(took)-1]}} {
		benchreport.Record(b, benchreport.Figure{Section: benchreport.SchedulerSeesSection,
			Name:  fmt.Sprintf("%s: stand-in pod deleted → %s, %s of %d", m.name, m.seen, f.what, samples),
			Value: ms(f.d), Unit: "ms"})
	}
}

// waitGate waits until the watched objects say cond.
func waitGate(ctx context.Context, b *testing.B, c kubernetes.Interface, node *cluster.Node, m gateMode, what string, cond func(*cluster.Node, any) bool) {
	b.Helper()
	w, err := m.watch(ctx, c, node)
	if err != nil {
		b.Fatal(err)
	}
	waitEvent(ctx, b, w, 3*time.Minute, m.name+" gate "+what, func(o any) bool { return cond(node, o) })
}

// benchStartup measures pod start-up of enrolled and plain pods and
// records it against the plain pods, the floor.
func benchStartup(ctx context.Context, b *testing.B, c kubernetes.Interface, node *cluster.Node, mode string) {
	// In initcontainer mode a third kind, outside the mesh, is the gate's
	// own floor: pods with a no-op init container of the gate's image
	// (inpod-waitready --help), so the cost of one more container is told
	// apart from the check's.
	kinds := []string{"plain", "mesh"}
	namespaces := map[string]map[string]string{"mesh": {enrollment.DataplaneModeLabel: enrollment.DataplaneAmbient}, "plain": nil}
	if mode == "initcontainer" {
		kinds = append(kinds, "floor")
		namespaces["floor"] = nil
	}
	for name, labels := range namespaces {
		ensureNamespace(ctx, b, c, name, labels)
	}
	// Warm-up, unmeasured (the first container from the image unpacks
	// it), and a check that the enrolled pods are the real thing: the
	// policy's request, the agent's annotation; the plain ones neither.
	for _, ns := range kinds {
		startShapedPods(ctx, b, c, ns, "warm", 1, false, 2*time.Minute, shapeOf(ns), func(p *corev1.Pod) {
			if ns == "floor" {
				return
			}
			// The guard the chart's policy gives enrolled pods: the
			// resource request, or in initcontainer mode the init container.
			if mode == "initcontainer" {
				guarded := len(p.Spec.InitContainers) > 0 && p.Spec.InitContainers[0].Name == "inpod-wait-ready"
				if guarded != (ns == "mesh") {
					b.Fatalf("%s/%s: init containers %v: not what a %s pod gets", ns, p.Name, p.Spec.InitContainers, ns)
				}
			} else {
				q := p.Spec.Containers[0].Resources.Limits[gateResource]
				if requested := q.Value() == 1; requested != (ns == "mesh") {
					b.Fatalf("%s/%s: request %q: not what a %s pod gets", ns, p.Name, q.String(), ns)
				}
			}
			// Ready waits on the agent's proof: enrolled pods carry the
			// readiness gate the chart's policy adds (on by default).
			if gated := enrollment.HasRedirectedGate(p); gated != (ns == "mesh") {
				b.Fatalf("%s/%s: readiness gate %s: %v, not what a %s pod gets", ns, p.Name, enrollment.RedirectedCondition, gated, ns)
			}
			if ns != "mesh" {
				return
			}
			testkit.Eventually(b, 30*time.Second, ns+"/"+p.Name+" annotated enabled", func() bool {
				got, err := c.CoreV1().Pods(ns).Get(ctx, p.Name, metav1.GetOptions{})
				return err == nil && got.Annotations[enrollment.RedirectionAnnotation] == "enabled"
			})
		})
	}
	// inpod's share of an enrolled pod's start-up, by the agent's own
	// metrics over each round: its measure of each CNI ADD (event in →
	// rules applied and ztunnel's ack) and its CPU time.
	agent := agentMetrics(ctx, b, node)
	before := agent()
	one := map[string][]time.Duration{}
	// One at a time, alternating, so drift over the run hits both kinds.
	for i := range startupPods {
		for _, ns := range kinds {
			one[ns] = append(one[ns], startShapedPods(ctx, b, c, ns, fmt.Sprintf("one-%d", i), 1, false, 2*time.Minute, shapeOf(ns), nil)...)
		}
	}
	after := agent()
	oneCNI := after.enrollMean(before)
	// The API writes an enrolled pod's start costs beyond a plain pod's:
	// the agent's pod-status patches of the condition (plain pods get
	// none), over the one-at-a-time round.
	writesPerStart := (after.conditionWrites - before.conditionWrites) / float64(len(one["mesh"]))
	// All at once, two rounds of each kind in the order plain, mesh, mesh,
	// plain: a round takes seconds on this shared machine, and load that
	// comes or goes in between would otherwise count for one kind only.
	all := map[string][]time.Duration{}
	var allEnroll agentSnapshot
	cpu := map[string]float64{}
	order := []string{"plain", "mesh", "mesh", "plain"}
	if mode == "initcontainer" {
		order = []string{"plain", "floor", "mesh", "mesh", "floor", "plain"}
	}
	for i, ns := range order {
		before := agent()
		all[ns] = append(all[ns], startShapedPods(ctx, b, c, ns, fmt.Sprintf("all-%d", i), startupPods, true, 3*time.Minute, shapeOf(ns), nil)...)
		after := agent()
		cpu[ns] += after.cpu - before.cpu
		if ns == "mesh" {
			allEnroll.enrollSum += after.enrollSum - before.enrollSum
			allEnroll.enrollCount += after.enrollCount - before.enrollCount
		}
	}
	allCNI := allEnroll.enrollMean(agentSnapshot{})
	perPod := func(ns string) float64 { return cpu[ns] * 1000 / float64(len(all[ns])) }
	b.Logf("%s: the agent's CNI ADD of an enrolled pod, mean: %s one at a time, %s with %d at once; the agent's CPU per pod (start and delete) with %d at once: enrolled %.1f ms, plain %.1f ms",
		mode, oneCNI.Round(time.Microsecond), allCNI.Round(time.Microsecond), startupPods, startupPods, perPod("mesh"), perPod("plain"))
	for _, round := range []struct {
		name string
		got  map[string][]time.Duration
	}{{"one at a time", one}, {fmt.Sprintf("%d at once (2 rounds)", startupPods), all}} {
		for _, q := range []struct {
			name string
			q    float64
		}{{"median", 0.5}, {"p99", 0.99}} {
			plain, enrolled := quantile(round.got["plain"], q.q), quantile(round.got["mesh"], q.q)
			limit := max(plain+plain/10, plain+50*time.Millisecond)
			verdict := "within target"
			if enrolled > limit {
				verdict = "MISSES the target"
			}
			b.Logf("%s, %s, %s: enrolled %s, plain %s, limit %s: %s", mode, round.name, q.name, enrolled.Round(time.Millisecond),
				plain.Round(time.Millisecond), limit.Round(time.Millisecond), verdict)
			benchreport.Record(b, benchreport.Figure{Section: benchreport.HeadlineSection,
				Name:  fmt.Sprintf("enrolled pods, %s gate, %s, %s (%d pods)", mode, round.name, q.name, len(round.got["mesh"])),
				Value: ms(enrolled), Unit: "ms", FloorName: "plain pods", Floor: ms(plain),
				Target: "within 10 % or 50 ms of plain pods, whichever is larger"})
			if floor := round.got["floor"]; len(floor) > 0 {
				f := quantile(floor, q.q)
				factor, target := 1.1, "within 1.1× of pods with a no-op init container"
				if round.name != "one at a time" {
					factor, target = 1.2, "within 1.2× of pods with a no-op init container"
				}
				verdict := "within target"
				if float64(enrolled) > factor*float64(f) {
					verdict = "MISSES the target"
				}
				b.Logf("%s, %s, %s: enrolled %s, its floor (no-op init container) %s, %.2f×: %s", mode, round.name, q.name,
					enrolled.Round(time.Millisecond), f.Round(time.Millisecond), float64(enrolled)/float64(f), verdict)
				benchreport.Record(b, benchreport.Figure{Section: benchreport.HeadlineSection,
					Name:  fmt.Sprintf("enrolled pods, %s gate, %s, %s, against the gate's floor (%d pods)", mode, round.name, q.name, len(round.got["mesh"])),
					Value: ms(enrolled), Unit: "ms", FloorName: "pods with a no-op init container of the same image", Floor: ms(f),
					Target: target})
			}
		}
	}
	benchreport.Record(b, benchreport.Figure{Section: benchreport.HeadlineSection,
		Name:  fmt.Sprintf("of which inpod's CNI ADD in the agent, %s gate, one at a time, mean (its metrics)", mode),
		Value: ms(oneCNI), Unit: "ms"})
	benchreport.Record(b, benchreport.Figure{Section: benchreport.HeadlineSection,
		Name:  fmt.Sprintf("of which inpod's CNI ADD in the agent, %s gate, %d at once, mean (its metrics)", mode, startupPods),
		Value: ms(allCNI), Unit: "ms"})
	b.Logf("%s: the agent's writes of the %s condition per enrolled pod start, one at a time: %.2f", mode, enrollment.RedirectedCondition, writesPerStart)
	benchreport.Record(b, benchreport.Figure{Section: benchreport.HeadlineSection,
		Name:  fmt.Sprintf("extra API writes per enrolled pod start (the agent's %s condition, a pods/status patch), %s gate, one at a time", enrollment.RedirectedCondition, mode),
		Value: writesPerStart, Unit: "writes", Target: "1 (the condition written once)"})
	benchreport.Record(b, benchreport.Figure{Section: benchreport.HeadlineSection,
		Name:  fmt.Sprintf("the agent's CPU per enrolled pod (start and delete), %s gate, %d at once", mode, startupPods),
		Value: perPod("mesh"), Unit: "ms", FloorName: "per plain pod", Floor: perPod("plain")})
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

// shapeOf is how the start-up benchmark shapes the pods of kind ns: the
// initcontainer gate's floor ("floor") gets a no-op init container shaped
// as the chart's policy shapes the real one with its default values (the
// gate's image, its resources, which bound its CPU, and its security
// context), so that the difference is the check's own; the others are left
// as startPods makes them.
func shapeOf(ns string) func(*corev1.Pod) {
	if ns != "floor" {
		return nil
	}
	user := int64(65532)
	resources := corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("50m"), corev1.ResourceMemory: resource.MustParse("32Mi")}
	return func(p *corev1.Pod) {
		p.Spec.InitContainers = []corev1.Container{{Name: "noop", Image: release.WaitReadyRepository + ":" + release.DevTag,
			ImagePullPolicy: corev1.PullNever, Args: []string{"--help"},
			Resources: corev1.ResourceRequirements{Requests: resources, Limits: resources},
			SecurityContext: &corev1.SecurityContext{RunAsNonRoot: ptr.To(true), RunAsUser: &user, RunAsGroup: &user,
				ReadOnlyRootFilesystem: ptr.To(true), AllowPrivilegeEscalation: ptr.To(false), Privileged: ptr.To(false),
				Capabilities:   &corev1.Capabilities{Drop: []corev1.Capability{"ALL"}},
				SeccompProfile: &corev1.SeccompProfile{Type: corev1.SeccompProfileTypeRuntimeDefault}}}}
	}
}

// agentSnapshot is a reading of the agent's metrics.
type agentSnapshot struct {
	// enrollSum and enrollCount: the enrollment histogram, source cni.
	enrollSum, enrollCount float64
	// cpu: the agent process's CPU seconds.
	cpu float64
	// conditionWrites: the pods' condition written (patches that took).
	conditionWrites float64
}

// enrollMean is the mean enrollment time between an earlier reading and s.
func (s agentSnapshot) enrollMean(earlier agentSnapshot) time.Duration {
	if s.enrollCount == earlier.enrollCount {
		return 0
	}
	return time.Duration((s.enrollSum - earlier.enrollSum) / (s.enrollCount - earlier.enrollCount) * float64(time.Second))
}

// agentMetrics returns a function that reads the agent's metrics.
func agentMetrics(ctx context.Context, b *testing.B, node *cluster.Node) func() agentSnapshot {
	b.Helper()
	n, err := node.Client.CoreV1().Nodes().Get(ctx, node.Name, metav1.GetOptions{})
	if err != nil {
		b.Fatal(err)
	}
	var ip string
	for _, a := range n.Status.Addresses {
		if a.Type == corev1.NodeInternalIP {
			ip = a.Address
		}
	}
	// The agent runs in the node's network namespace (hostNetwork), on
	// the chart's metrics port.
	url := "http://" + net.JoinHostPort(ip, "15020") + "/metrics"
	return func() agentSnapshot {
		b.Helper()
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		if err != nil {
			b.Fatal(err)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			b.Fatal(err)
		}
		defer resp.Body.Close()
		body, err := io.ReadAll(resp.Body)
		if err != nil {
			b.Fatal(err)
		}
		var snap agentSnapshot
		for _, line := range strings.Split(string(body), "\n") {
			name, value, ok := strings.Cut(line, " ")
			if !ok {
				continue
			}
			var into *float64
			switch name {
			case `inpod_enrollment_duration_seconds_sum{source="cni"}`:
				into = &snap.enrollSum
			case `inpod_enrollment_duration_seconds_count{source="cni"}`:
				into = &snap.enrollCount
			case "process_cpu_seconds_total":
				into = &snap.cpu
			case `inpod_pod_condition_writes_total{result="written"}`:
				into = &snap.conditionWrites
			default:
				continue
			}
			if *into, err = strconv.ParseFloat(value, 64); err != nil {
				b.Fatalf("%s: %q: %v", url, line, err)
			}
		}
		return snap
	}
}
