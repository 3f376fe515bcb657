//go:build e2e

package e2e

import (
	"context"
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes"

	"github.com/inpod-dev/inpod/e2e/chart"
	"github.com/inpod-dev/inpod/e2e/cluster"
	"github.com/inpod-dev/inpod/e2e/images"
	"github.com/inpod-dev/inpod/enrollment"
	"github.com/inpod-dev/inpod/internal/benchreport"
	"github.com/inpod-dev/inpod/internal/testkit"
)

// rolloutSection is the bench report's section for an agent rollout under
// pod churn with gate.
func rolloutSection(gate string) string {
	return fmt.Sprintf("Agent rollout under pod churn (%s gate)", gate)
}

// Pacing of the rollout benchmark: one enrolled pod every streamEvery
// (INPOD_BENCH_STREAM_EVERY, default 1 s), for long enough to cover an
// agent's rollout on the node. The issue asks for one every 200 ms; the
// 2-CPU test node sustains neither that nor one every 500 ms (each pod
// deleted once Ready): without a rollout, create → Ready grew to a median of
// 49–77 s at 500 ms and 96 s at 200 ms, the node full of pods waiting for
// CPU, and the surge agent itself waited for a pod slot ("Too many pods").
// A ratio of two saturated streams measures the node's backlog, not the
// rollout; at a pace the node sustains it measures what the rollout adds.
// A larger node can run the pace with INPOD_BENCH_STREAM_EVERY=200ms.
const (
	streamPods = 150
	// rolloutAfter pods into the stream, helm upgrade starts.
	rolloutAfter = 10
)

func streamEvery(b *testing.B) time.Duration {
	v := os.Getenv("INPOD_BENCH_STREAM_EVERY")
	if v == "" {
		return time.Second
	}
	d, err := time.ParseDuration(v)
	if err != nil || d <= 0 {
		b.Fatalf("INPOD_BENCH_STREAM_EVERY=%q: want a positive duration such as 200ms", v)
	}
	return d
}

// streamResult is what a stream of enrolled pods met.
type streamResult struct {
	ready []time.Duration // create → Ready
	// rejected: pods the kubelet refused (Failed at admission).
	rejected []string
	// failedADDs: the kubelet's FailedCreatePodSandBox events (a CNI ADD
	// failed, and is retried) on the stream's pods.
	failedADDs int
	// unfinished: neither Ready nor Failed by the deadline.
	unfinished int
	// warnings counts the kubelet's Warning events on the stream's pods by
	// reason, with one message each: where a pod waited beyond its start.
	warnings      map[string]int
	warningSample map[string]string
	// readyAt is each Ready pod's time from the stream's start, for the
	// timeline that shows when the node stalled.
	readyAt []time.Duration
	// slowest is each 10 s of the stream's creations' longest create →
	// Ready, so a slowdown shows where it began and whether it lasted.
	slowest []time.Duration
	start   time.Time
}

// benchRollout measures what an agent rollout does to enrolled pods being
// created on the node, one every streamEvery: a stream with no rollout,
// one while helm upgrade rolls the agent's DaemonSet (a changed pod
// annotation: the same rollout as a new image, without a registry), and
// one with no rollout again. Each pod is deleted once Ready, so a stream
// never reaches the node's pod limit.
func benchRollout(ctx context.Context, b *testing.B, c kubernetes.Interface, node *cluster.Node, target chart.Target, repo, tag, gate string, values []string) {
	const ns = "churn"
	ensureNamespace(ctx, b, c, ns, map[string]string{enrollment.DataplaneModeLabel: enrollment.DataplaneAmbient})
	quiet := sandboxCount(b)
	metrics := agentMetrics(ctx, b, node)
	before := metrics()
	steady := podStream(ctx, b, c, ns, "steady", nil)
	// The agent's own part of each ADD (its metrics): the old agent's over
	// the first stream, the new one's over its life (nearly all of the
	// second stream), then over the third.
	b.Logf("no rollout: the agent's CNI ADD, mean %s", metrics().enrollMean(before).Round(100*time.Microsecond))
	// The pods are gone from the API before the kubelet has torn their
	// sandboxes down: the second stream starts on a node as quiet as the
	// first did, or it would be judged on the first one's teardown.
	waitQuiet(ctx, b, quiet)
	upgraded := make(chan time.Duration, 1)
	logs := followAgentLogs(ctx, b, c, gate)
	roll := podStream(ctx, b, c, ns, "rollout", func() {
		// A goroutine of the stream's: it reports with Error, never Fatal,
		// and always sends, so the benchmark does not wait for its timeout.
		start := time.Now()
		defer func() { upgraded <- time.Since(start) }()
		b.Logf("rollout: helm upgrade at %s", start.Format("15:04:05.000"))
		if err := target.Install(ctx, repo, tag, append(values, "--set-string", `agent.podAnnotations.inpod\.dev/bench-rollout=`+start.Format("150405"))...); err != nil {
			b.Error(err)
			return
		}
		if err := waitRolledOut(ctx, c); err != nil {
			b.Error(err)
		}
	})
	took := <-upgraded
	rolled := metrics()
	b.Logf("agent rollout: the new agent's CNI ADD, mean %s", rolled.enrollMean(agentSnapshot{}).Round(100*time.Microsecond))
	b.Logf("rollout: helm upgrade → the new agent pod Ready: %s", took.Round(time.Millisecond))
	for _, l := range logs() {
		b.Logf("the old agent: %s", l)
	}
	for _, l := range agentLogLines(ctx, b, c, handoverLine) {
		b.Logf("the new agent: %s", l)
	}
	// The same stream once more after the rollout. The node drifts over a
	// run (its kernel's and disk's cleanup of the torn-down pods, the API
	// server's growing history): the latency floor is the faster of the
	// two streams without a rollout, the count floors the larger, and a
	// drift beyond the target itself makes the ratio inconclusive.
	waitQuiet(ctx, b, quiet)
	after := podStream(ctx, b, c, ns, "after", nil)
	b.Logf("after the rollout: the new agent's CNI ADD, mean %s", metrics().enrollMean(rolled).Round(100*time.Microsecond))
	for _, r := range []struct {
		name string
		got  streamResult
	}{{"no rollout (before)", steady}, {"agent rollout", roll}, {"no rollout (after)", after}} {
		b.Logf("%s: %d pods Ready, %d rejected %v, %d failed CNI ADDs (FailedCreatePodSandBox events), %d unfinished; create → Ready median %s, p99 %s",
			r.name, len(r.got.ready), len(r.got.rejected), r.got.rejected, r.got.failedADDs, r.got.unfinished,
			quantile(r.got.ready, 0.5).Round(time.Millisecond), quantile(r.got.ready, 0.99).Round(time.Millisecond))
		for reason, n := range r.got.warnings {
			b.Logf("%s: %d %s events, e.g. %q", r.name, n, reason, r.got.warningSample[reason])
		}
		b.Logf("%s: pods Ready per 10 s from the stream's start: %v", r.name, timeline(r.got.readyAt, 10*time.Second))
		b.Logf("%s: the slowest create → Ready of the pods created in each 10 s (-: none Ready): %s", r.name, r.got.slowestByTen())
	}
	section := rolloutSection(gate)
	const countFloor = "without a rollout, the larger of the streams before and after"
	if gate == "dra" {
		benchreport.Record(b, benchreport.Figure{Section: section,
			Name:  fmt.Sprintf("claims refused or unserved (FailedPrepareDynamicResources events) during the rollout, %d pods", streamPods),
			Value: float64(roll.warnings["FailedPrepareDynamicResources"]), Unit: "events", FloorName: countFloor,
			Floor: float64(max(steady.warnings["FailedPrepareDynamicResources"], after.warnings["FailedPrepareDynamicResources"])), Target: "0"})
	}
	benchreport.Record(b, benchreport.Figure{Section: section,
		Name:  fmt.Sprintf("pods rejected by the kubelet (UnexpectedAdmissionError) during the rollout, of %d", streamPods),
		Value: float64(len(roll.rejected)), Unit: "pods", FloorName: countFloor, Floor: float64(max(len(steady.rejected), len(after.rejected))), Target: "0"})
	benchreport.Record(b, benchreport.Figure{Section: section,
		Name:  fmt.Sprintf("failed CNI ADDs (FailedCreatePodSandBox events) during the rollout, %d pods", streamPods),
		Value: float64(roll.failedADDs), Unit: "events", FloorName: countFloor, Floor: float64(max(steady.failedADDs, after.failedADDs)), Target: "0"})
	for _, q := range []struct {
		name string
		q    float64
	}{{"median", 0.5}, {"p99", 0.99}} {
		before, later := quantile(steady.ready, q.q), quantile(after.ready, q.q)
		floor := min(before, later)
		if drift := float64(max(before, later)) / float64(floor); drift > 1.2 {
			b.Logf("%s: the node drifted %.2f× between the streams without a rollout (%s before, %s after): the ratio is inconclusive on this node",
				q.name, drift, before.Round(time.Millisecond), later.Round(time.Millisecond))
		}
		benchreport.Record(b, benchreport.Figure{Section: section,
			Name:  fmt.Sprintf("enrolled pod create → Ready during the rollout, %s (one every %s)", q.name, streamEvery(b)),
			Value: ms(quantile(roll.ready, q.q)), Unit: "ms", FloorName: "the same stream without a rollout, the faster of before and after", Floor: ms(floor),
			Target: "p99 within 1.2× of the stream without a rollout"})
	}
	benchreport.Record(b, benchreport.Figure{Section: section,
		Name: "helm upgrade → the new agent pod Ready", Value: ms(took), Unit: "ms"})
}

// slowestByTen renders slowest, a 10 s bucket with no Ready pod as "-".
func (r streamResult) slowestByTen() string {
	parts := make([]string, len(r.slowest))
	for i, d := range r.slowest {
		parts[i] = "-"
		if d > 0 {
			parts[i] = d.String()
		}
	}
	return "[" + strings.Join(parts, " ") + "]"
}

// podStream creates streamPods enrolled pods in ns, one every streamEvery,
// starting during (when set) in the background after rolloutAfter of
// them, and waits for each to be Ready (then deletes it) or Failed.
func podStream(ctx context.Context, b *testing.B, c kubernetes.Interface, ns, prefix string, during func()) streamResult {
	b.Helper()
	pods := c.CoreV1().Pods(ns)
	sel := "stream=" + prefix
	w, err := pods.Watch(ctx, metav1.ListOptions{LabelSelector: sel})
	if err != nil {
		b.Fatal(err)
	}
	defer w.Stop()
	var (
		mu      sync.Mutex
		created = map[string]time.Time{}
		res     streamResult
		done    = map[string]bool{}
	)
	grace := int64(0)
	finished := make(chan struct{})
	go func() {
		defer close(finished)
		for ev := range w.ResultChan() {
			if ev.Type == watch.Error {
				b.Errorf("%s: the watch ended: %v", prefix, ev.Object)
				return
			}
			p, ok := ev.Object.(*corev1.Pod)
			if !ok {
				continue
			}
			mu.Lock()
			at, known := created[p.Name]
			switch {
			case !known || done[p.Name]:
			case p.Status.Phase == corev1.PodFailed:
				done[p.Name] = true
				res.rejected = append(res.rejected, fmt.Sprintf("%s at +%s: %s: %s", p.Name, time.Since(at).Round(time.Millisecond), p.Status.Reason, p.Status.Message))
			case podReady(p):
				done[p.Name] = true
				took := time.Since(at)
				res.ready = append(res.ready, took)
				res.readyAt = append(res.readyAt, time.Since(res.start))
				i := int(at.Sub(res.start) / (10 * time.Second))
				for len(res.slowest) <= i {
					res.slowest = append(res.slowest, 0)
				}
				res.slowest[i] = max(res.slowest[i], took.Round(10*time.Millisecond))
			}
			finish := done[p.Name]
			all := len(done) == streamPods
			mu.Unlock()
			if finish && p.DeletionTimestamp == nil {
				pods.Delete(ctx, p.Name, metav1.DeleteOptions{GracePeriodSeconds: &grace})
			}
			if all {
				return
			}
		}
	}()
	var bg sync.WaitGroup
	tick := time.NewTicker(streamEvery(b))
	defer tick.Stop()
	mu.Lock()
	res.start = time.Now()
	mu.Unlock()
	for i := range streamPods {
		if i == rolloutAfter && during != nil {
			bg.Go(during)
		}
		name := fmt.Sprintf("%s-%d", prefix, i)
		p := &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{"stream": prefix}},
			Spec: corev1.PodSpec{TerminationGracePeriodSeconds: &grace, Containers: []corev1.Container{{
				Name: "app", Image: images.TestAppRef, ImagePullPolicy: corev1.PullNever, Args: []string{"--listen", ":8080"}}}},
		}
		mu.Lock()
		created[name] = time.Now()
		mu.Unlock()
		if _, err := pods.Create(ctx, p, metav1.CreateOptions{}); err != nil {
			b.Fatal(err)
		}
		<-tick.C
	}
	bg.Wait()
	select {
	case <-finished:
	case <-time.After(5 * time.Minute):
	case <-ctx.Done():
		b.Fatal(ctx.Err())
	}
	// The watcher may still be recording a late pod: it ends once its
	// watch is stopped, and only then is res whole.
	w.Stop()
	<-finished
	res.unfinished = streamPods - len(done)
	events, err := c.CoreV1().Events(ns).List(ctx, metav1.ListOptions{FieldSelector: "reason=FailedCreatePodSandBox"})
	if err != nil {
		b.Fatal(err)
	}
	for _, e := range events.Items {
		if strings.HasPrefix(e.InvolvedObject.Name, prefix+"-") {
			res.failedADDs += int(max(e.Count, 1))
		}
	}
	warnings, err := c.CoreV1().Events(ns).List(ctx, metav1.ListOptions{FieldSelector: "type=Warning"})
	if err != nil {
		b.Fatal(err)
	}
	res.warnings, res.warningSample = map[string]int{}, map[string]string{}
	for _, e := range warnings.Items {
		if strings.HasPrefix(e.InvolvedObject.Name, prefix+"-") {
			res.warnings[e.Reason] += int(max(e.Count, 1))
			res.warningSample[e.Reason] = e.Message
		}
	}
	deletePodsBySelector(ctx, b, c, ns, sel)
	return res
}

// sandboxCount is the number of pod sandboxes on the node: the runtime's
// cni- netns.
func sandboxCount(b *testing.B) int {
	b.Helper()
	entries, err := os.ReadDir("/run/netns")
	if err != nil {
		b.Fatal(err)
	}
	n := 0
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), "cni-") {
			n++
		}
	}
	return n
}

// waitQuiet waits, for at most 3 minutes, until the node runs no more
// sandboxes than it did quiet.
func waitQuiet(ctx context.Context, b *testing.B, quiet int) {
	b.Helper()
	start := time.Now()
	deadline := time.NewTimer(3 * time.Minute)
	defer deadline.Stop()
	for sandboxCount(b) > quiet {
		select {
		case <-deadline.C:
			b.Logf("the node still runs %d sandboxes (%d before the streams); going on", sandboxCount(b), quiet)
			return
		case <-ctx.Done():
			b.Fatal(ctx.Err())
		case <-time.After(time.Second):
		}
	}
	b.Logf("the node's sandboxes torn down %s after the stream's pods left the API", time.Since(start).Round(time.Second))
}

// timeline counts the durations falling in each bucket of width from 0:
// a saturated stream completes pods at the node's pace, so a stall shows as
// a run of low counts.
func timeline(at []time.Duration, width time.Duration) []int {
	var counts []int
	for _, d := range at {
		i := int(d / width)
		for len(counts) <= i {
			counts = append(counts, 0)
		}
		counts[i]++
	}
	return counts
}

// handoverLine picks the agent's log lines that time a hand-over: its
// start, the take-over, the restore, ztunnel and readiness.
func handoverLine(l string) bool {
	for _, s := range []string{"taking over", "took the node over", "restored enrolled pods", "handing the node over", "handed the node over",
		"ztunnel", "ready", "synced", "waiting for the pod and namespace watches", "registered"} {
		if strings.Contains(l, s) {
			return true
		}
	}
	return false
}

// agentLogLines reads the running agent pod's log whole and keeps the
// lines keep selects.
func agentLogLines(ctx context.Context, b *testing.B, c kubernetes.Interface, keep func(string) bool) []string {
	b.Helper()
	pods, err := c.CoreV1().Pods(chart.Namespace).List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/component=agent"})
	if err != nil || len(pods.Items) != 1 {
		b.Logf("the agent pod: %v (%d pods)", err, len(pods.Items))
		return nil
	}
	lines, err := podLogLines(ctx, c, chart.Namespace, pods.Items[0].Name, keep)
	if err != nil {
		b.Logf("the agent's log: %v", err)
	}
	return lines
}

func podReady(p *corev1.Pod) bool {
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady && c.Status == corev1.ConditionTrue {
			return true
		}
	}
	return false
}

// waitRolledOut waits until the agent's DaemonSet has rolled its pod on
// the node and the new one is Ready. It returns an error, as it runs in a
// goroutine of its own.
func waitRolledOut(ctx context.Context, c kubernetes.Interface) error {
	return testkit.Poll(5*time.Minute, "the agent DaemonSet rolled out", func() (bool, error) {
		if err := ctx.Err(); err != nil {
			return false, err
		}
		list, err := c.AppsV1().DaemonSets(chart.Namespace).List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/component=agent"})
		if err != nil || len(list.Items) != 1 {
			return false, nil
		}
		ds := list.Items[0]
		return rolledOut(&ds), nil
	})
}

func rolledOut(ds *appsv1.DaemonSet) bool {
	s := ds.Status
	return s.ObservedGeneration >= ds.Generation && s.DesiredNumberScheduled > 0 &&
		s.UpdatedNumberScheduled == s.DesiredNumberScheduled && s.NumberReady == s.DesiredNumberScheduled &&
		s.NumberUnavailable == 0
}

// deletePodsBySelector deletes what a stream left and waits for it to go.
func deletePodsBySelector(ctx context.Context, b *testing.B, c kubernetes.Interface, ns, sel string) {
	grace := int64(0)
	if err := c.CoreV1().Pods(ns).DeleteCollection(ctx, metav1.DeleteOptions{GracePeriodSeconds: &grace}, metav1.ListOptions{LabelSelector: sel}); err != nil {
		b.Fatal(err)
	}
	testkit.Eventually(b, 3*time.Minute, "the stream's pods gone", func() bool {
		l, err := c.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: sel})
		return err == nil && len(l.Items) == 0
	})
}

// ensureNamespace creates a namespace for a benchmark, or finds it made by
// an earlier one on the same node.
func ensureNamespace(ctx context.Context, b testing.TB, c kubernetes.Interface, name string, labels map[string]string) {
	b.Helper()
	_, err := c.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: labels}}, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		b.Fatal(err)
	}
}

// followAgentLogs follows the running agent pod's log and returns what it
// said so far of component (its gate's lines: an agent going away in a
// rollout takes its log with it).
func followAgentLogs(ctx context.Context, b *testing.B, c kubernetes.Interface, component string) func() []string {
	b.Helper()
	pods, err := c.CoreV1().Pods(chart.Namespace).List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/component=agent"})
	if err != nil || len(pods.Items) != 1 {
		b.Fatalf("the agent pod: %v (%d pods)", err, len(pods.Items))
	}
	return followPodLog(ctx, b, c, chart.Namespace, pods.Items[0].Name, func(l string) bool {
		return strings.Contains(l, `"component":"`+component+`"`) || strings.Contains(l, "allocatable") || handoverLine(l)
	})
}
