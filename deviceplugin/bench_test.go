package deviceplugin_test

import (
	"context"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/inpod-dev/inpod/agent/cniinstall"
	"github.com/inpod-dev/inpod/deviceplugin"
	"github.com/inpod-dev/inpod/deviceplugin/kubelettest"
	"github.com/inpod-dev/inpod/internal/benchreport"
	"github.com/inpod-dev/inpod/readiness"
	ztunnel "github.com/inpod-dev/inpod/zds/zdstest"
)

// waitReceived waits for the kubelet stand-in to receive, at or after since,
// an update with allocatable devices; the time measured ends when it
// arrived.
func waitReceived(b *testing.B, k *kubelettest.Kubelet, since time.Time, allocatable int, what string) kubelettest.Update {
	u, ok := received(k, since, allocatable, 10*time.Second)
	if !ok {
		b.Fatalf("%s: the kubelet never received allocatable %d", what, allocatable)
	}
	return u
}

func received(k *kubelettest.Kubelet, since time.Time, allocatable int, within time.Duration) (kubelettest.Update, bool) {
	deadline := time.After(within)
	for {
		if u, ok := k.FirstSince(deviceplugin.DefaultResourceName, since, allocatable); ok {
			return u, true
		}
		select {
		case <-k.Updates():
		case <-deadline:
			return kubelettest.Update{}, false
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
	ztunnel.ServeNoPods(b, filepath.Join(dir, "zt.sock"), ready, log)

	confDir := filepath.Join(dir, "net.d")
	os.MkdirAll(confDir, 0o755)
	original := []byte(`{"cniVersion":"1.0.0","name":"n","plugins":[{"type":"bridge"}]}`)
	os.WriteFile(filepath.Join(confDir, "10-n.conflist"), original, 0o644)
	image := filepath.Join(dir, "image")
	os.MkdirAll(image, 0o755)
	for _, name := range []string{"inpod-cni", "inpod-cni-apicheck"} {
		os.WriteFile(filepath.Join(image, name), []byte("binary"), 0o755)
	}
	repaired := make(chan time.Time, 1)
	inst, err := cniinstall.New(cniinstall.Config{SourceDir: image, BinDir: filepath.Join(dir, "bin"), ConfDir: confDir,
		StateDir: filepath.Join(dir, "state"), MaxRepairsPerMinute: 1 << 20, Logger: log,
		OnChange: func(ok bool, reason string) {
			// Stamped before readiness changes: the update it causes
			// arrives after this.
			at := time.Now()
			ready.Set(readiness.CNIInstalled, ok, reason)
			if ok {
				select {
				case repaired <- at:
				default:
				}
			}
		}})
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
	dp, err := deviceplugin.New(deviceplugin.Config{PluginDir: pluginDir, Devices: 8, Logger: log})
	if err != nil {
		b.Fatal(err)
	}
	go dp.Run(ctx, ready)

	connect := func() (stop func()) {
		z := ztunnel.New(ztunnel.Config{SocketPath: filepath.Join(dir, "zt.sock"), Logger: log, MinBackoff: time.Millisecond})
		zctx, zcancel := context.WithCancel(ctx)
		done := make(chan struct{})
		go func() { z.Run(zctx); close(done) }()
		return func() { zcancel(); <-done }
	}
	stopZ := connect()
	waitReceived(b, k, time.Time{}, 8, "start")
	<-repaired // the first install

	var zDown, zUp, cniDown, cniUp []time.Duration
	unseen := 0
	b.ResetTimer()
	for range b.N {
		start := time.Now()
		stopZ()
		down := waitReceived(b, k, start, 0, "ztunnel disconnected")
		zDown = append(zDown, down.At.Sub(start))
		start = time.Now()
		stopZ = connect()
		up := waitReceived(b, k, start, 8, "ztunnel reconnected")
		zUp = append(zUp, up.At.Sub(start))

		// Another CNI rewrites its file without inpod; the installer sees
		// it, reports not installed, repairs, reports installed.
		start = time.Now()
		os.WriteFile(filepath.Join(confDir, "10-n.conflist"), original, 0o644)
		var repairedAt time.Time
		select {
		case repairedAt = <-repaired:
		case <-time.After(10 * time.Second):
			b.Fatal("the installer never repaired the clobbered conflist")
		}
		// The device plugin sends the latest health: a repair faster than
		// it can send the unhealthy state in between may reach the kubelet
		// as no change at all. Counted, not timed. The stream is ordered,
		// so once the healthy update that follows the repair is in, an
		// unhealthy one sent before it is too.
		healthy, sent := received(k, repairedAt, 8, 2*time.Second)
		down, seen := k.FirstSince(deviceplugin.DefaultResourceName, start, 0)
		if !sent || !seen || down.At.After(healthy.At) {
			unseen++
			continue
		}
		cniDown = append(cniDown, down.At.Sub(start))
		cniUp = append(cniUp, healthy.At.Sub(start))
	}
	b.StopTimer()
	b.ReportMetric(float64(unseen), "conflist-flips-too-brief-to-send")
	if len(cniDown) == 0 {
		b.Fatal("no conflist flip reached the kubelet")
	}
	stopZ()
	const section = "Gate flip: device plugin (readiness change → ListAndWatch update at the kubelet)"
	report := func(metric, name string, ds []time.Duration, target string) {
		p50, p99 := benchreport.Percentile(ds, 50), benchreport.Percentile(ds, 99)
		b.ReportMetric(benchreport.Ms(p50), metric+"-p50-ms")
		b.ReportMetric(benchreport.Ms(p99), metric+"-p99-ms")
		benchreport.Record(b, benchreport.Figure{Section: section, Name: name + ", p50", Value: benchreport.Ms(p50), Unit: "ms", Target: target})
		benchreport.Record(b, benchreport.Figure{Section: section, Name: name + ", p99", Value: benchreport.Ms(p99), Unit: "ms", Target: target})
	}
	report("ztunnel-disconnect→unhealthy", "ztunnel disconnects → Unhealthy", zDown, "≤ 100 ms")
	report("ztunnel-reconnect→healthy", "ztunnel reconnects → Healthy", zUp, "")
	report("conflist-clobbered→unhealthy", "conflist clobbered by another CNI → Unhealthy", cniDown, "≤ 1 s")
	report("conflist-clobbered→repaired-healthy", "conflist clobbered → repaired, Healthy again", cniUp, "")
	benchreport.Record(b, benchreport.Figure{Section: section, Name: "conflist flips repaired before Unhealthy could be sent (counted, not timed)", Value: float64(unseen), Unit: "count"})
}
