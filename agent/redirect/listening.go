package redirect

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"

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
// It reads the kernel's socket table through sock_diag (NETLINK_INET_DIAG),
// a dump of TCP sockets filtered by the kernel to the LISTEN state, with no
// extensions (no tcp_info): on a busy pod the established connections and
// their counters are most of the table, and none of them is needed. Only
// the netlink socket is created inside ns, on a thread of its own
// (netns.Do); the calling thread never changes namespace, and the socket is
// closed before Listening returns. A namespace without IPv6 works: its IPv6
// dump is empty, or refused as by a kernel without IPv6 (EAFNOSUPPORT,
// EINVAL, ENOENT), which Listening reads as no IPv6 listener.
func Listening(ns *os.File, ports []uint16) (missing []uint16, err error) {
	if len(ports) == 0 {
		return nil, nil
	}
	fd, err := inetDiagSocketIn(ns)
	if err != nil {
		return nil, err
	}
	defer unix.Close(fd)

	found := make([]bool, len(ports))
	mark := func(port uint16) {
		for i, p := range ports {
			if p == port {
				found[i] = true
			}
		}
	}
	buf := make([]byte, diagRecvBuf)
	for i, f := range []Family{IPv4, IPv6} {
		af := uint8(unix.AF_INET)
		if f == IPv6 {
			af = unix.AF_INET6
		}
		err := dumpListeners(fd, buf, af, uint32(i+1), mark)
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

// inetDiagSocketIn opens a sock_diag socket that reads the socket table of
// ns. A netlink socket answers for the namespace it was created in, so only
// socket(2) runs in ns, on netns.Do's thread, which is discarded rather than
// reused should it fail to return.
func inetDiagSocketIn(ns *os.File) (int, error) {
	fd := -1
	err := netns.Do(ns, func() error {
		var err error
		fd, err = unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_INET_DIAG)
		return err
	})
	if err != nil {
		if fd >= 0 { // created, then the thread failed to come back
			unix.Close(fd)
		}
		return -1, fmt.Errorf("redirect: sock_diag socket in netns %s: %w", ns.Name(), err)
	}
	// Connected to the kernel, the socket takes no message another process
	// of the pod could send it (a forged listener).
	if err := unix.Connect(fd, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		unix.Close(fd)
		return -1, fmt.Errorf("redirect: connect sock_diag socket: %w", err)
	}
	return fd, nil
}

// The sock_diag ABI (linux/inet_diag.h, linux/sock_diag.h): a struct
// inet_diag_req_v2 after the netlink header asks; each answer is a struct
// inet_diag_msg after its header.
const (
	nlmsgHdrLen      = unix.SizeofNlMsghdr // 16
	inetDiagReqV2Len = 56                  // family, protocol, ext, pad, states; inet_diag_sockid (48)
	inetDiagMsgLen   = 72                  // family, state, timer, retrans; inet_diag_sockid; 5 × u32
	tcpListen        = 10                  // TCP_LISTEN in include/net/tcp_states.h
	// diagRecvBuf holds any datagram of a dump: the kernel fills each up to
	// the largest buffer its reader has offered, capped at 32 KiB, or one
	// page (NLMSG_GOODSIZE, at most 8 KiB) before the first read.
	diagRecvBuf = 32 << 10
	// A dump the kernel marks as interrupted (the table changed under it) is
	// read again, this many times at most.
	dumpAttempts = 3
)

var errDumpInterrupted = errors.New("sock_diag dump interrupted")

// dumpListeners asks for the TCP sockets of family in the LISTEN state and
// calls listener with the local port of each.
func dumpListeners(fd int, buf []byte, family uint8, seq uint32, listener func(port uint16)) error {
	var err error
	for range dumpAttempts {
		if err = dumpOnce(fd, buf, family, seq, listener); !errors.Is(err, errDumpInterrupted) {
			return err
		}
	}
	return err
}

func dumpOnce(fd int, buf []byte, family uint8, seq uint32, listener func(port uint16)) error {
	var req [nlmsgHdrLen + inetDiagReqV2Len]byte
	ne := binary.NativeEndian
	ne.PutUint32(req[0:], uint32(len(req)))
	ne.PutUint16(req[4:], unix.SOCK_DIAG_BY_FAMILY)
	ne.PutUint16(req[6:], unix.NLM_F_REQUEST|unix.NLM_F_DUMP)
	ne.PutUint32(req[8:], seq)
	// req[12:16], the port id, is 0: the kernel fills in ours.
	r := req[nlmsgHdrLen:]
	r[0] = family
	r[1] = unix.IPPROTO_TCP
	// r[2], the extensions asked for, stays 0: none.
	ne.PutUint32(r[4:], 1<<tcpListen)
	// The socket id stays zero: every socket of the family in those states.
	if err := unix.Send(fd, req[:], 0); err != nil {
		return err
	}

	// A dump's listeners go to listener as they come, so one interrupted
	// and read again may name a port twice: listener only marks ports.
	interrupted := false
	for {
		n, from, err := unix.Recvfrom(fd, buf, unix.MSG_TRUNC)
		if err != nil {
			if errors.Is(err, unix.EINTR) {
				continue
			}
			return err
		}
		if sa, ok := from.(*unix.SockaddrNetlink); !ok || sa.Pid != 0 {
			continue // not from the kernel (a connected socket takes none)
		}
		if n > len(buf) {
			return fmt.Errorf("sock_diag answer of %d bytes overflows the %d-byte buffer", n, len(buf))
		}
		for b := buf[:n]; len(b) >= nlmsgHdrLen; {
			msgLen := int(ne.Uint32(b[0:]))
			if msgLen < nlmsgHdrLen || msgLen > len(b) {
				return fmt.Errorf("malformed sock_diag answer: message of %d bytes in %d", msgLen, len(b))
			}
			typ, flags, msgSeq := ne.Uint16(b[4:]), ne.Uint16(b[6:]), ne.Uint32(b[8:])
			payload := b[nlmsgHdrLen:msgLen]
			b = b[min(nlmAlign(msgLen), len(b)):]
			if msgSeq != seq {
				continue // an answer to an earlier request of ours
			}
			if flags&unix.NLM_F_DUMP_INTR != 0 {
				interrupted = true
			}
			switch typ {
			case unix.NLMSG_DONE, unix.NLMSG_ERROR:
				// Both carry an int: 0, or a negated errno.
				if len(payload) >= 4 {
					if errno := int32(ne.Uint32(payload)); errno != 0 {
						return unix.Errno(-errno)
					}
				}
				if interrupted {
					return errDumpInterrupted
				}
				return nil
			case unix.SOCK_DIAG_BY_FAMILY:
				if len(payload) < inetDiagMsgLen {
					return fmt.Errorf("malformed sock_diag answer: inet_diag_msg of %d bytes", len(payload))
				}
				// The kernel filtered on the state asked for; checked
				// all the same, as it costs nothing.
				if payload[1] == tcpListen {
					listener(binary.BigEndian.Uint16(payload[4:])) // idiag_sport
				}
			}
		}
	}
}

func nlmAlign(n int) int { return (n + unix.NLMSG_ALIGNTO - 1) &^ (unix.NLMSG_ALIGNTO - 1) }

// ipv6Absent reports the answers of a kernel or namespace without IPv6 to
// an IPv6 dump.
func ipv6Absent(err error) bool {
	return errors.Is(err, unix.EAFNOSUPPORT) || errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOENT)
}
