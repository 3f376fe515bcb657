package zds

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"os"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"

	"github.com/inpod-dev/inpod/internal/testkit"
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

// connPair is a conn (its read loop running, the turn open, as after a
// snapshot) and the peer end of its socket.
func connPair(t *testing.T, ackTimeout time.Duration) (*conn, *net.UnixConn) {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	files := []*os.File{os.NewFile(uintptr(fds[0]), "agent"), os.NewFile(uintptr(fds[1]), "peer")}
	var ends []*net.UnixConn
	for _, f := range files {
		fc, err := net.FileConn(f)
		f.Close()
		if err != nil {
			t.Fatal(err)
		}
		ends = append(ends, fc.(*net.UnixConn))
	}
	c := newConn(1, ends[0], ackTimeout, slog.New(slog.DiscardHandler))
	t.Cleanup(func() { c.fail(nil); ends[1].Close() })
	go c.readLoop()
	c.release()
	return c, ends[1]
}

func strayAck(t *testing.T) []byte {
	b, err := proto.Marshal(&zdspb.WorkloadResponse{Payload: &zdspb.WorkloadResponse_Ack{Ack: &zdspb.Ack{}}})
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func inFlightNow(c *conn) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.waiting != nil
}

// An Ack the peer sends unasked, while a request's write is failing, is
// paired with that request by the read loop, which hands the turn on. The
// sender must not hand it on a second time: that blocked it for good, and
// on a live connection it made two tokens, two requests in flight at once
// and acks credited to the wrong pods. The connection is closed instead.
func TestAStrayAckDuringAFailingSendClosesTheConnectionOnce(t *testing.T) {
	c, peer := connPair(t, 300*time.Millisecond)
	// Fill the peer's queue so the next write blocks until its deadline.
	c.uc.SetWriteDeadline(time.Now().Add(100 * time.Millisecond))
	for {
		if _, _, err := c.uc.WriteMsgUnix(make([]byte, 512), nil, nil); err != nil {
			break
		}
	}
	errc := make(chan error, 1)
	go func() { errc <- c.do(context.Background(), &request{op: "add", uid: "uid-a", payload: []byte("x")}) }()
	testkit.Eventually(t, 5*time.Second, "the request in flight", func() bool { return inFlightNow(c) })
	if _, err := peer.Write(strayAck(t)); err != nil {
		t.Fatal(err)
	}
	var err error
	testkit.Eventually(t, 5*time.Second, "do to return", func() bool {
		select {
		case err = <-errc:
			return true
		default:
			return false
		}
	})
	if !errors.Is(err, ErrConnectionClosed) {
		t.Errorf("do = %v, want ErrConnectionClosed", err)
	}
	select {
	case <-c.done:
	default:
		t.Error("the connection is still open after an ack for a request that was never sent")
	}
	if n := len(c.turn); n > 1 {
		t.Errorf("the turn holds %d tokens", n)
	}
}

// The same with a request whose netns was closed (nothing written, which
// otherwise keeps the connection): whoever settles the request gives the
// turn back, once, so the connection ends up closed or with exactly one
// token, never two (two requests in flight at once) or none.
func TestAStrayAckDuringANetNSClosedSendLeavesOneTurn(t *testing.T) {
	for i := range 300 {
		c, peer := connPair(t, 2*time.Second)
		closed, err := os.Open(os.DevNull)
		if err != nil {
			t.Fatal(err)
		}
		closed.Close()
		wrote := make(chan struct{})
		go func() { peer.Write(strayAck(t)); close(wrote) }()
		errc := make(chan error, 1)
		go func() {
			errc <- c.do(context.Background(), &request{op: "add", uid: "a", payload: []byte("x"), netns: closed})
		}()
		<-wrote
		select {
		case <-errc:
		case <-time.After(5 * time.Second):
			t.Fatalf("round %d: do stuck giving the turn back", i)
		}
		select {
		case <-c.done:
		case <-c.turn:
			// Absence of a second token can only be watched for a while.
			select {
			case <-c.turn:
				t.Fatalf("round %d: a second token: two requests could go out at once", i)
			case <-c.done:
			case <-time.After(50 * time.Millisecond):
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("round %d: the turn is lost on a live connection", i)
		}
		c.fail(nil)
		peer.Close()
	}
}
