// Package uninstallhook is the chart's pre-delete hook (`inpod-agent
// uninstall-hook`): it deletes the agent DaemonSet and waits until the
// agent pods are gone, so that every agent runs its uninstall while its RBAC
// still exists. Without it, helm uninstall deletes the DaemonSet and, in the
// same call, the agent's RBAC and ServiceAccount: the agents still see their
// DaemonSet go (through their open watch) and clean their nodes, but their
// last step, removing the pods' redirection annotations, is refused.
package uninstallhook

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
)

// Config says which DaemonSet to delete and which pods to wait for.
type Config struct {
	Client    kubernetes.Interface
	Namespace string
	DaemonSet string
	// Selector selects the agent pods to wait for.
	Selector string
	// Timeout bounds the wait; past it the hook gives up and succeeds, so
	// an unreachable node (whose agent cannot clean up anyway) never blocks
	// an uninstall.
	Timeout time.Duration
	// Poll is the interval between pod listings (default 1 s).
	Poll   time.Duration
	Logger *slog.Logger
}

// Run deletes the DaemonSet and waits until no agent pod remains, or the
// timeout passes (then it logs what remains and returns nil). It fails only
// when the DaemonSet cannot be deleted or the pods cannot be listed.
func Run(ctx context.Context, cfg Config) error {
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	if cfg.Poll == 0 {
		cfg.Poll = time.Second
	}
	bg := metav1.DeletePropagationBackground
	err := cfg.Client.AppsV1().DaemonSets(cfg.Namespace).Delete(ctx, cfg.DaemonSet, metav1.DeleteOptions{PropagationPolicy: &bg})
	switch {
	case apierrors.IsNotFound(err):
		log.Info("agent DaemonSet already gone", "daemonset", cfg.DaemonSet)
	case err != nil:
		return fmt.Errorf("uninstall hook: delete DaemonSet %s/%s: %w", cfg.Namespace, cfg.DaemonSet, err)
	default:
		log.Info("deleted the agent DaemonSet; waiting for the agents to remove inpod from their nodes", "daemonset", cfg.DaemonSet)
	}
	deadline := time.Now().Add(cfg.Timeout)
	tick := time.NewTicker(cfg.Poll)
	defer tick.Stop()
	for {
		pods, err := cfg.Client.CoreV1().Pods(cfg.Namespace).List(ctx, metav1.ListOptions{LabelSelector: cfg.Selector})
		if err != nil {
			return fmt.Errorf("uninstall hook: list agent pods: %w", err)
		}
		if len(pods.Items) == 0 {
			log.Info("every agent has stopped")
			return nil
		}
		if time.Now().After(deadline) {
			var names []string
			for _, p := range pods.Items {
				names = append(names, p.Spec.NodeName+"/"+p.Name)
			}
			log.Warn("agents still running at the timeout; uninstalling anyway (their nodes keep inpod until an agent runs there again or it is removed by hand)", "agents", names)
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-tick.C:
		}
	}
}
