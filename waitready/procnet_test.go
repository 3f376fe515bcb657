package waitready

import (
	"encoding/binary"
	"net/netip"
	"testing"
)

// The kernel prints address words in host order; these tables are what a
// little-endian machine prints (the test machine's order is checked).
func TestParseSocketsAndRoutes(t *testing.T) {
	if binary.NativeEndian.Uint16([]byte{1, 0}) != 1 {
		t.Skip("the sample tables are a little-endian machine's")
	}
	tcp := `  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:3A99 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1 0000000000000000 100 0 0 10 0
   1: 0100007F:3A99 0264A8C6:D431 06 00000000:00000000 03:00001770 00000000     0        0 0 3 0000000000000000`
	tcp6 := `  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000000000000000000000000000:3A9E 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1 0000000000000000 100 0 0 10 0
   1: 0000000000000000FFFF00000100007F:3A99 0000000000000000FFFF00000264A8C6:D432 01 00000000:00000000 00:00000000 00000000     0        0 2 1 0000000000000000 20 4 30 10 -1
   2: 000042FD0000510000000000020000:1F90 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1 0000000000000000 100 0 0 10 0`
	s4, err := parseSockets(tcp)
	if err != nil {
		t.Fatal(err)
	}
	want4 := []socket{
		{netip.MustParseAddrPort("127.0.0.1:15001"), netip.MustParseAddrPort("0.0.0.0:0"), tcpStateListen},
		{netip.MustParseAddrPort("127.0.0.1:15001"), netip.MustParseAddrPort("198.168.100.2:54321"), 6},
	}
	if len(s4) != 2 || s4[0] != want4[0] || s4[1] != want4[1] {
		t.Errorf("tcp: %+v, want %+v", s4, want4)
	}
	if _, err := parseSockets(tcp6); err == nil {
		t.Error("a 30-digit address parsed")
	}
	tcp6 = tcp6[:len(tcp6)-len("\n   2: 000042FD0000510000000000020000:1F90 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1 0000000000000000 100 0 0 10 0")]
	s6, err := parseSockets(tcp6)
	if err != nil {
		t.Fatal(err)
	}
	// A dual-stack socket's IPv4 peer reads as the IPv4 address.
	want6 := []socket{
		{netip.MustParseAddrPort("[::]:15006"), netip.MustParseAddrPort("[::]:0"), tcpStateListen},
		{netip.MustParseAddrPort("127.0.0.1:15001"), netip.MustParseAddrPort("198.168.100.2:54322"), 1},
	}
	if len(s6) != 2 || s6[0] != want6[0] || s6[1] != want6[1] {
		t.Errorf("tcp6: %+v, want %+v", s6, want6)
	}
	if got := missingListeners(append(s4, s6...)); len(got) != 1 || got[0] != PortHBONE {
		t.Errorf("missing listeners %v, want [15008]", got)
	}

}
