//go:build integration

package scale

import (
	"context"
	"fmt"
	"os"
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
	"github.com/inpod-dev/inpod/nodecondition"
)

// BenchmarkIntegrationScaleTaintController runs two replicas of the real
// inpod-controller (continuous mode, production leader election and client
// limits) over INPOD_SCALE_TAINT_NODES simulated nodes (default 5,000),
// each with a Ready agent pod and the startup taint from its registration:
//   - every node's condition turns True at once: per node, its condition
//     write → its taint seen removed, beside the same write seen by a
//     watch (one write→watch trip, the floor);
//   - its RSS, beside the standby replica's (same binary, elected
//     nothing, no informers);
//   - its Node writes over a steady minute (must be 0);
//   - leader failover: the leader is SIGKILLed (the Lease must expire) and
//     later the new leader stopped with SIGTERM (it releases the Lease):
//     from the end of the leader to the first of 10 % of the nodes, whose
//     condition turned False meanwhile, tainted by the successor.
func BenchmarkIntegrationScaleTaintController(b *testing.B) {
	n := sizeFromEnv(b, "INPOD_SCALE_TAINT_NODES", 5000)
	bin := controllerBinary(b)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	w := newWorld(b, taintGate)
	w.addNodes(b, n)
	w.addAgentPods(b)
	seen := w.track(ctx, b)
	conditionTrue := w.watchConditions(ctx)

	replicas := map[string]*cluster.Component{"a": w.startController(b, bin, "a")}
	leader := w.waitLeader(ctx, b, "")
	replicas["b"] = w.startController(b, bin, "b")
	standby := map[string]string{"a": "b", "b": "a"}[leader]

	// Every node still carries its startup taint: an untaint before the
	// burst would read as a latency of 0.
	seen.waitAll(b, w.nodes, true, time.Minute)
	seen.forget(w.nodes)

	// The burst: every condition True at once.
	start := time.Now()
	written := w.setReady(b, w.nodes, true)
	burst := time.Since(start)
	openAt := seen.waitAll(b, w.nodes, false, 10*time.Minute)
	var untaint, floor []time.Duration
	var last time.Time
	for i, node := range w.nodes {
		untaint = append(untaint, max(0, openAt[node].Sub(written[i])))
		if c, ok := conditionTrue.at(node); ok {
			floor = append(floor, max(0, c.Sub(written[i])))
		}
		if openAt[node].After(last) {
			last = openAt[node]
		}
	}
	b.Logf("%d conditions True (written in %s): taint removed p50 %s, p99 %s, every taint gone %s after the first write; a watch saw the writes p50 %s, p99 %s",
		n, burst.Round(time.Millisecond), benchreport.Percentile(untaint, 50).Round(time.Millisecond), benchreport.Percentile(untaint, 99).Round(time.Millisecond),
		last.Sub(start).Round(time.Millisecond), benchreport.Percentile(floor, 50).Round(time.Millisecond), benchreport.Percentile(floor, 99).Round(time.Millisecond))

	// Steady state: nothing changes for a minute. Counted by the Nodes'
	// resourceVersions, which any write changes, so events of the burst
	// still queued in an informer cannot count.
	before := w.nodeVersions(ctx, b)
	steady := time.Minute
	time.Sleep(steady) // measuring over a fixed interval is the point
	steadyWrites := 0
	for name, rv := range w.nodeVersions(ctx, b) {
		if before[name] != rv {
			steadyWrites++
		}
	}
	leaderRSS, leaderPeak, err := rss(replicas[leader].PID())
	if err != nil {
		b.Fatal(err)
	}
	standbyRSS, _, err := rss(replicas[standby].PID())
	if err != nil {
		b.Fatal(err)
	}
	b.Logf("steady minute: %d Nodes written; leader RSS %.1f MiB (peak %.1f), standby %.1f MiB", steadyWrites, leaderRSS, leaderPeak, standbyRSS)
	if steadyWrites != 0 {
		b.Errorf("%d Nodes written in a steady minute, want 0", steadyWrites)
	}

	// Failover, twice: the leader killed, then the successor stopped.
	flips := max(1, n/10)
	var failover []struct {
		how     string
		elapsed time.Duration
	}
	var flipped []string
	for i := 0; i < flips; i++ {
		flipped = append(flipped, w.nodes[i*n/flips])
	}
	for round, how := range []string{"SIGKILL (Lease expires)", "SIGTERM (Lease released)"} {
		old := leader
		seen.forget(flipped)
		ended := time.Now()
		if round == 0 {
			replicas[old].Kill()
		} else {
			replicas[old].Stop(30 * time.Second)
		}
		delete(replicas, old)
		// The first round's nodes turn not ready (the successor taints
		// them), the second's ready again (it removes the taints).
		closed := round == 0
		w.setReady(b, flipped, !closed)
		at := seen.waitAll(b, flipped, closed, 2*time.Minute)
		first := time.Time{}
		for _, t := range at {
			if first.IsZero() || t.Before(first) {
				first = t
			}
		}
		leader = w.waitLeader(ctx, b, old)
		failover = append(failover, struct {
			how     string
			elapsed time.Duration
		}{how, first.Sub(ended)})
		b.Logf("failover by %s: %s from the old leader's end to the first of %d nodes acted on by %s", how, first.Sub(ended).Round(time.Millisecond), flips, leader)
		if round == 0 {
			// A standby again, for the graceful round.
			replicas[old] = w.startController(b, bin, old)
		}
	}

	sec := benchreport.ScaleTaintSection
	what := fmt.Sprintf("taint controller, %d nodes", n)
	if qps := os.Getenv("INPOD_SCALE_CONTROLLER_QPS"); qps != "" {
		what += ", --kube-api-qps " + qps
	}
	floorName := "the same condition writes seen by a watch (one write→watch trip)"
	benchreport.Record(b, benchreport.Figure{Section: sec, Name: what + ": every condition True at once → taint removed, p50",
		Value: benchreport.Ms(benchreport.Percentile(untaint, 50)), Unit: "ms", FloorName: floorName + ", p50", Floor: benchreport.Ms(benchreport.Percentile(floor, 50)), Target: "measured"})
	benchreport.Record(b, benchreport.Figure{Section: sec, Name: what + ": every condition True at once → taint removed, p99",
		Value: benchreport.Ms(benchreport.Percentile(untaint, 99)), Unit: "ms", FloorName: floorName + ", p99", Floor: benchreport.Ms(benchreport.Percentile(floor, 99)), Target: "measured"})
	benchreport.Record(b, benchreport.Figure{Section: sec, Name: what + ": leader's RSS after the burst and a steady minute",
		Value: leaderRSS, Unit: "MiB", FloorName: "the standby replica (no informers)", Floor: standbyRSS, Target: "measured"})
	benchreport.Record(b, benchreport.Figure{Section: sec, Name: what + ": Node writes in a steady minute", Value: float64(steadyWrites), Unit: "count", Target: "0"})
	for _, f := range failover {
		benchreport.Record(b, benchreport.Figure{Section: sec, Name: what + ": leader failover by " + f.how + " → first node acted on",
			Value: benchreport.Ms(f.elapsed), Unit: "ms", Target: "measured (Lease duration 15 s)"})
	}
}

// conditionSeen records when a watch first saw each node's condition True.
type conditionSeen struct {
	mu sync.Mutex
	m  map[string]time.Time
}

func (c *conditionSeen) at(node string) (time.Time, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	t, ok := c.m[node]
	return t, ok
}

// watchConditions follows the Nodes: when each condition was first seen
// True.
func (w *world) watchConditions(ctx context.Context) *conditionSeen {
	seen := &conditionSeen{m: map[string]time.Time{}}
	f := informers.NewSharedInformerFactory(w.cs, 0)
	f.Core().V1().Nodes().Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{UpdateFunc: func(_, obj any) {
		n := obj.(*corev1.Node)
		for _, c := range n.Status.Conditions {
			if c.Type == nodecondition.ConditionType && c.Status == corev1.ConditionTrue {
				seen.mu.Lock()
				if _, ok := seen.m[n.Name]; !ok {
					seen.m[n.Name] = time.Now()
				}
				seen.mu.Unlock()
			}
		}
	}})
	f.Start(ctx.Done())
	f.WaitForCacheSync(ctx.Done())
	return seen
}

// nodeVersions is every Node's resourceVersion, read from the API.
func (w *world) nodeVersions(ctx context.Context, b *testing.B) map[string]string {
	b.Helper()
	l, err := w.cs.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
	if err != nil {
		b.Fatal(err)
	}
	out := make(map[string]string, len(l.Items))
	for _, n := range l.Items {
		out[n.Name] = n.ResourceVersion
	}
	return out
}

// waitLeader waits for a Lease holder other than not and returns it.
func (w *world) waitLeader(ctx context.Context, b *testing.B, not string) string {
	b.Helper()
	var holder string
	if err := testkit.Poll(time.Minute, "a controller leading", func() (bool, error) {
		holder = w.leader(ctx)
		return holder != "" && holder != not, nil
	}); err != nil {
		b.Fatal(err)
	}
	return holder
}
