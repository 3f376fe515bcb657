// Command inpod-agent is the node agent: it installs the inpod-cni plugin,
// enrolls pods into the mesh, installs their redirection rules, hands their
// network namespaces to ztunnel, and reports the node's readiness. See
// package agent.
package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"

	"github.com/inpod-dev/inpod/agent"
	"github.com/inpod-dev/inpod/cnievent"
	"github.com/inpod-dev/inpod/deviceplugin"
	"github.com/inpod-dev/inpod/dra"
	"github.com/inpod-dev/inpod/internal/envflag"
	"github.com/inpod-dev/inpod/readiness"
	"github.com/inpod-dev/inpod/zds"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "inpod-agent:", err)
		os.Exit(1)
	}
}

func run() error {
	if len(os.Args) > 1 && os.Args[1] == "uninstall-hook" {
		return runUninstallHook(os.Args[2:])
	}
	fs := flag.NewFlagSet("inpod-agent", flag.ContinueOnError)
	var cfg agent.Config
	var kubeAPIQPS float64
	fs.StringVar(&cfg.NodeName, "node-name", "", "this node's name (set it from the downward API: spec.nodeName)")
	fs.StringVar(&cfg.Kubeconfig, "kubeconfig", "", "kubeconfig to use instead of the in-cluster service account")
	fs.StringVar(&cfg.ZDSSocket, "zds-socket", zds.DefaultSocketPath, "the ZDS socket ztunnel connects to")
	fs.StringVar(&cfg.CNISocket, "cni-socket", cnievent.DefaultSocketPath, "the socket the inpod-cni plugin talks to")
	handoverSocket := fs.String("handover-socket", "", "where the agent serving this node hands its sockets to its successor: a new agent (a rollout with surge) takes the node over once synced, and CNI events and ztunnel's reconnection wait for the moments of the switch instead of failing; empty: handover.sock next to --cni-socket; none: no hand-over (an agent started while another serves fails)")
	fs.StringVar(&cfg.CNISourceDir, "cni-source-dir", "/opt/inpod/bin", "where the agent's image holds inpod-cni and inpod-cni-apicheck, installed on the node")
	fs.StringVar(&cfg.CNIBinDir, "cni-bin-dir", "/opt/cni/bin", "the node's CNI plugin directory")
	fs.StringVar(&cfg.CNIConfDir, "cni-conf-dir", "/etc/cni/net.d", "the node's CNI configuration directory")
	fs.BoolVar(&cfg.InstallCNI, "install-cni", true, "install inpod-cni and keep it last in the chain the container runtime uses")
	fs.StringVar(&cfg.CNIOwnedFile, "cni-owned-config-file", agent.DefaultCNIOwnedFile, "the CNI configuration file (in --cni-conf-dir, ending .conflist, sorting before the primary's) the agent owns: the primary's chain with inpod-cni last, followed while the agent runs and left in place while it is away, so a primary CNI rewriting its own file cannot take inpod out of the chain; empty: chain inpod-cni into the primary's own file instead")
	fs.StringVar(&cfg.StateDir, "state-dir", "/var/lib/inpod", "the agent's state on the node (backups of CNI files)")
	fs.StringVar(&cfg.RedirectBackend, "redirect-backend", "auto", "auto, nftables, iptables-nft or iptables-legacy")
	fs.BoolVar(&cfg.DNSCapture, "dns-capture", false, "send enrolled pods' DNS to ztunnel's DNS proxy (15053) unless a pod's annotation ambient.istio.io/dns-capture says otherwise (the chart's default, as Istio's since 1.25, is true)")
	fs.StringVar(&cfg.EnrollmentLabel, "enrollment-label", "istio.io/dataplane-mode", "pod and namespace label whose value ambient enrolls and none opts out")
	exclude := fs.String("exclude-namespaces", "kube-system", "comma-separated namespaces never enrolled")
	fs.StringVar(&cfg.ProcRoot, "proc-root", "/proc", "the host's procfs (to find running pods' network namespaces)")
	fs.StringVar(&cfg.HostNetNS, "host-netns", "/proc/self/ns/net", "the node's network namespace (for the kubelet probe rules and backend detection)")
	fs.StringVar(&cfg.ProbeSocket, "probe-socket", "", "a unix socket in the agent's own container answering its exec probes (inpod-probe SOCKET /healthz or /readyz): ready while this agent serves the node and the node is ready, or while it waits for an agent that cannot hand over to exit; the chart uses it because the health port is the node's (hostNetwork) and, during a rollout's surge, shared by two agents; empty: none")
	fs.StringVar(&cfg.HealthAddr, "health-addr", ":15021", "address of /healthz and /readyz")
	fs.StringVar(&cfg.MetricsAddr, "metrics-addr", ":15020", "address of /metrics")
	fs.BoolVar(&cfg.DebugPprof, "debug-pprof", false, "also serve Go's profiles (heap, goroutines, CPU) under /debug/pprof/ on --metrics-addr; for diagnosis only, they show the agent's internals to whoever reaches the port")
	fs.StringVar(&cfg.Gate, "gate", "deviceplugin", "how scheduling follows readiness: a comma list of gates, or none. deviceplugin: the extended resource --resource-name, Healthy only while ready; dra: a DRA kubelet plugin (driver redirection.inpod.dev) whose ResourceSlice device carries NoSchedule taints while not ready (Kubernetes >= 1.36; needs deploy/dra/deviceclass.yaml); node-condition: the Node condition InPodRedirectionReady, written on each readiness change (for inpod-controller or node-readiness-controller; needs patch on nodes/status)")
	fs.BoolVar(&cfg.ReleaseStartupMemory, "release-startup-memory", true, "once the node has been ready and then without CNI events for --release-startup-memory-quiet, unmap the agent's binary (MADV_PAGEOUT) and drop its page cache that nothing maps: what start-up alone ran stops counting against the node (RSS ~20 MiB less with no pods); any page the agent runs again is read back from the binary")
	fs.DurationVar(&cfg.StartupMemoryQuiet, "release-startup-memory-quiet", agent.DefaultStartupMemoryQuiet, "how long the node must see no CNI event, once first ready, before --release-startup-memory")
	fs.StringVar(&cfg.PodName, "pod-name", "", "the agent's own pod (downward API metadata.name): at shutdown, if the DaemonSet controlling it (by UID) is gone or being deleted and no other inpod agent serves this node, the agent removes inpod from the node (CNI plugin and config, pod rules); empty: never")
	fs.StringVar(&cfg.PodNamespace, "pod-namespace", "", "the agent's namespace (downward API metadata.namespace); holds its pod and the plugin's ServiceAccount")
	fs.StringVar(&cfg.PodUID, "pod-uid", "", "the agent's pod's UID (downward API metadata.uid): with the dra gate, the kubelet plugin's sockets are named by it so a rollout's two agents both serve the driver during the hand-over (kubelet >= 1.33); empty: the dra gate hands no node over, the agent waits for the one before to exit")
	fs.StringVar(&cfg.AgentSelector, "agent-selector", agent.DefaultAgentSelector, "label selector of inpod agent pods (any installation); another one on this node keeps an uninstall from removing inpod here")
	fs.StringVar(&cfg.PluginServiceAccount, "plugin-service-account", agent.DefaultPluginServiceAccount, "ServiceAccount in --pod-namespace whose token (TokenRequest API, renewed hourly) the plugin's agent-down check uses; it may only get pods and namespaces")
	fs.StringVar(&cfg.DevicePlugin.PluginDir, "device-plugin-dir", deviceplugin.DefaultPluginDir, "the kubelet's device plugin directory")
	fs.StringVar(&cfg.PodResourcesSocket, "pod-resources-socket", agent.DefaultPodResourcesSocket, "the kubelet's pod-resources API; with it the deviceplugin gate also holds each container start of a pod that requested --resource-name until the pod runs redirected in its current sandbox (PreStartContainer), closing the window where another CNI's rewrite dropped inpod-cni while the sandbox was set up; empty: no such check")
	fs.StringVar(&cfg.DevicePlugin.ResourceName, "resource-name", deviceplugin.DefaultResourceName, "the extended resource pods request")
	fs.IntVar(&cfg.DevicePlugin.Devices, "devices", 0, fmt.Sprintf("devices to advertise; 0: the Node's pod capacity (status.capacity.pods), or %d when it cannot be read", deviceplugin.DefaultDevices))
	fs.DurationVar(&cfg.DevicePlugin.CloseTimeout, "device-plugin-close-timeout", deviceplugin.DefaultCloseTimeout, "deviceplugin gate: when the node stops being ready (or the agent stops), how long the devices may stay Healthy while the agent sets the resource's allocatable on its Node to 0 (so the scheduler binds no more enrolled pods here) and the kubelet admits the pods already bound, which then wait at their CNI ADD; the kubelet refuses for good a pod it admits while no device is Healthy; negative: Unhealthy at once (on a dip the count is still set to 0); at most 10s; at shutdown the close takes at most 2s")
	fs.StringVar(&cfg.DRA.RegistrarDir, "dra-registrar-dir", dra.DefaultRegistrarDir, "the kubelet's plugin registration directory (the dra gate registers there)")
	fs.StringVar(&cfg.DRA.PluginDir, "dra-plugin-dir", dra.DefaultPluginDir, "the dra gate's own directory: its gRPC socket and its record of prepared claims (same path on the host and in the container)")
	fs.DurationVar(&cfg.NodeCondition.StartupGrace, "node-condition-startup-grace", readiness.DefaultStartupGrace, "node-condition gate: when the Node's condition is already True at start (an agent restart), write nothing until the first ready verdict or until this passes, so a restart does not re-taint the node; negative: no grace")
	fs.DurationVar(&cfg.VerifyPeriod, "verify-period", agent.DefaultVerifyPeriod, "how often every enrolled pod is re-proven (its sandbox, the rules in its netns read back from the kernel, ztunnel's Ack and listeners, the node's probe exemptions), repairing what was lost; jittered by ±10 %; events that may break a pod's redirection (a CNI DEL, a recreated sandbox, ztunnel reconnecting, the CNI configuration repaired, a failed removal) ask for a round sooner")
	fs.DurationVar(&cfg.ZtunnelGrace, "ztunnel-grace", agent.DefaultZtunnelGrace, "how long ztunnel may be away (its restart, the agent's) before the verifier takes every enrolled pod for unproven and turns its inpod.dev/redirected condition False")
	fs.Float64Var(&kubeAPIQPS, "kube-api-qps", agent.DefaultKubeAPIQPS, "client-side limit of API requests per second, shared by the agent's writes (pod annotations, Events, the Node condition, token requests)")
	fs.IntVar(&cfg.KubeAPIBurst, "kube-api-burst", 0, fmt.Sprintf("client-side burst of API requests, at least --kube-api-qps (0: %d, or --kube-api-qps if higher)", agent.DefaultKubeAPIBurst))
	logLevel := fs.String("log-level", "info", "debug, info, warn or error")
	err := envflag.Parse(fs, "inpod-agent: the inpod node agent (run as a DaemonSet with hostNetwork)", os.Args[1:])
	if err == flag.ErrHelp {
		return nil
	}
	if err != nil {
		return err
	}
	var level slog.Level
	if err := level.UnmarshalText([]byte(*logLevel)); err != nil {
		return fmt.Errorf("invalid --log-level %q: %v", *logLevel, err)
	}
	switch *handoverSocket {
	case "none":
	case "":
		cfg.HandoverSocket = filepath.Join(filepath.Dir(cfg.CNISocket), "handover.sock")
	default:
		cfg.HandoverSocket = *handoverSocket
	}
	cfg.KubeAPIQPS = float32(kubeAPIQPS)
	cfg.Logger = slog.New(slog.NewJSONHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
	for _, ns := range strings.Split(*exclude, ",") {
		if ns = strings.TrimSpace(ns); ns != "" {
			cfg.ExcludedNamespaces = append(cfg.ExcludedNamespaces, ns)
		}
	}
	a, err := agent.New(cfg)
	if err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	return a.Run(ctx)
}
