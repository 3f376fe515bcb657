package waitready

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io/fs"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// tcpStateListen is TCP_LISTEN as /proc/net/tcp prints it.
const tcpStateListen = 0x0A

// socket is one line of /proc/net/tcp or tcp6.
type socket struct {
	local, remote netip.AddrPort
	state         int
}

// readSockets reads the TCP sockets of the netns the calling thread is in
// (dir is its /proc/thread-self/net). Both files are readable without
// privilege. tcp6 is missing when IPv6 is disabled.
func readSockets(dir string) ([]socket, error) {
	var out []socket
	for _, name := range []string{"tcp", "tcp6"} {
		data, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil {
			if name == "tcp6" && errors.Is(err, fs.ErrNotExist) {
				continue
			}
			return nil, err
		}
		socks, err := parseSockets(string(data))
		if err != nil {
			return nil, fmt.Errorf("%s: %w", filepath.Join(dir, name), err)
		}
		out = append(out, socks...)
	}
	return out, nil
}

// parseSockets parses the table the kernel prints in /proc/net/tcp{,6}: a
// header line, then "sl local rem st ...", addresses as the hex of the
// in-memory address words, ports as plain hex.
func parseSockets(table string) ([]socket, error) {
	var out []socket
	s := bufio.NewScanner(strings.NewReader(table))
	first := true
	for s.Scan() {
		if first {
			first = false
			continue
		}
		f := strings.Fields(s.Text())
		if len(f) < 4 {
			continue
		}
		local, err := parseHexAddrPort(f[1])
		if err != nil {
			return nil, err
		}
		remote, err := parseHexAddrPort(f[2])
		if err != nil {
			return nil, err
		}
		st, err := strconv.ParseUint(f[3], 16, 8)
		if err != nil {
			return nil, fmt.Errorf("bad state %q", f[3])
		}
		out = append(out, socket{local: local, remote: remote, state: int(st)})
	}
	return out, s.Err()
}

// parseHexAddrPort reads "0100007F:3A99". The kernel prints each 32-bit word
// of the address as a number in host byte order; the port is in host order
// already. IPv4-mapped addresses (a dual-stack socket) are unmapped.
func parseHexAddrPort(s string) (netip.AddrPort, error) {
	h, p, ok := strings.Cut(s, ":")
	if !ok || (len(h) != 8 && len(h) != 32) {
		return netip.AddrPort{}, fmt.Errorf("bad address %q", s)
	}
	var b [16]byte
	for i := 0; i < len(h)/8; i++ {
		w, err := strconv.ParseUint(h[i*8:i*8+8], 16, 32)
		if err != nil {
			return netip.AddrPort{}, fmt.Errorf("bad address %q", s)
		}
		binary.NativeEndian.PutUint32(b[i*4:], uint32(w))
	}
	port, err := strconv.ParseUint(p, 16, 16)
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("bad port in %q", s)
	}
	var a netip.Addr
	if len(h) == 8 {
		a = netip.AddrFrom4([4]byte(b[:4]))
	} else {
		a = netip.AddrFrom16(b).Unmap()
	}
	return netip.AddrPortFrom(a, uint16(port)), nil
}
