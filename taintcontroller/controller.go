package taintcontroller

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	listerscorev1 "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/leaderelection"
	"k8s.io/client-go/tools/leaderelection/resourcelock"
	"k8s.io/client-go/tools/record"
	"k8s.io/client-go/util/retry"
	"k8s.io/client-go/util/workqueue"
)

// Defaults of Config.
const (
	DefaultTaintKey      = "inpod.dev/not-ready"
	DefaultTaintEffect   = corev1.TaintEffectNoSchedule
	DefaultAgentSelector = "app.kubernetes.io/name=inpod,app.kubernetes.io/component=agent"
	DefaultNamespace     = "inpod-system"
	DefaultLeaseName     = "inpod-controller"
	DefaultGrace         = 30 * time.Second
	// DefaultWorkers: a reconcile mostly waits for its patch's round
	// trip, so many nodes turning ready at once need many in flight (the
	// client's QPS and burst still bound the load). make bench, 200 nodes
	// at once: 8 workers, median 0.4–0.7 s; 32 workers, 0.15–0.22 s.
	DefaultWorkers       = 32
	DefaultLeaseDuration = 15 * time.Second
	DefaultRenewDeadline = 10 * time.Second
	DefaultRetryPeriod   = 2 * time.Second
	// DefaultCacheSyncTimeout: a first list of every node and agent pod
	// takes seconds even on large clusters.
	DefaultCacheSyncTimeout = 2 * time.Minute
	// DefaultQPS and DefaultBurst are the client-side rate limits
	// inpod-controller's API client gets: a burst of 200 node writes (a
	// pool of nodes turning ready at once) goes out without waiting.
	DefaultQPS   = 100
	DefaultBurst = 200
)

const (
	eventReasonRemoved = "StartupTaintRemoved"
	eventReasonAdded   = "StartupTaintAdded"
	podNodeIndex       = "spec.nodeName"
	// healthzLeaseTolerance: /healthz fails when this replica leads but
	// has not renewed the Lease for this long past its deadline.
	healthzLeaseTolerance = 20 * time.Second
)

// Config configures the controller.
type Config struct {
	Client kubernetes.Interface
	Mode   Mode
	// TaintKey and TaintEffect name the startup taint; only taints with
	// both are ever edited.
	TaintKey    string
	TaintEffect corev1.TaintEffect
	// PreviousTaints are startup taints of an earlier configuration (the
	// key changed on upgrade): nothing removes them otherwise, and they
	// would keep every pod off the nodes that carry them for good. They are
	// only ever removed, and only when the startup taint itself would be (a
	// node ready, in bootstrap mode not yet done), in the same write; never
	// added. An entry without an effect matches NoSchedule and
	// PreferNoSchedule.
	PreviousTaints []corev1.Taint
	// NodeSelector is a label selector; nodes outside it are not watched
	// and never written. Empty: every node.
	NodeSelector string
	// AgentNamespace and AgentSelector find the agent pods (empty
	// namespace: all namespaces).
	AgentNamespace string
	AgentSelector  string
	// Grace is how long continuous mode waits before it taints a node
	// whose agent pod is missing or not Ready, or whose condition is
	// missing or Unknown. An explicit False taints at once.
	Grace   time.Duration
	Workers int
	// The Lease the replicas elect a leader on.
	LeaseNamespace, LeaseName, Identity       string
	LeaseDuration, RenewDeadline, RetryPeriod time.Duration
	// ReleaseOnCancel gives the Lease up when ctx ends, so another replica
	// takes over at once instead of after LeaseDuration.
	ReleaseOnCancel bool
	// CacheSyncTimeout bounds a new leader's wait for its node and pod
	// caches; past it the leader gives the Lease up and Run fails (a leader
	// that cannot see the nodes would hold the Lease and remove no taint).
	CacheSyncTimeout time.Duration
	// HealthAddr serves /healthz and /readyz, MetricsAddr /metrics; empty:
	// not served.
	HealthAddr, MetricsAddr string
	Metrics                 *Metrics
	Logger                  *slog.Logger
}

// Controller removes (and in continuous mode adds) the startup taint.
type Controller struct {
	cfg     Config
	log     *slog.Logger
	nodeSel labels.Selector
	now     func() time.Time

	leading atomic.Bool
	synced  atomic.Bool
	healthz *leaderelection.HealthzAdaptor

	mu            sync.Mutex
	notReadySince map[string]time.Time
}

// New validates cfg and fills defaults.
func New(cfg Config) (*Controller, error) {
	if cfg.Client == nil {
		return nil, errors.New("taintcontroller: no API client")
	}
	switch cfg.Mode {
	case "":
		cfg.Mode = Bootstrap
	case Bootstrap, Continuous:
	default:
		return nil, fmt.Errorf("taintcontroller: mode %q: want bootstrap or continuous", cfg.Mode)
	}
	if cfg.TaintKey == "" {
		cfg.TaintKey = DefaultTaintKey
	}
	switch cfg.TaintEffect {
	case "":
		cfg.TaintEffect = DefaultTaintEffect
	case corev1.TaintEffectNoSchedule, corev1.TaintEffectPreferNoSchedule:
	case corev1.TaintEffectNoExecute:
		// NoExecute would evict running pods when the node turns not
		// ready; readiness flips must never disturb running pods.
		return nil, errors.New("taintcontroller: effect NoExecute would evict running pods; use NoSchedule")
	default:
		return nil, fmt.Errorf("taintcontroller: unknown taint effect %q", cfg.TaintEffect)
	}
	if errs := validateTaintKey(cfg.TaintKey); errs != nil {
		return nil, fmt.Errorf("taintcontroller: taint key %q: %v", cfg.TaintKey, errs)
	}
	var previous []corev1.Taint
	for _, p := range cfg.PreviousTaints {
		if errs := validateTaintKey(p.Key); errs != nil {
			return nil, fmt.Errorf("taintcontroller: previous taint key %q: %v", p.Key, errs)
		}
		switch p.Effect {
		case "", corev1.TaintEffectNoSchedule, corev1.TaintEffectPreferNoSchedule:
		default:
			return nil, fmt.Errorf("taintcontroller: previous taint %s: effect %q: want NoSchedule, PreferNoSchedule or none (both)", p.Key, p.Effect)
		}
		// The current taint is never "previous": it is added too, and an
		// entry of its key alone would also match the key's other effect,
		// which is not inpod's unless named. Compared by key, then; only
		// another effect named explicitly stays (the effect changed on
		// upgrade: the chart passes the deployed key:effect).
		if p.Key == cfg.TaintKey && (p.Effect == "" || p.Effect == cfg.TaintEffect) {
			continue
		}
		previous = append(previous, corev1.Taint{Key: p.Key, Effect: p.Effect})
	}
	cfg.PreviousTaints = previous
	sel, err := labels.Parse(cfg.NodeSelector)
	if err != nil {
		return nil, fmt.Errorf("taintcontroller: node selector: %w", err)
	}
	if cfg.AgentSelector == "" {
		cfg.AgentSelector = DefaultAgentSelector
	}
	if _, err := labels.Parse(cfg.AgentSelector); err != nil {
		return nil, fmt.Errorf("taintcontroller: agent selector: %w", err)
	}
	if cfg.Grace <= 0 {
		cfg.Grace = DefaultGrace
	}
	if cfg.Workers <= 0 {
		cfg.Workers = DefaultWorkers
	}
	if cfg.LeaseNamespace == "" {
		cfg.LeaseNamespace = DefaultNamespace
	}
	if cfg.LeaseName == "" {
		cfg.LeaseName = DefaultLeaseName
	}
	if cfg.Identity == "" {
		host, _ := os.Hostname()
		cfg.Identity = fmt.Sprintf("%s_%d_%d", host, os.Getpid(), time.Now().UnixNano())
	}
	if cfg.LeaseDuration <= 0 {
		cfg.LeaseDuration = DefaultLeaseDuration
	}
	if cfg.RenewDeadline <= 0 {
		cfg.RenewDeadline = DefaultRenewDeadline
	}
	if cfg.RetryPeriod <= 0 {
		cfg.RetryPeriod = DefaultRetryPeriod
	}
	if cfg.CacheSyncTimeout <= 0 {
		cfg.CacheSyncTimeout = DefaultCacheSyncTimeout
	}
	if cfg.Metrics == nil {
		cfg.Metrics = NewMetrics()
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	return &Controller{
		cfg:           cfg,
		log:           log.With("component", "taintcontroller", "identity", cfg.Identity),
		nodeSel:       sel,
		now:           time.Now,
		healthz:       leaderelection.NewLeaderHealthzAdaptor(healthzLeaseTolerance),
		notReadySince: map[string]time.Time{},
	}, nil
}

// Run serves health and metrics, and competes for the Lease until ctx ends;
// while leading it reconciles nodes. It returns an error when leadership is
// lost while ctx is live (the process should exit and start over).
func (c *Controller) Run(parent context.Context) error {
	ctx, cancel := context.WithCancel(parent)
	defer cancel()
	var serveErr atomic.Pointer[error]
	serveDone := make(chan struct{})
	if c.cfg.HealthAddr != "" || c.cfg.MetricsAddr != "" {
		go func() {
			defer close(serveDone)
			if err := c.serve(ctx); err != nil {
				serveErr.Store(&err)
				cancel()
			}
		}()
	} else {
		close(serveDone)
	}
	// The election runs on a context of its own, ended only once the
	// workers have stopped: client-go releases the Lease (ReleaseOnCancel)
	// as soon as its context ends, without waiting for OnStartedLeading, and
	// the next leader would start while this one's workers still write.
	ectx, ecancel := context.WithCancel(context.WithoutCancel(parent))
	defer ecancel()
	var (
		mu       sync.Mutex
		leadDone chan struct{} // closed when OnStartedLeading returns; nil until it starts
		closed   bool          // le.Run has returned: a late OnStartedLeading must not lead
		leadErr  atomic.Pointer[error]
	)
	waitLead := func() {
		mu.Lock()
		d := leadDone
		mu.Unlock()
		if d != nil {
			<-d
		}
	}
	go func() {
		select {
		case <-ctx.Done():
		case <-ectx.Done():
			return
		}
		waitLead() // the workers stop on ctx (below), then the Lease goes
		ecancel()
	}()
	le, err := leaderelection.NewLeaderElector(leaderelection.LeaderElectionConfig{
		Lock: &resourcelock.LeaseLock{
			LeaseMeta:  metav1.ObjectMeta{Namespace: c.cfg.LeaseNamespace, Name: c.cfg.LeaseName},
			Client:     c.cfg.Client.CoordinationV1(),
			LockConfig: resourcelock.ResourceLockConfig{Identity: c.cfg.Identity},
		},
		LeaseDuration:   c.cfg.LeaseDuration,
		RenewDeadline:   c.cfg.RenewDeadline,
		RetryPeriod:     c.cfg.RetryPeriod,
		ReleaseOnCancel: c.cfg.ReleaseOnCancel,
		WatchDog:        c.healthz,
		Name:            c.cfg.LeaseName,
		Callbacks: leaderelection.LeaderCallbacks{
			OnStartedLeading: func(lctx context.Context) {
				mu.Lock()
				if closed || ctx.Err() != nil {
					mu.Unlock()
					return
				}
				done := make(chan struct{})
				leadDone = done
				mu.Unlock()
				defer close(done)
				// The workers stop when leadership is lost or on shutdown.
				wctx, wcancel := context.WithCancel(lctx)
				defer wcancel()
				defer context.AfterFunc(ctx, wcancel)()
				c.leading.Store(true)
				c.cfg.Metrics.leader.Set(1)
				c.log.Info("leading: reconciling nodes")
				err := c.lead(wctx)
				if err == nil && wctx.Err() == nil {
					err = errors.New("taintcontroller: stopped reconciling while leading")
				}
				if err != nil {
					// A leader that does not reconcile must not keep the
					// Lease: give it up and exit, so another replica leads.
					leadErr.Store(&err)
					c.log.Error("giving up leadership", "err", err)
					c.leading.Store(false)
					c.cfg.Metrics.leader.Set(0)
					ecancel()
				}
			},
			OnStoppedLeading: func() {
				c.leading.Store(false)
				c.cfg.Metrics.leader.Set(0)
			},
		},
	})
	if err != nil {
		return fmt.Errorf("taintcontroller: leader election: %w", err)
	}
	le.Run(ectx)
	mu.Lock()
	closed = true
	mu.Unlock()
	// le.Run returns as soon as renewing stops; the workers may still be
	// finishing a write under the (now cancelled) leading context.
	waitLead()
	c.leading.Store(false)
	c.cfg.Metrics.leader.Set(0)
	cancel()
	<-serveDone
	if p := serveErr.Load(); p != nil {
		return fmt.Errorf("taintcontroller: serving health or metrics: %w", *p)
	}
	if p := leadErr.Load(); p != nil {
		return *p
	}
	if parent.Err() == nil {
		return errors.New("taintcontroller: lost leadership")
	}
	return nil
}

// lead runs the informers and workers until ctx ends.
func (c *Controller) lead(ctx context.Context) error {
	client := c.cfg.Client
	nodeFactory := informers.NewSharedInformerFactoryWithOptions(client, 0,
		informers.WithTweakListOptions(func(o *metav1.ListOptions) { o.LabelSelector = c.nodeSel.String() }),
		informers.WithTransform(trimNode))
	podFactory := informers.NewSharedInformerFactoryWithOptions(client, 0,
		informers.WithNamespace(c.cfg.AgentNamespace),
		informers.WithTweakListOptions(func(o *metav1.ListOptions) { o.LabelSelector = c.cfg.AgentSelector }),
		informers.WithTransform(trimAgentPod))
	nodeInf := nodeFactory.Core().V1().Nodes()
	podInf := podFactory.Core().V1().Pods()
	if err := podInf.Informer().AddIndexers(cache.Indexers{podNodeIndex: func(obj any) ([]string, error) {
		if p, ok := obj.(*corev1.Pod); ok && p.Spec.NodeName != "" {
			return []string{p.Spec.NodeName}, nil
		}
		return nil, nil
	}}); err != nil {
		return err
	}
	queue := workqueue.NewTypedRateLimitingQueueWithConfig(
		workqueue.NewTypedItemExponentialFailureRateLimiter[string](50*time.Millisecond, 30*time.Second),
		workqueue.TypedRateLimitingQueueConfig[string]{Name: "inpod-taint"})
	defer queue.ShutDown()
	enqNode := func(obj any) {
		if t, ok := obj.(cache.DeletedFinalStateUnknown); ok {
			obj = t.Obj
		}
		if n, ok := obj.(*corev1.Node); ok {
			queue.Add(n.Name)
		}
	}
	enqPod := func(obj any) {
		if t, ok := obj.(cache.DeletedFinalStateUnknown); ok {
			obj = t.Obj
		}
		if p, ok := obj.(*corev1.Pod); ok && p.Spec.NodeName != "" {
			queue.Add(p.Spec.NodeName)
		}
	}
	if _, err := nodeInf.Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc: enqNode, UpdateFunc: func(_, n any) { enqNode(n) }, DeleteFunc: enqNode,
	}); err != nil {
		return err
	}
	if _, err := podInf.Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc: enqPod, UpdateFunc: func(o, n any) { enqPod(o); enqPod(n) }, DeleteFunc: enqPod,
	}); err != nil {
		return err
	}
	// Shutdown waits for the informers, which stop on ctx: end it first
	// when lead returns early (the caches not synced).
	ctx, cancel := context.WithCancel(ctx)
	nodeFactory.Start(ctx.Done())
	podFactory.Start(ctx.Done())
	defer nodeFactory.Shutdown()
	defer podFactory.Shutdown()
	defer cancel()
	sctx, scancel := context.WithTimeout(ctx, c.cfg.CacheSyncTimeout)
	defer scancel()
	if !cache.WaitForCacheSync(sctx.Done(), nodeInf.Informer().HasSynced, podInf.Informer().HasSynced) {
		if ctx.Err() != nil {
			return nil
		}
		return fmt.Errorf("taintcontroller: node and agent pod caches not synced after %s", c.cfg.CacheSyncTimeout)
	}
	c.synced.Store(true)
	defer c.synced.Store(false)

	recorder, stopEvents := c.eventRecorder(ctx)
	defer stopEvents()
	r := &reconciler{c: c, nodes: nodeInf.Lister(), pods: podInf.Informer().GetIndexer(), queue: queue, events: recorder}
	var wg sync.WaitGroup
	for range c.cfg.Workers {
		wg.Go(func() {
			for r.next(ctx) {
			}
		})
	}
	<-ctx.Done()
	queue.ShutDown()
	wg.Wait()
	c.mu.Lock()
	clear(c.notReadySince)
	c.mu.Unlock()
	return nil
}

func (c *Controller) eventRecorder(ctx context.Context) (record.EventRecorder, func()) {
	b := record.NewBroadcaster(record.WithContext(context.WithoutCancel(ctx)))
	b.StartRecordingToSink(&typedcorev1.EventSinkImpl{Interface: c.cfg.Client.CoreV1().Events("")})
	return b.NewRecorder(scheme.Scheme, corev1.EventSource{Component: "inpod-controller"}), b.Shutdown
}

type reconciler struct {
	c      *Controller
	nodes  listerscorev1.NodeLister
	pods   cache.Indexer
	queue  workqueue.TypedRateLimitingInterface[string]
	events record.EventRecorder
}

func (r *reconciler) next(ctx context.Context) bool {
	name, quit := r.queue.Get()
	if quit {
		return false
	}
	defer r.queue.Done(name)
	if err := r.reconcile(ctx, name); err != nil {
		if ctx.Err() != nil {
			return true
		}
		r.c.cfg.Metrics.reconcileErrors.Inc()
		r.c.log.Warn("reconcile failed; retrying", "node", name, "err", err)
		r.queue.AddRateLimited(name)
		return true
	}
	r.queue.Forget(name)
	return true
}

func (r *reconciler) agents(node string) []*corev1.Pod {
	objs, _ := r.pods.ByIndex(podNodeIndex, node)
	out := make([]*corev1.Pod, 0, len(objs))
	for _, o := range objs {
		out = append(out, o.(*corev1.Pod))
	}
	return out
}

// agentsAnywhere says whether any agent pod, on any node, is not being
// deleted. Terminating pods do not count: uninstalling deletes the
// DaemonSet, and its pods terminate for a while.
func (r *reconciler) agentsAnywhere() bool {
	for _, o := range r.pods.List() {
		if o.(*corev1.Pod).DeletionTimestamp == nil {
			return true
		}
	}
	return false
}

// plan decides for node as read, tracking how long it has been not ready.
func (r *reconciler) plan(node *corev1.Node) (observation, action, time.Duration) {
	c := r.c
	o := observe(node, c.cfg.TaintKey, c.cfg.TaintEffect, c.cfg.PreviousTaints, r.agents(node.Name))
	if c.cfg.Mode == Continuous && !o.tainted && !o.ready() && o.cond != "" {
		o.agentsAnywhere = r.agentsAnywhere()
	}
	var notReadyFor time.Duration
	c.mu.Lock()
	// Keyed by UID: a Node recreated with the same name starts afresh.
	key := node.Name + "/" + string(node.UID)
	if o.ready() {
		delete(c.notReadySince, key)
	} else {
		since, ok := c.notReadySince[key]
		if !ok {
			since = c.now()
			c.notReadySince[key] = since
		}
		notReadyFor = c.now().Sub(since)
	}
	c.mu.Unlock()
	a, recheck := decide(c.cfg.Mode, o, notReadyFor, c.cfg.Grace)
	return o, a, recheck
}

func (r *reconciler) reconcile(ctx context.Context, name string) error {
	c := r.c
	node, err := r.nodes.Get(name)
	if apierrors.IsNotFound(err) {
		c.mu.Lock()
		for k := range c.notReadySince {
			if len(k) > len(name) && k[:len(name)+1] == name+"/" {
				delete(c.notReadySince, k)
			}
		}
		c.mu.Unlock()
		return nil
	}
	if err != nil {
		return err
	}
	o, a, recheck := r.plan(node)
	if a == none {
		if recheck > 0 {
			r.queue.AddAfter(name, recheck)
		}
		return nil
	}
	fresh := false
	return retry.RetryOnConflict(retry.DefaultBackoff, func() error {
		if fresh {
			// The cached Node was stale: decide again on the Node as the
			// API server has it now.
			n, err := c.cfg.Client.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
			if apierrors.IsNotFound(err) {
				return nil
			}
			if err != nil {
				return err
			}
			if !c.nodeSel.Matches(labels.Set(n.Labels)) {
				return nil
			}
			node = n
			if o, a, _ = r.plan(node); a == none {
				return nil
			}
		}
		fresh = true
		return r.write(ctx, node, o, a)
	})
}

// write applies a to node with one merge patch that carries node's
// resourceVersion: the API server refuses it (Conflict) if the Node changed
// since it was read, so a concurrent change to anything else on the Node —
// another taint in particular — is never overwritten.
func (r *reconciler) write(ctx context.Context, node *corev1.Node, o observation, a action) error {
	c := r.c
	meta := map[string]any{"resourceVersion": node.ResourceVersion}
	body := map[string]any{"metadata": meta}
	if c.cfg.Mode == Bootstrap && (a == removeTaint || a == markDone) {
		// Rewritten on every such write: it now names the current taint,
		// whatever an earlier annotation named.
		meta["annotations"] = map[string]string{DoneAnnotation: doneValue(c.now(), c.cfg.TaintKey, c.cfg.TaintEffect)}
	}
	var removed []string
	switch a {
	case removeTaint:
		taints := withoutTaint(node.Spec.Taints, c.cfg.TaintKey, c.cfg.TaintEffect, c.cfg.PreviousTaints)
		for _, t := range node.Spec.Taints {
			if !slices.Contains(taints, t) {
				removed = append(removed, t.Key+":"+string(t.Effect))
			}
		}
		if len(taints) == 0 {
			body["spec"] = map[string]any{"taints": nil}
		} else {
			body["spec"] = map[string]any{"taints": taints}
		}
	case addTaint:
		// Previous taints stay: the node is not ready.
		taints := append(withoutTaint(node.Spec.Taints, c.cfg.TaintKey, c.cfg.TaintEffect, nil),
			corev1.Taint{Key: c.cfg.TaintKey, Effect: c.cfg.TaintEffect})
		body["spec"] = map[string]any{"taints": taints}
		// A done mark left by bootstrap mode would name exactly this
		// taint: back in bootstrap mode the node would count as done and
		// keep it for good. Tainted again, it is not done.
		if _, ok := node.Annotations[DoneAnnotation]; ok {
			meta["annotations"] = map[string]any{DoneAnnotation: nil}
		}
	}
	patch, err := json.Marshal(body)
	if err != nil {
		return err
	}
	if _, err := c.cfg.Client.CoreV1().Nodes().Patch(ctx, node.Name, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		return err
	}
	taint := c.cfg.TaintKey + ":" + string(c.cfg.TaintEffect)
	switch a {
	case removeTaint:
		c.cfg.Metrics.removed.Inc()
		// Latency of the current taint only: a previous taint removed from a
		// node ready for days (after a key change) would skew it.
		if !o.condSince.IsZero() && slices.Contains(removed, taint) {
			c.cfg.Metrics.untaintLatency.Observe(max(0, c.now().Sub(o.condSince)).Seconds())
		}
		what := strings.Join(removed, ", ")
		r.events.Eventf(node, corev1.EventTypeNormal, eventReasonRemoved,
			"removed %s: InPodRedirectionReady is True and the inpod agent pod is Ready (mode %s)", what, c.cfg.Mode)
		// "taints": what this write removed, which may be only a previous
		// taint (--taint alone would name one that was not there).
		c.log.Info("startup taint removed", "node", node.Name, "taints", what, "mode", c.cfg.Mode)
	case addTaint:
		c.cfg.Metrics.added.Inc()
		why := "InPodRedirectionReady is " + string(o.cond)
		if o.cond == corev1.ConditionTrue || o.cond == "" || o.cond == corev1.ConditionUnknown {
			why = fmt.Sprintf("no Ready inpod agent pod or no True InPodRedirectionReady for %s", c.cfg.Grace)
		}
		r.events.Eventf(node, corev1.EventTypeWarning, eventReasonAdded, "added %s: %s", taint, why)
		c.log.Info("startup taint added", "node", node.Name, "taint", taint, "why", why)
	case markDone:
		c.log.Info("node ready without the startup taint; bootstrap recorded", "node", node.Name)
	}
	return nil
}
