package dra

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"testing"

	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"

	"github.com/inpod-dev/inpod/readiness"
)

// Each failing condition is one taint key naming it; ready is none.
func TestTaintKeysNameTheFailingConditions(t *testing.T) {
	for _, tc := range []struct {
		st   readiness.State
		want []string
	}{
		{readiness.State{Ready: true}, nil},
		{readiness.State{Failing: []string{"ztunnel-connected: no ztunnel (0 connections)"}}, []string{TaintKeyPrefix + "ztunnel-not-connected"}},
		{readiness.State{Failing: []string{"pods-synced: not checked yet", "cni-installed: conflist rewritten"}},
			[]string{TaintKeyPrefix + "cni-not-installed", TaintKeyPrefix + "pods-not-synced"}},
		{readiness.State{Failing: []string{"something-new: x"}}, []string{TaintKeyPrefix + "not-ready"}},
		{readiness.State{}, []string{TaintKeyPrefix + "not-ready"}},
	} {
		if got := TaintKeys(tc.st); !slices.Equal(got, tc.want) {
			t.Errorf("TaintKeys(%+v) = %v, want %v", tc.st, got, tc.want)
		}
	}
}

// The published device: shared by every pod, NoSchedule taints only.
func TestResourcesPublishOneSharedDevice(t *testing.T) {
	r := Resources("n", []string{TaintKeyPrefix + "not-ready"})
	pool, ok := r.Pools["n"]
	if !ok || len(r.Pools) != 1 || len(pool.Slices) != 1 || len(pool.Slices[0].Devices) != 1 {
		t.Fatalf("resources %+v: want one pool named after the node with one device", r)
	}
	dev := pool.Slices[0].Devices[0]
	if dev.AllowMultipleAllocations == nil || !*dev.AllowMultipleAllocations {
		t.Fatal("the device is not shareable")
	}
	if len(dev.Taints) != 1 || dev.Taints[0].Effect != "NoSchedule" {
		t.Fatalf("taints %+v: want one NoSchedule", dev.Taints)
	}
}

// TestCheckpointFailuresAreNotFatal: the record of prepared claims is
// bookkeeping; an unreadable or unwritable one (here: a directory where the
// file should be) must neither stop the gate nor fail a prepare on a ready
// node.
func TestCheckpointFailuresAreNotFatal(t *testing.T) {
	dir := t.TempDir()
	if err := os.Mkdir(filepath.Join(dir, checkpointFile), 0o700); err != nil {
		t.Fatal(err)
	}
	d, err := New(Config{Client: fake.NewClientset(), NodeName: "node-a", PluginDir: dir})
	if err != nil {
		t.Fatal(err)
	}
	if err := d.loadCheckpoint(); err != nil {
		t.Fatalf("an unreadable record stops the gate: %v", err)
	}
	d.ready = true
	claim := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "c", UID: "uid-1"}}
	res, err := d.PrepareResourceClaims(context.Background(), []*resourceapi.ResourceClaim{claim})
	if err != nil || res["uid-1"].Err != nil {
		t.Fatalf("prepare on a ready node failed for an unwritable record: %v, %v", err, res["uid-1"].Err)
	}
	if got := d.Prepared(); len(got) != 1 || got[0] != "ns/c" {
		t.Errorf("prepared claims %v, want [ns/c]", got)
	}
	un, err := d.UnprepareResourceClaims(context.Background(), []kubeletplugin.NamespacedObject{{UID: "uid-1"}})
	if err != nil || un["uid-1"] != nil {
		t.Fatalf("unprepare failed for an unwritable record: %v, %v", err, un["uid-1"])
	}
}
