package agent

import (
	"context"
	"testing"
	"time"

	"github.com/inpod-dev/inpod/cnievent"
	"github.com/inpod-dev/inpod/internal/testkit"
)

// Quiet is nil on a quiet node and, while CNI events are in flight, a
// channel closed when the last of them is answered; each busy spell has its
// own, so a writer that waited out one spell waits out the next too.
func TestCNIActivityQuietClosesWhenTheLastEventIsAnswered(t *testing.T) {
	h := blockingHandler{release: make(chan struct{})}
	activity := &cniActivity{Handler: h}
	if activity.Quiet() != nil {
		t.Fatal("busy before any CNI event")
	}
	done := make(chan struct{}, 2)
	for range 2 {
		go func() { activity.Add(context.Background(), &cnievent.Request{}); done <- struct{}{} }()
	}
	testkit.Eventually(t, 10*time.Second, "two events in flight", func() bool { return activity.inFlightNow() == 2 })
	quiet := activity.Quiet()
	if quiet == nil {
		t.Fatal("quiet with two events in flight")
	}
	select {
	case <-quiet:
		t.Fatal("the spell ended with events in flight")
	default:
	}
	close(h.release)
	answered(t, done)
	answered(t, done)
	select {
	case <-quiet:
	case <-time.After(10 * time.Second):
		t.Fatal("the spell's channel not closed after its events were answered")
	}
	if activity.Quiet() != nil {
		t.Fatal("busy after every event was answered")
	}

	next := blockingHandler{release: make(chan struct{})}
	activity.Handler = next
	go func() { activity.Del(context.Background(), &cnievent.Request{}); done <- struct{}{} }()
	testkit.Eventually(t, 10*time.Second, "the next spell", func() bool { return activity.Quiet() != nil })
	if activity.Quiet() == quiet {
		t.Fatal("the next busy spell has the ended spell's channel")
	}
	close(next.release)
	answered(t, done)
}

func answered(t *testing.T, done <-chan struct{}) {
	t.Helper()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("a released CNI event was not answered")
	}
}
