package redirect

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"slices"

	"github.com/google/nftables"
	"github.com/google/nftables/binaryutil"
	"github.com/google/nftables/expr"
	"golang.org/x/sys/unix"
)

// Host-side names: a table of inpod's own in the node netns, apart from
// whatever the node's CNI, kube-proxy or firewall keep in theirs.
const (
	hostTableName = "inpod-host"
	hostChainName = "probe_snat"
	probeSetV4    = "probe-v4"
	probeSetV6    = "probe-v6"
)

// HostProbes keeps kubelet's health probes out of the mesh. In the node
// netns, TCP that a local process (the kubelet) sends to an enrolled pod's
// IP is SNATed to ProbeSourceV4 / ProbeSourceV6, which the in-pod rules let
// through to the application. The enrolled IPs live in an nf_tables set, so
// enrolling a pod adds one element instead of a rule. It works beside either
// in-pod backend and beside iptables-legacy or iptables-nft on the node.
type HostProbes struct {
	ns *os.File
}

// NewHostProbes manages the rules in the node netns ns.
func NewHostProbes(ns *os.File) *HostProbes { return &HostProbes{ns: ns} }

func (h *HostProbes) conn() (*nftables.Conn, error) {
	c, err := nftables.New(nftables.WithNetNSFd(int(h.ns.Fd())))
	if err != nil {
		return nil, fmt.Errorf("redirect: netlink in node netns: %w", err)
	}
	return c, nil
}

func hostTable() *nftables.Table {
	return &nftables.Table{Name: hostTableName, Family: nftables.TableFamilyINet}
}

func probeSet(f Family) *nftables.Set {
	if f == IPv6 {
		return &nftables.Set{Table: hostTable(), Name: probeSetV6, KeyType: nftables.TypeIP6Addr}
	}
	return &nftables.Set{Table: hostTable(), Name: probeSetV4, KeyType: nftables.TypeIPAddr}
}

func hostChain() *nftables.Chain {
	return &nftables.Chain{Name: hostChainName, Table: hostTable(), Type: nftables.ChainTypeNAT,
		Hooknum: nftables.ChainHookPostrouting, Priority: nftables.ChainPriorityNATSource}
}

func hostRules() [][]expr.Any {
	var rules [][]expr.Any
	for _, f := range []Family{IPv4, IPv6} {
		set := probeSet(f)
		off, size := uint32(16), uint32(4)
		natFamily := uint32(unix.NFPROTO_IPV4)
		if f == IPv6 {
			off, size, natFamily = 24, 16, unix.NFPROTO_IPV6
		}
		rules = append(rules, cat(
			nfproto(f), l4(unix.IPPROTO_TCP),
			// Loading the socket's uid fails, and so ends the rule, for
			// packets without a local socket: only host-originated
			// traffic (kubelet) matches, never forwarded pod traffic.
			[]expr.Any{
				&expr.Meta{Key: expr.MetaKeySKUID, Register: 1},
				&expr.Cmp{Op: expr.CmpOpGte, Register: 1, Data: binaryutil.NativeEndian.PutUint32(0)},
				&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: off, Len: size},
				&expr.Lookup{SourceRegister: 1, SetName: set.Name},
				&expr.Immediate{Register: 1, Data: f.probeSource().AsSlice()},
				&expr.NAT{Type: expr.NATTypeSourceNAT, Family: natFamily, RegAddrMin: 1, RegAddrMax: 1},
			}))
	}
	return rules
}

// Ensure creates the table, sets and SNAT rules once. An intact table is
// left alone; a damaged one is rebuilt in one batch that keeps the set
// elements, so enrolled pods keep their probe exemption throughout.
func (h *HostProbes) Ensure() error {
	c, err := h.conn()
	if err != nil {
		return err
	}
	var keep map[Family][]netip.Addr
	if _, err := c.ListTableOfFamily(hostTableName, nftables.TableFamilyINet); err == nil {
		intact, err := h.intact(c)
		if err != nil || intact {
			return err
		}
		if keep, err = h.members(c); err != nil {
			keep = nil // a set too damaged to read: the agent re-adds its pods
		}
		c.DelTable(hostTable())
	} else if !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("redirect: look up %s table: %w", hostTableName, err)
	}
	t := c.AddTable(hostTable())
	for _, f := range []Family{IPv4, IPv6} {
		s := probeSet(f)
		s.Table = t
		if err := c.AddSet(s, elements(keep[f])); err != nil {
			return fmt.Errorf("redirect: add set %s: %w", s.Name, err)
		}
	}
	ch := hostChain()
	ch.Table = t
	c.AddChain(ch)
	for _, r := range hostRules() {
		c.AddRule(&nftables.Rule{Table: t, Chain: ch, Exprs: r})
	}
	if err := c.Flush(); err != nil {
		return fmt.Errorf("redirect: create host probe rules: %w", err)
	}
	return nil
}

func (h *HostProbes) intact(c *nftables.Conn) (bool, error) {
	for _, f := range []Family{IPv4, IPv6} {
		s, err := c.GetSetByName(hostTable(), probeSet(f).Name)
		if err != nil || s.KeyType.Name != probeSet(f).KeyType.Name {
			return false, nil
		}
	}
	return matchesKernelTable(c, hostTableName, []nftChain{{chain: hostChain(), rules: hostRules()}})
}

func elements(addrs []netip.Addr) []nftables.SetElement {
	out := make([]nftables.SetElement, 0, len(addrs))
	for _, a := range addrs {
		out = append(out, nftables.SetElement{Key: a.AsSlice()})
	}
	return out
}

func familyOf(a netip.Addr) Family {
	if a.Is4() {
		return IPv4
	}
	return IPv6
}

// Add exempts probes to ip; adding an IP that is there already is fine.
func (h *HostProbes) Add(ip netip.Addr) error {
	return h.change(ip, true)
}

// Remove ends the exemption for ip; removing an absent IP is fine.
func (h *HostProbes) Remove(ip netip.Addr) error {
	return h.change(ip, false)
}

func (h *HostProbes) change(ip netip.Addr, add bool) error {
	ip = ip.Unmap()
	if !ip.IsValid() {
		return errors.New("redirect: invalid pod IP")
	}
	c, err := h.conn()
	if err != nil {
		return err
	}
	s := probeSet(familyOf(ip))
	el := elements([]netip.Addr{ip})
	if add {
		err = c.SetAddElements(s, el)
	} else {
		members, lerr := h.members(c)
		if lerr != nil {
			return lerr
		}
		if !slices.Contains(members[familyOf(ip)], ip) {
			return nil
		}
		err = c.SetDeleteElements(s, el)
	}
	if err == nil {
		err = c.Flush()
	}
	if err != nil {
		return fmt.Errorf("redirect: update probe set with %s: %w", ip, err)
	}
	return nil
}

// Prune makes the sets hold exactly keep: IPs of pods that went away while
// the agent was down lose their exemption.
func (h *HostProbes) Prune(keep []netip.Addr) error {
	_, _, err := h.sync(keep, true)
	return err
}

// Sync repairs the table (Ensure), then makes the sets hold exactly keep,
// and says what it added and removed: the verifier's check that the
// exemptions are the enrolled pods' current IPs and no others.
// Without removeStale it only adds what is missing.
func (h *HostProbes) Sync(keep []netip.Addr, removeStale bool) (added, removed []netip.Addr, err error) {
	if err := h.Ensure(); err != nil {
		return nil, nil, err
	}
	return h.sync(keep, removeStale)
}

func (h *HostProbes) sync(keep []netip.Addr, removeStale bool) (added, removed []netip.Addr, err error) {
	c, err := h.conn()
	if err != nil {
		return nil, nil, err
	}
	members, err := h.members(c)
	if err != nil {
		return nil, nil, err
	}
	want := map[Family][]netip.Addr{}
	for _, a := range keep {
		a = a.Unmap()
		want[familyOf(a)] = append(want[familyOf(a)], a)
	}
	for _, f := range []Family{IPv4, IPv6} {
		var stale, missing []netip.Addr
		for _, a := range members[f] {
			if removeStale && !slices.Contains(want[f], a) {
				stale = append(stale, a)
			}
		}
		for _, a := range want[f] {
			if !slices.Contains(members[f], a) && !slices.Contains(missing, a) {
				missing = append(missing, a)
			}
		}
		if len(stale) > 0 {
			if err := c.SetDeleteElements(probeSet(f), elements(stale)); err != nil {
				return nil, nil, err
			}
		}
		if len(missing) > 0 {
			if err := c.SetAddElements(probeSet(f), elements(missing)); err != nil {
				return nil, nil, err
			}
		}
		added, removed = append(added, missing...), append(removed, stale...)
	}
	if len(added)+len(removed) == 0 {
		return nil, nil, nil
	}
	if err := c.Flush(); err != nil {
		return nil, nil, fmt.Errorf("redirect: prune probe sets: %w", err)
	}
	return added, removed, nil
}

// Members lists the IPs currently exempted.
func (h *HostProbes) Members() ([]netip.Addr, error) {
	c, err := h.conn()
	if err != nil {
		return nil, err
	}
	m, err := h.members(c)
	if err != nil {
		return nil, err
	}
	return append(m[IPv4], m[IPv6]...), nil
}

func (h *HostProbes) members(c *nftables.Conn) (map[Family][]netip.Addr, error) {
	out := map[Family][]netip.Addr{}
	for _, f := range []Family{IPv4, IPv6} {
		els, err := c.GetSetElements(probeSet(f))
		if err != nil {
			return nil, fmt.Errorf("redirect: read probe set: %w", err)
		}
		for _, e := range els {
			if a, ok := netip.AddrFromSlice(e.Key); ok {
				out[f] = append(out[f], a)
			}
		}
		slices.SortFunc(out[f], func(a, b netip.Addr) int { return a.Compare(b) })
	}
	return out, nil
}

// Uninstall deletes the host table; used when inpod is removed from a node.
func (h *HostProbes) Uninstall() error {
	c, err := h.conn()
	if err != nil {
		return err
	}
	if _, err := c.ListTableOfFamily(hostTableName, nftables.TableFamilyINet); errors.Is(err, unix.ENOENT) {
		return nil
	}
	c.DelTable(hostTable())
	if err := c.Flush(); err != nil {
		return fmt.Errorf("redirect: delete host probe table: %w", err)
	}
	return nil
}
