// Package nodecondition is the scheduling gate in taint mode: the agent
// writes the Node condition InPodRedirectionReady from the readiness
// aggregate, and inpod-controller (or node-readiness-controller) turns it
// into the node's startup taint.
//
// It writes on transitions, and to repair its Node (recreated, or the
// condition changed by someone else), only — no heartbeat, so a node in
// steady state costs the API server no writes — and never more than the
// one condition:
// the kubelet and others write the Node's other conditions concurrently, so
// every write is a strategic merge patch on nodes/status, which merges
// conditions by type.
package nodecondition

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"

	"github.com/inpod-dev/inpod/readiness"
)

// ConditionType is the Node condition the gate owns.
const ConditionType corev1.NodeConditionType = "InPodRedirectionReady"

// Reasons of the condition. When several readiness conditions fail, the
// reason names the first in this order (the message names all of them).
const (
	ReasonReady               = "Ready"
	ReasonCNINotInstalled     = "CNINotInstalled"
	ReasonZtunnelNotConnected = "ZtunnelNotConnected"
	ReasonPodsNotSynced       = "PodsNotSynced"
	// ReasonNotReady covers a failing condition this version does not name.
	ReasonNotReady = "NotReady"
)

// reasonOrder maps readiness conditions to reasons, first failing wins.
var reasonOrder = []struct{ cond, reason string }{
	{readiness.CNIInstalled, ReasonCNINotInstalled},
	{readiness.ZtunnelConnected, ReasonZtunnelNotConnected},
	{readiness.PodsSynced, ReasonPodsNotSynced},
}

// Condition is what the gate writes for one readiness state.
type Condition struct {
	Status  corev1.ConditionStatus
	Reason  string
	Message string
}

// For maps a readiness state to the condition.
func For(st readiness.State) Condition {
	if st.Ready {
		return Condition{Status: corev1.ConditionTrue, Reason: ReasonReady,
			Message: "ready for redirection: CNI plugin installed, ztunnel connected, pods synced"}
	}
	c := Condition{Status: corev1.ConditionFalse, Reason: ReasonNotReady}
	if len(st.Failing) == 0 {
		c.Message = "not ready for redirection: no readiness conditions"
		return c
	}
	failing := map[string]bool{}
	for _, f := range st.Failing {
		name, _, _ := strings.Cut(f, ": ")
		failing[name] = true
	}
	for _, o := range reasonOrder {
		if failing[o.cond] {
			c.Reason = o.reason
			break
		}
	}
	c.Message = "not ready for redirection: " + strings.Join(st.Failing, "; ")
	return c
}

// Observer counts the gate's writes, for metrics.
type Observer interface {
	// ConditionWritten counts a write of the condition with this status.
	ConditionWritten(status corev1.ConditionStatus)
	// ConditionWriteFailed counts a failed read or write (it is retried).
	ConditionWriteFailed()
}

// Defaults of the retry backoff.
const (
	DefaultMinBackoff = 200 * time.Millisecond
	DefaultMaxBackoff = 10 * time.Second
	// attemptTimeout bounds one read-and-patch, so a hung connection
	// cannot hold back a newer state.
	attemptTimeout = 10 * time.Second
)

// Config configures the gate.
type Config struct {
	Client   kubernetes.Interface
	NodeName string
	// MinBackoff and MaxBackoff bound the wait between failed attempts
	// (doubling from min to max).
	MinBackoff, MaxBackoff time.Duration
	// StartupGrace: how long a restarted agent that finds the condition
	// True waits for its first ready verdict before it writes False
	// (readiness.StartupHold); 0 means readiness.DefaultStartupGrace,
	// negative none.
	StartupGrace time.Duration
	Observer     Observer
	Logger       *slog.Logger
}

// Gate writes the condition.
type Gate struct {
	cfg Config
	log *slog.Logger
	now func() time.Time
}

// New validates cfg.
func New(cfg Config) (*Gate, error) {
	if cfg.Client == nil {
		return nil, fmt.Errorf("nodecondition: no API client")
	}
	if cfg.NodeName == "" {
		return nil, fmt.Errorf("nodecondition: no node name")
	}
	if cfg.MinBackoff <= 0 {
		cfg.MinBackoff = DefaultMinBackoff
	}
	if cfg.MaxBackoff < cfg.MinBackoff {
		cfg.MaxBackoff = max(DefaultMaxBackoff, cfg.MinBackoff)
	}
	if cfg.StartupGrace == 0 {
		cfg.StartupGrace = readiness.DefaultStartupGrace
	}
	if cfg.Observer == nil {
		cfg.Observer = nopObserver{}
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	return &Gate{cfg: cfg, log: log.With("component", "nodecondition", "node", cfg.NodeName), now: time.Now}, nil
}

// Name is the gate's --gate value.
func (g *Gate) Name() string { return "node-condition" }

// Run follows ready until ctx ends. Each attempt writes the latest state
// seen: a newer state arriving while an attempt fails replaces the target,
// so after an API outage the condition converges to the newest value and
// an older one is never written after it.
//
// When ctx ends Run writes nothing, in particular not False: a stopped or
// dead agent cannot be relied on to report, so the controller judges a
// node whose agent pod is gone or not Ready by its own grace period, not
// by this condition.
//
// A restarted agent is not ready at first (ztunnel has not reconnected),
// and in continuous mode inpod-controller re-taints the node on False at
// once: a rolling upgrade would block every node for its restart. So when
// the Node already says True, Run writes nothing until the first ready
// verdict or until StartupGrace passes, then False if still not ready.
// When the condition is absent or False there is nothing to protect and
// Run writes at once.
//
// Run also watches its own Node and writes the current state again when
// the Node's condition is missing or says something else: a Node deleted
// and registered again under a running agent has no condition (and the
// admission policy's taint), and a condition changed by someone else
// would otherwise stay wrong until the next readiness change. The watch
// costs no writes in steady state: an event whose condition already says
// the current state is dropped without a request.
func (g *Gate) Run(ctx context.Context, ready *readiness.Aggregate) error {
	ctx, stop := context.WithCancel(ctx)
	states, cancel := ready.Subscribe()
	defer cancel()
	nodes, nodeChanged := g.watchNode()
	defer nodes.Shutdown() // after stop: Shutdown waits for the informer, which ends with ctx
	defer stop()
	nodes.Start(ctx.Done())
	var (
		want    Condition
		pending bool // want is not known to be on the Node
		backoff time.Duration
		retry   <-chan time.Time
		// Restores of the condition that follow each other closely back
		// off, so a second writer that disagrees (another agent on the
		// node) cannot turn the watch into a write loop.
		restoreBackoff time.Duration
		lastRestore    time.Time
	)
	hold := readiness.HoldStartup(g.cfg.StartupGrace, g.cfg.StartupGrace > 0 && g.conditionTrue(ctx))
	defer hold.Stop()
	if hold.Holding() {
		g.log.Info(holdingMsg, "grace", g.cfg.StartupGrace)
	}
	for {
		select {
		case <-ctx.Done():
			return nil
		case st := <-states:
			want, pending = For(st), true
			wasHolding := hold.Holding()
			if !hold.Observe(st) {
				continue
			}
			if wasHolding {
				g.log.Info(readyInGraceMsg)
			}
			if retry != nil {
				// Keep waiting out the backoff: readiness flipping
				// during an outage must not turn into a tight loop.
				continue
			}
		case <-nodeChanged:
			if hold.Holding() || pending || want.Status == "" || g.onNode(nodes, want) {
				continue
			}
			pending = true
			now := time.Now()
			if now.Sub(lastRestore) < 2*g.cfg.MaxBackoff {
				restoreBackoff = min(max(2*restoreBackoff, g.cfg.MinBackoff), g.cfg.MaxBackoff)
			} else {
				restoreBackoff = 0
			}
			lastRestore = now
			g.log.Info("the Node's condition is missing or differs from the current state; writing it again", "status", want.Status, "reason", want.Reason, "in", restoreBackoff)
			if restoreBackoff > 0 {
				retry = time.After(restoreBackoff)
				continue
			}
		case <-hold.Expired():
			if hold.Expire() && pending {
				g.log.Warn("no ready verdict within the startup grace; writing the not-ready state", "grace", g.cfg.StartupGrace, "reason", want.Reason)
			}
		case <-retry:
			retry = nil
		}
		if !pending {
			continue
		}
		if err := g.converge(ctx, want); err != nil {
			if ctx.Err() != nil {
				return nil
			}
			g.cfg.Observer.ConditionWriteFailed()
			backoff = min(max(2*backoff, g.cfg.MinBackoff), g.cfg.MaxBackoff)
			g.log.Warn("cannot write the node condition; retrying", "status", want.Status, "reason", want.Reason, "in", backoff, "err", err)
			retry = time.After(backoff)
			continue
		}
		pending, backoff = false, 0
	}
}

// Log messages tests wait on.
const (
	holdingMsg      = "the Node's condition is True: writing nothing until the first ready verdict or the startup grace"
	readyInGraceMsg = "ready within the startup grace; the condition was kept"
)

// watchNode returns an informer on the gate's own Node (by name: the
// agent reads no other Node) and a channel nudged on each add or update.
func (g *Gate) watchNode() (informers.SharedInformerFactory, <-chan struct{}) {
	f := informers.NewSharedInformerFactoryWithOptions(g.cfg.Client, 0, informers.WithTweakListOptions(func(o *metav1.ListOptions) {
		o.FieldSelector = fields.OneTermEqualSelector("metadata.name", g.cfg.NodeName).String()
	}))
	changed := make(chan struct{}, 1)
	nudge := func() {
		select {
		case changed <- struct{}{}:
		default:
		}
	}
	_, _ = f.Core().V1().Nodes().Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(any) { nudge() },
		UpdateFunc: func(_, _ any) { nudge() },
	})
	return f, changed
}

// onNode tells whether the watched Node's condition says want, or there is
// no Node to write to (a recreated one is an add, which nudges again). The
// cache may lag the gate's own writes: a stale "differs" only costs the
// read in converge, which then finds the condition right.
func (g *Gate) onNode(nodes informers.SharedInformerFactory, want Condition) bool {
	obj, ok, err := nodes.Core().V1().Nodes().Informer().GetStore().GetByKey(g.cfg.NodeName)
	if err != nil || !ok {
		return true
	}
	node, ok := obj.(*corev1.Node)
	if !ok {
		return true
	}
	for _, c := range node.Status.Conditions {
		if c.Type == ConditionType {
			return c.Status == want.Status && c.Reason == want.Reason && c.Message == want.Message
		}
	}
	return false
}

// conditionTrue tells whether the Node's condition is True. Not knowing
// only costs the grace, so an unreadable Node counts as True.
func (g *Gate) conditionTrue(ctx context.Context) bool {
	ctx, cancel := context.WithTimeout(ctx, attemptTimeout)
	defer cancel()
	node, err := g.cfg.Client.CoreV1().Nodes().Get(ctx, g.cfg.NodeName, metav1.GetOptions{})
	if err != nil {
		g.log.Warn("cannot read the node; holding as if its condition were True", "err", err)
		return true
	}
	for _, c := range node.Status.Conditions {
		if c.Type == ConditionType {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

// converge reads the Node and patches the condition unless it already says
// want. lastTransitionTime moves only when the status changes: a new reason
// or message with the same status is not a transition.
func (g *Gate) converge(ctx context.Context, want Condition) error {
	ctx, cancel := context.WithTimeout(ctx, attemptTimeout)
	defer cancel()
	nodes := g.cfg.Client.CoreV1().Nodes()
	node, err := nodes.Get(ctx, g.cfg.NodeName, metav1.GetOptions{})
	if err != nil {
		return fmt.Errorf("read node: %w", err)
	}
	now := metav1.NewTime(g.now())
	transition := now
	for _, c := range node.Status.Conditions {
		if c.Type != ConditionType {
			continue
		}
		if c.Status == want.Status && c.Reason == want.Reason && c.Message == want.Message {
			return nil
		}
		if c.Status == want.Status && !c.LastTransitionTime.IsZero() {
			transition = c.LastTransitionTime
		}
	}
	// Only the one condition, merged by type into status.conditions: the
	// kubelet's conditions, written concurrently, are not in the patch and
	// cannot be overwritten by it. lastHeartbeatTime is the time of this
	// write; it is not refreshed (no heartbeat).
	patch, err := json.Marshal(map[string]any{"status": map[string]any{"conditions": []corev1.NodeCondition{{
		Type: ConditionType, Status: want.Status, Reason: want.Reason, Message: want.Message,
		LastHeartbeatTime: now, LastTransitionTime: transition,
	}}}})
	if err != nil {
		return err
	}
	if _, err := nodes.Patch(ctx, g.cfg.NodeName, types.StrategicMergePatchType, patch, metav1.PatchOptions{}, "status"); err != nil {
		return fmt.Errorf("patch node status: %w", err)
	}
	g.cfg.Observer.ConditionWritten(want.Status)
	g.log.Info("node condition written", "type", ConditionType, "status", want.Status, "reason", want.Reason, "message", want.Message)
	return nil
}

type nopObserver struct{}

func (nopObserver) ConditionWritten(corev1.ConditionStatus) {}
func (nopObserver) ConditionWriteFailed()                   {}
