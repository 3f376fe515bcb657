package redirect

import (
	"fmt"
	"os"
)

// Engine applies one backend's rule set plus the policy routing, and clears
// what other backends may have left in the netns (a node that switched
// backend must not run two rule sets in one pod).
type Engine struct {
	backend Backend
	others  []Backend
}

// NewEngine uses backend and removes the leftovers of others.
func NewEngine(backend Backend, others ...Backend) *Engine {
	return &Engine{backend: backend, others: others}
}

// Backend is the backend in use.
func (e *Engine) Backend() Backend { return e.backend }

// Result says what Apply did.
type Result struct {
	// Changed is false when everything was already in place.
	Changed  bool
	Families []Family
}

// Apply makes the pod netns redirect to ztunnel. It is idempotent: an intact
// set is left alone, a partial or modified one replaced in one transaction.
func (e *Engine) Apply(ns *os.File, opts Options) (Result, error) {
	if err := opts.validate(); err != nil {
		return Result{}, err
	}
	h, err := netlinkIn(ns)
	if err != nil {
		return Result{}, err
	}
	defer h.Close()
	fams, err := families(h)
	if err != nil {
		return Result{}, err
	}
	res := Result{Families: fams}
	// Routing first: harmless on its own, and in place before any packet
	// is marked for it.
	routed, err := applyRouting(h, fams)
	if err != nil {
		return res, err
	}
	applied, err := e.backend.Apply(ns, opts, fams)
	if err != nil {
		return res, fmt.Errorf("%s: %w", e.backend.Name(), err)
	}
	cleaned, err := e.removeOthers(ns)
	res.Changed = routed || applied || cleaned
	return res, err
}

// Remove leaves the netns as it was before Apply.
func (e *Engine) Remove(ns *os.File) (bool, error) {
	removed, err := e.backend.Remove(ns)
	if err != nil {
		return removed, fmt.Errorf("%s: %w", e.backend.Name(), err)
	}
	cleaned, err := e.removeOthers(ns)
	if err != nil {
		return removed || cleaned, err
	}
	h, err := netlinkIn(ns)
	if err != nil {
		return removed || cleaned, err
	}
	defer h.Close()
	unrouted, err := removeRouting(h)
	return removed || cleaned || unrouted, err
}

// Present says whether the netns holds any of inpod's netfilter rules, of
// this engine's backend or another's. Only the netfilter rules say so: the
// policy route (table 100, fwmark 0x111) uses Istio's values, so a pod
// Istio's own CNI redirected has it too.
func (e *Engine) Present(ns *os.File) (bool, error) {
	if ok, err := e.backend.Present(ns); err != nil || ok {
		return ok, err
	}
	for _, o := range e.others {
		if ok, err := o.Present(ns); err != nil || ok {
			return ok, err
		}
	}
	return false, nil
}

func (e *Engine) removeOthers(ns *os.File) (bool, error) {
	changed := false
	for _, o := range e.others {
		present, err := o.Present(ns)
		if err != nil {
			return changed, fmt.Errorf("%s leftovers: %w", o.Name(), err)
		}
		if !present {
			continue
		}
		if _, err := o.Remove(ns); err != nil {
			return changed, fmt.Errorf("remove %s leftovers: %w", o.Name(), err)
		}
		changed = true
	}
	return changed, nil
}
