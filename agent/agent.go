// Package agent wires the node agent together: it builds each piece from
// Config (redirection engine, host probe rules, pod informers, enrollment
// pipeline, CNI event server, CNI installer, ZDS server, readiness, metrics)
// and runs them. The logic lives in the sub-packages; this package only
// connects them.
package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/client-go/util/workqueue"

	"github.com/inpod-dev/inpod/agent/cniinstall"
	"github.com/inpod-dev/inpod/agent/cniserver"
	"github.com/inpod-dev/inpod/agent/enroll"
	"github.com/inpod-dev/inpod/agent/observe"
	"github.com/inpod-dev/inpod/agent/podnetns"
	"github.com/inpod-dev/inpod/agent/readiness"
	"github.com/inpod-dev/inpod/agent/redirect"
	"github.com/inpod-dev/inpod/apiaccess"
	"github.com/inpod-dev/inpod/deviceplugin"
	"github.com/inpod-dev/inpod/netns"
	"github.com/inpod-dev/inpod/passlist"
	"github.com/inpod-dev/inpod/zds"
)

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

	HealthAddr  string
	MetricsAddr string
	Logger      *slog.Logger

	// PodName and PodNamespace are the agent's own pod (downward API). At
	// shutdown the DaemonSet controlling it, by UID, tells an uninstall
	// from a restart (see uninstallWatch). Empty PodName: never remove
	// anything. The namespace also holds PluginServiceAccount.
	PodName, PodNamespace string
	// AgentSelector selects inpod agent pods of any installation (default
	// DefaultAgentSelector); one on this node other than the agent's own
	// keeps an uninstall from touching the node.
	AgentSelector string
	// PluginServiceAccount is the ServiceAccount whose token the agent
	// requests for the plugin's agent-down check (default inpod-cni).
	PluginServiceAccount string

	// Ready, when set, is used instead of a new aggregate, so the gates can
	// follow the same signal.
	Ready *readiness.Aggregate

	// Gate is how scheduling follows readiness: "deviceplugin" (default) or
	// "none".
	Gate string
	// DevicePlugin configures the device-plugin gate; its Ready, Observer
	// and Logger are filled in by the agent.
	DevicePlugin deviceplugin.Config
}

// Agent is a running node agent.
type Agent struct {
	cfg      Config
	log      *slog.Logger
	Ready    *readiness.Aggregate
	Metrics  *observe.Metrics
	pipeline *enroll.Pipeline
	pods     *podCache
}

// New validates cfg.
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
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	ready := cfg.Ready
	if ready == nil {
		ready = readiness.New(log, readiness.CNIInstalled, readiness.ZtunnelConnected, readiness.PodsSynced)
	}
	a := &Agent{cfg: cfg, log: log, Ready: ready, Metrics: observe.NewMetrics()}
	ready.OnChange(a.Metrics.Readiness)
	return a, nil
}

// Run runs the agent until ctx ends. Shutting down for a restart or an
// upgrade leaves the data path as it is: rules stay in every pod, ztunnel
// keeps its proxies, the CNI plugin stays installed (enrolled pods fail
// closed until the agent is back). Shutting down because inpod is being
// uninstalled removes it from the node (see uninstallWatch).
func (a *Agent) Run(ctx context.Context) error {
	cfg := a.cfg
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var wg sync.WaitGroup
	defer wg.Wait()
	// The ZDS server outlives the rest: removing inpod from the node at
	// shutdown still tells ztunnel about every pod it takes out.
	zdsCtx, stopZDS := context.WithCancel(context.WithoutCancel(ctx))
	defer stopZDS()
	// Closed when each piece that can enroll or touch the CNI config has
	// stopped, so a removal cannot race with them.
	cniServed, installerDone, reconcilerDone := make(chan struct{}), make(chan struct{}), make(chan struct{})
	errc := make(chan error, 8)
	goRun := func(name string, fn func() error) {
		wg.Go(func() {
			if err := fn(); err != nil && ctx.Err() == nil {
				errc <- fmt.Errorf("%s: %w", name, err)
			}
		})
	}

	restCfg, err := loadRestConfig(cfg.Kubeconfig)
	if err != nil {
		return err
	}
	client, err := kubernetes.NewForConfig(restCfg)
	if err != nil {
		return err
	}

	hostNS, err := netns.Open(cfg.HostNetNS)
	if err != nil {
		return fmt.Errorf("agent: node netns: %w", err)
	}
	defer hostNS.Close()
	backend, det, err := redirect.NewBackend(cfg.RedirectBackend, hostNS)
	if err != nil {
		return fmt.Errorf("agent: redirection backend: %w", err)
	}
	a.log.Info("redirection backend chosen", "backend", backend.Name(), "why", det.Reason)
	engine := redirect.NewEngine(backend, otherBackends(backend.Name())...)
	probes := redirect.NewHostProbes(hostNS)
	if err := probes.Ensure(); err != nil {
		return fmt.Errorf("agent: host probe rules: %w", err)
	}

	podInf, nsInf := newInformers(client, cfg.NodeName)
	pods := &podCache{client: client, pods: podInf.Core().V1().Pods().Lister(),
		namespaces: nsInf.Core().V1().Namespaces().Lister(), cacheWait: 5 * time.Second}
	a.pods = pods
	annotations := enroll.NewAnnotationWriter(client, a.log)
	goRun("annotations", func() error { annotations.Run(ctx); return nil })

	policy := enroll.Policy{ExcludedNamespaces: cfg.ExcludedNamespaces, Label: cfg.EnrollmentLabel}
	// Where the plugin finds what the agent writes for it.
	passListPath := filepath.Join(filepath.Dir(cfg.CNISocket), passListDir)
	apiAccessPath := filepath.Join(cfg.CNIConfDir, apiaccess.FileName)
	passList, err := passlist.Open(passListPath, pods.notEnrolled(policy), a.log)
	if err != nil {
		return err
	}

	var zdsServer *zds.Server
	a.pipeline = enroll.New(enroll.Config{
		Policy:      policy,
		Options:     redirect.Options{DNSCapture: cfg.DNSCapture},
		Rules:       engine,
		Probes:      probes,
		Ztunnel:     ztunnelRef{&zdsServer},
		Pods:        pods,
		Finder:      podnetns.Finder{ProcRoot: cfg.ProcRoot},
		Annotations: annotations,
		Events:      observe.NewEvents(ctx, client, cfg.NodeName),
		Observer:    a.Metrics,
		Logger:      a.log,
	})
	defer a.pipeline.Close()
	zdsServer, err = zds.NewServer(zds.Config{SocketPath: cfg.ZDSSocket, Source: a.pipeline, Logger: a.log})
	if err != nil {
		return err
	}

	cniSrv, err := cniserver.New(cniserver.Config{SocketPath: cfg.CNISocket, Handler: a.pipeline, Logger: a.log})
	if err != nil {
		return err
	}
	if err := cniSrv.Listen(); err != nil {
		return err
	}
	goRun("cni event server", func() error { defer close(cniServed); return cniSrv.Serve(ctx) })

	var installer *cniinstall.Installer
	if cfg.InstallCNI {
		if cfg.PodNamespace == "" {
			a.log.Warn("no --pod-namespace, so no token for the plugin; while the agent is down the plugin cannot tell enrolled pods apart and fails every pod's ADD")
		} else {
			cred := &pluginCredential{tokens: client.CoreV1().ServiceAccounts(cfg.PodNamespace), serviceAccount: cfg.PluginServiceAccount,
				rest: restCfg, path: apiAccessPath, label: cfg.EnrollmentLabel, log: a.log, observer: observe.NewPluginToken(a.Metrics.Registry)}
			goRun("plugin credential", func() error { cred.run(ctx); return nil })
		}
		cniWasInstalled := false // OnChange calls are sequential
		inst, err := cniinstall.New(cniinstall.Config{
			SourceDir: cfg.CNISourceDir, BinDir: cfg.CNIBinDir, ConfDir: cfg.CNIConfDir,
			StateDir: filepath.Join(cfg.StateDir, "cni"), Logger: a.log,
			Entry: cniinstall.Entry{AgentSocket: cfg.CNISocket, ExcludeNamespaces: cfg.ExcludedNamespaces,
				APIAccess: apiAccessPath, PassList: passListPath},
			OnChange: func(ok bool, reason string) {
				// Installed again after having been installed: a repair.
				// The first install at start is not one.
				if ok && cniWasInstalled {
					a.Metrics.CNIRepaired()
				}
				cniWasInstalled = cniWasInstalled || ok
				a.Ready.Set(readiness.CNIInstalled, ok, reason)
			},
		})
		if err != nil {
			return err
		}
		installer = inst
		goRun("cni installer", func() error { defer close(installerDone); return inst.Run(ctx) })
	} else {
		close(installerDone)
		a.Ready.Set(readiness.CNIInstalled, true, "")
	}

	// Reconcile pods through a rate-limited queue, so failures retry with
	// backoff and one pod never blocks another.
	queue := workqueue.NewTypedRateLimitingQueue(workqueue.DefaultTypedControllerRateLimiter[types.NamespacedName]())
	// The pass list is refreshed right in the handlers, not through the
	// queue: a pod that turns enrolled must leave it before its sandbox's
	// ADD can read it.
	podChanged := func(obj any) {
		if key, ok := podKey(obj); ok {
			a.refreshPassList(passList, key)
			queue.Add(key)
		}
	}
	podInf.Core().V1().Pods().Informer().AddEventHandler(handlerFuncs(podChanged, podChanged))
	nsInf.Core().V1().Namespaces().Informer().AddEventHandler(handlerFuncs(func(obj any) {
		if ns, ok := obj.(*corev1.Namespace); ok {
			for _, p := range pods.podsOfNamespace(ns.Name) {
				key := types.NamespacedName{Namespace: p.Namespace, Name: p.Name}
				a.refreshPassList(passList, key)
				queue.Add(key)
			}
		}
	}, func(any) {}))
	podInf.Start(ctx.Done())
	nsInf.Start(ctx.Done())
	var uninstall *uninstallWatch
	if cfg.PodName != "" {
		sel, _ := labels.Parse(cfg.AgentSelector) // checked by New
		uninstall = newUninstallWatch(a.log, client, cfg.NodeName, types.NamespacedName{Namespace: cfg.PodNamespace, Name: cfg.PodName},
			sel, podInf.Core().V1().Pods().Lister())
		// Open until the shutdown decision is made, past ctx.
		stopWatch := make(chan struct{})
		defer close(stopWatch)
		go uninstall.run(stopWatch)
	}
	a.log.Info("waiting for the pod and namespace watches to sync")
	if !cache.WaitForCacheSync(ctx.Done(), podInf.Core().V1().Pods().Informer().HasSynced, nsInf.Core().V1().Namespaces().Informer().HasSynced) {
		return ctx.Err()
	}
	// Restore before serving ztunnel: every running enrolled pod's netns is
	// found and its rules verified, so the first snapshot is complete.
	a.restore(ctx, pods, probes)
	if uninstall != nil {
		uninstall.checkSelf()
	}
	a.Ready.Set(readiness.PodsSynced, true, "")
	goRun("pass list", func() error { return passList.Run(ctx) })
	go func() {
		<-ctx.Done()
		queue.ShutDown()
	}()
	goRun("reconciler", func() error { defer close(reconcilerDone); a.reconcileLoop(ctx, queue, pods); return nil })

	if err := zdsServer.Listen(); err != nil {
		return err
	}
	goRun("zds server", func() error { return zdsServer.Serve(zdsCtx) })
	goRun("zds readiness", func() error {
		states, stop := zdsServer.Subscribe()
		defer stop()
		for {
			select {
			case <-ctx.Done():
				return nil
			case st := <-states:
				a.Metrics.ZtunnelConnections(st.Connections)
				reason := ""
				if !st.Ready {
					reason = fmt.Sprintf("no ztunnel has acknowledged a snapshot (%d connections)", st.Connections)
				}
				a.Ready.Set(readiness.ZtunnelConnected, st.Ready, reason)
			}
		}
	})
	switch cfg.Gate {
	case "", "deviceplugin":
		dpCfg := cfg.DevicePlugin
		if dpCfg.Devices <= 0 {
			dpCfg.Devices = a.podCapacity(ctx, client)
		}
		dpCfg.Ready, dpCfg.Observer, dpCfg.Logger = a.Ready, a.Metrics, a.log
		dp, err := deviceplugin.New(dpCfg)
		if err != nil {
			return err
		}
		goRun("device plugin", func() error { return dp.Run(ctx) })
	case "none":
	default:
		return fmt.Errorf("agent: unknown gate %q (want deviceplugin or none)", cfg.Gate)
	}
	goRun("observability", func() error { return observe.Serve(ctx, a.log, cfg.HealthAddr, cfg.MetricsAddr, a.Metrics, a.Ready) })

	select {
	case <-ctx.Done():
		if uninstall == nil || !uninstall.uninstalling(context.WithoutCancel(ctx)) {
			a.log.Info("agent stopping; rules, ztunnel's proxies and the CNI plugin stay in place")
			return nil
		}
		for _, done := range []chan struct{}{cniServed, installerDone, reconcilerDone} {
			<-done
		}
		return a.removeFromNode(installer, probes, annotations, apiAccessPath, passListPath)
	case err := <-errc:
		return err
	}
}

// Pipeline exposes the enrolled-pod table (for tests and the gates).
func (a *Agent) Pipeline() *enroll.Pipeline { return a.pipeline }

func (a *Agent) restore(ctx context.Context, pods *podCache, probes *redirect.HostProbes) {
	all, _ := pods.pods.List(labels.Everything())
	for _, p := range all {
		if err := a.pipeline.Reconcile(ctx, p); err != nil {
			a.log.Warn("could not restore pod at start; will retry", "pod", p.Namespace+"/"+p.Name, "err", err)
		}
	}
	if err := probes.Prune(a.pipeline.EnrolledIPs()); err != nil {
		a.log.Warn("could not prune the probe set", "err", err)
	}
	a.log.Info("restored enrolled pods", "pods", len(a.pipeline.EnrolledIPs()))
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
	if err != nil {
		// Deleted: forget it if it was enrolled.
		if uid, ok := a.pipeline.UIDOf(key); ok {
			return a.pipeline.Unenroll(ctx, uid)
		}
		return nil
	}
	return a.pipeline.Reconcile(ctx, pod)
}

func podKey(obj any) (types.NamespacedName, bool) {
	if d, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = d.Obj
	}
	p, ok := obj.(*corev1.Pod)
	if !ok {
		return types.NamespacedName{}, false
	}
	return types.NamespacedName{Namespace: p.Namespace, Name: p.Name}, true
}

// passListDir, next to the CNI socket, holds the pass list.
const passListDir = "not-enrolled"

func (a *Agent) refreshPassList(l *passlist.List, key types.NamespacedName) {
	if err := l.Refresh(key.Namespace, key.Name); err != nil {
		// The pod's ADD then asks the agent, or passes on a stale entry
		// only if this was a removal; say so loudly.
		a.log.Error("could not update the pass list", "pod", key, "err", err)
	}
}

// ztunnelRef lets the pipeline be built before the ZDS server, which needs
// the pipeline as its pod source.
type ztunnelRef struct{ s **zds.Server }

func (z ztunnelRef) Add(ctx context.Context, w zds.Workload) error { return (*z.s).Add(ctx, w) }
func (z ztunnelRef) Del(ctx context.Context, uid string) error     { return (*z.s).Del(ctx, uid) }

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
func (a *Agent) podCapacity(ctx context.Context, client kubernetes.Interface) int {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	var lastErr error
	for {
		node, err := client.CoreV1().Nodes().Get(ctx, a.cfg.NodeName, metav1.GetOptions{})
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
