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

func TestAllocateOnlyWhileReady(t *testing.T) {
	dir := t.TempDir()
	k := startKubelet(t, dir)
	ready := newReady()
	startPlugin(t, dir, ready, nil)
	eventually(t, "registration", func() bool { return k.Capacity(res) == 8 })
	ctx := context.Background()
	if _, err := k.Allocate(ctx, res, 1); err == nil || !strings.Contains(err.Error(), "not ready") {
		t.Fatalf("Allocate while not ready = %v", err)
	}
	ready.Set("test", true, "")
	eventually(t, "healthy", func() bool { return k.Allocatable(res) == 8 })
	resp, err := k.Allocate(ctx, res, 1)
	if err != nil {
		t.Fatal(err)
	}
	c := resp.ContainerResponses[0]
	if c.Envs[deviceplugin.GatedEnv] != "true" || c.Annotations[deviceplugin.GatedAnnotation] != "true" {
		t.Fatalf("allocation %+v lacks the gated marker", c)
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
