package redirect

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"slices"

	"golang.org/x/sys/unix"

	"github.com/inpod-dev/inpod/netns"
)

// Listening reports which of ports have no TCP socket listening on them in
// the network namespace ns: missing lists them in the order of ports (a
// port given twice and missing is listed twice), nil when every port has a
// listener. A listener on any local address of either family counts, so an
// IPv6 wildcard socket that also takes IPv4 (dual-stack) counts once for the
// port, as does one bound to a single address. Sockets in any other state
// (connected, bound but not listening, the connections a closed listener
// accepted) do not.
//
// It is what a verifier asks of a running pod: are ztunnel's redirection
// targets still there? It proves that something listens on each port, not
// that ztunnel does: a process of the pod could bind these ports too.
//
// It reads the kernel's socket table through sock_diag (NETLINK_INET_DIAG).
// First by lookup, the way the kernel finds the socket a connection to
// 127.0.0.1 (then ::1) on the port would reach: all the lookups in one
// request, each a hash lookup however many sockets the namespace (or the
// node: the listener table is shared by every namespace) holds. That finds
// a wildcard listener, dual-stack or not, and one bound to loopback, which
// is how ztunnel binds its own. A port no lookup finds is then looked for
// in a dump of the TCP sockets the kernel filters to the LISTEN state,
// with no extensions (no tcp_info), which finds a listener on any other
// address but walks the node's whole listener table. Only the netlink
// socket is created inside ns, on a thread of its own (netns.Do); the
// calling thread never changes namespace, and the socket is closed before
// Listening returns. A namespace without IPv6 works: its IPv6 lookups find
// nothing and its IPv6 dump is empty, or refused as by a kernel without
// IPv6 (EAFNOSUPPORT, EINVAL, ENOENT), which Listening reads as no IPv6
// listener.
func Listening(ns *os.File, ports []uint16) (missing []uint16, err error) {
	if len(ports) == 0 {
		return nil, nil
	}
	nl, err := netns.OpenNetlink(ns, unix.NETLINK_INET_DIAG)
	if err != nil {
		return nil, fmt.Errorf("redirect: sock_diag: %w", err)
	}
	defer nl.Close()

	found := make([]bool, len(ports))
	mark := func(port uint16) {
		for i, p := range ports {
			if p == port {
				found[i] = true
			}
		}
	}
	unfound := func() (left []uint16) {
		for i, p := range ports {
			if !found[i] && !slices.Contains(left, p) {
				left = append(left, p)
			}
		}
		return left
	}
	for _, f := range []Family{IPv4, IPv6} {
		for _, port := range unfound() {
			// Not found, or a lookup the kernel refuses: left to the
			// dump, which says why.
			_ = lookUpListener(nl, f, port, mark)
		}
	}
	if len(unfound()) == 0 {
		return nil, nil
	}
	for _, f := range []Family{IPv4, IPv6} {
		af := uint8(unix.AF_INET)
		if f == IPv6 {
			af = unix.AF_INET6
		}
		err := dumpListeners(nl, af, mark)
		if err != nil && f == IPv6 && ipv6Absent(err) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("redirect: list the %s listeners of netns %s: %w", f, ns.Name(), err)
		}
	}
	for i, p := range ports {
		if !found[i] {
			missing = append(missing, p)
		}
	}
	return missing, nil
}

// The sock_diag ABI (linux/inet_diag.h, linux/sock_diag.h): a struct
// inet_diag_req_v2 asks; each answer is a struct inet_diag_msg.
const (
	inetDiagReqV2Len = 56 // family, protocol, ext, pad, states; inet_diag_sockid (48)
	inetDiagMsgLen   = 72 // family, state, timer, retrans; inet_diag_sockid; 5 × u32
	tcpListen        = 10 // TCP_LISTEN in include/net/tcp_states.h
	// A dump the kernel marks as interrupted (the table changed under it) is
	// read again, this many times at most.
	dumpAttempts = 3
)

// diagRequest is an inet_diag_req_v2 for TCP sockets of family in the
// LISTEN state, with no extensions (no tcp_info).
func diagRequest(family uint8) []byte {
	r := make([]byte, inetDiagReqV2Len)
	r[0] = family
	r[1] = unix.IPPROTO_TCP
	binary.NativeEndian.PutUint32(r[4:], 1<<tcpListen)
	return r
}

// listenerPort calls listener with the local port of a sock_diag answer
// that is a TCP listener.
func listenerPort(listener func(port uint16)) func(typ uint16, msg []byte) {
	return func(typ uint16, msg []byte) {
		// The kernel filtered on the state asked for; checked all the
		// same, as it costs nothing.
		if typ == unix.SOCK_DIAG_BY_FAMILY && len(msg) >= inetDiagMsgLen && msg[1] == tcpListen {
			listener(binary.BigEndian.Uint16(msg[4:])) // idiag_sport
		}
	}
}

// lookUpListener asks the kernel which socket a TCP connection to the
// loopback address of family on port would reach, and calls listener with
// port if it is a listener. unix.ENOENT: none.
func lookUpListener(nl *netns.Netlink, family Family, port uint16, listener func(port uint16)) error {
	r := diagRequest(unix.AF_INET)
	// inet_diag_sockid: sport, dport, src, dst, if, cookie. The kernel
	// looks up a connection from dst:dport to src:sport; dst and dport
	// stay zero, which only a listener accepts.
	binary.BigEndian.PutUint16(r[8:], port)
	if family == IPv4 {
		copy(r[12:], []byte{127, 0, 0, 1})
	} else {
		r[0] = unix.AF_INET6
		r[12+15] = 1 // ::1
	}
	// No cookie: whichever socket is found.
	binary.NativeEndian.PutUint32(r[48:], ^uint32(0))
	binary.NativeEndian.PutUint32(r[52:], ^uint32(0))
	return nl.Request(unix.SOCK_DIAG_BY_FAMILY, 0, r, listenerPort(listener))
}

// dumpListeners asks for the TCP sockets of family in the LISTEN state and
// calls listener with the local port of each. A dump interrupted and read
// again may name a port twice: listener only marks ports.
func dumpListeners(nl *netns.Netlink, family uint8, listener func(port uint16)) error {
	var err error
	for range dumpAttempts {
		err = nl.Request(unix.SOCK_DIAG_BY_FAMILY, unix.NLM_F_DUMP, diagRequest(family), listenerPort(listener))
		if !errors.Is(err, netns.ErrDumpInterrupted) {
			return err
		}
	}
	return err
}

// ipv6Absent reports the answers of a kernel or namespace without IPv6 to
// an IPv6 dump.
func ipv6Absent(err error) bool {
	return errors.Is(err, unix.EAFNOSUPPORT) || errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOENT)
}
