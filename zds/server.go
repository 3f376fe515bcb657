// Package zds is the agent side of ZDS, the protocol that hands pod network
// namespaces to ztunnel over a SOCK_SEQPACKET unix socket. It is wire
// compatible with Istio's ztunnel and knows nothing about Kubernetes: a
// PodSource tells it which pods exist.
//
// A connection carries one request at a time: its caller sends it while
// holding the connection's turn and waits for its Ack, and a reader
// goroutine, reading the socket all the time (so a peer that goes away is
// noticed at once rather than at the next request), delivers the Ack and
// passes the turn to the next caller.
// An Ack that arrives when nothing is in flight, or a request that times out,
// closes the connection: an Ack carries no id, so after either the pairing of
// requests and acks can no longer be trusted.
package zds

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/inpod-dev/inpod/internal/latest"
	"github.com/inpod-dev/inpod/internal/unixsock"
	"github.com/inpod-dev/inpod/zds/zdspb"
)

// Workload is one pod as ztunnel sees it.
type Workload struct {
	UID            string
	Name           string
	Namespace      string
	ServiceAccount string
	// NetNS is the pod's network namespace. Add borrows it: the caller
	// keeps it open until Add returns. A snapshot hands it over: see
	// PodSource. In a snapshot, nil means "known, netns not held" and is sent
	// as Keep.
	NetNS *os.File
}

// Dup returns a copy of w whose NetNS is a new descriptor of the same
// namespace, owned by the caller: what a PodSource hands to the server, so
// that the source may close its own file at any time.
func (w Workload) Dup() (Workload, error) {
	if w.NetNS == nil {
		return w, nil
	}
	rc, err := w.NetNS.SyscallConn()
	if err != nil {
		return Workload{}, fmt.Errorf("%w: pod %s (%s)", ErrNetNSClosed, w.UID, w.NetNS.Name())
	}
	var fd int
	var dupErr error
	if err := rc.Control(func(orig uintptr) {
		fd, dupErr = unix.FcntlInt(orig, unix.F_DUPFD_CLOEXEC, 0)
	}); err != nil {
		return Workload{}, fmt.Errorf("%w: pod %s (%s)", ErrNetNSClosed, w.UID, w.NetNS.Name())
	}
	if dupErr != nil {
		return Workload{}, fmt.Errorf("zds: dup the netns fd of pod %s: %w", w.UID, dupErr)
	}
	w.NetNS = os.NewFile(uintptr(fd), w.NetNS.Name())
	return w, nil
}

// PodSource lists the pods a newly connected ztunnel must be told about.
//
// The server owns every NetNS in the returned list and closes each one once
// it has been sent, or when the snapshot ends for any reason, so a source
// hands out files of its own (Workload.Dup, taken under the same lock that
// guards its table): the snapshot is sent without that lock, and an unenroll
// that closes the source's file meanwhile must not take the server's with it.
type PodSource interface {
	Snapshot(ctx context.Context) ([]Workload, error)
}

// State is the server's readiness signal.
type State struct {
	// Connections counts connections past their hello.
	Connections int
	// Ready is true while at least one connection has acknowledged its
	// snapshot: a ztunnel is there and knows every enrolled pod.
	Ready bool
}

// NotReadyReason says why the state is not ready, for a readiness
// condition; "" when ready.
func (st State) NotReadyReason() string {
	if st.Ready {
		return ""
	}
	return fmt.Sprintf("no ztunnel has acknowledged a snapshot (%d connections)", st.Connections)
}

// Config configures a Server. Zero durations take the defaults.
type Config struct {
	SocketPath string
	Source     PodSource
	// HelloTimeout bounds the wait for ZdsHello after a connect (Istio: 5 s).
	HelloTimeout time.Duration
	// AckTimeout bounds the wait for each Ack; on expiry the connection is
	// closed so that a late Ack can never be credited to the next request.
	AckTimeout time.Duration
	// AllowedPeerUIDs are the uids a connecting process may run as; empty
	// means root only.
	AllowedPeerUIDs []uint32
	Logger          *slog.Logger
}

const (
	defaultHelloTimeout = 5 * time.Second
	defaultAckTimeout   = 5 * time.Second
)

var (
	// ErrNoConnection means no ztunnel is connected to receive an Add.
	ErrNoConnection = errors.New("zds: no ztunnel connected")
	// ErrConnectionClosed means the connection ended before the Ack came.
	ErrConnectionClosed = errors.New("zds: ztunnel connection closed before the ack")
	// ErrAckTimeout means ztunnel did not answer in time; the connection
	// has been closed.
	ErrAckTimeout = errors.New("zds: timed out waiting for ztunnel's ack")
	// ErrNetNSClosed means the netns file was closed before it could be
	// sent. Nothing was written, so the pairing of requests and acks is
	// intact and the connection stays: that Add fails alone, and a snapshot
	// leaves that entry out and goes on.
	ErrNetNSClosed = errors.New("zds: the pod's netns fd was closed before it could be sent")
)

// AckError is an Ack that carried an error: ztunnel refused that workload.
type AckError struct {
	Op  string
	UID string
	Msg string
}

func (e *AckError) Error() string {
	return fmt.Sprintf("zds: ztunnel rejected %s of pod %s: %s", e.Op, e.UID, e.Msg)
}

// Server accepts ztunnel connections and delivers workload changes to them.
type Server struct {
	cfg Config
	log *slog.Logger

	sock *unixsock.Socket

	mu        sync.Mutex
	holding   bool    // a Hold is under way or done: no new connection is kept
	conns     []*conn // in connect order; the last is the newest
	nextID    uint64
	published State
	states    *latest.Value[State]
}

// NewServer validates cfg and fills in defaults; Listen opens the socket.
func NewServer(cfg Config) (*Server, error) {
	if cfg.SocketPath == "" {
		cfg.SocketPath = DefaultSocketPath
	}
	if cfg.Source == nil {
		return nil, errors.New("zds: Config.Source is required")
	}
	if cfg.HelloTimeout <= 0 {
		cfg.HelloTimeout = defaultHelloTimeout
	}
	if cfg.AckTimeout <= 0 {
		cfg.AckTimeout = defaultAckTimeout
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	log = log.With("component", "zds")
	return &Server{
		cfg:    cfg,
		log:    log,
		sock:   unixsock.NewSocket("unixpacket", cfg.SocketPath, log, "listening for ztunnel"),
		states: latest.New(State{}),
	}, nil
}

// Listen creates the socket: the directory root-only (0700), a stale socket
// from a dead agent removed, the socket itself 0600. It refuses to take over
// a socket another live process is serving. Serve listens when nobody did.
func (s *Server) Listen() error {
	if err := s.sock.Listen(); err != nil {
		return fmt.Errorf("zds: %w", err)
	}
	return nil
}

// Adopt serves ln, the socket handed over by the agent before, instead of
// binding the path.
func (s *Server) Adopt(ln *net.UnixListener) error {
	if err := s.sock.Adopt(ln); err != nil {
		return fmt.Errorf("zds: %w", err)
	}
	return nil
}

// Hold stops accepting (ztunnel's reconnections wait in the socket's
// backlog), closes every ztunnel connection (its proxies keep running) and
// returns a copy of the socket once their handlers have returned: whoever
// serves the socket next gives ztunnel its snapshot.
func (s *Server) Hold(ctx context.Context) (*os.File, error) {
	s.mu.Lock()
	s.holding = true
	s.mu.Unlock()
	f, err := s.sock.Hold(ctx, s.closeAll)
	if err != nil {
		s.Release()
		return nil, fmt.Errorf("zds: %w", err)
	}
	return f, nil
}

// Release serves again after Hold: ztunnel reconnects here.
func (s *Server) Release() {
	s.mu.Lock()
	s.holding = false
	s.mu.Unlock()
	s.sock.Release()
}

// Retire stops serving for good, leaving the socket to the agent it was
// handed to: Serve returns.
func (s *Server) Retire() { s.sock.Retire() }

// Serve accepts connections until ctx ends or Retire, then closes every
// connection.
// Closing a connection leaves ztunnel's proxies running: it reconnects and
// receives a fresh snapshot.
func (s *Server) Serve(ctx context.Context) error {
	// Connections close as soon as ctx ends, so handlers mid-request return
	// promptly and Serve can wait for them.
	stop := context.AfterFunc(ctx, s.closeAll)
	defer stop()
	if err := s.sock.Serve(ctx, func(uc *net.UnixConn) { s.handle(ctx, uc) }); err != nil {
		return fmt.Errorf("zds: %w", err)
	}
	return nil
}

func (s *Server) closeAll() {
	s.mu.Lock()
	conns := append([]*conn(nil), s.conns...)
	s.mu.Unlock()
	for _, c := range conns {
		c.fail(errors.New("server shutting down"))
	}
}

// State returns the current readiness signal.
func (s *Server) State() State {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.stateLocked()
}

// Subscribe returns a channel that always holds the latest State after a
// change (older undelivered values are replaced, so a slow reader never
// blocks the server), starting with the current one. cancel releases it.
func (s *Server) Subscribe() (<-chan State, func()) { return s.states.Subscribe() }

// Follow calls each with the current State and then every change, on the
// caller's goroutine, until ctx ends: what a readiness gate needs to track
// ztunnel.
func (s *Server) Follow(ctx context.Context, each func(State)) {
	states, stop := s.Subscribe()
	defer stop()
	for {
		select {
		case <-ctx.Done():
			return
		case st := <-states:
			each(st)
		}
	}
}

func (s *Server) stateLocked() State {
	st := State{Connections: len(s.conns)}
	for _, c := range s.conns {
		if c.snapshotAcked {
			st.Ready = true
		}
	}
	return st
}

// publishLocked tells subscribers about a change; holding s.mu keeps the
// published order the order of changes.
func (s *Server) publishLocked() {
	st := s.stateLocked()
	if st == s.published {
		return
	}
	if st.Ready != s.published.Ready {
		s.log.Info("ztunnel readiness changed", "ready", st.Ready, "connections", st.Connections)
	}
	s.published = st
	s.states.Publish(st)
}

// Add tells the newest connection about a pod and returns once ztunnel has
// acknowledged it, which means its listeners exist inside the pod. An Ack
// with an error comes back as *AckError.
func (s *Server) Add(ctx context.Context, w Workload) error {
	if w.NetNS == nil {
		return fmt.Errorf("zds: Add of pod %s without a netns", w.UID)
	}
	msg, err := addRequest(w)
	if err != nil {
		return err
	}
	s.mu.Lock()
	var newest *conn
	if n := len(s.conns); n > 0 {
		newest = s.conns[n-1]
	}
	s.mu.Unlock()
	if newest == nil {
		return ErrNoConnection
	}
	return newest.do(ctx, &request{op: "add", uid: w.UID, payload: msg, netns: w.NetNS})
}

// Del tells every connection that a pod is gone. With no connection there is
// nobody to tell and Del succeeds: the next snapshot will not name the pod.
func (s *Server) Del(ctx context.Context, uid string) error {
	if uid == "" {
		return errors.New("zds: Del without a uid")
	}
	msg, err := Marshal(&zdspb.WorkloadRequest{Payload: &zdspb.WorkloadRequest_Del{Del: &zdspb.DelWorkload{Uid: uid}}})
	if err != nil {
		return err
	}
	s.mu.Lock()
	conns := append([]*conn(nil), s.conns...)
	s.mu.Unlock()
	errs := make([]error, len(conns))
	var wg sync.WaitGroup
	for i, c := range conns {
		wg.Go(func() {
			err := c.do(ctx, &request{op: "del", uid: uid, payload: msg})
			if errors.Is(err, ErrConnectionClosed) {
				// A ztunnel that went away forgets the pod with its
				// connection; there is nothing left to delete there.
				err = nil
			}
			errs[i] = err
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}

// Kubernetes' own limits on the names an Add carries (a namespace is a DNS
// label, pod and service account names DNS subdomains, a uid a UUID with room
// to spare). Together they keep any Add inside the 1 KiB datagram, so these
// checks only reject data that did not come from Kubernetes.
var fieldLimits = []struct {
	field string
	max   int
	value func(Workload) string
}{
	{"uid", maxUIDLen, func(w Workload) string { return w.UID }},
	{"namespace", 63, func(w Workload) string { return w.Namespace }},
	{"name", 253, func(w Workload) string { return w.Name }},
	{"service account", 253, func(w Workload) string { return w.ServiceAccount }},
}

const maxUIDLen = 128

func addRequest(w Workload) ([]byte, error) {
	for _, f := range fieldLimits {
		if v := f.value(w); len(v) > f.max {
			return nil, fmt.Errorf("%w: pod %.63s/%.253s: %s is %d bytes (at most %d)", ErrMessageTooLarge, w.Namespace, w.Name, f.field, len(v), f.max)
		}
	}
	if w.UID == "" {
		return nil, fmt.Errorf("zds: pod %s/%s has no uid", w.Namespace, w.Name)
	}
	return Marshal(&zdspb.WorkloadRequest{Payload: &zdspb.WorkloadRequest_Add{Add: &zdspb.AddWorkload{
		Uid: w.UID,
		WorkloadInfo: &zdspb.WorkloadInfo{
			Name:           w.Name,
			Namespace:      w.Namespace,
			ServiceAccount: w.ServiceAccount,
		},
	}}})
}

func (s *Server) handle(ctx context.Context, uc *net.UnixConn) {
	defer uc.Close()
	cred, err := unixsock.CheckPeer(uc, s.cfg.AllowedPeerUIDs)
	if err != nil {
		s.log.Warn("rejecting connection", "err", err)
		return
	}
	log := s.log.With("peerPID", cred.Pid)
	if err := s.readHello(uc); err != nil {
		log.Error("rejecting connection", "err", err)
		return
	}

	s.mu.Lock()
	if s.holding {
		// Accepted just before a Hold, after its closeAll: ztunnel
		// reconnects to whoever serves next.
		s.mu.Unlock()
		log.Info("closing a ztunnel connection: the socket is being handed over")
		return
	}
	s.nextID++
	c := newConn(s.nextID, uc, s.cfg.AckTimeout, log.With("conn", s.nextID))
	s.conns = append(s.conns, c)
	s.publishLocked()
	s.mu.Unlock()
	c.log.Info("ztunnel connected")

	go c.readLoop()
	err = c.run(ctx, s.cfg.Source, func() {
		s.mu.Lock()
		c.snapshotAcked = true
		s.publishLocked()
		s.mu.Unlock()
	})
	c.fail(err)
	s.mu.Lock()
	for i, x := range s.conns {
		if x == c {
			s.conns = append(s.conns[:i], s.conns[i+1:]...)
			break
		}
	}
	s.publishLocked()
	s.mu.Unlock()
	c.log.Info("ztunnel disconnected", "reason", c.closeReason())
}

func (s *Server) readHello(uc *net.UnixConn) error {
	if err := uc.SetReadDeadline(time.Now().Add(s.cfg.HelloTimeout)); err != nil {
		return err
	}
	d, err := ReadDatagram(uc)
	if err != nil {
		if errors.Is(err, os.ErrDeadlineExceeded) {
			return fmt.Errorf("zds: no ZdsHello within %s", s.cfg.HelloTimeout)
		}
		return fmt.Errorf("zds: read ZdsHello: %w", err)
	}
	if len(d.FDs) > 0 {
		d.CloseFDs()
		return errors.New("zds: ZdsHello carried file descriptors")
	}
	if err := DecodeHello(d.Payload); err != nil {
		return err
	}
	return uc.SetReadDeadline(time.Time{})
}

// isPeerGone reports errors that mean the other end has gone away.
func isPeerGone(err error) bool {
	return errors.Is(err, io.EOF) || errors.Is(err, net.ErrClosed) || errors.Is(err, syscall.EPIPE) ||
		errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.ENOTCONN)
}
