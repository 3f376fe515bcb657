// Package cniserver is the agent's end of the inpod-cni plugin's socket: it
// accepts only root peers, bounds and validates every request, hands valid
// ones to the enrollment pipeline (a Handler) and answers with its verdict.
// Nothing in a request is trusted: it names a pod and a netns path, and the
// pipeline checks both against its own view.
package cniserver

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"time"

	"github.com/inpod-dev/inpod/cnievent"
	"github.com/inpod-dev/inpod/internal/unixsock"
)

// Handler is the enrollment pipeline behind the socket.
type Handler interface {
	// Add redirects an enrolled pod, or reports it not enrolled.
	Add(ctx context.Context, req *cnievent.Request) (cnievent.Outcome, error)
	// Del forgets a pod's attachment.
	Del(ctx context.Context, req *cnievent.Request) (cnievent.Outcome, error)
	// Check verifies an enrolled pod's redirection.
	Check(ctx context.Context, req *cnievent.Request) (cnievent.Outcome, error)
}

// DefaultRequestTimeout is the agent's own bound on one CNI event: short
// of the plugin's wait, so the plugin gets the agent's answer, not its own
// timeout. An ADD that hits it fails.
const DefaultRequestTimeout = cnievent.Deadline - 5*time.Second

// Config configures the server; zero values take defaults.
type Config struct {
	SocketPath string
	Handler    Handler
	// ReadTimeout bounds receiving a request (a slow or stuck peer).
	ReadTimeout time.Duration
	// RequestTimeout bounds the pipeline's work on one request; keep it
	// below the plugin's own timeout so the plugin gets a real answer.
	RequestTimeout time.Duration
	// NetnsPrefixes are where a pod netns path may point (default: the
	// runtimes' /var/run/netns/ and /run/netns/, and /proc/<pid>/ns/net).
	NetnsPrefixes []string
	// MaxConcurrent bounds requests in progress; more wait for a slot
	// within their RequestTimeout.
	MaxConcurrent int
	// AllowedPeerUIDs: root only when empty.
	AllowedPeerUIDs []uint32
	Logger          *slog.Logger
}

// Server serves the plugin's socket.
type Server struct {
	cfg   Config
	log   *slog.Logger
	slots chan struct{}
	sock  *unixsock.Socket
}

// New validates cfg and fills in defaults.
func New(cfg Config) (*Server, error) {
	if cfg.Handler == nil {
		return nil, errors.New("cniserver: Config.Handler is required")
	}
	if cfg.SocketPath == "" {
		cfg.SocketPath = cnievent.DefaultSocketPath
	}
	if cfg.ReadTimeout <= 0 {
		cfg.ReadTimeout = 5 * time.Second
	}
	if cfg.RequestTimeout <= 0 {
		cfg.RequestTimeout = DefaultRequestTimeout
	}
	if len(cfg.NetnsPrefixes) == 0 {
		cfg.NetnsPrefixes = []string{"/var/run/netns/", "/run/netns/", "/proc/"}
	}
	if cfg.MaxConcurrent <= 0 {
		cfg.MaxConcurrent = 64
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	log = log.With("component", "cniserver")
	return &Server{cfg: cfg, log: log, slots: make(chan struct{}, cfg.MaxConcurrent),
		sock: unixsock.NewSocket("unix", cfg.SocketPath, log, "listening for CNI events")}, nil
}

// Listen creates the root-only socket; Serve does when nobody did.
func (s *Server) Listen() error {
	if err := s.sock.Listen(); err != nil {
		return fmt.Errorf("cniserver: %w", err)
	}
	return nil
}

// Adopt serves ln, the socket handed over by the agent before, instead of
// binding the path.
func (s *Server) Adopt(ln *net.UnixListener) error {
	if err := s.sock.Adopt(ln); err != nil {
		return fmt.Errorf("cniserver: %w", err)
	}
	return nil
}

// Hold stops answering new requests (the plugin's connections wait in the
// socket's backlog) and returns a copy of the socket once the requests in
// progress are answered; see unixsock.Socket.Hold.
func (s *Server) Hold(ctx context.Context) (*os.File, error) {
	f, err := s.sock.Hold(ctx, nil)
	if err != nil {
		return nil, fmt.Errorf("cniserver: %w", err)
	}
	return f, nil
}

// Release answers again after Hold.
func (s *Server) Release() { s.sock.Release() }

// Retire stops serving for good, leaving the socket to the agent it was
// handed to: Serve returns.
func (s *Server) Retire() { s.sock.Retire() }

// Serve answers requests until ctx ends or Retire, then waits for those in
// progress.
func (s *Server) Serve(ctx context.Context) error {
	if err := s.sock.Serve(ctx, func(uc *net.UnixConn) { s.serveConn(ctx, uc) }); err != nil {
		return fmt.Errorf("cniserver: %w", err)
	}
	return nil
}

func (s *Server) serveConn(ctx context.Context, uc *net.UnixConn) {
	defer uc.Close()
	if _, err := unixsock.CheckPeer(uc, s.cfg.AllowedPeerUIDs); err != nil {
		s.log.Warn("refusing CNI event connection", "err", err)
		return
	}
	uc.SetDeadline(time.Now().Add(s.cfg.ReadTimeout))
	req, err := readRequest(uc)
	if err == nil {
		err = s.Validate(req)
	}
	if err != nil {
		s.log.Warn("refusing a bad CNI event", "err", err)
		// Unread input would turn the close into a reset that destroys
		// the answer; swallow a bounded amount first.
		io.Copy(io.Discard, io.LimitReader(uc, 1<<20))
		s.reply(uc, cnievent.Failed, "invalid request: "+err.Error())
		return
	}
	// Attributes built only when a line is logged: With would allocate a
	// handler per request on the path of every pod start.
	attrs := func(more ...any) []any {
		return append([]any{"pod", req.Pod(), "command", req.Command, "container", shortID(req.ContainerID)}, more...)
	}

	// The request's deadline covers its wait for a slot too, so the
	// plugin still gets an answer before its own timeout. Waiting beats
	// refusing at once: a refused ADD costs the runtime a whole sandbox
	// torn down and set up again, and a burst of pods (100 at once on a
	// loaded node) would otherwise fail some only to retry them later.
	rctx, cancel := context.WithTimeout(ctx, s.cfg.RequestTimeout)
	defer cancel()
	start := time.Now()
	select {
	case s.slots <- struct{}{}:
		defer func() { <-s.slots }()
	default:
		s.log.Debug("CNI events at the limit; waiting for a slot", attrs("inProgress", s.cfg.MaxConcurrent)...)
		select {
		case s.slots <- struct{}{}:
			defer func() { <-s.slots }()
		case <-rctx.Done():
			s.log.Warn("too many CNI events in progress for the whole request timeout; refusing one", attrs("waited", time.Since(start))...)
			s.reply(uc, cnievent.Failed, fmt.Sprintf("agent busy: %d CNI events were in progress for %s", s.cfg.MaxConcurrent, time.Since(start).Round(time.Millisecond)))
			return
		}
	}
	outcome, err := s.dispatch(rctx, req)
	if err != nil {
		s.log.Error("CNI event failed", attrs("err", err, "took", time.Since(start))...)
		s.reply(uc, cnievent.Failed, err.Error())
		return
	}
	if s.log.Enabled(rctx, slog.LevelDebug) {
		s.log.Debug("CNI event handled", attrs("outcome", outcome, "took", time.Since(start))...)
	}
	s.reply(uc, outcome, "")
}

func (s *Server) dispatch(ctx context.Context, req *cnievent.Request) (cnievent.Outcome, error) {
	switch req.Command {
	case cnievent.Add:
		return s.cfg.Handler.Add(ctx, req)
	case cnievent.Del:
		return s.cfg.Handler.Del(ctx, req)
	default:
		return s.cfg.Handler.Check(ctx, req)
	}
}

func (s *Server) reply(uc *net.UnixConn, outcome cnievent.Outcome, msg string) {
	// The read deadline may have passed (a slow peer); the answer still
	// gets its own short window.
	uc.SetWriteDeadline(time.Now().Add(time.Second))
	b, _ := json.Marshal(cnievent.Response{Outcome: outcome, Message: msg})
	if _, err := uc.Write(b); err != nil {
		s.log.Warn("could not answer the plugin", "err", err)
	}
}

// readRequest reads one request up to EOF, bounded in size, and validates
// every field.
func readRequest(r io.Reader) (*cnievent.Request, error) {
	data, err := io.ReadAll(io.LimitReader(r, cnievent.MaxMessageSize+1))
	if err != nil {
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() {
			return nil, errors.New("request not received in time")
		}
		return nil, fmt.Errorf("read request: %w", err)
	}
	if len(data) > cnievent.MaxMessageSize {
		return nil, fmt.Errorf("request over the %d-byte limit", cnievent.MaxMessageSize)
	}
	var req cnievent.Request
	if err := json.Unmarshal(data, &req); err != nil {
		return nil, fmt.Errorf("undecodable request: %v", err)
	}
	return &req, nil
}

var (
	dnsLabel     = regexp.MustCompile(`^[a-z0-9]([-a-z0-9]*[a-z0-9])?$`)
	dnsSubdomain = regexp.MustCompile(`^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$`)
	uidPattern   = regexp.MustCompile(`^[A-Za-z0-9-]{1,128}$`)
	idPattern    = regexp.MustCompile(`^[A-Za-z0-9_.-]{1,256}$`)
	ifnamePat    = regexp.MustCompile(`^[^/\s:]{1,15}$`)
	procNetns    = regexp.MustCompile(`^/proc/[0-9]+/(task/[0-9]+/)?ns/net$`)
)

// Validate checks a request against what Kubernetes and the runtimes can
// produce; it is exported for the pipeline's own defensive use.
func (s *Server) Validate(req *cnievent.Request) error {
	switch req.Command {
	case cnievent.Add, cnievent.Del, cnievent.Check:
	default:
		return fmt.Errorf("unknown command %q", req.Command)
	}
	if len(req.PodNamespace) > 63 || !dnsLabel.MatchString(req.PodNamespace) {
		return fmt.Errorf("invalid pod namespace %q", req.PodNamespace)
	}
	if len(req.PodName) > 253 || !dnsSubdomain.MatchString(req.PodName) {
		return fmt.Errorf("invalid pod name %q", req.PodName)
	}
	if req.PodUID != "" && !uidPattern.MatchString(req.PodUID) {
		return fmt.Errorf("invalid pod uid %q", req.PodUID)
	}
	if !idPattern.MatchString(req.ContainerID) {
		return fmt.Errorf("invalid container id %q", req.ContainerID)
	}
	if req.IfName != "" && !ifnamePat.MatchString(req.IfName) {
		return fmt.Errorf("invalid interface name %q", req.IfName)
	}
	if req.Command != cnievent.Del || req.Netns != "" {
		if err := s.validNetns(req.Netns); err != nil {
			return err
		}
	}
	if len(req.IPs) > cnievent.MaxIPs {
		return fmt.Errorf("%d IPs, at most %d", len(req.IPs), cnievent.MaxIPs)
	}
	for _, ip := range req.IPs {
		if _, err := netip.ParseAddr(ip); err != nil {
			return fmt.Errorf("invalid IP %q", ip)
		}
	}
	return nil
}

func (s *Server) validNetns(p string) error {
	if p == "" {
		return errors.New("missing netns path")
	}
	if !filepath.IsAbs(p) || filepath.Clean(p) != p {
		return fmt.Errorf("netns path %q is not a clean absolute path", p)
	}
	for _, prefix := range s.cfg.NetnsPrefixes {
		if prefix == "/proc/" {
			if procNetns.MatchString(p) {
				return nil
			}
			continue
		}
		if strings.HasPrefix(p, prefix) && !strings.Contains(p[len(prefix):], "/") {
			return nil
		}
	}
	return fmt.Errorf("netns path %q is outside the allowed locations %v", p, s.cfg.NetnsPrefixes)
}

func shortID(id string) string {
	if len(id) > 12 {
		return id[:12]
	}
	return id
}
