// Package handover passes a running agent's listening sockets (the CNI
// event socket, the ZDS socket and the hand-over socket itself) to its
// successor on the same node, so that an upgrade starts the new agent
// beside the old one instead of after it: connections made during the
// switch wait in the sockets' backlogs instead of being refused, and no
// pod start fails for want of an agent.
//
// It is the first step of the surge rollout (issue 40); the agent does not
// use it yet.
//
// # The exchange
//
// Over a root-only SOCK_SEQPACKET socket (unixsock: 0600 in a 0700
// directory, the peer's uid checked by SO_PEERCRED), one exchange at a time:
//
//  1. The successor (Take) sends "take" with its rank (its pod's creation
//     time): the agent of the newest pod serves.
//  2. The running agent (Serve) refuses an older rank. Otherwise it pauses
//     (Source.Pause: stops accepting, finishes what is in flight, closes
//     its ztunnel connections) and sends its listening sockets, named, as
//     SCM_RIGHTS.
//  3. The successor, holding them all, answers "got" and from then on
//     serves them: it never gives them back.
//  4. The running agent, on "got", closes its copies and is retired. On
//     anything else (the successor died, closed, sent something else) it
//     resumes (Source.Resume) with the sockets it still holds.
//
// # Why exactly one agent serves
//
// A listening socket lives while any process holds it. Before "got" only
// the running agent accepts on them (the successor holds copies it does not
// use yet, and closes them if it fails); after "got" only the successor
// does: the running agent stopped accepting in Pause and never resumes
// once it has read "got". The one moment the two disagree is a successor
// that sent "got" and died at once: then neither serves, the kernel closes
// the sockets with the last copy, and the next agent binds them afresh;
// meanwhile the CNI plugin's connect is refused and an enrolled pod's ADD
// fails closed, as when an agent crashes today. A successor never binds
// over a socket another process serves (unixsock refuses), so a stuck
// running agent makes its successor wait, never run beside it.
package handover

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"os"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/inpod-dev/inpod/internal/unixsock"
)

// HandoverSocket is the name under which the hand-over socket passes
// itself on: the successor serves the next hand-over.
const HandoverSocket = "handover"

// protocol names the exchange; a successor speaking another one is refused.
const protocol = "inpod-handover/1"

// maxMessage bounds one message: a handful of names.
const maxMessage = 4096

// ErrNoAgent is Take's answer when no agent serves the hand-over socket:
// the successor binds its sockets itself.
var ErrNoAgent = errors.New("handover: no agent serves the hand-over socket")

// Refused is Take's answer when the running agent keeps its sockets.
type Refused struct{ Reason string }

func (r *Refused) Error() string { return "handover: the running agent refused: " + r.Reason }

// Source is the running agent's side: what it serves and can pause.
type Source interface {
	// Pause stops accepting on every socket, finishes the work in flight
	// and closes ztunnel's connections, then returns the listening
	// sockets by name (HandoverSocket aside). The files stay the
	// Source's: Serve neither closes nor keeps them.
	Pause(ctx context.Context) (map[string]*os.File, error)
	// Resume serves again: the successor failed before it took over.
	Resume()
	// Retire is called once the successor holds the sockets: the Source
	// closes its copies and does nothing more on the node.
	Retire()
}

// Serve answers hand-over requests on ln for the running agent until ctx
// ends (false) or a successor took over (true, after src.Retire). Requests
// are answered one at a time; rank is this agent's (see Take).
func Serve(ctx context.Context, ln *net.UnixListener, log *slog.Logger, rank int64, src Source) (bool, error) {
	stop := context.AfterFunc(ctx, func() { ln.SetDeadline(time.Now()) })
	defer stop()
	for {
		uc, err := ln.AcceptUnix()
		if err != nil {
			if ctx.Err() != nil {
				return false, nil
			}
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				continue
			}
			return false, fmt.Errorf("handover: accept: %w", err)
		}
		taken, err := give(ctx, uc, ln, rank, src)
		uc.Close()
		if err != nil {
			log.Warn("hand-over not done; serving on", "err", err)
		}
		if taken {
			log.Info("hand-over done: the successor serves the node's sockets; this agent is retired")
			return true, nil
		}
	}
}

// give runs one exchange; true once the successor holds the sockets.
func give(ctx context.Context, uc *net.UnixConn, ln *net.UnixListener, rank int64, src Source) (bool, error) {
	cred, err := unixsock.CheckPeer(uc, nil)
	if err != nil {
		return false, err
	}
	uc.SetDeadline(time.Now().Add(5 * time.Second))
	theirs, err := readTake(uc)
	if err != nil {
		return false, fmt.Errorf("successor pid %d: %w", cred.Pid, err)
	}
	if theirs < rank {
		reason := fmt.Sprintf("this agent's pod is newer (rank %d > %d)", rank, theirs)
		uc.Write([]byte("refuse " + reason))
		return false, fmt.Errorf("successor pid %d refused: %s", cred.Pid, reason)
	}
	uc.SetDeadline(time.Time{})
	files, err := src.Pause(ctx)
	if err != nil {
		src.Resume()
		uc.Write([]byte("refuse cannot pause: " + err.Error()))
		return false, fmt.Errorf("pause: %w", err)
	}
	hf, err := ln.File()
	if err != nil {
		src.Resume()
		uc.Write([]byte("refuse " + err.Error()))
		return false, fmt.Errorf("the hand-over socket's file: %w", err)
	}
	defer hf.Close()
	names := []string{HandoverSocket}
	all := []*os.File{hf}
	for _, name := range slices.Sorted(maps.Keys(files)) {
		names = append(names, name)
		all = append(all, files[name])
	}
	fds := make([]int, len(all))
	for i, f := range all {
		if fds[i], err = rawFD(f); err != nil {
			src.Resume()
			uc.Write([]byte("refuse " + err.Error()))
			return false, fmt.Errorf("socket %s: %w", names[i], err)
		}
	}
	// Only "got" commits: the successor's death or a stray answer (or a
	// stuck successor, after the bound) leaves the sockets here.
	uc.SetDeadline(time.Now().Add(10 * time.Second))
	if _, _, err := uc.WriteMsgUnix([]byte("sockets "+strings.Join(names, " ")), unix.UnixRights(fds...), nil); err != nil {
		src.Resume()
		return false, fmt.Errorf("send the sockets: %w", err)
	}
	buf := make([]byte, maxMessage)
	n, err := uc.Read(buf)
	if err != nil || string(buf[:n]) != "got" {
		src.Resume()
		if err == nil {
			err = fmt.Errorf("answer %q, want \"got\"", buf[:n])
		}
		return false, fmt.Errorf("successor pid %d did not take the sockets: %w", cred.Pid, err)
	}
	src.Retire()
	return true, nil
}

func readTake(uc *net.UnixConn) (int64, error) {
	buf := make([]byte, maxMessage)
	n, err := uc.Read(buf)
	if err != nil {
		return 0, fmt.Errorf("read the request: %w", err)
	}
	f := strings.Fields(string(buf[:n]))
	if len(f) != 3 || f[0] != "take" || f[1] != protocol {
		return 0, fmt.Errorf("request %q: want \"take %s <rank>\"", buf[:n], protocol)
	}
	rank, err := strconv.ParseInt(f[2], 10, 64)
	if err != nil {
		return 0, fmt.Errorf("request %q: rank: %w", buf[:n], err)
	}
	return rank, nil
}

// Take asks the agent serving the hand-over socket at path for its
// sockets. rank orders agents: the pod created last serves (its creation
// time in nanoseconds; a restarted container keeps its pod's rank). On
// success the caller holds the named sockets and must serve them (the
// running agent has retired); ErrNoAgent means none serves path; any other
// error leaves the running agent serving, and the caller holding nothing.
func Take(ctx context.Context, path string, rank int64) (map[string]*os.File, error) {
	var d net.Dialer
	c, err := d.DialContext(ctx, "unixpacket", path)
	if err != nil {
		if errors.Is(err, syscall.ENOENT) || errors.Is(err, syscall.ECONNREFUSED) {
			return nil, ErrNoAgent
		}
		return nil, fmt.Errorf("handover: dial %s: %w", path, err)
	}
	uc := c.(*net.UnixConn)
	defer uc.Close()
	// The running agent is root, as this one must be: a socket held by
	// anyone else is not an agent's.
	if _, err := unixsock.CheckPeer(uc, nil); err != nil {
		return nil, fmt.Errorf("handover: %s: %w", path, err)
	}
	stop := context.AfterFunc(ctx, func() { uc.SetDeadline(time.Now()) })
	defer stop()
	if _, err := fmt.Fprintf(uc, "take %s %d", protocol, rank); err != nil {
		return nil, fmt.Errorf("handover: send the request: %w", err)
	}
	buf := make([]byte, maxMessage)
	oob := make([]byte, unix.CmsgSpace(16*4))
	n, oobn, flags, _, err := uc.ReadMsgUnix(buf, oob)
	if err != nil {
		return nil, fmt.Errorf("handover: read the answer: %w", err)
	}
	fds, fdErr := rights(oob[:oobn])
	files := make([]*os.File, len(fds))
	for i, fd := range fds {
		files[i] = os.NewFile(uintptr(fd), "handover")
	}
	closeAll := func() {
		for _, f := range files {
			f.Close()
		}
	}
	msg := string(buf[:n])
	if reason, ok := strings.CutPrefix(msg, "refuse "); ok {
		closeAll()
		return nil, &Refused{Reason: reason}
	}
	names, ok := strings.CutPrefix(msg, "sockets ")
	fields := strings.Fields(names)
	switch {
	case fdErr != nil:
		err = fdErr
	case flags&unix.MSG_CTRUNC != 0:
		err = errors.New("more sockets than expected (control data truncated)")
	case !ok || len(fields) != len(files):
		err = fmt.Errorf("answer %q with %d sockets", msg, len(files))
	case !slices.Contains(fields, HandoverSocket):
		err = fmt.Errorf("answer %q names no %s socket", msg, HandoverSocket)
	}
	if err != nil {
		closeAll()
		return nil, fmt.Errorf("handover: %w", err)
	}
	got := make(map[string]*os.File, len(files))
	for i, name := range fields {
		if got[name] != nil {
			closeAll()
			return nil, fmt.Errorf("handover: answer %q names %s twice", msg, name)
		}
		got[name] = files[i]
	}
	// From here the sockets are this agent's, whatever the running agent
	// does next: it retires on reading "got", and if it died meanwhile the
	// sockets live on in these files.
	uc.SetDeadline(time.Time{})
	if _, err := uc.Write([]byte("got")); err != nil && !isPeerGone(err) {
		closeAll()
		return nil, fmt.Errorf("handover: confirm: %w", err)
	}
	return got, nil
}

// Listener turns a received socket into a listener (the file stays open:
// close it once the listener is built, or keep it to pass on).
func Listener(f *os.File) (*net.UnixListener, error) {
	l, err := net.FileListener(f)
	if err != nil {
		return nil, fmt.Errorf("handover: %s: %w", f.Name(), err)
	}
	ul, ok := l.(*net.UnixListener)
	if !ok {
		l.Close()
		return nil, fmt.Errorf("handover: %s is not a unix listening socket", f.Name())
	}
	return ul, nil
}

func rights(oob []byte) ([]int, error) {
	if len(oob) == 0 {
		return nil, nil
	}
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return nil, fmt.Errorf("parse control data: %w", err)
	}
	var fds []int
	var bad error
	for _, m := range msgs {
		if m.Header.Level != unix.SOL_SOCKET || m.Header.Type != unix.SCM_RIGHTS || len(m.Data)%4 != 0 {
			bad = fmt.Errorf("unexpected control message level %d type %d", m.Header.Level, m.Header.Type)
			continue
		}
		r, err := unix.ParseUnixRights(&m)
		if err != nil {
			bad = err
			continue
		}
		fds = append(fds, r...)
	}
	return fds, bad
}

// rawFD is f's descriptor, read without File.Fd, which would switch the
// socket, shared with the agent's own listener, to blocking mode: its
// accept would then ignore deadlines and a paused agent could not resume.
// The descriptor stays valid while f is open.
func rawFD(f *os.File) (int, error) {
	rc, err := f.SyscallConn()
	if err != nil {
		return 0, err
	}
	var fd int
	if err := rc.Control(func(v uintptr) { fd = int(v) }); err != nil {
		return 0, err
	}
	return fd, nil
}

// isPeerGone: the running agent exited after sending the sockets.
func isPeerGone(err error) bool {
	return errors.Is(err, syscall.EPIPE) || errors.Is(err, syscall.ECONNRESET)
}
