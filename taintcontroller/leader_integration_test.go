//go:build integration

package taintcontroller

import (
	"context"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/inpod-dev/inpod/internal/testkit"
	"github.com/inpod-dev/inpod/nodecondition"
	"github.com/inpod-dev/inpod/readiness"
)

func (w *world) leaseHolder(t testing.TB) string {
	t.Helper()
	l, err := w.admin.CoordinationV1().Leases(ns).Get(context.Background(), DefaultLeaseName, metav1.GetOptions{})
	if err != nil || l.Spec.HolderIdentity == nil {
		return ""
	}
	return *l.Spec.HolderIdentity
}

// Two replicas: only the leader writes; when the leader dies (its context
// ends without giving the Lease up, as on SIGKILL) the other takes over
// within the lease duration; when it stops cleanly (SIGTERM) at once.
func TestIntegrationTaintLeaderElection(t *testing.T) {
	const lease = 3 * time.Second
	for _, tc := range []struct {
		name    string
		release bool
		within  time.Duration
	}{
		{"killed", false, lease + time.Second},
		{"stopped", true, time.Second},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := newWorld(t)
			byID := map[string]*running{}
			for _, id := range []string{"one", "two"} {
				byID[id] = w.start(t, Config{Mode: Bootstrap, Identity: id, LeaseDuration: lease,
					RenewDeadline: 2 * time.Second, RetryPeriod: 200 * time.Millisecond, ReleaseOnCancel: tc.release})
			}
			testkit.Eventually(t, 30*time.Second, "a leader", func() bool { return w.leaseHolder(t) != "" })
			leaderID := w.leaseHolder(t)
			leader, follower := byID["one"], byID["two"]
			if leaderID == "two" {
				leader, follower = follower, leader
			}

			w.addNode(t, "a", nil)
			w.addAgentPod(t, "a", true)
			w.setCondition(t, "a", corev1.ConditionTrue)
			w.waitTainted(t, "a", false)
			w.barrier(t, nil)
			if n := follower.writes.nonLease(); n != 0 {
				t.Fatalf("the follower made %d writes besides the Lease while not leading: %v", n, follower.writes.byPath)
			}

			leader.stop()
			// Events are posted by client-go's broadcaster in the
			// background and may land after Run returns; what must not
			// is a write to a Node.
			written := leader.writes.nodeWrites()
			start := time.Now()
			testkit.Eventually(t, 3*lease, "the follower takes over", func() bool { return w.leaseHolder(t) != leaderID && w.leaseHolder(t) != "" })
			took := time.Since(start)
			if took > tc.within {
				t.Fatalf("takeover after %s, want within %s", took, tc.within)
			}
			t.Logf("takeover after %s (lease %s)", took, lease)
			w.addNode(t, "b", nil)
			w.addAgentPod(t, "b", true)
			w.setCondition(t, "b", corev1.ConditionTrue)
			w.waitTainted(t, "b", false)
			// The untaint is visible before its answer is counted; the one
			// worker has that answer once it has handled a later barrier.
			w.barrier(t, nil)
			if follower.writes.accepted("PATCH nodes/b") != 1 {
				t.Fatalf("the new leader patched node b %d times, want 1", follower.writes.accepted("PATCH nodes/b"))
			}
			if got := leader.writes.nodeWrites(); got != written {
				t.Fatalf("the old leader wrote to Nodes %d times after it stopped: %v", got-written, leader.writes.byPath)
			}
		})
	}
}

// The agent's real node-condition gate and the controller, across a
// brief API server stop: readiness turns True while the API is down; once
// it is back the condition converges to True and the taint goes.
func TestIntegrationTaintAcrossAPIServerOutage(t *testing.T) {
	w := newWorld(t)
	w.addNode(t, "a", nil)
	w.addAgentPod(t, "a", true)
	ready := readiness.New(nil, readiness.CNIInstalled, readiness.ZtunnelConnected, readiness.PodsSynced)
	obs := &failures{}
	gate, err := nodecondition.New(nodecondition.Config{Client: w.admin, NodeName: "a", Observer: obs,
		MinBackoff: 50 * time.Millisecond, MaxBackoff: 500 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() { gate.Run(ctx, ready) })
	t.Cleanup(func() { cancel(); wg.Wait() })
	r := w.start(t, Config{Mode: Continuous, Grace: time.Second})
	testkit.Eventually(t, 30*time.Second, "condition False written", func() bool {
		for _, c := range w.node(t, "a").Status.Conditions {
			if c.Type == nodecondition.ConditionType {
				return c.Status == corev1.ConditionFalse
			}
		}
		return false
	})
	w.barrier(t, nil)
	if !w.tainted(t, "a") {
		t.Fatal("untainted while the agent reports False")
	}

	w.cp.StopAPIServer()
	for _, c := range []string{readiness.CNIInstalled, readiness.ZtunnelConnected, readiness.PodsSynced} {
		ready.Set(c, true, "ok")
	}
	testkit.Eventually(t, 30*time.Second, "the gate failing to write True", func() bool { return obs.count() > 0 })
	if err := w.cp.StartAPIServer(context.Background()); err != nil {
		t.Fatal(err)
	}
	w.waitTainted(t, "a", false)
	t.Logf("controller restarts (leadership lost during the outage): %d", r.restarts.Load())
}

type failures struct {
	mu sync.Mutex
	n  int
}

func (f *failures) ConditionWritten(corev1.ConditionStatus) {}
func (f *failures) ConditionWriteFailed() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.n++
}
func (f *failures) count() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.n
}

// /healthz, /readyz and /metrics on one address, as the Deployment probes
// them.
func TestIntegrationTaintHealthAndMetricsEndpoints(t *testing.T) {
	w := newWorld(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	w.start(t, Config{Mode: Bootstrap, HealthAddr: addr, MetricsAddr: addr})
	get := func(path string) (int, string) {
		resp, err := http.Get("http://" + addr + path)
		if err != nil {
			return 0, err.Error()
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(body)
	}
	testkit.Eventually(t, 30*time.Second, "leading with /metrics saying so", func() bool {
		code, body := get("/metrics")
		return code == http.StatusOK && strings.Contains(body, "\ninpod_controller_leader 1\n")
	})
	w.barrier(t, nil)
	for _, p := range []string{"/healthz", "/readyz"} {
		if code, body := get(p); code != http.StatusOK {
			t.Fatalf("%s: %d %s", p, code, body)
		}
	}
	if _, body := get("/metrics"); !strings.Contains(body, "\ninpod_controller_taints_removed_total 1\n") {
		t.Fatalf("/metrics does not count the barrier's removal:\n%s", body)
	}
}

// On SIGTERM the Lease is given up only after the workers have stopped: a
// release while a worker's node write is in flight lets the next leader
// start while this one still writes (two leaders). The test holds the
// leader's write to node a, stops the leader, and watches the Lease.
func TestIntegrationTaintLeaseReleasedAfterWorkersStop(t *testing.T) {
	w := newWorld(t)
	r := w.start(t, Config{Mode: Bootstrap, Identity: "one"})
	testkit.Eventually(t, 30*time.Second, "a leader", func() bool { return w.leaseHolder(t) == "one" })
	entered, gate := make(chan struct{}), make(chan struct{})
	var once sync.Once
	r.writes.setBefore(func(req *http.Request) {
		if req.Method != http.MethodGet && strings.HasSuffix(req.URL.Path, "/nodes/a") {
			once.Do(func() { close(entered) })
			<-gate
		}
	})
	w.addNode(t, "a", nil)
	w.addAgentPod(t, "a", true)
	w.setCondition(t, "a", corev1.ConditionTrue)
	select {
	case <-entered:
	case <-time.After(30 * time.Second):
		t.Fatal("the leader never wrote node a")
	}
	r.cancel()
	// A bounded window to observe a premature release, not a sync.
	if err := testkit.Poll(2*time.Second, "the Lease released", func() (bool, error) { return w.leaseHolder(t) == "", nil }); err == nil {
		close(gate)
		t.Fatal("the Lease was released while a worker's node write was in flight")
	}
	close(gate)
	testkit.Eventually(t, 10*time.Second, "the Lease released once the workers stopped", func() bool { return w.leaseHolder(t) == "" })
	<-r.done
}

// A leader whose caches never sync (here: its node list and watch never answer)
// gives the Lease up and Run fails, rather than holding the Lease while
// removing no taint.
func TestIntegrationTaintLeaderGivesUpWhenCachesNeverSync(t *testing.T) {
	w := newWorld(t)
	stuck := make(chan struct{})
	t.Cleanup(func() { close(stuck) })
	wr := &writes{}
	wr.setBefore(func(req *http.Request) {
		// List and watch both: the informer may list through a watch
		// (sendInitialEvents).
		if req.Method == http.MethodGet && strings.HasSuffix(req.URL.Path, "/api/v1/nodes") {
			select {
			case <-req.Context().Done():
			case <-stuck:
			}
		}
	})
	c, err := New(Config{Client: w.controllerClient(t, wr), Mode: Bootstrap, Identity: "stuck", AgentNamespace: ns, Workers: 1,
		LeaseDuration: 2 * time.Second, RenewDeadline: 1500 * time.Millisecond, RetryPeriod: 200 * time.Millisecond,
		ReleaseOnCancel: true, CacheSyncTimeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	defer func() {
		cancel()
		<-done
	}()
	select {
	case err := <-done:
		done <- err // for the deferred wait
		if err == nil || !strings.Contains(err.Error(), "not synced") {
			t.Fatalf("Run: %v, want the caches not synced", err)
		}
		t.Logf("Run: %v", err)
	case <-time.After(15 * time.Second):
		t.Fatalf("a leader with caches that never sync still leads after 15 s (Lease holder %q)", w.leaseHolder(t))
	}
	if h := w.leaseHolder(t); h == "stuck" {
		t.Fatalf("the Lease is still held by the leader that gave up")
	}
}
