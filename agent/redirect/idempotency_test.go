package redirect_test

import (
	"net/netip"
	"slices"
	"strings"
	"testing"

	"github.com/inpod-dev/inpod/agent/redirect"
	"github.com/inpod-dev/inpod/netns/netnstest"
)

// kernelState includes nf_tables rule handles, which change whenever a rule
// is rewritten, so equal states also prove nothing was rewritten.
func kernelState(t *testing.T, ns *netnstest.NetNS) string {
	return ns.Exec(t, "nft", "-a", "list", "ruleset") + netState(t, ns) + legacyRules(t, ns)
}

type tamper struct {
	name string
	do   func(t *testing.T, ns *netnstest.NetNS)
}

func tampers(backend string) []tamper {
	routing := []tamper{
		{"policy rule deleted", func(t *testing.T, ns *netnstest.NetNS) {
			ns.Exec(t, "ip", "rule", "del", "pref", "32764")
		}},
		{"local route replaced", func(t *testing.T, ns *netnstest.NetNS) {
			ns.Exec(t, "ip", "route", "flush", "table", "100")
		}},
	}
	if backend == "nftables" {
		return append(routing,
			tamper{"chain flushed", func(t *testing.T, ns *netnstest.NetNS) {
				ns.Exec(t, "nft", "flush", "chain", "inet", "inpod", "nat_output")
			}},
			tamper{"foreign rule added", func(t *testing.T, ns *netnstest.NetNS) {
				ns.Exec(t, "nft", "insert", "rule", "inet", "inpod", "nat_prerouting", "accept")
			}},
			tamper{"chain deleted", func(t *testing.T, ns *netnstest.NetNS) {
				ns.Exec(t, "nft", "delete", "chain", "inet", "inpod", "mangle_prerouting")
			}},
		)
	}
	ipt, ip6t := "iptables-nft", "ip6tables-nft"
	if backend == "iptables-legacy" {
		ipt, ip6t = "iptables-legacy", "ip6tables-legacy"
	}
	return append(routing,
		tamper{"one rule deleted", func(t *testing.T, ns *netnstest.NetNS) {
			ns.Exec(t, ipt, "-t", "nat", "-D", "INPOD_OUTPUT", "1")
		}},
		tamper{"one rule replaced", func(t *testing.T, ns *netnstest.NetNS) {
			ns.Exec(t, ip6t, "-t", "nat", "-R", "INPOD_PRERT", "1", "-p", "udp", "-j", "ACCEPT")
		}},
		tamper{"jump duplicated", func(t *testing.T, ns *netnstest.NetNS) {
			ns.Exec(t, ipt, "-t", "mangle", "-A", "PREROUTING", "-j", "INPOD_PRERT")
		}},
		tamper{"jump deleted", func(t *testing.T, ns *netnstest.NetNS) {
			ns.Exec(t, ipt, "-t", "nat", "-D", "OUTPUT", "-j", "INPOD_OUTPUT")
		}},
		tamper{"stale inpod chain", func(t *testing.T, ns *netnstest.NetNS) {
			ns.Exec(t, ipt, "-t", "raw", "-N", "INPOD_OLD")
			ns.Exec(t, ipt, "-t", "raw", "-A", "OUTPUT", "-j", "INPOD_OLD")
		}},
	)
}

func TestApplyIsIdempotentAndRepairsTampering(t *testing.T) {
	for name, newBackend := range backends(t) {
		t.Run(name, func(t *testing.T) {
			pod := netnstest.New(t)
			f := pod.Open(t)
			engine := redirect.NewEngine(newBackend())
			opts := redirect.Options{DNSCapture: true}
			if res, err := engine.Apply(f, opts); err != nil || !res.Changed {
				t.Fatalf("first Apply = %+v, %v", res, err)
			}
			applied := kernelState(t, pod)

			res, err := engine.Apply(f, opts)
			if err != nil || res.Changed {
				t.Fatalf("second Apply = %+v, %v; want no change", res, err)
			}
			if again := kernelState(t, pod); again != applied {
				t.Fatalf("second Apply rewrote rules:\n%s", lineDiff(applied, again))
			}

			for _, tc := range tampers(name) {
				tc.do(t, pod)
				res, err := engine.Apply(f, opts)
				if err != nil || !res.Changed {
					t.Fatalf("%s: Apply = %+v, %v; want a repair", tc.name, res, err)
				}
				if res, err := engine.Apply(f, opts); err != nil || res.Changed {
					t.Fatalf("%s: Apply after the repair = %+v, %v; want no change", tc.name, res, err)
				}
				if got := withoutHandles(kernelState(t, pod)); got != withoutHandles(applied) {
					t.Errorf("%s: repaired state differs:\n%s", tc.name, lineDiff(withoutHandles(applied), got))
				}
			}
		})
	}
}

func withoutHandles(s string) string {
	lines := strings.Split(s, "\n")
	for i, l := range lines {
		if j := strings.Index(l, " # handle "); j >= 0 {
			lines[i] = l[:j]
		}
	}
	return strings.Join(lines, "\n")
}

func TestSwitchingBackendRemovesTheOthersRules(t *testing.T) {
	all := backends(t)
	for _, pair := range [][2]string{{"iptables-nft", "nftables"}, {"nftables", "iptables-legacy"}, {"iptables-legacy", "iptables-nft"}} {
		from, to := pair[0], pair[1]
		t.Run(from+"→"+to, func(t *testing.T) {
			tp := newTopology(t)
			if _, err := redirect.NewEngine(all[from]()).Apply(tp.podFile, redirect.Options{}); err != nil {
				t.Fatal(err)
			}
			var others []redirect.Backend
			for name, nb := range all {
				if name != to {
					others = append(others, nb())
				}
			}
			engine := redirect.NewEngine(all[to](), others...)
			if _, err := engine.Apply(tp.podFile, redirect.Options{}); err != nil {
				t.Fatal(err)
			}
			old := all[from]()
			if present, err := old.Present(tp.podFile); err != nil || present {
				t.Fatalf("%s rules still present after switching to %s (err %v)", from, to, err)
			}
			out4 := hostPort(outsideIP4, appPort)
			expectLanding(t, "after switch: pod → outside", reply(t, tp.podFile, out4, 0), "ztunnel-15001", out4)
		})
	}
}

func TestHostProbesSetOperations(t *testing.T) {
	node := netnstest.New(t)
	probes := redirect.NewHostProbes(node.Open(t))
	if err := probes.Ensure(); err != nil {
		t.Fatal(err)
	}
	a, b, c := netip.MustParseAddr("198.51.100.7"), netip.MustParseAddr("fd42:51::7"), netip.MustParseAddr("198.51.100.8")
	for _, ip := range []netip.Addr{a, b, a} { // adding twice is fine
		if err := probes.Add(ip); err != nil {
			t.Fatal(err)
		}
	}
	created := node.Exec(t, "nft", "-a", "list", "table", "inet", "inpod-host")
	if err := probes.Ensure(); err != nil {
		t.Fatal(err)
	}
	if again := node.Exec(t, "nft", "-a", "list", "table", "inet", "inpod-host"); again != created {
		t.Fatalf("a second Ensure rewrote the table:\n%s", lineDiff(created, again))
	}
	// A damaged chain is rebuilt and the enrolled IPs survive it.
	node.Exec(t, "nft", "flush", "chain", "inet", "inpod-host", "probe_snat")
	if err := probes.Ensure(); err != nil {
		t.Fatal(err)
	}
	expectMembers(t, probes, a, b)
	if got := node.Exec(t, "nft", "list", "chain", "inet", "inpod-host", "probe_snat"); !strings.Contains(got, "snat ip to 169.254.7.127") {
		t.Fatalf("chain not repaired:\n%s", got)
	}

	if err := probes.Remove(a); err != nil {
		t.Fatal(err)
	}
	if err := probes.Remove(a); err != nil {
		t.Fatalf("removing an absent IP: %v", err)
	}
	expectMembers(t, probes, b)
	if err := probes.Prune([]netip.Addr{c}); err != nil {
		t.Fatal(err)
	}
	expectMembers(t, probes, c)
	if err := probes.Uninstall(); err != nil {
		t.Fatal(err)
	}
	if got := node.Exec(t, "nft", "list", "ruleset"); got != "" {
		t.Fatalf("Uninstall left:\n%s", got)
	}
	if err := probes.Uninstall(); err != nil {
		t.Fatalf("second Uninstall: %v", err)
	}
}

func expectMembers(t *testing.T, probes *redirect.HostProbes, want ...netip.Addr) {
	t.Helper()
	got, err := probes.Members()
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(got, want) {
		t.Fatalf("probe set holds %v, want %v", got, want)
	}
}

// Leftovers of an iptables backend in one IP family only are found and
// removed: presence is looked up for both families in one pass, and a
// miss here would leave a pod's IPv6 traffic redirected after a switch of
// backend or an uninstall.
func TestIPTablesLeftoversInOneFamilyAreFound(t *testing.T) {
	for _, c := range []struct {
		mode redirect.IPTablesMode
		ip6t string
	}{{redirect.IPTablesNFT, "ip6tables-nft"}, {redirect.IPTablesLegacy, "ip6tables-legacy"}} {
		t.Run(string(c.mode), func(t *testing.T) {
			ns := netnstest.New(t)
			f := ns.Open(t)
			b := mustIPTables(t, c.mode)
			ns.Exec(t, c.ip6t, "-t", "nat", "-N", "INPOD_LEFT")
			if present, err := b.Present(f); err != nil || !present {
				t.Fatalf("Present with an IPv6-only inpod chain = %v, %v; want true", present, err)
			}
			if changed, err := b.Remove(f); err != nil || !changed {
				t.Fatalf("Remove = %v, %v; want changed", changed, err)
			}
			if present, err := b.Present(f); err != nil || present {
				t.Fatalf("Present after Remove = %v, %v; want false", present, err)
			}
			if got := ns.Exec(t, c.ip6t+"-save"); strings.Contains(got, "INPOD_") {
				t.Fatalf("the chain is still there:\n%s", got)
			}
		})
	}
}

// Only the ip and ip6 families hold iptables' chains: an inpod-named chain
// in another family's table is not an iptables leftover, and listing every
// family's chains does not trip over them.
func TestIPTablesNFTIgnoresOtherFamiliesChains(t *testing.T) {
	ns := netnstest.New(t)
	f := ns.Open(t)
	for _, family := range []string{"bridge", "arp", "netdev"} {
		ns.Exec(t, "nft", "add", "table", family, "other")
		ns.Exec(t, "nft", "add", "chain", family, "other", "INPOD_NOT_IPTABLES")
	}
	if present, err := mustIPTables(t, redirect.IPTablesNFT).Present(f); err != nil || present {
		t.Fatalf("Present = %v, %v; want false", present, err)
	}
}
