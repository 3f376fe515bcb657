// Package handover passes a running agent's listening sockets (the CNI
// event socket, the ZDS socket and the hand-over socket itself) to its
// successor on the same node, so that an upgrade starts the new agent
// beside the old one instead of after it: connections made during the
// switch wait in the sockets' backlogs instead of being refused, and no
// pod start fails for want of an agent.
//
// The agent takes over at start (agent.Config.HandoverSocket); the chart
// rolls the agent with a surge where the gates allow it.
//
// # The exchange
//
// Over a root-only SOCK_SEQPACKET socket (unixsock: 0600 in a 0700
// directory, the peer's uid checked by SO_PEERCRED), one exchange at a time:
//
//  1. The successor (Take) sends "take" with its rank (its pod's creation
//     time, a tie within one second broken by the DaemonSet template's
//     generation): the agent of the newest pod serves.
//  2. The running agent (Serve) refuses an older rank. Otherwise it pauses
//     (Source.Pause: stops accepting, finishes what is in flight, closes
//     its ztunnel connections) and sends its listening sockets, named, as
//     SCM_RIGHTS.
//  3. The successor, holding them all, answers "got".
//  4. The running agent alone decides. On "got" within its bound it closes
//     its copies (leaving the paths: Source.Retire), is retired, and says
//     "retired"; on anything else (the successor died, closed, was late or
//     sent something else) it says "resume" and serves on (Source.Resume)
//     with the sockets it still holds.
//  5. The successor serves on "retired", or on the running agent's end of
//     the connection closing (it died: only the successor's copies keep
//     the sockets); on "resume" it closes its copies.
//
// # Why exactly one agent serves
//
// A listening socket lives while any process holds it. Until the running
// agent decides, only it accepts (it paused, and the successor does not use
// its copies yet); after it decides, the successor serves exactly when the
// running agent does not, since the successor acts only on its word or its
// death. Two ways end with nobody serving, never two: a successor that
// dies after "got", and a stuck exchange the successor gives up on (Take's
// bound). The kernel then closes the sockets with the last copy, the CNI
// plugin's connect is refused and an enrolled pod's ADD fails closed, as
// when an agent crashes today, until the next agent binds them afresh.
// Equal ranks are refused, so two agents never pass the sockets back and
// forth. Not covered here: two agents that both find no running agent and
// bind at once: the agent's binding side must hold a lock for that.
package handover

import (
	"context"
	"errors"
	"fmt"
	"io"
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
	// closes its copies, after SetUnlinkOnClose(false) on its listeners
	// (the paths are the successor's), and does nothing more on the node.
	Retire()
}

// Bounds of one exchange, variables for the tests.
var (
	// pauseTimeout bounds Source.Pause: a running agent that cannot finish
	// its work in flight by then resumes and refuses (the successor backs
	// off and asks again). Short: the CNI plugin's requests wait for the
	// whole pause.
	pauseTimeout = 5 * time.Second
	// confirmTimeout is how long the running agent waits for "got".
	confirmTimeout = 10 * time.Second
	// takeTimeout bounds Take when its context has no deadline: past
	// pauseTimeout and confirmTimeout, so the running agent decides first.
	takeTimeout = time.Minute
	// verdictTimeout bounds the successor's wait for the running agent's
	// decision after "got" (it stops its pieces first), whatever Take's
	// context says.
	verdictTimeout = 30 * time.Second
)

// Serve answers hand-over requests on ln for the running agent until ctx
// ends (false) or a successor took over (true, after src.Retire). Requests
// are answered one at a time; rank is this agent's (see Take).
func Serve(ctx context.Context, ln *net.UnixListener, log *slog.Logger, rank int64, src Source) (bool, error) {
	stop := context.AfterFunc(ctx, func() { ln.SetDeadline(time.Now()) })
	defer stop()
	var pause time.Duration
	for {
		uc, err := ln.AcceptUnix()
		if err != nil {
			if ctx.Err() != nil {
				return false, nil
			}
			if errors.Is(err, net.ErrClosed) {
				return false, fmt.Errorf("handover: accept: %w", err)
			}
			// EMFILE and the like pass: the socket must stay served.
			pause = min(max(2*pause, 5*time.Millisecond), time.Second)
			log.Error("hand-over accept failed", "err", err, "retryIn", pause)
			time.Sleep(pause)
			continue
		}
		pause = 0
		taken, err := give(ctx, uc, ln, rank, src)
		uc.Close()
		if err != nil && !errors.Is(err, errProbe) {
			log.Warn("hand-over not done; serving on", "err", err)
		}
		if taken {
			log.Info("hand-over done: the successor serves the node's sockets; this agent is retired")
			return true, nil
		}
	}
}

// give runs one exchange; true once the successor holds the sockets. Only
// this side decides: it answers "got" with "retired" or "resume", so the
// successor serves exactly when this agent does not.
func give(ctx context.Context, uc *net.UnixConn, ln *net.UnixListener, rank int64, src Source) (bool, error) {
	stop := context.AfterFunc(ctx, func() { uc.SetDeadline(time.Now()) })
	defer stop()
	cred, err := unixsock.CheckPeer(uc, nil)
	if err != nil {
		return false, err
	}
	uc.SetDeadline(time.Now().Add(5 * time.Second))
	theirs, err := readTake(uc)
	if errors.Is(err, io.EOF) {
		return false, errProbe
	}
	if err != nil {
		return false, fmt.Errorf("successor pid %d: %w", cred.Pid, err)
	}
	// Strictly newer: two agents of one rank would pass the sockets back
	// and forth.
	if theirs <= rank {
		reason := fmt.Sprintf("this agent's pod is not older (rank %d, the successor's %d)", rank, theirs)
		uc.Write([]byte("refuse " + reason))
		return false, fmt.Errorf("successor pid %d refused: %s", cred.Pid, reason)
	}
	refuse := func(what string, err error) (bool, error) {
		src.Resume()
		uc.Write([]byte("refuse " + what + ": " + err.Error()))
		return false, fmt.Errorf("%s: %w", what, err)
	}
	pctx, cancel := context.WithTimeout(ctx, pauseTimeout)
	files, err := src.Pause(pctx)
	cancel()
	if err != nil {
		return refuse("cannot pause", err)
	}
	if ctx.Err() != nil {
		return refuse("stopping", ctx.Err())
	}
	hf, err := ln.File()
	if err != nil {
		return refuse("the hand-over socket's file", err)
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
			return refuse("socket "+names[i], err)
		}
	}
	uc.SetDeadline(time.Now().Add(confirmTimeout))
	if _, _, err := uc.WriteMsgUnix([]byte("sockets "+strings.Join(names, " ")), unix.UnixRights(fds...), nil); err != nil {
		return refuse("send the sockets", err)
	}
	buf := make([]byte, maxMessage)
	n, err := uc.Read(buf)
	if err != nil || string(buf[:n]) != "got" {
		if err == nil {
			err = fmt.Errorf("answer %q, want \"got\"", buf[:n])
		}
		// A successor that is only late reads this before it serves. If
		// it cannot be told (neither written nor the successor gone), it
		// may read EOF and serve: retire instead of serving beside it.
		uc.SetDeadline(time.Now().Add(time.Second))
		if _, werr := uc.Write([]byte("resume")); werr == nil || isPeerGone(werr) {
			src.Resume()
			return false, fmt.Errorf("successor pid %d did not take the sockets: %w", cred.Pid, err)
		}
	}
	// The paths are the successor's now: closing a copy here must not
	// remove them.
	ln.SetUnlinkOnClose(false)
	src.Retire()
	uc.SetDeadline(time.Now().Add(time.Second))
	uc.Write([]byte("retired")) // if lost, the successor reads EOF: the same
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

// errProbe is a connection closed without a request: Serving's.
var errProbe = errors.New("handover: probed")

// Serving reports whether an agent serves the hand-over socket at path,
// without asking it for anything: a starting agent that finds one waits
// until it is ready to serve before it takes over, and binds the sockets
// at once otherwise.
func Serving(path string) bool { return unixsock.Serving("unixpacket", path) }

// Take asks the agent serving the hand-over socket at path for its
// sockets. rank orders agents: the pod created last serves (its creation
// time; a restarted container keeps its pod's rank, and equal ranks are
// refused). On success the caller holds the named sockets and must serve
// them: the running agent retired or died. ErrNoAgent means none serves
// path: the caller binds the sockets itself. ErrInterrupted (the running
// agent went away mid-exchange) is worth another Take. Any other error
// leaves the caller holding nothing, and the running agent serving, or
// (after a stuck exchange) nobody: an ADD then fails closed until the next
// agent binds the sockets afresh.
func Take(ctx context.Context, path string, rank int64) (map[string]*os.File, error) {
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, takeTimeout)
		defer cancel()
	}
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
	return takeOver(ctx, uc, rank)
}

// ErrInterrupted: the running agent went away before it sent its sockets.
var ErrInterrupted = errors.New("handover: the running agent went away mid-exchange")

func takeOver(ctx context.Context, uc *net.UnixConn, rank int64) (map[string]*os.File, error) {
	// The running agent is root, as this one must be: a socket held by
	// anyone else is not an agent's.
	if _, err := unixsock.CheckPeer(uc, nil); err != nil {
		return nil, fmt.Errorf("handover: %w", err)
	}
	stop := context.AfterFunc(ctx, func() { uc.SetDeadline(time.Now()) })
	defer stop()
	if _, err := fmt.Fprintf(uc, "take %s %d", protocol, rank); err != nil {
		return nil, fmt.Errorf("handover: send the request: %w", err)
	}
	buf := make([]byte, maxMessage)
	oob := make([]byte, unix.CmsgSpace(16*4))
	n, oobn, flags, _, err := uc.ReadMsgUnix(buf, oob)
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
	if err == nil && n == 0 {
		err = io.EOF
	}
	if err != nil {
		closeAll()
		if isPeerGone(err) {
			return nil, ErrInterrupted
		}
		return nil, fmt.Errorf("handover: read the answer: %w", err)
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
	case flags&(unix.MSG_CTRUNC|unix.MSG_TRUNC) != 0:
		err = errors.New("the answer was truncated")
	case !ok || len(fields) != len(files):
		err = fmt.Errorf("answer %q with %d sockets", msg, len(files))
	case !slices.Contains(fields, HandoverSocket):
		err = fmt.Errorf("answer %q names no %s socket", msg, HandoverSocket)
	}
	got := make(map[string]*os.File, len(files))
	for i, name := range fields {
		if err == nil && got[name] != nil {
			err = fmt.Errorf("answer %q names %s twice", msg, name)
		}
		if err == nil {
			got[name] = files[i]
		}
	}
	if err != nil {
		closeAll()
		// The running agent resumes on anything but "got".
		return nil, fmt.Errorf("handover: %w", err)
	}
	if _, err := uc.Write([]byte("got")); err != nil {
		if isPeerGone(err) {
			return got, nil // it died: the sockets live on in these files
		}
		closeAll()
		return nil, fmt.Errorf("handover: confirm: %w", err)
	}
	// The running agent decides: "retired", or "resume" if "got" came too
	// late. If it dies instead, the sockets live on in these files. The
	// wait is its own, not ctx's: giving up now, while the running agent
	// retires, would leave nobody serving.
	stop()
	uc.SetDeadline(time.Now().Add(verdictTimeout))
	n, err = uc.Read(buf)
	switch {
	case err == nil && string(buf[:n]) == "retired", err == nil && n == 0, err != nil && isPeerGone(err):
		return got, nil
	case err == nil && string(buf[:n]) == "resume":
		closeAll()
		return nil, errors.New("handover: the running agent resumed: this agent confirmed too late")
	case err == nil:
		err = fmt.Errorf("answer %q, want \"retired\"", buf[:n])
	}
	closeAll()
	return nil, fmt.Errorf("handover: after confirming: %w", err)
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

// isPeerGone: the process at the other end exited or closed.
func isPeerGone(err error) bool {
	return errors.Is(err, io.EOF) || errors.Is(err, syscall.EPIPE) || errors.Is(err, syscall.ECONNRESET)
}
