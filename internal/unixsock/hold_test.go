package unixsock_test

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/inpod-dev/inpod/internal/testkit"
	"github.com/inpod-dev/inpod/internal/unixsock"
)

// served is a Socket being served by a handler that writes reply to each
// connection once release (if not nil) is closed; accepted gets a value
// per connection the handler has.
type served struct {
	s        *unixsock.Socket
	done     chan error
	stop     context.CancelFunc
	accepted chan struct{}
}

func serveSocket(t *testing.T, s *unixsock.Socket, reply string, release <-chan struct{}) *served {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	sv := &served{s: s, done: make(chan error, 1), stop: cancel, accepted: make(chan struct{}, 16)}
	go func() {
		sv.done <- s.Serve(ctx, func(uc *net.UnixConn) {
			sv.accepted <- struct{}{}
			if release != nil {
				<-release
			}
			uc.Write([]byte(reply))
			uc.Close()
		})
	}()
	t.Cleanup(func() {
		cancel()
		select {
		case <-sv.done:
		case <-time.After(10 * time.Second):
			t.Error("Serve did not return after its context ended")
		}
	})
	return sv
}

func newSocket(t *testing.T) (*unixsock.Socket, string) {
	path := filepath.Join(testkit.ShortTempDir(t, "unixsock-"), "s.sock")
	s := unixsock.NewSocket("unix", path, slog.New(slog.NewTextHandler(io.Discard, nil)), "listening")
	if err := s.Listen(); err != nil {
		t.Fatal(err)
	}
	return s, path
}

func dial(t *testing.T, path string) net.Conn {
	t.Helper()
	c, err := net.Dial("unix", path)
	if err != nil {
		t.Fatalf("connect to %s: %v", path, err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func waitAccepted(t *testing.T, sv *served) {
	t.Helper()
	select {
	case <-sv.accepted:
	case <-time.After(10 * time.Second):
		t.Fatal("the connection was not accepted")
	}
}

// answer reads the whole reply on c within d.
func answer(c net.Conn, d time.Duration) (string, error) {
	c.SetReadDeadline(time.Now().Add(d))
	b, err := io.ReadAll(c)
	return string(b), err
}

// While held, a new connection waits in the backlog unanswered; after
// Release, the same process answers it.
func TestSocketHoldThenReleaseAnswersWhatWaited(t *testing.T) {
	s, path := newSocket(t)
	serveSocket(t, s, "a", nil)
	if got, err := answer(dial(t, path), 10*time.Second); got != "a" {
		t.Fatalf("before the hold: %q %v", got, err)
	}
	f, err := s.Hold(context.Background(), nil)
	if err != nil {
		t.Fatal(err)
	}
	f.Close()
	waiting := dial(t, path)
	if got, err := answer(waiting, 300*time.Millisecond); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("a connection made while held was answered: %q %v", got, err)
	}
	s.Release()
	if got, err := answer(waiting, 10*time.Second); got != "a" {
		t.Fatalf("after Release, the waiting connection got %q %v", got, err)
	}
	if _, err := s.Hold(context.Background(), nil); err != nil {
		t.Fatalf("a second hold after Release: %v", err)
	}
	s.Release()
}

// Hold returns only once the connections accepted before it are handled,
// and calls end after the accept loop stopped.
func TestSocketHoldWaitsForTheConnectionsInFlight(t *testing.T) {
	s, path := newSocket(t)
	release := make(chan struct{})
	sv := serveSocket(t, s, "a", release)
	busy := dial(t, path)
	waitAccepted(t, sv)
	ended := make(chan struct{})
	held := make(chan error, 1)
	go func() {
		f, err := s.Hold(context.Background(), func() { close(ended) })
		if f != nil {
			f.Close()
		}
		held <- err
	}()
	select {
	case <-ended:
	case <-time.After(10 * time.Second):
		t.Fatal("end was not called")
	}
	select {
	case err := <-held:
		t.Fatalf("Hold returned (%v) while a connection was being handled", err)
	case <-time.After(200 * time.Millisecond): // the negative: Hold still waits
	}
	close(release)
	if err := <-held; err != nil {
		t.Fatal(err)
	}
	if got, err := answer(busy, 10*time.Second); got != "a" {
		t.Fatalf("the connection in flight got %q %v", got, err)
	}
	s.Release()
}

// A hold whose context ends before the handlers finish gives up, and the
// socket serves again.
func TestSocketHoldGivenUpServesAgain(t *testing.T) {
	s, path := newSocket(t)
	release := make(chan struct{})
	sv := serveSocket(t, s, "a", release)
	dial(t, path)
	waitAccepted(t, sv)
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	if f, err := s.Hold(ctx, nil); err == nil {
		f.Close()
		t.Fatal("Hold succeeded while a handler was busy past its context")
	}
	next := dial(t, path)
	close(release)
	if got, err := answer(next, 10*time.Second); got != "a" {
		t.Fatalf("after a hold given up, a new connection got %q %v", got, err)
	}
}

// Retire after Hold: Serve returns, the path stays, and a second Socket
// adopting the copy answers both the connection that waited and new ones.
func TestSocketRetireHandsTheSocketToItsAdopter(t *testing.T) {
	old, path := newSocket(t)
	sv := serveSocket(t, old, "old", nil)
	f, err := old.Hold(context.Background(), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	waiting := dial(t, path)
	old.Retire()
	select {
	case err := <-sv.done:
		sv.done <- err // for the cleanup
		if err != nil {
			t.Fatalf("Serve after Retire: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Serve did not return after Retire")
	}
	if _, err := os.Stat(path); err != nil {
		t.Fatalf("Retire removed the path: %v", err)
	}
	l, err := net.FileListener(f)
	if err != nil {
		t.Fatal(err)
	}
	successor := unixsock.NewSocket("unix", path, slog.New(slog.NewTextHandler(io.Discard, nil)), "listening")
	if err := successor.Adopt(l.(*net.UnixListener)); err != nil {
		t.Fatal(err)
	}
	serveSocket(t, successor, "new", nil)
	if got, err := answer(waiting, 10*time.Second); got != "new" {
		t.Fatalf("the connection that waited through the switch got %q %v", got, err)
	}
	if got, err := answer(dial(t, path), 10*time.Second); got != "new" {
		t.Fatalf("a new connection got %q %v", got, err)
	}
	if err := successor.Adopt(l.(*net.UnixListener)); err == nil {
		t.Fatal("a second Adopt succeeded")
	}
}
