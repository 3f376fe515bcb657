package agent

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"github.com/inpod-dev/inpod/agent/cniserver"
	"github.com/inpod-dev/inpod/cnievent"
)

// cniActivity counts the CNI events the agent serves, for the work that
// should wait for the node to be quiet: the start-up memory release waits
// for a quiet node (one that has just become ready is when the kubelet
// starts the pods it held back, and the release makes the code they run be
// read back from the image), and the annotation writer keeps its API
// writes out of a burst of pod starts (enroll.AnnotationWriter).
type cniActivity struct {
	cniserver.Handler
	started atomic.Uint64

	mu       sync.Mutex
	inFlight int
	// idle is closed when inFlight drops to 0; a new one is made when it
	// leaves 0.
	idle chan struct{}
}

func (c *cniActivity) track() func() {
	c.started.Add(1)
	c.mu.Lock()
	if c.inFlight == 0 {
		c.idle = make(chan struct{})
	}
	c.inFlight++
	c.mu.Unlock()
	return func() {
		c.mu.Lock()
		c.inFlight--
		if c.inFlight == 0 {
			close(c.idle)
		}
		c.mu.Unlock()
	}
}

// Quiet returns nil when no CNI event is being served, else a channel
// closed once none is.
func (c *cniActivity) Quiet() <-chan struct{} {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.inFlight == 0 {
		return nil
	}
	return c.idle
}

func (c *cniActivity) inFlightNow() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.inFlight
}

func (c *cniActivity) Add(ctx context.Context, req *cnievent.Request) (cnievent.Outcome, error) {
	defer c.track()()
	return c.Handler.Add(context.WithValue(ctx, cniEventKey{}, true), req)
}

// cniEventKey marks the context of a CNI ADD (fromCNIEvent).
type cniEventKey struct{}

// fromCNIEvent reports whether ctx is a CNI ADD's.
func fromCNIEvent(ctx context.Context) bool { return ctx.Value(cniEventKey{}) != nil }

func (c *cniActivity) Del(ctx context.Context, req *cnievent.Request) (cnievent.Outcome, error) {
	defer c.track()()
	return c.Handler.Del(ctx, req)
}

func (c *cniActivity) Check(ctx context.Context, req *cnievent.Request) (cnievent.Outcome, error) {
	defer c.track()()
	return c.Handler.Check(ctx, req)
}

// waitQuiet returns true once n consecutive ticks passed with no CNI event
// started or in flight, false if ctx ends first.
func (c *cniActivity) waitQuiet(ctx context.Context, ticks <-chan time.Time, n int) bool {
	var q quietCount
	q.last = c.started.Load()
	for q.ticks < n {
		select {
		case <-ctx.Done():
			return false
		case <-ticks:
		}
		q.observe(c.started.Load(), int64(c.inFlightNow()))
	}
	return true
}

// quietCount counts the ticks in a row that saw no CNI event: none in
// flight, none started since the previous tick.
type quietCount struct {
	last  uint64 // events started, as of the previous tick
	ticks int
}

func (q *quietCount) observe(started uint64, inFlight int64) {
	if started != q.last || inFlight > 0 {
		q.last, q.ticks = started, 0
		return
	}
	q.ticks++
}
