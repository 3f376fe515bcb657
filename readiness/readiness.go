// Package readiness is the one signal every scheduling gate follows: the
// node is ready for redirection when, and only while, every condition holds
// (the CNI plugin installed last in the chain, a ztunnel connected with its
// snapshot acknowledged, the agent's pod watch synced). Each change is
// logged with its reason and delivered to subscribers.
package readiness

import (
	"log/slog"
	"slices"
	"sort"
	"sync"

	"github.com/inpod-dev/inpod/internal/latest"
)

// The conditions of the design.
const (
	CNIInstalled     = "cni-installed"
	ZtunnelConnected = "ztunnel-connected"
	PodsSynced       = "pods-synced"
)

// State is the aggregate at one moment.
type State struct {
	Ready bool
	// Failing lists "condition: reason" for every condition that does not
	// hold, sorted.
	Failing []string
}

// Aggregate combines named conditions.
type Aggregate struct {
	log *slog.Logger

	mu          sync.Mutex
	conds       map[string]cond
	last        State
	states      *latest.Value[State]
	transitions int
	onChange    []func(State)
}

type cond struct {
	ok     bool
	reason string
}

// New starts with every named condition false ("not checked yet").
func New(log *slog.Logger, names ...string) *Aggregate {
	if log == nil {
		log = slog.Default()
	}
	a := &Aggregate{log: log.With("component", "readiness"), conds: map[string]cond{}}
	for _, n := range names {
		a.conds[n] = cond{reason: "not checked yet"}
	}
	a.last = a.stateLocked()
	a.states = latest.New(a.last)
	return a
}

// OnChange registers fn to be called (synchronously, in order) on every
// change of the aggregate; for metrics and events.
func (a *Aggregate) OnChange(fn func(State)) {
	a.mu.Lock()
	a.onChange = append(a.onChange, fn)
	a.mu.Unlock()
}

// Set records one condition.
func (a *Aggregate) Set(name string, ok bool, reason string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	prev, known := a.conds[name]
	if known && prev.ok == ok && prev.reason == reason {
		return
	}
	a.conds[name] = cond{ok: ok, reason: reason}
	st := a.stateLocked()
	if st.Ready == a.last.Ready && slices.Equal(st.Failing, a.last.Failing) {
		return
	}
	if st.Ready != a.last.Ready {
		a.transitions++
		if st.Ready {
			a.log.Info("node is ready for redirection", "because", name+" now holds")
		} else {
			a.log.Warn("node is NOT ready for redirection", "failing", st.Failing)
		}
	}
	a.last = st
	a.states.Publish(st)
	for _, fn := range a.onChange {
		fn(st)
	}
}

// State returns the current aggregate.
func (a *Aggregate) State() State {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.last
}

// Transitions counts ready/not-ready flips so far.
func (a *Aggregate) Transitions() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.transitions
}

// Subscribe returns a channel holding the latest State after each change
// (starting with the current one); a slow reader only ever misses
// intermediate values, never the last.
func (a *Aggregate) Subscribe() (<-chan State, func()) { return a.states.Subscribe() }

func (a *Aggregate) stateLocked() State {
	st := State{Ready: len(a.conds) > 0}
	for name, c := range a.conds {
		if !c.ok {
			st.Ready = false
			st.Failing = append(st.Failing, name+": "+c.reason)
		}
	}
	sort.Strings(st.Failing)
	return st
}
