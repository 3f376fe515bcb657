package zdstest

import (
	"io"
	"log/slog"
	"testing"

	"google.golang.org/protobuf/proto"

	"github.com/inpod-dev/inpod/zds"
	"github.com/inpod-dev/inpod/zds/zdspb"
)

// FuzzHandle feeds the stand-in a conversation of WorkloadRequests as the
// agent could send them (no fds: a fuzzer cannot make a netns). The input
// is a sequence of datagrams, each prefixed by its length byte. Properties:
// no panic; every message is judged the way ztunnel judges it (an oracle
// written from the protocol facts: undecodable or unknown payload, an Add
// (which needs exactly one fd), a Keep after SnapshotSent and a second
// SnapshotSent end the connection; Del, Keep and the first SnapshotSent are
// acked); and no workload ever starts without a netns.
func FuzzHandle(f *testing.F) {
	msg := func(r *zdspb.WorkloadRequest) []byte {
		b, _ := proto.Marshal(r)
		return append([]byte{byte(len(b))}, b...)
	}
	keep := msg(&zdspb.WorkloadRequest{Payload: &zdspb.WorkloadRequest_Keep{Keep: &zdspb.KeepWorkload{Uid: "0b5a3f9e-1c2d"}}})
	snap := msg(&zdspb.WorkloadRequest{Payload: &zdspb.WorkloadRequest_SnapshotSent{SnapshotSent: &zdspb.SnapshotSent{}}})
	del := msg(&zdspb.WorkloadRequest{Payload: &zdspb.WorkloadRequest_Del{Del: &zdspb.DelWorkload{Uid: "0b5a3f9e-1c2d"}}})
	add := msg(&zdspb.WorkloadRequest{Payload: &zdspb.WorkloadRequest_Add{Add: &zdspb.AddWorkload{Uid: "u",
		WorkloadInfo: &zdspb.WorkloadInfo{Name: "web-1", Namespace: "default", ServiceAccount: "default"}}}})
	cat := func(parts ...[]byte) []byte {
		var out []byte
		for _, p := range parts {
			out = append(out, p...)
		}
		return out
	}
	for _, seed := range [][]byte{
		cat(keep, keep, snap, del), cat(snap, keep), cat(snap, snap), cat(add), cat(keep, snap, del, del),
		{0x02, 0x0a, 0x00}, {0x00}, {0x03, 0xff, 0xff, 0xff}, {0x02, 0x30, 0x01}, {},
	} {
		f.Add(seed)
	}
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	f.Fuzz(func(t *testing.T, conv []byte) {
		z := New(Config{SocketPath: "/nonexistent", Logger: quiet})
		named := map[string]bool{}
		snapshotDone := false
		for len(conv) > 0 {
			n := int(conv[0])
			conv = conv[1:]
			n = min(n, len(conv))
			payload := conv[:n]
			conv = conv[n:]

			var req zdspb.WorkloadRequest
			wantPerr := true
			if proto.Unmarshal(payload, &req) == nil {
				switch req.Payload.(type) {
				case *zdspb.WorkloadRequest_Keep:
					wantPerr = snapshotDone
				case *zdspb.WorkloadRequest_SnapshotSent:
					wantPerr = snapshotDone
					snapshotDone = true
				case *zdspb.WorkloadRequest_Del:
					wantPerr = false
				}
			}
			ackErr, _, _, perr := z.handle(nil, zds.Datagram{Payload: append([]byte(nil), payload...)}, named) // no fds: no netns switch
			if (perr != nil) != wantPerr {
				t.Fatalf("message %x: protocol error %v, want one: %v", payload, perr, wantPerr)
			}
			if perr == nil && ackErr != "" {
				t.Fatalf("message %x acked with error %q", payload, ackErr)
			}
			if perr != nil {
				break // the connection ends
			}
		}
		if ws := z.Workloads(); len(ws) != 0 {
			t.Fatalf("workloads %v started without a netns", ws)
		}
	})
}
