package zds

import (
	"errors"
	"fmt"
	"io"
	"net"

	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"

	"github.com/inpod-dev/inpod/zds/zdspb"
)

// MaxMessageSize is the receive buffer both ends use: a datagram that does
// not fit is truncated by the kernel, and ztunnel treats that as an error.
const MaxMessageSize = 1024

// DefaultSocketPath is where Istio's ztunnel connects unless INPOD_UDS says
// otherwise.
const DefaultSocketPath = "/var/run/ztunnel/ztunnel.sock"

// maxFDsPerMessage sizes the control buffer: a message carries at most one
// fd, so room for two lets a reader see, and reject, a sender that attaches
// more instead of having them silently truncated (MSG_CTRUNC leaks nothing,
// but a clear error is better).
const maxFDsPerMessage = 2

var (
	// ErrTruncated reports a datagram or its control data cut by the kernel.
	ErrTruncated = errors.New("zds: message or control data truncated (over the 1 KiB limit)")
	// ErrMessageTooLarge reports a message that would not fit the peer's buffer.
	ErrMessageTooLarge = errors.New("zds: message exceeds the 1 KiB limit")
)

// Datagram is one received message and the fds that came with it. The
// receiver owns the fds and must close them.
type Datagram struct {
	Payload []byte
	FDs     []int
}

// ReadDatagram reads one message from a SOCK_SEQPACKET connection, enforcing
// the limits both ends of ZDS apply.
func ReadDatagram(uc *net.UnixConn) (Datagram, error) {
	buf := make([]byte, MaxMessageSize)
	oob := make([]byte, unix.CmsgSpace(4*maxFDsPerMessage))
	n, oobn, flags, _, err := uc.ReadMsgUnix(buf, oob)
	if err != nil {
		return Datagram{}, err
	}
	fds, parseErr := parseRights(oob[:oobn])
	if flags&(unix.MSG_TRUNC|unix.MSG_CTRUNC) != 0 {
		closeFDs(fds)
		return Datagram{}, ErrTruncated
	}
	if parseErr != nil {
		closeFDs(fds)
		return Datagram{}, parseErr
	}
	if n == 0 && len(fds) == 0 {
		// A zero-length read on SOCK_SEQPACKET is the peer's orderly close
		// (no ZDS message encodes to zero bytes that a peer may send).
		return Datagram{}, io.EOF
	}
	return Datagram{Payload: buf[:n], FDs: fds}, nil
}

func parseRights(oob []byte) ([]int, error) {
	if len(oob) == 0 {
		return nil, nil
	}
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return nil, fmt.Errorf("zds: parse control data: %w", err)
	}
	var fds []int
	var bad error
	for _, m := range msgs {
		if m.Header.Level != unix.SOL_SOCKET || m.Header.Type != unix.SCM_RIGHTS {
			bad = fmt.Errorf("zds: unexpected control message level %d type %d", m.Header.Level, m.Header.Type)
			continue
		}
		if len(m.Data)%4 != 0 {
			// ParseUnixRights indexes past the end of such data (a panic
			// in x/sys); the kernel never builds it, but refuse, not crash.
			bad = fmt.Errorf("zds: SCM_RIGHTS of %d bytes, not a whole number of fds", len(m.Data))
			continue
		}
		rights, err := unix.ParseUnixRights(&m)
		if err != nil {
			bad = fmt.Errorf("zds: parse SCM_RIGHTS: %w", err)
			continue
		}
		fds = append(fds, rights...)
	}
	return fds, bad
}

func closeFDs(fds []int) {
	for _, fd := range fds {
		unix.Close(fd)
	}
}

// CloseFDs closes fds received with a Datagram.
func (d Datagram) CloseFDs() { closeFDs(d.FDs) }

// Marshal encodes m and checks it against the size limit.
func Marshal(m proto.Message) ([]byte, error) {
	b, err := proto.Marshal(m)
	if err != nil {
		return nil, fmt.Errorf("zds: encode %T: %w", m, err)
	}
	if len(b) > MaxMessageSize {
		return nil, fmt.Errorf("%w: %T is %d bytes", ErrMessageTooLarge, m, len(b))
	}
	return b, nil
}

// DecodeResponse parses what ztunnel sends after its hello: only an Ack is
// defined.
func DecodeResponse(b []byte) (*zdspb.Ack, error) {
	var resp zdspb.WorkloadResponse
	if err := proto.Unmarshal(b, &resp); err != nil {
		return nil, fmt.Errorf("zds: decode WorkloadResponse: %w", err)
	}
	ack := resp.GetAck()
	if ack == nil {
		return nil, errors.New("zds: WorkloadResponse without an ack")
	}
	return ack, nil
}

// DecodeHello parses ztunnel's first message and insists on version V1.
func DecodeHello(b []byte) error {
	var hello zdspb.ZdsHello
	if err := proto.Unmarshal(b, &hello); err != nil {
		return fmt.Errorf("zds: decode ZdsHello: %w", err)
	}
	if v := hello.GetVersion(); v != zdspb.Version_V1 {
		return fmt.Errorf("zds: peer speaks protocol version %d (%s); this agent speaks only V1", int32(v), v)
	}
	return nil
}
