// Package redirect installs, verifies and removes the in-pod rules that send
// a pod's TCP traffic to ztunnel's listeners inside the pod's own network
// namespace, and the node-side rules that keep kubelet probes out of the
// mesh.
//
// Two backends implement the same behaviour: iptables (one iptables-restore
// transaction per address family, nf_tables or legacy binaries) and nftables
// (one netlink batch, no exec). Applying is idempotent and cheap when nothing
// is there yet: a netlink or procfs look-up decides whether the slow
// verify-and-replace path is needed at all, so a new pod pays one
// transaction, the floor.
package redirect

import (
	"fmt"
	"net/netip"
	"os"
	"strings"
)

// What ztunnel needs; these are Istio's values, so that Istio's ztunnel
// works unchanged.
const (
	// ZtunnelMark is set by ztunnel on its own sockets; such traffic is
	// never redirected.
	ZtunnelMark = 0x539
	// ConnMark marks connections ztunnel accepted, so the application's
	// replies are routed back to ztunnel's transparent sockets.
	ConnMark = 0x111
	// MarkMask limits inpod's marks to the low 12 bits so other users of
	// the mark keep theirs.
	MarkMask = 0xfff
	// RouteTable holds the local route that delivers marked replies to
	// ztunnel; RulePriority is its policy-routing rule's preference.
	RouteTable   = 100
	RulePriority = 32764

	PortOutbound = 15001
	PortInbound  = 15006
	PortHBONE    = 15008
	PortDNS      = 15053
)

// ProbeSource is the address kubelet probes are SNATed to on the node, per
// family, so the in-pod rules can recognise and pass them.
var (
	ProbeSourceV4 = netip.MustParseAddr("169.254.7.127")
	ProbeSourceV6 = netip.MustParseAddr("fd16:9254:7127:1337:ffff:ffff:ffff:ffff")
)

// Options selects variants of the in-pod rule set.
type Options struct {
	// DNSCapture sends the pod's DNS (UDP and TCP port 53) to ztunnel's
	// DNS proxy on 15053.
	DNSCapture bool
	// NoInboundCapture leaves inbound traffic alone (ingress-style pods):
	// only outbound is redirected.
	NoInboundCapture bool
	// VirtualInterfaces are interfaces of the pod whose incoming TCP is a
	// guest's outgoing traffic (a KubeVirt VM's tap, a nested container's
	// bridge): it goes to ztunnel's outbound listener instead of the
	// inbound one, and nothing else of the pod's inbound rules applies to
	// it, as with Istio's istio.io/reroute-virtual-interfaces. UDP is left
	// alone, as Istio leaves it. Each must be ValidInterfaceName: the
	// names are written into the rules.
	VirtualInterfaces []string
}

func (o Options) String() string {
	s := fmt.Sprintf("dns=%t inbound=%t", o.DNSCapture, !o.NoInboundCapture)
	if len(o.VirtualInterfaces) > 0 {
		s += " virtual-interfaces=" + strings.Join(o.VirtualInterfaces, ",")
	}
	return s
}

// ValidInterfaceName reports whether name can name a network interface
// (the kernel's rule: 1 to 15 bytes, not "." or "..", no '/', ':' or
// white space), restricted further to letters, digits, '_', '-' and '.',
// so that a name taken from a pod can never change the meaning of a rule
// (iptables-restore input, or iptables' '+' wildcard).
func ValidInterfaceName(name string) bool {
	if len(name) == 0 || len(name) >= 16 || name == "." || name == ".." {
		return false
	}
	for _, r := range name {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '_' || r == '-' || r == '.') {
			return false
		}
	}
	return true
}

// validate refuses options whose names cannot be written safely.
func (o Options) validate() error {
	for _, name := range o.VirtualInterfaces {
		if !ValidInterfaceName(name) {
			return fmt.Errorf("virtual interface %q: not an interface name", name)
		}
	}
	return nil
}

// Family is an address family of the rules.
type Family int

const (
	IPv4 Family = 4
	IPv6 Family = 6
)

func (f Family) String() string { return fmt.Sprintf("IPv%d", int(f)) }

func (f Family) loopback() netip.Addr {
	if f == IPv6 {
		return netip.IPv6Loopback()
	}
	return netip.MustParseAddr("127.0.0.1")
}

func (f Family) probeSource() netip.Addr {
	if f == IPv6 {
		return ProbeSourceV6
	}
	return ProbeSourceV4
}

// Backend applies the rule set inside one pod netns. Implementations switch
// into the namespace themselves where they must (exec) and use netlink
// sockets opened in it otherwise.
type Backend interface {
	// Name identifies the backend in logs, metrics and flags.
	Name() string
	// Apply makes the netns hold exactly the rule set for opts and the given
	// families, writing nothing when it already does. It reports whether
	// it wrote.
	Apply(ns *os.File, opts Options, families []Family) (changed bool, err error)
	// Remove deletes every inpod rule of this backend from the netns and
	// reports whether there was any.
	Remove(ns *os.File) (changed bool, err error)
	// Present reports whether any inpod rule of this backend is there,
	// without changing anything; used to clean up after a backend switch.
	Present(ns *os.File) (bool, error)
}
