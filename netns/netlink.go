package netns

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"time"

	"golang.org/x/sys/unix"
)

// Netlink is a netlink socket created inside a network namespace: it
// answers for that namespace whichever thread uses it, so only socket(2)
// runs in the namespace (on Do's thread) and the requests run on the
// caller's. It is what the verifier uses to read a pod's addresses, rules
// generation and sockets several times a minute per pod, where a library's
// handle (its own namespace switch, its poller) costs several times more
// than the request. One goroutine at a time.
type Netlink struct {
	fd  int
	seq uint32
	buf []byte
}

// netlinkRecvBuf holds any datagram of a dump: the kernel fills each up to
// the largest buffer its reader has offered, capped at 32 KiB.
const netlinkRecvBuf = 32 << 10

// netlinkTimeout bounds a wait for the kernel's answer, which comes while
// the request is sent: never reached unless the answer was dropped.
const netlinkTimeout = 5 * time.Second

// ErrDumpInterrupted is a dump the kernel marked as interrupted: what it
// listed changed under it. Read it again.
var ErrDumpInterrupted = errors.New("netlink dump interrupted")

// OpenNetlink opens a netlink socket of protocol proto (unix.NETLINK_*) in
// ns, connected to the kernel, so no other process (of the pod, say) can
// send it a forged answer.
func OpenNetlink(ns *os.File, proto int) (*Netlink, error) {
	fd := -1
	err := Do(ns, func() error {
		var err error
		fd, err = unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, proto)
		return err
	})
	if err != nil {
		if fd >= 0 { // created, then the thread failed to come back
			unix.Close(fd)
		}
		return nil, fmt.Errorf("netlink socket in netns %s: %w", ns.Name(), err)
	}
	tv := unix.NsecToTimeval(netlinkTimeout.Nanoseconds())
	if err := unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("netlink socket receive timeout: %w", err)
	}
	if err := unix.Connect(fd, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("connect netlink socket: %w", err)
	}
	return &Netlink{fd: fd, buf: make([]byte, netlinkRecvBuf)}, nil
}

// Close closes the socket.
func (n *Netlink) Close() error { return unix.Close(n.fd) }

// Request sends the kernel one message of type typ with flags (NLM_F_REQUEST
// is added) and payload, and calls answer with the type and payload of each
// message of its answer, until the answer is complete: NLMSG_DONE for a dump
// (NLM_F_DUMP in flags), the first message otherwise. An NLMSG_ERROR or
// NLMSG_DONE carrying an errno returns it (unix.Errno); a dump the kernel
// marked as interrupted returns ErrDumpInterrupted once it is complete.
// payload and the slice answer is given are valid only during the call.
func (n *Netlink) Request(typ, flags uint16, payload []byte, answer func(typ uint16, payload []byte)) error {
	n.seq++
	seq := n.seq
	ne := binary.NativeEndian
	req := make([]byte, unix.SizeofNlMsghdr+len(payload))
	ne.PutUint32(req[0:], uint32(len(req)))
	ne.PutUint16(req[4:], typ)
	ne.PutUint16(req[6:], flags|unix.NLM_F_REQUEST)
	ne.PutUint32(req[8:], seq)
	// req[12:16], the port id, is 0: the kernel fills in ours.
	copy(req[unix.SizeofNlMsghdr:], payload)
	if err := unix.Send(n.fd, req, 0); err != nil {
		return err
	}
	dump := flags&unix.NLM_F_DUMP != 0
	interrupted := false
	for {
		got, from, err := unix.Recvfrom(n.fd, n.buf, unix.MSG_TRUNC)
		if err != nil {
			if errors.Is(err, unix.EINTR) {
				continue
			}
			if errors.Is(err, unix.EAGAIN) {
				return fmt.Errorf("no answer from the kernel in %v", netlinkTimeout)
			}
			return err
		}
		if sa, ok := from.(*unix.SockaddrNetlink); !ok || sa.Pid != 0 {
			continue // not from the kernel (a connected socket takes none)
		}
		if got > len(n.buf) {
			return fmt.Errorf("netlink answer of %d bytes overflows the %d-byte buffer", got, len(n.buf))
		}
		for b := n.buf[:got]; len(b) >= unix.SizeofNlMsghdr; {
			msgLen := int(ne.Uint32(b[0:]))
			if msgLen < unix.SizeofNlMsghdr || msgLen > len(b) {
				return fmt.Errorf("malformed netlink answer: message of %d bytes in %d", msgLen, len(b))
			}
			typ, flags, msgSeq := ne.Uint16(b[4:]), ne.Uint16(b[6:]), ne.Uint32(b[8:])
			body := b[unix.SizeofNlMsghdr:msgLen]
			b = b[min(nlmAlign(msgLen), len(b)):]
			if msgSeq != seq {
				continue // the rest of an earlier request's answer
			}
			if flags&unix.NLM_F_DUMP_INTR != 0 {
				interrupted = true
			}
			switch typ {
			case unix.NLMSG_DONE, unix.NLMSG_ERROR:
				// Both carry an int: 0, or a negated errno.
				if len(body) >= 4 {
					if errno := int32(ne.Uint32(body)); errno != 0 {
						return unix.Errno(-errno)
					}
				}
				if interrupted {
					return ErrDumpInterrupted
				}
				return nil
			}
			answer(typ, body)
			if !dump {
				return nil
			}
		}
	}
}

func nlmAlign(n int) int { return (n + unix.NLMSG_ALIGNTO - 1) &^ (unix.NLMSG_ALIGNTO - 1) }
