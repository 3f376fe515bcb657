package main

import (
	"testing"

	"github.com/inpod-dev/inpod/netns"
	"github.com/inpod-dev/inpod/netns/netnstest"
)

// Every case must end before the check runs: this test runs in the host's
// netns, where a check would probe the machine's network.
func TestFlags(t *testing.T) {
	for _, c := range []struct {
		args []string
		want int
	}{
		{[]string{"--help"}, 0},
		{[]string{"--no-such-flag"}, 2},
		{[]string{"--timeout=1s", "stray"}, 2},
		// Loopback is never redirected: a probe there would prove nothing.
		{[]string{"--probe=127.0.0.1:9"}, 2},
		{[]string{"--probe=example.com:9"}, 2},
		{[]string{"--probe-port=0"}, 2},
		{[]string{"--probe-port=70000"}, 2},
		// The pod's own address on 15001 would pass without any rule.
		{[]string{"--probe-port=15001"}, 2},
		{[]string{"--probe=10.0.0.5:15008"}, 2},
		{[]string{"--timeout=-1s"}, 2},
	} {
		if got := run(c.args); got != c.want {
			t.Errorf("%v: exit %d, want %d", c.args, got, c.want)
		}
	}
}

// The kubelet sets service links in every container of the pod: a Service
// named inpod-probe (or inpod-timeout, …) in the pod's namespace must not
// configure the check, let alone make it exit 2 in every enrolled pod there.
// The check runs (exit 1: nothing is redirected) in an empty netns.
func TestEnvironmentIsIgnored(t *testing.T) {
	netnstest.RequireRoot(t)
	for _, kv := range [][2]string{
		{"INPOD_PROBE_PORT", "tcp://10.96.0.7:80"},
		{"INPOD_PROBE", "tcp://10.96.0.8:80"},
		{"INPOD_TIMEOUT", "tcp://10.96.0.9:80"},
		{"INPOD_DIAL_TIMEOUT", "tcp://10.96.0.10:80"},
	} {
		t.Setenv(kv[0], kv[1])
	}
	ns := netnstest.New(t).Open(t)
	var got int
	if err := netns.Do(ns, func() error { got = run([]string{"--timeout=1ms"}); return nil }); err != nil {
		t.Fatal(err)
	}
	if got != 1 {
		t.Errorf("with service-link variables INPOD_*: exit %d, want 1 (the check ran and found nothing)", got)
	}
}
