package redirect_test

import (
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/inpod-dev/inpod/agent/redirect"
	"github.com/inpod-dev/inpod/netns/netnstest"
)

var update = flag.Bool("update", false, "rewrite the golden files in testdata/")

var variants = map[string]redirect.Options{
	"default":     {},
	"dns":         {DNSCapture: true},
	"no-inbound":  {NoInboundCapture: true},
	"virtual":     {VirtualInterfaces: []string{"virt0", "tap0_kata"}},
	"virtual-dns": {DNSCapture: true, VirtualInterfaces: []string{"virt0"}},
}

func golden(t *testing.T, name, got string) {
	t.Helper()
	path := filepath.Join("testdata", name+".golden")
	if *update {
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, []byte(got), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (run go test -update to create it)", err)
	}
	if got != string(want) {
		t.Errorf("%s differs from %s:\n%s", name, path, lineDiff(string(want), got))
	}
}

// The iptables rule text for each family and option.
func TestIPTablesRuleTextGolden(t *testing.T) {
	for variant, opts := range variants {
		for _, f := range []redirect.Family{redirect.IPv4, redirect.IPv6} {
			golden(t, "iptables/"+variant+"-"+strings.ToLower(f.String()), redirect.IPTablesRestoreInput(f, opts))
		}
	}
}

// The nftables rules as the kernel holds them after Apply, for each option,
// with both families and with IPv6 disabled in the pod.
func TestNFTablesRulesGolden(t *testing.T) {
	for variant, opts := range variants {
		for _, v6 := range []bool{true, false} {
			name := variant + "-dual"
			if !v6 {
				name = variant + "-ipv4"
			}
			t.Run(name, func(t *testing.T) {
				pod := netnstest.New(t)
				if !v6 {
					pod.Exec(t, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.lo.disable_ipv6=1")
				}
				if _, err := redirect.NewEngine(redirect.NewNFTables()).Apply(pod.Open(t), opts); err != nil {
					t.Fatal(err)
				}
				golden(t, "nftables/"+name, pod.Exec(t, "nft", "list", "table", "inet", "inpod"))
			})
		}
	}
}

func TestHostProbeRulesGolden(t *testing.T) {
	node := netnstest.New(t)
	if err := redirect.NewHostProbes(node.Open(t)).Ensure(); err != nil {
		t.Fatal(err)
	}
	golden(t, "host-probes", node.Exec(t, "nft", "list", "table", "inet", "inpod-host"))
}
