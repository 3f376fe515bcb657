//go:build e2e

package e2e

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"github.com/inpod-dev/inpod/dra"
	"github.com/inpod-dev/inpod/e2e/chart"
	"github.com/inpod-dev/inpod/internal/testkit"
)

// TestE2EChartDRAMode installs the chart with gates={dra} on the real node:
// the agent publishes the node's ResourceSlice with its device tainted
// while ztunnel is missing, so an enrolled pod (its request added by the
// chart's policy and served by the chart's DeviceClass) stays Pending; the
// taint goes when the stand-in connects and the pod runs redirected; it
// comes back when ztunnel goes (a new enrolled pod waits, the running one
// is left alone), and uninstall takes the slice and the DeviceClass away.
// A pod that names a ResourceClaim of the device sees the node's readiness
// as the device's health in its allocatedResourcesStatus (the agent's
// DRAResourceHealth stream through the kubelet). An upgrade under a stream
// of enrolled pods hands the node over with both agents' plugins serving
// the driver: no claim refused, no ADD failed, the device never tainted.
func TestE2EChartDRAMode(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	// Installed from make release's artifacts, as a user of a release
	// installs: the agent runs by the digest the values file pins.
	c := newReleasedChartNode(ctx, t, "/var/lib/inpod-e2e-chartdra")
	slices := c.Client.ResourceV1().ResourceSlices()
	// taints is the node's device's taints, or nil with no slice of ours.
	taints := func() []string {
		l, err := slices.List(ctx, metav1.ListOptions{})
		if err != nil {
			return nil
		}
		for i := range l.Items {
			if keys, ok := sliceTaints(&l.Items[i]); ok {
				if keys == nil {
					keys = []string{}
				}
				return keys
			}
		}
		return nil
	}
	c.install(t, "--set", "gates={dra}")
	if _, err := c.Client.ResourceV1().DeviceClasses().Get(ctx, dra.DefaultDriverName, metav1.GetOptions{}); err != nil {
		t.Fatalf("the chart's DeviceClass: %v", err)
	}
	c.agentRunsReleasedImage(t)
	testkit.Eventually(t, 2*time.Minute, "the node's slice published, its device tainted (no ztunnel)", func() bool {
		keys := taints()
		return len(keys) == 1 && keys[0] == dra.TaintKeyPrefix+"ztunnel-not-connected"
	})
	c.waitRequestPolicy(t)
	c.create(t, testAppPod("mesh", "app"))
	testkit.Eventually(t, time.Minute, "the enrolled pod Pending", func() bool { return unschedulableFor(ctx, c.Node, "mesh", "app", "") })

	c.standInUp(t)
	untainted := testkit.Eventually(t, 2*time.Minute, "the device untainted", func() bool {
		keys := taints()
		return keys != nil && len(keys) == 0
	})
	t.Logf("stand-in created → device untainted: %s", untainted.Round(time.Millisecond))
	app := waitReady(t, ctx, c.Node, "mesh", "app")
	c.enrolled(t, app)
	c.inbound(t, app)
	// A pod naming a claim of the device: the kubelet reports the device's
	// health only for such containers (not for a request of the extended
	// resource, which is how enrolled pods ask).
	if _, err := c.Client.ResourceV1().ResourceClaims("mesh").Create(ctx, &resourceapi.ResourceClaim{
		ObjectMeta: metav1.ObjectMeta{Name: "redirection"},
		Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{Requests: []resourceapi.DeviceRequest{{
			Name: "r", Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: dra.DefaultDriverName}}}}},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	claimed := testAppPod("mesh", "claimed")
	claimed.Spec.ResourceClaims = []corev1.PodResourceClaim{{Name: "r", ResourceClaimName: ptr.To("redirection")}}
	claimed.Spec.Containers[0].Resources.Claims = []corev1.ResourceClaim{{Name: "r"}}
	c.create(t, claimed)
	waitReady(t, ctx, c.Node, "mesh", "claimed")
	// health is the claimed device's health in the pod's status, "" while
	// the kubelet reports none.
	health := func() string {
		p, err := c.Client.CoreV1().Pods("mesh").Get(ctx, "claimed", metav1.GetOptions{})
		if err != nil || len(p.Status.ContainerStatuses) == 0 {
			return ""
		}
		for _, rs := range p.Status.ContainerStatuses[0].AllocatedResourcesStatus {
			if rs.Name == "claim:r" && len(rs.Resources) == 1 {
				return string(rs.Resources[0].Health)
			}
		}
		return ""
	}
	testkit.Eventually(t, time.Minute, "the claimed device Healthy in the pod's status", func() bool { return health() == string(corev1.ResourceHealthStatusHealthy) })

	appState := podState(t, ctx, c.Node, "mesh", "app")
	c.standInDown(t)
	closed := testkit.Eventually(t, time.Minute, "the device tainted again", func() bool { return len(taints()) > 0 })
	t.Logf("ztunnel gone → the scheduler sees the gate closed (DRA: device taint in the API): %s", closed.Round(time.Millisecond))
	unhealthy := testkit.Eventually(t, time.Minute, "the claimed device Unhealthy in the pod's status", func() bool {
		return health() == string(corev1.ResourceHealthStatusUnhealthy)
	})
	t.Logf("ztunnel gone → the claimed device Unhealthy in the pod's allocatedResourcesStatus: %s", unhealthy.Round(time.Millisecond))
	c.create(t, testAppPod("mesh", "waiting"))
	testkit.Eventually(t, time.Minute, "a new enrolled pod Pending", func() bool { return unschedulableFor(ctx, c.Node, "mesh", "waiting", "") })
	if got := podState(t, ctx, c.Node, "mesh", "app"); got != appState {
		t.Fatalf("the running enrolled pod was disturbed: %s, was %s", got, appState)
	}
	c.standInUp(t)
	c.enrolled(t, waitReady(t, ctx, c.Node, "mesh", "waiting"))

	c.upgradeUnderChurn(t, taints)

	c.standInDown(t)
	if _, err := c.target.Helm(ctx, c.repo, "uninstall", "inpod", "-n", "inpod-system", "--wait", "--timeout", "3m"); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, time.Minute, "the slice and the DeviceClass gone", func() bool {
		_, err := c.Client.ResourceV1().DeviceClasses().Get(ctx, dra.DefaultDriverName, metav1.GetOptions{})
		return taints() == nil && err != nil
	})
	if got := podState(t, ctx, c.Node, "mesh", "app"); got != appState {
		t.Fatalf("uninstall disturbed the enrolled pod: %s, was %s", got, appState)
	}
}

// upgradeUnderChurn rolls the agent (a changed pod annotation) while
// enrolled pods are created on the node: the surge's agent takes the node
// over while the old one's kubelet plugin serves on, so the device is
// never tainted, no pod's claim is refused (FailedPrepareDynamicResources),
// no CNI ADD fails, and each pod runs redirected.
func (c *chartNode) upgradeUnderChurn(t *testing.T, taints func() []string) {
	t.Helper()
	ctx := c.ctx
	var oldAgent string
	testkit.Eventually(t, time.Minute, "the agent pod Ready", func() bool { oldAgent = agentReady(t, ctx, c.Node); return oldAgent != "" })
	oldLog := followPodLog(ctx, t, c.Client, chart.Namespace, oldAgent, containing("hand", "retire", "successor", "deregistering", "dra", "WARN", "ERROR"))
	stream := startChurn(ctx, c.Client, "mesh", 500*time.Millisecond, 30)
	c.install(t, "--set", "gates={dra}", "--set-string", `agent.podAnnotations.inpod\.dev/e2e-rollout=1`)
	deadline := time.Now().Add(3 * time.Minute)
	for {
		if keys := taints(); len(keys) > 0 {
			t.Fatalf("the device tainted during the rollout: %v", keys)
		}
		if name := agentReady(t, ctx, c.Node); name != "" && name != oldAgent {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for the upgraded agent Ready; the agent pods:\n%s", agentPodsReport(c.Client))
		}
		time.Sleep(50 * time.Millisecond) // sampling the slice, not synchronising
	}
	newAgent := agentReady(t, ctx, c.Node)
	defer func() {
		if t.Failed() {
			logCtx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			newLines, err := podLogLines(logCtx, c.Client, chart.Namespace, newAgent, containing("hand", "tak", "dra", "plugin", "serving", "claim"))
			t.Logf("the old agent's lines:\n%s\nthe upgraded agent's hand-over and gate lines (%v):\n%s",
				strings.Join(oldLog(), "\n"), err, strings.Join(newLines, "\n"))
		}
	}()
	churned := stream.stopAfterHandOver(t, ctx, c.Client, oldAgent, func() {
		if keys := taints(); len(keys) > 0 {
			t.Fatalf("the device tainted during the rollout: %v", keys)
		}
	})
	for _, name := range churned {
		c.enrolled(t, waitReady(t, ctx, c.Node, "mesh", name))
	}
	for _, reason := range []string{"FailedCreatePodSandBox", "FailedPrepareDynamicResources"} {
		evs, err := c.Client.CoreV1().Events("mesh").List(ctx, metav1.ListOptions{FieldSelector: "reason=" + reason})
		if err != nil {
			t.Fatal(err)
		}
		for _, ev := range evs.Items {
			if slices.Contains(churned, ev.InvolvedObject.Name) {
				t.Errorf("%s on %s, created during the upgrade: %s", reason, ev.InvolvedObject.Name, ev.Message)
			}
		}
	}
	const taken = `inpod_agent_handovers_total{role="taken"}`
	if got := agentSample(agentMetricsPort, taken); got != 1 {
		t.Errorf("the upgraded agent's %s is %v, want 1: it did not take the node over", taken, got)
	}
	if !t.Failed() {
		t.Logf("%d enrolled pods created during the upgrade: every one redirected, no claim refused, no failed ADD; the retired agent's gate:\n%s",
			len(churned), strings.Join(slices.DeleteFunc(oldLog(), func(l string) bool { return !containing("retired", "successor", "deregistering")(l) }), "\n"))
	}
	for _, name := range churned {
		c.Client.CoreV1().Pods("mesh").Delete(ctx, name, metav1.DeleteOptions{})
	}
}
