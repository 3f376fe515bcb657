//go:build integration

package dra

import (
	"context"
	"io"
	"log/slog"
	"path/filepath"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/inpod-dev/inpod/e2e/cluster"
	"github.com/inpod-dev/inpod/internal/benchreport"
	"github.com/inpod-dev/inpod/internal/testkit"
	"github.com/inpod-dev/inpod/readiness"
	ztunnel "github.com/inpod-dev/inpod/zds/zdstest"
)

// BenchmarkIntegrationDRAGateFlip measures what the scheduler waits for in
// DRA mode: from ztunnel disconnecting (and reconnecting) to the node's
// ResourceSlice tainted (untainted) in a real API server, seen through a
// watch as the scheduler sees it. The pieces are the real ones: ZDS server
// and stand-in over a socket, the readiness aggregate, the gate with its
// kubeletplugin helper, the agent's RBAC. The device-plugin gate's window to
// the scheduler is the kubelet's node-status sync (up to 10 s), which
// BenchmarkGateFlip in deviceplugin/ does not include.
func BenchmarkIntegrationDRAGateFlip(b *testing.B) {
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	cp, err := cluster.StartControlPlane(ctx, cluster.Config{Root: filepath.Join(b.TempDir(), "cp")})
	if err != nil {
		b.Fatal(err)
	}
	defer cp.Stop()
	if _, err := cp.Client.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: nodeName}}, metav1.CreateOptions{}); err != nil {
		b.Fatal(err)
	}
	dir := testkit.ShortTempDir(b, "drab-")

	ready := readiness.New(log, readiness.ZtunnelConnected)
	ztunnel.ServeNoPods(b, filepath.Join(dir, "zt.sock"), ready, log)
	// The gate's own client, as in the agent: its rate limiter is not the
	// test's.
	gateClient, err := kubernetes.NewForConfig(rest.CopyConfig(cp.Rest))
	if err != nil {
		b.Fatal(err)
	}
	d, err := New(Config{Client: gateClient, NodeName: nodeName, RegistrarDir: filepath.Join(dir, "reg"), PluginDir: filepath.Join(dir, "plugin"), Logger: log})
	if err != nil {
		b.Fatal(err)
	}
	go d.Run(ctx, ready)
	connect := func() (stop func()) {
		z := ztunnel.New(ztunnel.Config{SocketPath: filepath.Join(dir, "zt.sock"), Logger: log, MinBackoff: time.Millisecond})
		zctx, zcancel := context.WithCancel(ctx)
		done := make(chan struct{})
		go func() { z.Run(zctx); close(done) }()
		return func() { zcancel(); <-done }
	}
	// Waits, through a watch opened before the change, for the slice to
	// carry (or not) a taint; returns when the event arrived.
	watchFrom := func() watch.Interface {
		l, err := cp.Client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{})
		if err != nil {
			b.Fatal(err)
		}
		w, err := cp.Client.ResourceV1().ResourceSlices().Watch(ctx, metav1.ListOptions{ResourceVersion: l.ResourceVersion})
		if err != nil {
			b.Fatal(err)
		}
		return w
	}
	until := func(w watch.Interface, tainted bool) time.Time {
		defer w.Stop()
		deadline := time.After(30 * time.Second)
		for {
			select {
			case ev := <-w.ResultChan():
				s, ok := ev.Object.(*resourceapi.ResourceSlice)
				if ok && len(s.Spec.Devices) == 1 && (len(s.Spec.Devices[0].Taints) > 0) == tainted {
					return time.Now()
				}
			case <-deadline:
				b.Fatalf("the slice never became tainted=%v", tainted)
			}
		}
	}
	w := watchFrom()
	stopZ := connect()
	until(w, false)

	var down, up []time.Duration
	b.ResetTimer()
	for range b.N {
		// Pacing, not synchronisation: the gate's client allows 5
		// requests/s (burst 10), so back-to-back flips would measure
		// client-go's limiter (200 ms each once the burst is spent), not
		// the window of a readiness change.
		time.Sleep(300 * time.Millisecond)
		w := watchFrom()
		start := time.Now()
		stopZ()
		down = append(down, until(w, true).Sub(start))
		time.Sleep(300 * time.Millisecond)
		w = watchFrom()
		start = time.Now()
		stopZ = connect()
		up = append(up, until(w, false).Sub(start))
	}
	b.StopTimer()
	stopZ()
	report := func(metric, name string, ds []time.Duration) {
		p50, p99 := benchreport.Percentile(ds, 50), benchreport.Percentile(ds, 99)
		b.ReportMetric(benchreport.Ms(p50), metric+"-p50-ms")
		b.ReportMetric(benchreport.Ms(p99), metric+"-p99-ms")
		benchreport.Record(b, benchreport.Figure{Section: benchreport.SchedulerSeesSection, Name: name + ", p50", Value: benchreport.Ms(p50), Unit: "ms", Target: "< 1 s p99"})
		benchreport.Record(b, benchreport.Figure{Section: benchreport.SchedulerSeesSection, Name: name + ", p99", Value: benchreport.Ms(p99), Unit: "ms", Target: "< 1 s"})
	}
	report("ztunnel-disconnect→slice-tainted", "DRA gate: ztunnel stops → device taint in the API (watch)", down)
	report("ztunnel-reconnect→slice-untainted", "DRA gate: ztunnel back → device taint gone from the API (watch)", up)
}
