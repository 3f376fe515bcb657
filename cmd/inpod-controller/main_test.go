package main

import (
	"context"
	"crypto/tls"
	"flag"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/client-go/kubernetes/scheme"

	"github.com/inpod-dev/inpod/internal/envflag"
	"github.com/inpod-dev/inpod/internal/requestcases"
	"github.com/inpod-dev/inpod/internal/testkit"
	"github.com/inpod-dev/inpod/requestwebhook"
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

// blocker stands for the taint controller: it runs until its context ends.
type blocker struct{ ctx chan context.Context }

func (b blocker) Run(ctx context.Context) error {
	b.ctx <- ctx
	<-ctx.Done()
	return nil
}

// A webhook without its certificate (the Secret not yet issued, or gone)
// must not stop the taint controller in the same process: nodes would stay
// tainted for a webhook problem. It serves once the files appear.
func TestWebhookWithoutCertificateKeepsControllerRunning(t *testing.T) {
	dir := t.TempDir()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	w, err := requestwebhook.New(requestwebhook.Config{Client: fake.NewClientset(), Addr: addr, CertDir: dir})
	if err != nil {
		t.Fatal(err)
	}
	ctrl := blocker{ctx: make(chan context.Context, 1)}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- runWithWebhook(ctx, ctrl, w, slog.New(slog.DiscardHandler)) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	})
	cctx := <-ctrl.ctx
	handshake := func() error {
		c, err := tls.DialWithDialer(&net.Dialer{Timeout: time.Second}, "tcp", addr, &tls.Config{InsecureSkipVerify: true})
		if err == nil {
			c.Close()
		}
		return err
	}
	var herr error
	testkit.Eventually(t, 10*time.Second, "the webhook listening, or the controller stopped", func() bool {
		if cctx.Err() != nil {
			return true
		}
		c, err := net.DialTimeout("tcp", addr, time.Second)
		if err != nil {
			return false
		}
		c.Close()
		herr = handshake()
		return true
	})
	if cctx.Err() != nil {
		t.Fatal("the taint controller was stopped by a webhook without its certificate")
	}
	if herr == nil {
		t.Fatal("TLS handshake succeeded without a certificate")
	}
	requestcases.WriteServingCert(t, dir, 1)
	testkit.Eventually(t, 10*time.Second, "a TLS handshake once the certificate appears", func() bool { return handshake() == nil })
	if cctx.Err() != nil {
		t.Fatal("the taint controller stopped")
	}
}

// The webhook's readiness gate and request switches, as the chart passes
// them, and from their INPOD_ variables.
func TestWebhookSwitches(t *testing.T) {
	parse := func(args ...string) *options {
		t.Helper()
		fs := flag.NewFlagSet("inpod-controller", flag.ContinueOnError)
		o := define(fs)
		if err := envflag.Parse(fs, "test", args); err != nil {
			t.Fatal(err)
		}
		return o
	}
	if o := parse(); o.webhook.ReadinessGate || !*o.resourceRequest {
		t.Errorf("defaults: readiness gate %t, request %t; want off, on (the binary alone behaves as before)", o.webhook.ReadinessGate, *o.resourceRequest)
	}
	if o := parse("--readiness-gate=true", "--resource-request=false"); !o.webhook.ReadinessGate || *o.resourceRequest {
		t.Errorf("flags: readiness gate %t, request %t", o.webhook.ReadinessGate, *o.resourceRequest)
	}
	t.Setenv("INPOD_READINESS_GATE", "true")
	t.Setenv("INPOD_RESOURCE_REQUEST", "false")
	if o := parse(); !o.webhook.ReadinessGate || *o.resourceRequest {
		t.Errorf("INPOD_READINESS_GATE, INPOD_RESOURCE_REQUEST: readiness gate %t, request %t", o.webhook.ReadinessGate, *o.resourceRequest)
	}
}

// --previous-taints as the chart passes it (an entry per earlier taint,
// key:effect from the deployed Deployment, a key alone from
// controller.taint.previousKeys), and from INPOD_PREVIOUS_TAINTS.
func TestPreviousTaints(t *testing.T) {
	parse := func(args ...string) []corev1.Taint {
		t.Helper()
		fs := flag.NewFlagSet("inpod-controller", flag.ContinueOnError)
		o := define(fs)
		if err := envflag.Parse(fs, "test", args); err != nil {
			t.Fatal(err)
		}
		return parsePreviousTaints(*o.previousTaints)
	}
	if got := parse(); got != nil {
		t.Errorf("default: %+v, want none", got)
	}
	want := []corev1.Taint{{Key: "inpod.dev/not-ready", Effect: corev1.TaintEffectNoSchedule}, {Key: "example.com/old"}}
	if got := parse("--previous-taints=inpod.dev/not-ready:NoSchedule, example.com/old,"); !slices.Equal(got, want) {
		t.Errorf("flag: %+v, want %+v", got, want)
	}
	t.Setenv("INPOD_PREVIOUS_TAINTS", "inpod.dev/not-ready:NoSchedule,example.com/old")
	if got := parse(); !slices.Equal(got, want) {
		t.Errorf("INPOD_PREVIOUS_TAINTS: %+v, want %+v", got, want)
	}
}
