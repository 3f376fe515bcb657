package redirect_test

import (
	"testing"

	"github.com/inpod-dev/inpod/agent/redirect"
	"github.com/inpod-dev/inpod/netns/netnstest"
)

// The generation moves on every committed nf_tables change in the netns,
// iptables-nft's too, and only there.
func TestGenerationMovesWithTheNetnsRules(t *testing.T) {
	pod, other := netnstest.New(t), netnstest.New(t)
	ns := pod.Open(t)
	gen := func() uint32 {
		t.Helper()
		g, err := redirect.Generation(ns)
		if err != nil {
			t.Fatal(err)
		}
		return g
	}
	g0 := gen()
	if g := gen(); g != g0 {
		t.Fatalf("the generation moved with nothing changed: %d → %d", g0, g)
	}
	other.Exec(t, "nft", "add", "table", "inet", "elsewhere")
	if g := gen(); g != g0 {
		t.Fatal("a change in another netns moved this one's generation")
	}
	if _, err := redirect.NewEngine(redirect.NewNFTables()).Apply(ns, redirect.Options{}); err != nil {
		t.Fatal(err)
	}
	g1 := gen()
	if g1 == g0 {
		t.Fatal("applying the rules did not move the generation")
	}
	pod.Exec(t, "nft", "flush", "ruleset")
	if g := gen(); g == g1 {
		t.Fatal("a flush did not move the generation")
	}
	g2 := gen()
	pod.Exec(t, "iptables-nft", "-t", "nat", "-A", "OUTPUT", "-j", "ACCEPT")
	if g := gen(); g == g2 {
		t.Fatal("an iptables-nft change did not move the generation")
	}
}
