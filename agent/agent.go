// Package agent wires the node agent together: New builds the API client
// and the scheduling gates (gate.go), Run builds each other piece from
// Config (redirection engine, host probe rules, pod informers, enrollment
// pipeline, CNI event server, CNI installer, ZDS server; see pieces),
// starts them in one errgroup so one failure stops them all, and at
// shutdown either leaves the node as it is (restart, upgrade) or removes
// inpod (removal.go). The logic lives in the sub-packages; this package
// only connects them. A starting agent takes the node over from one still
// serving it (handover.go).
package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sync/errgroup"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/metadata"
	"k8s.io/client-go/metadata/metadatainformer"
	"k8s.io/client-go/metadata/metadatalister"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/client-go/util/workqueue"

	"github.com/inpod-dev/inpod/agent/cniinstall"
	"github.com/inpod-dev/inpod/agent/cniserver"
	"github.com/inpod-dev/inpod/agent/enroll"
	"github.com/inpod-dev/inpod/agent/enrolledrecord"
	"github.com/inpod-dev/inpod/agent/handover"
	"github.com/inpod-dev/inpod/agent/observe"
	"github.com/inpod-dev/inpod/agent/podcondition"
	"github.com/inpod-dev/inpod/agent/podnetns"
	"github.com/inpod-dev/inpod/agent/redirect"
	"github.com/inpod-dev/inpod/apiaccess"
	"github.com/inpod-dev/inpod/deviceplugin"
	"github.com/inpod-dev/inpod/dra"
	"github.com/inpod-dev/inpod/enrollment"
	"github.com/inpod-dev/inpod/internal/clientlimit"
	"github.com/inpod-dev/inpod/internal/unixsock"
	"github.com/inpod-dev/inpod/netns"
	"github.com/inpod-dev/inpod/nodecondition"
	"github.com/inpod-dev/inpod/passlist"
	"github.com/inpod-dev/inpod/readiness"
	"github.com/inpod-dev/inpod/zds"
)

// DefaultCNIOwnedFile sorts before the names primary CNIs use (05-cilium,
// 10-calico, 10-flannel, 00-multus…), so the runtime picks it.
const DefaultCNIOwnedFile = "00-inpod.conflist"

// Config is everything the agent needs; cmd/inpod-agent fills it from
// flags and INPOD_* variables.
type Config struct {
	NodeName   string
	Kubeconfig string // empty: in-cluster

	ZDSSocket string
	CNISocket string

	CNISourceDir string
	CNIBinDir    string
	CNIConfDir   string
	StateDir     string
	// InstallCNI false leaves the CNI configuration alone (tests that
	// drive the plugin directly, or nodes set up by hand).
	InstallCNI bool
	// CNIOwnedFile is the file in CNIConfDir the agent owns: the primary's
	// chain with inpod-cni last, named to sort first, kept while the agent
	// is away. Empty: inpod-cni is chained into the primary's own file,
	// which the primary may rewrite while the agent is away.
	CNIOwnedFile string

	RedirectBackend string // auto, nftables, iptables-nft, iptables-legacy
	// EnrollmentLabel is the pod and namespace label that enrolls (default
	// Istio's istio.io/dataplane-mode).
	EnrollmentLabel    string
	DNSCapture         bool
	ExcludedNamespaces []string
	ProcRoot           string
	// HostNetNS is the node netns (default: the agent's own; it runs with
	// hostNetwork).
	HostNetNS string

	// HandoverSocket is where the agent serving this node passes its
	// sockets to its successor (package handover): a starting agent that
	// finds one served takes the node over once synced instead of waiting
	// for the other to exit. Empty: no hand-over; the agent binds its
	// sockets and fails while another serves them.
	HandoverSocket string
	// ProbeSocket answers the exec probes of the agent's own container
	// (cmd/inpod-probe): the agent pod is ready while this agent serves
	// the node and the node is ready, or while it waits for an agent that
	// cannot hand over to exit (so a rollout's surge can remove that
	// one). Empty: none.
	ProbeSocket string

	HealthAddr  string
	MetricsAddr string
	Logger      *slog.Logger
	// KubeAPIQPS and KubeAPIBurst are the API client's rate limit
	// (default DefaultKubeAPIQPS, DefaultKubeAPIBurst), shared by its
	// writes: the pods' redirection annotations, Events, the Node
	// condition, the plugin's token requests.
	KubeAPIQPS   float32
	KubeAPIBurst int
	// DebugPprof serves Go's profiles under /debug/pprof/ on MetricsAddr
	// (to find where memory or CPU goes on a live node).
	DebugPprof bool
	// ReleaseStartupMemory gives back the binary's pages (see package
	// codepages) once the node has been ready and then without CNI events
	// for StartupMemoryQuiet (default DefaultStartupMemoryQuiet): what
	// start-up alone ran stops counting against the node. Off in tests
	// that run the agent in their own process.
	ReleaseStartupMemory bool
	StartupMemoryQuiet   time.Duration

	// PodName and PodNamespace are the agent's own pod (downward API). At
	// shutdown the DaemonSet controlling it, by UID, tells an uninstall
	// from a restart (see uninstallWatch). Empty PodName: never remove
	// anything. The namespace also holds PluginServiceAccount.
	PodName, PodNamespace string
	// PodUID is the agent's pod's UID (downward API): with the dra gate,
	// the two agents of a hand-over name their kubelet plugin sockets by
	// it, so both serve the driver for the moments of the switch. Without
	// it the dra gate hands no node over.
	PodUID string
	// AgentSelector selects inpod agent pods of any installation (default
	// DefaultAgentSelector); one on this node other than the agent's own
	// keeps an uninstall from touching the node.
	AgentSelector string
	// PluginServiceAccount is the ServiceAccount whose token the agent
	// requests for the plugin's agent-down check (default inpod-cni).
	PluginServiceAccount string

	// Gate is how scheduling follows readiness: a comma list of gates
	// (see gateList); empty means "deviceplugin", "none" no gate.
	Gate string
	// DevicePlugin configures the device-plugin gate; its Observer, Logger,
	// DevicesFrom and PreStart are filled in by the agent.
	DevicePlugin deviceplugin.Config
	// PodResourcesSocket is the kubelet's pod-resources API. With it the
	// device-plugin gate also holds each container start of a gated pod
	// until the pod runs redirected in its current sandbox (PreStart);
	// empty, or missing at start: no such check.
	PodResourcesSocket string
	// DRA configures the dra gate; its Client, NodeName, Observer and
	// Logger are filled in by the agent.
	DRA dra.Config
	// NodeCondition configures the node-condition gate; its Client,
	// NodeName, Observer and Logger are filled in by the agent.
	NodeCondition nodecondition.Config

	// VerifyPeriod is how often every enrolled pod is re-proven (default
	// DefaultVerifyPeriod); events that may break a pod's redirection ask
	// for a round sooner. ZtunnelGrace is how long ztunnel may be away
	// before the verifier takes every pod for unproven (default
	// DefaultZtunnelGrace).
	VerifyPeriod time.Duration
	ZtunnelGrace time.Duration
}

// Agent is a running node agent.
type Agent struct {
	cfg     Config
	log     *slog.Logger
	Ready   *readiness.Aggregate
	Metrics *observe.Metrics
	restCfg *rest.Config
	client  kubernetes.Interface
	gates   []Gate

	// Set by Run.
	pipeline *enroll.Pipeline
	pods     *podCache
	// preStart is the device-plugin gate's container-start check; nil
	// without that gate or the pod-resources API.
	preStart *preStartCheck
	// closer stops the scheduler before the device-plugin gate's devices
	// turn Unhealthy; nil without that gate.
	closer *schedulingCloser

	// started ranks a hand-over when the agent has no pod.
	started time.Time
	// frozen holds ztunnel's readiness as it was while a hand-over is
	// under way; retired is set once this agent handed the node over;
	// tookOver once it took the node from another.
	frozen, retired atomic.Bool
	tookOver        bool
	// waitingForExit is set while this agent waits for an agent that
	// serves the node without a hand-over socket to exit.
	waitingForExit atomic.Bool
	// serving is set once this agent holds the node's sockets.
	serving atomic.Bool
	// acting is held (read) by what acts on the node outside the pieces
	// (a container start's reconcile, prestart.go), and quiet set once
	// such acts must end: a hand-over's retire and a stop wait for them
	// (stopActing) with the pieces, so nothing of this agent acts beside
	// its successor or a removal from the node.
	acting sync.RWMutex
	quiet  atomic.Bool
}

// DefaultKubeAPIQPS and DefaultKubeAPIBurst are the agent's API rate
// limit. Its writes follow the node's pod starts, about one annotation patch
// per enrolled pod, so the limit only binds in bursts: node start-up, a
// rollout, a restart reconcile. client-go's default (5/s, burst 10) made the
// annotations of a 50-pod burst trail its ADDs by ~10 s (enrollment
// benchmark); at 20/s with a burst of 50 such a burst is annotated as fast as
// the one annotation worker patches, and a node's sustained share stays well
// under the kubelet's own default (50/s, burst 100).
const (
	DefaultKubeAPIQPS   = 20
	DefaultKubeAPIBurst = 50
)

// stopTimeout bounds how long Run waits for what it started to stop, so a
// piece that ignores its context can never keep a failed agent alive.
const stopTimeout = 5 * time.Second

// New validates cfg and builds what needs no node access: the API client
// and the gates. Nothing runs yet.
func New(cfg Config) (*Agent, error) {
	if cfg.NodeName == "" {
		return nil, errors.New("agent: the node name is required (--node-name, usually from the downward API)")
	}
	if cfg.HostNetNS == "" {
		cfg.HostNetNS = "/proc/self/ns/net"
	}
	if cfg.RedirectBackend == "" {
		cfg.RedirectBackend = "auto"
	}
	if cfg.StartupMemoryQuiet < 0 {
		return nil, fmt.Errorf("agent: negative --release-startup-memory-quiet %v", cfg.StartupMemoryQuiet)
	}
	if cfg.StartupMemoryQuiet == 0 {
		cfg.StartupMemoryQuiet = DefaultStartupMemoryQuiet
	}
	if cfg.AgentSelector == "" {
		cfg.AgentSelector = DefaultAgentSelector
	}
	if sel, err := labels.Parse(cfg.AgentSelector); err != nil || sel.Empty() {
		return nil, fmt.Errorf("agent: --agent-selector %q is not a non-empty label selector: %v", cfg.AgentSelector, err)
	}
	if cfg.PodName != "" && cfg.PodNamespace == "" {
		return nil, errors.New("agent: --pod-name needs --pod-namespace (both from the downward API)")
	}
	if cfg.PluginServiceAccount == "" {
		cfg.PluginServiceAccount = DefaultPluginServiceAccount
	}
	if cfg.KubeAPIQPS == 0 {
		cfg.KubeAPIQPS = DefaultKubeAPIQPS
	}
	qps, burst, err := clientlimit.Resolve(float64(cfg.KubeAPIQPS), cfg.KubeAPIBurst, DefaultKubeAPIBurst)
	if err != nil {
		return nil, fmt.Errorf("agent: %w", err)
	}
	cfg.KubeAPIQPS, cfg.KubeAPIBurst = qps, burst
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	gates, err := gateList(cfg.Gate)
	if err != nil {
		return nil, err
	}
	if slices.Contains(gates, "dra") {
		if cfg.PodUID != "" {
			cfg.DRA.RollingUpdateUID = types.UID(cfg.PodUID)
		} else if cfg.HandoverSocket != "" {
			// Both agents' DRA plugins would register the same driver
			// on the same sockets.
			log.Warn("no hand-over between agents with the dra gate without --pod-uid: the agent binds its sockets and waits for the one serving them to exit", "handoverSocket", cfg.HandoverSocket)
			cfg.HandoverSocket = ""
		}
	}
	a := &Agent{cfg: cfg, log: log, Metrics: observe.NewMetrics(), started: time.Now(),
		Ready: readiness.New(log, readiness.CNIInstalled, readiness.ZtunnelConnected, readiness.PodsSynced)}
	a.Ready.OnChange(a.Metrics.Readiness)
	if a.restCfg, err = loadRestConfig(cfg.Kubeconfig); err != nil {
		return nil, err
	}
	a.restCfg.QPS, a.restCfg.Burst = cfg.KubeAPIQPS, cfg.KubeAPIBurst
	if a.client, err = kubernetes.NewForConfig(a.restCfg); err != nil {
		return nil, err
	}
	if a.gates, err = a.newGates(gates); err != nil {
		return nil, err
	}
	return a, nil
}

// Run runs the agent until ctx ends or one of its pieces fails; a failure
// stops everything else and is returned within stopTimeout. Shutting down
// for a restart or an upgrade leaves the data path as it is: rules stay in
// every pod, ztunnel keeps its proxies, the CNI plugin stays installed
// (enrolled pods fail closed until the agent is back). Shutting down
// because inpod is being uninstalled removes it from the node (see
// uninstallWatch).
func (a *Agent) Run(ctx context.Context) error {
	// Ends what build started in the background (the event broadcaster)
	// on every return.
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	p, err := a.build(ctx)
	if err != nil {
		return err
	}
	defer p.close()
	if err := a.start(ctx, p); err != nil {
		return err
	}
	if a.retired.Load() {
		// The successor serves the node and writes what this agent held.
		a.log.Info("agent stopping after it handed the node over")
		return nil
	}
	if !a.serving.Load() {
		// It never served the node (it was waiting to take it over):
		// the agent that does decides what stays.
		a.log.Info("agent stopping before it served the node")
		return nil
	}
	if p.uninstall == nil || !p.uninstall.uninstalling(context.WithoutCancel(ctx)) {
		// The writer stopped with the rest; what it still held (a burst's
		// annotations wait for its ADDs) is written now, briefly: the next
		// agent re-asserts any that do not make it.
		flushCtx, cancelFlush := context.WithTimeout(context.WithoutCancel(ctx), annotationFlushTimeout)
		// Conditions first: a pod's Ready waits on them, and the kubelet
		// must see a condition before the annotation (see
		// AnnotationWriter.WriteAfter).
		if err := p.conditions.Flush(flushCtx); err != nil {
			a.log.Warn("some pods' inpod.dev/redirected conditions not written at shutdown; the next agent writes them", "err", err)
		}
		if err := p.annotations.Flush(flushCtx); err != nil {
			a.log.Warn("some pods' redirection annotations not written at shutdown; the next agent writes them", "err", err)
		}
		cancelFlush()
		a.log.Info("agent stopping; rules, ztunnel's proxies and the CNI plugin stay in place")
		return nil
	}
	// start has returned, so the CNI server, the installer and the
	// reconciler have stopped: nothing races with the removal. The ZDS
	// server still runs, to tell ztunnel about every pod taken out.
	return a.removeFromNode(p)
}

// pieces are what Run builds from Config before starting any of it, and
// what shutdown takes apart again.
type pieces struct {
	client      kubernetes.Interface
	hostNS      *os.File
	probes      *redirect.HostProbes
	annotations *enroll.AnnotationWriter
	// conditions converges the pods' inpod.dev/redirected condition.
	conditions *podcondition.Writer
	pipeline   *enroll.Pipeline
	pods       *podCache
	podInf     informers.SharedInformerFactory
	nsInf      metadatainformer.SharedInformerFactory
	// queue feeds the reconciler; the informers' handlers fill it.
	queue    workqueue.TypedRateLimitingInterface[types.NamespacedName]
	passList *passlist.List
	cni      *cniserver.Server
	// activity counts the CNI events cni serves.
	activity *cniActivity
	// installer is nil when Config.InstallCNI is false.
	installer *cniinstall.Installer
	nodeMark  *nodeMark
	// cred keeps the plugin's API access file; nil without a pod namespace.
	cred *pluginCredential
	zds  *zds.Server
	// uninstall tells an uninstall from a restart at shutdown; nil without
	// --pod-name. Its watch stays open until stopUninstallWatch closes.
	uninstall          *uninstallWatch
	stopUninstallWatch chan struct{}
	// Where the plugin finds what the agent writes for it.
	passListPath, apiAccessPath string
	// records is the node-local record of pods with rules.
	records *enrolledrecord.Dir
	// finder finds running pods' netns through procfs.
	finder podnetns.Finder

	// ztunnelBack is closed once a CNI ADD may ask ztunnel for its pod:
	// at once, except after a take-over, until ztunnel reconnects to this
	// agent or handoverZtunnelWait passes.
	ztunnelBack chan struct{}

	// verifier re-proves the enrolled pods; presence is what it may
	// conclude from ztunnel's state.
	verifier *verifier
	presence *ztunnelPresence

	// stopZDS ends the ZDS server, which outlives the other pieces;
	// zdsDone is closed once it has stopped (nil: never started).
	stopZDS context.CancelFunc
	zdsDone chan struct{}
}

// build makes every piece from Config; nothing is served or watched yet.
// On error, what it opened is closed again.
func (a *Agent) build(ctx context.Context) (_ *pieces, err error) {
	cfg := a.cfg
	p := &pieces{client: a.client,
		passListPath:  filepath.Join(filepath.Dir(cfg.CNISocket), passListDir),
		apiAccessPath: filepath.Join(cfg.CNIConfDir, apiaccess.FileName),
		ztunnelBack:   make(chan struct{}),
	}
	close(p.ztunnelBack)
	defer func() {
		if err != nil {
			p.close()
		}
	}()
	if p.hostNS, err = netns.Open(cfg.HostNetNS); err != nil {
		return nil, fmt.Errorf("agent: node netns: %w", err)
	}
	nodeID, err := netns.IdentityOf(int(p.hostNS.Fd()))
	if err != nil {
		return nil, fmt.Errorf("agent: node netns: %w", err)
	}
	backend, det, err := redirect.NewBackend(cfg.RedirectBackend, p.hostNS)
	if err != nil {
		return nil, fmt.Errorf("agent: redirection backend: %w", err)
	}
	a.log.Info("redirection backend chosen", "backend", backend.Name(), "why", det.Reason)
	engine := redirect.NewEngine(backend, otherBackends(backend.Name())...)
	// Ensured once this agent serves the node (startPieces): an agent
	// waiting to take over must not rewrite what the serving one uses.
	p.probes = redirect.NewHostProbes(p.hostNS)

	meta, err := metadata.NewForConfig(a.restCfg)
	if err != nil {
		return nil, err
	}
	policy := enrollment.Policy{ExcludedNamespaces: cfg.ExcludedNamespaces, Label: cfg.EnrollmentLabel}
	p.podInf, p.nsInf = newInformers(p.client, meta, cfg.NodeName, policy.LabelName())
	p.pods = &podCache{client: p.client, node: cfg.NodeName, pods: p.podInf.Core().V1().Pods().Lister(),
		namespaces: metadatalister.New(p.nsInf.ForResource(namespacesResource).Informer().GetIndexer(), namespacesResource), cacheWait: 5 * time.Second}
	a.pods = p.pods
	// The writer waits for the CNI events in flight; the counter wraps
	// the pipeline once it exists.
	p.activity = &cniActivity{}
	p.annotations = enroll.NewAnnotationWriter(p.client, p.activity, a.log)
	if p.passList, err = passlist.Open(p.passListPath, p.pods.notEnrolled(policy), a.log); err != nil {
		return nil, err
	}

	// On the tmpfs next to the sockets: a reboot ends the sandboxes.
	if p.records, err = enrolledrecord.Open(filepath.Join(filepath.Dir(cfg.CNISocket), enrolledRecordDir)); err != nil {
		return nil, err
	}
	p.conditions = podcondition.New(podcondition.Config{Client: p.client, Logger: a.log, Current: p.pods.cachedPod, Observer: a.Metrics.PodConditions()})
	p.annotations.WriteAfter(p.conditions)
	p.presence = newZtunnelPresence(cfg.ZtunnelGrace)
	round := &verifyRound{pipeline: func() *enroll.Pipeline { return p.pipeline }, pods: p.pods, sweepEvery: enroll.DefaultSweepEvery}
	p.verifier = newVerifier(cfg.VerifyPeriod, round.run, p.activity)
	p.finder = podnetns.Finder{ProcRoot: cfg.ProcRoot, NodeNetNS: nodeID}
	p.pipeline = enroll.New(enroll.Config{
		Records:     p.records,
		Policy:      policy,
		Rules:       podRules{engine},
		VariantOf:   variantOf(enroll.Variant{DNSCapture: cfg.DNSCapture}, a.log),
		Probes:      p.probes,
		Ztunnel:     ztunnelRef{p},
		Pods:        p.pods,
		Finder:      p.finder,
		Annotations: p.annotations,
		Events:      observe.NewEvents(ctx, p.client, cfg.NodeName),
		Observer:    a.Metrics,
		Logger:      a.log,

		Listeners:      ztunnelListeners{},
		Acks:           ztunnelRef{p},
		Conditions:     p.conditions,
		VerifyObserver: a.Metrics,
		Presence:       p.presence.presence,
		VerifySoon:     p.verifier.trigger,
		Generation:     rulesGeneration(backend),
	})
	a.pipeline = p.pipeline
	a.Metrics.TrackEnrolled(func() int { return len(p.pipeline.Enrolled()) })
	if p.zds, err = zds.NewServer(zds.Config{SocketPath: cfg.ZDSSocket, Source: p.pipeline, Logger: a.log}); err != nil {
		return nil, err
	}
	p.activity.Handler = p.pipeline
	if p.cni, err = cniserver.New(cniserver.Config{SocketPath: cfg.CNISocket, Handler: p.activity, Logger: a.log}); err != nil {
		return nil, err
	}
	if cfg.InstallCNI {
		if cfg.PodNamespace == "" {
			a.log.Warn("no --pod-namespace, so no token for the plugin; while the agent is down the plugin cannot tell enrolled pods apart and fails every pod's ADD")
		} else {
			p.cred = &pluginCredential{tokens: p.client.CoreV1().ServiceAccounts(cfg.PodNamespace), serviceAccount: cfg.PluginServiceAccount,
				rest: a.restCfg, path: p.apiAccessPath, label: cfg.EnrollmentLabel, log: a.log, observer: observe.NewPluginToken(a.Metrics.Registry)}
		}
		p.nodeMark = newNodeMark(p.client, cfg.NodeName, a.log)
		if p.installer, err = a.newInstaller(p); err != nil {
			return nil, err
		}
	}

	// Reconcile pods through a rate-limited queue, so failures retry with
	// backoff and one pod never blocks another.
	p.queue = workqueue.NewTypedRateLimitingQueue(workqueue.DefaultTypedControllerRateLimiter[types.NamespacedName]())
	if a.preStart != nil {
		a.preStart.mayStart, a.preStart.requeue = a.mayStart(p), p.queue.Add
		a.preStart.reconcile = a.reconcileNow(p)
	}

	// The pass list is refreshed right in the handlers, not through the
	// queue: a pod that turns enrolled must leave it before its sandbox's
	// ADD can read it.
	podChanged := func(obj any) {
		if key, ok := podKey(obj); ok {
			a.refreshPassList(p.passList, key)
			p.queue.Add(key)
		}
	}
	p.podInf.Core().V1().Pods().Informer().AddEventHandler(handlerFuncs(podChanged, func(obj any) {
		podChanged(obj)
		if pod, ok := deletedPod(obj); ok {
			p.conditions.Forget(types.NamespacedName{Namespace: pod.Namespace, Name: pod.Name}, pod.UID)
		}
	}))
	p.nsInf.ForResource(namespacesResource).Informer().AddEventHandler(handlerFuncs(func(obj any) {
		if ns, ok := obj.(*metav1.PartialObjectMetadata); ok {
			for _, pod := range p.pods.podsOfNamespace(ns.Name) {
				key := types.NamespacedName{Namespace: pod.Namespace, Name: pod.Name}
				a.refreshPassList(p.passList, key)
				p.queue.Add(key)
			}
		}
	}, func(any) {}))
	return p, nil
}

func (a *Agent) newInstaller(p *pieces) (*cniinstall.Installer, error) {
	cfg := a.cfg
	cniWasInstalled := false // OnChange calls are sequential
	return cniinstall.New(cniinstall.Config{
		SourceDir: cfg.CNISourceDir, BinDir: cfg.CNIBinDir, ConfDir: cfg.CNIConfDir,
		StateDir: filepath.Join(cfg.StateDir, "cni"), Logger: a.log, OwnedFile: cfg.CNIOwnedFile,
		Entry: cniinstall.Entry{AgentSocket: cfg.CNISocket, ExcludeNamespaces: cfg.ExcludedNamespaces,
			APIAccess: p.apiAccessPath, PassList: p.passListPath},
		OnChange: func(ok bool, reason string) {
			// Installed again after having been installed: a repair.
			// The first install at start is not one.
			if ok && cniWasInstalled {
				a.Metrics.CNIRepaired()
				// Pods started while inpod was out of the chain run
				// unredirected until found.
				p.verifier.trigger()
			}
			cniWasInstalled = cniWasInstalled || ok
			if ok {
				p.nodeMark.installed()
			}
			a.Ready.Set(readiness.CNIInstalled, ok, reason)
		},
	})
}

// close stops the ZDS server (within stopTimeout) and releases what build
// opened; safe on a partly built p.
func (p *pieces) close() {
	if p.stopUninstallWatch != nil {
		close(p.stopUninstallWatch)
	}
	if p.zdsDone != nil {
		p.stopZDS()
		select {
		case <-p.zdsDone:
		case <-time.After(stopTimeout):
		}
	}
	if p.pipeline != nil {
		p.pipeline.Close()
	}
	if p.hostNS != nil {
		p.hostNS.Close()
	}
}

// start starts the pieces in order and returns once they have all stopped
// again: nil when ctx ended, or the first failure, set-up or at runtime,
// which stops the rest (errgroup). It never waits more than stopTimeout for
// them after the stop.
func (a *Agent) start(parent context.Context, p *pieces) error {
	ctx, fail := context.WithCancelCause(parent)
	defer fail(nil)
	g, ctx := errgroup.WithContext(ctx)
	// A hand-over stops the pieces (retire) and leaves the agent until it
	// is stopped: the hand-over server and the device plugin run on.
	piecesCtx, stopPieces := context.WithCancelCause(ctx)
	defer stopPieces(nil)
	var pieces sync.WaitGroup
	// run runs one piece until the agent stops or hands over; its error
	// stops the agent, unless the agent was stopping anyway.
	run := func(name string, fn func(ctx context.Context) error) {
		pieces.Add(1)
		g.Go(func() error {
			defer pieces.Done()
			if err := fn(piecesCtx); err != nil && piecesCtx.Err() == nil {
				return fmt.Errorf("%s: %w", name, err)
			}
			return nil
		})
	}
	// runToEnd runs one piece until the agent stops, handed over or not.
	runToEnd := func(name string, fn func(ctx context.Context) error) {
		g.Go(func() error {
			if err := fn(ctx); err != nil && ctx.Err() == nil {
				return fmt.Errorf("%s: %w", name, err)
			}
			return nil
		})
	}
	retire := func() {
		stopPieces(errHandedOver)
		done := make(chan struct{})
		go func() { pieces.Wait(); a.stopActing(); close(done) }()
		select {
		case <-done:
		case <-time.After(stopTimeout):
			// Such a piece might act on the node beside the successor:
			// the process ends instead.
			fail(fmt.Errorf("agent: not every piece stopped within %s of handing the node over", stopTimeout))
		}
	}
	if err := a.startPieces(ctx, p, run, runToEnd, retire, fail); err != nil {
		fail(err)
	}

	<-ctx.Done()
	stopped := make(chan struct{})
	go func() { g.Wait(); a.stopActing(); close(stopped) }()
	cause := context.Cause(ctx)
	wait := stopTimeout
	if a.closer != nil {
		// The device-plugin gate closes before it stops serving.
		wait += deviceplugin.MaxShutdownDelay
	}
	select {
	case <-stopped:
	case <-time.After(wait):
		// Nothing is removed from the node: some piece may still act.
		return fmt.Errorf("agent: not everything stopped within %s after: %w", wait, cause)
	}
	if parent.Err() != nil && cause == context.Cause(parent) {
		return nil
	}
	return cause
}

// startPieces starts each piece, in the order that keeps the promises: the
// CNI server answers (failing closed) from the start; ztunnel is served
// only once the watches are synced and every running enrolled pod
// restored, so its first snapshot is complete. When another agent serves
// the node (a rollout's surge), this one syncs first while the other
// serves on, then takes the sockets over (claim), and serves the CNI
// plugin once restored: the requests of the switch wait instead of
// failing.
func (a *Agent) startPieces(ctx context.Context, p *pieces, run, runToEnd func(string, func(context.Context) error), retire func(), fail context.CancelCauseFunc) error {
	cfg := a.cfg
	if cfg.ProbeSocket != "" {
		runToEnd("probe socket", func(ctx context.Context) error {
			return observe.ServeProbes(ctx, a.log, cfg.ProbeSocket, a.podReadiness)
		})
	}
	run("annotations", func(ctx context.Context) error { p.annotations.Run(ctx); return nil })
	run("pod conditions", func(ctx context.Context) error { p.conditions.Run(ctx); return nil })
	claiming := false
	if cfg.HandoverSocket != "" && handover.Serving(cfg.HandoverSocket) {
		claiming = true
		a.log.Info("another agent serves this node: taking over once the watches are synced", "handoverSocket", cfg.HandoverSocket)
	} else if err := a.bindCNI(p); err != nil {
		if cfg.HandoverSocket == "" || !errors.Is(err, unixsock.ErrInUse) {
			return err
		}
		// Starting too, or without hand-overs: see claim.
		claiming = true
		a.log.Info("another agent serves this node's CNI socket: taking over once the watches are synced", "socket", cfg.CNISocket)
	}
	if !claiming {
		if err := a.serveNode(p); err != nil {
			return err
		}
		run("cni event server", p.cni.Serve)
		a.startNodeWriters(p, run)
	}

	p.podInf.Start(ctx.Done())
	p.nsInf.Start(ctx.Done())
	if cfg.PodName != "" {
		sel, _ := labels.Parse(cfg.AgentSelector) // checked by New
		p.uninstall = newUninstallWatch(a.log, p.client, cfg.NodeName, types.NamespacedName{Namespace: cfg.PodNamespace, Name: cfg.PodName},
			sel, p.podInf.Core().V1().Pods().Lister())
		// Open past ctx, until the shutdown decision is made (pieces.close).
		p.stopUninstallWatch = make(chan struct{})
		go p.uninstall.run(p.stopUninstallWatch)
	}
	a.log.Info("waiting for the pod and namespace watches to sync")
	if !cache.WaitForCacheSync(ctx.Done(), p.podInf.Core().V1().Pods().Informer().HasSynced, p.nsInf.ForResource(namespacesResource).Informer().HasSynced) {
		return ctx.Err()
	}
	rank := a.handoverRank(p)
	var handoverLn *net.UnixListener
	if claiming {
		var err error
		if handoverLn, err = a.claim(ctx, p, rank); err != nil {
			return err
		}
		if err := a.serveNode(p); err != nil {
			return err
		}
		a.startNodeWriters(p, run)
	}
	var fresh []*corev1.Pod
	if a.tookOver {
		fresh = a.freshPods(ctx, p)
	}
	a.restore(ctx, p, fresh)
	if claiming {
		// After the restore, which takes each running pod's lock: an ADD
		// holding one while it waits for ztunnel would hold the restore,
		// and ztunnel is served only after it. The plugin's requests wait
		// in the socket's backlog meanwhile.
		run("cni event server", p.cni.Serve)
	}
	if p.uninstall != nil {
		p.uninstall.checkSelf()
	}
	a.Ready.Set(readiness.PodsSynced, true, "")
	run("pass list", p.passList.Run)
	run("reconciler", func(ctx context.Context) error {
		// The loop waits on the queue: its end is the queue's.
		context.AfterFunc(ctx, p.queue.ShutDown)
		a.reconcileLoop(ctx, p.queue, p.pods)
		return nil
	})

	if err := a.listenZDS(ctx, p); err != nil {
		return err
	}
	// ztunnel's grace runs from here: before, it could not connect.
	p.presence.reset()
	// The ZDS server outlives the rest: removing inpod from the node at
	// shutdown still tells ztunnel about every pod it takes out. It stops
	// in pieces.close; a failure of its own stops the agent.
	var zdsCtx context.Context
	zdsCtx, p.stopZDS = context.WithCancel(context.WithoutCancel(ctx))
	p.zdsDone = make(chan struct{})
	go func() {
		defer close(p.zdsDone)
		if err := p.zds.Serve(zdsCtx); err != nil && zdsCtx.Err() == nil {
			fail(fmt.Errorf("zds server: %w", err))
		}
	}()
	run("zds readiness", func(ctx context.Context) error { a.followZtunnel(ctx, p); return nil })
	if a.tookOver {
		run("ztunnel back", func(ctx context.Context) error { a.awaitZtunnel(ctx, p, handoverZtunnelWait); return nil })
	}
	run("verifier", func(ctx context.Context) error { p.verifier.run(ctx); return nil })
	run("sandbox check", func(ctx context.Context) error {
		checkSandboxes(ctx, sandboxCheckInterval, p.pipeline.Enrolled, p.queue)
		return nil
	})

	var lingering []handingOverGate
	for _, gate := range a.gates {
		h, handsOver := gate.(handingOverGate)
		if !handsOver || cfg.HandoverSocket == "" {
			run("gate "+gate.Name(), func(ctx context.Context) error { return gate.Run(ctx, a.Ready) })
			continue
		}
		if a.tookOver {
			h.TakeOver(handoverRegisterWait)
		}
		// Registered until the successor's plugin is (see handover.go).
		lingering = append(lingering, h)
		runToEnd("gate "+gate.Name(), func(ctx context.Context) error { return gate.Run(ctx, a.Ready) })
	}
	if cfg.ReleaseStartupMemory {
		run("start-up memory release", func(ctx context.Context) error { a.releaseStartupMemory(ctx, p.activity); return nil })
	}
	run("observability", func(ctx context.Context) error {
		return observe.Serve(ctx, a.log, cfg.HealthAddr, cfg.MetricsAddr, a.Metrics, a.Ready, cfg.DebugPprof)
	})
	// Last: a hand-over stops the pieces started above (retire waits for
	// them), so none may start after it can begin.
	if cfg.HandoverSocket != "" {
		runToEnd("hand-over", func(ctx context.Context) error {
			return a.serveHandover(ctx, p, handoverLn, rank, func() {
				for _, h := range lingering {
					h.Retire(handoverLinger)
				}
				retire()
			})
		})
	}
	return nil
}

// startNodeWriters starts what keeps inpod in place on the node: the
// plugin's credential, the CNI installer and the Node's label.
func (a *Agent) startNodeWriters(p *pieces, run func(string, func(context.Context) error)) {
	if p.installer == nil {
		a.Ready.Set(readiness.CNIInstalled, true, "")
		return
	}
	if p.cred != nil {
		run("plugin credential", func(ctx context.Context) error { p.cred.run(ctx); return nil })
	}
	run("cni installer", p.installer.Run)
	run("node label", func(ctx context.Context) error { p.nodeMark.run(ctx); return nil })
}

// followZtunnel turns the ZDS server's state into the readiness condition.
func (a *Agent) followZtunnel(ctx context.Context, p *pieces) {
	p.zds.Follow(ctx, func(st zds.State) {
		if a.frozen.Load() {
			// A hand-over closed ztunnel's connections: the successor
			// serves it next, or Resume publishes the state.
			return
		}
		a.Metrics.ZtunnelConnections(st.Connections)
		a.Ready.Set(readiness.ZtunnelConnected, st.Ready, st.NotReadyReason())
		if p.presence.observe(st) {
			// A ztunnel that (re)connected got a snapshot; whether
			// each pod's proxy is up is for the verifier.
			p.verifier.trigger()
		}
	})
}

// Pipeline exposes the enrolled-pod table (for tests and the gates).
func (a *Agent) Pipeline() *enroll.Pipeline { return a.pipeline }

// restore brings every pod on the node to what the policy says before
// ztunnel is served. A pod a previous agent enrolled that cannot be restored
// yet is held (see enroll.Pipeline.Restore): the first snapshot keeps its
// proxy and the prune keeps its probe exemption, since its rules still point
// at both. The informers' initial list queues every pod as well, so the
// reconciler retries what failed here.
func (a *Agent) restore(ctx context.Context, p *pieces, fresh []*corev1.Pod) {
	all, _ := p.pods.pods.List(labels.Everything())
	if fresh != nil {
		all = fresh
	}
	// One procfs pass for every pod: during a hand-over, the CNI plugin's
	// requests wait for the restore.
	start := time.Now()
	restore := a.pipeline.Restore
	if snap, err := p.finder.Snapshot(); err != nil {
		a.log.Warn("cannot read procfs once for the restore; searching it per pod", "err", err)
	} else {
		restore = func(ctx context.Context, pod *corev1.Pod) error { return a.pipeline.RestoreWith(ctx, pod, snap) }
	}
	inCache := make(map[types.UID]bool, len(all))
	for _, pod := range all {
		inCache[pod.UID] = true
		if err := restore(ctx, pod); err != nil {
			a.log.Warn("could not restore pod at start; will retry", "pod", pod.Namespace+"/"+pod.Name, "err", err)
		}
	}
	if err := a.pipeline.PruneRecords(func(uid types.UID) bool { return inCache[uid] }); err != nil {
		a.log.Warn("could not prune the records of pods gone from the node", "err", err)
	}
	if !a.pipeline.PruneSafe() {
		// A stale exemption only SNATs probes; a missing one gets an
		// enrolled pod killed by its liveness probe.
		a.log.Warn("not pruning the probe set: a pod enrolled by the previous agent reports no IPs yet; stale exemptions stay until the next restart")
	} else if err := p.probes.Prune(a.pipeline.EnrolledIPs()); err != nil {
		a.log.Warn("could not prune the probe set", "err", err)
	}
	a.log.Info("restored enrolled pods", "pods", len(a.pipeline.Enrolled()), "took", time.Since(start).Round(time.Millisecond))
}

func (a *Agent) reconcileLoop(ctx context.Context, queue workqueue.TypedRateLimitingInterface[types.NamespacedName], pods *podCache) {
	for {
		key, quit := queue.Get()
		if quit {
			return
		}
		err := a.reconcileOne(ctx, key, pods)
		if err != nil {
			a.log.Warn("reconcile failed; retrying with backoff", "pod", key, "err", err)
			queue.AddRateLimited(key)
		} else {
			queue.Forget(key)
		}
		queue.Done(key)
	}
}

func (a *Agent) reconcileOne(ctx context.Context, key types.NamespacedName, pods *podCache) error {
	pod, err := pods.pods.Pods(key.Namespace).Get(key.Name)
	// Every enrolled pod of this name that is not the cached one is gone:
	// deleted, or deleted and recreated under the same name (its DEL may
	// have been missed while the agent was down). Left in the table it
	// would stay in every snapshot and keep its fd and probe exemption.
	//
	// The cache alone cannot say so: a CNI ADD that did not find the pod in
	// it read the pod from the API, and a lagging watch (relisting after an
	// API outage) would then have a sweep take a running pod out of the
	// mesh. One live read decides, and only when the cache disagrees with
	// the table, which is rare: a deleted pod's DEL normally unenrolled it.
	var errs []error
	var live *corev1.Pod
	var liveErr error
	asked := false
	for _, uid := range a.pipeline.UIDsOf(key) {
		if err == nil && uid == pod.UID {
			continue
		}
		if !asked {
			live, liveErr = pods.liveOrGone(ctx, key)
			asked = true
		}
		if liveErr != nil {
			errs = append(errs, fmt.Errorf("the cache no longer shows enrolled pod %s (uid %s), and the API could not confirm it is gone: %w", key, uid, liveErr))
			continue
		}
		if live != nil && live.UID == uid {
			continue // the watch lags; its update will come
		}
		if err := a.pipeline.Unenroll(ctx, uid); err != nil {
			errs = append(errs, err)
		}
	}
	var cached types.UID
	if err == nil {
		cached = pod.UID
	}
	a.pipeline.ForgetGone(key, cached)
	if err == nil {
		errs = append(errs, a.pipeline.Reconcile(ctx, pod))
	}
	return errors.Join(errs...)
}

func podKey(obj any) (types.NamespacedName, bool) {
	p, ok := deletedPod(obj)
	if !ok {
		return types.NamespacedName{}, false
	}
	return types.NamespacedName{Namespace: p.Namespace, Name: p.Name}, true
}

// deletedPod is the pod of an informer event, also of a deletion the
// watch only learnt of in a relist.
func deletedPod(obj any) (*corev1.Pod, bool) {
	if d, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = d.Obj
	}
	p, ok := obj.(*corev1.Pod)
	return p, ok
}

// passListDir, next to the CNI socket, holds the pass list.
const passListDir = "not-enrolled"

// annotationFlushTimeout bounds the annotations written at a stop that is
// not an uninstall, so an API server outage delays no restart for long.
const annotationFlushTimeout = 2 * time.Second

// enrolledRecordDir, next to the CNI socket, holds the record of pods with
// rules (package enrolledrecord).
const enrolledRecordDir = "enrolled"

func (a *Agent) refreshPassList(l *passlist.List, key types.NamespacedName) {
	if err := l.Refresh(key.Namespace, key.Name); err != nil {
		// The pod's ADD then asks the agent, or passes on a stale entry
		// only if this was a removal; say so loudly.
		a.log.Error("could not update the pass list", "pod", key, "err", err)
	}
}

// podRules turns a pod's variant into the engine's options, so the
// pipeline needs nothing of package redirect.
type podRules struct{ *redirect.Engine }

func (r podRules) Apply(ns *os.File, v enroll.Variant) (changed bool, err error) {
	res, err := r.Engine.Apply(ns, redirect.Options{DNSCapture: v.DNSCapture, NoInboundCapture: v.NoInboundCapture, VirtualInterfaces: v.VirtualInterfaces})
	return res.Changed, err
}

// ztunnelRef lets the pipeline be built before the ZDS server, which needs
// the pipeline as its pod source.
type ztunnelRef struct{ p *pieces }

// Add of a CNI ADD waits, after a take-over, for ztunnel to be back (see
// pieces.ztunnelBack): an enrolled pod's ADD in the moments of the switch
// waits instead of failing. The others (the restore, the verifier) do not
// wait: ztunnel's snapshot brings it their pods.
func (z ztunnelRef) Add(ctx context.Context, w zds.Workload) error {
	if fromCNIEvent(ctx) {
		select {
		case <-z.p.ztunnelBack:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return z.p.zds.Add(ctx, w)
}
func (z ztunnelRef) Del(ctx context.Context, uid string) error { return z.p.zds.Del(ctx, uid) }
func (z ztunnelRef) Acked(uid string) bool                     { return z.p.zds.Acked(uid) }
func (z ztunnelRef) Settled() bool                             { return z.p.zds.Settled() }

// otherBackends are cleaned out of pods when another backend is in use.
func otherBackends(inUse string) []redirect.Backend {
	var out []redirect.Backend
	if inUse != "nftables" {
		out = append(out, redirect.NewNFTables())
	}
	for _, mode := range []redirect.IPTablesMode{redirect.IPTablesNFT, redirect.IPTablesLegacy} {
		if "iptables-"+string(mode) == inUse {
			continue
		}
		if b, err := redirect.NewIPTables(mode); err == nil {
			out = append(out, b)
		}
	}
	return out
}

func loadRestConfig(kubeconfig string) (*rest.Config, error) {
	if kubeconfig != "" {
		return clientcmd.BuildConfigFromFlags("", kubeconfig)
	}
	cfg, err := rest.InClusterConfig()
	if err != nil {
		return nil, fmt.Errorf("agent: not in a cluster and no --kubeconfig: %w", err)
	}
	return cfg, nil
}

// podCapacity is how many devices to advertise when not configured: one per
// pod the node can run (its status.capacity.pods, the kubelet's maxPods),
// so the gate never caps the node below its own limit.
func (a *Agent) podCapacity(ctx context.Context) int {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	var lastErr error
	for {
		node, err := a.client.CoreV1().Nodes().Get(ctx, a.cfg.NodeName, metav1.GetOptions{})
		if err == nil {
			if pods, ok := node.Status.Capacity[corev1.ResourcePods]; ok && pods.Value() > 0 {
				a.log.Info("advertising one device per pod the node can run", "devices", pods.Value())
				return int(pods.Value())
			}
			err = errors.New("the Node reports no pod capacity")
		}
		lastErr = err
		select {
		case <-ctx.Done():
			a.log.Warn("cannot read the node's pod capacity; advertising the kubelet's default maxPods (set --devices)",
				"devices", deviceplugin.DefaultDevices, "err", lastErr)
			return deviceplugin.DefaultDevices
		case <-time.After(time.Second):
		}
	}
}

// PodCached reports whether the agent's pod watch has delivered the pod;
// for diagnostics and tests that must know what the agent can decide
// without the API server.
func (a *Agent) PodCached(namespace, name string) bool {
	if a.pods == nil {
		return false
	}
	_, err := a.pods.pods.Pods(namespace).Get(name)
	return err == nil
}
