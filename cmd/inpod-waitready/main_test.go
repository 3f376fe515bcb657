package main

import "testing"

// Every case must end before the check runs: this test runs in the host's
// netns, where a check would probe the machine's gateway.
func TestFlags(t *testing.T) {
	for _, c := range []struct {
		args []string
		want int
	}{
		{[]string{"--help"}, 0},
		{[]string{"--no-such-flag"}, 2},
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
	t.Setenv("INPOD_TIMEOUT", "soon")
	if got := run(nil); got != 2 {
		t.Errorf("INPOD_TIMEOUT=soon: exit %d, want 2", got)
	}
}
