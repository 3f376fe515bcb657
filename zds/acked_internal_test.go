package zds

import (
	"context"
	"errors"
	"os"
	"testing"
	"time"
)

// A connection that has ended holds nothing, even in the moment before the
// server drops it from its list (where Server.Acked could still find it as
// the newest): its ztunnel is gone or no longer trusted.
func TestAClosedConnectionHoldsNothing(t *testing.T) {
	c, peer := connPair(t, 5*time.Second)
	go func() {
		d, err := ReadDatagram(peer)
		if err != nil {
			return
		}
		d.CloseFDs()
		peer.Write(strayAck(t)) // the Ack of that request: no error
	}()
	// Any file stands in for the netns: the connection only passes it on.
	f, err := os.Open(os.DevNull)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := c.do(context.Background(), &request{op: "add", uid: "uid-1", payload: []byte("x"), netns: f}); err != nil {
		t.Fatal(err)
	}
	if !c.holds("uid-1") {
		t.Fatal("the connection does not hold the pod it acknowledged")
	}
	c.fail(errors.New("peer went away"))
	if c.holds("uid-1") {
		t.Fatal("a closed connection still holds the pod")
	}
}
