package redirect

import (
	"errors"
	"net"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/inpod-dev/inpod/netns"
	"github.com/inpod-dev/inpod/netns/netnstest"
)

// A dump the kernel refuses comes back as its errno, which is how an IPv6
// dump on a kernel without IPv6 is recognised (ipv6Absent), and the socket
// still answers the next request: a family past AF_MAX is refused with
// EINVAL like the IPv6 dump of such a kernel.
func TestDumpReturnsTheKernelsRefusal(t *testing.T) {
	ns := netnstest.New(t).Open(t)
	nl, err := netns.OpenNetlink(ns, unix.NETLINK_INET_DIAG)
	if err != nil {
		t.Fatal(err)
	}
	defer nl.Close()
	err = dumpListeners(nl, 255, func(uint16) { t.Error("a listener in a refused dump") })
	if !errors.Is(err, unix.EINVAL) || !ipv6Absent(err) {
		t.Fatalf("dump of family 255 = %v, want EINVAL", err)
	}
	if err := dumpListeners(nl, unix.AF_INET, func(uint16) {}); err != nil {
		t.Fatalf("dump after a refused one: %v", err)
	}
}

// The lookup finds what ztunnel binds without walking the node's listener
// table: a wildcard listener of either kind, or one on loopback, is found
// at 127.0.0.1 (a dual-stack [::] socket too); an IPv6-only one at ::1.
// Nothing else is: a connection's port, or a port nothing listens on.
func TestLookUpFindsWildcardAndLoopbackListeners(t *testing.T) {
	pod := netnstest.New(t).Open(t)
	listen := func(network, addr string) {
		t.Helper()
		var l net.Listener
		if err := netns.Do(pod, func() (err error) {
			l, err = net.Listen(network, addr)
			return err
		}); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { l.Close() })
	}
	listen("tcp4", "0.0.0.0:15001")
	listen("tcp", ":15006") // [::], dual-stack
	listen("tcp4", "127.0.0.1:15053")
	listen("tcp6", "[::]:15008") // IPv6 only

	nl, err := netns.OpenNetlink(pod, unix.NETLINK_INET_DIAG)
	if err != nil {
		t.Fatal(err)
	}
	defer nl.Close()
	for _, c := range []struct {
		family Family
		port   uint16
		found  bool
	}{
		{IPv4, 15001, true}, {IPv4, 15006, true}, {IPv4, 15053, true}, {IPv4, 15008, false}, {IPv4, 80, false},
		{IPv6, 15006, true}, {IPv6, 15008, true}, {IPv6, 15001, false}, {IPv6, 15053, false},
	} {
		found := false
		err := lookUpListener(nl, c.family, c.port, func(p uint16) { found = p == c.port })
		if found != c.found {
			t.Errorf("lookup of %s port %d: found %v (%v), want %v", c.family, c.port, found, err, c.found)
		}
		if !found && !errors.Is(err, unix.ENOENT) {
			t.Errorf("lookup of %s port %d found nothing: %v, want ENOENT", c.family, c.port, err)
		}
	}
}
