//go:build integration

package deploy_test

import (
	"encoding/base64"
	"os"
	"path/filepath"
	"testing"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"

	"github.com/inpod-dev/inpod/internal/requestcases"
	"github.com/inpod-dev/inpod/internal/testkit"
)

// TestIntegrationChartAcceptedByAPIServer: every object the chart renders,
// for each gate value and with every optional part on (bar the
// ServiceMonitor, whose CRD a bare API server lacks), and the committed
// deploy/manifests/inpod.yaml, pass a real kube-apiserver's validation and
// admission in a server-side dry run with strict field validation (an
// unknown or misspelled field fails).
func TestIntegrationChartAcceptedByAPIServer(t *testing.T) {
	a := startAPIServer(t)
	for _, args := range [][]string{
		nil,
		{"--set", "gates={dra}", "--set-json", "enrollment.excludedNamespaces=[]"},
		{"--set", "gates={node-condition}", "--set", "enrollment.autoRequest.enabled=false"},
		{"--set", "gates={none}", "--set", "enrollment.autoRequest.enabled=false"},
		{"--set", "gates={deviceplugin}", "--set", "enrollment.readinessGate.enabled=false"},
		{"--set", "gates={deviceplugin,node-condition}", "--set", "redirection.dnsCapture=true",
			"--set", "agent.apiServer.host=127.0.0.1", "--set", "agent.apiServer.port=6443",
			"--set", "enrollment.excludedNamespaces={kube-system,monitoring}", "--set", "agent.extraArgs={--log-level=debug}"},
		// The init-container gate, alone (the agent runs no gate) and
		// next to another.
		{"--set", "gates={initcontainer}", "--set", "initContainer.timeout=90s"},
		{"--set", "gates={dra,initcontainer}"},
		// inpod-controller, taint mode, in both modes with the node-taint
		// policy (and its binding's node selector).
		{"--set", "gates={node-condition}", "--set", "controller.enabled=true", "--set", "controller.nodeTaintPolicy.enabled=true"},
		{"--set", "gates={deviceplugin,node-condition}", "--set", "controller.enabled=true", "--set", "controller.mode=continuous",
			"--set", "controller.nodeTaintPolicy.enabled=true", "--set", "controller.grace=1m30s",
			"--set-string", `controller.nodeSelector.example\.com/mesh=true`,
			"--set", "agent.apiServer.host=127.0.0.1", "--set", "agent.apiServer.port=6443"},
	} {
		objs := render(t, args...)
		if len(objs) < 10 {
			t.Fatalf("%v: only %d objects rendered", args, len(objs))
		}
		a.create(t, true, objs...)
	}
	// mode=webhook, with a caBundle of one's own, and with cert-manager
	// (whose Certificate and Issuer a bare API server cannot take: the
	// rest, with the cainjector's annotation).
	ca := base64.StdEncoding.EncodeToString(requestcases.WriteServingCert(t, t.TempDir(), 1))
	webhook := []string{"--set", "enrollment.autoRequest.mode=webhook", "--set", "controller.enabled=true"}
	a.create(t, true, render(t, append(webhook, "--set", "enrollment.autoRequest.webhook.caBundle="+ca)...)...)
	// Taint mode: the webhook serves the readiness gate alone.
	a.create(t, true, render(t, append(webhook, "--set", "enrollment.autoRequest.webhook.caBundle="+ca, "--set", "gates={node-condition}")...)...)
	var noCertManager []*unstructured.Unstructured
	for _, o := range render(t, append(webhook, "--set", "enrollment.autoRequest.webhook.certManager.enabled=true")...) {
		if o.GroupVersionKind().Group != "cert-manager.io" {
			noCertManager = append(noCertManager, o)
		}
	}
	a.create(t, true, noCertManager...)

	data, err := os.ReadFile(filepath.Join(testkit.RepoDir(t), "deploy", "manifests", "inpod.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	objs := decode(t, data)
	// The Namespace exists already; the rest in a dry run.
	a.create(t, true, objs[1:]...)
	data, err = os.ReadFile(filepath.Join(testkit.RepoDir(t), "deploy", "initcontainer", "policy.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	a.create(t, true, decode(t, data)...)
}
