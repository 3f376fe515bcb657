package agent

import (
	"context"
	"errors"
	"os"
	"strings"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
)

// removalTimeout bounds removing inpod from the node at shutdown; keep the
// DaemonSet's terminationGracePeriodSeconds above it.
const removalTimeout = 20 * time.Second

// removedFromCluster tells an uninstall from a restart or an upgrade: the
// agent's DaemonSet is gone, or being deleted. When it cannot tell (no
// DaemonSet configured, API server unreachable) it answers no: leaving
// inpod in place fails closed, removing it by mistake would let enrolled
// pods start unredirected.
func (a *Agent) removedFromCluster(client kubernetes.Interface) bool {
	if a.cfg.DaemonSet == "" {
		return false
	}
	ns, name, _ := strings.Cut(a.cfg.DaemonSet, "/")
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	ds, err := client.AppsV1().DaemonSets(ns).Get(ctx, name, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		a.log.Info("the agent's DaemonSet is gone: removing inpod from this node", "daemonset", a.cfg.DaemonSet)
		return true
	case err != nil:
		a.log.Warn("cannot tell an uninstall from a restart; leaving inpod in place", "daemonset", a.cfg.DaemonSet, "err", err)
		return false
	case ds.DeletionTimestamp != nil:
		a.log.Info("the agent's DaemonSet is being deleted: removing inpod from this node", "daemonset", a.cfg.DaemonSet)
		return true
	}
	return false
}

// removeFromNode undoes everything the agent did on the node, in the order
// that keeps pods safe: first the plugin leaves the CNI configuration (new
// pods start without inpod), then every enrolled pod loses its rules and
// ztunnel is told, then the node-wide pieces go. Callers have stopped the
// CNI server, the installer's watch and the reconciler.
func (a *Agent) removeFromNode(p *pieces) error {
	ctx, cancel := context.WithTimeout(context.Background(), removalTimeout)
	defer cancel()
	var errs []error
	if p.installer != nil {
		if err := p.installer.Uninstall(); err != nil {
			errs = append(errs, err)
		}
		if err := os.Remove(p.apiAccessPath); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	if err := p.pipeline.UnenrollAll(ctx); err != nil {
		errs = append(errs, err)
	}
	// The writer's loop has stopped with the agent; the pods' redirection
	// annotations are removed here.
	if err := p.annotations.Flush(ctx); err != nil {
		errs = append(errs, err)
	}
	if err := p.probes.Uninstall(); err != nil {
		errs = append(errs, err)
	}
	if err := os.RemoveAll(p.passListPath); err != nil {
		errs = append(errs, err)
	}
	if err := errors.Join(errs...); err != nil {
		a.log.Error("inpod was only partly removed from this node", "err", err)
		return err
	}
	a.log.Info("inpod removed from this node: CNI plugin and configuration, every pod's rules, host probe rules")
	return nil
}
