// Package uninstallhook is the chart's pre-delete hook (`inpod-agent
// uninstall-hook`): it deletes the agent DaemonSet and waits until the
// agent pods are gone, so that every agent runs its uninstall while its RBAC
// still exists. Without it, helm uninstall deletes the DaemonSet and, in the
// same call, the agent's RBAC and ServiceAccount: the agents still see their
// DaemonSet go (through their open watch) and clean their nodes, but their
// last step, removing the pods' redirection annotations, is refused.
//
// An agent that is not running when the uninstall starts (crash-looping, its
// node offline), and a node an agent left without cleaning it (found by the
// label agents keep on nodes that chain inpod-cni), cannot be cleaned by an
// agent: inpod-cni stays chained there, and its
// agent-down check loses its credential with the ServiceAccount, so every
// new pod on that node would fail. The hook cannot fix such a node, but it
// must not hide it: it fails, naming the nodes, so Helm stops the uninstall
// (keeping the RBAC) and the user cleans those nodes before finishing with
// `helm uninstall --no-hooks`.
//
// First of all it deletes the MutatingAdmissionPolicyBindings of policies
// that must not outlive the agents (Config.Bindings): Helm deletes
// admission policies last, after the agents and inpod-controller, and
// while such a binding is live:
//   - node-taint policy: a node registering with no controller running
//     (during the hook's wait, or after it) keeps the startup taint forever;
//   - init-container policy (gate initcontainer): a pod created while the
//     agents leave gets inpod-wait-ready, which can never pass once no
//     agent redirects it, so the pod never starts.
package uninstallhook

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
)

// Config says which DaemonSet to delete and which pods to wait for.
type Config struct {
	Client    kubernetes.Interface
	Namespace string
	DaemonSet string
	// Bindings are the MutatingAdmissionPolicyBindings to delete before
	// anything else (the node-taint and init-container policies' ones the
	// chart renders); one already gone is fine.
	Bindings []string
	// Selector selects the agent pods to wait for.
	Selector string
	// InstalledLabel is the Node label an agent keeps while inpod-cni is
	// in its node's chain (agent.NodeInstalledLabel). Once every agent is
	// gone, a node still carrying it was left without cleaning (its agent
	// moved off the DaemonSet while down, or killed during its removal)
	// and is named; empty: nodes are not checked.
	InstalledLabel string
	// Timeout bounds the wait; past it the hook fails, naming the nodes
	// whose agent is still there (an unreachable node cannot be cleaned by
	// its agent).
	Timeout time.Duration
	// Poll is the interval between pod listings (default 1 s).
	Poll   time.Duration
	Logger *slog.Logger
}

// Run deletes the policy bindings, then the DaemonSet, and waits until no
// agent pod remains. It fails
// when an agent was not running at the start (its node keeps inpod), when
// agents remain at the timeout, or when the API refuses it; the error names
// the nodes left to clean by hand.
func Run(ctx context.Context, cfg Config) error {
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	if cfg.Poll == 0 {
		cfg.Poll = time.Second
	}
	for _, b := range cfg.Bindings {
		// A failure stops the uninstall: going on would leave the policy
		// acting without the agents (nodes tainted for good, pods
		// waiting for good).
		err := cfg.Client.AdmissionregistrationV1().MutatingAdmissionPolicyBindings().Delete(ctx, b, metav1.DeleteOptions{})
		switch {
		case apierrors.IsNotFound(err):
			log.Info("policy binding already gone", "binding", b)
		case err != nil:
			return fmt.Errorf("uninstall hook: delete MutatingAdmissionPolicyBinding %s (its policy would act without the agents): %w", b, err)
		default:
			log.Info("deleted the policy binding before the agents", "binding", b)
		}
	}
	// Read before the DaemonSet goes: once deleted, a crash-looping agent's
	// pod disappears as fast as a clean one.
	before, err := cfg.Client.CoreV1().Pods(cfg.Namespace).List(ctx, metav1.ListOptions{LabelSelector: cfg.Selector})
	if err != nil {
		return fmt.Errorf("uninstall hook: list agent pods: %w", err)
	}
	var notRunning []string
	for _, p := range before.Items {
		if !allRunning(&p) {
			notRunning = append(notRunning, p.Spec.NodeName)
		}
	}
	bg := metav1.DeletePropagationBackground
	err = cfg.Client.AppsV1().DaemonSets(cfg.Namespace).Delete(ctx, cfg.DaemonSet, metav1.DeleteOptions{PropagationPolicy: &bg})
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
			if len(notRunning) > 0 {
				return uncleanError("their agent was not running when the uninstall began", notRunning)
			}
			if left, err := labelledNodes(ctx, cfg); err != nil {
				return err
			} else if len(left) > 0 {
				return uncleanError(fmt.Sprintf("they still carry %s, and no agent is left to remove inpod there (an agent that left such a node while it was down, or was killed during its removal)", cfg.InstalledLabel), left)
			}
			log.Info("every agent has stopped")
			return nil
		}
		if time.Now().After(deadline) {
			nodes := append([]string(nil), notRunning...)
			for _, p := range pods.Items {
				nodes = append(nodes, p.Spec.NodeName)
			}
			return uncleanError(fmt.Sprintf("their agent had not finished after %s", cfg.Timeout), nodes)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-tick.C:
		}
	}
}

// labelledNodes names the nodes that carry cfg.InstalledLabel.
func labelledNodes(ctx context.Context, cfg Config) ([]string, error) {
	if cfg.InstalledLabel == "" {
		return nil, nil
	}
	nodes, err := cfg.Client.CoreV1().Nodes().List(ctx, metav1.ListOptions{LabelSelector: cfg.InstalledLabel})
	if err != nil {
		return nil, fmt.Errorf("uninstall hook: list the nodes labelled %s: %w", cfg.InstalledLabel, err)
	}
	var names []string
	for _, n := range nodes.Items {
		names = append(names, n.Name)
	}
	return names, nil
}

// allRunning says whether every container of an agent pod runs, the one
// state in which its agent sees the DaemonSet go and cleans its node.
func allRunning(p *corev1.Pod) bool {
	if p.Status.Phase != corev1.PodRunning || len(p.Status.ContainerStatuses) == 0 {
		return false
	}
	for _, c := range p.Status.ContainerStatuses {
		if c.State.Running == nil {
			return false
		}
	}
	return true
}

func uncleanError(why string, nodes []string) error {
	slices.Sort(nodes)
	nodes = slices.Compact(nodes)
	return fmt.Errorf("uninstall hook: inpod may still be chained in the CNI configuration of node(s) %s: %s. "+
		"New pods there fail until it is removed (README: Uninstall, a node whose agent was down). "+
		"Helm keeps the release; after cleaning those nodes, finish with: helm uninstall --no-hooks",
		strings.Join(nodes, ", "), why)
}
