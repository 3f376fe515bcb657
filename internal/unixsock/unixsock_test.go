package unixsock_test

import (
	"context"
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

func TestServeKeepsAcceptingWhileAHandlerIsBusy(t *testing.T) {
	dir, err := os.MkdirTemp("", "unixsock-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	path := filepath.Join(dir, "run", "s.sock")
	ln, err := unixsock.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(path); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("socket mode: %v %v", fi.Mode(), err)
	}
	if fi, err := os.Stat(filepath.Dir(path)); err != nil || fi.Mode().Perm() != 0o700 {
		t.Fatalf("socket dir mode: %v %v", fi.Mode(), err)
	}
	release := make(chan struct{})
	// Each connection says whether it should block; the handler echoes
	// the byte back once done.
	handle := func(uc *net.UnixConn) {
		defer uc.Close()
		b := make([]byte, 1)
		if _, err := io.ReadFull(uc, b); err != nil {
			return
		}
		if b[0] == 'b' {
			<-release
		}
		uc.Write(b)
	}
	ctx, cancel := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- unixsock.Serve(ctx, ln, slog.Default(), handle) }()

	call := func(b byte) (net.Conn, error) {
		c, err := net.Dial("unix", path)
		if err != nil {
			return nil, err
		}
		c.SetDeadline(time.Now().Add(10 * time.Second))
		_, err = c.Write([]byte{b})
		return c, err
	}
	answer := func(c net.Conn) byte {
		b := make([]byte, 1)
		if _, err := io.ReadFull(c, b); err != nil {
			t.Fatal(err)
		}
		return b[0]
	}
	blocked, err := call('b')
	if err != nil {
		t.Fatal(err)
	}
	// While one handler is held, every other connection is still served.
	for i := range 20 {
		c, err := call(byte('0' + i%10))
		if err != nil {
			t.Fatal(err)
		}
		if got := answer(c); got != byte('0'+i%10) {
			t.Fatalf("answer %q", got)
		}
		c.Close()
	}
	close(release)
	if got := answer(blocked); got != 'b' {
		t.Fatalf("held connection answered %q", got)
	}
	cancel()
	select {
	case err := <-served:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Serve did not return after its context ended")
	}
}

// A client that connects after Listen and before Serve is answered once
// serving starts; a second Listen keeps the same socket.
func TestSocketListenedEarlyAnswersWhatConnectedBeforeServe(t *testing.T) {
	path := filepath.Join(testkit.ShortTempDir(t, "unixsock-"), "s.sock")
	s := unixsock.NewSocket("unix", path, slog.New(slog.NewTextHandler(io.Discard, nil)), "listening")
	if err := s.Listen(); err != nil {
		t.Fatal(err)
	}
	before, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Listen(); err != nil {
		t.Fatalf("a second Listen: %v", err)
	}
	if after, err := os.Stat(path); err != nil || !os.SameFile(before, after) {
		t.Fatalf("a second Listen replaced the socket: %v", err)
	}
	c, err := net.Dial("unix", path)
	if err != nil {
		t.Fatalf("connect before Serve: %v", err)
	}
	defer c.Close()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- s.Serve(ctx, func(uc *net.UnixConn) { uc.Write([]byte("y")); uc.Close() })
	}()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	b := make([]byte, 1)
	if _, err := io.ReadFull(c, b); err != nil || b[0] != 'y' {
		t.Fatalf("the early client was not answered: %q %v", b, err)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Serve: %v", err)
	}
}

func TestSocketServeListensWhenNobodyDid(t *testing.T) {
	path := filepath.Join(testkit.ShortTempDir(t, "unixsock-"), "s.sock")
	s := unixsock.NewSocket("unix", path, slog.New(slog.NewTextHandler(io.Discard, nil)), "listening")
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Serve(ctx, func(uc *net.UnixConn) { uc.Close() }) }()
	testkit.Eventually(t, 10*time.Second, "Serve listening", func() bool {
		c, err := net.Dial("unix", path)
		if err == nil {
			c.Close()
		}
		return err == nil
	})
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Serve: %v", err)
	}
}
