// Command inpod-controller is inpod's taint-mode controller: it removes the
// nodes' startup taint once the inpod agent reports the node ready (the
// Node condition InPodRedirectionReady) and its agent pod is Ready, and in
// continuous mode puts it back while the node is not. See package
// taintcontroller. With --webhook-addr it also serves the mutating admission
// webhook that adds the resource request (and, with --readiness-gate, the
// readiness gate inpod.dev/redirected) to enrolled pods, on every replica;
// see package requestwebhook.
package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"syscall"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/inpod-dev/inpod/enrollment"
	"github.com/inpod-dev/inpod/internal/clientlimit"
	"github.com/inpod-dev/inpod/internal/envflag"
	"github.com/inpod-dev/inpod/requestwebhook"
	"github.com/inpod-dev/inpod/taintcontroller"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "inpod-controller:", err)
		os.Exit(1)
	}
}

// options are the flags; define registers them on fs.
type options struct {
	cfg                               taintcontroller.Config
	kubeconfig, mode, taint, logLevel *string
	previousTaints                    *string
	qps                               *float64
	burst                             *int
	webhook                           requestwebhook.Config
	excludeNamespaces, resourceName   *string
	resourceRequest                   *bool
}

func define(fs *flag.FlagSet) *options {
	o := &options{}
	cfg := &o.cfg
	o.kubeconfig = fs.String("kubeconfig", "", "kubeconfig to use instead of the in-cluster service account")
	o.mode = fs.String("mode", string(taintcontroller.Bootstrap), "bootstrap: remove the startup taint once per node (recorded in the annotation "+taintcontroller.DoneAnnotation+"); continuous: also put it back while the node's condition is False, or its agent pod is missing or not Ready for longer than --grace")
	o.taint = fs.String("taint", taintcontroller.DefaultTaintKey+":"+string(taintcontroller.DefaultTaintEffect), "the startup taint, key:effect (NoSchedule or PreferNoSchedule); only taints with this key and effect are ever edited")
	o.previousTaints = fs.String("previous-taints", "", "comma-separated startup taints of an earlier --taint, key:effect, or key alone for NoSchedule and PreferNoSchedule: removed from a node when --taint would be (node ready; bootstrap: not yet done), never added, so changing --taint strands no node; an entry of --taint's own key counts only when it names the other effect")
	fs.StringVar(&cfg.NodeSelector, "node-selector", "", "label selector of the nodes in the mesh; other nodes are never touched (empty: every node)")
	fs.StringVar(&cfg.AgentNamespace, "agent-namespace", taintcontroller.DefaultNamespace, "namespace of the inpod agent pods (empty: all namespaces)")
	fs.StringVar(&cfg.AgentSelector, "agent-selector", taintcontroller.DefaultAgentSelector, "label selector of the inpod agent pods")
	fs.DurationVar(&cfg.Grace, "grace", taintcontroller.DefaultGrace, "continuous mode: how long a node's agent pod may be missing or not Ready (or its condition Unknown) before the node is tainted again; an explicit False taints at once; a node that never reported the condition is never tainted")
	fs.IntVar(&cfg.Workers, "workers", taintcontroller.DefaultWorkers, "nodes reconciled in parallel")
	fs.StringVar(&cfg.LeaseNamespace, "lease-namespace", taintcontroller.DefaultNamespace, "namespace of the leader-election Lease (set it from the downward API: metadata.namespace)")
	fs.StringVar(&cfg.LeaseName, "lease-name", taintcontroller.DefaultLeaseName, "name of the leader-election Lease")
	fs.StringVar(&cfg.Identity, "identity", "", "this replica's identity in the Lease (set it from the downward API: metadata.name; empty: hostname, pid and start time)")
	fs.DurationVar(&cfg.LeaseDuration, "lease-duration", taintcontroller.DefaultLeaseDuration, "how long a leader's Lease holds without renewal: the takeover time after a leader dies")
	fs.DurationVar(&cfg.RenewDeadline, "renew-deadline", taintcontroller.DefaultRenewDeadline, "how long the leader keeps retrying a renewal before it stops leading")
	fs.DurationVar(&cfg.RetryPeriod, "retry-period", taintcontroller.DefaultRetryPeriod, "how often candidates try to acquire and the leader renews")
	fs.StringVar(&cfg.HealthAddr, "health-addr", ":15021", "address of /healthz and /readyz")
	fs.StringVar(&cfg.MetricsAddr, "metrics-addr", ":15020", "address of /metrics")
	o.qps = fs.Float64("kube-api-qps", taintcontroller.DefaultQPS, "client-side limit of API requests per second; the leader patches one node a request, so a whole cluster turning ready at once is untainted at this rate (5,000 nodes: 50 s at 100)")
	o.burst = fs.Int("kube-api-burst", 0, fmt.Sprintf("client-side burst of API requests, at least --kube-api-qps (0: %d, or --kube-api-qps if higher)", taintcontroller.DefaultBurst))
	o.logLevel = fs.String("log-level", "info", "debug, info, warn or error")
	wh := &o.webhook
	fs.StringVar(&wh.Addr, "webhook-addr", "", "HTTPS address of the mutating admission webhook that adds the resource request to the pods the enrollment rules enroll, served by every replica (path "+requestwebhook.Path+"; empty: no webhook)")
	fs.StringVar(&wh.CertDir, "webhook-cert-dir", "/etc/inpod/webhook-certs", "directory of the webhook's serving certificate and key ("+requestwebhook.CertFile+", "+requestwebhook.KeyFile+": a kubernetes.io/tls Secret mounted there), read again when they change")
	o.resourceName = fs.String("resource-name", requestwebhook.DefaultResourceName, "webhook: the extended resource enrolled pods request (the agent's --resource-name)")
	o.resourceRequest = fs.Bool("resource-request", true, "webhook: add the resource request to enrolled pods (false with a gate that advertises no resource, where a request would hold every enrolled pod Pending)")
	fs.BoolVar(&wh.ReadinessGate, "readiness-gate", false, "webhook: add the readiness gate "+string(requestwebhook.ReadinessGate)+" to enrolled pods, so a Service sends them traffic only once the agent has proven their redirection (the agent sets that condition)")
	fs.StringVar(&wh.Policy.Label, "enrollment-label", enrollment.DataplaneModeLabel, "webhook: pod and namespace label whose value ambient enrolls and none opts out (the agent's --enrollment-label)")
	o.excludeNamespaces = fs.String("exclude-namespaces", "kube-system", "webhook: comma-separated namespaces never enrolled (the agent's --exclude-namespaces)")
	fs.StringVar(&wh.OwnNamespace, "own-namespace", taintcontroller.DefaultNamespace, "webhook: inpod's namespace, the only one where the label app.kubernetes.io/part-of=inpod exempts a pod from the request")
	return o
}

func run() error {
	fs := flag.NewFlagSet("inpod-controller", flag.ContinueOnError)
	o := define(fs)
	err := envflag.Parse(fs, "inpod-controller: removes the startup taint from nodes whose inpod agent is ready (taint mode; run as a Deployment, leader-elected)", os.Args[1:])
	if err == flag.ErrHelp {
		return nil
	}
	if err != nil {
		return err
	}
	cfg := o.cfg
	var level slog.Level
	if err := level.UnmarshalText([]byte(*o.logLevel)); err != nil {
		return fmt.Errorf("invalid --log-level %q: %v", *o.logLevel, err)
	}
	cfg.Logger = slog.New(slog.NewJSONHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
	cfg.Mode = taintcontroller.Mode(*o.mode)
	key, effect, ok := strings.Cut(*o.taint, ":")
	if !ok {
		return fmt.Errorf("invalid --taint %q: want key:effect", *o.taint)
	}
	cfg.TaintKey, cfg.TaintEffect = key, corev1.TaintEffect(effect)
	cfg.PreviousTaints = parsePreviousTaints(*o.previousTaints)
	// A replica stopped by SIGTERM hands the Lease over at once instead
	// of after --lease-duration.
	cfg.ReleaseOnCancel = true

	var rc *rest.Config
	if *o.kubeconfig != "" {
		rc, err = clientcmd.BuildConfigFromFlags("", *o.kubeconfig)
	} else {
		rc, err = rest.InClusterConfig()
	}
	if err != nil {
		return err
	}
	if rc.QPS, rc.Burst, err = clientlimit.Resolve(*o.qps, *o.burst, taintcontroller.DefaultBurst); err != nil {
		return err
	}
	rc.UserAgent = "inpod-controller"
	if cfg.Client, err = kubernetes.NewForConfig(rc); err != nil {
		return err
	}
	c, err := taintcontroller.New(cfg)
	if err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if o.webhook.Addr == "" {
		return c.Run(ctx)
	}
	wcfg := o.webhook
	wcfg.Client, wcfg.Logger = cfg.Client, cfg.Logger
	wcfg.ResourceName = corev1.ResourceName(*o.resourceName)
	wcfg.NoResourceRequest = !*o.resourceRequest
	for _, ns := range strings.Split(*o.excludeNamespaces, ",") {
		if ns = strings.TrimSpace(ns); ns != "" {
			wcfg.Policy.ExcludedNamespaces = append(wcfg.Policy.ExcludedNamespaces, ns)
		}
	}
	w, err := requestwebhook.New(wcfg)
	if err != nil {
		return err
	}
	return runWithWebhook(ctx, c, w, cfg.Logger)
}

// parsePreviousTaints reads --previous-taints; taintcontroller.New
// validates the keys and effects.
func parsePreviousTaints(s string) []corev1.Taint {
	var out []corev1.Taint
	for _, e := range strings.Split(s, ",") {
		if e = strings.TrimSpace(e); e == "" {
			continue
		}
		key, effect, _ := strings.Cut(e, ":")
		out = append(out, corev1.Taint{Key: key, Effect: corev1.TaintEffect(effect)})
	}
	return out
}

// runner is what runWithWebhook runs: the taint controller, the webhook.
type runner interface {
	Run(ctx context.Context) error
}

// runWithWebhook runs the taint controller and the webhook until ctx ends.
// The webhook serves before and outside leader election (every replica
// behind the Service must answer), but nothing it does stops the
// controller: a broken webhook costs resource requests (failurePolicy
// Ignore), a stopped controller leaves nodes tainted. Its error is logged;
// the controller's ends the process (to be restarted).
func runWithWebhook(ctx context.Context, controller, webhook runner, log *slog.Logger) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := webhook.Run(ctx); err != nil && ctx.Err() == nil {
			log.Error("webhook stopped; the taint controller goes on", "err", err)
		}
	}()
	err := controller.Run(ctx)
	cancel()
	<-done
	return err
}
