package cniserver_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/inpod-dev/inpod/agent/cniserver"
	"github.com/inpod-dev/inpod/cnievent"
	"github.com/inpod-dev/inpod/internal/testkit"
)

// handler records requests and answers with whatever the test sets.
type handler struct {
	mu      sync.Mutex
	seen    []cnievent.Request
	outcome cnievent.Outcome
	err     error
	block   chan struct{}
}

func (h *handler) answer(req *cnievent.Request) (cnievent.Outcome, error) {
	h.mu.Lock()
	h.seen = append(h.seen, *req)
	block, outcome, err := h.block, h.outcome, h.err
	h.mu.Unlock()
	if block != nil {
		<-block
	}
	return outcome, err
}

func (h *handler) Add(_ context.Context, r *cnievent.Request) (cnievent.Outcome, error) {
	return h.answer(r)
}
func (h *handler) Del(_ context.Context, r *cnievent.Request) (cnievent.Outcome, error) {
	return h.answer(r)
}
func (h *handler) Check(_ context.Context, r *cnievent.Request) (cnievent.Outcome, error) {
	return h.answer(r)
}

func (h *handler) count() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return len(h.seen)
}

func start(t *testing.T, h cniserver.Handler, mod func(*cniserver.Config)) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "inpod", "cni.sock")
	cfg := cniserver.Config{SocketPath: path, Handler: h, ReadTimeout: 300 * time.Millisecond}
	if mod != nil {
		mod(&cfg)
	}
	srv, err := cniserver.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	testkit.Serve(t, srv)
	return path
}

func validAdd() *cnievent.Request {
	return &cnievent.Request{
		Command: cnievent.Add, PodNamespace: "default", PodName: "web-1", PodUID: "0b5a3f9e-1c2d-4e5f-8a9b-0c1d2e3f4a5b",
		ContainerID: strings.Repeat("ab", 32), Netns: "/var/run/netns/cni-1234", IfName: "eth0",
		IPs: []string{"198.51.100.9", "fd42::9"},
	}
}

func send(t *testing.T, path string, req *cnievent.Request) (*cnievent.Response, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	return cnievent.Send(ctx, path, req)
}

func TestValidRequestReachesHandlerAndVerdictComesBack(t *testing.T) {
	h := &handler{outcome: cnievent.Redirected}
	path := start(t, h, nil)
	resp, err := send(t, path, validAdd())
	if err != nil || resp.Outcome != cnievent.Redirected {
		t.Fatalf("Send = %+v, %v", resp, err)
	}
	if h.count() != 1 || h.seen[0].PodUID != validAdd().PodUID || len(h.seen[0].IPs) != 2 {
		t.Fatalf("handler saw %+v", h.seen)
	}
	h.err = errors.New("ztunnel rejected the pod: no listeners")
	resp, err = send(t, path, validAdd())
	if err != nil || resp.Outcome != cnievent.Failed || !strings.Contains(resp.Message, "no listeners") {
		t.Fatalf("Send with a failing pipeline = %+v, %v; want its error text", resp, err)
	}
}

func TestInvalidRequestsAreRefusedWithoutReachingTheHandler(t *testing.T) {
	h := &handler{outcome: cnievent.Redirected}
	path := start(t, h, nil)
	bad := map[string]func(r *cnievent.Request){
		"netns outside the allowed dirs": func(r *cnievent.Request) { r.Netns = "/etc/passwd" },
		"netns escaping its dir":         func(r *cnievent.Request) { r.Netns = "/var/run/netns/../../etc/x" },
		"netns in a subdirectory":        func(r *cnievent.Request) { r.Netns = "/var/run/netns/a/b" },
		"proc path that is not a netns":  func(r *cnievent.Request) { r.Netns = "/proc/1/root" },
		"namespace with a slash":         func(r *cnievent.Request) { r.PodNamespace = "../kube-system" },
		"namespace too long":             func(r *cnievent.Request) { r.PodNamespace = strings.Repeat("a", 64) },
		"pod name with upper case":       func(r *cnievent.Request) { r.PodName = "Web" },
		"uid with spaces":                func(r *cnievent.Request) { r.PodUID = "a b" },
		"IP that is not an IP":           func(r *cnievent.Request) { r.IPs = []string{"198.51.100.300"} },
		"unknown command":                func(r *cnievent.Request) { r.Command = "VERSION" },
		"missing container id":           func(r *cnievent.Request) { r.ContainerID = "" },
		"interface name with a slash":    func(r *cnievent.Request) { r.IfName = "eth0/../x" },
		"ADD without a netns":            func(r *cnievent.Request) { r.Netns = "" },
	}
	for name, mutate := range bad {
		t.Run(name, func(t *testing.T) {
			req := validAdd()
			mutate(req)
			resp, err := send(t, path, req)
			if err != nil || resp.Outcome != cnievent.Failed || !strings.Contains(resp.Message, "invalid request") {
				t.Fatalf("Send = %+v, %v; want a refusal", resp, err)
			}
		})
	}
	if h.count() != 0 {
		t.Fatalf("the handler saw %d invalid requests", h.count())
	}
	// Allowed forms still pass: /proc netns paths, DEL without a netns.
	ok := validAdd()
	ok.Netns = "/proc/1234/ns/net"
	if resp, err := send(t, path, ok); err != nil || resp.Outcome != cnievent.Redirected {
		t.Fatalf("/proc netns path: %+v, %v", resp, err)
	}
	del := validAdd()
	del.Command, del.Netns = cnievent.Del, ""
	if resp, err := send(t, path, del); err != nil || resp.Outcome != cnievent.Redirected {
		t.Fatalf("DEL without netns: %+v, %v", resp, err)
	}
}

// rawExchange writes raw bytes, half-closes when told, and returns the reply.
func rawExchange(t *testing.T, path string, payload []byte, closeWrite bool) cnievent.Response {
	t.Helper()
	resp, err := tryRawExchange(path, payload, closeWrite)
	if err != nil {
		t.Fatal(err)
	}
	return resp
}

func tryRawExchange(path string, payload []byte, closeWrite bool) (cnievent.Response, error) {
	c, err := net.Dial("unix", path)
	if err != nil {
		return cnievent.Response{}, err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	if len(payload) > 0 {
		c.Write(payload)
	}
	if closeWrite {
		c.(*net.UnixConn).CloseWrite()
	}
	data, err := io.ReadAll(c)
	if err != nil {
		return cnievent.Response{}, err
	}
	var resp cnievent.Response
	if err := json.Unmarshal(data, &resp); err != nil {
		return resp, fmt.Errorf("reply %q: %v", data, err)
	}
	return resp, nil
}

func TestGarbageOversizedAndSlowRequestsGetErrorsAndOthersAreServed(t *testing.T) {
	h := &handler{outcome: cnievent.NotEnrolled}
	path := start(t, h, nil)

	// A slow peer holds its connection open without sending; meanwhile a
	// well-behaved request is answered.
	type result struct {
		resp cnievent.Response
		err  error
	}
	slow := make(chan result, 1)
	go func() {
		resp, err := tryRawExchange(path, nil, false)
		slow <- result{resp, err}
	}()
	if resp, err := send(t, path, validAdd()); err != nil || resp.Outcome != cnievent.NotEnrolled {
		t.Fatalf("request beside a slow peer: %+v, %v", resp, err)
	}
	if got := <-slow; got.err != nil || got.resp.Outcome != cnievent.Failed || !strings.Contains(got.resp.Message, "not received in time") {
		t.Fatalf("slow peer got %+v, %v", got.resp, got.err)
	}

	if got := rawExchange(t, path, []byte("{not json"), true); got.Outcome != cnievent.Failed || !strings.Contains(got.Message, "undecodable") {
		t.Fatalf("garbage got %+v", got)
	}
	huge := []byte(`{"command":"ADD","podName":"` + strings.Repeat("x", cnievent.MaxMessageSize) + `"}`)
	if got := rawExchange(t, path, huge, true); got.Outcome != cnievent.Failed || !strings.Contains(got.Message, "limit") {
		t.Fatalf("oversized got %+v", got)
	}
	if resp, err := send(t, path, validAdd()); err != nil || resp.Outcome != cnievent.NotEnrolled {
		t.Fatalf("after bad peers: %+v, %v", resp, err)
	}
}

func TestDisallowedPeerIsRefused(t *testing.T) {
	h := &handler{outcome: cnievent.Redirected}
	// The test runs as root; allowing only another uid shows root refused.
	path := start(t, h, func(c *cniserver.Config) { c.AllowedPeerUIDs = []uint32{4242} })
	if _, err := send(t, path, validAdd()); !errors.Is(err, cnievent.ErrUnreachable) {
		t.Fatalf("Send from a disallowed peer = %v, want the connection closed unanswered", err)
	}
	if h.count() != 0 {
		t.Fatal("a disallowed peer's request reached the handler")
	}
}

func TestBusyServerQueuesThenRefusesAtTheTimeout(t *testing.T) {
	h := &handler{outcome: cnievent.Redirected, block: make(chan struct{})}
	waiting := &waitLog{}
	path := start(t, h, func(c *cniserver.Config) {
		c.MaxConcurrent, c.RequestTimeout = 1, 2*time.Second
		c.Logger = slog.New(slog.NewTextHandler(waiting, &slog.HandlerOptions{Level: slog.LevelDebug}))
	})
	first := make(chan error, 1)
	go func() {
		_, err := send(t, path, validAdd())
		first <- err
	}()
	testkit.Eventually(t, 5*time.Second, "the first request to reach the handler", func() bool { return h.count() > 0 })
	// While the only slot is taken, a request waits its whole timeout
	// and is then refused as busy, never reaching the handler.
	resp, err := send(t, path, validAdd())
	if err != nil || resp.Outcome != cnievent.Failed || !strings.Contains(resp.Message, "busy") {
		t.Fatalf("second request = %+v, %v; want busy", resp, err)
	}
	if h.count() != 1 {
		t.Fatalf("handler saw %d requests, want 1", h.count())
	}
	// One sent meanwhile waits (the server says so), and is served once
	// the slot frees up.
	before := waiting.count()
	third := make(chan *cnievent.Response, 1)
	go func() {
		resp, err := send(t, path, validAdd())
		if err != nil {
			resp = &cnievent.Response{Outcome: cnievent.Failed, Message: err.Error()}
		}
		third <- resp
	}()
	testkit.Eventually(t, 5*time.Second, "the third request waiting for a slot", func() bool { return waiting.count() > before })
	close(h.block)
	if err := <-first; err != nil {
		t.Fatal(err)
	}
	if resp := <-third; resp.Outcome != cnievent.Redirected {
		t.Fatalf("a request queued behind a finished one = %+v, want served", resp)
	}
}

// waitLog counts the server's "waiting for a slot" lines.
type waitLog struct {
	mu sync.Mutex
	n  int
}

func (w *waitLog) Write(p []byte) (int, error) {
	if strings.Contains(string(p), "waiting for a slot") {
		w.mu.Lock()
		w.n++
		w.mu.Unlock()
	}
	return len(p), nil
}

func (w *waitLog) count() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.n
}
