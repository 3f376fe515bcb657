package zdstest

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strconv"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/inpod-dev/inpod/netns"
)

// soOriginalDst is SO_ORIGINAL_DST (and IP6T_SO_ORIGINAL_DST), 80 at both
// SOL_IP and SOL_IPV6.
const soOriginalDst = 80

// listen binds the workload's listeners inside its netns. Sockets keep the
// namespace they were created in, so only the socket() and bind() calls need
// the thread to be in the pod netns; accepting happens anywhere.
func (z *Standin) listen(w *workload) error {
	ports := []int{PortOutbound, PortInbound, PortHBONE}
	if z.cfg.DNS {
		ports = append(ports, PortDNS)
	}
	return netns.Do(w.netns, func() error {
		for _, port := range ports {
			for _, network := range []string{"tcp4", "tcp6"} {
				ln, err := listenConfig.Listen(context.Background(), network, listenAddr(network, port))
				if err != nil {
					if network == "tcp6" && ipv6Unavailable(err) {
						continue
					}
					return fmt.Errorf("listen %s/%d: %w", network, port, err)
				}
				w.listeners = append(w.listeners, ln)
				go z.serve(w.info.UID, port, ln)
			}
			if port == PortDNS {
				pc, err := listenConfig.ListenPacket(context.Background(), "udp4", listenAddr("udp4", port))
				if err != nil {
					return fmt.Errorf("listen udp/%d: %w", port, err)
				}
				w.listeners = append(w.listeners, pc)
			}
		}
		return nil
	})
}

func listenAddr(network string, port int) string {
	host := "0.0.0.0"
	if network == "tcp6" {
		host = "::"
	}
	return net.JoinHostPort(host, strconv.Itoa(port))
}

// listenConfig marks every socket as ztunnel does, so the redirection rules
// that exempt mark 0x539 see the stand-in's traffic as ztunnel's, and lets
// several workloads in one netns (and a replaced proxy) share the port.
var listenConfig = net.ListenConfig{Control: func(network, address string, rc syscall.RawConn) error {
	var err error
	cerr := rc.Control(func(fd uintptr) {
		if err = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_MARK, Mark); err != nil {
			return
		}
		if err = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_REUSEPORT, 1); err != nil {
			return
		}
		if network == "tcp6" {
			err = unix.SetsockoptInt(int(fd), unix.IPPROTO_IPV6, unix.IPV6_V6ONLY, 1)
		}
	})
	return errors.Join(cerr, err)
}}

func ipv6Unavailable(err error) bool {
	return errors.Is(err, unix.EADDRNOTAVAIL) || errors.Is(err, unix.EAFNOSUPPORT)
}

func (z *Standin) serve(uid string, port int, ln net.Listener) {
	for {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		orig := OriginalDst(c.(*net.TCPConn))
		z.mu.Lock()
		z.accepted = append(z.accepted, Accepted{UID: uid, Port: port, OrigDst: orig, Peer: c.RemoteAddr().String(), Received: time.Now()})
		z.mu.Unlock()
		c.SetWriteDeadline(time.Now().Add(time.Second))
		fmt.Fprintf(c, "ztunnel-standin port=%d orig=%s peer=%s\n", port, orig, c.RemoteAddr())
		c.Close()
	}
}

// OriginalDst is the destination a connection had before netfilter
// redirected it, or its local address when it was not redirected.
func OriginalDst(c *net.TCPConn) string {
	rc, err := c.SyscallConn()
	if err != nil {
		return "error:" + err.Error()
	}
	var out string
	rc.Control(func(fd uintptr) {
		local := c.LocalAddr().(*net.TCPAddr)
		if local.IP.To4() != nil {
			var sa unix.RawSockaddrInet4
			l := uint32(unsafe.Sizeof(sa))
			if err := getsockopt(int(fd), unix.SOL_IP, soOriginalDst, unsafe.Pointer(&sa), &l); err != nil {
				out = local.String()
				return
			}
			out = netip.AddrPortFrom(netip.AddrFrom4(sa.Addr), netPort(sa.Port)).String()
			return
		}
		var sa unix.RawSockaddrInet6
		l := uint32(unsafe.Sizeof(sa))
		if err := getsockopt(int(fd), unix.SOL_IPV6, soOriginalDst, unsafe.Pointer(&sa), &l); err != nil {
			out = local.String()
			return
		}
		out = netip.AddrPortFrom(netip.AddrFrom16(sa.Addr), netPort(sa.Port)).String()
	})
	return out
}

// netPort reads a sockaddr's port, stored in network byte order.
func netPort(p uint16) uint16 {
	b := (*[2]byte)(unsafe.Pointer(&p))
	return binary.BigEndian.Uint16(b[:])
}

func getsockopt(fd, level, opt int, val unsafe.Pointer, l *uint32) error {
	_, _, e := unix.Syscall6(unix.SYS_GETSOCKOPT, uintptr(fd), uintptr(level), uintptr(opt), uintptr(val), uintptr(unsafe.Pointer(l)), 0)
	if e != 0 {
		return e
	}
	return nil
}
