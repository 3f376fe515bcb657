package dra

import (
	"slices"
	"testing"

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
