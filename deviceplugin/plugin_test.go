package deviceplugin_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/inpod-dev/inpod/deviceplugin"
	"github.com/inpod-dev/inpod/deviceplugin/kubelettest"
	"github.com/inpod-dev/inpod/internal/testkit"
	"github.com/inpod-dev/inpod/readiness"
)

const res = deviceplugin.DefaultResourceName

func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	testkit.Eventually(t, 10*time.Second, what, cond)
}

func startKubelet(t *testing.T, dir string) *kubelettest.Kubelet {
	t.Helper()
	k, err := kubelettest.Start(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(k.Stop)
	return k
}

func startPlugin(t *testing.T, dir string, ready *readiness.Aggregate, mod func(*deviceplugin.Config)) *deviceplugin.Plugin {
	t.Helper()
	cfg := deviceplugin.Config{PluginDir: dir, Devices: 8}
	if mod != nil {
		mod(&cfg)
	}
	p, err := deviceplugin.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- p.Run(ctx, ready) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	})
	return p
}

func newReady() *readiness.Aggregate { return readiness.New(nil, "test") }

func TestAllocatableFollowsReadiness(t *testing.T) {
	dir := t.TempDir()
	k := startKubelet(t, dir)
	ready := newReady()
	startPlugin(t, dir, ready, nil)
	eventually(t, "registration with 8 devices", func() bool { return k.Capacity(res) == 8 })
	if got := k.Allocatable(res); got != 0 {
		t.Fatalf("allocatable %d while not ready, want 0", got)
	}
	ready.Set("test", true, "")
	eventually(t, "allocatable 8 once ready", func() bool { return k.Allocatable(res) == 8 })
	ready.Set("test", false, "ztunnel went away")
	eventually(t, "allocatable 0 once not ready", func() bool { return k.Allocatable(res) == 0 })
	if k.Capacity(res) != 8 {
		t.Fatal("the plugin withdrew its devices instead of marking them Unhealthy")
	}
	if k.Registrations() != 1 {
		t.Fatalf("%d registrations, want 1: readiness must not cause re-registration", k.Registrations())
	}
}

func TestPluginStartedBeforeTheKubelet(t *testing.T) {
	dir := t.TempDir()
	ready := newReady()
	ready.Set("test", true, "")
	startPlugin(t, dir, ready, nil)
	k := startKubelet(t, dir)
	eventually(t, "registration once the kubelet appears", func() bool { return k.Allocatable(res) == 8 })
}

func TestKubeletRestartAndSocketRemovalReRegister(t *testing.T) {
	dir := t.TempDir()
	k := startKubelet(t, dir)
	ready := newReady()
	ready.Set("test", true, "")
	p := startPlugin(t, dir, ready, nil)
	eventually(t, "first registration", func() bool { return k.Allocatable(res) == 8 })

	if err := k.Restart(); err != nil {
		t.Fatal(err)
	}
	eventually(t, "re-registration after a kubelet restart", func() bool { return k.Registrations() == 2 && k.Allocatable(res) == 8 })

	if err := os.Remove(p.SocketPath()); err != nil {
		t.Fatal(err)
	}
	eventually(t, "re-registration after the socket was removed", func() bool {
		_, err := os.Stat(p.SocketPath())
		return k.Registrations() == 3 && k.Allocatable(res) == 8 && err == nil
	})
}

func TestTwoInstancesUseTheirOwnSockets(t *testing.T) {
	dir := t.TempDir()
	k := startKubelet(t, dir)
	ready := newReady()
	ready.Set("test", true, "")
	old := startPlugin(t, dir, ready, nil)
	eventually(t, "old registered", func() bool { return k.Endpoint(res) == filepath.Base(old.SocketPath()) })
	// A surge rollout starts the new agent while the old one still runs.
	newer := startPlugin(t, dir, ready, nil)
	if old.SocketPath() == newer.SocketPath() {
		t.Fatal("two instances share a socket name")
	}
	eventually(t, "the newer instance serving the resource", func() bool {
		return k.Endpoint(res) == filepath.Base(newer.SocketPath()) && k.Allocatable(res) == 8
	})
	if _, err := os.Stat(old.SocketPath()); err != nil {
		t.Fatalf("the old instance's socket was disturbed: %v", err)
	}
}

// Allocate grants while the node is not ready too: the kubelet asks only
// for devices it saw Healthy, and a refusal would fail the pod for good
// where its CNI ADD holds it instead.
func TestAllocateMarksTheContainerGated(t *testing.T) {
	dir := t.TempDir()
	k := startKubelet(t, dir)
	ready := newReady()
	startPlugin(t, dir, ready, nil)
	eventually(t, "registration", func() bool { return k.Capacity(res) == 8 })
	for _, when := range []string{"not ready", "ready"} {
		if when == "ready" {
			ready.Set("test", true, "")
			eventually(t, "healthy", func() bool { return k.Allocatable(res) == 8 })
		}
		resp, err := k.Allocate(context.Background(), res, 1)
		if err != nil {
			t.Fatalf("Allocate while %s = %v", when, err)
		}
		c := resp.ContainerResponses[0]
		if c.Envs[deviceplugin.GatedEnv] != "true" || c.Annotations[deviceplugin.GatedAnnotation] != "true" {
			t.Fatalf("allocation while %s %+v lacks the gated marker", when, c)
		}
	}
}

// With a PreStart check the plugin registers PreStartRequired, and the
// check's answer decides each container start; without one the kubelet
// never asks.
func TestPreStartDecidesContainerStarts(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	k := startKubelet(t, dir)
	startPlugin(t, dir, newReady(), nil)
	eventually(t, "registration", func() bool { return k.Capacity(res) == 8 })
	if asked, err := k.PreStart(ctx, res, []string{"a"}); asked || err != nil {
		t.Fatalf("PreStart without a check: asked %v, %v; want not asked", asked, err)
	}

	dir = t.TempDir()
	k = startKubelet(t, dir)
	var (
		mu   sync.Mutex
		seen []string
		hold = true
	)
	startPlugin(t, dir, newReady(), func(c *deviceplugin.Config) {
		c.PreStart = func(_ context.Context, ids []string) error {
			mu.Lock()
			defer mu.Unlock()
			seen = append(seen, ids...)
			if hold {
				return errors.New("pod mesh/web is not redirected yet")
			}
			return nil
		}
	})
	eventually(t, "registration", func() bool { return k.Capacity(res) == 8 })
	if asked, err := k.PreStart(ctx, res, []string{"dev-3"}); !asked || err == nil || !strings.Contains(err.Error(), "not redirected yet") {
		t.Fatalf("PreStart while the check holds: asked %v, %v; want asked and the check's error", asked, err)
	}
	mu.Lock()
	hold = false
	mu.Unlock()
	if asked, err := k.PreStart(ctx, res, []string{"dev-3"}); !asked || err != nil {
		t.Fatalf("PreStart once the check passes: asked %v, %v", asked, err)
	}
	mu.Lock()
	defer mu.Unlock()
	if !slices.Equal(seen, []string{"dev-3", "dev-3"}) {
		t.Fatalf("the check saw devices %v, want the container's dev-3 twice", seen)
	}
}

func TestResourceNameRules(t *testing.T) {
	for _, bad := range []string{"redirection", "kubernetes.io/redirection", "x.kubernetes.io/y", "a/b/c", "/x"} {
		if _, err := deviceplugin.New(deviceplugin.Config{ResourceName: bad}); err == nil {
			t.Errorf("resource name %q accepted", bad)
		}
	}
}

// Left at 0, the device count is asked for once at Run (the agent reads the
// Node's pod capacity there, off New's path).
func TestDevicesFromIsAskedAtRun(t *testing.T) {
	dir := t.TempDir()
	k := startKubelet(t, dir)
	startPlugin(t, dir, newReady(), func(c *deviceplugin.Config) {
		c.Devices, c.DevicesFrom = 0, func(context.Context) int { return 3 }
	})
	eventually(t, "3 devices registered", func() bool { return k.Capacity(res) == 3 })
}

// The device-plugin directory gone while the plugin waits for a kubelet to
// register with: the plugin must not wait on with its own socket gone (the
// kubelet would dial back to nothing), but serve again, which fails, so Run
// returns and the agent stops instead of lingering with a green health
// check.
func TestRunFailsWhenItsDirectoryGoesBeforeRegistration(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "device-plugins")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	p, err := deviceplugin.New(deviceplugin.Config{PluginDir: dir, Devices: 8})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- p.Run(ctx, newReady()) }()
	eventually(t, "the plugin's socket", func() bool { _, err := os.Stat(p.SocketPath()); return err == nil })
	// The plugin may serve again into the directory while it is being
	// removed (then the last rmdir finds it not empty): remove until gone.
	eventually(t, "the directory removed", func() bool { return os.RemoveAll(dir) == nil })
	select {
	case err := <-done:
		if err == nil {
			t.Fatal("Run returned nil after its directory went away")
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Run still waits for a kubelet 10 s after its own socket and directory went away")
	}
}

// closer is a Closer the test releases; it records what the kubelet
// stand-in saw when the close began.
type closer struct {
	k        *kubelettest.Kubelet
	calls    chan int // allocatable at each call
	release  chan struct{}
	canceled chan struct{}
	// keeps and kept get a value as each KeepClosed begins and ends.
	keeps chan int
	kept  chan struct{}
}

func newCloser(k *kubelettest.Kubelet) *closer {
	return &closer{k: k, calls: make(chan int, 8), release: make(chan struct{}), canceled: make(chan struct{}, 8),
		keeps: make(chan int, 8), kept: make(chan struct{}, 8)}
}

func (c *closer) KeepClosed(ctx context.Context) {
	c.keeps <- c.k.Allocatable(res)
	<-ctx.Done()
	c.kept <- struct{}{}
}

func (c *closer) keepsClosed(t *testing.T) {
	t.Helper()
	select {
	case <-c.keeps:
	case <-time.After(10 * time.Second):
		t.Fatal("the plugin never asked its Closer to keep the Node closed")
	}
}

func (c *closer) CloseScheduling(ctx context.Context) error {
	c.calls <- c.k.Allocatable(res)
	select {
	case <-c.release:
		return nil
	case <-ctx.Done():
		c.canceled <- struct{}{}
		return ctx.Err()
	}
}

// healthyPlugin is a plugin Run by the test (done gets Run's result;
// cancel stops it), Healthy at a kubelet stand-in, closing through c.
type healthyPlugin struct {
	k      *kubelettest.Kubelet // its Dir is the plugin directory
	c      *closer
	p      *deviceplugin.Plugin
	ready  *readiness.Aggregate
	done   chan error
	cancel context.CancelFunc
}

func runHealthyWithCloser(t *testing.T) *healthyPlugin {
	t.Helper()
	dir := t.TempDir()
	hp := &healthyPlugin{k: startKubelet(t, dir), ready: newReady(), done: make(chan error, 1)}
	hp.c = newCloser(hp.k)
	p, err := deviceplugin.New(deviceplugin.Config{PluginDir: dir, Devices: 8, Closer: hp.c, CloseTimeout: deviceplugin.MaxCloseTimeout})
	if err != nil {
		t.Fatal(err)
	}
	hp.p = p
	ctx, cancel := context.WithCancel(context.Background())
	hp.cancel = cancel
	go func() { hp.done <- p.Run(ctx, hp.ready) }()
	hp.ready.Set("test", true, "")
	eventually(t, "healthy", func() bool { return hp.k.Allocatable(res) == 8 })
	return hp
}

// startHealthyWithCloser starts a kubelet stand-in and a plugin closing
// through a test closer, and turns every condition of ready true.
func startHealthyWithCloser(t *testing.T, ready *readiness.Aggregate, timeout time.Duration) (*kubelettest.Kubelet, *closer) {
	t.Helper()
	dir := t.TempDir()
	k := startKubelet(t, dir)
	c := newCloser(k)
	startPlugin(t, dir, ready, func(cfg *deviceplugin.Config) { cfg.Closer, cfg.CloseTimeout = c, timeout })
	for _, cond := range []string{readiness.CNIInstalled, "test"} {
		ready.Set(cond, true, "")
	}
	eventually(t, "healthy", func() bool { return k.Allocatable(res) == 8 })
	return k, c
}

func (c *closer) called(t *testing.T) int {
	t.Helper()
	select {
	case n := <-c.calls:
		return n
	case <-time.After(10 * time.Second):
		t.Fatal("the plugin never asked its Closer to close")
		return 0
	}
}

// A readiness dip keeps the devices Healthy until the Closer has stopped
// the scheduler (the kubelet would refuse, for good, a pod it admits with
// no device Healthy), and only then turns them Unhealthy; the kubelet's
// Allocate is granted meanwhile.
func TestDevicesTurnUnhealthyOnlyOnceClosed(t *testing.T) {
	ready := newReady()
	k, c := startHealthyWithCloser(t, ready, deviceplugin.MaxCloseTimeout)

	dip := time.Now()
	ready.Set("test", false, "ztunnel went away")
	if n := c.called(t); n != 8 {
		t.Fatalf("the close began with %d devices Healthy, want 8", n)
	}
	if _, err := k.Allocate(context.Background(), res, 1); err != nil {
		t.Fatalf("Allocate while closing = %v; the kubelet would fail the pod", err)
	}
	if u, ok := k.FirstSince(res, dip, 0); ok {
		t.Fatalf("devices turned Unhealthy at %s, before the close ended", u.At)
	}
	close(c.release)
	eventually(t, "Unhealthy once closed", func() bool { return k.Allocatable(res) == 0 })
	c.keepsClosed(t)
	if _, err := k.Allocate(context.Background(), res, 1); err != nil {
		t.Fatalf("Allocate while not ready = %v; a pod the kubelet admits waits at its CNI ADD instead", err)
	}
	// Ready again: the Node is no longer kept closed, before the devices
	// turn Healthy.
	ready.Set("test", true, "")
	select {
	case <-c.kept:
	case <-time.After(5 * time.Second):
		t.Fatal("KeepClosed still runs after the node is ready again")
	}
}

// Ready again before the close ends: the close is called off and the
// devices never leave Healthy.
func TestReadyAgainCancelsTheClose(t *testing.T) {
	ready := newReady()
	k, c := startHealthyWithCloser(t, ready, deviceplugin.MaxCloseTimeout)
	dip := time.Now()
	ready.Set("test", false, "ztunnel went away")
	c.called(t)
	ready.Set("test", true, "")
	select {
	case <-c.canceled:
	case <-time.After(10 * time.Second):
		t.Fatal("the close was not called off when the node was ready again")
	}
	// A second dip closes again, from the start.
	ready.Set("test", false, "ztunnel went away again")
	c.called(t)
	if u, ok := k.FirstSince(res, dip, 0); ok {
		t.Fatalf("devices turned Unhealthy at %s although the node was ready again before the close ended", u.At)
	}
	close(c.release)
}

// The close is bounded: a Closer that never returns leaves the devices
// Healthy for CloseTimeout, no longer.
func TestCloseTimeoutBoundsTheClose(t *testing.T) {
	ready := newReady()
	k, c := startHealthyWithCloser(t, ready, 200*time.Millisecond)
	dip := time.Now()
	ready.Set("test", false, "ztunnel went away")
	c.called(t)
	eventually(t, "Unhealthy once the close timed out", func() bool { return k.Allocatable(res) == 0 })
	if u, ok := k.FirstSince(res, dip, 0); !ok || u.At.Sub(dip) > 2*time.Second {
		t.Fatalf("devices Unhealthy %s after the dip (%v), want about the 200 ms timeout", u.At.Sub(dip), ok)
	}
}

// A chain the installer puts back within moments: the devices blink
// Unhealthy, but the Node's count is not written 0 (that would keep the
// node unschedulable until the kubelet's next sync).
func TestAChainBlipLeavesTheNodeOpen(t *testing.T) {
	ready := readiness.New(nil, readiness.CNIInstalled, "test")
	k, c := startHealthyWithCloser(t, ready, deviceplugin.MaxCloseTimeout)
	blip := time.Now()
	ready.Set(readiness.CNIInstalled, false, "another CNI rewrote the chain")
	ready.Set(readiness.CNIInstalled, true, "")
	eventually(t, "healthy again, and past the time a lasting loss is written", func() bool {
		select {
		case <-c.keeps:
			t.Fatal("the Node's count was written 0 for a chain put back at once")
		default:
		}
		return k.Allocatable(res) == 8 && time.Since(blip) > time.Second
	})
	close(c.release)
}

// With the chain missing inpod-cni, a pod admitted now would set its
// sandbox up without inpod (PreStartContainer holds only the container
// holding the device): the devices turn Unhealthy at once, the Node is
// kept closed, Allocate refuses, and a close under way is called off when
// the chain goes.
func TestChainLostClosesAtOnce(t *testing.T) {
	for _, preStart := range []bool{false, true} {
		dir := t.TempDir()
		k := startKubelet(t, dir)
		ready := readiness.New(nil, readiness.CNIInstalled, "test")
		c := newCloser(k)
		startPlugin(t, dir, ready, func(cfg *deviceplugin.Config) {
			cfg.Closer, cfg.CloseTimeout = c, deviceplugin.MaxCloseTimeout
			if preStart {
				cfg.PreStart = func(context.Context, []string) error { return nil }
			}
		})
		ready.Set(readiness.CNIInstalled, true, "")
		ready.Set("test", true, "")
		eventually(t, "healthy", func() bool { return k.Allocatable(res) == 8 })

		ready.Set(readiness.CNIInstalled, false, "inpod-cni is not in the chain")
		eventually(t, "Unhealthy at once", func() bool { return k.Allocatable(res) == 0 })
		c.keepsClosed(t)
		select {
		case <-c.calls:
			t.Fatalf("preStart %v: the plugin closed through its Closer with the chain missing inpod-cni", preStart)
		default:
		}
		if _, err := k.Allocate(context.Background(), res, 1); err == nil || !strings.Contains(err.Error(), "not in the node's CNI chain") {
			t.Fatalf("preStart %v: Allocate with the chain missing inpod-cni = %v, want refused", preStart, err)
		}

		ready.Set(readiness.CNIInstalled, true, "")
		eventually(t, "healthy again", func() bool { return k.Allocatable(res) == 8 })
		ready.Set("test", false, "ztunnel went away")
		c.called(t)
		ready.Set(readiness.CNIInstalled, false, "inpod-cni is not in the chain")
		eventually(t, "Unhealthy once the chain went mid-close", func() bool { return k.Allocatable(res) == 0 })
	}
}

func TestCloseTimeoutIsBounded(t *testing.T) {
	if _, err := deviceplugin.New(deviceplugin.Config{CloseTimeout: deviceplugin.MaxCloseTimeout + time.Second}); err == nil {
		t.Fatal("a close timeout above MaxCloseTimeout was accepted")
	}
}

// The agent stopping closes too, before the plugin's stream ends (the
// kubelet turns every device Unhealthy then).
func TestStoppingClosesBeforeTheStreamEnds(t *testing.T) {
	hp := runHealthyWithCloser(t)
	c, p, done, cancel := hp.c, hp.p, hp.done, hp.cancel
	defer cancel()
	cancel()
	if n := c.called(t); n != 8 {
		t.Fatalf("the close began with %d devices Healthy, want 8", n)
	}
	select {
	case err := <-done:
		t.Fatalf("Run returned (%v) before the close ended", err)
	case <-time.After(100 * time.Millisecond):
	}
	close(c.release)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(p.SocketPath()); err == nil {
		t.Fatal("the plugin's socket is still there after Run returned")
	}
	// After the stream ended, the Node was kept closed a moment, and
	// nothing of the plugin runs on.
	c.keepsClosed(t)
	select {
	case <-c.kept:
	default:
		t.Fatal("KeepClosed still runs after Run returned")
	}
}

// Retired, the plugin serves on until the successor's plugin serves too,
// then stops without closing: no Closer call, and the last devices the
// kubelet got from it are Healthy. A retired plugin no successor joins
// closes the gate at the end of its linger, as at a stop.
func TestRetiredStopsWithoutClosingOnceTheSuccessorServes(t *testing.T) {
	hp := runHealthyWithCloser(t)
	k, c, p, done, cancel := hp.k, hp.c, hp.p, hp.done, hp.cancel
	defer cancel()
	retired := time.Now()
	p.Retire(time.Minute)
	select {
	case err := <-done:
		t.Fatalf("a retired plugin stopped (%v) before any successor served", err)
	case <-time.After(300 * time.Millisecond): // the negative: it serves on
	}
	successorReady := newReady()
	successorReady.Set("test", true, "")
	startPlugin(t, hp.k.Dir, successorReady, nil)
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("the retired plugin did not stop once the successor's served")
	}
	select {
	case <-c.calls:
		t.Fatal("a retired plugin asked its Closer to close the Node")
	default:
	}
	if u, ok := k.FirstSince(res, retired, 0); ok {
		t.Fatalf("a retired plugin sent Unhealthy devices at %v", u.At)
	}

	lone := runHealthyWithCloser(t)
	defer lone.cancel()
	close(lone.c.release)
	lone.p.Retire(200 * time.Millisecond)
	if n := lone.c.called(t); n != 8 {
		t.Fatalf("the close began with %d devices Healthy, want 8", n)
	}
	select {
	case err := <-lone.done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("a retired plugin with no successor did not stop after its linger")
	}
}

// After a take-over the plugin registers only once the node is ready
// here, so its first devices are Healthy; never ready, it registers
// after the wait and says so.
func TestTakeOverRegistersOnceReady(t *testing.T) {
	dir := t.TempDir()
	k := startKubelet(t, dir)
	ready := newReady()
	p, err := deviceplugin.New(deviceplugin.Config{PluginDir: dir, Devices: 8})
	if err != nil {
		t.Fatal(err)
	}
	p.TakeOver(time.Minute)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- p.Run(ctx, ready) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	})
	start := time.Now()
	time.Sleep(300 * time.Millisecond) // the negative: no registration while not ready
	if n := k.Registrations(); n != 0 {
		t.Fatalf("registered %d times before the node was ready", n)
	}
	ready.Set("test", true, "")
	eventually(t, "registered and Healthy", func() bool { return k.Allocatable(res) == 8 })
	if u, ok := k.FirstSince(res, start, 0); ok {
		t.Fatalf("the plugin sent Unhealthy devices at %v after a take-over", u.At)
	}

	dir2 := t.TempDir()
	k2 := startKubelet(t, dir2)
	never := newReady()
	p2, err := deviceplugin.New(deviceplugin.Config{PluginDir: dir2, Devices: 8})
	if err != nil {
		t.Fatal(err)
	}
	p2.TakeOver(200 * time.Millisecond)
	ctx2, cancel2 := context.WithCancel(context.Background())
	done2 := make(chan error, 1)
	go func() { done2 <- p2.Run(ctx2, never) }()
	t.Cleanup(func() {
		cancel2()
		if err := <-done2; err != nil {
			t.Error(err)
		}
	})
	eventually(t, "registered after the wait", func() bool { return k2.Registrations() == 1 && k2.Capacity(res) == 8 })
	if n := k2.Allocatable(res); n != 0 {
		t.Fatalf("a plugin never ready reported %d Healthy devices", n)
	}
}
