package agent_test

import (
	"strings"
	"testing"

	"github.com/inpod-dev/inpod/agent"
)

// A --gate value the agent cannot build fails New, before anything runs on
// the node: a typo never leaves a node without its gate.
func TestNewRejectsGatesItCannotBuild(t *testing.T) {
	for _, tc := range []struct{ gate, want string }{
		{"bogus", `unknown gate "bogus"`},
		{"deviceplugin,bogus", `unknown gate "bogus"`},
		{"dra,bogus", `unknown gate "bogus"`},
		{"dra,dra", "twice"},
		{"node-condition,bogus", `unknown gate "bogus"`},
		{"none,deviceplugin", "none cannot be combined"},
		{"deviceplugin,deviceplugin", "twice"},
	} {
		_, err := agent.New(agent.Config{NodeName: "n", Gate: tc.gate})
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("New(--gate %q) = %v, want an error containing %q", tc.gate, err, tc.want)
		}
	}
}
