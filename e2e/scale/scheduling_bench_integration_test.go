//go:build integration

package scale

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/tools/cache"

	"github.com/inpod-dev/inpod/e2e/cluster"
	"github.com/inpod-dev/inpod/internal/benchreport"
	"github.com/inpod-dev/inpod/internal/testkit"
)

// BenchmarkIntegrationScaleScheduling measures, per gate and without
// inpod, on a fresh control plane each, in INPOD_SCALE_ROUNDS interleaved
// rounds (default 3; DRA once): (1) the scheduler placing
// INPOD_SCALE_PODS enrolled pods (default 5,000) on INPOD_SCALE_NODES
// simulated nodes (default 1,000), created before the scheduler starts so
// its throughput is its own (pods/s between the first and the last
// binding) and its per-pod algorithm latency (its own histogram,
// scheduler_scheduling_algorithm_duration_seconds); (2) a readiness flip of
// 10 % of the nodes at once: from the not-ready writes to the object the
// scheduler filters on showing it (seen by a watch, as the scheduler's
// informer sees it), then, with a probe pod pinned to each such node and
// refused by the scheduler, from the ready writes to each probe bound.
// Without inpod the flip is a cordon and an uncordon.
func BenchmarkIntegrationScaleScheduling(b *testing.B) {
	nodes := sizeFromEnv(b, "INPOD_SCALE_NODES", 1000)
	benchScheduling(b, nodes, sizeFromEnv(b, "INPOD_SCALE_PODS", 5*nodes), sizeFromEnv(b, "INPOD_SCALE_ROUNDS", 3))
}

// BenchmarkIntegrationScaleSchedulingLarge is the same at
// INPOD_SCALE_LARGE_NODES (default 5,000), the larger size, with as
// many pods (INPOD_SCALE_LARGE_PODS, one a node) in INPOD_SCALE_LARGE_ROUNDS
// (default 1, DRA included: ~15 min on two cores).
func BenchmarkIntegrationScaleSchedulingLarge(b *testing.B) {
	nodes := sizeFromEnv(b, "INPOD_SCALE_LARGE_NODES", 5000)
	benchScheduling(b, nodes, sizeFromEnv(b, "INPOD_SCALE_LARGE_PODS", nodes), sizeFromEnv(b, "INPOD_SCALE_LARGE_ROUNDS", 1))
}

func benchScheduling(b *testing.B, nodes, pods, rounds int) {
	flips := max(1, nodes/10)
	bin := controllerBinary(b)
	runs := map[string][]*schedResult{}
	for round := 1; round <= rounds; round++ {
		for _, g := range []gate{noGate, devicePluginGate, draGate, taintGate} {
			if g.name == draGate.name && round > 1 {
				// Ten times the others' cost: one round says it.
				continue
			}
			b.Run(fmt.Sprintf("%s/round-%d", strings.ReplaceAll(g.name, " ", "-"), round), func(b *testing.B) {
				runs[g.name] = append(runs[g.name], runScheduling(b, g, nodes, pods, flips, bin))
			})
		}
	}
	// On two shared cores one run's throughput moves by a fifth: the
	// gates run interleaved with the floor, and each figure is the median
	// of its rounds (the flips' samples pooled).
	results := map[string]*schedResult{}
	for name, rs := range runs {
		results[name] = merge(rs)
		var each []string
		for _, r := range rs {
			each = append(each, fmt.Sprintf("%.0f", r.podsPerSec))
		}
		b.Logf("%s: pods/s per round %s; median %.0f", name, strings.Join(each, ", "), results[name].podsPerSec)
	}
	floor := results[noGate.name]
	if floor == nil {
		return
	}
	sec := benchreport.ScaleSchedulingSection
	for _, g := range []gate{devicePluginGate, draGate, taintGate} {
		r := results[g.name]
		if r == nil {
			continue
		}
		throughputTarget, stopTarget, resumeTarget := "≥ 0.9× floor", "≤ 1 s", "≤ 1 s"
		if g.name == draGate.name {
			throughputTarget = "measured"
		}
		if g.name == devicePluginGate.name {
			// Closing is the agent's own write; opening waits for the
			// kubelet's node-status sync first, which no simulated node has.
			stopTarget, resumeTarget = "measured", "measured (+ the kubelet's status sync, ≤ 10 s, on a real node)"
		}
		what := fmt.Sprintf("%s: %d enrolled pods on %d nodes", g.name, pods, nodes)
		benchreport.Record(b, benchreport.Figure{Section: sec, Name: what + ", scheduling throughput", Value: r.podsPerSec, Unit: "pods/s",
			FloorName: "without inpod", Floor: floor.podsPerSec, Target: throughputTarget})
		benchreport.Record(b, benchreport.Figure{Section: sec, Name: what + ", scheduling algorithm per pod (filters, scores), mean", Value: benchreport.Ms(r.algorithmMean), Unit: "ms",
			FloorName: "without inpod", Floor: benchreport.Ms(floor.algorithmMean), Target: "measured"})
		benchreport.Record(b, benchreport.Figure{Section: sec, Name: what + ", scheduling algorithm per pod (filters, scores), p99 (in the scheduler's buckets)", Value: benchreport.Ms(r.algorithmP99), Unit: "ms",
			FloorName: "without inpod", Floor: benchreport.Ms(floor.algorithmP99), Target: "measured"})
		flip := fmt.Sprintf("%s: %d of %d nodes turn not ready at once", g.name, flips, nodes)
		benchreport.Record(b, benchreport.Figure{Section: sec, Name: flip + ", not-ready write → closed to the scheduler, p99",
			Value: benchreport.Ms(benchreport.Percentile(r.stop, 99)), Unit: "ms",
			FloorName: "without inpod: cordon → seen", Floor: benchreport.Ms(benchreport.Percentile(floor.stop, 99)), Target: stopTarget})
		benchreport.Record(b, benchreport.Figure{Section: sec, Name: flip + " and back, ready write → pending pod placed there, p50",
			Value: benchreport.Ms(benchreport.Percentile(r.resume, 50)), Unit: "ms",
			FloorName: "without inpod: uncordon → placed", Floor: benchreport.Ms(benchreport.Percentile(floor.resume, 50)), Target: "measured"})
		benchreport.Record(b, benchreport.Figure{Section: sec, Name: flip + " and back, ready write → pending pod placed there, p99",
			Value: benchreport.Ms(benchreport.Percentile(r.resume, 99)), Unit: "ms",
			FloorName: "without inpod: uncordon → placed", Floor: benchreport.Ms(benchreport.Percentile(floor.resume, 99)), Target: resumeTarget})
	}
}

type schedResult struct {
	podsPerSec float64
	// algorithmMean/P99: the scheduler's filters and scores per pod.
	algorithmMean, algorithmP99 time.Duration
	// stop: per flipped node, its not-ready write → the scheduler's
	// object showing it closed; resume: its ready write → its probe pod
	// bound.
	stop, resume []time.Duration
}

// merge is the median round's throughput and algorithm times, and every
// round's flip samples.
func merge(rs []*schedResult) *schedResult {
	median := func(f func(*schedResult) float64) float64 {
		vs := make([]float64, len(rs))
		for i, r := range rs {
			vs[i] = f(r)
		}
		slices.Sort(vs)
		return vs[len(vs)/2]
	}
	out := &schedResult{
		podsPerSec:    median(func(r *schedResult) float64 { return r.podsPerSec }),
		algorithmMean: time.Duration(median(func(r *schedResult) float64 { return float64(r.algorithmMean) })),
		algorithmP99:  time.Duration(median(func(r *schedResult) float64 { return float64(r.algorithmP99) })),
	}
	for _, r := range rs {
		out.stop = append(out.stop, r.stop...)
		out.resume = append(out.resume, r.resume...)
	}
	return out
}

func runScheduling(b *testing.B, g gate, nodes, pods, flips int, controllerBin string) *schedResult {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	w := newWorld(b, g)
	g.install(b, w)
	w.addNodes(b, nodes)
	seen := w.track(ctx, b)
	w.setReady(b, w.nodes, true)
	if g.name == taintGate.name {
		w.addAgentPods(b)
		w.startController(b, controllerBin, "a")
	}
	seen.waitAll(b, w.nodes, false, 5*time.Minute)

	all := make([]*corev1.Pod, pods)
	for i := range all {
		all[i] = w.enrolledPod(fmt.Sprintf("pod-%05d", i), "")
	}
	start := time.Now()
	w.createPods(b, all)
	b.Logf("%s: %d pending pods created in %s", g.name, pods, time.Since(start).Round(time.Millisecond))

	sched, err := w.cp.StartScheduler(ctx, cluster.SchedulerConfig{QPS: 5000, Burst: 10000})
	if err != nil {
		b.Fatal(err)
	}
	schedStart := time.Now()
	profile := w.profileScheduler(ctx, b, sched, g.name)
	defer func() { cancel(); <-profile }()
	binds := seen.waitBound(b, podNames(all), 15*time.Minute)
	<-profile
	slices.SortFunc(binds, func(x, y time.Time) int { return x.Compare(y) })
	r := &schedResult{podsPerSec: float64(len(binds)-1) / binds[len(binds)-1].Sub(binds[0]).Seconds()}
	metrics := w.scrape(ctx, b, sched.MetricsURL)
	// The algorithm (filters and scores) is the scheduler's own work per
	// pod; an attempt adds the binding, an API call, whose latency in a
	// burst of thousands is the apiserver's queue on two cores.
	algorithm := parseHistogram(metrics, "scheduler_scheduling_algorithm_duration_seconds")
	attempts := parseHistogram(metrics, "scheduler_scheduling_attempt_duration_seconds", `result="scheduled"`)
	r.algorithmMean, r.algorithmP99 = parseMean(metrics, "scheduler_scheduling_algorithm_duration_seconds"), algorithm.quantile(0.99)
	b.Logf("%s: %d pods bound in %s from the scheduler's start (%s from the first binding): %.0f pods/s; scheduling algorithm mean %s, p99 %s (%v runs, p99 interpolated in the scheduler's buckets); attempt with binding p50 %s, p99 %s",
		g.name, len(binds), binds[len(binds)-1].Sub(schedStart).Round(time.Millisecond), binds[len(binds)-1].Sub(binds[0]).Round(time.Millisecond),
		r.podsPerSec, r.algorithmMean.Round(time.Microsecond), r.algorithmP99.Round(time.Microsecond), algorithm.count(),
		attempts.quantile(0.5).Round(time.Microsecond), attempts.quantile(0.99).Round(time.Microsecond))
	if g.request {
		claims, err := w.cs.ResourceV1().ResourceClaims(benchNS).List(ctx, metav1.ListOptions{})
		if err != nil {
			b.Fatal(err)
		}
		b.Logf("%s: %d ResourceClaims (the scheduler makes one per pod given the resource through DRA)", g.name, len(claims.Items))
	}

	// The flip: every tenth node, so the flipped nodes are spread over
	// the scheduler's node list as a failing rack would not be.
	var flipped []string
	for i := 0; i < flips; i++ {
		flipped = append(flipped, w.nodes[i*len(w.nodes)/flips])
	}
	seen.forget(flipped)
	written := w.setReady(b, flipped, false)
	closedAt := seen.waitAll(b, flipped, true, 2*time.Minute)
	for i, n := range flipped {
		r.stop = append(r.stop, max(0, closedAt[n].Sub(written[i])))
	}
	probes := make([]*corev1.Pod, len(flipped))
	for i, n := range flipped {
		probes[i] = w.enrolledPod("probe-"+n, n)
	}
	w.createPods(b, probes)
	// Each probe must be tried and refused before the ready writes: a
	// probe bound to a closed node is a gate that did not close.
	if err := testkit.Poll(2*time.Minute, "every probe pod refused by the scheduler", func() (bool, error) {
		l, err := w.cs.CoreV1().Pods(benchNS).List(ctx, metav1.ListOptions{LabelSelector: "app=bench"})
		if err != nil {
			return false, err
		}
		refused := 0
		for _, p := range l.Items {
			if !strings.HasPrefix(p.Name, "probe-") {
				continue
			}
			if p.Spec.NodeName != "" {
				return false, fmt.Errorf("probe %s bound to %s while the node is not ready", p.Name, p.Spec.NodeName)
			}
			for _, c := range p.Status.Conditions {
				if c.Type == corev1.PodScheduled && c.Status == corev1.ConditionFalse && c.Reason == corev1.PodReasonUnschedulable {
					refused++
				}
			}
		}
		return refused == len(probes), nil
	}); err != nil {
		b.Fatal(err)
	}
	written = w.setReady(b, flipped, true)
	bound := seen.waitBound(b, podNames(probes), 2*time.Minute)
	for i := range flipped {
		r.resume = append(r.resume, max(0, bound[i].Sub(written[i])))
	}
	// The first probe placed shows the signal's own latency; the rest, the
	// scheduler placing a hundred pods at once at its per-pod cost.
	b.Logf("%s: %d nodes not ready: write → closed p50 %s p99 %s; back ready: write → probe bound first %s, p50 %s, p99 %s",
		g.name, len(flipped), benchreport.Percentile(r.stop, 50).Round(time.Millisecond), benchreport.Percentile(r.stop, 99).Round(time.Millisecond),
		slices.Min(r.resume).Round(time.Millisecond), benchreport.Percentile(r.resume, 50).Round(time.Millisecond), benchreport.Percentile(r.resume, 99).Round(time.Millisecond))
	return r
}

func podNames(pods []*corev1.Pod) []string {
	out := make([]string, len(pods))
	for i, p := range pods {
		out[i] = p.Name
	}
	return out
}

// tracker follows, through informers, what the scheduler's informers
// see: per node whether the gate keeps it closed (and since when), and
// per pod when it was bound.
type tracker struct {
	w      *world
	mu     sync.Mutex
	closed map[string]bool
	since  map[string]time.Time
	bound  map[string]time.Time
}

func (w *world) track(ctx context.Context, b *testing.B) *tracker {
	t := &tracker{w: w, closed: map[string]bool{}, since: map[string]time.Time{}, bound: map[string]time.Time{}}
	f := informers.NewSharedInformerFactory(w.cs, 0)
	gateObject := func(obj any) {
		if node, isClosed, ok := w.gate.closed(obj); ok {
			t.mu.Lock()
			if prev, has := t.closed[node]; !has || prev != isClosed {
				t.closed[node], t.since[node] = isClosed, time.Now()
			}
			t.mu.Unlock()
		}
	}
	handler := cache.ResourceEventHandlerFuncs{AddFunc: gateObject, UpdateFunc: func(_, obj any) { gateObject(obj) }}
	f.Core().V1().Nodes().Informer().AddEventHandler(handler)
	if w.gate.name == draGate.name {
		f.Resource().V1().ResourceSlices().Informer().AddEventHandler(handler)
	}
	podSeen := func(obj any) {
		p, ok := obj.(*corev1.Pod)
		if !ok || p.Namespace != benchNS || p.Spec.NodeName == "" {
			return
		}
		t.mu.Lock()
		if _, has := t.bound[p.Name]; !has {
			t.bound[p.Name] = time.Now()
		}
		t.mu.Unlock()
	}
	f.Core().V1().Pods().Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{AddFunc: podSeen, UpdateFunc: func(_, obj any) { podSeen(obj) }})
	f.Start(ctx.Done())
	f.WaitForCacheSync(ctx.Done())
	return t
}

// forget drops what is known of the nodes' state, so waitAll measures the
// next change.
func (t *tracker) forget(nodes []string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, n := range nodes {
		delete(t.since, n)
	}
}

// waitAll waits until every node is seen closed (or open) and returns
// since when, per node.
func (t *tracker) waitAll(b *testing.B, nodes []string, closed bool, timeout time.Duration) map[string]time.Time {
	b.Helper()
	out := map[string]time.Time{}
	if err := testkit.Poll(timeout, fmt.Sprintf("%d nodes seen closed=%t", len(nodes), closed), func() (bool, error) {
		t.mu.Lock()
		defer t.mu.Unlock()
		for _, n := range nodes {
			at, known := t.since[n]
			if !known || t.closed[n] != closed {
				return false, nil
			}
			out[n] = at
		}
		return true, nil
	}); err != nil {
		b.Fatal(err)
	}
	return out
}

// waitBound waits until every pod is bound and returns, in the pods'
// order, when each was seen bound.
func (t *tracker) waitBound(b *testing.B, pods []string, timeout time.Duration) []time.Time {
	b.Helper()
	out := make([]time.Time, len(pods))
	if err := testkit.Poll(timeout, fmt.Sprintf("%d pods bound", len(pods)), func() (bool, error) {
		t.mu.Lock()
		defer t.mu.Unlock()
		for i, p := range pods {
			at, ok := t.bound[p]
			if !ok {
				return false, nil
			}
			out[i] = at
		}
		return true, nil
	}); err != nil {
		b.Fatal(err)
	}
	return out
}

// scrape reads a component's /metrics.
func (w *world) scrape(ctx context.Context, b *testing.B, url string) string {
	b.Helper()
	client, err := w.cp.ComponentHTTPClient()
	if err != nil {
		b.Fatal(err)
	}
	req, err := newRequest(ctx, url)
	if err != nil {
		b.Fatal(err)
	}
	resp, err := client.Do(req)
	if err != nil {
		b.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != 200 {
		b.Fatalf("%s: %d %v", url, resp.StatusCode, err)
	}
	return string(body)
}

// profileScheduler takes a 5 s CPU profile of the scheduler while it
// works and logs where its time goes (pprof -top), so a gate's cost is
// explained, not only measured. The channel closes when it is done.
func (w *world) profileScheduler(ctx context.Context, b *testing.B, s *cluster.Scheduler, name string) <-chan struct{} {
	done := make(chan struct{})
	go func() {
		defer close(done)
		client, err := w.cp.ComponentHTTPClient()
		if err != nil {
			b.Log(err)
			return
		}
		req, err := newRequest(ctx, strings.TrimSuffix(s.MetricsURL, "/metrics")+"/debug/pprof/profile?seconds=5")
		if err != nil {
			b.Log(err)
			return
		}
		resp, err := client.Do(req)
		if err != nil {
			b.Logf("%s: scheduler profile: %v", name, err)
			return
		}
		defer resp.Body.Close()
		path := filepath.Join(b.TempDir(), "scheduler.pprof")
		f, err := os.Create(path)
		if err != nil {
			b.Log(err)
			return
		}
		_, err = io.Copy(f, resp.Body)
		f.Close()
		if err != nil || resp.StatusCode != 200 {
			b.Logf("%s: scheduler profile: %d %v", name, resp.StatusCode, err)
			return
		}
		if dir := os.Getenv("INPOD_SCALE_PROFILE_DIR"); dir != "" {
			os.MkdirAll(dir, 0o755)
			data, _ := os.ReadFile(path)
			os.WriteFile(filepath.Join(dir, strings.ReplaceAll(name, " ", "-")+".pprof"), data, 0o644)
		}
		out, err := exec.Command("go", "tool", "pprof", "-top", "-cum", "-nodecount=25", path).CombinedOutput()
		if err != nil {
			b.Logf("%s: pprof: %v", name, err)
		}
		b.Logf("%s: where the scheduler's CPU goes while it places the pods (5 s profile, cumulative):\n%s", name, out)
	}()
	return done
}
