package zds

import (
	"net"
	"os"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/inpod-dev/inpod/zds/zdspb"
)

// An agent descheduled past the ack deadline wakes with the Ack (read in
// time by the read loop) and the expired timer both ready. The Ack wins:
// a random pick would close the connection and fail every ADD in flight
// for a ztunnel that answered in time.
func TestAwaitTakesAnAckThatArrivedBeforeTheDeadlineWasSeen(t *testing.T) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	peer := os.NewFile(uintptr(fds[1]), "peer")
	defer peer.Close()
	f := os.NewFile(uintptr(fds[0]), "agent")
	fc, err := net.FileConn(f)
	f.Close()
	if err != nil {
		t.Fatal(err)
	}
	c := newConn(1, fc.(*net.UnixConn), time.Second, nil)
	defer c.uc.Close()
	r := &request{op: "add", uid: "uid-1"}
	// Enough rounds that a coin toss between the two would lose one.
	for i := range 200 {
		ackc := make(chan *zdspb.Ack, 1)
		ackc <- &zdspb.Ack{}
		expired := time.NewTimer(-1)
		if settled, err := c.await(nil, r, ackc, expired); !settled || err != nil {
			t.Fatalf("round %d: await = %v, %v; want the Ack taken", i, settled, err)
		}
	}
	select {
	case <-c.done:
		t.Fatalf("the connection was closed: %v", c.closeReason())
	default:
	}
}
