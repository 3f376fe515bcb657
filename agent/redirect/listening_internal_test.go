package redirect

import (
	"errors"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/inpod-dev/inpod/netns/netnstest"
)

// A dump the kernel refuses comes back as its errno, which is how an IPv6
// dump on a kernel without IPv6 is recognised (ipv6Absent), and the socket
// still answers the next request: a family past AF_MAX is refused with
// EINVAL like the IPv6 dump of such a kernel.
func TestDumpReturnsTheKernelsRefusal(t *testing.T) {
	ns := netnstest.New(t).Open(t)
	fd, err := inetDiagSocketIn(ns)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	buf := make([]byte, diagRecvBuf)
	err = dumpListeners(fd, buf, 255, 1, func(uint16) { t.Error("a listener in a refused dump") })
	if !errors.Is(err, unix.EINVAL) || !ipv6Absent(err) {
		t.Fatalf("dump of family 255 = %v, want EINVAL", err)
	}
	if err := dumpListeners(fd, buf, unix.AF_INET, 2, func(uint16) {}); err != nil {
		t.Fatalf("dump after a refused one: %v", err)
	}
}
