package readiness

import "time"

// DefaultStartupGrace is how long a restarted agent's gate keeps what a
// previous agent published as ready while it waits for its own first ready
// verdict. ztunnel reconnects within seconds; closing the gate for every
// restart instead would block each node of a rolling upgrade in turn.
const DefaultStartupGrace = 15 * time.Second

// StartupHold is the rule every gate that publishes to the API follows at
// start: when the previous agent left the node published as ready, publish
// nothing until this agent's first ready verdict or until the grace has
// passed, whichever comes first; then follow readiness. When nothing ready
// was published there is nothing to protect, and nothing is held.
//
// A StartupHold belongs to the one goroutine that runs the gate's loop.
type StartupHold struct {
	holding bool
	timer   *time.Timer
}

// HoldStartup starts the hold when grace is positive and publishedReady
// (the API says ready, or cannot tell).
func HoldStartup(grace time.Duration, publishedReady bool) *StartupHold {
	h := &StartupHold{holding: grace > 0 && publishedReady}
	if h.holding {
		h.timer = time.NewTimer(grace)
	}
	return h
}

// Holding tells whether publishing is still held.
func (h *StartupHold) Holding() bool { return h.holding }

// Observe takes a readiness state and tells whether it may be published: a
// ready one ends the hold; a not-ready one is held back while holding.
func (h *StartupHold) Observe(st State) (publish bool) {
	if !h.holding {
		return true
	}
	if !st.Ready {
		return false
	}
	h.release()
	return true
}

// Expired fires once when the grace ends while still holding; nil (never
// ready in a select) when not holding.
func (h *StartupHold) Expired() <-chan time.Time {
	if !h.holding {
		return nil
	}
	return h.timer.C
}

// Expire ends the hold after Expired fired; it tells whether the hold was
// still on, so the caller publishes the held not-ready state.
func (h *StartupHold) Expire() (wasHolding bool) {
	wasHolding = h.holding
	h.holding = false
	return wasHolding
}

// Stop releases the timer.
func (h *StartupHold) Stop() { h.release() }

func (h *StartupHold) release() {
	h.holding = false
	if h.timer != nil {
		h.timer.Stop()
	}
}
