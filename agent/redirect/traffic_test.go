package redirect_test

import (
	"fmt"
	"net"
	"net/netip"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/inpod-dev/inpod/agent/redirect"
	"github.com/inpod-dev/inpod/netns"
	"github.com/inpod-dev/inpod/netns/netnstest"
	ztunnel "github.com/inpod-dev/inpod/zds/zdstest"
)

// backends lists every backend under test with the command that shows its
// rules for the before/after comparison.
func backends(t *testing.T) map[string]func() redirect.Backend {
	return map[string]func() redirect.Backend{
		"nftables":        func() redirect.Backend { return redirect.NewNFTables() },
		"iptables-nft":    func() redirect.Backend { return mustIPTables(t, redirect.IPTablesNFT) },
		"iptables-legacy": func() redirect.Backend { return mustIPTables(t, redirect.IPTablesLegacy) },
	}
}

func mustIPTables(t *testing.T, mode redirect.IPTablesMode) redirect.Backend {
	t.Helper()
	b, err := redirect.NewIPTables(mode)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// legacyRules is what iptables-legacy holds, less the empty built-in tables
// it can never delete again.
func legacyRules(t *testing.T, ns *netnstest.NetNS) string {
	var keep []string
	for _, cmd := range []string{"iptables-legacy-save", "ip6tables-legacy-save"} {
		for _, l := range strings.Split(ns.Exec(t, cmd), "\n") {
			if strings.HasPrefix(l, "-A") || strings.HasPrefix(l, ":INPOD") {
				keep = append(keep, l)
			}
		}
	}
	return strings.Join(keep, "\n")
}

func TestRedirectionWithRealTraffic(t *testing.T) {
	for name, newBackend := range backends(t) {
		t.Run(name, func(t *testing.T) {
			tp := newTopology(t)
			before := netState(t, tp.pod) + legacyRules(t, tp.pod)
			engine := redirect.NewEngine(newBackend())
			res, err := engine.Apply(tp.podFile, redirect.Options{})
			if err != nil {
				t.Fatal(err)
			}
			if !res.Changed || len(res.Families) != 2 {
				t.Fatalf("Apply = %+v, want a change on both families", res)
			}

			out4, out6 := hostPort(outsideIP4, appPort), hostPort(outsideIP6, appPort)
			expectLanding(t, "pod → outside (v4)", reply(t, tp.podFile, out4, 0), "ztunnel-15001", out4)
			expectLanding(t, "pod → outside (v6)", reply(t, tp.podFile, out6, 0), "ztunnel-15001", out6)
			app4, app6 := hostPort(podIP4, appPort), hostPort(podIP6, appPort)
			expectLanding(t, "node → pod app (v4)", reply(t, tp.nodeFile, app4, 0), "ztunnel-15006", app4)
			expectLanding(t, "node → pod app (v6)", reply(t, tp.nodeFile, app6, 0), "ztunnel-15006", app6)
			hbone := hostPort(podIP4, ztunnel.PortHBONE)
			expectLanding(t, "node → pod 15008", reply(t, tp.nodeFile, hbone, 0), "ztunnel-15008", hbone)
			expectLanding(t, "ztunnel-marked pod → outside (v4)", reply(t, tp.podFile, out4, redirect.ZtunnelMark), "outside", "")
			expectLanding(t, "ztunnel-marked pod → outside (v6)", reply(t, tp.podFile, out6, redirect.ZtunnelMark), "outside", "")
			expectLanding(t, "pod → 127.0.0.1", reply(t, tp.podFile, hostPort("127.0.0.1", appPort), 0), "app", "")
			expectLanding(t, "pod → ::1", reply(t, tp.podFile, hostPort("::1", appPort), 0), "app", "")

			// The kubelet's probe path: host-originated TCP to an enrolled
			// pod IP is SNATed on the node and let through in the pod.
			probes := redirect.NewHostProbes(tp.nodeFile)
			if err := probes.Ensure(); err != nil {
				t.Fatal(err)
			}
			for _, ip := range []string{podIP4, podIP6} {
				if err := probes.Add(netip.MustParseAddr(ip)); err != nil {
					t.Fatal(err)
				}
			}
			got := reply(t, tp.nodeFile, app4, 0)
			expectLanding(t, "node probe → pod app (v4)", got, "app", "")
			if !strings.Contains(got, "peer="+redirect.ProbeSourceV4.String()+":") {
				t.Errorf("probe arrived as %q, want it from %s", got, redirect.ProbeSourceV4)
			}
			got = reply(t, tp.nodeFile, app6, 0)
			expectLanding(t, "node probe → pod app (v6)", got, "app", "")
			if !strings.Contains(got, "peer=["+redirect.ProbeSourceV6.String()+"]:") {
				t.Errorf("probe arrived as %q, want it from %s", got, redirect.ProbeSourceV6)
			}
			if err := probes.Uninstall(); err != nil {
				t.Fatal(err)
			}

			if _, err := engine.Remove(tp.podFile); err != nil {
				t.Fatal(err)
			}
			expectLanding(t, "after Remove: pod → outside (v4)", reply(t, tp.podFile, out4, 0), "outside", "")
			expectLanding(t, "after Remove: pod → outside (v6)", reply(t, tp.podFile, out6, 0), "outside", "")
			got = reply(t, tp.nodeFile, app4, 0)
			expectLanding(t, "after Remove: node → pod app", got, "app", "")
			if !strings.Contains(got, "peer="+nodeIP4+":") {
				t.Errorf("after Remove the connection arrived as %q, want it from the node's own address", got)
			}
			expectLanding(t, "after Remove: node → pod app (v6)", reply(t, tp.nodeFile, app6, 0), "app", "")
			if after := netState(t, tp.pod) + legacyRules(t, tp.pod); after != before {
				t.Errorf("Remove left the pod netns changed:\n%s", lineDiff(before, after))
			}
		})
	}
}

func TestOptionsChangeWhatIsCaptured(t *testing.T) {
	for name, newBackend := range backends(t) {
		t.Run(name, func(t *testing.T) {
			tp := newTopology(t)
			engine := redirect.NewEngine(newBackend())
			if _, err := engine.Apply(tp.podFile, redirect.Options{NoInboundCapture: true}); err != nil {
				t.Fatal(err)
			}
			app4 := hostPort(podIP4, appPort)
			expectLanding(t, "no inbound capture: node → pod app", reply(t, tp.nodeFile, app4, 0), "app", "")
			out4 := hostPort(outsideIP4, appPort)
			expectLanding(t, "no inbound capture: pod → outside", reply(t, tp.podFile, out4, 0), "ztunnel-15001", out4)

			// Switching options replaces the set in place.
			res, err := engine.Apply(tp.podFile, redirect.Options{DNSCapture: true})
			if err != nil || !res.Changed {
				t.Fatalf("Apply with new options = %+v, %v; want a change", res, err)
			}
			expectLanding(t, "inbound capture back on", reply(t, tp.nodeFile, app4, 0), "ztunnel-15006", app4)
			dns := hostPort(outsideIP4, 53)
			serve(t, tp.podFile, "tcp4", "0.0.0.0:15053", "ztunnel-15053", redirect.ZtunnelMark)
			expectLanding(t, "DNS over TCP", reply(t, tp.podFile, dns, 0), "ztunnel-15053", dns)
		})
	}
}

func TestIPv6DisabledPodGetsIPv4Only(t *testing.T) {
	for name, newBackend := range backends(t) {
		t.Run(name, func(t *testing.T) {
			pod := netnstest.New(t)
			pod.Exec(t, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1")
			pod.Exec(t, "sysctl", "-qw", "net.ipv6.conf.lo.disable_ipv6=1")
			f := pod.Open(t)
			engine := redirect.NewEngine(newBackend())
			res, err := engine.Apply(f, redirect.Options{})
			if err != nil {
				t.Fatal(err)
			}
			if len(res.Families) != 1 || res.Families[0] != redirect.IPv4 {
				t.Fatalf("families %v, want IPv4 only", res.Families)
			}
			if strings.Contains(pod.Exec(t, "ip", "-6", "rule"), "lookup 100") {
				t.Error("IPv6 policy rule installed in a pod without IPv6")
			}
			if _, err := engine.Remove(f); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// lineDiff lists the lines only one side has.
func lineDiff(before, after string) string {
	count := map[string]int{}
	for _, l := range strings.Split(before, "\n") {
		count[l]++
	}
	for _, l := range strings.Split(after, "\n") {
		count[l]--
	}
	var out []string
	for l, n := range count {
		switch {
		case n > 0:
			out = append(out, "- "+l)
		case n < 0:
			out = append(out, "+ "+l)
		}
	}
	return strings.Join(out, "\n")
}

// TestVirtualInterfaceTrafficGoesOutbound: TCP arriving on a pod's virtual
// interface (a guest VM behind it, here a netns on a veth named virt0) is
// inbound capture's like any other until the interface is named; then it
// goes to ztunnel's outbound listener with its original destination,
// while the pod's own inbound traffic still goes to the inbound one.
func TestVirtualInterfaceTrafficGoesOutbound(t *testing.T) {
	for name, newBackend := range backends(t) {
		t.Run(name, func(t *testing.T) {
			tp := newTopology(t)
			guest := addGuest(t, tp)
			guestFile := guest.Open(t)

			engine := redirect.NewEngine(newBackend())
			if _, err := engine.Apply(tp.podFile, redirect.Options{}); err != nil {
				t.Fatal(err)
			}
			out4 := hostPort(outsideIP4, appPort)
			expectLanding(t, "guest → outside, interface not named", reply(t, guestFile, out4, 0), "ztunnel-15006", out4)

			opts := redirect.Options{VirtualInterfaces: []string{"virt0"}}
			res, err := engine.Apply(tp.podFile, opts)
			if err != nil || !res.Changed {
				t.Fatalf("Apply naming virt0 = %+v, %v; want a change", res, err)
			}
			expectLanding(t, "guest → outside", reply(t, guestFile, out4, 0), "ztunnel-15001", out4)
			app4 := hostPort(podIP4, appPort)
			expectLanding(t, "node → pod app", reply(t, tp.nodeFile, app4, 0), "ztunnel-15006", app4)
			if res, err := engine.Apply(tp.podFile, opts); err != nil || res.Changed {
				t.Fatalf("second Apply = %+v, %v; want nothing changed (the rules read back as written)", res, err)
			}
		})
	}
}

// TestOptionsRefuseNamesThatAreNotInterfaces: a name that could change a
// rule's meaning is refused before anything is written.
func TestOptionsRefuseNamesThatAreNotInterfaces(t *testing.T) {
	pod := netnstest.New(t)
	for _, bad := range []string{"", "eth0 -j ACCEPT", "virt+", "a/b", "x:1", "..", "sixteen-chars-00", "eth0\n-A"} {
		if redirect.ValidInterfaceName(bad) {
			t.Errorf("ValidInterfaceName(%q) = true", bad)
		}
		if _, err := redirect.NewEngine(redirect.NewNFTables()).Apply(pod.Open(t), redirect.Options{VirtualInterfaces: []string{bad}}); err == nil {
			t.Errorf("Apply with virtual interface %q: no error", bad)
		}
	}
	if strings.Contains(pod.Exec(t, "nft", "list", "ruleset"), "inpod") {
		t.Error("a refused Apply wrote rules")
	}
	for _, good := range []string{"virt0", "tap0_kata", "net1.100", "k6t-eth0", "fifteen-chars-0"} {
		if !redirect.ValidInterfaceName(good) {
			t.Errorf("ValidInterfaceName(%q) = false", good)
		}
	}
}

// TestVirtualInterfaceGuestDNSThroughMasquerade: with DNS capture on, a
// guest's DNS query that the pod masquerades (as KubeVirt's masquerade
// binding does) still gets its answer: the answer arriving from outside is
// put in the conntrack zone of ztunnel's DNS relays, so the guest's query
// must be tracked there too, or the answer is never un-NATed.
func TestVirtualInterfaceGuestDNSThroughMasquerade(t *testing.T) {
	for name, newBackend := range backends(t) {
		t.Run(name, func(t *testing.T) {
			tp := newTopology(t)
			guest := addGuest(t, tp)
			tp.pod.Exec(t, "nft", "add table ip guestnat; add chain ip guestnat post { type nat hook postrouting priority srcnat; }; add rule ip guestnat post oifname eth0 masquerade")
			serveUDPEcho(t, tp.nodeFile, hostPort(outsideIP4, 53))

			engine := redirect.NewEngine(newBackend())
			opts := redirect.Options{DNSCapture: true, VirtualInterfaces: []string{"virt0"}}
			if _, err := engine.Apply(tp.podFile, opts); err != nil {
				t.Fatal(err)
			}
			if err := udpExchange(guest.Open(t), hostPort(outsideIP4, 53)); err != nil {
				t.Fatalf("the guest's DNS query through the pod's masquerade: %v", err)
			}
			if res, err := engine.Apply(tp.podFile, opts); err != nil || res.Changed {
				t.Fatalf("second Apply = %+v, %v; want nothing changed (the rules read back as written)", res, err)
			}
		})
	}
}

// serveUDPEcho answers each datagram to addr, in ns, with itself.
func serveUDPEcho(t *testing.T, ns *os.File, addr string) {
	t.Helper()
	var pc net.PacketConn
	if err := netns.Do(ns, func() error {
		var err error
		pc, err = net.ListenPacket("udp4", addr)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pc.Close() })
	go func() {
		buf := make([]byte, 512)
		for {
			n, from, err := pc.ReadFrom(buf)
			if err != nil {
				return
			}
			pc.WriteTo(buf[:n], from)
		}
	}()
}

// udpExchange sends a datagram from ns to addr and waits for it to come
// back.
func udpExchange(ns *os.File, addr string) error {
	return netns.Do(ns, func() error {
		c, err := net.Dial("udp4", addr)
		if err != nil {
			return err
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(2 * time.Second))
		if _, err := c.Write([]byte("query")); err != nil {
			return err
		}
		buf := make([]byte, 16)
		n, err := c.Read(buf)
		if err != nil {
			return err
		}
		if string(buf[:n]) != "query" {
			return fmt.Errorf("answered %q", buf[:n])
		}
		return nil
	})
}

// addGuest puts a guest (a VM, here a netns) behind the pod's interface
// virt0, routed through the pod, which forwards for it.
func addGuest(t *testing.T, tp *topology) *netnstest.NetNS {
	t.Helper()
	const podOnVirt, guestIP = "192.0.2.1", "192.0.2.2"
	guest := netnstest.New(t)
	tp.pod.Exec(t, "ip", "link", "add", "virt0", "type", "veth", "peer", "name", "eth0", "netns", guest.Name)
	tp.pod.Exec(t, "ip", "addr", "add", podOnVirt+"/24", "dev", "virt0")
	tp.pod.Exec(t, "ip", "link", "set", "virt0", "up")
	tp.pod.Exec(t, "sysctl", "-qw", "net.ipv4.ip_forward=1")
	guest.Exec(t, "ip", "addr", "add", guestIP+"/24", "dev", "eth0")
	guest.Exec(t, "ip", "link", "set", "eth0", "up")
	guest.Exec(t, "ip", "route", "add", "default", "via", podOnVirt)
	return guest
}
