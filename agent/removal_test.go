package agent

import (
	"context"
	"io"
	"log/slog"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
	listersv1 "k8s.io/client-go/listers/core/v1"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/client-go/tools/cache"
)

var testAgentLabels = map[string]string{"app.kubernetes.io/name": "inpod", "app.kubernetes.io/component": "agent"}

func testDS(name, uid string) *appsv1.DaemonSet {
	return &appsv1.DaemonSet{ObjectMeta: metav1.ObjectMeta{Namespace: "inpod-system", Name: name, UID: types.UID(uid)},
		Spec: appsv1.DaemonSetSpec{Template: corev1.PodTemplateSpec{ObjectMeta: metav1.ObjectMeta{Labels: testAgentLabels}}}}
}

func testAgentPod(name, node string, owner *appsv1.DaemonSet) *corev1.Pod {
	yes := true
	p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "inpod-system", Name: name, UID: types.UID("pod-" + name), Labels: testAgentLabels},
		Spec: corev1.PodSpec{NodeName: node}}
	if owner != nil {
		p.OwnerReferences = []metav1.OwnerReference{{APIVersion: "apps/v1", Kind: "DaemonSet", Name: owner.Name, UID: owner.UID, Controller: &yes}}
	}
	return p
}

// evidenceCase builds an uninstallWatch over: the API server's DaemonSets
// (apiDS; forbidden: every read refused, as after helm deleted the RBAC),
// the node's pods as the pod watch has them, and what the DaemonSet watch
// has (watchDS) or saw deleted.
type evidenceCase struct {
	apiDS []*appsv1.DaemonSet
	// apiPods are in the API server only: created after the pod watch
	// stopped.
	apiPods     []*corev1.Pod
	forbidden   bool
	pods        []*corev1.Pod
	watchDS     []*appsv1.DaemonSet
	seenDeleted []types.UID
	self        string
	// node is this Node in the API server; none: it cannot be read.
	node *corev1.Node
}

func (c evidenceCase) watch(t *testing.T) *uninstallWatch {
	var objs []runtime.Object
	for _, d := range c.apiDS {
		objs = append(objs, d)
	}
	for _, p := range c.apiPods {
		objs = append(objs, p)
	}
	if c.node != nil {
		objs = append(objs, c.node)
	}
	client := fake.NewClientset(objs...)
	if c.forbidden {
		client.PrependReactor("*", "*", func(k8stesting.Action) (bool, runtime.Object, error) {
			return true, nil, apierrors.NewForbidden(schema.GroupResource{Group: "apps", Resource: "daemonsets"}, "", nil)
		})
	}
	idx := cache.NewIndexer(cache.MetaNamespaceKeyFunc, cache.Indexers{cache.NamespaceIndex: cache.MetaNamespaceIndexFunc})
	for _, p := range c.pods {
		idx.Add(p)
	}
	self := c.self
	if self == "" {
		self = "agent-a"
	}
	sel, _ := labels.Parse(DefaultAgentSelector)
	w := newUninstallWatch(slog.New(slog.NewTextHandler(io.Discard, nil)), client, "node-1",
		types.NamespacedName{Namespace: "inpod-system", Name: self}, sel, listersv1.NewPodLister(idx))
	for _, d := range c.watchDS {
		w.daemonSets.GetIndexer().Add(d)
	}
	for _, uid := range c.seenDeleted {
		w.markDeleted(uid)
	}
	return w
}

func TestUninstallIsDecidedOnlyOnUnambiguousEvidence(t *testing.T) {
	old := testDS("inpod-agent", "uid-old")
	renamed := testDS("inpod-node-agent", "uid-new")
	sameName := testDS("inpod-agent", "uid-again")
	deleting := testDS("inpod-agent", "uid-old")
	now := metav1.Now()
	deleting.DeletionTimestamp = &now
	self := testAgentPod("agent-a", "node-1", old)
	terminating := testAgentPod("agent-new", "node-1", renamed)
	terminating.DeletionTimestamp = &now
	orphan := self.DeepCopy()
	orphan.OwnerReferences = nil
	cases := map[string]struct {
		c    evidenceCase
		want bool
	}{
		"own DaemonSet in place: a restart or an upgrade": {evidenceCase{apiDS: []*appsv1.DaemonSet{old}, pods: []*corev1.Pod{self}}, false},
		"own DaemonSet not found: uninstall":              {evidenceCase{pods: []*corev1.Pod{self}}, true},
		"own DaemonSet being deleted: uninstall":          {evidenceCase{apiDS: []*appsv1.DaemonSet{deleting}, pods: []*corev1.Pod{self}}, true},
		"seen deleted by the watch, reads now refused (RBAC gone): uninstall": {
			evidenceCase{forbidden: true, pods: []*corev1.Pod{self}, seenDeleted: []types.UID{"uid-old"}}, true},
		"not seen deleted and reads refused: cannot tell": {evidenceCase{forbidden: true, pods: []*corev1.Pod{self}}, false},
		"renamed: the new DaemonSet's pod is on this node": {
			evidenceCase{apiDS: []*appsv1.DaemonSet{renamed}, pods: []*corev1.Pod{self, testAgentPod("agent-new", "node-1", renamed)}}, false},
		"renamed: the new DaemonSet's pod not created yet, the watch has the DaemonSet": {
			evidenceCase{apiDS: []*appsv1.DaemonSet{renamed}, pods: []*corev1.Pod{self}, watchDS: []*appsv1.DaemonSet{renamed}}, false},
		"replaced under the same name": {evidenceCase{apiDS: []*appsv1.DaemonSet{sameName}, pods: []*corev1.Pod{self}}, false},
		"replaced under the same name, the watch saw only the deletion": {
			evidenceCase{apiDS: []*appsv1.DaemonSet{sameName}, pods: []*corev1.Pod{self}, seenDeleted: []types.UID{"uid-old"}}, false},
		"renamed: the new DaemonSet's pod created after the pod watch stopped": {
			evidenceCase{pods: []*corev1.Pod{self}, apiPods: []*corev1.Pod{testAgentPod("agent-new", "node-1", renamed)}, seenDeleted: []types.UID{"uid-old"}}, false},
		"the other agent's pod is terminating: uninstall": {
			evidenceCase{pods: []*corev1.Pod{self, terminating}}, true},
		"the other agent's DaemonSet was seen deleted too: uninstall": {
			evidenceCase{pods: []*corev1.Pod{self, testAgentPod("agent-new", "node-1", renamed)}, seenDeleted: []types.UID{"uid-old", "uid-new"}}, true},
		"a surge pod of the same deleted DaemonSet: uninstall": {
			evidenceCase{pods: []*corev1.Pod{self, testAgentPod("agent-surge", "node-1", old)}}, true},
		"another node's agent pod does not serve this node: uninstall": {
			evidenceCase{pods: []*corev1.Pod{self, testAgentPod("agent-far", "node-2", renamed)}}, true},
		"own pod never seen (mistyped --pod-name)":         {evidenceCase{pods: []*corev1.Pod{self}, self: "agent-typo"}, false},
		"own pod on another node":                          {evidenceCase{pods: []*corev1.Pod{testAgentPod("agent-a", "node-2", old)}}, false},
		"own pod not controlled by a DaemonSet (orphaned)": {evidenceCase{pods: []*corev1.Pod{orphan}}, false},
	}
	for name, tc := range cases {
		t.Run(name, func(t *testing.T) {
			if got := tc.c.watch(t).uninstalling(context.Background()); got != tc.want {
				t.Fatalf("uninstalling = %v, want %v", got, tc.want)
			}
		})
	}
}

// A DaemonSet in place that no longer runs a pod on this node (the node
// relabelled out of its selector, its affinity narrowed, a NoExecute taint
// it does not tolerate) is a removal from the node, as the DaemonSet
// controller judges it: a restart it keeps running through (a NoSchedule
// taint, the NotReady taint its pods tolerate) is not, and neither is a
// Node that cannot be read.
func TestRemovalFromTheNodeFollowsTheDaemonSetsSelection(t *testing.T) {
	node := func(labels map[string]string, taints ...corev1.Taint) *corev1.Node {
		return &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-1", Labels: labels}, Spec: corev1.NodeSpec{Taints: taints}}
	}
	ds := func(mod func(*corev1.PodSpec)) *appsv1.DaemonSet {
		d := testDS("inpod-agent", "uid-old")
		mod(&d.Spec.Template.Spec)
		return d
	}
	selecting := ds(func(s *corev1.PodSpec) { s.NodeSelector = map[string]string{"inpod": "yes"} })
	self := testAgentPod("agent-a", "node-1", selecting)
	affinity := ds(func(s *corev1.PodSpec) {
		s.Affinity = &corev1.Affinity{NodeAffinity: &corev1.NodeAffinity{RequiredDuringSchedulingIgnoredDuringExecution: &corev1.NodeSelector{
			NodeSelectorTerms: []corev1.NodeSelectorTerm{{MatchExpressions: []corev1.NodeSelectorRequirement{{Key: "pool", Operator: corev1.NodeSelectorOpIn, Values: []string{"mesh"}}}}}}}}
	})
	tolerating := ds(func(s *corev1.PodSpec) {
		s.Tolerations = []corev1.Toleration{{Key: "dedicated", Operator: corev1.TolerationOpExists, Effect: corev1.TaintEffectNoExecute}}
	})
	noExecute := corev1.Taint{Key: "dedicated", Value: "gpu", Effect: corev1.TaintEffectNoExecute}
	cases := map[string]struct {
		c    evidenceCase
		want bool
	}{
		"selected: a restart": {evidenceCase{apiDS: []*appsv1.DaemonSet{selecting}, pods: []*corev1.Pod{self}, node: node(map[string]string{"inpod": "yes"})}, false},
		"relabelled out of the node selector: removal": {
			evidenceCase{apiDS: []*appsv1.DaemonSet{selecting}, pods: []*corev1.Pod{self}, node: node(nil)}, true},
		"required node affinity no longer matches: removal": {
			evidenceCase{apiDS: []*appsv1.DaemonSet{affinity}, pods: []*corev1.Pod{self}, node: node(map[string]string{"pool": "batch"})}, true},
		"required node affinity matches: a restart": {
			evidenceCase{apiDS: []*appsv1.DaemonSet{affinity}, pods: []*corev1.Pod{self}, node: node(map[string]string{"pool": "mesh"})}, false},
		"an untolerated NoExecute taint: removal": {
			evidenceCase{apiDS: []*appsv1.DaemonSet{testDS("inpod-agent", "uid-old")}, pods: []*corev1.Pod{self}, node: node(nil, noExecute)}, true},
		"a tolerated NoExecute taint: a restart": {
			evidenceCase{apiDS: []*appsv1.DaemonSet{tolerating}, pods: []*corev1.Pod{self}, node: node(nil, noExecute)}, false},
		"an untolerated NoSchedule taint keeps a running daemon: a restart": {
			evidenceCase{apiDS: []*appsv1.DaemonSet{testDS("inpod-agent", "uid-old")}, pods: []*corev1.Pod{self},
				node: node(nil, corev1.Taint{Key: "dedicated", Effect: corev1.TaintEffectNoSchedule})}, false},
		"the NotReady taint every daemon tolerates: a restart": {
			evidenceCase{apiDS: []*appsv1.DaemonSet{testDS("inpod-agent", "uid-old")}, pods: []*corev1.Pod{self},
				node: node(nil, corev1.Taint{Key: corev1.TaintNodeNotReady, Effect: corev1.TaintEffectNoExecute})}, false},
		"the Node cannot be read: a restart": {evidenceCase{apiDS: []*appsv1.DaemonSet{selecting}, pods: []*corev1.Pod{self}}, false},
		"relabelled out, but another inpod agent serves the node: left for it": {
			evidenceCase{apiDS: []*appsv1.DaemonSet{selecting}, node: node(nil),
				pods: []*corev1.Pod{self, testAgentPod("agent-other", "node-1", testDS("inpod-other", "uid-other"))}}, false},
	}
	for name, tc := range cases {
		t.Run(name, func(t *testing.T) {
			if got := tc.c.watch(t).uninstalling(context.Background()); got != tc.want {
				t.Fatalf("uninstalling = %v, want %v", got, tc.want)
			}
		})
	}
}

// The agent's pod may leave the watch's cache before the agent decides (a
// forced deletion); what was last seen of it still counts.
func TestUninstallRemembersTheAgentsPod(t *testing.T) {
	old := testDS("inpod-agent", "uid-old")
	self := testAgentPod("agent-a", "node-1", old)
	c := evidenceCase{pods: []*corev1.Pod{self}}
	w := c.watch(t)
	w.checkSelf()
	idx := cache.NewIndexer(cache.MetaNamespaceKeyFunc, cache.Indexers{cache.NamespaceIndex: cache.MetaNamespaceIndexFunc})
	w.pods = listersv1.NewPodLister(idx)
	if !w.uninstalling(context.Background()) {
		t.Fatal("the remembered pod's DaemonSet is gone, yet no uninstall")
	}
}

// A selector that does not select the agent itself would not select the
// other agents either: removal is off.
func TestUninstallNeedsTheSelectorToSelectTheAgent(t *testing.T) {
	self := testAgentPod("agent-a", "node-1", testDS("inpod-agent", "uid-old"))
	w := evidenceCase{pods: []*corev1.Pod{self}}.watch(t)
	w.selector, _ = labels.Parse("app=other")
	if w.uninstalling(context.Background()) {
		t.Fatal("removal with a selector that does not select the agent")
	}
}
