package redirect

import (
	"errors"
	"fmt"
	"net"
	"os"
	"slices"

	"github.com/vishvananda/netlink"
	vnetns "github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// netlinkIn opens a netlink handle whose sockets live in ns, so no thread
// has to switch namespaces.
func netlinkIn(ns *os.File) (*netlink.Handle, error) {
	// Only the route family: the handle opens one socket per family it
	// serves, each from a thread moved into the pod netns and back.
	h, err := netlink.NewHandleAt(vnetns.NsHandle(int(ns.Fd())), unix.NETLINK_ROUTE)
	if err != nil {
		return nil, fmt.Errorf("redirect: netlink in pod netns: %w", err)
	}
	return h, nil
}

// families reports the address families the pod netns has: IPv6 counts
// only when loopback holds ::1, which it does not when IPv6 is disabled.
func families(h *netlink.Handle) ([]Family, error) {
	lo, err := h.LinkByName("lo")
	if err != nil {
		return nil, fmt.Errorf("redirect: find lo: %w", err)
	}
	addrs, err := h.AddrList(lo, netlink.FAMILY_V6)
	if err != nil {
		return nil, fmt.Errorf("redirect: list lo addresses: %w", err)
	}
	for _, a := range addrs {
		if a.IP.Equal(net.IPv6loopback) {
			return []Family{IPv4, IPv6}, nil
		}
	}
	return []Family{IPv4}, nil
}

func nlFamily(f Family) int {
	if f == IPv6 {
		return netlink.FAMILY_V6
	}
	return netlink.FAMILY_V4
}

func markRule(f Family) *netlink.Rule {
	r := netlink.NewRule()
	r.Family = nlFamily(f)
	r.Priority = RulePriority
	r.Mark = ConnMark
	mask := uint32(MarkMask)
	r.Mask = &mask
	r.Table = RouteTable
	return r
}

func localRoute(f Family, lo int) *netlink.Route {
	dst := &net.IPNet{IP: net.IPv4zero.To4(), Mask: net.CIDRMask(0, 32)}
	if f == IPv6 {
		dst = &net.IPNet{IP: net.IPv6zero, Mask: net.CIDRMask(0, 128)}
	}
	return &netlink.Route{
		Family:    nlFamily(f),
		Dst:       dst,
		LinkIndex: lo,
		Table:     RouteTable,
		Type:      unix.RTN_LOCAL,
		Scope:     netlink.SCOPE_HOST,
	}
}

// applyRouting ensures the policy-routing rule and local route that carry
// replies on ztunnel-accepted connections back to ztunnel.
func applyRouting(h *netlink.Handle, fams []Family) (bool, error) {
	lo, err := h.LinkByName("lo")
	if err != nil {
		return false, fmt.Errorf("redirect: find lo: %w", err)
	}
	changed := false
	for _, f := range fams {
		has, err := hasMarkRule(h, f)
		if err != nil {
			return changed, err
		}
		if !has {
			if err := h.RuleAdd(markRule(f)); err != nil {
				return changed, fmt.Errorf("redirect: add %s policy rule: %w", f, err)
			}
			changed = true
		}
		routes, err := tableRoutes(h, f)
		if err != nil {
			return changed, err
		}
		want := localRoute(f, lo.Attrs().Index)
		if len(routes) == 1 && sameLocalRoute(routes[0], want) {
			continue
		}
		for _, r := range routes {
			if err := h.RouteDel(&r); err != nil && !errors.Is(err, unix.ESRCH) {
				return changed, fmt.Errorf("redirect: delete stale %s route in table %d: %w", f, RouteTable, err)
			}
		}
		if err := h.RouteAdd(want); err != nil {
			return changed, fmt.Errorf("redirect: add %s local route to table %d: %w", f, RouteTable, err)
		}
		changed = true
	}
	return changed, nil
}

func removeRouting(h *netlink.Handle) (bool, error) {
	changed := false
	for _, f := range []Family{IPv4, IPv6} {
		for {
			has, err := hasMarkRule(h, f)
			if err != nil || !has {
				if err != nil {
					return changed, err
				}
				break
			}
			if err := h.RuleDel(markRule(f)); err != nil {
				return changed, fmt.Errorf("redirect: delete %s policy rule: %w", f, err)
			}
			changed = true
		}
		routes, err := tableRoutes(h, f)
		if err != nil {
			return changed, err
		}
		for _, r := range routes {
			if err := h.RouteDel(&r); err != nil && !errors.Is(err, unix.ESRCH) {
				return changed, fmt.Errorf("redirect: delete %s route in table %d: %w", f, RouteTable, err)
			}
			changed = true
		}
	}
	return changed, nil
}

func hasMarkRule(h *netlink.Handle, f Family) (bool, error) {
	rules, err := h.RuleList(nlFamily(f))
	if err != nil {
		if errors.Is(err, unix.EAFNOSUPPORT) {
			return false, nil
		}
		return false, fmt.Errorf("redirect: list %s rules: %w", f, err)
	}
	return slices.ContainsFunc(rules, func(r netlink.Rule) bool {
		return r.Priority == RulePriority && r.Table == RouteTable && r.Mark == ConnMark &&
			r.Mask != nil && *r.Mask == MarkMask
	}), nil
}

func tableRoutes(h *netlink.Handle, f Family) ([]netlink.Route, error) {
	routes, err := h.RouteListFiltered(nlFamily(f), &netlink.Route{Table: RouteTable}, netlink.RT_FILTER_TABLE)
	if err != nil {
		if errors.Is(err, unix.EAFNOSUPPORT) {
			return nil, nil
		}
		return nil, fmt.Errorf("redirect: list %s routes of table %d: %w", f, RouteTable, err)
	}
	return routes, nil
}

func sameLocalRoute(r netlink.Route, want *netlink.Route) bool {
	isDefault := r.Dst == nil
	if !isDefault {
		ones, _ := r.Dst.Mask.Size()
		isDefault = ones == 0 && r.Dst.IP.IsUnspecified()
	}
	return isDefault && r.Type == want.Type && r.LinkIndex == want.LinkIndex
}
