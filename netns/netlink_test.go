package netns_test

import (
	"encoding/binary"
	"errors"
	"os"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/inpod-dev/inpod/internal/testkit"
	"github.com/inpod-dev/inpod/netns"
	"github.com/inpod-dev/inpod/netns/netnstest"
)

// ifinfomsg asks about the link of index (0: every link).
func ifinfomsg(index int32) []byte {
	m := make([]byte, unix.SizeofIfInfomsg)
	binary.NativeEndian.PutUint32(m[4:], uint32(index))
	return m
}

// A socket made in a namespace answers for it, from the caller's thread:
// a fresh namespace has one link, lo, where the caller's has more. A dump
// ends at NLMSG_DONE, a plain request at its one answer, a refused one
// with the kernel's errno; the socket answers the next request after each.
func TestNetlinkAnswersForItsNamespace(t *testing.T) {
	netnstest.RequireRoot(t)
	ns := netnstest.New(t).Open(t)
	nl, err := netns.OpenNetlink(ns, unix.NETLINK_ROUTE)
	if err != nil {
		t.Fatal(err)
	}
	defer nl.Close()

	var links []int32
	link := func(typ uint16, msg []byte) {
		if typ == unix.RTM_NEWLINK && len(msg) >= unix.SizeofIfInfomsg {
			links = append(links, int32(binary.NativeEndian.Uint32(msg[4:])))
		}
	}
	if err := nl.Request(unix.RTM_GETLINK, unix.NLM_F_DUMP, ifinfomsg(0), link); err != nil {
		t.Fatal(err)
	}
	if len(links) != 1 || links[0] != 1 {
		t.Fatalf("links of a fresh netns: %v, want lo (1) alone", links)
	}

	err = nl.Request(unix.RTM_GETLINK, 0, ifinfomsg(4242), link)
	if !errors.Is(err, unix.ENODEV) {
		t.Fatalf("a link that is not there: %v, want ENODEV", err)
	}

	links = nil
	if err := nl.Request(unix.RTM_GETLINK, 0, ifinfomsg(1), link); err != nil {
		t.Fatal(err)
	}
	if len(links) != 1 || links[0] != 1 {
		t.Fatalf("lo asked for alone: %v", links)
	}
}

// The verifier opens three of these per pod every period: none may stay.
func TestNetlinkLeaksNoFileDescriptors(t *testing.T) {
	netnstest.RequireRoot(t)
	ns := netnstest.New(t).Open(t)
	testkit.RequireNoFDLeak(t, 200, "netlink sockets opened, used and closed", func() {
		nl, err := netns.OpenNetlink(ns, unix.NETLINK_ROUTE)
		if err != nil {
			t.Fatal(err)
		}
		defer nl.Close()
		if err := nl.Request(unix.RTM_GETLINK, unix.NLM_F_DUMP, ifinfomsg(0), func(uint16, []byte) {}); err != nil {
			t.Fatal(err)
		}
	})
}

// A file that is not a network namespace is refused before anything is
// opened.
func TestOpenNetlinkRefusesWhatIsNotANetns(t *testing.T) {
	f, err := os.Open("/proc/self/ns/uts")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := netns.OpenNetlink(f, unix.NETLINK_ROUTE); !errors.Is(err, netns.ErrNotNetNS) {
		t.Fatalf("OpenNetlink(uts namespace) = %v, want ErrNotNetNS", err)
	}
}
