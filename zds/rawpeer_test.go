package zds_test

import (
	"errors"
	"io"
	"net"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"

	"github.com/inpod-dev/inpod/zds"
	"github.com/inpod-dev/inpod/zds/zdspb"
)

// rawPeer is a hand-driven ztunnel for fault injection: it sends exactly
// what a test tells it to, including what a real ztunnel never would.
type rawPeer struct {
	t  *testing.T
	uc *net.UnixConn
}

func dialRaw(t *testing.T, path string) *rawPeer {
	t.Helper()
	c, err := net.Dial("unixpacket", path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return &rawPeer{t: t, uc: c.(*net.UnixConn)}
}

func (p *rawPeer) send(b []byte) {
	if _, err := p.uc.Write(b); err != nil {
		p.t.Logf("raw peer write: %v", err)
	}
}

func (p *rawPeer) hello(v zdspb.Version) {
	b, _ := proto.Marshal(&zdspb.ZdsHello{Version: v})
	p.send(b)
}

func (p *rawPeer) ack(msg string) {
	b, _ := proto.Marshal(&zdspb.WorkloadResponse{Payload: &zdspb.WorkloadResponse_Ack{Ack: &zdspb.Ack{Error: msg}}})
	p.send(b)
}

// expect reads the next request and checks its kind (add, del, keep,
// snapshot_sent).
func (p *rawPeer) expect(t *testing.T, kind string) *zdspb.WorkloadRequest {
	t.Helper()
	p.uc.SetReadDeadline(time.Now().Add(10 * time.Second))
	d, err := zds.ReadDatagram(p.uc)
	if err != nil {
		t.Fatalf("raw peer waiting for %s: %v", kind, err)
	}
	d.CloseFDs()
	var req zdspb.WorkloadRequest
	if err := proto.Unmarshal(d.Payload, &req); err != nil {
		t.Fatal(err)
	}
	var got string
	switch req.Payload.(type) {
	case *zdspb.WorkloadRequest_Add:
		got = "add"
	case *zdspb.WorkloadRequest_Del:
		got = "del"
	case *zdspb.WorkloadRequest_Keep:
		got = "keep"
	case *zdspb.WorkloadRequest_SnapshotSent:
		got = "snapshot_sent"
	}
	if got != kind {
		t.Fatalf("raw peer got %s (%v), want %s", got, &req, kind)
	}
	return &req
}

// expectClosed waits for the server to close the connection.
func (p *rawPeer) expectClosed(t *testing.T) {
	t.Helper()
	p.uc.SetReadDeadline(time.Now().Add(10 * time.Second))
	for {
		d, err := zds.ReadDatagram(p.uc)
		if err != nil {
			if errors.Is(err, io.EOF) || errors.Is(err, unix.ECONNRESET) {
				return
			}
			t.Fatalf("waiting for the server to close: %v", err)
		}
		d.CloseFDs() // e.g. the snapshot the server sent before giving up
	}
}

func syscallRights(fd int) []byte { return unix.UnixRights(fd) }
