package agent

import (
	"context"
	"sync/atomic"
	"time"

	"github.com/inpod-dev/inpod/agent/cniserver"
	"github.com/inpod-dev/inpod/cnievent"
	"github.com/inpod-dev/inpod/internal/codepages"
)

// DefaultStartupMemoryQuiet is how long, once first ready, the node must
// see no CNI event before the agent gives back its start-up memory.
const DefaultStartupMemoryQuiet = 30 * time.Second

// cniActivity counts the CNI events the agent serves, so the start-up
// memory release waits for a quiet node: a node that has just become ready
// is when the kubelet starts the pods it held back, and the release makes
// the code they run be read back from the image.
type cniActivity struct {
	cniserver.Handler
	started  atomic.Uint64
	inFlight atomic.Int64
}

func (c *cniActivity) track() func() {
	c.started.Add(1)
	c.inFlight.Add(1)
	return func() { c.inFlight.Add(-1) }
}

func (c *cniActivity) Add(ctx context.Context, req *cnievent.Request) (cnievent.Outcome, error) {
	defer c.track()()
	return c.Handler.Add(ctx, req)
}

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
		q.observe(c.started.Load(), c.inFlight.Load())
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

// releaseStartupMemory gives back the binary's pages (see package
// codepages) once, when the node has first been ready and then quiet for
// cfg.StartupMemoryQuiet. By then start-up has run (client-go's init of
// every API group, the informers' first lists, restoring running pods, the
// gates' registration, the pods the node held back); what the agent runs
// from then on is read back as it runs.
func (a *Agent) releaseStartupMemory(ctx context.Context, activity *cniActivity) {
	states, stop := a.Ready.Subscribe()
	for ready := false; !ready; {
		select {
		case <-ctx.Done():
			stop()
			return
		case st := <-states:
			ready = st.Ready
		}
	}
	stop()
	quiet := a.cfg.StartupMemoryQuiet
	tick := max(min(time.Second, quiet), time.Millisecond)
	ticker := time.NewTicker(tick)
	defer ticker.Stop()
	if !activity.waitQuiet(ctx, ticker.C, max(int((quiet+tick-1)/tick), 1)) {
		return
	}
	r, err := codepages.Release()
	a.Metrics.StartupMemoryReleased(r.Freed())
	const mib = 1 << 20
	attrs := []any{"mappedBeforeMiB", float64(r.MappedBefore) / mib, "mappedAfterMiB", float64(r.MappedAfter) / mib,
		"cachedBeforeMiB", float64(r.CachedBefore) / mib, "cachedAfterMiB", float64(r.CachedAfter) / mib}
	switch {
	case err != nil:
		a.log.Warn("gave back the binary's start-up pages only in part", append(attrs, "err", err)...)
	case r.Freed() == 0:
		// Pages another process maps, or still being written, stay; so
		// does all of it without the right to write the binary.
		a.log.Warn("gave back none of the binary's page cache", attrs...)
	default:
		a.log.Info("gave back the binary's start-up pages", attrs...)
	}
}
