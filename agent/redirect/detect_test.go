package redirect_test

import (
	"testing"

	"github.com/inpod-dev/inpod/agent/redirect"
	"github.com/inpod-dev/inpod/netns/netnstest"
)

func TestDetectReadsWithoutCreating(t *testing.T) {
	cases := []struct {
		name  string
		setup [][]string
		want  string
	}{
		{"empty node", nil, "nftables"},
		{"iptables-nft node", [][]string{{"iptables-nft", "-t", "nat", "-A", "POSTROUTING", "-j", "ACCEPT"}}, "iptables-nft"},
		{"iptables-legacy node", [][]string{{"iptables-legacy", "-t", "nat", "-A", "POSTROUTING", "-j", "ACCEPT"}}, "iptables-legacy"},
		{"native nftables node", [][]string{{"nft", "add", "table", "inet", "cni"}, {"nft", "add", "chain", "inet", "cni", "fw"}}, "nftables"},
		{"both, more legacy", [][]string{
			{"iptables-nft", "-t", "filter", "-A", "INPUT", "-j", "ACCEPT"},
			{"iptables-legacy", "-t", "nat", "-A", "POSTROUTING", "-j", "ACCEPT"},
			{"iptables-legacy", "-t", "nat", "-A", "PREROUTING", "-j", "ACCEPT"},
		}, "iptables-legacy"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			node := netnstest.New(t)
			for _, cmd := range tc.setup {
				node.Exec(t, cmd...)
			}
			before := node.Exec(t, "nft", "list", "ruleset") + legacyTables(t, node)
			det, err := redirect.Detect(node.Open(t))
			if err != nil {
				t.Fatal(err)
			}
			if det.Backend != tc.want {
				t.Errorf("Detect = %+v, want %s", det, tc.want)
			}
			if after := node.Exec(t, "nft", "list", "ruleset") + legacyTables(t, node); after != before {
				t.Errorf("detection changed the node:\n%s", lineDiff(before, after))
			}
		})
	}
}

func legacyTables(t *testing.T, ns *netnstest.NetNS) string {
	return ns.Exec(t, "sh", "-c", "cat /proc/net/ip_tables_names /proc/net/ip6_tables_names 2>/dev/null; true")
}

func TestNewBackendRejectsUnknownNames(t *testing.T) {
	if _, _, err := redirect.NewBackend("ebpf", nil); err == nil {
		t.Fatal("unknown backend accepted")
	}
}
