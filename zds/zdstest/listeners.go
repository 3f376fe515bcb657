package zdstest

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"runtime"
	"sync"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// soOriginalDst is SO_ORIGINAL_DST (and IP6T_SO_ORIGINAL_DST), 80 at both
// SOL_IP and SOL_IPV6.
const soOriginalDst = 80

// nsSwitch enters pod netns from the session's goroutine: it locks the
// goroutine to its thread only for the switch, so an Add costs no goroutine
// hop and no new thread. host is the netns the stand-in's threads run in, to
// which each switch returns.
type nsSwitch struct {
	host   *os.File
	broken bool
}

func newNSSwitch() (*nsSwitch, error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	host, err := os.Open("/proc/thread-self/ns/net")
	if err != nil {
		return nil, fmt.Errorf("open the stand-in's own netns: %w", err)
	}
	return &nsSwitch{host: host}, nil
}

// in runs fn with the calling goroutine's thread in the netns ns, and brings
// it back. Sockets keep the namespace they were created in, so only socket()
// and bind() need the switch. A thread that cannot be brought back stays
// locked: the caller must end its goroutine (see poisoned), and the runtime
// then discards the thread instead of reusing it in the wrong netns.
func (sw *nsSwitch) in(ns *os.File, fn func() error) error {
	runtime.LockOSThread()
	if err := unix.Setns(int(ns.Fd()), unix.CLONE_NEWNET); err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("enter netns %s: %w", ns.Name(), err)
	}
	fnErr := fn()
	if err := unix.Setns(int(sw.host.Fd()), unix.CLONE_NEWNET); err != nil {
		sw.broken = true
		return errors.Join(fnErr, fmt.Errorf("return to the stand-in's netns: %w", err))
	}
	runtime.UnlockOSThread()
	return fnErr
}

func (sw *nsSwitch) poisoned() bool { return sw.broken }

func (sw *nsSwitch) close() { sw.host.Close() }

// ports are the listeners ztunnel binds in a pod, in binding order.
func (z *Standin) ports() []int {
	ports := []int{PortOutbound, PortInbound, PortHBONE}
	if z.cfg.DNS {
		ports = append(ports, PortDNS)
	}
	return ports
}

// listen binds the workload's listeners inside its netns, on the session's
// thread: each a socket marked and bound as ztunnel's, listening before the
// Ack goes out. Only the system calls that make the sockets are on the Ack's
// path; serveAll hands the TCP ones to the acceptor afterwards.
//
// One TCP socket per port, as ztunnel binds them: on its wildcard address,
// [::] dual-stack (it takes IPv4 too, as v4-mapped addresses), or 0.0.0.0
// where the pod's netns has no IPv6.
func (z *Standin) listen(sw *nsSwitch, w *workload) error {
	return sw.in(w.netns, func() error {
		for _, port := range z.ports() {
			l, err := newSocket(port, true, true)
			if err != nil && ipv6Unavailable(err) {
				l, err = newSocket(port, false, true)
			}
			if err != nil {
				return err
			}
			w.listeners = append(w.listeners, l)
			if port == PortDNS {
				l, err := newSocket(port, false, false)
				if err != nil {
					return err
				}
				w.listeners = append(w.listeners, l)
			}
		}
		return nil
	})
}

// boundSocket is a socket bound (and, for TCP, listening) on the session's
// thread. The acceptor answers its connections once it is served; Close may
// come first, from a Del, or while the acceptor is accepting on it.
type boundSocket struct {
	port int
	tcp  bool

	mu      sync.Mutex
	fd      int    // -1 once closed
	unserve func() // set once the acceptor serves it
}

// socketOpts are ztunnel's on every in-pod socket: its mark, so the rules
// that exempt mark 0x539 see the stand-in's traffic as ztunnel's, and
// SO_REUSEPORT, so several workloads in one netns (and a replaced proxy)
// share the port; SO_REUSEADDR as Go and tokio set it on listeners.
var socketOpts = [][2]int{{unix.SO_REUSEADDR, 1}, {unix.SO_MARK, Mark}, {unix.SO_REUSEPORT, 1}}

// newSocket makes a TCP listener or a UDP socket on the wildcard address:
// 0.0.0.0, or [::] taking both families. Plain TCP, as ztunnel's (not MPTCP,
// Go's default for its own listeners where the kernel has it).
func newSocket(port int, v6, tcp bool) (*boundSocket, error) {
	family, sa := unix.AF_INET, unix.Sockaddr(&unix.SockaddrInet4{Port: port})
	what := "4"
	if v6 {
		family, sa, what = unix.AF_INET6, &unix.SockaddrInet6{Port: port}, "6"
	}
	typ := unix.SOCK_STREAM
	if what = "tcp" + what; !tcp {
		typ, what = unix.SOCK_DGRAM, "udp"+what[3:]
	}
	fd, err := unix.Socket(family, typ|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("socket %s/%d: %w", what, port, err)
	}
	fail := func(op string, err error) (*boundSocket, error) {
		unix.Close(fd)
		return nil, fmt.Errorf("%s %s/%d: %w", op, what, port, err)
	}
	for _, o := range socketOpts {
		if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, o[0], o[1]); err != nil {
			return fail("setsockopt", err)
		}
	}
	if v6 {
		// Explicitly: net.ipv6.bindv6only may default to IPv6 only.
		if err := unix.SetsockoptInt(fd, unix.IPPROTO_IPV6, unix.IPV6_V6ONLY, 0); err != nil {
			return fail("setsockopt", err)
		}
	}
	if err := unix.Bind(fd, sa); err != nil {
		return fail("bind", err)
	}
	if tcp {
		if err := unix.Listen(fd, unix.SOMAXCONN); err != nil {
			return fail("listen", err)
		}
	}
	return &boundSocket{port: port, tcp: tcp, fd: fd}, nil
}

// Close closes the socket, whether or not it is being served yet. Under mu,
// so the acceptor never accepts on a closed (and maybe reused) fd number;
// closing the only reference also takes the fd out of the acceptor's epoll.
func (b *boundSocket) Close() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.fd < 0 {
		return nil
	}
	err := unix.Close(b.fd)
	b.fd = -1
	if b.unserve != nil {
		b.unserve()
	}
	return err
}

// serveAll starts answering on w's TCP listeners.
func (z *Standin) serveAll(w *workload) {
	for _, l := range w.listeners {
		if b, ok := l.(*boundSocket); ok && b.tcp {
			if err := z.acceptor.serve(w.info.UID, b); err != nil {
				z.log.Error("cannot serve a listener; its connections stay queued", "uid", w.info.UID, "port", b.port, "err", err)
			}
		}
	}
}

func ipv6Unavailable(err error) bool {
	return errors.Is(err, unix.EADDRNOTAVAIL) || errors.Is(err, unix.EAFNOSUPPORT)
}

// answer tells the peer of one accepted connection what the stand-in saw:
// the port, the connection's original destination and its peer. The line is
// short and the socket's send buffer empty, so the write does not block (a
// peer that never reads is cut off by the send timeout).
func (z *Standin) answer(uid string, port, fd int) {
	defer unix.Close(fd)
	orig, peer := originalDst(fd), peerOf(fd)
	z.mu.Lock()
	z.accepted = append(z.accepted, Accepted{UID: uid, Port: port, OrigDst: orig, Peer: peer, Received: time.Now()})
	z.mu.Unlock()
	unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_SNDTIMEO, &unix.Timeval{Sec: 1})
	unix.Write(fd, fmt.Appendf(nil, "ztunnel-standin port=%d orig=%s peer=%s\n", port, orig, peer))
}

// OriginalDst is the destination a connection had before netfilter
// redirected it, or its local address when it was not redirected.
func OriginalDst(c *net.TCPConn) string {
	rc, err := c.SyscallConn()
	if err != nil {
		return "error:" + err.Error()
	}
	var out string
	rc.Control(func(fd uintptr) { out = originalDst(int(fd)) })
	return out
}

func originalDst(fd int) string {
	sa, err := unix.Getsockname(fd)
	if err != nil {
		return "error:" + err.Error()
	}
	local := addrPort(sa)
	// IPv4 traffic on a dual-stack socket has a v4-mapped address (which
	// addrPort unmaps); its conntrack entry, and so its original
	// destination, is IPv4.
	if local.Addr().Is4() {
		var sa unix.RawSockaddrInet4
		l := uint32(unsafe.Sizeof(sa))
		if err := getsockopt(fd, unix.SOL_IP, soOriginalDst, unsafe.Pointer(&sa), &l); err != nil {
			return local.String()
		}
		return netip.AddrPortFrom(netip.AddrFrom4(sa.Addr), netPort(sa.Port)).String()
	}
	var raw unix.RawSockaddrInet6
	l := uint32(unsafe.Sizeof(raw))
	if err := getsockopt(fd, unix.SOL_IPV6, soOriginalDst, unsafe.Pointer(&raw), &l); err != nil {
		return local.String()
	}
	return netip.AddrPortFrom(netip.AddrFrom16(raw.Addr), netPort(raw.Port)).String()
}

func peerOf(fd int) string {
	sa, err := unix.Getpeername(fd)
	if err != nil {
		return "error:" + err.Error()
	}
	return addrPort(sa).String()
}

// addrPort is an inet sockaddr's address and port, a v4-mapped address
// unmapped, so that it prints as net.TCPAddr.String does.
func addrPort(sa unix.Sockaddr) netip.AddrPort {
	switch a := sa.(type) {
	case *unix.SockaddrInet4:
		return netip.AddrPortFrom(netip.AddrFrom4(a.Addr), uint16(a.Port))
	case *unix.SockaddrInet6:
		return netip.AddrPortFrom(netip.AddrFrom16(a.Addr).Unmap(), uint16(a.Port))
	}
	return netip.AddrPort{}
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

// BindListeners enters ns and binds the listeners an Add binds there, as
// the session does before it acks; release closes them. For benchmarks: it
// is the stand-in's own share of an Add→Ack, which ztunnel pays as well.
// An error that says the thread could not come back from ns leaves the
// caller's goroutine locked to that thread: the caller must end it (a
// benchmark's Fatal does), so the runtime discards the thread.
func (z *Standin) BindListeners(ns *os.File) (release func(), err error) {
	sw, err := newNSSwitch()
	if err != nil {
		return nil, err
	}
	defer sw.close()
	w := &workload{netns: ns}
	err = z.listen(sw, w)
	if sw.poisoned() {
		err = errors.Join(err, errors.New("could not return the thread to its own netns"))
	}
	release = func() {
		for _, l := range w.listeners {
			l.Close()
		}
	}
	if err != nil {
		release()
		return nil, err
	}
	return release, nil
}
