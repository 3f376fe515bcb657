package latest

import "testing"

func TestSlowSubscriberGetsTheLatestAndPublisherNeverBlocks(t *testing.T) {
	v := New(0)
	ch, cancel := v.Subscribe()
	defer cancel()
	if got := <-ch; got != 0 {
		t.Fatalf("first value %d, want the current 0", got)
	}
	for i := 1; i <= 100; i++ {
		v.Publish(i) // nobody reads: must not block
	}
	if got := <-ch; got != 100 {
		t.Fatalf("got %d, want the latest 100", got)
	}
	select {
	case got := <-ch:
		t.Fatalf("stale value %d delivered", got)
	default:
	}
	cancel()
	v.Publish(101)
	if v.Get() != 101 {
		t.Fatal("Get does not return the latest value")
	}
}
