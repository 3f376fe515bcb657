//go:build e2e

package e2e

import (
	"context"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/inpod-dev/inpod/enrollment"
	"github.com/inpod-dev/inpod/internal/testkit"
	"github.com/inpod-dev/inpod/release"
)

// TestE2EInitContainerGate installs inpod with gate initcontainer only,
// its agent held off the node (it runs on nodes carrying a label the node
// does not have yet): the admission policy is in place, the plugin is not.
// An enrolled pod created then gets inpod-wait-ready first, which fails at
// its timeout with a message naming the missing listeners (the pod is not
// Running: its app never started) and is retried by the kubelet. Labelling
// the node brings the agent there: it enrolls the running sandbox through
// procfs, the init container passes, and the app runs redirected (a
// connection to it lands on ztunnel's inbound listener).
func TestE2EInitContainerGate(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	c := newChartNode(ctx, t, "/var/lib/inpod-e2e-initc")
	node, client := c.Node, c.Client

	const agentLabel = "e2e.inpod.dev/agent"
	c.install(t, "--set", "gates={initcontainer}",
		"--set", "initContainer.image.repository="+release.WaitReadyRepository, "--set", "initContainer.image.tag="+release.DevTag,
		"--set", "initContainer.image.pullPolicy=Never", "--set", "initContainer.timeout=10s",
		"--set-string", "agent.nodeSelector.e2e\\.inpod\\.dev/agent=true")
	c.standInUp(t)
	pod := testAppPod("mesh", "app")
	// A new policy takes seconds to act: dry runs until it does.
	testkit.Eventually(t, time.Minute, "the init-container policy to apply", func() bool {
		p, err := client.CoreV1().Pods("mesh").Create(ctx, pod.DeepCopy(), metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
		return err == nil && len(p.Spec.InitContainers) == 1 && p.Spec.InitContainers[0].Name == "inpod-wait-ready"
	})
	if _, err := client.CoreV1().Pods("mesh").Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	get := func() *corev1.Pod {
		p, err := client.CoreV1().Pods("mesh").Get(ctx, "app", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return p
	}

	// No redirection on the node: the init container fails, saying why,
	// and the app never starts.
	var message string
	testkit.Eventually(t, 3*time.Minute, "the init container failing at its timeout", func() bool {
		p := get()
		if len(p.Status.InitContainerStatuses) == 0 {
			return false
		}
		s := p.Status.InitContainerStatuses[0]
		for _, st := range []corev1.ContainerState{s.State, s.LastTerminationState} {
			if st.Terminated != nil && st.Terminated.ExitCode != 0 {
				message = st.Terminated.Message
				return true
			}
		}
		return false
	})
	if !strings.Contains(message, "ztunnel's listeners on port 15001, 15006, 15008 are not bound") {
		t.Errorf("the init container's termination message does not say what is missing: %q", message)
	}
	p := get()
	if p.Status.Phase == corev1.PodRunning || len(p.Status.ContainerStatuses) == 0 || p.Status.ContainerStatuses[0].State.Running != nil ||
		p.Status.ContainerStatuses[0].LastTerminationState.Terminated != nil {
		t.Fatalf("the app started without redirection: phase %s, %+v", p.Status.Phase, p.Status.ContainerStatuses)
	}
	t.Logf("without redirection: %s", message)

	// inpod reaches the node: the agent starts there and enrolls the
	// running sandbox; the next run of the init container passes.
	if _, err := client.CoreV1().Nodes().Patch(ctx, node.Name, types.MergePatchType,
		[]byte(`{"metadata":{"labels":{"`+agentLabel+`":"true"}}}`), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	labelled := time.Now()
	testkit.Eventually(t, 4*time.Minute, "the app Running once the agent enrolled it", func() bool {
		p = get()
		return p.Status.Phase == corev1.PodRunning && p.Status.PodIP != ""
	})
	t.Logf("app Running %s after the agent's node was labelled (init-container back-off included)", time.Since(labelled).Round(time.Second))
	if p.Annotations[enrollment.RedirectionAnnotation] != enrollment.AnnotationEnabled {
		t.Errorf("the app runs without the %s=enabled annotation: %v", enrollment.RedirectionAnnotation, p.Annotations)
	}
	logs, err := client.CoreV1().Pods("mesh").GetLogs("app", &corev1.PodLogOptions{Container: "inpod-wait-ready"}).DoRaw(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(logs), "redirection in place") || !strings.Contains(string(logs), "delivered to its 15001") {
		t.Errorf("the init container's last run did not prove redirection: %s", logs)
	}
	c.enrolled(t, p)
	c.inbound(t, p)
}
