package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"syscall"
	"time"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/inpod-dev/inpod/agent"
	"github.com/inpod-dev/inpod/internal/envflag"
	"github.com/inpod-dev/inpod/uninstallhook"
)

// runUninstallHook is `inpod-agent uninstall-hook`, the chart's pre-delete
// hook: delete the node-taint and init-container policy bindings, then the
// agent DaemonSet, and wait for the agents to finish their uninstall while
// their RBAC still exists.
func runUninstallHook(args []string) error {
	fs := flag.NewFlagSet("inpod-agent uninstall-hook", flag.ContinueOnError)
	var cfg uninstallhook.Config
	kubeconfig := fs.String("kubeconfig", "", "kubeconfig to use instead of the in-cluster service account")
	fs.StringVar(&cfg.Namespace, "namespace", "", "the agents' namespace")
	fs.StringVar(&cfg.DaemonSet, "daemonset", "inpod-agent", "the agent DaemonSet to delete")
	fs.Func("binding", "a MutatingAdmissionPolicyBinding to delete first (repeatable; the chart's node-taint and init-container bindings)", func(v string) error {
		if v == "" {
			return fmt.Errorf("empty binding name")
		}
		cfg.Bindings = append(cfg.Bindings, v)
		return nil
	})
	fs.StringVar(&cfg.Selector, "agent-selector", agent.DefaultAgentSelector, "label selector of the agent pods to wait for")
	fs.StringVar(&cfg.InstalledLabel, "installed-label", agent.NodeInstalledLabel, "the Node label agents keep while inpod-cni is in the node's chain: once every agent is gone, nodes still carrying it are named as left to clean; empty: not checked")
	fs.DurationVar(&cfg.Timeout, "timeout", 2*time.Minute, "how long to wait for the agents; then succeed anyway")
	err := envflag.Parse(fs, "inpod-agent uninstall-hook: the chart's pre-delete hook (delete the agent DaemonSet, wait for the agents' uninstall)", args)
	if err == flag.ErrHelp {
		return nil
	}
	if err != nil {
		return err
	}
	var rc *rest.Config
	if *kubeconfig != "" {
		rc, err = clientcmd.BuildConfigFromFlags("", *kubeconfig)
	} else {
		rc, err = rest.InClusterConfig()
	}
	if err != nil {
		return err
	}
	if cfg.Client, err = kubernetes.NewForConfig(rc); err != nil {
		return err
	}
	cfg.Logger = slog.New(slog.NewJSONHandler(os.Stderr, nil))
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	return uninstallhook.Run(ctx, cfg)
}
