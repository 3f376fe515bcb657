//go:build e2e

package e2e

import (
	"context"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/inpod-dev/inpod/dra"
	"github.com/inpod-dev/inpod/internal/testkit"
)

// TestE2EChartDRAMode installs the chart with gates={dra} on the real node:
// the agent publishes the node's ResourceSlice with its device tainted
// while ztunnel is missing, so an enrolled pod (its request added by the
// chart's policy and served by the chart's DeviceClass) stays Pending; the
// taint goes when the stand-in connects and the pod runs redirected; it
// comes back when ztunnel goes (a new enrolled pod waits, the running one
// is left alone), and uninstall takes the slice and the DeviceClass away.
func TestE2EChartDRAMode(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	c := newChartNode(ctx, t, "/var/lib/inpod-e2e-chartdra")
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

	appState := podState(t, ctx, c.Node, "mesh", "app")
	c.standInDown(t)
	closed := testkit.Eventually(t, time.Minute, "the device tainted again", func() bool { return len(taints()) > 0 })
	t.Logf("ztunnel gone → the scheduler sees the gate closed (DRA: device taint in the API): %s", closed.Round(time.Millisecond))
	c.create(t, testAppPod("mesh", "waiting"))
	testkit.Eventually(t, time.Minute, "a new enrolled pod Pending", func() bool { return unschedulableFor(ctx, c.Node, "mesh", "waiting", "") })
	if got := podState(t, ctx, c.Node, "mesh", "app"); got != appState {
		t.Fatalf("the running enrolled pod was disturbed: %s, was %s", got, appState)
	}
	c.standInUp(t)
	c.enrolled(t, waitReady(t, ctx, c.Node, "mesh", "waiting"))

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
