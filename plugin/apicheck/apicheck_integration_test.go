//go:build integration

package apicheck_test

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	authv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/inpod-dev/inpod/apiaccess"
	"github.com/inpod-dev/inpod/e2e/cluster"
	"github.com/inpod-dev/inpod/e2e/cluster/clustertest"
	"github.com/inpod-dev/inpod/plugin/apicheck"
	"github.com/inpod-dev/inpod/plugin/plugintest"
)

// inpod-cni-apicheck, as the plugin runs it, against a real kube-apiserver
// with a service-account token that may only get pods and namespaces.
func TestIntegrationAPICheckWithTheRealAPIServer(t *testing.T) {
	ctx := context.Background()
	cp := clustertest.ControlPlane(t, cluster.Config{})
	bin := t.TempDir()
	if err := plugintest.Build(bin); err != nil {
		t.Fatal(err)
	}
	c := cp.Client
	for name, labels := range map[string]map[string]string{"mesh": {apicheck.DataplaneModeLabel: apicheck.DataplaneAmbient}, "plain": nil} {
		if _, err := c.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: labels}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "app"}, Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "c", Image: "x"}}}}
		if _, err := c.CoreV1().Pods(name).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	token := func(sa string, rules []rbacv1.PolicyRule) string {
		if _, err := c.CoreV1().ServiceAccounts("default").Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: sa}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		if rules != nil {
			c.RbacV1().ClusterRoles().Create(ctx, &rbacv1.ClusterRole{ObjectMeta: metav1.ObjectMeta{Name: sa}, Rules: rules}, metav1.CreateOptions{})
			c.RbacV1().ClusterRoleBindings().Create(ctx, &rbacv1.ClusterRoleBinding{ObjectMeta: metav1.ObjectMeta{Name: sa},
				RoleRef:  rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "ClusterRole", Name: sa},
				Subjects: []rbacv1.Subject{{Kind: "ServiceAccount", Name: sa, Namespace: "default"}}}, metav1.CreateOptions{})
		}
		tok, err := c.CoreV1().ServiceAccounts("default").CreateToken(ctx, sa, &authv1.TokenRequest{}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return tok.Status.Token
	}
	ca := cp.Rest.TLSClientConfig.CAData
	accessFile := func(tok string) string {
		path := filepath.Join(t.TempDir(), apiaccess.FileName)
		data, _ := json.Marshal(apiaccess.Access{Server: cp.Server(), CAData: ca, Token: tok})
		os.WriteFile(path, data, 0o600)
		return path
	}
	run := func(access, ns string) (apicheck.Verdict, string, error) {
		var stdout, stderr bytes.Buffer
		cmd := exec.Command(filepath.Join(bin, "inpod-cni-apicheck"), "--access", access, "--namespace", ns, "--name", "app")
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		err := cmd.Run()
		var v apicheck.Verdict
		if err == nil {
			err = json.Unmarshal(stdout.Bytes(), &v)
		}
		return v, stderr.String(), err
	}

	// Least privilege: get pods and namespaces, nothing else.
	leastPrivilege := accessFile(token("inpod-cni", []rbacv1.PolicyRule{{APIGroups: []string{""}, Resources: []string{"pods", "namespaces"}, Verbs: []string{"get"}}}))
	if v, stderr, err := run(leastPrivilege, "mesh"); err != nil || !v.Enrolled || !strings.Contains(v.Reason, "namespace label") {
		t.Errorf("pod in an ambient namespace: %+v, %v: %s", v, err, stderr)
	}
	if v, stderr, err := run(leastPrivilege, "plain"); err != nil || v.Enrolled {
		t.Errorf("pod in a plain namespace: %+v, %v: %s", v, err, stderr)
	}
	// A token without those rights is an error naming the refusal.
	noRights := accessFile(token("no-rights", nil))
	if _, stderr, err := run(noRights, "plain"); err == nil || !strings.Contains(stderr, "403") || !strings.Contains(stderr, "forbidden") {
		t.Errorf("token without rights: %v: %s", err, stderr)
	}
}
