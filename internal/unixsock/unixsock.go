// Package unixsock opens the agent's root-only unix sockets the same way
// everywhere: a 0700 directory, a 0600 socket, a stale socket from a dead
// process removed, a socket another live process serves never taken over,
// and peers identified by SO_PEERCRED.
package unixsock

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// ErrInUse is Listen's error when another process serves the path.
var ErrInUse = errors.New("another process is already serving the socket")

// Listen listens on path with network "unix" or "unixpacket".
func Listen(network, path string) (*net.UnixListener, error) {
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("create socket dir: %w", err)
	}
	if err := os.Chmod(dir, 0o700); err != nil {
		return nil, fmt.Errorf("restrict socket dir: %w", err)
	}
	if err := removeStale(network, path); err != nil {
		return nil, err
	}
	ln, err := net.ListenUnix(network, &net.UnixAddr{Name: path, Net: network})
	if err != nil {
		return nil, fmt.Errorf("listen on %s: %w", path, err)
	}
	if err := os.Chmod(path, 0o600); err != nil {
		ln.Close()
		return nil, fmt.Errorf("restrict socket: %w", err)
	}
	return ln, nil
}

// Serving reports whether something accepts connections on the socket at
// path (network "unix" or "unixpacket"), asking it for nothing.
func Serving(network, path string) bool {
	c, err := net.DialTimeout(network, path, time.Second)
	if err != nil {
		return false
	}
	c.Close()
	return true
}

func removeStale(network, path string) error {
	fi, err := os.Lstat(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("inspect %s: %w", path, err)
	}
	if fi.Mode().Type() != fs.ModeSocket {
		return fmt.Errorf("%s exists and is not a socket; refusing to replace it", path)
	}
	c, err := net.DialTimeout(network, path, time.Second)
	if err == nil {
		c.Close()
		return fmt.Errorf("%w: %s", ErrInUse, path)
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("remove stale socket: %w", err)
	}
	return nil
}

// PeerCred returns the credentials of the process at the other end.
func PeerCred(uc *net.UnixConn) (*unix.Ucred, error) {
	rc, err := uc.SyscallConn()
	if err != nil {
		return nil, err
	}
	var cred *unix.Ucred
	var credErr error
	if err := rc.Control(func(fd uintptr) {
		cred, credErr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return nil, err
	}
	return cred, credErr
}

// CheckPeer refuses a peer whose uid is not allowed (root only when
// allowed is empty).
func CheckPeer(uc *net.UnixConn, allowed []uint32) (*unix.Ucred, error) {
	cred, err := PeerCred(uc)
	if err != nil {
		return nil, fmt.Errorf("cannot read peer credentials: %w", err)
	}
	if len(allowed) == 0 {
		allowed = []uint32{0}
	}
	if !slices.Contains(allowed, cred.Uid) {
		return cred, fmt.Errorf("peer pid %d runs as uid %d, not an allowed uid %v", cred.Pid, cred.Uid, allowed)
	}
	return cred, nil
}

// Serve accepts connections on ln until ctx ends, running handle for each
// concurrently, and waits for the handlers before returning. Transient
// accept errors (EMFILE and the like) are logged and retried with a growing
// pause instead of ending the server.
//
// Handlers run on goroutines that stay for a while after their connection
// to take the next one. A fresh goroutine per connection grows its stack
// from scratch on every request (JSON, validation and logging are deep);
// on the CNI socket, answered once per pod start while the plugin's exec
// waits, that was a measurable share of the round trip.
func Serve(ctx context.Context, ln *net.UnixListener, log *slog.Logger, handle func(*net.UnixConn)) error {
	return serve(ctx, ln, log, handle, nil)
}

// serve is Serve; with h, the accept loop parks while h holds it.
func serve(ctx context.Context, ln *net.UnixListener, log *slog.Logger, handle func(*net.UnixConn), h *holder) error {
	stop := context.AfterFunc(ctx, func() { ln.Close() })
	defer stop()
	var wg sync.WaitGroup
	defer wg.Wait()
	// Unbuffered: a send succeeds only when a handler goroutine is idle.
	idle := make(chan *net.UnixConn)
	defer close(idle)
	if h != nil {
		inner := handle
		handle = func(uc *net.UnixConn) { defer h.finished(); inner(uc) }
	}
	var pause time.Duration
	for {
		uc, err := ln.AcceptUnix()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			if h != nil {
				switch h.state() {
				case retired:
					return nil
				case held:
					if !h.park(ctx) {
						return nil
					}
					continue
				}
				if errors.Is(err, os.ErrDeadlineExceeded) {
					continue // a Hold released before the loop saw it
				}
			}
			if errors.Is(err, net.ErrClosed) {
				return fmt.Errorf("listener closed: %w", err)
			}
			pause = min(max(2*pause, 5*time.Millisecond), time.Second)
			log.Error("accept failed", "err", err, "retryIn", pause)
			time.Sleep(pause)
			continue
		}
		pause = 0
		if h != nil {
			// Counted here, before the loop accepts again, so that once
			// the loop parks the count only falls.
			h.started()
		}
		select {
		case idle <- uc:
		default:
			wg.Go(func() { handleThenWait(uc, idle, handle) })
		}
	}
}

// handlerIdleTime is how long a handler goroutine waits for another
// connection before it ends.
const handlerIdleTime = time.Minute

func handleThenWait(uc *net.UnixConn, next <-chan *net.UnixConn, handle func(*net.UnixConn)) {
	handle(uc)
	timer := time.NewTimer(handlerIdleTime)
	defer timer.Stop()
	for {
		select {
		case uc, ok := <-next:
			if !ok {
				return
			}
			handle(uc)
			timer.Reset(handlerIdleTime)
		case <-timer.C:
			return
		}
	}
}

// Socket is a root-only listening socket that can be opened before it is
// served: the agent listens early, so a client that connects before
// serving starts waits in the backlog instead of failing, and Serve opens
// the socket itself when nobody did.
type Socket struct {
	network, path string
	log           *slog.Logger
	// listening is logged when the socket opens ("listening for ztunnel").
	listening string

	mu sync.Mutex
	ln *net.UnixListener

	h holder
}

// holder parks a Socket's accept loop for Hold without closing the socket,
// and counts the connections whose handlers have not returned.
type holder struct {
	mu       sync.Mutex
	mode     holdMode
	parked   chan struct{} // closed by the loop when it parks for this hold
	decision chan bool     // this hold's end: true serves again, false retires
	inflight int
	drained  chan struct{} // closed when inflight falls to 0, for a waiting Hold
}

type holdMode int

const (
	serving holdMode = iota
	held
	retired
)

func (h *holder) state() holdMode {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.mode
}

// park is the accept loop's wait while held: true to accept again, false
// when retired or ctx ended.
func (h *holder) park(ctx context.Context) bool {
	h.mu.Lock()
	parked, decision := h.parked, h.decision
	h.parked = nil
	h.mu.Unlock()
	if parked != nil {
		close(parked)
	}
	select {
	case again := <-decision:
		return again
	case <-ctx.Done():
		return false
	}
}

func (h *holder) started() {
	h.mu.Lock()
	h.inflight++
	h.mu.Unlock()
}

func (h *holder) finished() {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.inflight--
	if h.inflight == 0 && h.drained != nil {
		close(h.drained)
		h.drained = nil
	}
}

// untilDrained is closed once no handler is in flight.
func (h *holder) untilDrained() <-chan struct{} {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.inflight == 0 {
		done := make(chan struct{})
		close(done)
		return done
	}
	if h.drained == nil {
		h.drained = make(chan struct{})
	}
	return h.drained
}

// NewSocket describes a socket; nothing is opened yet.
func NewSocket(network, path string, log *slog.Logger, listening string) *Socket {
	return &Socket{network: network, path: path, log: log, listening: listening}
}

// Listen opens the socket (see Listen); once open, it does nothing.
func (s *Socket) Listen() error {
	_, err := s.listener()
	return err
}

func (s *Socket) listener() (*net.UnixListener, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ln != nil {
		return s.ln, nil
	}
	ln, err := Listen(s.network, s.path)
	if err != nil {
		return nil, err
	}
	s.ln = ln
	s.log.Info(s.listening, "socket", s.path)
	return ln, nil
}

// Adopt makes s serve ln, a socket its path's previous server handed
// over, instead of binding the path afresh.
func (s *Socket) Adopt(ln *net.UnixListener) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ln != nil {
		return fmt.Errorf("%s: already listening", s.path)
	}
	s.ln = ln
	s.log.Info(s.listening, "socket", s.path, "handedOver", true)
	return nil
}

// Serve opens the socket if needed, then serves it (see Serve) until ctx
// ends or Retire.
func (s *Socket) Serve(ctx context.Context, handle func(*net.UnixConn)) error {
	ln, err := s.listener()
	if err != nil {
		return err
	}
	return serve(ctx, ln, s.log, handle, &s.h)
}

// Hold stops s from accepting (new connections wait in the socket's
// backlog) and, once every connection accepted before has been handled,
// returns a copy of the listening socket to hand over. end, if not nil, is
// called once nothing new is accepted, to end long-lived connections. If
// ctx ends first, s accepts again and Hold returns ctx's error. Release or
// Retire ends a Hold that succeeded.
func (s *Socket) Hold(ctx context.Context, end func()) (*os.File, error) {
	ln := s.current()
	if ln == nil {
		return nil, fmt.Errorf("%s: not listening", s.path)
	}
	h := &s.h
	h.mu.Lock()
	if h.mode != serving {
		h.mu.Unlock()
		return nil, fmt.Errorf("%s: already held or retired", s.path)
	}
	h.mode = held
	parked := make(chan struct{})
	h.parked, h.decision = parked, make(chan bool, 1)
	h.mu.Unlock()
	// A deadline in the past wakes the accept loop without closing the
	// socket.
	if err := ln.SetDeadline(time.Now()); err != nil {
		s.Release()
		return nil, fmt.Errorf("%s: stop accepting: %w", s.path, err)
	}
	select {
	case <-parked:
	case <-ctx.Done():
		s.Release()
		return nil, fmt.Errorf("%s: stop accepting: %w", s.path, ctx.Err())
	}
	if end != nil {
		end()
	}
	select {
	case <-h.untilDrained():
	case <-ctx.Done():
		s.Release()
		return nil, fmt.Errorf("%s: finish the connections in flight: %w", s.path, ctx.Err())
	}
	f, err := ln.File()
	if err != nil {
		s.Release()
		return nil, fmt.Errorf("%s: copy the socket: %w", s.path, err)
	}
	return f, nil
}

// current is the listening socket (nil before Listen or Adopt).
func (s *Socket) current() *net.UnixListener {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.ln
}

// Release ends a Hold: s accepts again, starting with what waited in the
// backlog.
func (s *Socket) Release() {
	ln := s.current()
	h := &s.h
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.mode != held {
		return
	}
	h.mode = serving
	ln.SetDeadline(time.Time{})
	h.decision <- true
}

// Retire ends serving for good: the listening socket closes in this
// process and its path stays, for the process the socket was handed to.
// Serve returns nil once the handlers in flight have returned.
func (s *Socket) Retire() {
	ln := s.current()
	h := &s.h
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.mode == retired {
		return
	}
	wasHeld := h.mode == held
	h.mode = retired
	if ln != nil {
		ln.SetUnlinkOnClose(false)
		ln.Close()
	}
	if wasHeld {
		h.decision <- false
	}
}
