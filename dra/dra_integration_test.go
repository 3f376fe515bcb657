//go:build integration

package dra

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	drahealth "k8s.io/kubelet/pkg/apis/dra-health/v1"
	drapb "k8s.io/kubelet/pkg/apis/dra/v1"

	"github.com/inpod-dev/inpod/e2e/cluster"
	"github.com/inpod-dev/inpod/e2e/cluster/clustertest"
	"github.com/inpod-dev/inpod/internal/testkit"
	"github.com/inpod-dev/inpod/readiness"
)

const nodeName = "node-a"

type counter struct {
	mu                            sync.Mutex
	publishes, tainted, untainted int
	refused                       int
	latencies                     []time.Duration
}

func (c *counter) SlicePublished() { c.mu.Lock(); c.publishes++; c.mu.Unlock() }
func (c *counter) TaintsChanged(t bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if t {
		c.tainted++
	} else {
		c.untainted++
	}
}
func (c *counter) SliceWritten(d time.Duration) {
	c.mu.Lock()
	c.latencies = append(c.latencies, d)
	c.mu.Unlock()
}
func (c *counter) PrepareRefused() { c.mu.Lock(); c.refused++; c.mu.Unlock() }
func (c *counter) written() int    { c.mu.Lock(); defer c.mu.Unlock(); return len(c.latencies) }

type world struct {
	t     *testing.T
	cp    *cluster.ControlPlane
	admin kubernetes.Interface
	// agent has exactly the rights deploy/rbac/agent.yaml gives the agent.
	agent kubernetes.Interface
	ready *readiness.Aggregate
	// dirs survive driver restarts, as the host paths do.
	regDir, pluginDir string
}

func newWorld(t *testing.T) *world {
	t.Helper()
	ctx := context.Background()
	cp := clustertest.ControlPlane(t, cluster.Config{})
	dir := testkit.ShortTempDir(t, "dra-")
	w := &world{t: t, cp: cp, admin: cp.Client, ready: notReady(),
		regDir: filepath.Join(dir, "reg"), pluginDir: filepath.Join(dir, "plugin")}
	clustertest.ApplyShippedRBAC(t, w.admin)
	rc := rest.CopyConfig(cp.Rest)
	rc.Impersonate = rest.ImpersonationConfig{UserName: "system:serviceaccount:inpod-system:inpod-agent"}
	var err error
	if w.agent, err = kubernetes.NewForConfig(rc); err != nil {
		t.Fatal(err)
	}
	if _, err := w.admin.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: nodeName}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	return w
}

func notReady() *readiness.Aggregate {
	return readiness.New(nil, readiness.CNIInstalled, readiness.ZtunnelConnected, readiness.PodsSynced)
}

func setReady(a *readiness.Aggregate) {
	a.Set(readiness.CNIInstalled, true, "")
	a.Set(readiness.PodsSynced, true, "")
	a.Set(readiness.ZtunnelConnected, true, "")
}

// start runs a driver on ready until stop (which waits for Run and fails
// the test on its error).
func (w *world) start(ready *readiness.Aggregate, obs *counter, grace time.Duration) (*Driver, func()) {
	w.t.Helper()
	d := w.driver(Config{StartupGrace: grace, Observer: obs})
	stop, _ := w.run(d, ready)
	testkit.Eventually(w.t, 10*time.Second, "the plugin socket", func() bool { _, err := os.Stat(d.PluginSocket()); return err == nil })
	return d, stop
}

// driver is a gate of the world's node and directories, with cfg's other
// fields.
func (w *world) driver(cfg Config) *Driver {
	w.t.Helper()
	cfg.Client, cfg.NodeName, cfg.RegistrarDir, cfg.PluginDir = w.agent, nodeName, w.regDir, w.pluginDir
	cfg.Logger = slog.New(slog.NewTextHandler(testWriter{w.t}, nil))
	d, err := New(cfg)
	if err != nil {
		w.t.Fatal(err)
	}
	return d
}

// run runs d on ready until stop (which waits for Run and fails the test
// on its error); returned is closed once Run has returned.
func (w *world) run(d *Driver, ready *readiness.Aggregate) (stop func(), returned <-chan struct{}) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	ended := make(chan struct{})
	go func() { done <- d.Run(ctx, ready); close(ended) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			if err := <-done; err != nil {
				w.t.Errorf("Run: %v", err)
			}
		})
	}
	w.t.Cleanup(stop)
	return stop, ended
}

func (w *world) slices() []resourceapi.ResourceSlice {
	w.t.Helper()
	l, err := w.admin.ResourceV1().ResourceSlices().List(context.Background(), metav1.ListOptions{})
	if err != nil {
		w.t.Fatal(err)
	}
	return l.Items
}

// waitSlice waits for the node's one slice to carry exactly taints.
func (w *world) waitSlice(taints ...string) resourceapi.ResourceSlice {
	w.t.Helper()
	var got resourceapi.ResourceSlice
	testkit.Eventually(w.t, 30*time.Second, "the slice with taints "+strings.Join(taints, ","), func() bool {
		s := w.slices()
		if len(s) != 1 || len(s[0].Spec.Devices) != 1 {
			return false
		}
		got = s[0]
		var keys []string
		for _, t := range s[0].Spec.Devices[0].Taints {
			if t.Effect != resourceapi.DeviceTaintEffectNoSchedule {
				w.t.Fatalf("taint %+v: want NoSchedule only", t)
			}
			keys = append(keys, t.Key)
		}
		return slices.Equal(keys, taints)
	})
	return got
}

// checkShape checks what the scheduler reads: driver, pool, node, one
// shared device.
func (w *world) checkShape(s resourceapi.ResourceSlice) {
	w.t.Helper()
	if s.Spec.Driver != DefaultDriverName || s.Spec.Pool.Name != nodeName || s.Spec.NodeName == nil || *s.Spec.NodeName != nodeName {
		w.t.Fatalf("slice spec %+v: want driver %s, pool and node %s", s.Spec, DefaultDriverName, nodeName)
	}
	dev := s.Spec.Devices[0]
	if dev.Name != DeviceName || dev.AllowMultipleAllocations == nil || !*dev.AllowMultipleAllocations {
		w.t.Fatalf("device %+v: want %q shared by every pod (allowMultipleAllocations)", dev, DeviceName)
	}
}

// The slice follows readiness both ways, with NoSchedule taints naming the
// failing conditions, and the time to the API is measured.
func TestIntegrationDRASliceFollowsReadiness(t *testing.T) {
	w := newWorld(t)
	obs := &counter{}
	// Not ready from the start (no slice yet: published at once).
	_, _ = w.start(w.ready, obs, time.Minute)
	s := w.waitSlice(TaintKeyPrefix+"cni-not-installed", TaintKeyPrefix+"pods-not-synced", TaintKeyPrefix+"ztunnel-not-connected")
	w.checkShape(s)

	setReady(w.ready)
	s = w.waitSlice()
	w.checkShape(s)

	w.ready.Set(readiness.ZtunnelConnected, false, "ztunnel left")
	w.waitSlice(TaintKeyPrefix + "ztunnel-not-connected")
	w.ready.Set(readiness.ZtunnelConnected, true, "")
	w.waitSlice()
	// The three changes made here are each measured once the driver's own
	// watch shows them; the first slice is measured only when that watch
	// started before it was written (a loaded CI run found it in the
	// watch's initial list instead, unmeasured).
	testkit.Eventually(t, 10*time.Second, "three writes measured", func() bool { return obs.written() >= 3 })
	obs.mu.Lock()
	defer obs.mu.Unlock()
	t.Logf("readiness change → slice in the API: %v", obs.latencies)
	if obs.tainted < 1 || obs.untainted < 2 || obs.publishes < 3 {
		t.Fatalf("metrics: %d publishes, %d to tainted, %d to untainted; want ≥3, ≥1, ≥2", obs.publishes, obs.tainted, obs.untainted)
	}
	for _, l := range obs.latencies {
		if l > 5*time.Second {
			t.Fatalf("a readiness change took %s to reach the slice", l)
		}
	}
}

// watchWrites counts every change of the node's slices from now on.
func (w *world) watchWrites() func() []watch.Event {
	w.t.Helper()
	wi, err := w.admin.ResourceV1().ResourceSlices().Watch(context.Background(), metav1.ListOptions{ResourceVersion: w.listRV()})
	if err != nil {
		w.t.Fatal(err)
	}
	w.t.Cleanup(wi.Stop)
	var mu sync.Mutex
	var events []watch.Event
	go func() {
		for ev := range wi.ResultChan() {
			if ev.Type == watch.Bookmark {
				continue
			}
			mu.Lock()
			events = append(events, ev)
			mu.Unlock()
		}
	}()
	return func() []watch.Event { mu.Lock(); defer mu.Unlock(); return slices.Clone(events) }
}

func (w *world) listRV() string {
	l, err := w.admin.ResourceV1().ResourceSlices().List(context.Background(), metav1.ListOptions{})
	if err != nil {
		w.t.Fatal(err)
	}
	return l.ResourceVersion
}

// quiet asserts no slice write for d (an absence: bounded wait).
func (w *world) quiet(events func() []watch.Event, d time.Duration) {
	w.t.Helper()
	deadline := time.Now().Add(d)
	for time.Now().Before(deadline) {
		if ev := events(); len(ev) > 0 {
			w.t.Fatalf("the slice was written: %s %+v", ev[0].Type, ev[0].Object)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// An agent restart while ready does not delete, recreate or re-taint the
// slice: not even in the restarted agent's first moments, before ztunnel
// has reconnected (the startup grace).
func TestIntegrationDRARestartWhileReadyWritesNothing(t *testing.T) {
	w := newWorld(t)
	setReady(w.ready)
	_, stop := w.start(w.ready, &counter{}, time.Minute)
	before := w.waitSlice()
	stop()
	events := w.watchWrites()

	// The new agent's readiness starts not ready, as a restarted agent's does.
	again := notReady()
	obs := &counter{}
	w.start(again, obs, time.Minute)
	w.quiet(events, time.Second)
	again.Set(readiness.CNIInstalled, true, "")
	again.Set(readiness.PodsSynced, true, "")
	w.quiet(events, time.Second)
	again.Set(readiness.ZtunnelConnected, true, "")
	testkit.Eventually(t, 10*time.Second, "the restarted driver's slice seen", func() bool { return obs.written() >= 1 })
	w.quiet(events, 3*time.Second)
	after := w.waitSlice()
	if after.UID != before.UID || after.ResourceVersion != before.ResourceVersion {
		t.Fatalf("slice %s/%s after the restart, want the same object %s/%s", after.UID, after.ResourceVersion, before.UID, before.ResourceVersion)
	}
}

// A restarted agent that does not become ready within the grace taints the
// slice the previous agent left untainted.
func TestIntegrationDRARestartIntoNotReadyTaintsAfterTheGrace(t *testing.T) {
	w := newWorld(t)
	setReady(w.ready)
	_, stop := w.start(w.ready, &counter{}, time.Minute)
	w.waitSlice()
	stop()
	again := notReady()
	again.Set(readiness.CNIInstalled, true, "")
	again.Set(readiness.PodsSynced, true, "")
	started := time.Now()
	d, _ := w.start(again, &counter{}, 2*time.Second)
	// Meanwhile the slice still says ready (as after an agent was killed
	// while ready): a pod bound now cannot start, prepare is refused.
	c := w.claim("bound-meanwhile")
	if r := prepare(t, dial(t, d), c)[string(c.UID)]; r == nil || !strings.Contains(r.Error, "not ready") {
		t.Fatalf("prepare during the grace: %+v, want a refusal", r)
	}
	w.waitSlice(TaintKeyPrefix + "ztunnel-not-connected")
	if took := time.Since(started); took < 2*time.Second {
		t.Fatalf("tainted after %s, within the grace", took)
	}
}

// Uninstall: once the driver has stopped, RemoveFromNode leaves no slice,
// and nothing writes one again.
func TestIntegrationDRAUninstallRemovesTheSlice(t *testing.T) {
	w := newWorld(t)
	setReady(w.ready)
	d, stop := w.start(w.ready, &counter{}, time.Minute)
	w.waitSlice()
	stop()
	if err := d.RemoveFromNode(context.Background()); err != nil {
		t.Fatal(err)
	}
	if s := w.slices(); len(s) != 0 {
		t.Fatalf("slices after uninstall: %+v", s)
	}
	events := w.watchWrites()
	w.quiet(events, 2*time.Second)
}

// The kubelet wipes its node's slices when it starts (and a driver's 30 s
// after its connection went): the serving gate publishes again within
// seconds, not after the helper's 30 s sync delay.
func TestIntegrationDRARepublishesAWipedSlice(t *testing.T) {
	w := newWorld(t)
	setReady(w.ready)
	w.start(w.ready, &counter{}, time.Minute)
	before := w.waitSlice()
	if err := w.admin.ResourceV1().ResourceSlices().DeleteCollection(context.Background(), metav1.DeleteOptions{}, metav1.ListOptions{}); err != nil {
		t.Fatal(err)
	}
	wiped := time.Now()
	after := w.waitSlice()
	if after.UID == before.UID {
		t.Fatal("the same slice after the wipe")
	}
	if took := time.Since(wiped); took > 10*time.Second {
		t.Fatalf("published again %s after the wipe", took)
	} else {
		t.Logf("published again %s after the wipe", took.Round(time.Millisecond))
	}
}

// An API server outage while readiness flips: the slice converges to the
// newest state once the API is back, without a readiness change to prompt
// it (the helper's own backoff would have grown to minutes).
func TestIntegrationDRAConvergesAfterAnAPIOutage(t *testing.T) {
	w := newWorld(t)
	setReady(w.ready)
	w.start(w.ready, &counter{}, time.Minute)
	w.waitSlice()
	w.cp.StopAPIServer()
	w.ready.Set(readiness.ZtunnelConnected, false, "ztunnel left")
	// Long enough for the helper's failures to back off well past a second.
	time.Sleep(15 * time.Second) // the outage itself, not synchronisation
	if err := w.cp.StartAPIServer(context.Background()); err != nil {
		t.Fatal(err)
	}
	back := time.Now()
	w.waitSlice(TaintKeyPrefix + "ztunnel-not-connected")
	t.Logf("tainted %s after the API server came back", time.Since(back).Round(time.Millisecond))
	if took := time.Since(back); took > 10*time.Second {
		t.Fatalf("took %s after the outage", took)
	}
}

// claim creates a claim allocated to the node's device, as the scheduler
// would.
func (w *world) claim(name string) *resourceapi.ResourceClaim {
	w.t.Helper()
	ctx := context.Background()
	c, err := w.admin.ResourceV1().ResourceClaims("default").Create(ctx, &resourceapi.ResourceClaim{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{Requests: []resourceapi.DeviceRequest{{
			Name: "redirection", Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: DefaultDriverName}}}}},
	}, metav1.CreateOptions{})
	if err != nil {
		w.t.Fatal(err)
	}
	c.Status.Allocation = &resourceapi.AllocationResult{Devices: resourceapi.DeviceAllocationResult{Results: []resourceapi.DeviceRequestAllocationResult{{
		Request: "redirection", Driver: DefaultDriverName, Pool: nodeName, Device: DeviceName}}}}
	if c, err = w.admin.ResourceV1().ResourceClaims("default").UpdateStatus(ctx, c, metav1.UpdateOptions{}); err != nil {
		w.t.Fatal(err)
	}
	return c
}

func dial(t *testing.T, d *Driver) drapb.DRAPluginClient {
	t.Helper()
	conn, err := grpc.NewClient("unix://"+d.PluginSocket(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return drapb.NewDRAPluginClient(conn)
}

func prepare(t *testing.T, c drapb.DRAPluginClient, claims ...*resourceapi.ResourceClaim) map[string]*drapb.NodePrepareResourceResponse {
	t.Helper()
	req := &drapb.NodePrepareResourcesRequest{}
	for _, cl := range claims {
		req.Claims = append(req.Claims, &drapb.Claim{Namespace: cl.Namespace, Name: cl.Name, Uid: string(cl.UID)})
	}
	resp, err := c.NodePrepareResources(context.Background(), req)
	if err != nil {
		t.Fatal(err)
	}
	return resp.Claims
}

func unprepare(t *testing.T, c drapb.DRAPluginClient, claims ...*resourceapi.ResourceClaim) {
	t.Helper()
	req := &drapb.NodeUnprepareResourcesRequest{}
	for _, cl := range claims {
		req.Claims = append(req.Claims, &drapb.Claim{Namespace: cl.Namespace, Name: cl.Name, Uid: string(cl.UID)})
	}
	resp, err := c.NodeUnprepareResources(context.Background(), req)
	if err != nil {
		t.Fatal(err)
	}
	for uid, r := range resp.Claims {
		if r.Error != "" {
			t.Fatalf("unprepare %s: %s", uid, r.Error)
		}
	}
}

// NodePrepareResources through the kubelet's gRPC API: refused while not
// ready (the second guard), recorded once ready, the same on repeats;
// unprepare forgets, also after a restart, and repeats are no error.
func TestIntegrationDRAPrepareAndUnprepare(t *testing.T) {
	w := newWorld(t)
	obs := &counter{}
	d, stop := w.start(w.ready, obs, time.Minute)
	c := dial(t, d)
	a, b := w.claim("a"), w.claim("b")

	for uid, r := range prepare(t, c, a) {
		if !strings.Contains(r.Error, "not ready") {
			t.Fatalf("prepare %s while not ready: %+v, want a refusal", uid, r)
		}
	}
	obs.mu.Lock()
	refused := obs.refused
	obs.mu.Unlock()
	if refused != 1 || len(d.Prepared()) != 0 {
		t.Fatalf("after a refusal: %d refused, recorded %v", refused, d.Prepared())
	}

	setReady(w.ready)
	testkit.Eventually(t, 5*time.Second, "the driver ready", func() bool { d.mu.Lock(); defer d.mu.Unlock(); return d.ready })
	for range 2 { // a repeat answers the same
		got := prepare(t, c, a, b)
		for _, cl := range []*resourceapi.ResourceClaim{a, b} {
			r := got[string(cl.UID)]
			if r == nil || r.Error != "" || len(r.Devices) != 1 || r.Devices[0].PoolName != nodeName || r.Devices[0].DeviceName != DeviceName {
				t.Fatalf("prepare %s: %+v", cl.Name, r)
			}
		}
	}
	if got := d.Prepared(); !slices.Equal(got, []string{"default/a", "default/b"}) {
		t.Fatalf("recorded %v", got)
	}

	// Not ready again: even a claim prepared before is refused.
	w.ready.Set(readiness.ZtunnelConnected, false, "ztunnel left")
	testkit.Eventually(t, 5*time.Second, "the driver not ready", func() bool { d.mu.Lock(); defer d.mu.Unlock(); return !d.ready })
	if r := prepare(t, c, a)[string(a.UID)]; r == nil || r.Error == "" {
		t.Fatalf("prepare while not ready: %+v", r)
	}

	// A restart keeps the record: unprepare after it forgets the claim.
	stop()
	d2, _ := w.start(w.ready, &counter{}, time.Minute)
	if got := d2.Prepared(); !slices.Equal(got, []string{"default/a", "default/b"}) {
		t.Fatalf("recorded after a restart %v", got)
	}
	c2 := dial(t, d2)
	unprepare(t, c2, a)
	unprepare(t, c2, a) // idempotent
	if got := d2.Prepared(); !slices.Equal(got, []string{"default/b"}) {
		t.Fatalf("recorded after unprepare %v", got)
	}
	unprepare(t, c2, b)
	if got := d2.Prepared(); len(got) != 0 {
		t.Fatalf("recorded after unprepare %v", got)
	}
}

// The kubelet's DRAResourceHealth stream, through its gRPC API on the
// plugin's socket: the device's health at once (Unhealthy, naming what
// fails, while not ready), Healthy once ready, Unhealthy again when ztunnel
// leaves, each change as it happens; and the same health again within the
// kubelet's 30 s while nothing changes (HealthResendEvery, shortened here).
func TestIntegrationDRAHealthFollowsReadiness(t *testing.T) {
	defer func(old time.Duration) { HealthResendEvery = old }(HealthResendEvery)
	HealthResendEvery = 200 * time.Millisecond
	w := newWorld(t)
	d, _ := w.start(w.ready, &counter{}, time.Minute)
	conn, err := grpc.NewClient("unix://"+d.PluginSocket(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	stream, err := drahealth.NewDRAResourceHealthClient(conn).NodeWatchResources(ctx, &drahealth.NodeWatchResourcesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	// next reads reports until the device has want, its message naming
	// reason; it fails on the stream's end or the deadline.
	next := func(want drahealth.HealthStatus, reason string) time.Time {
		t.Helper()
		for {
			resp, err := stream.Recv()
			if err != nil {
				t.Fatalf("waiting for the device %s (%q): %v", want, reason, err)
			}
			if len(resp.Devices) != 1 || resp.Devices[0].Device.GetPoolName() != nodeName || resp.Devices[0].Device.GetDeviceName() != DeviceName {
				t.Fatalf("a report of other devices than the node's one: %v", resp.Devices)
			}
			if h := resp.Devices[0]; h.Health == want && strings.Contains(h.Message, reason) {
				return time.Now()
			}
		}
	}
	next(drahealth.HealthStatus_UNHEALTHY, "ztunnel")
	setReady(w.ready)
	next(drahealth.HealthStatus_HEALTHY, "ready")
	first := next(drahealth.HealthStatus_HEALTHY, "ready")
	again := next(drahealth.HealthStatus_HEALTHY, "ready")
	if again.Sub(first) > 5*time.Second {
		t.Errorf("an unchanged health was resent after %s; want about every %s", again.Sub(first), HealthResendEvery)
	}
	w.ready.Set(readiness.ZtunnelConnected, false, "ztunnel left")
	next(drahealth.HealthStatus_UNHEALTHY, "ztunnel left")
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}
