//go:build integration

package agent_test

import (
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/inpod-dev/inpod/enrollment"
)

// podPatch says whether r is a patch of a pod (the annotation writer's
// only kind of write).
func podPatch(r *http.Request) bool {
	return r.Method == http.MethodPatch && strings.Contains(r.URL.Path, "/pods/")
}

// stopWithin stops the agent and fails the test unless Run returns within
// limit: a restart the kubelet must SIGKILL loses what the graceful stop
// was for.
func stopWithin(t *testing.T, stop func() error, limit time.Duration) {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- stop() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("agent: %v", err)
		}
	case <-time.After(limit):
		t.Fatalf("the agent's graceful stop did not return within %s", limit)
	}
}

// A stop that is not an uninstall writes the annotations the writer still
// holds (the writer itself stops with the agent): here the API server
// refused the pod's patch until just before the stop, so the writer's next
// retry was seconds away.
func TestIntegrationGracefulStopWritesTheAnnotationsItHeld(t *testing.T) {
	w := newWorld(t)
	var refusing atomic.Bool
	var refused atomic.Int64
	refusing.Store(true)
	w.cfg.Kubeconfig = apiProxy(t, w.cp, func(r *http.Request) bool {
		if podPatch(r) && refusing.Load() {
			refused.Add(1)
			return false
		}
		return true
	})
	stop := w.runAgent()
	pod, sandbox := w.pod("mesh", "held")
	if _, err := w.cniAdd(pod, sandbox); err != nil {
		t.Fatal(err)
	}
	// The writer's retries back off from 5 ms, doubling: after ten
	// refusals the next is ~2.5 s away, far longer than the stop takes.
	w.eventually("the writer refused ten times", func() bool { return refused.Load() >= 10 })
	refusing.Store(false)
	stopWithin(t, stop, 20*time.Second)
	if got := w.annotation(pod); got != enrollment.AnnotationEnabled {
		t.Fatalf("redirection annotation after the stop = %q, want %q", got, enrollment.AnnotationEnabled)
	}
}

// With the API server unreachable, the flush at a graceful stop gives up
// after its bound instead of holding the restart: the next agent writes
// what did not make it.
func TestIntegrationGracefulStopIsNotHeldByAnUnreachableAPIServer(t *testing.T) {
	w := newWorld(t)
	var hung atomic.Int64
	released := make(chan struct{})
	w.cfg.Kubeconfig = apiProxy(t, w.cp, func(r *http.Request) bool {
		if podPatch(r) {
			hung.Add(1)
			select {
			case <-r.Context().Done():
			case <-released:
			}
			return false
		}
		return true
	})
	stop := w.runAgent()
	// Before the agent's own cleanup (it waits for the stop), so that a
	// stop that does hang ends once the test has failed.
	t.Cleanup(func() { close(released) })
	pod, sandbox := w.pod("mesh", "unwritten")
	if _, err := w.cniAdd(pod, sandbox); err != nil {
		t.Fatal(err)
	}
	w.eventually("the writer's patch in flight", func() bool { return hung.Load() >= 1 })
	stopWithin(t, stop, 20*time.Second)
	if got := w.annotation(pod); got != "" {
		t.Fatalf("redirection annotation = %q, want none: the test needs every patch to hang", got)
	}
}
