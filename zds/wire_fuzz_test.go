package zds

import (
	"testing"

	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"

	"github.com/inpod-dev/inpod/zds/zdspb"
)

// FuzzDecodeHello is the agent reading ztunnel's first message. Property:
// accepted exactly when the bytes are a ZdsHello whose version is V1. (What
// ztunnel sends after it is FuzzDecodeResponse, in wire_test.go.)
func FuzzDecodeHello(f *testing.F) {
	for _, seed := range [][]byte{{0x08, 0x01}, {0x08, 0x00}, {0x08, 0x02}, {}, {0x08, 0x01, 0x08, 0x02}, {0x08, 0x02, 0x08, 0x01},
		{0x08, 0x81, 0x80, 0x80, 0x80, 0x10}, {0x0a, 0x01, 0x00}, {0x78, 0x01, 0x08, 0x01}} {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		err := DecodeHello(b)
		var hello zdspb.ZdsHello
		want := proto.Unmarshal(b, &hello) == nil && hello.GetVersion() == zdspb.Version_V1
		if (err == nil) != want {
			t.Fatalf("DecodeHello(%x) = %v; a V1 hello: %v", b, err, want)
		}
	})
}

// FuzzParseRights is the control data that comes with a datagram. The
// kernel only delivers what it built, but the parser must still hold up:
// no panic, and without an error every message was SCM_RIGHTS. The fds it
// returns are never closed here: they are made-up numbers.
func FuzzParseRights(f *testing.F) {
	f.Add(unix.UnixRights(3))
	f.Add(unix.UnixRights(3, 4))
	f.Add(append(unix.UnixRights(5), unix.UnixCredentials(&unix.Ucred{Pid: 1})...))
	f.Add(unix.UnixCredentials(&unix.Ucred{Pid: 1, Uid: 0, Gid: 0}))
	f.Add([]byte{})
	f.Add(make([]byte, unix.CmsgSpace(4)))
	f.Fuzz(func(t *testing.T, oob []byte) {
		fds, err := parseRights(oob)
		if err != nil {
			return
		}
		msgs, perr := unix.ParseSocketControlMessage(oob)
		if len(oob) > 0 && perr != nil {
			t.Fatalf("parseRights accepted control data the parser refuses: %v", perr)
		}
		n := 0
		for _, m := range msgs {
			if m.Header.Level != unix.SOL_SOCKET || m.Header.Type != unix.SCM_RIGHTS {
				t.Fatalf("accepted a control message of level %d type %d", m.Header.Level, m.Header.Type)
			}
			r, _ := unix.ParseUnixRights(&m)
			n += len(r)
		}
		if n != len(fds) {
			t.Fatalf("%d fds in the rights, %d returned", n, len(fds))
		}
	})
}
