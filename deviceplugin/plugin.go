// Package deviceplugin is the scheduling gate in device-plugin mode: a
// kubelet device plugin (API v1beta1) that advertises the extended resource
// inpod.dev/redirection, with every device Healthy only while the node is
// ready for redirection and Unhealthy otherwise. Pods that need redirection
// request the resource, so the scheduler cannot place them on a node that
// is not ready.
//
// A readiness dip closes the gate in two steps (see Closer): first the
// scheduler is stopped, then the devices turn Unhealthy. The kubelet
// refuses, for good, a pod it admits while no device is Healthy
// (UnexpectedAdmissionError), and the scheduler learns of Unhealthy devices
// only at the kubelet's next node-status sync (up to 10 s later): turning
// them Unhealthy first would have the kubelet reject every pod the scheduler
// binds in between. A pod admitted while the node is not ready is safe: its
// sandbox waits at the CNI ADD, which fails closed, and its app at
// PreStartContainer.
//
// It serves its socket before registering (the kubelet dials back at once),
// never exits to signal "not ready" (an unregistered resource lingers for
// minutes), and re-registers when the kubelet restarts (which deletes every
// plugin socket and recreates kubelet.sock) or its own socket disappears.
package deviceplugin

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/fsnotify/fsnotify"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"

	"github.com/inpod-dev/inpod/internal/latest"
	"github.com/inpod-dev/inpod/readiness"
)

// Defaults of the design.
const (
	DefaultResourceName = "inpod.dev/redirection"
	DefaultPluginDir    = "/var/lib/kubelet/device-plugins"
	// DefaultDevices covers the kubelet's default maxPods.
	DefaultDevices = 110
	// DefaultCloseTimeout bounds how long devices stay Healthy, once the
	// node is not ready, while the Closer stops the scheduler and the
	// kubelet admits the pods already bound.
	DefaultCloseTimeout = 5 * time.Second
	// MaxCloseTimeout bounds a dip's close.
	MaxCloseTimeout = 10 * time.Second
	// KeepClosedFor covers the kubelet's node-status period (10 s by
	// default) once the devices are Unhealthy.
	KeepClosedFor = 12 * time.Second
	// keepClosedDelay: turned Unhealthy without a close (the chain lost
	// inpod-cni), the Node's count is written 0 only if that lasts: the
	// installer puts the chain back within tens of ms, and the write
	// would keep the node unschedulable until the kubelet's next sync.
	keepClosedDelay = 250 * time.Millisecond
	// shutdownCloseTimeout bounds the close at shutdown, which the
	// agent's termination grace period must hold with the rest: the
	// settle time and the admission of pods already bound take about
	// 1 s.
	shutdownCloseTimeout = 2 * time.Second
	// shutdownKeepClosed: after the stream ends at shutdown.
	shutdownKeepClosed = time.Second
	// MaxShutdownDelay is how much longer Run takes to return at
	// shutdown for closing the gate.
	MaxShutdownDelay = shutdownCloseTimeout + shutdownKeepClosed
	// GatedEnv and GatedAnnotation tell a container its start was gated.
	GatedEnv        = "INPOD_REDIRECTION_GATED"
	GatedAnnotation = "inpod.dev/redirection-gated"
)

// Observer counts what the plugin does, for metrics.
type Observer interface {
	Registered(reregistration bool)
	HealthChanged(healthy bool)
	// SchedulingClosed reports one close: how long devices stayed Healthy
	// after the node stopped being ready, and how it ended (Closed,
	// CloseIncomplete, CloseCalledOff).
	SchedulingClosed(took time.Duration, result string)
}

// Closer stops the scheduler from placing more pods that request the
// resource on this node, then returns once the pods it has already placed
// are through the kubelet's admission, or ctx ends. The plugin keeps its
// devices Healthy meanwhile and turns them Unhealthy after, whatever it
// returns: the kubelet admits those pods, and the node not being ready
// holds each one at its CNI ADD instead.
type Closer interface {
	CloseScheduling(ctx context.Context) error
	// KeepClosed runs once the devices are Unhealthy, until ctx ends
	// (after KeepClosedFor, or when the node is ready again): a kubelet
	// status sync that computed its count before it saw them Unhealthy
	// writes that count back once more. It also shrinks the window when the
	// devices turned Unhealthy without a close.
	KeepClosed(ctx context.Context)
}

// How a close ended, for Observer.SchedulingClosed.
const (
	Closed = "closed"
	// CloseIncomplete: the timeout or an error ended it first; the kubelet
	// may refuse a pod bound just before.
	CloseIncomplete = "incomplete"
	// CloseCalledOff: ready again (or stopping) before it ended.
	CloseCalledOff = "called-off"
)

// Config configures the plugin.
type Config struct {
	ResourceName string
	// Devices is how many devices to advertise; 0 asks DevicesFrom once at
	// Run (the agent reads the Node's pod capacity), or DefaultDevices.
	Devices     int
	DevicesFrom func(ctx context.Context) int
	// PluginDir holds kubelet.sock and the plugin's own socket.
	PluginDir string
	// SocketName is unique per agent instance, so a rolling update with
	// surge never has two instances on one socket (default:
	// inpod-<random>.sock).
	SocketName string
	// PreStart, when set, is asked before each container holding the
	// plugin's devices starts (the kubelet's PreStartContainer, requested
	// by registering with PreStartRequired): an error keeps that container
	// from starting, and the kubelet tries again at its next sync. The
	// scheduling gate cannot cover a pod admitted while the node was ready
	// whose sandbox was then set up without inpod (another CNI rewrote the
	// conflist in between); this holds its app until the agent has
	// redirected the sandbox it runs in.
	PreStart func(ctx context.Context, deviceIDs []string) error
	// Closer, when set, runs before the devices turn Unhealthy, for at
	// most CloseTimeout (0: DefaultCloseTimeout; negative: no close, the
	// devices turn Unhealthy at once; at most MaxCloseTimeout). A node
	// whose chain lost inpod-cni turns Unhealthy at once too: a pod
	// admitted then would set its sandbox up without inpod.
	Closer       Closer
	CloseTimeout time.Duration
	Observer     Observer
	Logger       *slog.Logger
}

// MaxRegisterWait bounds TakeOver's wait.
const MaxRegisterWait = time.Minute

// Plugin is the device plugin.
type Plugin struct {
	pluginapi.UnimplementedDevicePluginServer
	cfg Config
	log *slog.Logger

	mu      sync.Mutex
	healthy bool
	// failing is what readiness said last time the devices turned
	// Unhealthy (nil while Healthy).
	failing []string
	// devices is what every ListAndWatch stream sends: the latest list,
	// never blocking the readiness follower on a slow kubelet.
	devices *latest.Value[[]*pluginapi.Device]
	// registerWait is TakeOver's; awaitingRegistration is set while Run
	// waits for it: the kubelet does not know this plugin yet, so a
	// not-ready node closes nothing through it.
	registerWait         time.Duration
	awaitingRegistration atomic.Bool
	// retired is closed by Retire; lingerFor is its bound.
	retired   chan struct{}
	lingerFor time.Duration
}

// TakeOver is called before Run when the agent took the node over from a
// running agent whose plugin still serves the resource, Healthy: the
// kubelet takes the devices' health from whichever plugin reported last,
// so this one registers only once the node is ready here too, or after
// wait (at most MaxRegisterWait), when it reports what it sees. Registering
// earlier would turn the devices Unhealthy for the moments this agent
// needs to become ready, and the kubelet would refuse the pods bound then.
func (p *Plugin) TakeOver(wait time.Duration) { p.registerWait = min(wait, MaxRegisterWait) }

// New validates cfg.
func New(cfg Config) (*Plugin, error) {
	if cfg.ResourceName == "" {
		cfg.ResourceName = DefaultResourceName
	}
	if err := validResourceName(cfg.ResourceName); err != nil {
		return nil, err
	}
	if cfg.Devices <= 0 && cfg.DevicesFrom == nil {
		cfg.Devices = DefaultDevices
	}
	if cfg.PluginDir == "" {
		cfg.PluginDir = DefaultPluginDir
	}
	if cfg.CloseTimeout == 0 {
		cfg.CloseTimeout = DefaultCloseTimeout
	}
	if cfg.CloseTimeout > MaxCloseTimeout {
		return nil, fmt.Errorf("deviceplugin: close timeout %s is above %s: the devices would stay Healthy that long on a node that is not ready", cfg.CloseTimeout, MaxCloseTimeout)
	}
	if cfg.SocketName == "" {
		var b [4]byte
		rand.Read(b[:])
		cfg.SocketName = "inpod-" + hex.EncodeToString(b[:]) + ".sock"
	}
	if strings.Contains(cfg.SocketName, "/") {
		return nil, fmt.Errorf("deviceplugin: socket name %q must be a file name in the plugin dir", cfg.SocketName)
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	return &Plugin{cfg: cfg, log: log.With("component", "deviceplugin", "resource", cfg.ResourceName), retired: make(chan struct{})}, nil
}

// Name is the gate's --gate value.
func (p *Plugin) Name() string { return "deviceplugin" }

// validResourceName applies the kubelet's rule: an extended resource is
// "<domain>/<name>" outside the kubernetes.io domains.
func validResourceName(name string) error {
	domain, rest, ok := strings.Cut(name, "/")
	if !ok || domain == "" || rest == "" || strings.Contains(rest, "/") {
		return fmt.Errorf("deviceplugin: resource name %q is not <domain>/<name>", name)
	}
	if domain == "kubernetes.io" || strings.HasSuffix(domain, ".kubernetes.io") {
		return fmt.Errorf("deviceplugin: resource name %q uses a reserved kubernetes.io domain", name)
	}
	return nil
}

// SocketPath is the plugin's socket.
func (p *Plugin) SocketPath() string { return filepath.Join(p.cfg.PluginDir, p.cfg.SocketName) }

func (p *Plugin) kubeletSocket() string { return filepath.Join(p.cfg.PluginDir, "kubelet.sock") }

// Run serves and registers until ctx ends, following ready and
// re-registering after kubelet restarts. A Plugin runs once.
func (p *Plugin) Run(ctx context.Context, ready *readiness.Aggregate) error {
	if p.cfg.Devices <= 0 {
		if p.cfg.Devices = p.cfg.DevicesFrom(ctx); p.cfg.Devices <= 0 {
			p.cfg.Devices = DefaultDevices
		}
	}
	p.devices = latest.New(p.devicesLocked())
	states, cancel := ready.Subscribe()
	defer cancel()
	// Nothing the follower started (a close, KeepClosed) outlives Run.
	followCtx, stopFollowing := context.WithCancel(ctx)
	followed := make(chan struct{})
	go func() {
		defer close(followed)
		p.followReadiness(followCtx, states)
	}()
	defer func() { stopFollowing(); <-followed }()

	if err := os.MkdirAll(p.cfg.PluginDir, 0o755); err != nil {
		return fmt.Errorf("deviceplugin: %w", err)
	}
	w, err := fsnotify.NewWatcher()
	if err != nil {
		return fmt.Errorf("deviceplugin: %w", err)
	}
	defer w.Close()
	if err := w.Add(p.cfg.PluginDir); err != nil {
		return fmt.Errorf("deviceplugin: watch %s: %w", p.cfg.PluginDir, err)
	}

	if p.registerWait > 0 {
		p.awaitingRegistration.Store(true)
		healthy := p.waitHealthy(ctx, p.registerWait)
		p.awaitingRegistration.Store(false)
		p.mu.Lock()
		failing := p.failing
		p.mu.Unlock()
		if !healthy && ctx.Err() == nil && !p.isRetired() && p.closeFor(failing) {
			// Registered Unhealthy, this plugin would turn the devices
			// Unhealthy under the Healthy ones of the agent before: close
			// first, as for a readiness dip.
			p.close(ctx, p.cfg.CloseTimeout, "not ready after a take-over", failing)
		}
	}
	registrations := 0
	for {
		if p.isRetired() {
			// Retired before it registered (a second rollout): the
			// successor's plugin serves the resource.
			return nil
		}
		srv, err := p.serve()
		if err != nil {
			return err
		}
		registered := p.register(ctx, w, registrations > 0)
		if registered {
			registrations++
		}
		// Serve until our socket goes or the kubelet comes back (a new
		// kubelet.sock), then start over.
		reason := p.waitForRestart(ctx, w, registered, inode(p.kubeletSocket()))
		// Retired: served until the successor's plugin is registered
		// too (the kubelet keeps the devices Healthy while one plugin of
		// the resource remains), then stopped without a close; closed
		// as at a stop if none comes.
		if reason == reasonRetired {
			// Readiness is held as it was; a close or KeepClosed of a dip
			// in flight must not land beside the successor's plugin.
			stopFollowing()
			<-followed
		}
		quiet := reason == reasonRetired && p.linger(ctx, w)
		stopping := ctx.Err() != nil || reason == reasonRetired
		closed := false
		if quiet {
			p.log.Info("stopping without closing the gate: the successor's plugin serves the resource")
		} else if stopping && registered {
			// The kubelet turns every device Unhealthy the moment the
			// stream ends: close first, as for a readiness dip, once
			// the follower (and a dip's close) has stopped.
			stopFollowing()
			<-followed
			closed = p.closeAtShutdown(ctx)
		}
		srv.Stop()
		os.Remove(p.SocketPath())
		if stopping {
			if closed {
				// A kubelet status sync computed just before the
				// stream ended lands within moments.
				kctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), shutdownKeepClosed)
				p.cfg.Closer.KeepClosed(kctx)
				cancel()
			}
			return nil
		}
		if p.isRetired() {
			// The kubelet restarted or lost our socket: it registers
			// the successor's plugin, not a retired one.
			p.log.Info("retired: not registering again", "because", reason)
			return nil
		}
		p.log.Info("re-registering with the kubelet", "because", reason)
	}
}

// reasonRetired is waitForRestart's answer once Retire was called.
const reasonRetired = "retired"

// Retire tells a running plugin that its agent handed the node over to a
// successor on the node (package agent/handover): it no longer follows
// readiness (its agent's is held as it was), never registers again, and
// serves until the successor's plugin is registered (a live socket of
// another inpod plugin in the directory, then siblingGrace) or for at most
// linger; then Run returns, without closing the gate when the successor's
// plugin serves and with a close, as at a stop, when none does.
func (p *Plugin) Retire(linger time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.isRetired() {
		p.lingerFor = linger
		close(p.retired)
	}
}

func (p *Plugin) isRetired() bool {
	select {
	case <-p.retired:
		return true
	default:
		return false
	}
}

// siblingGrace is how long a retired plugin serves on after it first sees
// the successor's socket: the successor registers right after it serves.
var siblingGrace = 2 * time.Second

// linger serves a retired plugin on until the successor's plugin serves
// (true) or lingerFor passes or ctx ends without one (false).
func (p *Plugin) linger(ctx context.Context, w *fsnotify.Watcher) bool {
	p.mu.Lock()
	limit := p.lingerFor
	p.mu.Unlock()
	p.log.Info("retired: serving until the successor's plugin is registered", "atMost", limit)
	deadline := time.NewTimer(limit)
	defer deadline.Stop()
	tick := time.NewTicker(500 * time.Millisecond) // a missed event
	defer tick.Stop()
	var grace <-chan time.Time
	for {
		if grace == nil && p.siblingServes() {
			grace = time.After(siblingGrace)
		}
		select {
		case <-ctx.Done():
			return grace != nil
		case <-deadline.C:
			p.log.Warn("no successor's plugin registered while retired: closing the gate", "waited", limit)
			return false
		case <-grace:
			return true
		case <-w.Events:
		case <-w.Errors:
		case <-tick.C:
		}
	}
}

// siblingServes reports whether another inpod plugin (a socket named
// inpod-*.sock, not this one's) accepts connections in the directory.
func (p *Plugin) siblingServes() bool {
	socks, _ := filepath.Glob(filepath.Join(p.cfg.PluginDir, "inpod-*.sock"))
	for _, s := range socks {
		if s == p.SocketPath() {
			continue
		}
		if c, err := net.DialTimeout("unix", s, 200*time.Millisecond); err == nil {
			c.Close()
			return true
		}
	}
	return false
}

// waitHealthy returns true once the devices are Healthy, false after wait,
// when ctx ends or the plugin is retired.
func (p *Plugin) waitHealthy(ctx context.Context, wait time.Duration) bool {
	changes, cancel := p.devices.Subscribe()
	defer cancel()
	timer := time.NewTimer(wait)
	defer timer.Stop()
	p.log.Info("registering once the node is ready here: the agent before still serves the resource", "atMost", wait)
	for !p.isHealthy() {
		select {
		case <-ctx.Done():
			return false
		case <-p.retired:
			return false
		case <-timer.C:
			p.log.Warn("the node is not ready after the wait; registering anyway, reporting it", "waited", wait)
			return false
		case <-changes:
		}
	}
	return true
}

// serve starts the gRPC server on a fresh socket.
func (p *Plugin) serve() (*grpc.Server, error) {
	path := p.SocketPath()
	os.Remove(path)
	ln, err := net.Listen("unix", path)
	if err != nil {
		return nil, fmt.Errorf("deviceplugin: listen on %s: %w", path, err)
	}
	srv := grpc.NewServer()
	pluginapi.RegisterDevicePluginServer(srv, p)
	go srv.Serve(ln)
	return srv, nil
}

// register calls the kubelet; when it is absent, it waits for kubelet.sock.
func (p *Plugin) register(ctx context.Context, w *fsnotify.Watcher, again bool) bool {
	backoff := 100 * time.Millisecond
	for {
		// Registering a socket that is gone would have the kubelet dial
		// back to nothing, forever: serve again instead (which fails, and
		// stops the agent, when the directory itself is gone).
		if _, err := os.Stat(p.SocketPath()); err != nil {
			p.log.Warn("the plugin's own socket is gone before registration; serving again", "socket", p.SocketPath())
			return false
		}
		if _, err := os.Stat(p.kubeletSocket()); err == nil {
			err := p.registerOnce(ctx)
			if err == nil {
				p.log.Info("registered with the kubelet", "socket", p.cfg.SocketName, "devices", p.cfg.Devices, "reregistration", again)
				if p.cfg.Observer != nil {
					p.cfg.Observer.Registered(again)
				}
				return true
			}
			p.log.Warn("registration failed; retrying", "err", err, "in", backoff)
		} else {
			p.log.Info("waiting for the kubelet", "socket", p.kubeletSocket())
		}
		select {
		case <-ctx.Done():
			return false
		case <-time.After(backoff):
		case ev := <-w.Events:
			if filepath.Base(ev.Name) == "kubelet.sock" && ev.Has(fsnotify.Create) {
				backoff = 100 * time.Millisecond
				continue
			}
		}
		backoff = min(2*backoff, 5*time.Second)
	}
}

func (p *Plugin) registerOnce(ctx context.Context) error {
	conn, err := grpc.NewClient("unix://"+p.kubeletSocket(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer conn.Close()
	rctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	_, err = pluginapi.NewRegistrationClient(conn).Register(rctx, &pluginapi.RegisterRequest{
		Version:      pluginapi.Version,
		Endpoint:     p.cfg.SocketName,
		ResourceName: p.cfg.ResourceName,
		Options:      p.options(),
	})
	return err
}

// waitForRestart returns why the plugin must serve and register again.
// Events are checked against the files as they are now: the plugin's own
// earlier remove-and-recreate of its socket, and the kubelet.sock it
// registered with, must not count as restarts.
func (p *Plugin) waitForRestart(ctx context.Context, w *fsnotify.Watcher, registered bool, kubeletInode uint64) string {
	if !registered {
		return "not registered"
	}
	// A cheap periodic check catches a missed event.
	tick := time.NewTicker(5 * time.Second)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return "shutting down"
		case <-p.retired:
			return reasonRetired
		case ev := <-w.Events:
			name := filepath.Base(ev.Name)
			switch {
			case name == "kubelet.sock" && ev.Has(fsnotify.Create):
				if now := inode(p.kubeletSocket()); now != 0 && now != kubeletInode {
					return "the kubelet restarted (kubelet.sock recreated)"
				}
			case name == p.cfg.SocketName && (ev.Has(fsnotify.Remove) || ev.Has(fsnotify.Rename)):
				if _, err := os.Stat(p.SocketPath()); err != nil {
					return "our socket was removed"
				}
			}
		case err := <-w.Errors:
			p.log.Warn("watch error", "err", err)
		case <-tick.C:
			if _, err := os.Stat(p.SocketPath()); err != nil {
				return "our socket is gone"
			}
		}
	}
}

func (p *Plugin) options() *pluginapi.DevicePluginOptions {
	return &pluginapi.DevicePluginOptions{PreStartRequired: p.cfg.PreStart != nil, GetPreferredAllocationAvailable: false}
}

// followReadiness turns readiness into device health: Healthy at once, and
// Unhealthy once a close (closeFor) has stopped the scheduler. Readiness
// back before the close ends cancels it, and the devices never leave
// Healthy. Once Unhealthy, the Closer keeps the Node's count at 0 for
// KeepClosedFor, or until ready again.
func (p *Plugin) followReadiness(ctx context.Context, states <-chan readiness.State) {
	var (
		closing     context.CancelCauseFunc
		closed      <-chan struct{}
		keeping     context.CancelFunc
		kept        <-chan struct{}
		lastFailing []string
	)
	stopClosing := func(why error) {
		if closing != nil {
			closing(why)
			<-closed
			closing, closed = nil, nil
		}
	}
	// stopKeeping waits for KeepClosed to end: a zero write landing after
	// the node is ready again would keep it unschedulable for one more
	// kubelet sync.
	stopKeeping := func() {
		if keeping != nil {
			keeping()
			<-kept
			keeping, kept = nil, nil
		}
	}
	unhealthy := func(failing []string, delay time.Duration) {
		p.setHealthy(false, failing)
		if p.cfg.Closer == nil || keeping != nil || p.awaitingRegistration.Load() {
			return
		}
		kctx, cancel := context.WithTimeout(ctx, KeepClosedFor)
		done := make(chan struct{})
		keeping, kept = cancel, done
		go func() {
			defer close(done)
			select {
			case <-kctx.Done():
				return
			case <-time.After(delay):
			}
			p.cfg.Closer.KeepClosed(kctx)
		}()
	}
	defer stopClosing(errStopping)
	defer stopKeeping()
	for {
		select {
		case <-ctx.Done():
			return
		case <-closed:
			closing, closed = nil, nil
			if ctx.Err() == nil {
				unhealthy(lastFailing, 0)
			}
		case st := <-states:
			lastFailing = st.Failing
			switch {
			case st.Ready:
				stopClosing(errReadyAgain)
				stopKeeping()
				p.setHealthy(true, nil)
			case closing != nil && !p.closeFor(st.Failing):
				// The chain lost inpod-cni meanwhile: see closeFor.
				stopClosing(errChainLost)
				unhealthy(st.Failing, 0)
			case closing != nil:
				// Still closing; the verdict is the last state's.
			case p.isHealthy() && p.closeFor(st.Failing):
				cctx, cancel := context.WithCancelCause(ctx)
				done := make(chan struct{})
				closing, closed = cancel, done
				go func() {
					defer close(done)
					p.close(cctx, p.cfg.CloseTimeout, "not ready", st.Failing)
				}()
			default:
				unhealthy(st.Failing, keepClosedDelay)
			}
		}
	}
}

// Why a close ended early.
var (
	errReadyAgain = errors.New("ready again")
	errStopping   = errors.New("the plugin is stopping")
	errChainLost  = errors.New("the chain lost inpod-cni")
)

// closeFor reports whether the devices stay Healthy through a close when
// these readiness conditions fail.
func (p *Plugin) closeFor(failing []string) bool {
	if p.cfg.Closer == nil || p.cfg.CloseTimeout < 0 {
		return false
	}
	// A pod admitted with the chain missing inpod-cni sets its sandbox up
	// without inpod: PreStartContainer holds only the container that holds
	// the device, not its init containers or the others. Refusing it is the
	// lesser harm.
	return !chainLost(failing)
}

func chainLost(failing []string) bool {
	return slices.ContainsFunc(failing, func(f string) bool {
		name, _, _ := strings.Cut(f, ":")
		return name == readiness.CNIInstalled
	})
}

// close runs the Closer for at most timeout; canceling ctx (with a cause)
// ends it early.
func (p *Plugin) close(ctx context.Context, timeout time.Duration, why string, failing []string) {
	start := time.Now()
	p.log.Info("closing the gate: stopping the scheduler before the devices turn Unhealthy", "why", why, "failing", failing, "timeout", timeout)
	cctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	err := p.cfg.Closer.CloseScheduling(cctx)
	took := time.Since(start)
	result := Closed
	switch cause := context.Cause(ctx); {
	case errors.Is(cause, errChainLost):
		result = CloseIncomplete
		p.log.Warn("close cut short: the chain lost inpod-cni, so the devices turn Unhealthy at once; the kubelet may refuse a pod bound just before (UnexpectedAdmissionError)", "after", took)
	case cause != nil:
		result = CloseCalledOff
		p.log.Info("close called off", "because", cause, "after", took)
	case err != nil:
		result = CloseIncomplete
		p.log.Warn("the gate closed without the scheduler stopped or every bound pod admitted; the kubelet may refuse a pod bound just before (UnexpectedAdmissionError)", "after", took, "err", err)
	default:
		p.log.Info("the gate closed: the scheduler stopped and the pods bound before are admitted", "after", took)
	}
	if p.cfg.Observer != nil {
		p.cfg.Observer.SchedulingClosed(took, result)
	}
}

// closeAtShutdown closes the gate of a Healthy plugin before it stops
// serving, for at most shutdownCloseTimeout: readiness is no longer
// followed meanwhile, so a chain rewritten now would go unseen as long as
// the devices stay Healthy. It reports whether it closed.
func (p *Plugin) closeAtShutdown(ctx context.Context) bool {
	p.mu.Lock()
	healthy, failing := p.healthy, p.failing
	p.mu.Unlock()
	if !healthy || !p.closeFor(failing) {
		return false
	}
	p.close(context.WithoutCancel(ctx), min(p.cfg.CloseTimeout, shutdownCloseTimeout), "the agent is stopping", nil)
	return true
}

func (p *Plugin) isHealthy() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.healthy
}

func (p *Plugin) setHealthy(healthy bool, failing []string) {
	p.mu.Lock()
	changed := healthy != p.healthy
	p.healthy, p.failing = healthy, failing
	p.devices.Publish(p.devicesLocked())
	p.mu.Unlock()
	if changed {
		if healthy {
			p.log.Info("devices Healthy: the node is ready for redirection")
		} else {
			p.log.Warn("devices Unhealthy: the node is not ready for redirection", "failing", failing)
		}
		if p.cfg.Observer != nil {
			p.cfg.Observer.HealthChanged(healthy)
		}
	}
}

func (p *Plugin) devicesLocked() []*pluginapi.Device {
	health := pluginapi.Unhealthy
	if p.healthy {
		health = pluginapi.Healthy
	}
	devs := make([]*pluginapi.Device, p.cfg.Devices)
	for i := range devs {
		devs[i] = &pluginapi.Device{ID: fmt.Sprintf("redirection-%d", i), Health: health}
	}
	return devs
}

// GetDevicePluginOptions implements the kubelet API.
func (p *Plugin) GetDevicePluginOptions(context.Context, *pluginapi.Empty) (*pluginapi.DevicePluginOptions, error) {
	return p.options(), nil
}

// ListAndWatch sends the devices now and after every health change.
func (p *Plugin) ListAndWatch(_ *pluginapi.Empty, stream grpc.ServerStreamingServer[pluginapi.ListAndWatchResponse]) error {
	ch, cancel := p.devices.Subscribe()
	defer cancel()
	for {
		select {
		case <-stream.Context().Done():
			return nil
		case devs := <-ch:
			if err := stream.Send(&pluginapi.ListAndWatchResponse{Devices: devs}); err != nil {
				return err
			}
		}
	}
}

// Allocate grants devices; the container learns its start was gated. It
// grants them while the node is not ready too: the kubelet asks only for
// devices it last saw Healthy, a refusal fails the pod for good
// (UnexpectedAdmissionError), and a pod admitted while the node is not
// ready waits at its CNI ADD. Not so when the chain lost inpod-cni: that
// pod's sandbox would be set up without inpod, so it is refused.
func (p *Plugin) Allocate(_ context.Context, req *pluginapi.AllocateRequest) (*pluginapi.AllocateResponse, error) {
	p.mu.Lock()
	refuse := !p.healthy && chainLost(p.failing)
	p.mu.Unlock()
	if refuse {
		return nil, errors.New("inpod-cni is not in the node's CNI chain; refusing to allocate " + p.cfg.ResourceName)
	}
	resp := &pluginapi.AllocateResponse{}
	for range req.ContainerRequests {
		resp.ContainerResponses = append(resp.ContainerResponses, &pluginapi.ContainerAllocateResponse{
			Envs:        map[string]string{GatedEnv: "true"},
			Annotations: map[string]string{GatedAnnotation: "true"},
		})
	}
	return resp, nil
}

// PreStartContainer asks Config.PreStart, when set, whether the container
// holding these devices may start.
func (p *Plugin) PreStartContainer(ctx context.Context, req *pluginapi.PreStartContainerRequest) (*pluginapi.PreStartContainerResponse, error) {
	if p.cfg.PreStart != nil {
		if err := p.cfg.PreStart(ctx, req.GetDevicesIds()); err != nil {
			p.log.Info("holding a container start", "devices", req.GetDevicesIds(), "why", err)
			return nil, err
		}
	}
	return &pluginapi.PreStartContainerResponse{}, nil
}

func inode(path string) uint64 {
	fi, err := os.Stat(path)
	if err != nil {
		return 0
	}
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		return st.Ino
	}
	return 0
}
