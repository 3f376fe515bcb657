package agent

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"

	"github.com/inpod-dev/inpod/agent/handover"
	"github.com/inpod-dev/inpod/internal/unixsock"
	"github.com/inpod-dev/inpod/readiness"
)

// The agent's side of a hand-over (package handover). A starting agent
// that finds another serving this node syncs its watches while the other
// serves on, then takes its sockets: the CNI plugin's connections and
// ztunnel's reconnection wait in the sockets' backlogs for the moments of
// the switch instead of being refused. The agent handing over stops acting
// on the node before the successor starts (the exchange's "retired"), so
// the two never act at once; only its kubelet plugin (device plugin or
// DRA) stays registered, unchanged, until the successor's is
// (handoverLinger), because the kubelet turns the resource Unhealthy (or
// refuses the claims) when the driver's last plugin leaves.

// handingOverGate is a gate whose kubelet plugin serves across a
// hand-over: the successor's registers once the node is ready under it
// (TakeOver), the retired agent's serves until then (Retire).
type handingOverGate interface {
	Gate
	TakeOver(wait time.Duration)
	Retire(linger time.Duration)
}

const (
	// handoverRetry paces a successor's attempts while the running agent
	// refuses (it is busy, or newer) or cannot hand over.
	handoverRetry    = time.Second
	handoverMaxRetry = 30 * time.Second
	// handoverRegisterWait bounds how long a successor's device plugin
	// waits for the node to be ready here before registering.
	handoverRegisterWait = 20 * time.Second
	// handoverLinger bounds how long a retired agent's device plugin
	// waits for the successor's (deviceplugin.Plugin.Retire): past the
	// successor's start, a restore, reading the Node's pod capacity and
	// handoverRegisterWait.
	handoverLinger = 2 * time.Minute
	// handoverZtunnelWait bounds how long, from serving the ZDS socket
	// again, a successor keeps enrolled pods' ADDs waiting for ztunnel to
	// reconnect.
	handoverZtunnelWait = 20 * time.Second
	// freshListWait bounds a successor's list of the node's pods.
	freshListWait = 10 * time.Second
	// resumeGrace bounds how long readiness stays held after a hand-over
	// that did not happen, for ztunnel to reconnect.
	resumeGrace = 5 * time.Second
)

// awaitZtunnel closes p.ztunnelBack once ztunnel is connected with its
// snapshot acknowledged, after wait, or when ctx ends.
func (a *Agent) awaitZtunnel(ctx context.Context, p *pieces, wait time.Duration) {
	defer close(p.ztunnelBack)
	states, cancel := p.zds.Subscribe()
	defer cancel()
	timer := time.NewTimer(wait)
	defer timer.Stop()
	for {
		select {
		case st := <-states:
			if st.Ready {
				return
			}
		case <-timer.C:
			a.log.Warn("ztunnel has not reconnected since the hand-over; enrolled pods' ADDs go on without it (and fail closed)", "waited", wait)
			return
		case <-ctx.Done():
			return
		}
	}
}

// errHandedOver ends the pieces of an agent that handed the node over.
var errHandedOver = errors.New("agent: handed the node over to its successor")

// Names under which the agent passes its sockets.
const (
	handoverCNI = "cni"
	handoverZDS = "zds"
)

// bindCNI binds the CNI event socket afresh. The lock makes "no agent
// serves it" and the bind one step for the agents of a node: of two that
// start at once, the second finds the first's socket served
// (unixsock.ErrInUse).
func (a *Agent) bindCNI(p *pieces) error {
	unlock, err := lockDir(filepath.Dir(a.cfg.CNISocket))
	if err != nil {
		return err
	}
	defer unlock()
	return p.cni.Listen()
}

// serveNode is the start of serving the node, once its sockets are this
// agent's: the host's probe rules, which the agent before may have used
// until now.
func (a *Agent) serveNode(p *pieces) error {
	a.serving.Store(true)
	if err := p.probes.Ensure(); err != nil {
		return fmt.Errorf("agent: host probe rules: %w", err)
	}
	return nil
}

// zdsFreeWait bounds how long an agent that bound the CNI socket after the
// agent before stopped waits for that agent's ZDS server, which outlives
// its other pieces at shutdown, to let the ZDS socket go: the agent of a
// pod deleted is still stopping when the DaemonSet's surge starts the next.
const zdsFreeWait = 30 * time.Second

// listenZDS opens the ZDS socket (a no-op when taken over).
func (a *Agent) listenZDS(ctx context.Context, p *pieces) error {
	deadline := time.Now().Add(zdsFreeWait)
	for {
		err := p.zds.Listen()
		if err == nil || a.cfg.HandoverSocket == "" || !errors.Is(err, unixsock.ErrInUse) || time.Now().After(deadline) {
			return err
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// lockDir takes an exclusive lock on dir's agent.lock, creating dir (0700,
// as the sockets' directory) if needed.
func lockDir(dir string) (unlock func(), err error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("agent: socket dir: %w", err)
	}
	f, err := os.OpenFile(filepath.Join(dir, "agent.lock"), os.O_CREATE|os.O_RDWR|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, fmt.Errorf("agent: lock: %w", err)
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX); err != nil {
		f.Close()
		return nil, fmt.Errorf("agent: lock %s: %w", f.Name(), err)
	}
	return func() { f.Close() }, nil
}

// claim makes this agent the one serving the node's sockets, once its
// watches are synced: it takes them over from the agent serving them, or
// binds the CNI socket when none does. It retries until ctx ends while an
// agent serves that will not hand over (it is newer, busy, or predates
// hand-overs: then this one binds once it has exited). It returns the
// hand-over socket it took (nil when it bound afresh).
func (a *Agent) claim(ctx context.Context, p *pieces, rank int64) (*net.UnixListener, error) {
	waiting := false
	// Each refused attempt may have paused the running agent (up to the
	// protocol's pause bound): back off, so it serves most of the time.
	retry := handoverRetry
	for {
		wait := handoverRetry // binding costs the running agent nothing
		if handover.Serving(a.cfg.HandoverSocket) {
			wait = retry
			retry = min(2*retry, handoverMaxRetry)
			files, err := handover.Take(ctx, a.cfg.HandoverSocket, rank)
			if err == nil {
				return a.adopt(p, files)
			}
			var refused *handover.Refused
			switch {
			case ctx.Err() != nil:
				return nil, ctx.Err()
			case errors.As(err, &refused):
				if !waiting {
					a.log.Info("the agent serving this node keeps its sockets; asking again", "why", refused.Reason, "in", wait)
				}
				waiting = true
			case errors.Is(err, handover.ErrNoAgent):
				continue // gone meanwhile: bind
			default:
				a.log.Warn("taking over from the agent serving this node failed; asking again", "err", err, "in", wait)
			}
		} else {
			err := a.bindCNI(p)
			if err == nil {
				a.waitingForExit.Store(false)
				return nil, nil
			}
			if !errors.Is(err, unixsock.ErrInUse) {
				return nil, err
			}
			if !waiting {
				a.log.Info("another agent serves this node's CNI socket without a hand-over socket; binding once it has exited", "socket", a.cfg.CNISocket)
			}
			waiting = true
			// An agent of a release before hand-overs: a rollout's
			// surge removes it only once this agent's pod is ready.
			a.waitingForExit.Store(true)
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(wait):
		}
	}
}

// freshPods lists the node's pods from the API server, trimmed as the
// watch trims them: after a take-over, the restore reads them, not the
// watch, which synced while the agent before still served (a pod it
// enrolled just before the hand-over, missing from the restore, would lose
// its record and probe exemption to the prune and be left out of
// ztunnel's first snapshot). nil when the API does not answer: the watch
// is trusted then.
func (a *Agent) freshPods(ctx context.Context, p *pieces) []*corev1.Pod {
	lctx, cancel := context.WithTimeout(ctx, freshListWait)
	defer cancel()
	list, err := p.client.CoreV1().Pods("").List(lctx, metav1.ListOptions{
		FieldSelector: fields.OneTermEqualSelector("spec.nodeName", a.cfg.NodeName).String()})
	if err != nil {
		a.log.Warn("cannot list the node's pods after the take-over; restoring from the watch", "err", err)
		return nil
	}
	out := make([]*corev1.Pod, 0, len(list.Items))
	for i := range list.Items {
		t, _ := trimPod(&list.Items[i])
		out = append(out, t.(*corev1.Pod))
	}
	return out
}

// podReadiness is the agent pod's readiness (Config.ProbeSocket).
func (a *Agent) podReadiness() (bool, string) {
	switch {
	case a.retired.Load():
		return false, "handed the node over to the agent that started after this one"
	case a.waitingForExit.Load():
		return true, "waiting for the agent serving this node, which cannot hand over, to exit"
	}
	st := a.Ready.State()
	if !st.Ready {
		return false, "not ready:\n  " + strings.Join(st.Failing, "\n  ")
	}
	return true, "ready"
}

// adopt serves the sockets taken over; every file is closed on return.
func (a *Agent) adopt(p *pieces, files map[string]*os.File) (_ *net.UnixListener, err error) {
	defer func() {
		for _, f := range files {
			f.Close()
		}
	}()
	listeners := map[string]*net.UnixListener{}
	defer func() {
		if err != nil {
			// Nobody serves what this agent fails to: the plugin's
			// connections are refused (enrolled pods fail closed) until
			// the kubelet restarts this agent, which binds afresh.
			for _, ln := range listeners {
				ln.Close()
			}
		}
	}()
	for _, name := range []string{handoverCNI, handoverZDS, handover.HandoverSocket} {
		f := files[name]
		if f == nil {
			return nil, fmt.Errorf("agent: the agent before handed over no %q socket", name)
		}
		ln, err := handover.Listener(f)
		if err != nil {
			return nil, err
		}
		ln.SetUnlinkOnClose(true) // this agent's paths now, removed at its normal exit
		listeners[name] = ln
	}
	if err := p.cni.Adopt(listeners[handoverCNI]); err != nil {
		return nil, err
	}
	if err := p.zds.Adopt(listeners[handoverZDS]); err != nil {
		return nil, err
	}
	a.tookOver = true
	a.waitingForExit.Store(false)
	p.ztunnelBack = make(chan struct{})
	a.Metrics.HandedOver("taken")
	a.log.Info("took the node over from the agent serving it: serving its CNI, ZDS and hand-over sockets")
	return listeners[handover.HandoverSocket], nil
}

// handoverRank is this agent's rank (handoverRankOf its own pod), so the
// agent of the newest pod serves and a restarted container of an older pod
// never takes the node back; without its pod, the process's start.
func (a *Agent) handoverRank(p *pieces) int64 {
	if a.cfg.PodName != "" {
		pod, err := p.pods.pods.Pods(a.cfg.PodNamespace).Get(a.cfg.PodName)
		if err == nil {
			if rank, ok := handoverRankOf(pod); ok {
				return rank
			}
		}
		a.log.Warn("the agent's own pod and its creation time are not in the watch; ranking the hand-over by the process's start", "pod", a.cfg.PodNamespace+"/"+a.cfg.PodName)
	}
	return a.started.UnixNano()
}

// templateGenerationLabel is the DaemonSet controller's label on each pod:
// the generation of the DaemonSet's template the pod was made from, which
// grows with every change of the template (a rollback included).
const templateGenerationLabel = "pod-template-generation"

// handoverRankOf ranks an agent pod: its creation time in nanoseconds. The
// API keeps that to the second, so two agent pods created within one second
// (an upgrade right after the install, or two in a row) would rank equal,
// refuse each other, and stall the rollout with the old agent serving on.
// The sub-second part breaks that tie with the DaemonSet template's
// generation: the pod of the newer template serves. It stays one integer
// on the wire, so agents from before the tie-break still order by the
// second as they did. A pod without the label (not from a DaemonSet, or a
// controller that dropped the deprecated label) ranks as before.
func handoverRankOf(pod *corev1.Pod) (int64, bool) {
	if pod.CreationTimestamp.IsZero() {
		return 0, false
	}
	rank := pod.CreationTimestamp.Unix() * int64(time.Second)
	if g, err := strconv.ParseInt(pod.Labels[templateGenerationLabel], 10, 64); err == nil && g > 0 {
		rank += min(g, int64(time.Second)-1)
	}
	return rank, true
}

// serveHandover serves the hand-over socket (ln when taken over, else
// bound) until ctx ends or a successor took the node.
func (a *Agent) serveHandover(ctx context.Context, p *pieces, ln *net.UnixListener, rank int64, retire func()) error {
	if ln == nil {
		var err error
		if ln, err = unixsock.Listen("unixpacket", a.cfg.HandoverSocket); err != nil {
			return fmt.Errorf("hand-over socket: %w", err)
		}
	}
	src := &handoverSource{a: a, p: p, retire: retire}
	taken, err := handover.Serve(ctx, ln, a.log, rank, src)
	ln.Close() // Serve kept the path when it handed over
	if taken {
		a.Metrics.HandedOver("given")
	}
	return err
}

// handoverSource is what a hand-over pauses and passes on.
type handoverSource struct {
	a      *Agent
	p      *pieces
	retire func()

	mu    sync.Mutex
	files map[string]*os.File
	// pauses counts Pause calls: an unfreeze of an earlier one gives way.
	pauses int
}

// Pause stops answering the CNI plugin (its connections wait), once the
// requests in progress are answered, and ztunnel (its connections close;
// it reconnects to whichever agent serves next). The node's readiness is
// held as it was meanwhile: a pause is not the node turning unready.
func (s *handoverSource) Pause(ctx context.Context) (map[string]*os.File, error) {
	s.mu.Lock()
	s.pauses++
	s.mu.Unlock()
	s.a.frozen.Store(true)
	cni, err := s.p.cni.Hold(ctx)
	if err != nil {
		s.unfreeze()
		return nil, err
	}
	zds, err := s.p.zds.Hold(ctx)
	if err != nil {
		cni.Close()
		s.p.cni.Release()
		s.unfreeze()
		return nil, err
	}
	s.a.log.Info("handing the node over: paused the CNI and ZDS sockets")
	s.mu.Lock()
	s.files = map[string]*os.File{handoverCNI: cni, handoverZDS: zds}
	s.mu.Unlock()
	return s.files, nil
}

func (s *handoverSource) closeFiles() {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, f := range s.files {
		f.Close()
	}
	s.files = nil
}

// Resume serves on: the successor did not take the sockets.
func (s *handoverSource) Resume() {
	s.closeFiles()
	s.p.zds.Release()
	s.p.cni.Release()
	s.unfreeze()
	s.a.log.Info("hand-over not done: serving on")
}

// unfreeze follows ztunnel again once it is back (the pause closed its
// connections; it reconnects within moments) or after resumeGrace: a
// hand-over that did not happen is no readiness dip. Unless another pause
// began meanwhile.
func (s *handoverSource) unfreeze() {
	s.mu.Lock()
	pause := s.pauses
	s.mu.Unlock()
	go func() {
		states, cancel := s.p.zds.Subscribe()
		defer cancel()
		timer := time.NewTimer(resumeGrace)
		defer timer.Stop()
	wait:
		for {
			select {
			case st := <-states:
				if st.Ready {
					break wait
				}
			case <-timer.C:
				break wait
			}
		}
		s.mu.Lock()
		defer s.mu.Unlock()
		if s.pauses != pause {
			return
		}
		s.a.frozen.Store(false)
		st := s.p.zds.State()
		s.a.Ready.Set(readiness.ZtunnelConnected, st.Ready, st.NotReadyReason())
		// What the verifier would have learnt from the reconnection.
		s.p.verifier.trigger()
	}()
}

// Retire stops everything that acts on the node before the successor is
// told to start; readiness stays held, so the device plugin that lingers
// reports the node as it was.
func (s *handoverSource) Retire() {
	s.closeFiles()
	s.p.cni.Retire()
	s.p.zds.Retire()
	s.a.retired.Store(true)
	s.retire()
	s.a.log.Info("handed the node over: this agent no longer acts on it and exits when stopped")
}
