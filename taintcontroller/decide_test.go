package taintcontroller

import (
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/inpod-dev/inpod/nodecondition"
)

func TestDecide(t *testing.T) {
	const grace = 30 * time.Second
	T, F, U := corev1.ConditionTrue, corev1.ConditionFalse, corev1.ConditionUnknown
	for _, tc := range []struct {
		name        string
		mode        Mode
		o           observation
		notReadyFor time.Duration
		want        action
		recheck     time.Duration
	}{
		{"bootstrap: ready and tainted", Bootstrap, observation{tainted: true, cond: T, agentReady: true}, 0, removeTaint, 0},
		{"bootstrap: condition True, agent pod not Ready", Bootstrap, observation{tainted: true, cond: T}, time.Hour, none, 0},
		{"bootstrap: agent Ready, condition False", Bootstrap, observation{tainted: true, cond: F, agentReady: true}, time.Hour, none, 0},
		{"bootstrap: agent Ready, no condition", Bootstrap, observation{tainted: true, agentReady: true}, time.Hour, none, 0},
		{"bootstrap: done, taint back", Bootstrap, observation{tainted: true, done: true, cond: T, agentReady: true}, 0, none, 0},
		{"bootstrap: done, not ready, untainted", Bootstrap, observation{done: true, cond: F}, time.Hour, none, 0},
		{"bootstrap: ready, never tainted", Bootstrap, observation{cond: T, agentReady: true}, 0, markDone, 0},
		{"continuous: ready and tainted", Continuous, observation{tainted: true, cond: T, agentReady: true}, 0, removeTaint, 0},
		{"continuous: ready, untainted", Continuous, observation{cond: T, agentReady: true}, 0, none, 0},
		{"continuous: False taints at once", Continuous, observation{cond: F, agentReady: true, agentsAnywhere: true}, 0, addTaint, 0},
		{"continuous: agent gone within grace", Continuous, observation{cond: T, agentsAnywhere: true}, 10 * time.Second, none, 20 * time.Second},
		{"continuous: agent gone past grace", Continuous, observation{cond: T, agentsAnywhere: true}, grace, addTaint, 0},
		{"continuous: Unknown past grace", Continuous, observation{cond: U, agentReady: true, agentsAnywhere: true}, grace, addTaint, 0},
		{"continuous: already tainted", Continuous, observation{tainted: true, cond: F}, time.Hour, none, 0},
		{"continuous: never reported a condition", Continuous, observation{agentReady: true, agentsAnywhere: true}, time.Hour, none, 0},
		{"continuous: no agent pod anywhere (uninstall)", Continuous, observation{cond: T}, time.Hour, none, 0},
		{"continuous: False but no agent pod anywhere", Continuous, observation{cond: F}, time.Hour, none, 0},
		// A previous taint (the key changed on upgrade) goes exactly when
		// the startup taint would, and its presence never stands for the
		// startup taint: a not-ready node still gets the current one.
		{"bootstrap: ready, previous taint only", Bootstrap, observation{previous: true, cond: T, agentReady: true}, 0, removeTaint, 0},
		{"bootstrap: previous taint, condition True, agent pod not Ready", Bootstrap, observation{previous: true, cond: T}, time.Hour, none, 0},
		{"bootstrap: previous taint, agent Ready, condition False", Bootstrap, observation{previous: true, cond: F, agentReady: true}, time.Hour, none, 0},
		{"bootstrap: previous taint, no condition", Bootstrap, observation{previous: true, agentReady: true}, time.Hour, none, 0},
		// done: the annotation names the previous taint (observe; see
		// TestObserveDoneAnnotation for the annotations that do not).
		{"bootstrap: done for the previous taint, taint back", Bootstrap, observation{previous: true, done: true, cond: T, agentReady: true}, 0, none, 0},
		{"continuous: ready, previous taint only", Continuous, observation{previous: true, cond: T, agentReady: true}, 0, removeTaint, 0},
		{"continuous: ready, both taints", Continuous, observation{tainted: true, previous: true, cond: T, agentReady: true}, 0, removeTaint, 0},
		{"continuous: previous taint, agent gone", Continuous, observation{previous: true, cond: T, agentsAnywhere: true}, 10 * time.Second, none, 20 * time.Second},
		{"continuous: previous taint, False adds the startup taint", Continuous, observation{previous: true, cond: F, agentReady: true, agentsAnywhere: true}, 0, addTaint, 0},
		{"continuous: previous taint, no agent pod anywhere", Continuous, observation{previous: true, cond: T}, time.Hour, none, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a, recheck := decide(tc.mode, tc.o, tc.notReadyFor, grace)
			if a != tc.want || recheck != tc.recheck {
				t.Fatalf("decide = %v, %v; want %v, %v", a, recheck, tc.want, tc.recheck)
			}
		})
	}
}

// A node is done only for the taint its DoneAnnotation names. The current
// taint on a node whose annotation names another one (the old leader of a
// rolling update changing the key marked the node done, while the node-taint
// policy already gave it the new key) or says none (an older version's bare
// time) is removed on the usual evidence, never without it; a taint the
// annotation names stays, as a done node's always did.
func TestObserveDoneAnnotation(t *testing.T) {
	const (
		key = "readiness.k8s.io/inpod-redirection"
		old = "inpod.dev/not-ready"
	)
	current := corev1.Taint{Key: key, Effect: corev1.TaintEffectNoSchedule}
	oldTaint := corev1.Taint{Key: old, Effect: corev1.TaintEffectNoSchedule}
	previous := []corev1.Taint{{Key: old}}
	readyPod := &corev1.Pod{Status: corev1.PodStatus{Conditions: []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue}}}}
	at := time.Date(2026, 12, 6, 3, 30, 4, 0, time.UTC)
	namesCurrent, namesOld := doneValue(at, key, corev1.TaintEffectNoSchedule), doneValue(at, old, corev1.TaintEffectNoSchedule)
	const legacy = "2026-12-06T03:30:04Z"
	for _, tc := range []struct {
		name       string
		annotation *string
		taints     []corev1.Taint
		ready      bool
		want       action
	}{
		{"names another key, current taint, ready", &namesOld, []corev1.Taint{current}, true, removeTaint},
		{"names another key, current taint, not ready", &namesOld, []corev1.Taint{current}, false, none},
		{"legacy, current taint, ready", ptr(legacy), []corev1.Taint{current}, true, removeTaint},
		{"legacy, current taint, not ready", ptr(legacy), []corev1.Taint{current}, false, none},
		{"legacy, previous taint, ready", ptr(legacy), []corev1.Taint{oldTaint}, true, removeTaint},
		{"names another effect, current taint, ready", ptr(doneValue(at, key, corev1.TaintEffectPreferNoSchedule)), []corev1.Taint{current}, true, removeTaint},
		{"names the current key, taint back", &namesCurrent, []corev1.Taint{current}, true, none},
		{"names the previous key, previous taint back", &namesOld, []corev1.Taint{oldTaint}, true, none},
		{"names the current key, previous taint", &namesCurrent, []corev1.Taint{oldTaint}, true, removeTaint},
		// Nothing to remove: done whatever it names, so no write.
		{"names another key, untainted", &namesOld, nil, true, none},
		{"legacy, untainted", ptr(legacy), []corev1.Taint{{Key: "example.com/other", Effect: corev1.TaintEffectNoSchedule}}, true, none},
		{"no annotation, untainted", nil, nil, true, markDone},
	} {
		t.Run(tc.name, func(t *testing.T) {
			node := &corev1.Node{Spec: corev1.NodeSpec{Taints: tc.taints}}
			if tc.annotation != nil {
				node.Annotations = map[string]string{DoneAnnotation: *tc.annotation}
			}
			cond := corev1.ConditionFalse
			if tc.ready {
				cond = corev1.ConditionTrue
			}
			node.Status.Conditions = []corev1.NodeCondition{{Type: nodecondition.ConditionType, Status: cond}}
			o := observe(node, key, corev1.TaintEffectNoSchedule, previous, []*corev1.Pod{readyPod})
			if a, _ := decide(Bootstrap, o, time.Hour, time.Minute); a != tc.want {
				t.Fatalf("decide(%+v) = %v, want %v", o, a, tc.want)
			}
		})
	}
	if got, want := namesCurrent, "2026-12-06T03:30:04Z readiness.k8s.io/inpod-redirection:NoSchedule"; got != want {
		t.Errorf("doneValue = %q, want %q", got, want)
	}
	for v, want := range map[string]string{namesOld: old + ":NoSchedule", legacy: "", "": ""} {
		if got := doneTaint(v); got != want {
			t.Errorf("doneTaint(%q) = %q, want %q", v, got, want)
		}
	}
}

func ptr[T any](v T) *T { return &v }

func TestObserve(t *testing.T) {
	ready := func(s corev1.ConditionStatus) []corev1.PodCondition {
		return []corev1.PodCondition{{Type: corev1.PodReady, Status: s}}
	}
	now := metav1.Now()
	node := &corev1.Node{
		ObjectMeta: metav1.ObjectMeta{Name: "n", Annotations: map[string]string{DoneAnnotation: "x"}},
		Spec: corev1.NodeSpec{Taints: []corev1.Taint{
			{Key: DefaultTaintKey, Effect: corev1.TaintEffectPreferNoSchedule}, // other effect: not ours
			{Key: "other", Effect: DefaultTaintEffect},
		}},
		Status: corev1.NodeStatus{Conditions: []corev1.NodeCondition{
			{Type: corev1.NodeReady, Status: corev1.ConditionTrue},
			{Type: nodecondition.ConditionType, Status: corev1.ConditionTrue, LastTransitionTime: now},
		}},
	}
	terminating := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{DeletionTimestamp: &now}, Status: corev1.PodStatus{Conditions: ready(corev1.ConditionTrue)}}
	notReady := &corev1.Pod{Status: corev1.PodStatus{Conditions: ready(corev1.ConditionFalse)}}
	o := observe(node, DefaultTaintKey, DefaultTaintEffect, nil, []*corev1.Pod{terminating, notReady})
	if o.tainted || o.previous || !o.done || o.cond != corev1.ConditionTrue || !o.condSince.Equal(now.Time) || o.agentReady {
		t.Fatalf("observe = %+v", o)
	}
	readyPod := &corev1.Pod{Status: corev1.PodStatus{Conditions: ready(corev1.ConditionTrue)}}
	node.Spec.Taints = append(node.Spec.Taints, corev1.Taint{Key: DefaultTaintKey, Effect: DefaultTaintEffect})
	if o := observe(node, DefaultTaintKey, DefaultTaintEffect, nil, []*corev1.Pod{notReady, readyPod}); !o.tainted || o.previous || !o.agentReady {
		t.Fatalf("observe = %+v, want tainted and agent Ready", o)
	}
	got := withoutTaint(node.Spec.Taints, DefaultTaintKey, DefaultTaintEffect, nil)
	if len(got) != 2 || got[0].Effect != corev1.TaintEffectPreferNoSchedule || got[1].Key != "other" {
		t.Fatalf("withoutTaint = %+v", got)
	}
}

// A previous taint is matched by key and effect, or by key alone for an
// entry without an effect, never as a NoExecute taint of the same key
// (not inpod's); removing it keeps every other taint.
func TestObservePreviousTaints(t *testing.T) {
	const old, older = "inpod.dev/not-ready", "example.com/older"
	node := &corev1.Node{Spec: corev1.NodeSpec{Taints: []corev1.Taint{
		{Key: "other", Effect: DefaultTaintEffect},
		{Key: old, Effect: corev1.TaintEffectNoSchedule},
		{Key: older, Effect: corev1.TaintEffectNoExecute},
		{Key: older, Effect: corev1.TaintEffectPreferNoSchedule},
	}}}
	const key = "readiness.k8s.io/inpod-redirection"
	for _, tc := range []struct {
		name     string
		previous []corev1.Taint
		want     bool
		left     []string
	}{
		{"none", nil, false, []string{"other", old, older, older}},
		{"key and effect", []corev1.Taint{{Key: old, Effect: corev1.TaintEffectNoSchedule}}, true, []string{"other", older, older}},
		{"other effect", []corev1.Taint{{Key: old, Effect: corev1.TaintEffectPreferNoSchedule}}, false, []string{"other", old, older, older}},
		{"key alone", []corev1.Taint{{Key: older}}, true, []string{"other", old, older}},
		{"both", []corev1.Taint{{Key: old}, {Key: older}}, true, []string{"other", older}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if o := observe(node, key, DefaultTaintEffect, tc.previous, nil); o.previous != tc.want || o.tainted {
				t.Errorf("observe = %+v, want previous %t", o, tc.want)
			}
			var left []string
			for _, t := range withoutTaint(node.Spec.Taints, key, DefaultTaintEffect, tc.previous) {
				left = append(left, t.Key)
			}
			if !slices.Equal(left, tc.left) {
				t.Errorf("withoutTaint left %v, want %v", left, tc.left)
			}
		})
	}
	if got := withoutTaint(node.Spec.Taints, key, DefaultTaintEffect, nil); got[2].Effect != corev1.TaintEffectNoExecute {
		t.Errorf("withoutTaint = %+v", got)
	}
}

func TestNewRejects(t *testing.T) {
	for _, cfg := range []Config{
		{},
		{Client: fakeClient(), Mode: "sometimes"},
		{Client: fakeClient(), TaintEffect: corev1.TaintEffectNoExecute},
		{Client: fakeClient(), TaintKey: "not a key"},
		{Client: fakeClient(), NodeSelector: "a in ("},
		{Client: fakeClient(), PreviousTaints: []corev1.Taint{{Key: "not a key"}}},
		{Client: fakeClient(), PreviousTaints: []corev1.Taint{{Key: "inpod.dev/old", Effect: corev1.TaintEffectNoExecute}}},
	} {
		if _, err := New(cfg); err == nil {
			t.Errorf("New(%+v) accepted", cfg)
		}
	}
}

// The longest previous key the controller takes, a 253-character prefix
// and a 63-character name, and one character more of either: the chart's
// schema (controller.taint.previousKeys) draws the same line
// (hack/chart-check.sh), so the chart never renders a key that would stop
// the controller from starting.
func TestNewPreviousTaintKeyLengths(t *testing.T) {
	label := strings.Repeat("p", 60)
	prefix, name := strings.Join([]string{label, label, label, label, strings.Repeat("p", 9)}, "."), strings.Repeat("n", 63)
	if len(prefix) != 253 {
		t.Fatalf("prefix of %d characters", len(prefix))
	}
	if _, err := New(Config{Client: fakeClient(), PreviousTaints: []corev1.Taint{{Key: prefix + "/" + name}}}); err != nil {
		t.Fatalf("253-character prefix, 63-character name: %v", err)
	}
	for _, key := range []string{prefix + "p/" + name, prefix + "/" + name + "n", name + "n"} {
		if _, err := New(Config{Client: fakeClient(), PreviousTaints: []corev1.Taint{{Key: key}}}); err == nil {
			t.Errorf("New accepted previous key %q (prefix or name too long)", key)
		}
	}
}

// The current key listed as previous is dropped, with its effect or alone:
// it is added too, and "previous" would only confuse the events. Only its
// other effect named explicitly stays (the effect changed on upgrade).
func TestNewDropsCurrentFromPrevious(t *testing.T) {
	c, err := New(Config{Client: fakeClient(), PreviousTaints: []corev1.Taint{
		{Key: DefaultTaintKey, Effect: DefaultTaintEffect}, {Key: DefaultTaintKey}, {Key: "inpod.dev/old"},
		{Key: DefaultTaintKey, Effect: corev1.TaintEffectPreferNoSchedule},
	}})
	if err != nil {
		t.Fatal(err)
	}
	want := []corev1.Taint{{Key: "inpod.dev/old"}, {Key: DefaultTaintKey, Effect: corev1.TaintEffectPreferNoSchedule}}
	if !slices.Equal(c.cfg.PreviousTaints, want) {
		t.Fatalf("PreviousTaints = %+v, want %+v", c.cfg.PreviousTaints, want)
	}
}

// The taint a done mark names, in this version's layout and as a person
// might write one: anything that is not a taint names none (the node is
// judged again, never untainted without the ready evidence).
func TestDoneTaintReadsTheLastField(t *testing.T) {
	for v, want := range map[string]string{
		doneValue(time.Date(2026, 12, 6, 3, 30, 4, 0, time.UTC), "inpod.dev/not-ready", corev1.TaintEffectNoSchedule): "inpod.dev/not-ready:NoSchedule",
		"2026-12-06 03:30:04Z inpod.dev/not-ready:NoSchedule":                                                         "inpod.dev/not-ready:NoSchedule",
		"inpod.dev/not-ready:NoSchedule":                                                                              "inpod.dev/not-ready:NoSchedule",
		"2026-12-06T03:30:04Z\tinpod.dev/not-ready:PreferNoSchedule":                                                  "inpod.dev/not-ready:PreferNoSchedule",
		"2026-12-06T03:30:04Z":      "",
		"2026-12-06 03:30:04Z":      "",
		"2026-12-06T03:30:04+01:00": "",
		"done":                      "",
		"":                          "",
	} {
		if got := doneTaint(v); got != want {
			t.Errorf("doneTaint(%q) = %q, want %q", v, got, want)
		}
	}
}
