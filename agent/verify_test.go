package agent

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/inpod-dev/inpod/agent/enroll"
	"github.com/inpod-dev/inpod/internal/testkit"
	"github.com/inpod-dev/inpod/zds"
)

// The first round runs at once (the agent's start may follow anything),
// asks made before a round runs are one round, and a round asked for
// waits for the CNI events in flight.
func TestVerifierRunsAtStartCoalescesAndWaitsForQuiet(t *testing.T) {
	var rounds atomic.Int32
	activity := &cniActivity{}
	v := newVerifier(time.Hour, func(context.Context) { rounds.Add(1) }, activity)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { v.run(ctx); close(done) }()
	t.Cleanup(func() { cancel(); <-done })

	testkit.Eventually(t, 5*time.Second, "the start's round", func() bool { return rounds.Load() == 1 })
	endEvent := activity.track() // a CNI event in flight
	for range 5 {
		v.trigger()
	}
	// minVerifySpacing passes; the round still waits for the event.
	quietFor := minVerifySpacing + 200*time.Millisecond
	deadline := time.Now().Add(quietFor)
	for time.Now().Before(deadline) {
		if rounds.Load() != 1 {
			t.Fatal("a round asked for ran while a CNI event was in flight")
		}
		time.Sleep(10 * time.Millisecond)
	}
	endEvent()
	testkit.Eventually(t, 5*time.Second, "the round asked for", func() bool { return rounds.Load() == 2 })
	// Five asks were one round.
	deadline = time.Now().Add(quietFor)
	for time.Now().Before(deadline) {
		if n := rounds.Load(); n != 2 {
			t.Fatalf("%d rounds after five asks; want one", n-1)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// ztunnel gone for less than the grace is "reconnecting" (nothing is
// concluded about the pods), longer is "away"; back, it is ready, and
// coming back is reported once.
func TestZtunnelPresenceGivesAGraceThenConcludes(t *testing.T) {
	z := newZtunnelPresence(200 * time.Millisecond)
	if got := z.presence(); got != enroll.ZtunnelReconnecting {
		t.Fatalf("at start = %v; want reconnecting", got)
	}
	if !z.observe(zds.State{Connections: 1, Ready: true}) {
		t.Fatal("ztunnel becoming ready was not reported")
	}
	if z.observe(zds.State{Connections: 2, Ready: true}) {
		t.Fatal("a second connection was reported as ztunnel becoming ready")
	}
	if got := z.presence(); got != enroll.ZtunnelReady {
		t.Fatalf("ready = %v", got)
	}
	z.observe(zds.State{})
	if got := z.presence(); got != enroll.ZtunnelReconnecting {
		t.Fatalf("just gone = %v; want reconnecting", got)
	}
	testkit.Eventually(t, 5*time.Second, "the grace to end", func() bool { return z.presence() == enroll.ZtunnelAway })
}

// The ports checked are ztunnel's, with its DNS proxy's for a pod whose
// DNS is captured.
func TestZtunnelListenersFollowDNSCapture(t *testing.T) {
	if got := (ztunnelListeners{}).ports(enroll.Variant{}); len(got) != 3 {
		t.Fatalf("ports without DNS capture = %v", got)
	}
	if got := (ztunnelListeners{}).ports(enroll.Variant{DNSCapture: true, NoInboundCapture: true}); len(got) != 4 || got[3] != 15053 {
		t.Fatalf("ports with DNS capture = %v", got)
	}
}
