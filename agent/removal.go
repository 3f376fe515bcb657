package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"syscall"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	appslisters "k8s.io/client-go/listers/apps/v1"
	listersv1 "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/tools/cache"
	corev1helpers "k8s.io/component-helpers/scheduling/corev1"
	"k8s.io/component-helpers/scheduling/corev1/nodeaffinity"
	"k8s.io/klog/v2"
)

// removalTimeout bounds removing inpod from the node at shutdown; keep the
// DaemonSet's terminationGracePeriodSeconds above it.
const removalTimeout = 20 * time.Second

// DefaultAgentSelector selects the pods of inpod agents, of any
// installation: a pod it selects on this node, other than the agent's own,
// is another agent that serves (or is about to serve) the node.
const DefaultAgentSelector = "app.kubernetes.io/name=inpod,app.kubernetes.io/component=agent"

// uninstallWatch gathers, while the agent runs, the evidence that tells an
// uninstall from a restart, an upgrade or a hand-over to another
// DaemonSet. Nothing here depends on a name that can be mistyped or
// reused: the agent's own pod (--pod-name, from the downward API) names its
// controlling DaemonSet by UID.
//
// The owner's deletion is learned from a watch on the DaemonSets of the
// agent's namespace, kept open while the agent runs: helm deletes the
// DaemonSet and then, in the same operation, the RBAC that lets the agent
// read it, and the kubelet's SIGTERM can come after that. An established
// watch keeps delivering events when the binding goes (authorization is
// checked when it is opened); a read made at SIGTERM would get 403. The
// direct read at shutdown is the fallback for when the watch has not seen
// the deletion.
type uninstallWatch struct {
	log      *slog.Logger
	client   kubernetes.Interface
	node     string
	self     types.NamespacedName
	selector labels.Selector
	pods     listersv1.PodLister // this node's pods, from the agent's pod watch

	daemonSets cache.SharedIndexInformer
	dsLister   appslisters.DaemonSetLister

	mu sync.Mutex
	// deleted holds the UIDs of DaemonSets the watch saw deleted or being
	// deleted.
	deleted map[types.UID]bool
	// lastSelf is the agent's pod as last seen, for when it has already
	// left the cache at shutdown (a forced deletion).
	lastSelf *corev1.Pod
}

func newUninstallWatch(log *slog.Logger, client kubernetes.Interface, node string, self types.NamespacedName, selector labels.Selector, pods listersv1.PodLister) *uninstallWatch {
	f := informers.NewSharedInformerFactoryWithOptions(client, 0, informers.WithNamespace(self.Namespace), informers.WithTransform(trimDaemonSet))
	ds := f.Apps().V1().DaemonSets()
	w := &uninstallWatch{log: log, client: client, node: node, self: self, selector: selector, pods: pods,
		daemonSets: ds.Informer(), dsLister: ds.Lister(), deleted: map[types.UID]bool{}}
	seen := func(obj any) {
		if d, ok := obj.(*appsv1.DaemonSet); ok && d.DeletionTimestamp != nil {
			w.markDeleted(d.UID)
		}
	}
	w.daemonSets.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    seen,
		UpdateFunc: func(_, obj any) { seen(obj) },
		DeleteFunc: func(obj any) {
			if d, ok := obj.(cache.DeletedFinalStateUnknown); ok {
				obj = d.Obj
			}
			if d, ok := obj.(*appsv1.DaemonSet); ok {
				w.markDeleted(d.UID)
			}
		},
	})
	return w
}

// trimDaemonSet keeps of a DaemonSet what the uninstall check reads from
// the watch: what identifies it, its deletion, its pods' labels.
func trimDaemonSet(obj any) (any, error) {
	d, ok := obj.(*appsv1.DaemonSet)
	if !ok {
		return obj, nil
	}
	out := &appsv1.DaemonSet{ObjectMeta: metav1.ObjectMeta{Name: d.Name, Namespace: d.Namespace, UID: d.UID,
		ResourceVersion: d.ResourceVersion, DeletionTimestamp: d.DeletionTimestamp}}
	out.Spec.Template.Labels = d.Spec.Template.Labels
	return out, nil
}

func (w *uninstallWatch) markDeleted(uid types.UID) {
	w.mu.Lock()
	w.deleted[uid] = true
	w.mu.Unlock()
}

func (w *uninstallWatch) wasDeleted(uid types.UID) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.deleted[uid]
}

// run keeps the DaemonSet watch open until stop is closed: it must outlive
// the agent's context, so that a deletion in flight at SIGTERM still
// arrives. It does not wait for the watch to sync: without the RBAC to read
// DaemonSets the agent still runs, and simply never removes anything.
func (w *uninstallWatch) run(stop <-chan struct{}) { w.daemonSets.Run(stop) }

// checkSelf says at start whether uninstall can be detected, so a wrong
// --pod-name or --agent-selector shows in the log when the agent starts,
// not at an uninstall.
func (w *uninstallWatch) checkSelf() {
	self, err := w.pods.Pods(w.self.Namespace).Get(w.self.Name)
	if err != nil {
		w.log.Warn("the agent's own pod is not among this node's pods: it will never remove inpod from the node at shutdown",
			"pod", w.self, "err", err)
		return
	}
	w.remember(self)
	if _, why := w.ownerOf(self); why != "" {
		w.log.Warn("the agent will never remove inpod from the node at shutdown: "+why, "pod", w.self)
	}
}

func (w *uninstallWatch) remember(p *corev1.Pod) {
	w.mu.Lock()
	w.lastSelf = p
	w.mu.Unlock()
}

// ownerOf is the DaemonSet that controls the agent's pod, or why there is
// none to judge by.
func (w *uninstallWatch) ownerOf(self *corev1.Pod) (*metav1.OwnerReference, string) {
	if self.Spec.NodeName != w.node {
		return nil, fmt.Sprintf("the pod named by --pod-name runs on node %q, not this one", self.Spec.NodeName)
	}
	if !w.selector.Matches(labels.Set(self.Labels)) {
		// Other agents are recognised by the same selector; if it does not
		// select this agent, it would not select them either.
		return nil, fmt.Sprintf("the agent's own pod does not match --agent-selector %q", w.selector)
	}
	ref := metav1.GetControllerOf(self)
	if ref == nil || ref.Kind != "DaemonSet" || ref.APIVersion != appsv1.SchemeGroupVersion.String() {
		return nil, "the agent's pod is not controlled by a DaemonSet"
	}
	return ref, ""
}

// uninstalling decides, at shutdown, whether inpod is being removed from the
// node: only on unambiguous evidence (invariant 5, docs/design/invariants.md).
// It answers yes only when
//   - the DaemonSet that controls the agent's own pod, identified by UID, is
//     gone or being deleted (seen by the watch, or read now: not found,
//     being deleted, or its name now belongs to another object), or, read
//     now, no longer runs a pod on this node (its node selector or required
//     node affinity no longer matches the Node, or the Node has a NoExecute
//     taint it does not tolerate: the DaemonSet controller deletes its pod
//     for either, and never starts another here), and
//   - no other inpod agent serves this node: no other pod on this node that
//     the agent selector selects, is not terminating and is controlled by a
//     DaemonSet not known to be deleted; and no other live DaemonSet in the
//     agent's namespace whose pods the selector selects (its pod may not
//     have been created on this node yet: a rename creates the new
//     DaemonSet just before deleting the old).
//
// Anything unknown (no --pod-name, the own pod never seen, a read refused)
// answers no: leaving inpod in place fails closed, removing it by mistake
// lets enrolled pods run unredirected.
func (w *uninstallWatch) uninstalling(ctx context.Context) bool {
	self, err := w.pods.Pods(w.self.Namespace).Get(w.self.Name)
	if err != nil {
		w.mu.Lock()
		self = w.lastSelf
		w.mu.Unlock()
	}
	if self == nil {
		w.log.Info("cannot tell an uninstall from a restart (the agent's pod was never seen); leaving inpod in place", "pod", w.self)
		return false
	}
	owner, why := w.ownerOf(self)
	if owner == nil {
		w.log.Info("cannot tell an uninstall from a restart ("+why+"); leaving inpod in place", "pod", w.self)
		return false
	}
	gone, how, successor, ds := w.ownerGone(ctx, owner)
	if !gone && ds != nil {
		if why := w.notOnThisNode(ctx, ds); why != "" {
			gone, how = true, "it no longer runs on this node: "+why
		}
	}
	if !gone {
		w.log.Info("the agent's DaemonSet is in place ("+how+"): a restart or an upgrade", "daemonset", owner.Name, "uid", owner.UID)
		return false
	}
	peer := successor
	if peer == "" {
		peer = w.peer(ctx, self, owner)
	}
	if peer != "" {
		w.log.Info("the agent's DaemonSet is gone from this node ("+how+") but another inpod agent serves it: leaving inpod in place for it",
			"daemonset", owner.Name, "uid", owner.UID, "other", peer)
		return false
	}
	w.log.Info("the agent's DaemonSet is gone from this node ("+how+") and no other inpod agent serves it: removing inpod from this node",
		"daemonset", owner.Name, "uid", owner.UID)
	return true
}

// ownerGone reports whether the DaemonSet owner is gone or being deleted,
// and how that is known; successor names an inpod DaemonSet that now has
// its name (deleted and created again: kubectl replace --force). When the
// owner is in place, ds is it as read now.
func (w *uninstallWatch) ownerGone(ctx context.Context, owner *metav1.OwnerReference) (gone bool, how, successor string, ds *appsv1.DaemonSet) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	ds, err := w.client.AppsV1().DaemonSets(w.self.Namespace).Get(ctx, owner.Name, metav1.GetOptions{})
	if w.wasDeleted(owner.UID) {
		// Known gone; a read that still works can only add a successor
		// created under the same name (kubectl replace --force) that the
		// watch has not delivered yet. A refused read (RBAC deleted with
		// the DaemonSet) changes nothing.
		if err == nil && ds.UID != owner.UID && ds.DeletionTimestamp == nil && w.selector.Matches(labels.Set(ds.Spec.Template.Labels)) {
			successor = "DaemonSet " + ds.Namespace + "/" + ds.Name + " (created again under the same name)"
		}
		return true, "the watch saw it deleted", successor, nil
	}
	switch {
	case apierrors.IsNotFound(err):
		return true, "not found", "", nil
	case err != nil:
		return false, "cannot read it: " + err.Error(), "", nil
	case ds.UID != owner.UID:
		if ds.DeletionTimestamp == nil && w.selector.Matches(labels.Set(ds.Spec.Template.Labels)) {
			successor = "DaemonSet " + ds.Namespace + "/" + ds.Name + " (created again under the same name)"
		}
		return true, "its name belongs to another DaemonSet now", successor, nil
	case ds.DeletionTimestamp != nil:
		return true, "being deleted", "", nil
	}
	return false, "read now", "", ds
}

// daemonSetTolerations are the NoExecute tolerations the DaemonSet
// controller adds to every pod it creates: a node going NotReady or
// unreachable does not take its daemons away.
var daemonSetTolerations = []corev1.Toleration{
	{Key: corev1.TaintNodeNotReady, Operator: corev1.TolerationOpExists, Effect: corev1.TaintEffectNoExecute},
	{Key: corev1.TaintNodeUnreachable, Operator: corev1.TolerationOpExists, Effect: corev1.TaintEffectNoExecute},
}

// notOnThisNode says why ds no longer runs a pod on this node, or "" when
// it does or the Node cannot be read. It judges as the DaemonSet
// controller does whether a running daemon pod may continue: the
// template's node selector and required node affinity must match the Node,
// and every NoExecute taint of the Node must be tolerated. (A NoSchedule
// taint keeps a running daemon.)
func (w *uninstallWatch) notOnThisNode(ctx context.Context, ds *appsv1.DaemonSet) string {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	node, err := w.client.CoreV1().Nodes().Get(ctx, w.node, metav1.GetOptions{})
	if err != nil {
		w.log.Info("cannot read this Node to tell whether the agent's DaemonSet still runs here; taking it that it does", "node", w.node, "err", err)
		return ""
	}
	pod := &corev1.Pod{Spec: *ds.Spec.Template.Spec.DeepCopy()}
	if ok, err := nodeaffinity.GetRequiredNodeAffinity(pod).Match(node); err != nil {
		w.log.Info("cannot match the agent's DaemonSet's node affinity; taking it that it still runs here", "err", err)
		return ""
	} else if !ok {
		return "its node selector or required node affinity no longer matches this Node"
	}
	tolerations := append(append([]corev1.Toleration(nil), pod.Spec.Tolerations...), daemonSetTolerations...)
	if taint, untolerated := corev1helpers.FindMatchingUntoleratedTaint(klog.Background(), node.Spec.Taints, tolerations, func(t *corev1.Taint) bool {
		return t.Effect == corev1.TaintEffectNoExecute
	}, false); untolerated {
		return fmt.Sprintf("the Node's taint %s=%s:%s is not tolerated", taint.Key, taint.Value, taint.Effect)
	}
	return ""
}

// peer names another inpod agent that serves this node, or returns "".
func (w *uninstallWatch) peer(ctx context.Context, self *corev1.Pod, owner *metav1.OwnerReference) string {
	// The watch's last view and a fresh read of this node's agent pods,
	// together: the pod watch stopped with the agent, and a successor's pod
	// may have been created since. A refused read (RBAC gone) adds nothing;
	// a pod in only one of them counts, which can only keep inpod in place.
	pods, _ := w.pods.List(w.selector)
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if list, err := w.client.CoreV1().Pods(metav1.NamespaceAll).List(ctx, metav1.ListOptions{
		LabelSelector: w.selector.String(), FieldSelector: "spec.nodeName=" + w.node}); err == nil {
		for i := range list.Items {
			pods = append(pods, &list.Items[i])
		}
	}
	for _, p := range pods {
		if p.UID == self.UID || p.Spec.NodeName != w.node || p.DeletionTimestamp != nil ||
			p.Status.Phase == corev1.PodSucceeded || p.Status.Phase == corev1.PodFailed {
			continue
		}
		ref := metav1.GetControllerOf(p)
		if ref == nil || ref.Kind != "DaemonSet" || ref.UID == owner.UID || w.wasDeleted(ref.UID) {
			continue
		}
		return "pod " + p.Namespace + "/" + p.Name + " of DaemonSet " + ref.Name
	}
	// The watch's view; empty when it never synced, which only makes the
	// pod check above the one that counts.
	daemonSets, _ := w.dsLister.DaemonSets(w.self.Namespace).List(labels.Everything())
	for _, d := range daemonSets {
		if d.UID == owner.UID || d.DeletionTimestamp != nil || w.wasDeleted(d.UID) {
			continue
		}
		if w.selector.Matches(labels.Set(d.Spec.Template.Labels)) {
			return "DaemonSet " + d.Namespace + "/" + d.Name
		}
	}
	return ""
}

// removeFromNode undoes everything the agent did on the node, in the order
// that keeps pods safe: first the plugin leaves the CNI configuration (new
// pods start without inpod), then every enrolled pod loses its rules and
// ztunnel is told, then the node-wide pieces go. Callers have stopped the
// CNI server, the installer's watch and the reconciler. Nothing before the
// annotations needs the API server, so a removal whose RBAC is already gone
// still clears the node.
func (a *Agent) removeFromNode(p *pieces) error {
	ctx, cancel := context.WithTimeout(context.Background(), removalTimeout)
	defer cancel()
	var errs []error
	cniRemoved := false
	if p.installer != nil {
		if err := p.installer.Uninstall(); err != nil {
			errs = append(errs, err)
		} else {
			cniRemoved = true
		}
		if err := os.Remove(p.apiAccessPath); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	if err := p.pipeline.UnenrollAll(ctx); err != nil {
		errs = append(errs, err)
	}
	if err := p.probes.Uninstall(); err != nil {
		errs = append(errs, err)
	}
	if err := os.RemoveAll(p.passListPath); err != nil {
		errs = append(errs, err)
	}
	// Each pod taken out dropped its record; one left names a pod whose
	// rules could not be removed, for a later install to find.
	if err := os.Remove(p.records.Path()); errors.Is(err, syscall.ENOTEMPTY) {
		left, _ := p.records.List()
		a.log.Warn("pods whose rules may still be in place keep their record, for a later install to find", "dir", p.records.Path(), "uids", left)
	} else if err != nil && !errors.Is(err, os.ErrNotExist) {
		errs = append(errs, err)
	}
	// Last, as the steps that need the API server. The gates have
	// stopped, so a removed ResourceSlice is not written again; the
	// writer's loop has stopped with the agent, the pods' redirection
	// annotations are removed here.
	for _, g := range a.gates {
		if r, ok := g.(nodeRemover); ok {
			if err := r.RemoveFromNode(ctx); err != nil {
				errs = append(errs, fmt.Errorf("gate %s: %w", g.Name(), err))
			}
		}
	}
	if err := p.annotations.Flush(ctx); err != nil {
		errs = append(errs, err)
	}
	// The label goes only with the plugin: a node that may still chain
	// it keeps the mark the uninstall hook looks for.
	if p.nodeMark != nil && cniRemoved {
		if err := p.nodeMark.patch(ctx, false); err != nil {
			errs = append(errs, err)
		}
	}
	// Out of the mesh, no pod has anything left to prove: a gated pod
	// left False (or never set) would stay unready with nobody to set it.
	all, _ := p.podInf.Core().V1().Pods().Lister().List(labels.Everything())
	p.pipeline.ReleaseGates(all)
	if err := p.conditions.Flush(ctx); err != nil {
		errs = append(errs, err)
	}
	if err := errors.Join(errs...); err != nil {
		a.log.Error("inpod was only partly removed from this node", "err", err)
		return err
	}
	a.log.Info("inpod removed from this node: CNI plugin and configuration, every pod's rules, host probe rules, the gates' objects")
	return nil
}
