//go:build e2e

package e2e

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/inpod-dev/inpod/agent"
	"github.com/inpod-dev/inpod/agent/enroll"
	"github.com/inpod-dev/inpod/e2e/cluster"
	"github.com/inpod-dev/inpod/e2e/cluster/clustertest"
	"github.com/inpod-dev/inpod/e2e/images"
	"github.com/inpod-dev/inpod/enrollment"
	"github.com/inpod-dev/inpod/internal/testkit"
	ztunnel "github.com/inpod-dev/inpod/zds/zdstest"
)

// TestE2EStaticPods runs static pods (manifests in the kubelet's
// staticPodPath) on the real node with the agent and the ztunnel stand-in:
// the runtime names their sandboxes by the manifest's hash, not by their
// mirror pods' API UIDs. One in a namespace enrolled by label must run
// redirected, one in a plain namespace must run and not be redirected.
func TestE2EStaticPods(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	manifests := testkit.ShortTempDir(t, "inpod-static-")
	node := clustertest.Node(ctx, t, cluster.NodeConfig{Config: cluster.Config{Root: "/var/lib/inpod-e2e-static"},
		RepoDir: testkit.RepoDir(t), StaticPodPath: manifests})
	client := node.Client
	for name, labels := range map[string]map[string]string{
		"mesh":  {enrollment.DataplaneModeLabel: enrollment.DataplaneAmbient},
		"plain": nil,
	} {
		ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: labels}}
		if _, err := client.CoreV1().Namespaces().Create(ctx, ns, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}

	a, zdsSocket := runHostAgent(ctx, t, node, func(c *agent.Config) { c.Gate = "none" })
	z := ztunnel.New(ztunnel.Config{SocketPath: zdsSocket, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	zctx, zcancel := context.WithCancel(ctx)
	zdone := make(chan struct{})
	go func() { z.Run(zctx); close(zdone) }()
	t.Cleanup(func() { zcancel(); <-zdone })
	testkit.Eventually(t, 60*time.Second, "the agent ready", func() bool { return a.Ready.State().Ready })

	// Static pods are not deleted through the API (the kubelet recreates
	// their mirrors): their manifests go first, and the test waits for the
	// kubelet to have torn them down, so the node stops clean.
	mirrors := map[string]string{} // namespace → mirror pod name
	t.Cleanup(func() {
		os.RemoveAll(manifests)
		os.Mkdir(manifests, 0o755)
		for ns, name := range mirrors {
			testkit.Eventually(t, 2*time.Minute, "static pod "+ns+"/"+name+" removed", func() bool {
				_, err := client.CoreV1().Pods(ns).Get(context.Background(), name, metav1.GetOptions{})
				return apierrors.IsNotFound(err)
			})
		}
	})
	for _, ns := range []string{"mesh", "plain"} {
		pod := corev1.Pod{
			TypeMeta:   metav1.TypeMeta{APIVersion: "v1", Kind: "Pod"},
			ObjectMeta: metav1.ObjectMeta{Name: "static", Namespace: ns},
			Spec: corev1.PodSpec{
				TerminationGracePeriodSeconds: new(int64),
				Containers:                    []corev1.Container{{Name: "app", Image: images.TestAppRef, ImagePullPolicy: corev1.PullNever}},
			},
		}
		b, err := json.Marshal(pod)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(manifests, ns+".json"), b, 0o644); err != nil {
			t.Fatal(err)
		}
		mirrors[ns] = "static-" + node.Name
	}

	running := func(ns string) *corev1.Pod {
		var p *corev1.Pod
		testkit.Eventually(t, 3*time.Minute, "static pod in "+ns+" Running", func() bool {
			got, err := client.CoreV1().Pods(ns).Get(ctx, mirrors[ns], metav1.GetOptions{})
			if err != nil || got.Status.Phase != corev1.PodRunning {
				return false
			}
			p = got
			return true
		})
		if hash := p.Annotations[enroll.MirrorAnnotation]; hash == "" || hash == string(p.UID) {
			t.Fatalf("pod %s/%s is not a mirror pod whose runtime UID differs from its API UID: annotations %v", ns, p.Name, p.Annotations)
		}
		return p
	}
	mesh := running("mesh")
	plain := running("plain")

	workloads := z.Workloads()
	if w, ok := workloads[string(mesh.UID)]; !ok || w.Namespace != "mesh" {
		t.Errorf("the enrolled static pod runs but ztunnel was not handed it (stand-in has %v)", workloads)
	}
	testkit.Eventually(t, 30*time.Second, "the enrolled static pod's redirection annotation", func() bool {
		p, err := client.CoreV1().Pods("mesh").Get(ctx, mesh.Name, metav1.GetOptions{})
		return err == nil && p.Annotations[enrollment.RedirectionAnnotation] == enrollment.AnnotationEnabled
	})
	if _, ok := workloads[string(plain.UID)]; ok {
		t.Errorf("the static pod in a plain namespace was handed to ztunnel")
	}
	if v, ok := plain.Annotations[enrollment.RedirectionAnnotation]; ok {
		t.Errorf("the static pod in a plain namespace has %s=%s", enrollment.RedirectionAnnotation, v)
	}
}
