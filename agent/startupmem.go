package agent

import (
	"context"
	"time"

	"github.com/inpod-dev/inpod/internal/codepages"
)

// DefaultStartupMemoryQuiet is how long, once first ready, the node must
// see no CNI event before the agent gives back its start-up memory.
const DefaultStartupMemoryQuiet = 30 * time.Second

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
