package main

import (
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	"k8s.io/client-go/kubernetes/scheme"

	"github.com/inpod-dev/inpod/internal/envflag"
	"github.com/inpod-dev/inpod/internal/testkit"
)

// The shipped Deployment may only use flags and INPOD_* variables the
// binary has: a typo would make the controller exit at start or silently
// run with a default.
func TestDeploymentUsesKnownFlags(t *testing.T) {
	data, err := os.ReadFile(filepath.Join(testkit.RepoDir(t), "deploy", "controller", "deployment.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	obj, _, err := scheme.Codecs.UniversalDeserializer().Decode(data, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	d := obj.(*appsv1.Deployment)
	known := map[string]bool{}
	fs := flag.NewFlagSet("inpod-controller", flag.ContinueOnError)
	define(fs)
	fs.VisitAll(func(f *flag.Flag) { known[f.Name] = true })
	c := d.Spec.Template.Spec.Containers[0]
	for _, a := range c.Args {
		name, _, _ := strings.Cut(strings.TrimPrefix(a, "--"), "=")
		if !known[name] {
			t.Errorf("deployment.yaml passes unknown flag %q", a)
		}
	}
	for _, e := range c.Env {
		ok := false
		for name := range known {
			ok = ok || envflag.EnvName(name) == e.Name
		}
		if !ok {
			t.Errorf("deployment.yaml sets %s, which no flag reads", e.Name)
		}
	}
	if *d.Spec.Replicas != 2 {
		t.Errorf("replicas %d, want 2", *d.Spec.Replicas)
	}
}
