package taintcontroller

import (
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/inpod-dev/inpod/nodecondition"
)

// Mode says whether the controller only removes the taint or also adds it.
type Mode string

const (
	// Bootstrap removes the taint once per Node and never adds it.
	Bootstrap Mode = "bootstrap"
	// Continuous also adds the taint while the node is not ready.
	Continuous Mode = "continuous"
)

// DoneAnnotation marks a Node whose taint bootstrap mode has removed (or
// found absent on a ready node). Its value is the time and the taint it was
// for, as doneValue writes it: "2026-12-06T03:30:04Z
// inpod.dev/not-ready:NoSchedule". Older versions wrote the time alone.
const DoneAnnotation = "inpod.dev/startup-taint-removed"

// doneValue is DoneAnnotation's value for the taint key:effect at t. The
// taint is in it because "done" only holds for that taint: during a rolling
// update changing the key, the old leader marks done a node that the
// node-taint policy already gave the new key, and the new leader must still
// remove that one.
func doneValue(t time.Time, key string, effect corev1.TaintEffect) string {
	return t.UTC().Format(time.RFC3339) + " " + key + ":" + string(effect)
}

// doneTaint is the taint, key:effect, a DoneAnnotation value was written
// for: its last field, which holds a ':' where this version wrote it; ""
// for a value of an older version (the time alone), which cannot say. A
// value written by hand in another layout (a time with a space in it, the
// taint alone, a tab) reads the same way.
func doneTaint(v string) string {
	fields := strings.Fields(v)
	if len(fields) == 0 {
		return ""
	}
	last := fields[len(fields)-1]
	if _, err := time.Parse(time.RFC3339, last); err == nil || !strings.Contains(last, ":") || strings.HasSuffix(last, "Z") {
		return ""
	}
	return last
}

// observation is what the controller knows about one node.
type observation struct {
	tainted bool // carries the startup taint (key and effect)
	// previous: carries a taint of Config.PreviousTaints, which is only
	// ever removed, under the rule that removes the startup taint.
	previous bool
	// done: DoneAnnotation is present and names every taint of the
	// controller's (current or previous) the node carries; see observe.
	done bool
	cond corev1.ConditionStatus
	// condSince is the condition's lastTransitionTime.
	condSince  time.Time
	agentReady bool // one of the node's agent pods is Ready and not terminating
	// agentsAnywhere: the informer knows at least one agent pod, on any
	// node. None at all means the agent DaemonSet is gone (uninstall) or
	// was never deployed, not that every node turned unready at once.
	agentsAnywhere bool
}

// ready is the positive evidence needed to remove the taint.
func (o observation) ready() bool {
	return o.cond == corev1.ConditionTrue && o.agentReady
}

type action int

const (
	none action = iota
	removeTaint
	addTaint
	// markDone records bootstrap as finished on a node that carries no
	// taint (registered before the policy, or untainted by someone else).
	markDone
)

// decide says what to do with a node. notReadyFor is how long the node has
// been seen not ready without an explicit False (0 when it is ready). When
// the answer may change by time alone, recheck says after how long.
func decide(mode Mode, o observation, notReadyFor, grace time.Duration) (a action, recheck time.Duration) {
	if mode == Bootstrap {
		switch {
		case o.done:
			return none, 0
		case !o.ready():
			return none, 0
		case o.tainted || o.previous:
			return removeTaint, 0
		default:
			return markDone, 0
		}
	}
	if o.ready() {
		if o.tainted || o.previous {
			return removeTaint, 0
		}
		return none, 0
	}
	if o.tainted {
		return none, 0
	}
	// Adding the taint blocks every pod without a toleration, also pods
	// outside the mesh, so it needs evidence that the node is in the mesh
	// at all: a node that never reported the condition (its agent does not
	// run the node-condition gate, or no agent is meant to run there) is
	// left alone, and so is every node once no agent pod is left anywhere
	// (inpod being uninstalled).
	if o.cond == "" || !o.agentsAnywhere {
		return none, 0
	}
	// A False is the agent's own word: no grace.
	if o.cond == corev1.ConditionFalse || notReadyFor >= grace {
		return addTaint, 0
	}
	return none, grace - notReadyFor
}

// observe reads a node and its agent pods.
func observe(node *corev1.Node, key string, effect corev1.TaintEffect, previous []corev1.Taint, agents []*corev1.Pod) observation {
	var o observation
	for _, t := range node.Spec.Taints {
		if t.Key == key && t.Effect == effect {
			o.tainted = true
		}
		if matchesAny(t, previous) {
			o.previous = true
		}
	}
	// A node is done only for the taint its annotation names. Another
	// taint of ours on it — the current one under an annotation written
	// for an earlier key, or by an older version that did not say which —
	// may be one nothing else will ever remove, so the node is judged
	// again (and removal still needs the node ready). A node carrying none
	// stays done whatever its annotation names: nothing to remove, and no
	// write.
	if v, ok := node.Annotations[DoneAnnotation]; ok {
		named := doneTaint(v)
		o.done = true
		for _, t := range node.Spec.Taints {
			ours := t.Key == key && t.Effect == effect || matchesAny(t, previous)
			if ours && t.Key+":"+string(t.Effect) != named {
				o.done = false
			}
		}
	}
	for _, c := range node.Status.Conditions {
		if c.Type == nodecondition.ConditionType {
			o.cond, o.condSince = c.Status, c.LastTransitionTime.Time
		}
	}
	for _, p := range agents {
		if p.DeletionTimestamp == nil && podReady(p) {
			o.agentReady = true
		}
	}
	return o
}

func podReady(p *corev1.Pod) bool {
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

// withoutTaint is taints less every taint with key and effect, and every
// one matching previous.
func withoutTaint(taints []corev1.Taint, key string, effect corev1.TaintEffect, previous []corev1.Taint) []corev1.Taint {
	out := make([]corev1.Taint, 0, len(taints))
	for _, t := range taints {
		if (t.Key != key || t.Effect != effect) && !matchesAny(t, previous) {
			out = append(out, t)
		}
	}
	return out
}

// matchesAny says whether t is one of previous: the same key, and the same
// effect or, for an entry without one, either effect the controller can
// use (a NoExecute taint is never inpod's).
func matchesAny(t corev1.Taint, previous []corev1.Taint) bool {
	for _, p := range previous {
		if t.Key != p.Key {
			continue
		}
		if t.Effect == p.Effect || p.Effect == "" && (t.Effect == corev1.TaintEffectNoSchedule || t.Effect == corev1.TaintEffectPreferNoSchedule) {
			return true
		}
	}
	return false
}
