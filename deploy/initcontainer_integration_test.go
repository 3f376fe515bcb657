//go:build integration

package deploy_test

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/inpod-dev/inpod/internal/requestcases"
	"github.com/inpod-dev/inpod/internal/testkit"
)

const waitReadyName = "inpod-wait-ready"

// checkWaitReady says what is wrong with got's init containers, given the
// pod as it was submitted (orig): enrolled, inpod-wait-ready comes first,
// locked down, followed by the pod's own init containers in their order;
// not enrolled, the init containers are the pod's own.
func checkWaitReady(orig, got *corev1.Pod, enrolled bool) string {
	var own []string
	for _, c := range orig.Spec.InitContainers {
		own = append(own, c.Name)
	}
	var have []string
	for _, c := range got.Spec.InitContainers {
		have = append(have, c.Name)
	}
	if !enrolled {
		if !slices.Equal(have, own) {
			return "not enrolled, but its init containers changed: " + names(have)
		}
		return ""
	}
	if !slices.Equal(have, append([]string{waitReadyName}, own...)) {
		return "init containers " + names(have) + ", want " + names(append([]string{waitReadyName}, own...))
	}
	c := got.Spec.InitContainers[0]
	sc := c.SecurityContext
	switch {
	case sc == nil:
		return "no securityContext"
	case sc.RunAsNonRoot == nil || !*sc.RunAsNonRoot, sc.RunAsUser == nil || *sc.RunAsUser == 0:
		return "may run as root"
	case sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem:
		return "writable root filesystem"
	case sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation, sc.Privileged == nil || *sc.Privileged:
		return "privilege escalation or privileged allowed"
	case sc.Capabilities == nil || !slices.Equal(sc.Capabilities.Drop, []corev1.Capability{"ALL"}) || len(sc.Capabilities.Add) > 0:
		return "capabilities not all dropped"
	case sc.SeccompProfile == nil || sc.SeccompProfile.Type != corev1.SeccompProfileTypeRuntimeDefault:
		return "seccomp profile not RuntimeDefault"
	case c.RestartPolicy != nil:
		return "a sidecar, not an init container that completes"
	case c.Resources.Requests.Cpu().Cmp(resource.MustParse("50m")) != 0 || c.Resources.Requests.Memory().Cmp(resource.MustParse("32Mi")) != 0,
		c.Resources.Limits.Cpu().Cmp(*c.Resources.Requests.Cpu()) != 0 || c.Resources.Limits.Memory().Cmp(*c.Resources.Requests.Memory()) != 0:
		// Requests == limits: a Guaranteed pod stays Guaranteed.
		return "resources " + c.Resources.String()
	case c.Image != "ghcr.io/inpod-dev/inpod-waitready:test" || !slices.Equal(c.Args, []string{"--timeout=5m"}):
		return "image " + c.Image + " args " + names(c.Args)
	case c.TerminationMessagePolicy != corev1.TerminationMessageFallbackToLogsOnError:
		return "termination message not from its log"
	}
	return ""
}

func names(s []string) string { return "[" + strings.Join(s, ", ") + "]" }

// TestIntegrationInitContainerPolicy creates the chart's admission policies
// for gates deviceplugin and initcontainer on a real API server and admits
// requestcases' pods (server-side dry run): every pod the enrollment rules
// enroll gets inpod-wait-ready first among its init containers, locked down
// (a namespace enforcing Pod Security "restricted" admits it), and keeps
// its resource request; every excluded pod is left alone; a pod that has
// the container already does not get a second.
func TestIntegrationInitContainerPolicy(t *testing.T) {
	a := startAPIServer(t)
	a.create(t, false, kinds(render(t, "--set", "gates={deviceplugin,initcontainer}", "--set", "initContainer.image.tag=test"),
		"MutatingAdmissionPolicy", "MutatingAdmissionPolicyBinding", "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")...)
	// The request policy decides as before next to it (this also creates
	// the cases' namespaces).
	a.checkRequestCases(t, "the request policy next to the init-container policy")

	ctx := context.Background()
	admit := func(p *corev1.Pod) *corev1.Pod { t.Helper(); return a.admit(t, p) }
	probe := requestcases.Cases()[0]
	testkit.Eventually(t, 30*time.Second, "the init-container policy to apply", func() bool {
		return checkWaitReady(probe.Pod, admit(probe.Pod.DeepCopy()), true) == ""
	})
	for _, c := range requestcases.Cases() {
		if msg := checkWaitReady(c.Pod, admit(c.Pod.DeepCopy()), c.Gated()); msg != "" {
			t.Errorf("pod %s/%s (gated: %t): %s", c.Pod.Namespace, c.Pod.Name, c.Gated(), msg)
		}
	}

	// inpod's own pods, in the release namespace only, get neither.
	if got := admit(requestcases.OwnPod()); checkWaitReady(requestcases.OwnPod(), got, false) != "" || requestcases.Requested(got) {
		t.Errorf("inpod's own pod in %s was gated: %v", requestcases.Own, got.Spec)
	}

	// Idempotent: a pod that already has it (created from an admitted
	// pod's spec) keeps exactly one, first.
	once := admit(probe.Pod.DeepCopy())
	again := probe.Pod.DeepCopy()
	again.Spec.InitContainers = once.Spec.InitContainers
	if msg := checkWaitReady(probe.Pod, admit(again), true); msg != "" {
		t.Errorf("admitted twice: %s", msg)
	}

	// A Guaranteed pod (requests == limits in every container, init
	// containers included) stays Guaranteed: the API server computes the
	// class at creation, after the mutation.
	guaranteed := probe.Pod.DeepCopy()
	guaranteed.Name = "guaranteed"
	for i := range guaranteed.Spec.Containers {
		rl := corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("200m"), corev1.ResourceMemory: resource.MustParse("128Mi")}
		guaranteed.Spec.Containers[i].Resources = corev1.ResourceRequirements{Requests: rl, Limits: rl}
	}
	if got := admit(guaranteed); got.Status.QOSClass != corev1.PodQOSGuaranteed {
		t.Errorf("a Guaranteed pod became %s with %s: %v", got.Status.QOSClass, waitReadyName, got.Spec.InitContainers[0].Resources)
	}

	// A pod that brings its own inpod-wait-ready (which the mutation, by
	// name, leaves alone) is refused unless it is the guard itself; a pod
	// outside the mesh may name its containers as it likes.
	fake := probe.Pod.DeepCopy()
	fake.Name = "fake-guard"
	fake.Spec.InitContainers = []corev1.Container{{Name: waitReadyName, Image: "busybox", Command: []string{"true"}}}
	testkit.Eventually(t, 30*time.Second, "the genuine-guard policy to refuse a fake "+waitReadyName, func() bool {
		_, err := a.Client.CoreV1().Pods(fake.Namespace).Create(ctx, fake.DeepCopy(), metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
		return err != nil && strings.Contains(err.Error(), "must be inpod's guard")
	})
	outside := fake.DeepCopy()
	outside.Namespace, outside.Labels = "plain", nil
	if got := admit(outside); len(got.Spec.InitContainers) != 1 || got.Spec.InitContainers[0].Image != "busybox" {
		t.Errorf("a pod outside the mesh with its own %s: %v", waitReadyName, got.Spec.InitContainers)
	}

	// Pod Security "restricted" (validated after mutation) admits the
	// injected container next to a compliant application.
	if _, err := a.Client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "strict", Labels: map[string]string{
		requestcases.Label: "ambient", "pod-security.kubernetes.io/enforce": "restricted"}}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	yes, no := true, false
	strict := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "strict", Name: "app"}, Spec: corev1.PodSpec{Containers: []corev1.Container{{
		Name: "app", Image: "app", SecurityContext: &corev1.SecurityContext{RunAsNonRoot: &yes, AllowPrivilegeEscalation: &no,
			Capabilities:   &corev1.Capabilities{Drop: []corev1.Capability{"ALL"}},
			SeccompProfile: &corev1.SeccompProfile{Type: corev1.SeccompProfileTypeRuntimeDefault}}}}}}
	if msg := checkWaitReady(strict, admit(strict.DeepCopy()), true); msg != "" {
		t.Errorf("restricted namespace: %s", msg)
	}
}

// TestIntegrationInitContainerGateAlone: gate initcontainer alone renders
// no resource request (no node advertises the resource) and runs the agent
// with no gate of its own; enrolled pods still get the init container (and
// the readiness gate, which every gate has).
func TestIntegrationInitContainerGateAlone(t *testing.T) {
	objs := render(t, "--set", "gates={initcontainer}", "--set", "initContainer.image.tag=test")
	var policies []string
	for _, o := range kinds(objs, "MutatingAdmissionPolicy") {
		policies = append(policies, o.GetName())
	}
	slices.Sort(policies)
	if want := []string{"inpod-readiness-gate", waitReadyName}; !slices.Equal(policies, want) {
		t.Fatalf("policies %v, want %v", policies, want)
	}
	a := startAPIServer(t)
	a.create(t, false, kinds(objs, "MutatingAdmissionPolicy", "MutatingAdmissionPolicyBinding")...)
	ctx := context.Background()
	for _, ns := range requestcases.Namespaces() {
		if _, err := a.Client.CoreV1().Namespaces().Create(ctx, ns, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	c := requestcases.Cases()[0]
	testkit.Eventually(t, 30*time.Second, "the init-container policy to apply", func() bool {
		out, err := a.Client.CoreV1().Pods(c.Pod.Namespace).Create(ctx, c.Pod.DeepCopy(), metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
		return err == nil && checkWaitReady(c.Pod, out, true) == "" && !requestcases.Requested(out)
	})
}
