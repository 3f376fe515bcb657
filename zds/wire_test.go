package zds_test

import (
	"bytes"
	"encoding/hex"
	"testing"

	"google.golang.org/protobuf/proto"

	"github.com/inpod-dev/inpod/zds"
	"github.com/inpod-dev/inpod/zds/zdspb"
)

// Expected bytes are written out by hand from the field numbers and wire
// types in the protocol facts (tag = field<<3 | wiretype; 2 = length-
// delimited, 0 = varint), not produced by the code under test.
func TestWireBytesMatchIstioFieldNumbers(t *testing.T) {
	cases := []struct {
		name string
		msg  proto.Message
		want string
	}{
		{"hello V1 (version = 1, varint)", &zdspb.ZdsHello{Version: zdspb.Version_V1}, "0801"},
		{"del uid in field 2 inside request field 2",
			&zdspb.WorkloadRequest{Payload: &zdspb.WorkloadRequest_Del{Del: &zdspb.DelWorkload{Uid: "u"}}},
			"12" + "03" + "12" + "01" + "75"},
		{"keep is request field 5, uid field 1",
			&zdspb.WorkloadRequest{Payload: &zdspb.WorkloadRequest_Keep{Keep: &zdspb.KeepWorkload{Uid: "u"}}},
			"2a" + "03" + "0a" + "01" + "75"},
		{"snapshot_sent is request field 3, empty",
			&zdspb.WorkloadRequest{Payload: &zdspb.WorkloadRequest_SnapshotSent{SnapshotSent: &zdspb.SnapshotSent{}}},
			"1a" + "00"},
		{"add: uid 1, workload_info 2 {name 1, namespace 2, service_account 3}",
			&zdspb.WorkloadRequest{Payload: &zdspb.WorkloadRequest_Add{Add: &zdspb.AddWorkload{
				Uid:          "u",
				WorkloadInfo: &zdspb.WorkloadInfo{Name: "n", Namespace: "s", ServiceAccount: "a"},
			}}},
			"0a" + "0e" + "0a" + "01" + "75" + "12" + "09" + "0a016e" + "120173" + "1a0161"},
		{"ack with error is response field 1, error field 1",
			&zdspb.WorkloadResponse{Payload: &zdspb.WorkloadResponse_Ack{Ack: &zdspb.Ack{Error: "x"}}},
			"0a" + "03" + "0a" + "01" + "78"},
		{"empty ack", &zdspb.WorkloadResponse{Payload: &zdspb.WorkloadResponse_Ack{Ack: &zdspb.Ack{}}}, "0a00"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got, err := zds.Marshal(c.msg)
			if err != nil {
				t.Fatal(err)
			}
			want, _ := hex.DecodeString(c.want)
			if !bytes.Equal(got, want) {
				t.Fatalf("encoded %x, want %x", got, want)
			}
		})
	}
}

func TestDecodeHello(t *testing.T) {
	if err := zds.DecodeHello([]byte{0x08, 0x01}); err != nil {
		t.Errorf("V1 hello: %v", err)
	}
	for name, b := range map[string][]byte{
		"NOT_USED": {},
		"v2":       {0x08, 0x02},
		"garbage":  {0xff},
	} {
		if err := zds.DecodeHello(b); err == nil {
			t.Errorf("%s hello accepted", name)
		}
	}
}

func TestDecodeResponse(t *testing.T) {
	ack, err := zds.DecodeResponse([]byte{0x0a, 0x03, 0x0a, 0x01, 'x'})
	if err != nil || ack.GetError() != "x" {
		t.Fatalf("ack = %v, %v; want error x", ack, err)
	}
	if _, err := zds.DecodeResponse(nil); err == nil {
		t.Error("a response without an ack was accepted")
	}
}

// FuzzDecodeResponse feeds arbitrary datagrams to the decoders the server
// runs on everything ztunnel sends: they must never panic, and whatever they
// accept must survive a round trip.
func FuzzDecodeResponse(f *testing.F) {
	for _, seed := range []string{"0a00", "0a030a0178", "0801", "", "ff", "0a05"} {
		b, _ := hex.DecodeString(seed)
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		zds.DecodeHello(b)
		ack, err := zds.DecodeResponse(b)
		if err != nil {
			return
		}
		again, err := zds.Marshal(&zdspb.WorkloadResponse{Payload: &zdspb.WorkloadResponse_Ack{Ack: ack}})
		if err != nil && len(b) <= zds.MaxMessageSize {
			t.Fatalf("accepted ack does not re-encode: %v", err)
		}
		if err == nil {
			back, err := zds.DecodeResponse(again)
			if err != nil || back.GetError() != ack.GetError() {
				t.Fatalf("round trip changed the ack: %q → %q (%v)", ack.GetError(), back.GetError(), err)
			}
		}
	})
}
