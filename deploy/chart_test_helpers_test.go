//go:build integration

// Package deploy_test checks the chart against a real kube-apiserver.
package deploy_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/discovery/cached/memory"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/restmapper"

	"github.com/inpod-dev/inpod/e2e/cluster"
	"github.com/inpod-dev/inpod/e2e/cluster/clustertest"
	"github.com/inpod-dev/inpod/internal/testkit"
)

const namespace = "inpod-system"

// render runs helm template on the chart (helm as make deps installs it)
// and returns the objects.
func render(t testing.TB, args ...string) []*unstructured.Unstructured {
	t.Helper()
	repo := testkit.RepoDir(t)
	helm := filepath.Join(repo, "bin", "helm")
	if _, err := os.Stat(helm); err != nil {
		t.Fatalf("no %s: run make deps", helm)
	}
	cmd := exec.Command(helm, append([]string{"template", "inpod", filepath.Join(repo, "deploy", "helm", "inpod"), "-n", namespace}, args...)...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("helm template %v: %v: %s", args, err, stderr.String())
	}
	return decode(t, out)
}

func decode(t testing.TB, data []byte) []*unstructured.Unstructured {
	t.Helper()
	var objs []*unstructured.Unstructured
	dec := yaml.NewYAMLOrJSONDecoder(bytes.NewReader(data), 4096)
	for {
		var m map[string]any
		if err := dec.Decode(&m); errors.Is(err, io.EOF) {
			return objs
		} else if err != nil {
			t.Fatal(err)
		}
		if m == nil {
			continue
		}
		objs = append(objs, &unstructured.Unstructured{Object: m})
	}
}

// apiserver is a real etcd + kube-apiserver with the chart's namespace.
type apiserver struct {
	*cluster.ControlPlane
	dyn    dynamic.Interface
	mapper meta.RESTMapper
}

func startAPIServer(t testing.TB) *apiserver {
	t.Helper()
	cp := clustertest.ControlPlane(t, cluster.Config{})
	dyn, err := dynamic.NewForConfig(cp.Rest)
	if err != nil {
		t.Fatal(err)
	}
	a := &apiserver{ControlPlane: cp, dyn: dyn,
		mapper: restmapper.NewDeferredDiscoveryRESTMapper(memory.NewMemCacheClient(cp.Client.Discovery()))}
	a.create(t, false, decode(t, []byte("apiVersion: v1\nkind: Namespace\nmetadata: {name: "+namespace+"}\n"))...)
	return a
}

// create creates objs, or with dryRun has the API server validate and
// admit them without storing them (server-side dry run).
func (a *apiserver) create(t testing.TB, dryRun bool, objs ...*unstructured.Unstructured) {
	t.Helper()
	opts := metav1.CreateOptions{FieldValidation: "Strict"}
	if dryRun {
		opts.DryRun = []string{metav1.DryRunAll}
	}
	for _, o := range objs {
		gvk := o.GroupVersionKind()
		m, err := a.mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
		if err != nil {
			t.Fatalf("%s %s: the API server does not serve it: %v", gvk, o.GetName(), err)
		}
		var ri dynamic.ResourceInterface = a.dyn.Resource(m.Resource)
		if m.Scope.Name() == meta.RESTScopeNameNamespace {
			ri = a.dyn.Resource(m.Resource).Namespace(o.GetNamespace())
		}
		if _, err := ri.Create(context.Background(), o, opts); err != nil {
			t.Fatalf("%s %s/%s refused: %v", gvk.Kind, o.GetNamespace(), o.GetName(), err)
		}
	}
}
