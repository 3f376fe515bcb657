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
		return fmt.Errorf("another process is already serving %s", path)
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
	stop := context.AfterFunc(ctx, func() { ln.Close() })
	defer stop()
	var wg sync.WaitGroup
	defer wg.Wait()
	// Unbuffered: a send succeeds only when a handler goroutine is idle.
	idle := make(chan *net.UnixConn)
	defer close(idle)
	var pause time.Duration
	for {
		uc, err := ln.AcceptUnix()
		if err != nil {
			if ctx.Err() != nil {
				return nil
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

// Serve opens the socket if needed, then serves it (see Serve).
func (s *Socket) Serve(ctx context.Context, handle func(*net.UnixConn)) error {
	ln, err := s.listener()
	if err != nil {
		return err
	}
	return Serve(ctx, ln, s.log, handle)
}
