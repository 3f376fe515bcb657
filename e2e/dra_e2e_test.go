//go:build e2e

package e2e

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/util/retry"
	"k8s.io/utils/ptr"

	"github.com/inpod-dev/inpod/agent"
	"github.com/inpod-dev/inpod/dra"
	"github.com/inpod-dev/inpod/e2e/cluster"
	"github.com/inpod-dev/inpod/e2e/cluster/clustertest"
	"github.com/inpod-dev/inpod/e2e/images"
	"github.com/inpod-dev/inpod/internal/testkit"
	"github.com/inpod-dev/inpod/readiness"
	ztunnel "github.com/inpod-dev/inpod/zds/zdstest"
)

// applyDeviceClass creates deploy/dra/deviceclass.yaml as shipped.
func applyDeviceClass(ctx context.Context, t *testing.T, client kubernetes.Interface) {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(testkit.RepoDir(t), "deploy", "dra", "deviceclass.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	obj, _, err := scheme.Codecs.UniversalDeserializer().Decode(data, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := client.ResourceV1().DeviceClasses().Create(ctx, obj.(*resourceapi.DeviceClass), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// waitEvent watches until cond holds for an object and returns when the
// event arrived.
func waitEvent(ctx context.Context, t testing.TB, w watch.Interface, timeout time.Duration, what string, cond func(obj any) bool) time.Time {
	t.Helper()
	defer w.Stop()
	deadline := time.After(timeout)
	for {
		select {
		case ev, ok := <-w.ResultChan():
			if !ok {
				t.Fatalf("the watch for %s ended", what)
			}
			if ev.Type != watch.Bookmark && ev.Type != watch.Error && cond(ev.Object) {
				return time.Now()
			}
		case <-deadline:
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		case <-ctx.Done():
			t.Fatal(ctx.Err())
		}
	}
}

func sliceTaints(obj any) ([]string, bool) {
	s, ok := obj.(*resourceapi.ResourceSlice)
	if !ok || s.Spec.Driver != dra.DefaultDriverName || len(s.Spec.Devices) != 1 {
		return nil, false
	}
	var keys []string
	for _, tn := range s.Spec.Devices[0].Taints {
		keys = append(keys, tn.Key)
	}
	return keys, true
}

// TestE2EDRAGatesScheduling runs the agent with --gate=dra on the real node
// (its kubelet, scheduler and containerd) and the DeviceClass as shipped: a
// pod that requests inpod.dev/redirection: 1 stays Pending while the node is
// not ready and runs once it is; the windows both ways are measured. Then
// the scheduling cost of the device model with 110 pending pods.
func TestE2EDRAGatesScheduling(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	node := clustertest.Node(ctx, t, cluster.NodeConfig{Config: cluster.Config{Root: "/var/lib/inpod-e2e-dra"}, RepoDir: testkit.RepoDir(t)})
	client := node.Client
	applyDeviceClass(ctx, t, client)

	a, zdsSocket := runHostAgent(ctx, t, node, func(c *agent.Config) {
		c.Gate = "dra"
		c.DRA = dra.Config{RegistrarDir: filepath.Join(node.KubeletDir, "plugins_registry"),
			PluginDir: filepath.Join(node.KubeletDir, "plugins", dra.DefaultDriverName)}
	})
	var (
		mu      sync.Mutex
		readyAt time.Time
	)
	a.Ready.OnChange(func(st readiness.State) {
		mu.Lock()
		defer mu.Unlock()
		if st.Ready && readyAt.IsZero() {
			readyAt = time.Now()
		}
	})
	slices := client.ResourceV1().ResourceSlices()
	testkit.Eventually(t, 60*time.Second, "the node's slice tainted (no ztunnel yet)", func() bool {
		l, err := slices.List(ctx, metav1.ListOptions{})
		if err != nil || len(l.Items) != 1 {
			return false
		}
		keys, ok := sliceTaints(&l.Items[0])
		return ok && len(keys) == 1 && keys[0] == dra.TaintKeyPrefix+"ztunnel-not-connected"
	})

	gated := func(name string) *corev1.Pod {
		return &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: name},
			Spec: corev1.PodSpec{
				TerminationGracePeriodSeconds: new(int64),
				Containers: []corev1.Container{{Name: "app", Image: images.TestAppRef, ImagePullPolicy: corev1.PullNever,
					Resources: corev1.ResourceRequirements{Limits: corev1.ResourceList{gateResource: resource.MustParse("1")}}}},
			},
		}
	}
	pods := client.CoreV1().Pods("default")
	unschedulable := func(name string) {
		testkit.Eventually(t, 60*time.Second, "the scheduler to report "+name+" unschedulable", func() bool {
			p, err := pods.Get(ctx, name, metav1.GetOptions{})
			if err != nil {
				return false
			}
			for _, c := range p.Status.Conditions {
				if c.Type == corev1.PodScheduled && c.Status == corev1.ConditionFalse {
					t.Logf("%s: %s", name, c.Message)
					return p.Spec.NodeName == ""
				}
			}
			return false
		})
	}
	if _, err := pods.Create(ctx, gated("early"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	unschedulable("early")

	// ztunnel connects: the agent is ready, the taint goes, the pod binds.
	bound, err := pods.Watch(ctx, metav1.ListOptions{FieldSelector: "metadata.name=early"})
	if err != nil {
		t.Fatal(err)
	}
	z := ztunnel.New(ztunnel.Config{SocketPath: zdsSocket, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	zctx, zcancel := context.WithCancel(ctx)
	zdone := make(chan struct{})
	go func() { z.Run(zctx); close(zdone) }()
	stopZ := func() { zcancel(); <-zdone }
	t.Cleanup(stopZ)
	scheduled := waitEvent(ctx, t, bound, 60*time.Second, "the pod bound", func(o any) bool {
		p, ok := o.(*corev1.Pod)
		return ok && p.Spec.NodeName != ""
	})
	mu.Lock()
	window := scheduled.Sub(readyAt)
	mu.Unlock()
	t.Logf("DRA window: agent ready → pod scheduled %s", window.Round(time.Millisecond))
	testkit.Eventually(t, 90*time.Second, "the gated pod Running once the node is ready", func() bool {
		p, err := pods.Get(ctx, "early", metav1.GetOptions{})
		return err == nil && p.Status.Phase == corev1.PodRunning
	})

	// ztunnel goes: the taint is in the API within a second; a new pod
	// stays Pending; the running one is not touched (NoSchedule only).
	tainted, err := slices.Watch(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	left := time.Now()
	stopZ()
	seen := waitEvent(ctx, t, tainted, 30*time.Second, "the slice tainted", func(o any) bool {
		keys, ok := sliceTaints(o)
		return ok && len(keys) > 0
	})
	t.Logf("DRA window: ztunnel leaves → taint in the API %s", seen.Sub(left).Round(time.Millisecond))
	if _, err := pods.Create(ctx, gated("late"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	unschedulable("late")
	if p, err := pods.Get(ctx, "early", metav1.GetOptions{}); err != nil || p.Status.Phase != corev1.PodRunning || p.DeletionTimestamp != nil {
		t.Fatalf("the running pod after the flip: %v %+v", err, p.Status)
	}

	t.Run("device model cost", func(t *testing.T) { deviceModelCost(ctx, t, node) })
}

// deviceModelCost compares the two device models the gate could publish,
// by the scheduler's time to bind 110 pending pods once the devices become
// usable (the taint goes): one device shared by all (allowMultipleAllocations,
// what the gate publishes) against one device per pod (110 devices in two
// slices, at most 64 per slice with taints). The node is a Node object with
// no kubelet, so the pods bind and never run; both models request through a
// DeviceClass with an extended resource name, as users do.
func deviceModelCost(ctx context.Context, t *testing.T, node *cluster.Node) {
	rc := rest.CopyConfig(node.Rest)
	rc.QPS, rc.Burst = 500, 1000
	client, err := kubernetes.NewForConfig(rc)
	if err != nil {
		t.Fatal(err)
	}
	const fake, pods = "bench-node", 110
	_, err = client.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: fake,
		Labels: map[string]string{corev1.LabelHostname: fake}}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	alloc := corev1.ResourceList{corev1.ResourcePods: resource.MustParse("300"), corev1.ResourceCPU: resource.MustParse("100"),
		corev1.ResourceMemory: resource.MustParse("500Gi")}
	if err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		n, err := client.CoreV1().Nodes().Get(ctx, fake, metav1.GetOptions{})
		if err != nil {
			return err
		}
		n.Status = corev1.NodeStatus{Capacity: alloc, Allocatable: alloc, Conditions: []corev1.NodeCondition{{
			Type: corev1.NodeReady, Status: corev1.ConditionTrue, Reason: "KubeletReady", LastHeartbeatTime: metav1.Now(), LastTransitionTime: metav1.Now()}}}
		_, err = client.CoreV1().Nodes().UpdateStatus(ctx, n, metav1.UpdateOptions{})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	// Its lease, renewed, so the node controller does not take it away
	// mid-measurement.
	lease := &coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{Name: fake, Namespace: corev1.NamespaceNodeLease},
		Spec: coordinationv1.LeaseSpec{HolderIdentity: ptr.To(fake), LeaseDurationSeconds: ptr.To[int32](40), RenewTime: &metav1.MicroTime{Time: time.Now()}}}
	if _, err := client.CoordinationV1().Leases(corev1.NamespaceNodeLease).Create(ctx, lease, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	lctx, lcancel := context.WithCancel(ctx)
	defer lcancel()
	go func() {
		for {
			select {
			case <-lctx.Done():
				return
			case <-time.After(5 * time.Second):
			}
			if l, err := client.CoordinationV1().Leases(corev1.NamespaceNodeLease).Get(lctx, fake, metav1.GetOptions{}); err == nil {
				l.Spec.RenewTime = &metav1.MicroTime{Time: time.Now()}
				client.CoordinationV1().Leases(corev1.NamespaceNodeLease).Update(lctx, l, metav1.UpdateOptions{})
			}
		}
	}()

	testkit.Eventually(t, 60*time.Second, "the node controller to untaint "+fake, func() bool {
		n, err := client.CoreV1().Nodes().Get(ctx, fake, metav1.GetOptions{})
		return err == nil && len(n.Spec.Taints) == 0
	})

	for _, model := range []struct {
		name    string
		shared  bool
		devices int
	}{{"shared", true, 1}, {"perpod", false, pods}} {
		driver := "bench-" + model.name + ".inpod.dev"
		res := corev1.ResourceName("bench.inpod.dev/" + model.name)
		if _, err := client.ResourceV1().DeviceClasses().Create(ctx, &resourceapi.DeviceClass{ObjectMeta: metav1.ObjectMeta{Name: driver},
			Spec: resourceapi.DeviceClassSpec{ExtendedResourceName: ptr.To(string(res)),
				Selectors: []resourceapi.DeviceSelector{{CEL: &resourceapi.CELDeviceSelector{Expression: fmt.Sprintf("device.driver == %q", driver)}}}}},
			metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		// The published slices, tainted.
		taint := []resourceapi.DeviceTaint{{Key: dra.TaintKeyPrefix + "ztunnel-not-connected", Effect: resourceapi.DeviceTaintEffectNoSchedule}}
		perSlice := 64
		var created []*resourceapi.ResourceSlice
		nslices := (model.devices + perSlice - 1) / perSlice
		for i := range nslices {
			var devs []resourceapi.Device
			for j := i * perSlice; j < min((i+1)*perSlice, model.devices); j++ {
				d := resourceapi.Device{Name: fmt.Sprintf("redirection-%d", j), Taints: taint}
				if model.shared {
					d.Name, d.AllowMultipleAllocations = dra.DeviceName, ptr.To(true)
				}
				devs = append(devs, d)
			}
			s, err := client.ResourceV1().ResourceSlices().Create(ctx, &resourceapi.ResourceSlice{ObjectMeta: metav1.ObjectMeta{GenerateName: driver + "-"},
				Spec: resourceapi.ResourceSliceSpec{Driver: driver, NodeName: ptr.To(fake),
					Pool: resourceapi.ResourcePool{Name: fake, ResourceSliceCount: int64(nslices)}, Devices: devs}}, metav1.CreateOptions{})
			if err != nil {
				t.Fatal(err)
			}
			created = append(created, s)
		}
		ns := "bench-" + model.name
		if _, err := client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		for i := range pods {
			p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("p%d", i)}, Spec: corev1.PodSpec{
				NodeSelector: map[string]string{corev1.LabelHostname: fake},
				Containers: []corev1.Container{{Name: "app", Image: images.TestAppRef,
					Resources: corev1.ResourceRequirements{Limits: corev1.ResourceList{res: resource.MustParse("1")}}}}}}
			if _, err := client.CoreV1().Pods(ns).Create(ctx, p, metav1.CreateOptions{}); err != nil {
				t.Fatal(err)
			}
		}
		boundCount := func() int {
			l, err := client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
			if err != nil {
				return -1
			}
			c := 0
			for _, p := range l.Items {
				if p.Spec.NodeName != "" {
					c++
				}
			}
			return c
		}
		// Every pod tried and found unschedulable, and past its first
		// backoffs, before the devices become usable.
		testkit.Eventually(t, 60*time.Second, "all pods unschedulable", func() bool {
			l, err := client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
			if err != nil {
				return false
			}
			c := 0
			for _, p := range l.Items {
				for _, cond := range p.Status.Conditions {
					if cond.Type == corev1.PodScheduled && cond.Status == corev1.ConditionFalse {
						c++
					}
				}
			}
			return c == pods
		})
		if got := boundCount(); got != 0 {
			t.Fatalf("%s: %d pods bound to tainted devices", model.name, got)
		}
		start := time.Now()
		for _, s := range created {
			for i := range s.Spec.Devices {
				s.Spec.Devices[i].Taints = nil
			}
			if _, err := client.ResourceV1().ResourceSlices().Update(ctx, s, metav1.UpdateOptions{}); err != nil {
				t.Fatal(err)
			}
		}
		testkit.Eventually(t, 3*time.Minute, "all pods bound", func() bool { return boundCount() == pods })
		took := time.Since(start)
		t.Logf("device model %s (%d devices in %d slices): %d pending pods bound %s after the taint went (%.1f ms/pod)",
			model.name, model.devices, nslices, pods, took.Round(time.Millisecond), float64(took.Microseconds())/1000/pods)
		zero := int64(0)
		client.CoreV1().Pods(ns).DeleteCollection(ctx, metav1.DeleteOptions{GracePeriodSeconds: &zero}, metav1.ListOptions{})
	}
}
