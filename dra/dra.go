// Package dra is the scheduling gate for clusters with Dynamic Resource
// Allocation (resource.k8s.io/v1): a kubelet DRA plugin, driver
// redirection.inpod.dev, built on the maintained helper
// k8s.io/dynamic-resource-allocation/kubeletplugin (registration and the
// gRPC services are the helper's; the ResourceSlice is written by the same
// library's slice controller, run beside it so its lifetime is the gate's).
//
// The node's pool is one ResourceSlice with one device, "redirection",
// that every pod on the node shares (allowMultipleAllocations). A
// DeviceClass with extendedResourceName inpod.dev/redirection
// (deploy/dra/deviceclass.yaml) lets pods keep requesting
// inpod.dev/redirection: 1, as in device-plugin mode.
//
// The safety argument, against the promise "an enrolled pod never runs
// unredirected, a pod outside the mesh is never blocked":
//   - Not ready: the slice stays, but its device carries one NoSchedule
//     device taint per failing readiness condition (key names it), so the
//     scheduler allocates it to no new claim. Never NoExecute: a readiness
//     flip never evicts a running pod (invariant 8,
//     docs/design/invariants.md).
//   - A pod bound in any window (the taint not yet visible, or a slice left
//     behind by an agent that died while ready) still cannot start:
//     NodePrepareResources refuses while not ready, and the kubelet does not
//     start a pod whose claims are not prepared; it retries. With no agent
//     at all the kubelet cannot reach the driver and refuses too. Both fail
//     closed; and the CNI plugin fails an enrolled pod's ADD without an
//     agent regardless.
//   - Pods that do not request the resource never meet this gate.
//   - The slice is only written when what it says changes: an agent restart
//     while ready rewrites nothing (the controller compares the desired slice
//     with the stored one), and the first verdict after a restart is awaited
//     for StartupGrace so the restart's own not-yet-ready moments do not
//     flap the taint. The kubelet withdraws the slices of a driver whose
//     connection is gone for 30 s, so a dead agent's slice does not claim
//     readiness for long; it also withdraws them at its own start (node
//     reboot), so pods wait for the agent instead of failing admission, and
//     the gate publishes again as soon as it sees the deletion.
//   - Uninstall (the agent's removal decision) deletes the node's slices
//     after the gate has stopped, so nothing writes them again.
//   - An agent rollout hands the node over (kubeletplugin.RollingUpdate):
//     the two agents' plugins register on sockets named by their pods' UIDs
//     and the kubelet uses the newest connected one. The successor
//     registers once the node is ready under it (TakeOver), so the kubelet
//     never asks a plugin that would refuse; the retired agent stops
//     writing the slice at once (one writer: it cannot undo the
//     successor's taint) and answers the kubelet until the successor's
//     plugin is registered (Retire). Prepare and unprepare read the record
//     of prepared claims from the shared file on every call, under the
//     helper's file lock: either instance may be asked either.
package dra

import (
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/go-logr/logr"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/dynamic-resource-allocation/resourceslice"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"

	"golang.org/x/sys/unix"

	"github.com/inpod-dev/inpod/internal/atomicfile"
	"github.com/inpod-dev/inpod/internal/latest"
	"github.com/inpod-dev/inpod/internal/unixsock"
	"github.com/inpod-dev/inpod/readiness"
)

// Defaults of the design.
const (
	DefaultDriverName = "redirection.inpod.dev"
	// DeviceName is the one device of the pool.
	DeviceName          = "redirection"
	DefaultRegistrarDir = kubeletplugin.KubeletRegistryDir
	// DefaultPluginDir is where the plugin's socket and its record of
	// prepared claims live: /var/lib/kubelet/plugins/<driver>.
	DefaultPluginDir = kubeletplugin.KubeletPluginsDir + "/" + DefaultDriverName
	// TaintKeyPrefix starts every taint key; the rest names the condition.
	TaintKeyPrefix = "redirection.inpod.dev/"
	// checkpointFile, in the plugin dir, records the prepared claims.
	checkpointFile = "prepared-claims.json"
)

// taintNames maps readiness conditions to taint key suffixes; a condition
// this version does not know taints as "not-ready".
var taintNames = map[string]string{
	readiness.CNIInstalled:     "cni-not-installed",
	readiness.ZtunnelConnected: "ztunnel-not-connected",
	readiness.PodsSynced:       "pods-not-synced",
}

// TaintKeys are the device taint keys for a readiness state, sorted; none
// when ready.
func TaintKeys(st readiness.State) []string {
	if st.Ready {
		return nil
	}
	set := map[string]bool{}
	for _, f := range st.Failing {
		name, _, _ := strings.Cut(f, ": ")
		suffix, ok := taintNames[name]
		if !ok {
			suffix = "not-ready"
		}
		set[TaintKeyPrefix+suffix] = true
	}
	if len(set) == 0 {
		set[TaintKeyPrefix+"not-ready"] = true
	}
	keys := make([]string, 0, len(set))
	for k := range set {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

// Observer counts what the gate does, for metrics.
type Observer interface {
	// SlicePublished counts a write of the node's slice seen in the API.
	SlicePublished()
	// TaintsChanged counts a change of the published taints (tainted: the
	// device now carries at least one).
	TaintsChanged(tainted bool)
	// SliceWritten observes the time from a readiness change to the slice
	// saying so in the API.
	SliceWritten(took time.Duration)
	// PrepareRefused counts a NodePrepareResources refused while not ready.
	PrepareRefused()
}

// Config configures the gate.
type Config struct {
	Client   kubernetes.Interface
	NodeName string
	// DriverName defaults to DefaultDriverName.
	DriverName string
	// RegistrarDir is the kubelet's plugins_registry; PluginDir the
	// plugin's own directory (socket, checkpoint). Both must be the same
	// paths inside and outside the agent's container.
	RegistrarDir, PluginDir string
	// RollingUpdateUID, the agent pod's UID, lets two agents of the node
	// serve the driver side by side during a hand-over (TakeOver, Retire):
	// their sockets are named by it. Empty: one socket name, so the agent
	// before must have exited.
	RollingUpdateUID types.UID
	// StartupGrace: how long a restarted agent waits for its first ready
	// verdict before it taints a slice that a previous agent left
	// untainted (readiness.StartupHold); 0 means
	// readiness.DefaultStartupGrace, negative none.
	StartupGrace time.Duration
	Observer     Observer
	Logger       *slog.Logger
}

// Driver is the DRA gate.
type Driver struct {
	cfg Config
	log *slog.Logger

	mu sync.Mutex
	// ready is what NodePrepareResources follows; failing, why not.
	ready   bool
	failing []string
	// health is the device's health as the kubelet's DRAResourceHealth
	// stream reports it: ready, with the same verdict as ready.
	health *latest.Value[deviceHealth]
	// prepared is the checkpointed record (claim UID → namespace/name).
	prepared map[types.UID]string

	// fatal carries an error the helper reports that must stop the gate.
	fatal chan error
	// retry is signalled when a slice write failed.
	retry chan struct{}
	// wiped is signalled when the node's slice was deleted.
	wiped chan struct{}

	// sliceWriter writes the node's ResourceSlice; apart from the helper so a
	// retired agent stops writing while it still answers the kubelet.
	sliceWriter *resourceslice.Controller
	// registerWait: see TakeOver. retired is closed by Retire; lingerFor
	// is its bound.
	registerWait time.Duration
	retireOnce   sync.Once
	retired      chan struct{}
	// Under mu: what the retirement found (see linger).
	lingerFor       time.Duration
	markerAtRetire  string
	socketsAtRetire []string
	markOnce        sync.Once

	// For the latency metric: the wanted taints and since when.
	wantMu    sync.Mutex
	wantKeys  []string
	wantSince time.Time
	wantSet   bool
	seenKeys  []string
	seenValid bool
}

// New validates cfg.
func New(cfg Config) (*Driver, error) {
	if cfg.Client == nil {
		return nil, errors.New("dra: no API client")
	}
	if cfg.NodeName == "" {
		return nil, errors.New("dra: no node name")
	}
	if cfg.DriverName == "" {
		cfg.DriverName = DefaultDriverName
	}
	if cfg.RegistrarDir == "" {
		cfg.RegistrarDir = DefaultRegistrarDir
	}
	if cfg.PluginDir == "" {
		cfg.PluginDir = filepath.Join(kubeletplugin.KubeletPluginsDir, cfg.DriverName)
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
	return &Driver{cfg: cfg, log: log.With("component", "dra", "driver", cfg.DriverName, "node", cfg.NodeName),
		fatal: make(chan error, 1), retry: make(chan struct{}, 1), wiped: make(chan struct{}, 1), retired: make(chan struct{}),
		health: latest.New(deviceHealth{status: kubeletplugin.HealthStatusUnknown, message: "the agent has no readiness verdict yet"})}, nil
}

// Name is the gate's --gate value.
func (d *Driver) Name() string { return "dra" }

// PluginSocket is the DRA gRPC socket the kubelet dials.
func (d *Driver) PluginSocket() string { return filepath.Join(d.cfg.PluginDir, d.pluginSocketName()) }

// pluginSocketName is the helper's "dra.sock", or with rolling updates one
// per pod: named by a hash of its UID, not the UID itself (the helper's
// choice), which leaves a plugin dir of ~60 bytes within the 108 of a
// unix socket path.
func (d *Driver) pluginSocketName() string {
	if d.cfg.RollingUpdateUID == "" {
		return "dra.sock"
	}
	sum := sha256.Sum256([]byte(d.cfg.RollingUpdateUID))
	return "dra-" + base64.RawURLEncoding.EncodeToString(sum[:9]) + ".sock"
}

// RegistrationSocket is the socket the kubelet's plugin watcher finds.
func (d *Driver) RegistrationSocket() string {
	if d.cfg.RollingUpdateUID != "" {
		return filepath.Join(d.cfg.RegistrarDir, kubeletplugin.RollingUpdateRegistrarSocketFile(d.cfg.RegistrarDir, d.cfg.DriverName, d.cfg.RollingUpdateUID))
	}
	return filepath.Join(d.cfg.RegistrarDir, d.cfg.DriverName+"-reg.sock")
}

// MaxRegisterWait bounds TakeOver's wait.
const MaxRegisterWait = time.Minute

// TakeOver is called before Run when the agent took the node over from a
// running agent whose plugin still serves the driver (RollingUpdateUID
// set): the kubelet asks the newest plugin, so this one registers only once
// the node is ready here, or after wait (at most MaxRegisterWait).
// Registering earlier would refuse the claims of pods bound meanwhile, and
// each refusal costs such a pod the kubelet's sync back-off.
func (d *Driver) TakeOver(wait time.Duration) { d.registerWait = min(wait, MaxRegisterWait) }

// Retire tells a running gate that its agent handed the node over: it
// stops writing the node's slice at once (the successor's gate owns it),
// no longer follows readiness or refreshes the device's health, and
// answers the kubelet as it last did until the kubelet uses the
// successor's plugin (see linger) or for at most linger; then Run returns. The
// slice stays: the kubelet wipes a driver's slices only once no plugin of
// it is left.
func (d *Driver) Retire(linger time.Duration) {
	d.retireOnce.Do(func() {
		marker, sockets := d.readMarker(), d.registrationSockets()
		d.mu.Lock()
		d.lingerFor, d.markerAtRetire, d.socketsAtRetire = linger, marker, sockets
		d.mu.Unlock()
		close(d.retired)
	})
}

func (d *Driver) isRetired() bool {
	select {
	case <-d.retired:
		return true
	default:
		return false
	}
}

// siblingGrace is how long a retired gate serves on after the successor's
// registration socket serves, when the kubelet's use of it is not seen: its
// plugin watcher registers a new socket within a second or two.
var siblingGrace = 5 * time.Second

// Run registers with the kubelet, serves it and publishes the node's pool,
// following ready, until ctx ends or a retirement's linger. It stops the
// helper and the slice writes before returning, so nothing writes the
// slice afterwards. A Driver runs once.
func (d *Driver) Run(ctx context.Context, ready *readiness.Aggregate) error {
	for _, dir := range []string{d.cfg.RegistrarDir, d.cfg.PluginDir} {
		if err := os.MkdirAll(dir, 0o750); err != nil {
			return fmt.Errorf("dra: %w", err)
		}
	}
	if err := d.loadCheckpoint(); err != nil {
		return err
	}
	states, cancel := ready.Subscribe()
	defer cancel()

	ctx, stop := context.WithCancel(ctx)
	defer stop()
	// The helper logs through klog; send it to the agent's logger.
	ctx = klog.NewContext(ctx, logr.FromSlogHandler(d.log.Handler()))

	existing, err := d.slices(ctx)
	if err != nil {
		// Not knowing only costs the grace: assume a slice exists.
		d.log.Warn("cannot list the node's ResourceSlices; assuming one exists", "err", err)
		existing = 1
	}
	watchDone := d.watchSlices(ctx)
	defer func() { <-watchDone }()
	defer stop()

	var (
		last readiness.State
		// known: last holds a state from the aggregate (it sends one at
		// once), so a wipe or a retry never publishes a made-up one.
		known bool
	)
	if d.registerWait > 0 {
		var retired bool
		if last, known, retired = d.awaitReady(ctx, states); retired || ctx.Err() != nil {
			return nil
		}
	}
	if d.isRetired() {
		return nil // handed over before it ever registered
	}
	// Two gates starting at once (a reboot during a hand-over) must not
	// take each other's fresh socket for a stale one.
	unlock, err := d.lockStart(ctx)
	if err != nil {
		return err
	}
	if ctx.Err() != nil {
		if unlock != nil {
			unlock()
		}
		return nil
	}
	if unlock != nil {
		d.removeStaleSockets()
	} else {
		d.log.Warn("another gate holds the start lock; starting without removing stale sockets", "waited", startLockWait)
		unlock = func() {}
	}
	opts := []kubeletplugin.Option{
		kubeletplugin.DriverName(d.cfg.DriverName),
		kubeletplugin.KubeClient(d.cfg.Client),
		kubeletplugin.NodeName(d.cfg.NodeName),
		kubeletplugin.RegistrarDirectoryPath(d.cfg.RegistrarDir),
		kubeletplugin.PluginDataDirectoryPath(d.cfg.PluginDir),
		// The kubelet's DRAResourceHealth stream: the device's health is
		// the node's readiness (WatchHealthStatus).
		kubeletplugin.HealthService(true),
	}
	if d.cfg.RollingUpdateUID != "" {
		opts = append(opts, kubeletplugin.RollingUpdate(d.cfg.RollingUpdateUID), kubeletplugin.PluginSocket(d.pluginSocketName()))
	}
	// The helper stops when Run returns (helper.Stop), not with ctx: a
	// retired gate may serve on for a moment after it (linger).
	helper, err := kubeletplugin.Start(context.WithoutCancel(ctx), d, opts...)
	unlock()
	if err != nil {
		return fmt.Errorf("dra: start the kubelet plugin: %w", err)
	}
	defer helper.Stop()
	defer d.stopSlices()
	d.log.Info("DRA kubelet plugin serving", "socket", d.PluginSocket(), "registration", d.RegistrationSocket())

	// Publish nothing until the first verdict of this agent: a slice a
	// previous agent left is not re-tainted by this one's first moments.
	hold := readiness.HoldStartup(d.cfg.StartupGrace, existing > 0)
	defer hold.Stop()
	var (
		retryC, wipeC <-chan time.Time
		wipeChecks    int
	)
	if known && !d.isRetired() && hold.Observe(last) {
		if err := d.publish(ctx, last); err != nil {
			return err
		}
	}
	for {
		select {
		case <-ctx.Done():
			return nil
		case err := <-d.fatal:
			return err
		case <-d.retired:
		case st := <-states:
			if d.isRetired() {
				break
			}
			last, known = st, true
			d.setReady(st)
			if !hold.Observe(st) {
				continue
			}
		case <-hold.Expired():
			if !hold.Expire() {
				continue
			}
			d.log.Warn("no ready verdict within the startup grace; publishing the not-ready state", "grace", d.cfg.StartupGrace, "failing", last.Failing)
		case <-d.wiped:
			// The slice controller would look again only after its 30 s
			// sync delay; handing it the pool makes it sync now, and
			// again until the slice is back: its own watch may see the
			// deletion after ours, and a sync before that is a no-op.
			if hold.Holding() || !known {
				continue
			}
			wipeC, wipeChecks = time.After(wipeRecheck), 0
		case <-wipeC:
			wipeC = nil
			// Bounded: a slice that cannot be written is the retry
			// path's business.
			if wipeChecks++; d.sliceSeen() || wipeChecks > maxWipeChecks {
				continue
			}
			wipeC = time.After(wipeRecheck)
		case <-d.retry:
			// A failed write: the controller retries with a backoff that
			// grows to minutes; handing it the pool again makes it sync
			// at once, so the slice converges soon after an API outage.
			if retryC == nil && !hold.Holding() && known {
				retryC = time.After(RetryInterval)
			}
			continue
		case <-retryC:
			retryC = nil
		}
		if d.isRetired() {
			// Checked after every wake-up, not as one case among the
			// others: a retired gate neither follows readiness nor writes.
			d.stopSlices()
			return d.linger(ctx)
		}
		if err := d.publish(ctx, last); err != nil {
			return err
		}
	}
}

// awaitReady follows readiness without registering, until the node is
// ready here, registerWait passes, ctx ends or the gate is retired.
func (d *Driver) awaitReady(ctx context.Context, states <-chan readiness.State) (last readiness.State, known, retired bool) {
	d.log.Info("took the node over: registering once the node is ready here", "atMost", d.registerWait)
	deadline := time.NewTimer(d.registerWait)
	defer deadline.Stop()
	for {
		select {
		case <-ctx.Done():
			return last, known, false
		case <-d.retired:
			return last, known, true
		case <-deadline.C:
			d.log.Warn("the node is not ready here within the wait; registering anyway", "wait", d.registerWait, "failing", last.Failing)
			return last, known, false
		case st := <-states:
			last, known = st, true
			d.setReady(st)
			if st.Ready {
				return last, known, false
			}
		}
	}
}

// linger answers the kubelet on, as the gate last did, until the
// successor's plugin is registered, lingerFor passes, ctx ends or the
// helper fails. The kubelet asking the successor's plugin anything (the
// health stream, a claim) is the proof it registered it (the marker
// file); without that (the health stream off), a registration socket that
// appeared since the retirement and serves for siblingGrace. After the
// proof it serves handOverSettle more: calls the kubelet sent it just
// before finish, and a registration the kubelet undoes (its status notify
// failed) is retried before this plugin is gone.
func (d *Driver) linger(ctx context.Context) error {
	d.mu.Lock()
	limit, markerBefore, socketsBefore := d.lingerFor, d.markerAtRetire, d.socketsAtRetire
	d.mu.Unlock()
	d.log.Info("retired: no longer writing the node's slice; serving until the successor's plugin is registered", "atMost", limit)
	deadline := time.NewTimer(limit)
	defer deadline.Stop()
	poll := time.NewTicker(lingerPoll)
	defer poll.Stop()
	var servingSince, usedSince time.Time
	used := func() bool {
		m := d.readMarker()
		return m != "" && m != markerBefore && m != filepath.Base(d.RegistrationSocket())
	}
	stopped := ctx.Done()
	var stopBound <-chan time.Time
	for {
		switch {
		case !usedSince.IsZero():
			if time.Since(usedSince) >= handOverSettle {
				return nil
			}
		case used():
			usedSince = time.Now()
			d.log.Info("the kubelet uses the successor's plugin; deregistering", "registration", d.readMarker(), "in", handOverSettle)
		default:
			if sock := d.servingSibling(socketsBefore); sock == "" {
				servingSince = time.Time{}
			} else if servingSince.IsZero() {
				servingSince = time.Now()
				d.log.Info("the successor's plugin serves; deregistering once the kubelet uses it", "registration", sock, "orAfter", siblingGrace)
			} else if time.Since(servingSince) >= siblingGrace {
				return nil
			}
		}
		select {
		case <-stopped:
			// Stopped: the DaemonSet deletes this pod once the
			// successor's is ready, while the kubelet registers its
			// plugin. A moment more, within the agent's bound for its
			// pieces to stop.
			stopped, stopBound = nil, time.After(lingerAfterStop)
		case <-stopBound:
			return nil
		case err := <-d.fatal:
			return err
		case <-deadline.C:
			d.log.Warn("no successor's plugin registered within the linger; deregistering (pods wait for it)", "linger", limit)
			return nil
		case <-poll.C:
		}
	}
}

// handOverSettle is how long a retired gate serves on once the kubelet
// uses the successor's plugin.
const handOverSettle = 2 * time.Second

// lingerAfterStop bounds how long a retired gate serves on after its stop:
// under the agent's 5 s bound for its pieces to stop.
const lingerAfterStop = 3 * time.Second

// markerFile, in the plugin dir, names the registration socket of the
// plugin the kubelet last started to use (see linger).
const markerFile = "kubelet-uses"

func (d *Driver) readMarker() string {
	b, err := os.ReadFile(filepath.Join(d.cfg.PluginDir, markerFile))
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(b))
}

// kubeletUses records, once, that the kubelet asked this plugin
// something: it registered it.
func (d *Driver) kubeletUses() {
	if d.cfg.RollingUpdateUID == "" || d.isRetired() {
		return
	}
	d.markOnce.Do(func() {
		if err := atomicfile.Write(filepath.Join(d.cfg.PluginDir, markerFile), []byte(filepath.Base(d.RegistrationSocket())+"\n"), 0o600); err != nil {
			// The retired plugin then waits siblingGrace instead.
			d.log.Warn("could not record that the kubelet uses this plugin", "err", err)
		}
	})
}

// lingerPoll is how often a retired gate looks for the successor's socket.
const lingerPoll = 100 * time.Millisecond

// registrationSockets lists this driver's registration sockets in the
// registrar dir but this gate's own (the helper's names: <driver>-reg.sock,
// or <driver>-<pod UID or its hash>-reg.sock with rolling updates).
func (d *Driver) registrationSockets() []string {
	entries, err := os.ReadDir(d.cfg.RegistrarDir)
	if err != nil {
		return nil
	}
	own := filepath.Base(d.RegistrationSocket())
	var out []string
	for _, e := range entries {
		name := e.Name()
		if name != own && strings.HasPrefix(name, d.cfg.DriverName+"-") && strings.HasSuffix(name, "-reg.sock") {
			out = append(out, filepath.Join(d.cfg.RegistrarDir, name))
		}
	}
	return out
}

// servingSibling is another plugin's registration socket of this driver,
// none of before, that accepts connections, or "". (A socket there at the
// retirement is an agent before this one, lingering too.)
func (d *Driver) servingSibling(before []string) string {
	for _, sock := range d.registrationSockets() {
		if !slices.Contains(before, sock) && unixsock.Serving("unix", sock) {
			return sock
		}
	}
	return ""
}

// removeStaleSockets removes the sockets of this driver's plugins that
// nobody serves any more (an agent killed without its clean stop): the
// helper cannot, and the kubelet would keep a plugin on them. A socket
// that answers, or whose state is unsure, stays.
func (d *Driver) removeStaleSockets() {
	stale := d.registrationSockets()
	if plugin, err := filepath.Glob(filepath.Join(d.cfg.PluginDir, "dra*.sock")); err == nil {
		stale = append(stale, plugin...)
	}
	for _, sock := range stale {
		if sock == d.PluginSocket() || !socketRefused(sock) {
			continue
		}
		if err := os.Remove(sock); err == nil {
			d.log.Info("removed a socket no plugin serves (an agent before that did not stop cleanly)", "socket", sock)
		}
	}
}

// socketRefused tells whether nobody listens on path: a socket file whose
// connection is refused. Stricter than "not unixsock.Serving": a full
// backlog (EAGAIN) is a plugin that serves.
func socketRefused(path string) bool {
	c, err := net.DialTimeout("unix", path, time.Second)
	if err == nil {
		c.Close()
		return false
	}
	return errors.Is(err, syscall.ECONNREFUSED)
}

// lockStart serialises the gates' starts on the node (a lock file in the
// plugin dir, released by the returned func). A holder keeps it for
// seconds at most; past startLockWait (a frozen holder) it returns nil and
// no error, and the caller starts without the stale-socket cleanup.
func (d *Driver) lockStart(ctx context.Context) (func(), error) {
	f, err := os.OpenFile(filepath.Join(d.cfg.PluginDir, "start.lock"), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, fmt.Errorf("dra: %w", err)
	}
	giveUp := time.Now().Add(startLockWait)
	for {
		err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
		if err == nil {
			return func() { f.Close() }, nil
		}
		if !errors.Is(err, unix.EWOULDBLOCK) {
			f.Close()
			return nil, fmt.Errorf("dra: lock %s: %w", f.Name(), err)
		}
		if ctx.Err() != nil || time.Now().After(giveUp) {
			f.Close()
			return nil, nil
		}
		select {
		case <-ctx.Done():
		case <-time.After(lingerPoll):
		}
	}
}

// startLockWait bounds the wait for another gate's start.
const startLockWait = 10 * time.Second

// stopSlices stops writing the node's slice, leaving it as it is.
func (d *Driver) stopSlices() {
	d.wantMu.Lock()
	ctl := d.sliceWriter
	d.sliceWriter = nil
	d.wantMu.Unlock()
	ctl.Stop()
}

// RetryInterval is how soon a failed slice write is retried.
var RetryInterval = 2 * time.Second

// wipeRecheck is how often a deleted slice is handed to the controller again
// until it is back.
const (
	wipeRecheck   = 250 * time.Millisecond
	maxWipeChecks = 40
)

// sliceSeen reports whether the gate's watch shows the node's slice.
func (d *Driver) sliceSeen() bool {
	d.wantMu.Lock()
	defer d.wantMu.Unlock()
	return d.seenValid
}

func (d *Driver) setReady(st readiness.State) {
	d.mu.Lock()
	changed := d.ready != st.Ready
	healthChanged := changed || !slices.Equal(d.failing, st.Failing) || d.health.Get().status == kubeletplugin.HealthStatusUnknown
	d.ready, d.failing = st.Ready, slices.Clone(st.Failing)
	if healthChanged {
		d.health.Publish(healthOf(st))
	}
	d.mu.Unlock()
	if changed {
		if st.Ready {
			d.log.Info("node ready: preparing claims, device untainted")
		} else {
			d.log.Warn("node NOT ready: refusing to prepare claims, device tainted", "failing", st.Failing)
		}
	}
}

// publish hands the slice controller the pool for st; it writes only what
// differs from the stored slice, in the background.
func (d *Driver) publish(ctx context.Context, st readiness.State) error {
	keys := TaintKeys(st)
	res := Resources(d.cfg.NodeName, keys)
	d.wantMu.Lock()
	if !d.wantSet || !slices.Equal(keys, d.wantKeys) {
		d.wantKeys, d.wantSince, d.wantSet = keys, time.Now(), true
	}
	ctl := d.sliceWriter
	d.wantMu.Unlock()
	if ctl != nil {
		ctl.Update(&res)
	} else {
		// As the helper's PublishResources would start it, but with
		// the gate's lifetime rather than the helper's (Retire).
		ctl, err := resourceslice.StartController(klog.NewContext(ctx, klog.LoggerWithName(klog.FromContext(ctx), "ResourceSlice controller")),
			resourceslice.Options{DriverName: d.cfg.DriverName, KubeClient: d.cfg.Client,
				Owner:     &resourceslice.Owner{APIVersion: "v1", Kind: "Node", Name: d.cfg.NodeName},
				Resources: &res, ErrorHandler: d.sliceError})
		if err != nil {
			if ctx.Err() != nil {
				return nil // stopped while the controller synced
			}
			return fmt.Errorf("dra: publish: %w", err)
		}
		d.wantMu.Lock()
		d.sliceWriter = ctl
		d.wantMu.Unlock()
	}
	d.checkSeen()
	return nil
}

// Resources is the node's pool with the given taints on its device.
func Resources(nodeName string, taintKeys []string) resourceslice.DriverResources {
	dev := resourceapi.Device{Name: DeviceName, AllowMultipleAllocations: ptr.To(true)}
	for _, k := range taintKeys {
		dev.Taints = append(dev.Taints, resourceapi.DeviceTaint{Key: k, Effect: resourceapi.DeviceTaintEffectNoSchedule})
	}
	return resourceslice.DriverResources{Pools: map[string]resourceslice.Pool{
		nodeName: {Slices: []resourceslice.Slice{{Devices: []resourceapi.Device{dev}}}},
	}}
}

// sliceSelector selects this driver's slices of this node.
func (d *Driver) sliceSelector() string {
	return fields.Set{resourceapi.ResourceSliceSelectorDriver: d.cfg.DriverName,
		resourceapi.ResourceSliceSelectorNodeName: d.cfg.NodeName}.String()
}

func (d *Driver) slices(ctx context.Context) (int, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	list, err := d.cfg.Client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{FieldSelector: d.sliceSelector()})
	if err != nil {
		return 0, err
	}
	return len(list.Items), nil
}

// watchSlices follows the node's slices for the metrics: writes, taint
// changes and the time from a readiness change to the slice saying so.
func (d *Driver) watchSlices(ctx context.Context) <-chan struct{} {
	sel := d.sliceSelector()
	lw := cache.NewFilteredListWatchFromClient(d.cfg.Client.ResourceV1().RESTClient(), "resourceslices", "",
		func(o *metav1.ListOptions) { o.FieldSelector = sel })
	inf := cache.NewSharedIndexInformer(lw, &resourceapi.ResourceSlice{}, 0, cache.Indexers{})
	seen := func(obj any, write bool) {
		s, ok := obj.(*resourceapi.ResourceSlice)
		if !ok {
			return
		}
		if write {
			d.cfg.Observer.SlicePublished()
		}
		var keys []string
		for _, dev := range s.Spec.Devices {
			for _, t := range dev.Taints {
				if !slices.Contains(keys, t.Key) {
					keys = append(keys, t.Key)
				}
			}
		}
		sort.Strings(keys)
		d.wantMu.Lock()
		if d.seenValid && !slices.Equal(keys, d.seenKeys) && write {
			d.cfg.Observer.TaintsChanged(len(keys) > 0)
		}
		d.seenKeys, d.seenValid = keys, true
		d.wantMu.Unlock()
		d.checkSeen()
	}
	inf.AddEventHandler(cache.ResourceEventHandlerDetailedFuncs{
		AddFunc: func(obj any, initial bool) { seen(obj, !initial) },
		UpdateFunc: func(old, obj any) {
			o, _ := old.(*resourceapi.ResourceSlice)
			n, _ := obj.(*resourceapi.ResourceSlice)
			seen(obj, o != nil && n != nil && o.ResourceVersion != n.ResourceVersion)
		},
		DeleteFunc: func(any) {
			d.wantMu.Lock()
			d.seenValid = false
			d.wantMu.Unlock()
			// The kubelet wipes every slice of its node when it starts
			// (and a driver's when its connection is gone 30 s); the
			// slice controller would only look again after its 30 s sync delay.
			// Ask it now: pods need not wait half a minute for a slice
			// of a driver that is serving.
			select {
			case d.wiped <- struct{}{}:
			default:
			}
		},
	})
	done := make(chan struct{})
	go func() { defer close(done); inf.Run(ctx.Done()) }()
	return done
}

// checkSeen observes the latency once the API shows the wanted taints.
func (d *Driver) checkSeen() {
	d.wantMu.Lock()
	defer d.wantMu.Unlock()
	if d.wantSince.IsZero() || !d.seenValid || !slices.Equal(d.seenKeys, d.wantKeys) {
		return
	}
	took := time.Since(d.wantSince)
	d.wantSince = time.Time{}
	d.cfg.Observer.SliceWritten(took)
	d.log.Info("ResourceSlice says the node's readiness", "taints", d.wantKeys, "took", took)
}

// RemoveFromNode deletes this driver's slices of this node: for the
// agent's uninstall, after Run has returned (the gate would write them
// again otherwise). The kubelet would withdraw them some 30 s after the
// plugin deregistered; this does not wait for that.
func (d *Driver) RemoveFromNode(ctx context.Context) error {
	rs := d.cfg.Client.ResourceV1().ResourceSlices()
	list, err := rs.List(ctx, metav1.ListOptions{FieldSelector: d.sliceSelector()})
	if err != nil {
		return fmt.Errorf("dra: list the node's ResourceSlices: %w", err)
	}
	var errs []error
	for _, s := range list.Items {
		err := rs.Delete(ctx, s.Name, metav1.DeleteOptions{Preconditions: &metav1.Preconditions{UID: &s.UID}})
		if err != nil && !apierrors.IsNotFound(err) {
			errs = append(errs, err)
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("dra: delete the node's ResourceSlices: %w", err)
	}
	d.log.Info("removed the node's ResourceSlices", "slices", len(list.Items))
	return nil
}

// PrepareResourceClaims implements kubeletplugin.DRAPlugin: the second
// guard. While the node is not ready every claim is refused (the kubelet
// retries and the pod waits); when ready each claim is recorded and its
// allocated device returned. Repeats answer the same.
func (d *Driver) PrepareResourceClaims(ctx context.Context, claims []*resourceapi.ResourceClaim) (map[types.UID]kubeletplugin.PrepareResult, error) {
	d.kubeletUses()
	d.mu.Lock()
	defer d.mu.Unlock()
	d.prepared = d.readCheckpoint()
	out := make(map[types.UID]kubeletplugin.PrepareResult, len(claims))
	if !d.ready {
		for _, c := range claims {
			d.cfg.Observer.PrepareRefused()
			out[c.UID] = kubeletplugin.PrepareResult{Err: fmt.Errorf("node %s is not ready for redirection; refusing to prepare claim %s/%s", d.cfg.NodeName, c.Namespace, c.Name)}
		}
		d.log.Warn("refused to prepare claims: the node is not ready", "claims", len(claims))
		return out, nil
	}
	next, added := maps(d.prepared), false
	for _, c := range claims {
		var devs []kubeletplugin.Device
		if c.Status.Allocation != nil {
			for _, r := range c.Status.Allocation.Devices.Results {
				if r.Driver != d.cfg.DriverName {
					continue
				}
				devs = append(devs, kubeletplugin.Device{Requests: []string{r.Request}, PoolName: r.Pool, DeviceName: r.Device, ShareID: r.ShareID})
			}
		}
		if _, ok := next[c.UID]; !ok {
			next[c.UID], added = c.Namespace+"/"+c.Name, true
		}
		out[c.UID] = kubeletplugin.PrepareResult{Devices: devs}
	}
	if added {
		if err := d.saveCheckpoint(next); err != nil {
			return nil, err
		}
	}
	return out, nil
}

// UnprepareResourceClaims implements kubeletplugin.DRAPlugin: forgets the
// claims; one never prepared (or forgotten before) is not an error.
func (d *Driver) UnprepareResourceClaims(ctx context.Context, claims []kubeletplugin.NamespacedObject) (map[types.UID]error, error) {
	d.kubeletUses()
	d.mu.Lock()
	defer d.mu.Unlock()
	d.prepared = d.readCheckpoint()
	out := make(map[types.UID]error, len(claims))
	next := maps(d.prepared)
	for _, c := range claims {
		delete(next, c.UID)
		out[c.UID] = nil
	}
	if len(next) != len(d.prepared) {
		if err := d.saveCheckpoint(next); err != nil {
			return nil, err
		}
	}
	return out, nil
}

// Prepared lists the recorded claims (namespace/name), sorted.
func (d *Driver) Prepared() []string {
	d.mu.Lock()
	defer d.mu.Unlock()
	var out []string
	for _, v := range d.prepared {
		out = append(out, v)
	}
	sort.Strings(out)
	return out
}

// HandleError implements kubeletplugin.DRAPlugin: a failure of the
// helper's gRPC servers stops the gate.
func (d *Driver) HandleError(ctx context.Context, err error, msg string) {
	if !errors.Is(err, kubeletplugin.ErrRecoverable) {
		d.stopOn(fmt.Errorf("dra: %s: %w", msg, err))
		return
	}
	d.sliceError(ctx, err, msg)
}

func (d *Driver) stopOn(err error) {
	select {
	case d.fatal <- err:
	default:
	}
}

// sliceError handles the slice controller's errors. The API server
// dropping fields of the slice (device taints or allowMultipleAllocations:
// features off) would publish a device that looks ready while it is not:
// that stops the gate. Other errors are retried by the controller.
func (d *Driver) sliceError(_ context.Context, err error, msg string) {
	var dropped *resourceslice.DroppedFieldsError
	if errors.As(err, &dropped) {
		d.stopOn(fmt.Errorf("dra: %s: %w", msg, err))
		return
	}
	d.log.Warn("DRA slice publishing: "+msg+"; retrying", "err", err)
	select {
	case d.retry <- struct{}{}:
	default:
	}
}

// deviceHealth is the one device's health: the node's readiness.
type deviceHealth struct {
	status  kubeletplugin.HealthStatus
	message string
}

func healthOf(st readiness.State) deviceHealth {
	if st.Ready {
		return deviceHealth{status: kubeletplugin.HealthStatusHealthy, message: "the node is ready for redirection"}
	}
	return deviceHealth{status: kubeletplugin.HealthStatusUnhealthy, message: "the node is not ready for redirection: " + strings.Join(st.Failing, "; ")}
}

// HealthResendEvery is how often the device's health is reported again
// unchanged: the kubelet takes a health not refreshed within 30 s for
// unknown.
var HealthResendEvery = 10 * time.Second

// WatchHealthStatus implements kubeletplugin.DRAPlugin: the kubelet's
// DRAResourceHealth stream gets the device's health at once, again on
// every change of the node's readiness, and every HealthResendEvery.
//
// Only containers that name a ResourceClaim show it in their
// allocatedResourcesStatus: the kubelet (1.37) reports none for a
// container whose request of the extended resource DRA serves, which is
// how enrolled pods ask for the device. It is there for such claims, and
// for the kubelet's own view; the gate itself is the device's taints and
// NodePrepareResources.
func (d *Driver) WatchHealthStatus(ctx context.Context, reports chan<- kubeletplugin.DeviceHealthReport) error {
	d.kubeletUses()
	changes, cancel := d.health.Subscribe()
	defer cancel()
	resend := time.NewTicker(HealthResendEvery)
	defer resend.Stop()
	h := <-changes // the current health
	for {
		report := kubeletplugin.DeviceHealthReport{Devices: []kubeletplugin.DeviceHealth{{
			PoolName: d.cfg.NodeName, DeviceName: DeviceName, Health: h.status, Message: h.message, LastUpdated: time.Now(),
		}}}
		select {
		case <-ctx.Done():
			return nil
		case reports <- report:
		}
	wait:
		for {
			select {
			case <-ctx.Done():
				return nil
			case h = <-changes:
				break wait
			case <-resend.C:
				// Retired: the successor's plugin reports the health
				// now, and the kubelet keeps whichever report came last.
				if !d.isRetired() {
					h = d.health.Get()
					break wait
				}
			}
		}
	}
}

type checkpoint struct {
	// Claims maps claim UID to namespace/name.
	Claims map[types.UID]string `json:"claims"`
}

func (d *Driver) checkpointPath() string { return filepath.Join(d.cfg.PluginDir, checkpointFile) }

func (d *Driver) loadCheckpoint() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.prepared = d.readCheckpoint()
	return nil
}

// readCheckpoint reads the record as the file holds it now: during a
// hand-over the other agent's plugin may have written it since.
func (d *Driver) readCheckpoint() map[types.UID]string {
	b, err := os.ReadFile(d.checkpointPath())
	if errors.Is(err, os.ErrNotExist) {
		return map[types.UID]string{}
	}
	if err != nil {
		// Bookkeeping only (nothing is decided from it): an agent that
		// stopped on it would close the gate for a file.
		d.log.Warn("the record of prepared claims cannot be read; starting a new one", "path", d.checkpointPath(), "err", err)
		return map[types.UID]string{}
	}
	var cp checkpoint
	if err := json.Unmarshal(b, &cp); err != nil || cp.Claims == nil {
		if err != nil {
			// Only bookkeeping is lost: unprepare of an unknown claim succeeds.
			d.log.Warn("the record of prepared claims is unreadable; starting a new one", "path", d.checkpointPath(), "err", err)
		}
		return map[types.UID]string{}
	}
	return cp.Claims
}

// saveCheckpoint adopts next and writes it so no reader sees it half
// written. A failed write (a full disk) is logged, never an error: the
// record is bookkeeping, and failing prepare for it would keep pods from
// starting on a node that is ready.
func (d *Driver) saveCheckpoint(next map[types.UID]string) error {
	d.prepared = next
	b, err := json.Marshal(checkpoint{Claims: next})
	if err == nil {
		err = atomicfile.Write(d.checkpointPath(), b, 0o600)
	}
	if err != nil {
		d.log.Warn("could not record the prepared claims; continuing without", "path", d.checkpointPath(), "err", err)
	}
	return nil
}

func maps(m map[types.UID]string) map[types.UID]string {
	out := make(map[types.UID]string, len(m)+1)
	for k, v := range m {
		out[k] = v
	}
	return out
}

type nopObserver struct{}

func (nopObserver) SlicePublished()            {}
func (nopObserver) TaintsChanged(bool)         {}
func (nopObserver) SliceWritten(time.Duration) {}
func (nopObserver) PrepareRefused()            {}
