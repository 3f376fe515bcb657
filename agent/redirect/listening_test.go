package redirect_test

import (
	"context"
	"fmt"
	"net"
	"os"
	"slices"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	vnetns "github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/inpod-dev/inpod/agent/redirect"
	"github.com/inpod-dev/inpod/internal/testkit"
	"github.com/inpod-dev/inpod/netns"
	"github.com/inpod-dev/inpod/netns/netnstest"
)

// ztunnel's in-pod ports.
const (
	portOutbound = 15001
	portInbound  = 15006
	portHBONE    = 15008
	portDNS      = 15053
)

// listenIn binds a TCP listener inside ns (a socket keeps the namespace it
// was created in) and closes it at cleanup.
func listenIn(t testing.TB, ns *os.File, network, addr string) net.Listener {
	t.Helper()
	var l net.Listener
	if err := netns.Do(ns, func() (err error) {
		l, err = net.Listen(network, addr)
		return err
	}); err != nil {
		t.Fatalf("listen on %s %s in netns: %v", network, addr, err)
	}
	t.Cleanup(func() { l.Close() })
	return l
}

// socketIn makes a socket inside ns with the given system calls; it is
// closed at cleanup.
func socketIn(t *testing.T, ns *os.File, domain, typ int, setUp func(fd int) error) {
	t.Helper()
	if err := netns.Do(ns, func() error {
		fd, err := unix.Socket(domain, typ|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return err
		}
		t.Cleanup(func() { unix.Close(fd) })
		return setUp(fd)
	}); err != nil {
		t.Fatal(err)
	}
}

func expectMissing(t *testing.T, ns *os.File, ports []uint16, want ...uint16) {
	t.Helper()
	got, err := redirect.Listening(ns, ports)
	if err != nil {
		t.Fatalf("Listening(%v): %v", ports, err)
	}
	if !slices.Equal(got, want) {
		t.Fatalf("Listening(%v) missing %v, want %v", ports, got, want)
	}
}

// Every kind of listener counts, of either family, on a wildcard or a
// single address; the ports without one come back in the order given.
func TestListeningFindsTheNetnsListeners(t *testing.T) {
	pod := netnstest.New(t).Open(t)
	ports := []uint16{15021, portOutbound, portInbound, 80, portHBONE, portDNS}
	expectMissing(t, pod, ports, ports...)

	listenIn(t, pod, "tcp4", fmt.Sprintf("0.0.0.0:%d", portOutbound))
	// "tcp" on the wildcard is one [::] socket that takes IPv4 too, as
	// ztunnel binds its own: it is in the kernel's IPv6 table only.
	if l := listenIn(t, pod, "tcp", fmt.Sprintf(":%d", portInbound)); l.Addr().(*net.TCPAddr).IP.To4() != nil {
		t.Fatalf("want a dual-stack [::] listener, got %v", l.Addr())
	}
	listenIn(t, pod, "tcp6", fmt.Sprintf("[::]:%d", portHBONE)) // IPv6 only
	listenIn(t, pod, "tcp4", fmt.Sprintf("127.0.0.1:%d", portDNS))
	expectMissing(t, pod, ports, 15021, 80)
	expectMissing(t, pod, []uint16{portDNS, 80, portOutbound, 80}, 80, 80)
	expectMissing(t, pod, nil)

	// What a lookup at the loopback address cannot find, the dump does:
	// a listener on IPv6 loopback alone, and one on another address alone
	// (not one the pod has: bound with IP_FREEBIND).
	listenIn(t, pod, "tcp6", "[::1]:15021")
	socketIn(t, pod, unix.AF_INET, unix.SOCK_STREAM, func(fd int) error {
		if err := unix.SetsockoptInt(fd, unix.IPPROTO_IP, unix.IP_FREEBIND, 1); err != nil {
			return err
		}
		if err := unix.Bind(fd, &unix.SockaddrInet4{Addr: [4]byte{192, 0, 2, 7}, Port: 80}); err != nil {
			return err
		}
		return unix.Listen(fd, 1)
	})
	expectMissing(t, pod, ports)
}

// What listens in the caller's namespace, or in the machine's, is not the
// pod's: the dump reads the pod's table even when called from elsewhere.
func TestListeningIgnoresTheCallersNetns(t *testing.T) {
	callerNS, pod := netnstest.New(t).Open(t), netnstest.New(t).Open(t)
	listenIn(t, callerNS, "tcp", fmt.Sprintf(":%d", portOutbound))
	listenIn(t, pod, "tcp", fmt.Sprintf(":%d", portInbound))
	ports := []uint16{portOutbound, portInbound}

	var got []uint16
	err := netns.Do(callerNS, func() (err error) {
		got, err = redirect.Listening(pod, ports)
		return err
	})
	if err != nil || !slices.Equal(got, []uint16{portOutbound}) {
		t.Fatalf("from the caller's netns: missing %v (%v), want [%d]", got, err, portOutbound)
	}
	expectMissing(t, pod, ports, portOutbound)
	expectMissing(t, callerNS, ports, portInbound)
}

// A closed listener is missing, even while connections it accepted still
// hold its port: they are not listening.
func TestListeningClosedListenerIsMissing(t *testing.T) {
	pod := netnstest.New(t).Open(t)
	l := listenIn(t, pod, "tcp4", fmt.Sprintf("127.0.0.1:%d", portInbound))
	ports := []uint16{portInbound}
	expectMissing(t, pod, ports)

	var client net.Conn
	if err := netns.Do(pod, func() (err error) {
		client, err = net.DialTimeout("tcp4", l.Addr().String(), 5*time.Second)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	accepted, err := l.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer accepted.Close()
	l.Close()
	expectMissing(t, pod, ports, portInbound)
}

// A socket on the port that does not listen does not count: a connection's
// local end, a TCP socket only bound, a UDP socket.
func TestListeningIgnoresSocketsThatDoNotListen(t *testing.T) {
	pod := netnstest.New(t).Open(t)
	server := listenIn(t, pod, "tcp4", "127.0.0.1:20000")
	var client net.Conn
	if err := netns.Do(pod, func() (err error) {
		d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: portOutbound}, Timeout: 5 * time.Second}
		client, err = d.Dial("tcp4", server.Addr().String())
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	if got := client.LocalAddr().(*net.TCPAddr).Port; got != portOutbound {
		t.Fatalf("client bound to port %d", got)
	}
	accepted, err := server.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer accepted.Close()
	socketIn(t, pod, unix.AF_INET6, unix.SOCK_STREAM, func(fd int) error {
		return unix.Bind(fd, &unix.SockaddrInet6{Port: portInbound})
	})
	socketIn(t, pod, unix.AF_INET, unix.SOCK_DGRAM, func(fd int) error {
		return unix.Bind(fd, &unix.SockaddrInet4{Port: portDNS})
	})
	expectMissing(t, pod, []uint16{portOutbound, portInbound, portDNS, 20000}, portOutbound, portInbound, portDNS)
}

// A pod with IPv6 disabled has IPv4 listeners only, and no IPv6 to dump.
func TestListeningWithoutIPv6(t *testing.T) {
	pod := netnstest.New(t)
	for _, conf := range []string{"all", "default", "lo"} {
		pod.Exec(t, "sysctl", "-qw", "net.ipv6.conf."+conf+".disable_ipv6=1")
	}
	ns := pod.Open(t)
	listenIn(t, ns, "tcp4", fmt.Sprintf("0.0.0.0:%d", portOutbound))
	expectMissing(t, ns, []uint16{portOutbound, portInbound}, portInbound)
}

func TestListeningRefusesWhatIsNotANetns(t *testing.T) {
	netnstest.RequireRoot(t)
	devNull, err := os.Open(os.DevNull)
	if err != nil {
		t.Fatal(err)
	}
	defer devNull.Close()
	if _, err := redirect.Listening(devNull, []uint16{portOutbound}); err == nil {
		t.Error("Listening in /dev/null succeeded")
	}
	closed := netnstest.New(t).Open(t)
	closed.Close()
	if _, err := redirect.Listening(closed, []uint16{portOutbound}); err == nil {
		t.Error("Listening in a closed netns file succeeded")
	}
}

// A verifier calls Listening for every pod, again and again: a socket left
// open per call would run the agent out of descriptors and keep dead pods'
// namespaces alive.
func TestListeningLeaksNoFileDescriptors(t *testing.T) {
	pod := netnstest.New(t).Open(t)
	listenIn(t, pod, "tcp", fmt.Sprintf(":%d", portOutbound))
	noIPv6 := netnstest.New(t)
	noIPv6.Exec(t, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1")
	noIPv6NS := noIPv6.Open(t)
	devNull, err := os.Open(os.DevNull)
	if err != nil {
		t.Fatal(err)
	}
	defer devNull.Close()
	cycle := func() {
		t.Helper()
		for _, ns := range []*os.File{pod, noIPv6NS} {
			if _, err := redirect.Listening(ns, []uint16{portOutbound, portInbound}); err != nil {
				t.Fatal(err)
			}
		}
		if _, err := redirect.Listening(devNull, []uint16{portOutbound}); err == nil {
			t.Fatal("Listening in /dev/null succeeded")
		}
	}
	testkit.RequireNoFDLeak(t, 200, "cycles of Listening", cycle)
}

// BenchmarkListening is what the verifier pays per pod: one netns with
// ztunnel's four listeners, asked about those four ports. The library's
// SocketDiagTCP, which dumps every TCP socket with its tcp_info, runs
// alongside for comparison, in a pod idle and in one holding established
// connections (every one of which it reads and Listening skips).
func BenchmarkListening(b *testing.B) {
	pod := netnstest.New(b).Open(b)
	listenIn(b, pod, "tcp", fmt.Sprintf(":%d", portOutbound))
	listenIn(b, pod, "tcp", fmt.Sprintf(":%d", portInbound))
	listenIn(b, pod, "tcp", fmt.Sprintf(":%d", portHBONE))
	listenIn(b, pod, "tcp4", fmt.Sprintf("0.0.0.0:%d", portDNS))
	ports := []uint16{portOutbound, portInbound, portHBONE, portDNS}

	listening := func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			missing, err := redirect.Listening(pod, ports)
			if err != nil || len(missing) > 0 {
				b.Fatalf("missing %v (%v)", missing, err)
			}
		}
	}
	socketDiagTCP := func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			h, err := netlink.NewHandleAt(vnetns.NsHandle(int(pod.Fd())), unix.NETLINK_INET_DIAG)
			if err != nil {
				b.Fatal(err)
			}
			n := 0
			for _, af := range []uint8{unix.AF_INET, unix.AF_INET6} {
				socks, err := h.SocketDiagTCP(af)
				if err != nil {
					b.Fatal(err)
				}
				for _, s := range socks {
					if s.State == netlink.TCP_LISTEN && slices.Contains(ports, s.ID.SourcePort) {
						n++
					}
				}
			}
			h.Close()
			if n < len(ports) {
				b.Fatalf("%d listeners found", n)
			}
		}
	}
	b.Run("idle", listening)
	b.Run("idle/SocketDiagTCP", socketDiagTCP)
	connect(b, pod, fmt.Sprintf("127.0.0.1:%d", portInbound), 500)
	b.Run("500conns", listening)
	b.Run("500conns/SocketDiagTCP", socketDiagTCP)
}

// connect opens n connections to addr inside ns, none accepted (the
// kernel completes them all the same, up to the backlog), closed at cleanup.
func connect(b *testing.B, ns *os.File, addr string, n int) {
	b.Helper()
	err := netns.Do(ns, func() error {
		var d net.Dialer
		for range n {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			c, err := d.DialContext(ctx, "tcp4", addr)
			cancel()
			if err != nil {
				return err
			}
			b.Cleanup(func() { c.Close() })
		}
		return nil
	})
	if err != nil {
		b.Fatal(err)
	}
}
