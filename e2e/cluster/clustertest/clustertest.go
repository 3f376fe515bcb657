// Package clustertest starts the real cluster pieces of e2e/cluster for a
// test and stops them when the test ends, failed or not: the one place the
// integration and e2e tiers get their API server or node from.
package clustertest

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"

	"github.com/inpod-dev/inpod/e2e/cluster"
	"github.com/inpod-dev/inpod/internal/testkit"
)

// ControlPlane starts etcd and kube-apiserver under the test's temporary
// directory (cfg.Root empty) and stops them at the test's end.
func ControlPlane(t testing.TB, cfg cluster.Config) *cluster.ControlPlane {
	t.Helper()
	if cfg.Root == "" {
		cfg.Root = filepath.Join(t.TempDir(), "cp")
	}
	cp, err := cluster.StartControlPlane(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cp.Stop() })
	return cp
}

// Node starts a full single node (control plane, containerd, kubelet) and
// stops it at the test's end, reporting a failed stop as a test error.
func Node(ctx context.Context, t testing.TB, cfg cluster.NodeConfig) *cluster.Node {
	t.Helper()
	node, err := cluster.StartNode(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := node.Stop(); err != nil {
			t.Error(err)
		}
	})
	return node
}

// AgentNamespace is the namespace deploy/rbac binds the agent's and the
// plugin's ServiceAccounts in.
const AgentNamespace = "inpod-system"

// ApplyShippedRBAC creates AgentNamespace and every object of
// deploy/rbac/*.yaml exactly as shipped (rendered from the chart with every
// gate on), so a test's agent has the rights a real install gives it and
// no more.
func ApplyShippedRBAC(t testing.TB, c kubernetes.Interface) {
	t.Helper()
	ctx := context.Background()
	if _, err := c.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: AgentNamespace}}, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	files, _ := filepath.Glob(filepath.Join(testkit.RepoDir(t), "deploy", "rbac", "*.yaml"))
	if len(files) == 0 {
		t.Fatal("no deploy/rbac/*.yaml")
	}
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, doc := range strings.Split(string(data), "\n---\n") {
			obj, _, err := scheme.Codecs.UniversalDeserializer().Decode([]byte(doc), nil, nil)
			if err != nil {
				t.Fatalf("%s: %v", f, err)
			}
			if err := create(ctx, c, obj); err != nil {
				t.Fatalf("%s: %v", f, err)
			}
		}
	}
}

func create(ctx context.Context, c kubernetes.Interface, obj runtime.Object) error {
	var err error
	switch o := obj.(type) {
	case *corev1.ServiceAccount:
		_, err = c.CoreV1().ServiceAccounts(o.Namespace).Create(ctx, o, metav1.CreateOptions{})
	case *rbacv1.ClusterRole:
		_, err = c.RbacV1().ClusterRoles().Create(ctx, o, metav1.CreateOptions{})
	case *rbacv1.ClusterRoleBinding:
		_, err = c.RbacV1().ClusterRoleBindings().Create(ctx, o, metav1.CreateOptions{})
	case *rbacv1.Role:
		_, err = c.RbacV1().Roles(o.Namespace).Create(ctx, o, metav1.CreateOptions{})
	case *rbacv1.RoleBinding:
		_, err = c.RbacV1().RoleBindings(o.Namespace).Create(ctx, o, metav1.CreateOptions{})
	default:
		return fmt.Errorf("unexpected object %T", obj)
	}
	return err
}
