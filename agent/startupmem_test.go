package agent

import (
	"context"
	"testing"
	"time"

	"github.com/inpod-dev/inpod/cnievent"
	"github.com/inpod-dev/inpod/internal/testkit"
)

// A tick is quiet only with no CNI event in flight and none started since
// the previous tick; any event starts the count again.
func TestStartupMemoryCountsOnlyQuietTicks(t *testing.T) {
	var q quietCount
	for i, step := range []struct {
		started  uint64
		inFlight int64
		want     int
	}{
		{0, 0, 1},
		{0, 0, 2},
		{1, 1, 0}, // an ADD starts
		{1, 1, 0}, // still in flight over a tick
		{1, 0, 1}, // done
		{3, 0, 0}, // two more came and went between ticks
		{3, 0, 1},
		{3, 0, 2},
		{3, 0, 3},
	} {
		q.observe(step.started, step.inFlight)
		if q.ticks != step.want {
			t.Fatalf("step %d (%+v): %d quiet ticks, want %d", i, step, q.ticks, step.want)
		}
	}
}

// blockingHandler holds each CNI event until release is closed.
type blockingHandler struct{ release chan struct{} }

func (h blockingHandler) Add(context.Context, *cnievent.Request) (cnievent.Outcome, error) {
	<-h.release
	return "", nil
}
func (h blockingHandler) Del(ctx context.Context, r *cnievent.Request) (cnievent.Outcome, error) {
	return h.Add(ctx, r)
}
func (h blockingHandler) Check(ctx context.Context, r *cnievent.Request) (cnievent.Outcome, error) {
	return h.Add(ctx, r)
}

// Every CNI event the server hands the pipeline is counted, in flight until
// the pipeline answers; and a node that stays busy is never quiet.
func TestStartupMemoryTracksCNIEvents(t *testing.T) {
	h := blockingHandler{release: make(chan struct{})}
	activity := &cniActivity{Handler: h}
	for _, event := range []func(context.Context, *cnievent.Request) (cnievent.Outcome, error){activity.Add, activity.Del, activity.Check} {
		go event(context.Background(), &cnievent.Request{})
	}
	testkit.Eventually(t, 10*time.Second, "three events in flight", func() bool { return activity.inFlightNow() == 3 })
	ticks := make(chan time.Time)
	done := make(chan bool, 1)
	ctx, cancel := context.WithCancel(context.Background())
	go func() { done <- activity.waitQuiet(ctx, ticks, 2) }()
	for range 10 {
		ticks <- time.Time{}
	}
	cancel()
	if <-done {
		t.Fatal("quiet while CNI events were in flight")
	}
	close(h.release)
	testkit.Eventually(t, 10*time.Second, "the events answered", func() bool { return activity.inFlightNow() == 0 })
	if got := activity.started.Load(); got != 3 {
		t.Fatalf("%d events counted, want 3", got)
	}
	// Quiet now: two ticks and it returns.
	go func() { done <- activity.waitQuiet(context.Background(), ticks, 2) }()
	ticks <- time.Time{}
	ticks <- time.Time{}
	if !<-done {
		t.Fatal("waitQuiet returned false without a cancelled context")
	}
}

func TestStartupMemoryWaitEndsWithItsContext(t *testing.T) {
	activity := &cniActivity{Handler: blockingHandler{}}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if activity.waitQuiet(ctx, make(chan time.Time), 1) {
		t.Fatal("waitQuiet reported a quiet node after its context ended")
	}
}
