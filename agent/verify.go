package agent

import (
	"context"
	"math/rand/v2"
	"os"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"

	"github.com/inpod-dev/inpod/agent/enroll"
	"github.com/inpod-dev/inpod/agent/redirect"
	"github.com/inpod-dev/inpod/zds"
)

// DefaultVerifyPeriod is how often every enrolled pod is re-proven (see
// enroll.Pipeline.VerifyAll) when nothing asks for it sooner.
const DefaultVerifyPeriod = 10 * time.Second

// DefaultZtunnelGrace is how long the verifier gives ztunnel to (re)connect
// before it takes every enrolled pod for unproven: an agent restart, or a
// ztunnel restart, must not flip every pod's readiness.
const DefaultZtunnelGrace = 10 * time.Second

// minVerifySpacing keeps rounds asked for by events (a CNI DEL, a ztunnel
// reconnect, a repair) from following each other more often than this.
const minVerifySpacing = time.Second

// verifier runs the pipeline's verification rounds: every period,
// jittered by ±10 % so the nodes of a cluster do not read their pods in
// step, and soon after anything that may have broken a pod's redirection
// (trigger). A round asked for waits for the CNI events in flight to end: a
// burst of pod starts proves each of its pods itself, and the node's CPU
// is theirs then.
type verifier struct {
	period time.Duration
	round  func(context.Context)
	// quiet is the CNI activity (nil: never waits).
	quiet interface{ Quiet() <-chan struct{} }
	soon  chan struct{}
}

func newVerifier(period time.Duration, round func(context.Context), quiet interface{ Quiet() <-chan struct{} }) *verifier {
	if period <= 0 {
		period = DefaultVerifyPeriod
	}
	return &verifier{period: period, round: round, quiet: quiet, soon: make(chan struct{}, 1)}
}

// trigger asks for a round soon; asks before it runs are one.
func (v *verifier) trigger() {
	select {
	case v.soon <- struct{}{}:
	default:
	}
}

func (v *verifier) jittered() time.Duration {
	return time.Duration(float64(v.period) * (0.9 + 0.2*rand.Float64()))
}

// run runs rounds until ctx ends, the first once the CNI events in flight
// have ended (the agent's start is an event that may have broken anything;
// the kubelet's retried ADDs come first).
func (v *verifier) run(ctx context.Context) {
	if !v.settle(ctx, time.Time{}) {
		return
	}
	timer := time.NewTimer(0)
	defer timer.Stop()
	var last time.Time
	for {
		select {
		case <-ctx.Done():
			return
		case <-timer.C:
		case <-v.soon:
			if !v.settle(ctx, last) {
				return
			}
		}
		// This round covers every ask made before it starts.
		select {
		case <-v.soon:
		default:
		}
		v.round(ctx)
		last = time.Now()
		timer.Stop()
		timer.Reset(v.jittered())
	}
}

// settle waits, for a round asked for, until no CNI event is in flight
// (at most one period) and minVerifySpacing has passed since the last
// round. False if ctx ended.
func (v *verifier) settle(ctx context.Context, last time.Time) bool {
	if v.quiet != nil {
		if q := v.quiet.Quiet(); q != nil {
			select {
			case <-q:
			case <-time.After(v.period):
			case <-ctx.Done():
				return false
			}
		}
	}
	if wait := minVerifySpacing - time.Since(last); wait > 0 {
		select {
		case <-time.After(wait):
		case <-ctx.Done():
			return false
		}
	}
	return true
}

// ztunnelPresence turns the ZDS server's state into what a verification
// may conclude: ready, gone for less than the grace (reconnecting), or
// away.
type ztunnelPresence struct {
	grace time.Duration

	mu sync.Mutex
	// ready is the last state seen; since when it has held (the agent's
	// start, for "not ready" before any state came).
	ready bool
	since time.Time
}

func newZtunnelPresence(grace time.Duration) *ztunnelPresence {
	if grace <= 0 {
		grace = DefaultZtunnelGrace
	}
	return &ztunnelPresence{grace: grace, since: time.Now()}
}

// observe records the ZDS server's state; it reports whether ztunnel has
// just become ready.
func (z *ztunnelPresence) observe(st zds.State) bool {
	z.mu.Lock()
	defer z.mu.Unlock()
	if st.Ready == z.ready {
		return false
	}
	z.ready, z.since = st.Ready, time.Now()
	return st.Ready
}

// reset starts the grace again: the ZDS socket is served from now on.
func (z *ztunnelPresence) reset() {
	z.mu.Lock()
	defer z.mu.Unlock()
	if !z.ready {
		z.since = time.Now()
	}
}

func (z *ztunnelPresence) presence() enroll.ZtunnelPresence {
	z.mu.Lock()
	defer z.mu.Unlock()
	switch {
	case z.ready:
		return enroll.ZtunnelReady
	case time.Since(z.since) < z.grace:
		return enroll.ZtunnelReconnecting
	}
	return enroll.ZtunnelAway
}

// ztunnelListeners are the listeners ztunnel binds in every pod it proxies
// (Istio's ports), and its DNS proxy's in a pod whose DNS it captures: a
// pod opted out of DNS capture needs no DNS proxy, whether ztunnel runs
// one or not.
type ztunnelListeners struct{}

func (ztunnelListeners) ports(v enroll.Variant) []uint16 {
	ports := []uint16{redirect.PortOutbound, redirect.PortInbound, redirect.PortHBONE}
	if v.DNSCapture {
		ports = append(ports, redirect.PortDNS)
	}
	return ports
}

func (l ztunnelListeners) Missing(ns *os.File, v enroll.Variant) ([]uint16, error) {
	return redirect.Listening(ns, l.ports(v))
}

// rulesGeneration is what tells the verifier that no nf_tables table of a
// pod changed: the nf_tables generation, for the backends that write
// nf_tables; none for iptables-legacy, whose rules every round reads back.
func rulesGeneration(backend redirect.Backend) func(*os.File) (uint32, error) {
	if backend.Name() == "iptables-legacy" {
		return nil
	}
	return redirect.Generation
}

// cachedPod is the pod the agent's cache holds under a name, or nil.
func (c *podCache) cachedPod(key types.NamespacedName) *corev1.Pod {
	pod, err := c.pods.Pods(key.Namespace).Get(key.Name)
	if err != nil {
		return nil
	}
	return pod
}

// nodePods are the pods the agent's cache holds: this node's.
func (c *podCache) nodePods() []*corev1.Pod {
	pods, err := c.pods.List(labels.Everything())
	if err != nil {
		return nil
	}
	return pods
}

// verifyRound is one round of the verifier: every enrolled pod re-proven,
// and, every sweepEvery (and at the first round, the agent's start), the
// pods outside the mesh swept for inpod's rules. Run by the verifier's
// goroutine only.
type verifyRound struct {
	pipeline   func() *enroll.Pipeline
	pods       *podCache
	sweepEvery time.Duration
	sweptAt    time.Time
}

func (r *verifyRound) run(ctx context.Context) {
	p := r.pipeline()
	p.VerifyAll(ctx, r.pods.cachedPod)
	if r.sweptAt.IsZero() || time.Since(r.sweptAt) >= r.sweepEvery {
		p.SweepOutside(ctx, r.pods.nodePods())
		r.sweptAt = time.Now()
	}
}
