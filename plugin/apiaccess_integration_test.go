//go:build integration

package plugin_test

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	authv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/containernetworking/cni/pkg/skel"

	"github.com/inpod-dev/inpod/e2e/cluster"
	"github.com/inpod-dev/inpod/plugin"
)

// The plugin's agent-down fallback against a real kube-apiserver, with a
// service-account token that may only read pods and namespaces.
func TestIntegrationAgentDownDecidesWithTheRealAPIServer(t *testing.T) {
	ctx := context.Background()
	cp, err := cluster.StartControlPlane(ctx, cluster.Config{Root: filepath.Join(t.TempDir(), "cp")})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cp.Stop() })
	c := cp.Client
	for name, labels := range map[string]map[string]string{"mesh": {plugin.DataplaneModeLabel: plugin.DataplaneAmbient}, "plain": nil} {
		if _, err := c.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: labels}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "app"}, Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "c", Image: "x"}}}}
		if _, err := c.CoreV1().Pods(name).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	// Least privilege: get pods and namespaces, nothing else.
	sa, err := c.CoreV1().ServiceAccounts("default").Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "inpod-cni"}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	c.RbacV1().ClusterRoles().Create(ctx, &rbacv1.ClusterRole{ObjectMeta: metav1.ObjectMeta{Name: "inpod-cni"},
		Rules: []rbacv1.PolicyRule{{APIGroups: []string{""}, Resources: []string{"pods", "namespaces"}, Verbs: []string{"get"}}}}, metav1.CreateOptions{})
	c.RbacV1().ClusterRoleBindings().Create(ctx, &rbacv1.ClusterRoleBinding{ObjectMeta: metav1.ObjectMeta{Name: "inpod-cni"},
		RoleRef:  rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "ClusterRole", Name: "inpod-cni"},
		Subjects: []rbacv1.Subject{{Kind: "ServiceAccount", Name: sa.Name, Namespace: "default"}}}, metav1.CreateOptions{})
	tok, err := c.CoreV1().ServiceAccounts("default").CreateToken(ctx, sa.Name, &authv1.TokenRequest{}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	ca, err := os.ReadFile(cp.Rest.TLSClientConfig.CAFile)
	if err != nil {
		t.Fatal(err)
	}
	access := filepath.Join(t.TempDir(), "api-access.json")
	data, _ := json.Marshal(plugin.APIAccess{Server: cp.Server(), CAData: ca, Token: tok.Status.Token})
	os.WriteFile(access, data, 0o600)

	prev := `{"cniVersion":"1.0.0","ips":[{"address":"198.51.100.7/24"}]}`
	add := func(ns string) error {
		conf := `{"cniVersion":"1.0.0","name":"n","type":"inpod-cni","agentSocket":"/nonexistent/cni.sock","apiAccess":"` + access + `","prevResult":` + prev + `}`
		return plugin.New().Add(&skel.CmdArgs{ContainerID: "c", Netns: "/var/run/netns/x", IfName: "eth0",
			Args: "K8S_POD_NAMESPACE=" + ns + ";K8S_POD_NAME=app", StdinData: []byte(conf)})
	}
	if err := add("mesh"); err == nil || !strings.Contains(err.Error(), "mesh/app is enrolled in the mesh (namespace label") {
		t.Fatalf("enrolled pod with the agent down: %v", err)
	}
	if err := add("plain"); err != nil {
		t.Fatalf("pod that is not enrolled, agent down: %v", err)
	}
}
