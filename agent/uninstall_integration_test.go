//go:build integration

package agent_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	authnv1 "k8s.io/api/authentication/v1"
	authzv1 "k8s.io/api/authorization/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"github.com/inpod-dev/inpod/agent"
	"github.com/inpod-dev/inpod/apiaccess"
	"github.com/inpod-dev/inpod/e2e/cluster/clustertest"
	"github.com/inpod-dev/inpod/internal/testkit"
	"github.com/inpod-dev/inpod/netns/netnstest"
	"github.com/inpod-dev/inpod/plugin/apicheck"
)

// agentNS is the namespace of deploy/rbac.
const agentNS = "inpod-system"

// agentLabels are what the chart puts on agent pods (agent.DefaultAgentSelector).
var agentLabels = map[string]string{"app.kubernetes.io/name": "inpod", "app.kubernetes.io/component": "agent"}

// applyRBAC creates the objects of deploy/rbac/*.yaml exactly as shipped.
func (w *world) applyRBAC() {
	w.t.Helper()
	clustertest.ApplyShippedRBAC(w.t, w.client)
}

// agentDaemonSet creates an agent DaemonSet and the pod its controller would
// put on this node (there is no controller-manager in this tier).
func (w *world) agentDaemonSet(name string) (*appsv1.DaemonSet, *corev1.Pod) {
	w.t.Helper()
	ctx := context.Background()
	ds, err := w.client.AppsV1().DaemonSets(agentNS).Create(ctx, &appsv1.DaemonSet{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: appsv1.DaemonSetSpec{
			Selector: &metav1.LabelSelector{MatchLabels: map[string]string{"daemonset": name}},
			Template: corev1.PodTemplateSpec{ObjectMeta: metav1.ObjectMeta{Labels: withLabel(agentLabels, "daemonset", name)},
				Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "agent", Image: "inpod-agent"}}}},
		},
	}, metav1.CreateOptions{})
	if err != nil {
		w.t.Fatal(err)
	}
	return ds, w.agentPod(ds, nodeName)
}

// agentPod is the pod of ds on node, as its controller creates it.
func (w *world) agentPod(ds *appsv1.DaemonSet, node string) *corev1.Pod {
	w.t.Helper()
	return w.agentPodLabelled(ds, node, ds.Spec.Template.Labels)
}

// agentPodLabelled is agentPod with the labels the controller gave it.
func (w *world) agentPodLabelled(ds *appsv1.DaemonSet, node string, labels map[string]string) *corev1.Pod {
	w.t.Helper()
	yes := true
	pod, err := w.client.CoreV1().Pods(agentNS).Create(context.Background(), &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{GenerateName: ds.Name + "-", Labels: labels,
			OwnerReferences: []metav1.OwnerReference{{APIVersion: "apps/v1", Kind: "DaemonSet", Name: ds.Name, UID: ds.UID, Controller: &yes}}},
		Spec: corev1.PodSpec{NodeName: node, HostNetwork: true, ServiceAccountName: "inpod-agent",
			Containers: []corev1.Container{{Name: "agent", Image: "inpod-agent"}}},
	}, metav1.CreateOptions{})
	if err != nil {
		w.t.Fatal(err)
	}
	return pod
}

func withLabel(m map[string]string, k, v string) map[string]string {
	out := map[string]string{k: v}
	for mk, mv := range m {
		out[mk] = mv
	}
	return out
}

// runAs makes the next agent run as pod: its downward-API identity, and the
// kubelet's projected token of the inpod-agent ServiceAccount, bound to the
// pod, so the agent has exactly deploy/rbac's rights. It returns the token.
func (w *world) runAs(pod *corev1.Pod) string {
	w.t.Helper()
	exp := int64(3600)
	tr, err := w.client.CoreV1().ServiceAccounts(agentNS).CreateToken(context.Background(), "inpod-agent", &authnv1.TokenRequest{Spec: authnv1.TokenRequestSpec{
		ExpirationSeconds: &exp,
		BoundObjectRef:    &authnv1.BoundObjectReference{Kind: "Pod", APIVersion: "v1", Name: pod.Name, UID: pod.UID},
	}}, metav1.CreateOptions{})
	if err != nil {
		w.t.Fatal(err)
	}
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["it"] = &clientcmdapi.Cluster{Server: w.cp.Server(), CertificateAuthorityData: w.cp.Rest.TLSClientConfig.CAData}
	cfg.AuthInfos["agent"] = &clientcmdapi.AuthInfo{Token: tr.Status.Token}
	cfg.Contexts["it"] = &clientcmdapi.Context{Cluster: "it", AuthInfo: "agent"}
	cfg.CurrentContext = "it"
	path := filepath.Join(w.t.TempDir(), pod.Name+".kubeconfig")
	if err := clientcmd.WriteToFile(*cfg, path); err != nil {
		w.t.Fatal(err)
	}
	w.cfg.Kubeconfig, w.cfg.PodName, w.cfg.PodNamespace = path, pod.Name, pod.Namespace
	return tr.Status.Token
}

// terminate starts a graceful deletion of pod, as the garbage collector does
// for the pods of a deleted DaemonSet; with no kubelet it stays terminating.
func (w *world) terminate(pod *corev1.Pod) {
	w.t.Helper()
	if err := w.client.CoreV1().Pods(pod.Namespace).Delete(context.Background(), pod.Name, metav1.DeleteOptions{}); err != nil {
		w.t.Fatal(err)
	}
}

func (w *world) deleteDaemonSet(ds *appsv1.DaemonSet) {
	w.t.Helper()
	if err := w.client.AppsV1().DaemonSets(ds.Namespace).Delete(context.Background(), ds.Name, metav1.DeleteOptions{}); err != nil {
		w.t.Fatal(err)
	}
}

func (w *world) pluginInstalled() bool {
	_, err := os.Stat(filepath.Join(w.binDir, "inpod-cni"))
	return testkit.RuntimeChainEndsWith(w.confDir, "inpod-cni") && err == nil
}

// enrolledPod is an enrolled pod with rules in its sandbox.
func (w *world) enrolledPod(name string) (*corev1.Pod, *netnstest.NetNS) {
	w.t.Helper()
	pod, sandbox := w.pod("mesh", name)
	if _, err := w.cniAdd(pod, sandbox); err != nil {
		w.t.Fatal(err)
	}
	return pod, sandbox
}

// An agent stopping while its DaemonSet exists is restarting or being
// upgraded: the plugin, its configuration and every pod's rules stay, so
// enrolled pods fail closed until it is back.
func TestIntegrationShutdownWithItsDaemonSetLeavesEverything(t *testing.T) {
	w := newWorld(t)
	w.applyRBAC()
	_, self := w.agentDaemonSet("inpod-agent")
	w.runAs(self)
	stop := w.runAgent()
	_, sandbox := w.enrolledPod("a")
	w.terminate(self) // a rolling update replaces the pod
	if err := stop(); err != nil {
		t.Fatalf("agent: %v", err)
	}
	if !w.pluginInstalled() {
		t.Fatal("an upgrade took the plugin out of the node")
	}
	if _, err := os.Stat(filepath.Join(w.binDir, "inpod-cni-apicheck")); err != nil {
		t.Fatalf("an upgrade removed inpod-cni-apicheck: %v", err)
	}
	if !hasRules(t, sandbox) {
		t.Fatal("an upgrade took the rules out of a running pod")
	}
	if _, err := os.Stat(filepath.Join(filepath.Dir(w.cfg.CNISocket), "not-enrolled", ".alive")); !os.IsNotExist(err) {
		t.Fatalf("the pass list's heartbeat outlived the agent: %v", err)
	}
	// With the agent away, an enrolled pod fails closed.
	late, lateSandbox := w.pod("mesh", "late")
	if _, err := w.cniAdd(late, lateSandbox); err == nil {
		t.Fatal("an enrolled pod started while the agent was away")
	}
}

// assertRemoved checks that nothing of inpod is left on the node.
func (w *world) assertRemoved(t *testing.T, original []byte, pod *corev1.Pod, sandbox *netnstest.NetNS) {
	t.Helper()
	if conf, _ := os.ReadFile(filepath.Join(w.confDir, "10-podnet.conflist")); string(conf) != string(original) {
		t.Fatalf("CNI configuration after removal:\n%s\nwant the original:\n%s", conf, original)
	}
	for _, f := range []string{filepath.Join(w.binDir, "inpod-cni"), filepath.Join(w.binDir, "inpod-cni-apicheck"), filepath.Join(w.confDir, apiaccess.FileName),
		filepath.Join(w.confDir, agent.DefaultCNIOwnedFile)} {
		if _, err := os.Stat(f); !os.IsNotExist(err) {
			t.Fatalf("%s left on the node: %v", f, err)
		}
	}
	if hasRules(t, sandbox) {
		t.Fatal("a pod kept its rules after inpod was removed")
	}
	if _, ok := w.standin.Workloads()[string(pod.UID)]; ok {
		t.Fatal("ztunnel was not told the pod left")
	}
	if strings.Contains(w.node.Exec(t, "nft", "list", "tables"), "inpod-host") {
		t.Fatal("the host probe table was left")
	}
	if _, err := os.Stat(filepath.Join(filepath.Dir(w.cfg.CNISocket), "not-enrolled")); !os.IsNotExist(err) {
		t.Fatalf("the pass list was left: %v", err)
	}
	// Every pod's rules came out, so no record names a pod with rules.
	if _, err := os.Stat(filepath.Join(filepath.Dir(w.cfg.CNISocket), "enrolled")); !os.IsNotExist(err) {
		t.Fatalf("the record of enrolled pods was left: %v", err)
	}
}

// An agent stopping after its DaemonSet was deleted removes inpod from the
// node: the CNI configuration as it was, no binaries, no rules in any pod,
// ztunnel told, no annotations, no host rules, no pass list.
func TestIntegrationShutdownAfterItsDaemonSetIsDeletedRemovesInpod(t *testing.T) {
	w := newWorld(t)
	original, err := os.ReadFile(filepath.Join(w.confDir, "10-podnet.conflist"))
	if err != nil {
		t.Fatal(err)
	}
	w.applyRBAC()
	ds, self := w.agentDaemonSet("inpod-agent")
	w.runAs(self)
	stop := w.runAgent()
	pod, sandbox := w.enrolledPod("a")
	w.eventually("the access file", func() bool { _, err := apiaccess.Read(filepath.Join(w.confDir, apiaccess.FileName)); return err == nil })
	if _, err := os.Stat(filepath.Join(filepath.Dir(w.cfg.CNISocket), "enrolled", string(pod.UID))); err != nil {
		t.Fatalf("the enrolled pod has no record: %v", err)
	}
	w.deleteDaemonSet(ds)
	w.terminate(self)
	if err := stop(); err != nil {
		t.Fatalf("agent: %v", err)
	}
	w.assertRemoved(t, original, pod, sandbox)
	if got := w.annotation(pod); got != "" {
		t.Fatalf("the pod kept its redirection annotation %q", got)
	}
}

// A node relabelled out of the agent's DaemonSet (its node selector no
// longer matches) loses its agent for good: the DaemonSet is in place, but
// the departing agent removes inpod from the node as an uninstall does —
// its own CNI configuration (owned mode) and the primary's untouched, no
// binaries, no access file, no rules. Left, the plugin would fail every
// non-excluded pod's ADD once its token expired.
func TestIntegrationShutdownAfterTheNodeLeavesItsDaemonSetRemovesInpod(t *testing.T) {
	w := newWorld(t)
	ctx := context.Background()
	original, err := os.ReadFile(filepath.Join(w.confDir, "10-podnet.conflist"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := w.client.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: nodeName,
		Labels: map[string]string{"inpod": "yes"}}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	w.applyRBAC()
	ds, self := w.agentDaemonSet("inpod-agent")
	ds.Spec.Template.Spec.NodeSelector = map[string]string{"inpod": "yes"}
	if _, err := w.client.AppsV1().DaemonSets(agentNS).Update(ctx, ds, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	w.cfg.CNIOwnedFile = agent.DefaultCNIOwnedFile
	w.runAs(self)
	stop := w.runAgent()
	pod, sandbox := w.enrolledPod("a")
	if name, _, err := testkit.RuntimeChain(w.confDir); err != nil || name != agent.DefaultCNIOwnedFile {
		t.Fatalf("the runtime's configuration is %s (%v), want inpod's own", name, err)
	}
	w.eventually("the access file", func() bool { _, err := apiaccess.Read(filepath.Join(w.confDir, apiaccess.FileName)); return err == nil })

	patch := []byte(`{"metadata":{"labels":{"inpod":null}}}`)
	if _, err := w.client.CoreV1().Nodes().Patch(ctx, nodeName, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	w.terminate(self) // the DaemonSet controller deletes its pod
	if err := stop(); err != nil {
		t.Fatalf("agent: %v", err)
	}
	w.assertRemoved(t, original, pod, sandbox)
	if got := w.annotation(pod); got != "" {
		t.Fatalf("the pod kept its redirection annotation %q", got)
	}
}

// helm uninstall deletes the DaemonSet and then, in the same operation, the
// RBAC that let the agent read it; the kubelet's SIGTERM comes after. The
// removal must still happen: the agent learned of the deletion from its
// watch while it still could.
func TestIntegrationUninstallCompletesWhenItsRBACGoesWithTheDaemonSet(t *testing.T) {
	w := newWorld(t)
	original, err := os.ReadFile(filepath.Join(w.confDir, "10-podnet.conflist"))
	if err != nil {
		t.Fatal(err)
	}
	w.applyRBAC()
	ds, self := w.agentDaemonSet("inpod-agent")
	token := w.runAs(self)
	stop := w.runAgent()
	pod, sandbox := w.enrolledPod("a")
	ctx := context.Background()
	w.deleteDaemonSet(ds)
	for _, name := range []string{"inpod-agent", "inpod-cni"} {
		if err := w.client.RbacV1().ClusterRoleBindings().Delete(ctx, name, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	if err := w.client.RbacV1().RoleBindings(agentNS).Delete(ctx, "inpod-agent", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	w.terminate(self)
	// What the agent gets at SIGTERM from now on.
	agentClient := w.clientWithToken(token)
	w.eventually("the agent's reads refused", func() bool {
		_, err := agentClient.AppsV1().DaemonSets(agentNS).Get(ctx, ds.Name, metav1.GetOptions{})
		return apierrors.IsForbidden(err)
	})
	// The pods' annotations and the Node's label cannot be removed
	// without the RBAC; the node must be cleared all the same.
	if err := stop(); err != nil && !onlyAPISteps(err) {
		t.Fatalf("agent: %v", err)
	}
	w.assertRemoved(t, original, pod, sandbox)
}

// onlyAPISteps reports whether every line of a removal error is about a
// pod annotation or the Node's label (the steps that need the API server).
func onlyAPISteps(err error) bool {
	for _, line := range strings.Split(err.Error(), "\n") {
		if !strings.HasPrefix(line, "annotate ") && !strings.HasPrefix(line, "label Node ") {
			return false
		}
	}
	return true
}

func (w *world) clientWithToken(token string) kubernetes.Interface {
	w.t.Helper()
	cfg := *w.cp.Rest
	cfg.CertData, cfg.KeyData, cfg.CertFile, cfg.KeyFile, cfg.BearerToken = nil, nil, "", "", token
	c, err := kubernetes.NewForConfig(&cfg)
	if err != nil {
		w.t.Fatal(err)
	}
	return c
}

// A DaemonSet renamed (helm creates the new one, then deletes the old): the
// old agent's shutdown finds its own DaemonSet gone, but the new one's agent
// serves the node, so nothing is removed. "Serves" is modelled by the new
// DaemonSet's pod on this node, which is all the old agent can know: the new
// agent cannot bind the node's ports before the old one exits.
func TestIntegrationRenamedDaemonSetLeavesInpodToItsSuccessor(t *testing.T) {
	w := newWorld(t)
	w.applyRBAC()
	old, self := w.agentDaemonSet("inpod-agent")
	w.runAs(self)
	stop := w.runAgent()
	_, sandbox := w.enrolledPod("a")
	w.agentDaemonSet("inpod-node-agent")
	w.deleteDaemonSet(old)
	w.terminate(self)
	if err := stop(); err != nil {
		t.Fatalf("agent: %v", err)
	}
	if !w.pluginInstalled() || !hasRules(t, sandbox) {
		t.Fatalf("the old agent removed inpod although the renamed DaemonSet serves the node (plugin installed: %v, rules: %v)",
			w.pluginInstalled(), hasRules(t, sandbox))
	}
}

// A second DaemonSet takes the node over: its agent starts as the first
// one's DaemonSet goes. The first must not strip the rules that the second
// restores: the running pod's rules are never touched at all.
func TestIntegrationSecondDaemonSetTakesOverWithoutTouchingRules(t *testing.T) {
	w := newWorld(t)
	w.applyRBAC()
	first, firstPod := w.agentDaemonSet("inpod-agent")
	w.runAs(firstPod)
	stop := w.runAgent()
	pod, sandbox := w.enrolledPod("long-lived")
	w.setRunning(pod, sandboxIP(t, sandbox))
	sandbox.RunAsPod(t, string(pod.UID))
	rulesBefore := sandbox.Exec(t, "nft", "-a", "list", "ruleset")

	_, secondPod := w.agentDaemonSet("inpod-agent-v2")
	w.deleteDaemonSet(first)
	w.terminate(firstPod)
	if err := stop(); err != nil {
		t.Fatalf("first agent: %v", err)
	}
	w.runAs(secondPod)
	w.startInProcessAgent()
	w.eventually("the second agent's snapshot with the pod", func() bool {
		_, ok := w.standin.Workloads()[string(pod.UID)]
		return ok && w.standin.SnapshotDone()
	})
	if after := sandbox.Exec(t, "nft", "-a", "list", "ruleset"); after != rulesBefore {
		t.Fatalf("the hand-over rewrote the pod's rules (the first agent stripped them):\nbefore:\n%s\nafter:\n%s", rulesBefore, after)
	}
	if !w.pluginInstalled() {
		t.Fatal("the plugin is not installed after the hand-over")
	}
}

func sandboxIP(t *testing.T, sandbox *netnstest.NetNS) string {
	t.Helper()
	out := sandbox.Exec(t, "ip", "-4", "-o", "addr", "show", "dev", "eth0")
	f := strings.Fields(out)
	for i, s := range f {
		if s == "inet" && i+1 < len(f) {
			return strings.Split(f[i+1], "/")[0]
		}
	}
	t.Fatalf("no address in the sandbox: %s", out)
	return ""
}

// Nothing the operator types can make a restart look like an uninstall: a
// --pod-name that names no pod, or a pod that is not this agent's (another
// node's, or one the selector does not select), never leads to removal,
// even with every agent DaemonSet deleted.
func TestIntegrationAMistypedOrForeignPodNeverCausesRemoval(t *testing.T) {
	w := newWorld(t)
	w.applyRBAC()
	ds, self := w.agentDaemonSet("inpod-agent")
	foreign := w.agentPod(ds, "other-node")
	_, sandbox := func() (*corev1.Pod, *netnstest.NetNS) {
		w.runAs(self)
		stop := w.runAgent()
		defer stop()
		return w.enrolledPod("a")
	}()
	w.deleteDaemonSet(ds)
	for _, tc := range []struct {
		name     string
		identity func()
	}{
		{"mistyped pod name", func() { w.runAs(self); w.cfg.PodName = "inpod-agnet-x7k2p" }},
		{"another node's agent pod", func() { w.runAs(self); w.cfg.PodName = foreign.Name }},
		{"a selector that does not select the agent", func() { w.runAs(self); w.cfg.AgentSelector = "app=something-else" }},
	} {
		tc.identity()
		stop := w.runAgent()
		if err := stop(); err != nil {
			t.Fatalf("%s: agent: %v", tc.name, err)
		}
		w.cfg.AgentSelector = ""
		if !w.pluginInstalled() || !hasRules(t, sandbox) {
			t.Fatalf("%s: the agent removed inpod (plugin installed: %v, rules: %v)", tc.name, w.pluginInstalled(), hasRules(t, sandbox))
		}
	}
}

// The plugin's agent-down check holds a token of the inpod-cni
// ServiceAccount, requested by the agent (with deploy/rbac's rights only),
// bound to no pod: after the agent's pod is deleted (every rolling update)
// it still works, so a pod outside the mesh still starts while the agent is
// away, and an enrolled one is still recognised and refused.
func TestIntegrationPluginTokenOutlivesTheAgentsPod(t *testing.T) {
	w := newWorld(t)
	w.applyRBAC()
	_, self := w.agentDaemonSet("inpod-agent")
	agentToken := w.runAs(self)
	stop := w.runAgent()
	file := filepath.Join(w.confDir, apiaccess.FileName)
	w.eventually("the access file", func() bool { _, err := apiaccess.Read(file); return err == nil })
	access, _ := apiaccess.Read(file)
	if access.Token == agentToken {
		t.Fatal("the access file holds the agent's own token")
	}
	ctx := context.Background()
	review, err := w.client.AuthenticationV1().TokenReviews().Create(ctx, &authnv1.TokenReview{Spec: authnv1.TokenReviewSpec{Token: access.Token}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if u := review.Status.User; !review.Status.Authenticated || u.Username != "system:serviceaccount:"+agentNS+":inpod-cni" {
		t.Fatalf("the plugin's token authenticates as %+v (%s), want the inpod-cni ServiceAccount", u, review.Status.Error)
	}
	if pod, bound := review.Status.User.Extra["authentication.kubernetes.io/pod-name"]; bound {
		t.Fatalf("the plugin's token is bound to pod %v: it dies with it", pod)
	}
	if left := time.Until(access.Expires); left < 23*time.Hour {
		t.Fatalf("the plugin's token expires in %s", left)
	}
	for _, ra := range []struct {
		attr    authzv1.ResourceAttributes
		allowed bool
	}{
		{authzv1.ResourceAttributes{Verb: "get", Resource: "pods", Namespace: "mesh"}, true},
		{authzv1.ResourceAttributes{Verb: "get", Resource: "namespaces"}, true},
		{authzv1.ResourceAttributes{Verb: "list", Resource: "pods"}, false},
		{authzv1.ResourceAttributes{Verb: "patch", Resource: "pods", Namespace: "mesh"}, false},
		{authzv1.ResourceAttributes{Verb: "get", Resource: "secrets", Namespace: agentNS}, false},
	} {
		sar, err := w.client.AuthorizationV1().SubjectAccessReviews().Create(ctx, &authzv1.SubjectAccessReview{Spec: authzv1.SubjectAccessReviewSpec{
			User: review.Status.User.Username, Groups: review.Status.User.Groups, ResourceAttributes: &ra.attr}}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if sar.Status.Allowed != ra.allowed {
			t.Errorf("the plugin's token may %s %s: %v, want %v", ra.attr.Verb, ra.attr.Resource, sar.Status.Allowed, ra.allowed)
		}
	}

	// A rolling update: the agent's pod is deleted and the agent stops.
	zero := int64(0)
	if err := w.client.CoreV1().Pods(agentNS).Delete(ctx, self.Name, metav1.DeleteOptions{GracePeriodSeconds: &zero}); err != nil {
		t.Fatal(err)
	}
	if err := stop(); err != nil {
		t.Fatalf("agent: %v", err)
	}
	// The check as the plugin runs it, with the file the agent left (run
	// here, not through the chain: the node netns of this tier cannot reach
	// the apiserver on the host's loopback). A pod outside the mesh is told
	// apart from an enrolled one, so it is not blocked.
	check := func(ns, name string) (apicheck.Verdict, error) {
		var stdout, stderr bytes.Buffer
		cmd := exec.Command(filepath.Join(w.binDir, "inpod-cni-apicheck"), "--access", file, "--namespace", ns, "--name", name)
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		var v apicheck.Verdict
		if err := cmd.Run(); err != nil {
			return v, fmt.Errorf("%v: %s", err, stderr.String())
		}
		return v, json.Unmarshal(stdout.Bytes(), &v)
	}
	w.pod("mesh", "late")
	w.pod("plain", "outside")
	if v, err := check("mesh", "late"); err != nil || !v.Enrolled {
		t.Fatalf("the agent-down check of an enrolled pod after the agent's pod was deleted: %+v, %v", v, err)
	}
	if v, err := check("plain", "outside"); err != nil || v.Enrolled {
		t.Fatalf("the agent-down check of a pod outside the mesh after the agent's pod was deleted: %+v, %v", v, err)
	}
}
