package readiness

import (
	"testing"
	"time"
)

var (
	notReady = State{Failing: []string{ZtunnelConnected + ": not connected"}}
	ready    = State{Ready: true}
)

func TestStartupHoldKeepsNotReadyBackUntilTheFirstReadyVerdict(t *testing.T) {
	h := HoldStartup(time.Hour, true)
	defer h.Stop()
	if !h.Holding() || h.Expired() == nil {
		t.Fatal("a restart that finds the node published ready must hold")
	}
	if h.Observe(notReady) {
		t.Fatal("a not-ready state was let through while holding")
	}
	if !h.Observe(ready) {
		t.Fatal("the first ready verdict was held back")
	}
	if h.Holding() || h.Expired() != nil {
		t.Fatal("still holding after the first ready verdict")
	}
	if !h.Observe(notReady) {
		t.Fatal("a not-ready state after the hold ended was held back")
	}
}

func TestStartupHoldEndsWhenTheGracePasses(t *testing.T) {
	h := HoldStartup(time.Millisecond, true)
	defer h.Stop()
	if h.Observe(notReady) {
		t.Fatal("a not-ready state was let through while holding")
	}
	select {
	case <-h.Expired():
	case <-time.After(10 * time.Second):
		t.Fatal("the grace never ended")
	}
	if !h.Expire() {
		t.Fatal("Expire did not report the hold it ended")
	}
	if h.Holding() || !h.Observe(notReady) {
		t.Fatal("still holding after the grace")
	}
	if h.Expire() {
		t.Fatal("a second Expire reported a hold")
	}
}

func TestStartupHoldHoldsNothingWithoutAPublishedReadyOrAGrace(t *testing.T) {
	for name, h := range map[string]*StartupHold{
		"nothing ready published": HoldStartup(time.Hour, false),
		"no grace":                HoldStartup(0, true),
		"negative grace":          HoldStartup(-time.Second, true),
	} {
		if h.Holding() || h.Expired() != nil || !h.Observe(notReady) {
			t.Errorf("%s: held", name)
		}
		h.Stop()
	}
}
