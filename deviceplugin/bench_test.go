package deviceplugin_test

import (
	"context"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/inpod-dev/inpod/agent/cniinstall"
	"github.com/inpod-dev/inpod/agent/readiness"
	"github.com/inpod-dev/inpod/deviceplugin"
	"github.com/inpod-dev/inpod/deviceplugin/kubelettest"
	"github.com/inpod-dev/inpod/e2e/ztunnel"
	"github.com/inpod-dev/inpod/zds"
)

type emptySource struct{}

func (emptySource) Snapshot(context.Context) ([]zds.Workload, error) { return nil, nil }

// waitAllocatable waits on the stand-in's update signal, so the time
// measured ends when the kubelet side received the update.
func waitAllocatable(b *testing.B, k *kubelettest.Kubelet, want int) {
	deadline := time.After(10 * time.Second)
	for k.Allocatable(deviceplugin.DefaultResourceName) != want {
		select {
		case <-k.Updates():
		case <-deadline:
			b.Fatalf("allocatable never became %d", want)
		}
	}
}

// BenchmarkGateFlip measures how fast the kubelet learns that the node
// stopped (and started again) being ready: from a ztunnel disconnect, and
// from another CNI clobbering the conflist, to the ListAndWatch update with
// the devices' new health received by the kubelet stand-in. The pieces are
// the real ones: ZDS server and stand-in over a socket, the CNI installer
// watching a conf dir, the readiness aggregate, the device plugin over gRPC.
func BenchmarkGateFlip(b *testing.B) {
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	dir, err := os.MkdirTemp("", "gate-")
	if err != nil {
		b.Fatal(err)
	}
	defer os.RemoveAll(dir)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()

	ready := readiness.New(log, readiness.CNIInstalled, readiness.ZtunnelConnected)
	srv, err := zds.NewServer(zds.Config{SocketPath: filepath.Join(dir, "zt.sock"), Source: emptySource{}, Logger: log})
	if err != nil {
		b.Fatal(err)
	}
	if err := srv.Listen(); err != nil {
		b.Fatal(err)
	}
	go srv.Serve(ctx)
	go func() {
		states, stop := srv.Subscribe()
		defer stop()
		for {
			select {
			case <-ctx.Done():
				return
			case st := <-states:
				ready.Set(readiness.ZtunnelConnected, st.Ready, "")
			}
		}
	}()

	confDir := filepath.Join(dir, "net.d")
	os.MkdirAll(confDir, 0o755)
	original := []byte(`{"cniVersion":"1.0.0","name":"n","plugins":[{"type":"bridge"}]}`)
	os.WriteFile(filepath.Join(confDir, "10-n.conflist"), original, 0o644)
	image := filepath.Join(dir, "image")
	os.MkdirAll(image, 0o755)
	for _, name := range []string{"inpod-cni", "inpod-cni-apicheck"} {
		os.WriteFile(filepath.Join(image, name), []byte("binary"), 0o755)
	}
	inst, err := cniinstall.New(cniinstall.Config{SourceDir: image, BinDir: filepath.Join(dir, "bin"), ConfDir: confDir,
		StateDir: filepath.Join(dir, "state"), MaxRepairsPerMinute: 1 << 20, Logger: log,
		OnChange: func(ok bool, reason string) { ready.Set(readiness.CNIInstalled, ok, reason) }})
	if err != nil {
		b.Fatal(err)
	}
	go inst.Run(ctx)

	pluginDir := filepath.Join(dir, "dp")
	k, err := kubelettest.Start(pluginDir)
	if err != nil {
		b.Fatal(err)
	}
	defer k.Stop()
	dp, err := deviceplugin.New(deviceplugin.Config{PluginDir: pluginDir, Devices: 8, Ready: ready, Logger: log})
	if err != nil {
		b.Fatal(err)
	}
	go dp.Run(ctx)

	connect := func() (stop func()) {
		z := ztunnel.New(ztunnel.Config{SocketPath: filepath.Join(dir, "zt.sock"), Logger: log, MinBackoff: time.Millisecond})
		zctx, zcancel := context.WithCancel(ctx)
		done := make(chan struct{})
		go func() { z.Run(zctx); close(done) }()
		return func() { zcancel(); <-done }
	}
	stopZ := connect()
	waitAllocatable(b, k, 8)

	var zDown, zUp, cniDown, cniUp []time.Duration
	b.ResetTimer()
	for range b.N {
		start := time.Now()
		stopZ()
		waitAllocatable(b, k, 0)
		zDown = append(zDown, time.Since(start))
		start = time.Now()
		stopZ = connect()
		waitAllocatable(b, k, 8)
		zUp = append(zUp, time.Since(start))

		// Another CNI rewrites its file without inpod; the installer sees
		// it, reports not installed, repairs, reports installed.
		start = time.Now()
		os.WriteFile(filepath.Join(confDir, "10-n.conflist"), original, 0o644)
		waitAllocatable(b, k, 0)
		cniDown = append(cniDown, time.Since(start))
		waitAllocatable(b, k, 8)
		cniUp = append(cniUp, time.Since(start))
	}
	b.StopTimer()
	stopZ()
	report := func(name string, ds []time.Duration) {
		s := slices.Clone(ds)
		slices.Sort(s)
		b.ReportMetric(float64(s[len(s)/2].Microseconds())/1000, name+"-p50-ms")
		b.ReportMetric(float64(s[(len(s)-1)*99/100].Microseconds())/1000, name+"-p99-ms")
	}
	report("ztunnel-disconnect→unhealthy", zDown)
	report("ztunnel-reconnect→healthy", zUp)
	report("conflist-clobbered→unhealthy", cniDown)
	report("conflist-clobbered→repaired-healthy", cniUp)
}
