package cniserver_test

import (
	"context"
	"net"
	"path/filepath"
	"testing"
	"time"

	"github.com/inpod-dev/inpod/agent/cniserver"
	"github.com/inpod-dev/inpod/cnievent"
	"github.com/inpod-dev/inpod/internal/testkit"
)

// The plugin's view of a hand-over: a request in progress when the hold
// starts gets the old server's answer, one sent during the switch is
// answered by one of them, and the successor answers after; none fails.
func TestHoldFinishesInFlightAndTheSuccessorAnswersWhatWaited(t *testing.T) {
	path := filepath.Join(t.TempDir(), "inpod", "cni.sock")
	oldH := &handler{outcome: cnievent.Redirected, block: make(chan struct{})}
	old, err := cniserver.New(cniserver.Config{SocketPath: path, Handler: oldH})
	if err != nil {
		t.Fatal(err)
	}
	testkit.Serve(t, old)

	inFlight := make(chan error, 1)
	go func() {
		resp, err := send(t, path, validAdd())
		if err == nil && resp.Outcome != cnievent.Redirected {
			err = &outcomeError{resp}
		}
		inFlight <- err
	}()
	testkit.Eventually(t, 5*time.Second, "the first request at the old handler", func() bool { return oldH.count() == 1 })

	type held struct {
		ln  *net.UnixListener
		err error
	}
	holdDone := make(chan held, 1)
	go func() {
		f, err := old.Hold(context.Background())
		if err != nil {
			holdDone <- held{err: err}
			return
		}
		defer f.Close()
		l, err := net.FileListener(f)
		if err != nil {
			holdDone <- held{err: err}
			return
		}
		holdDone <- held{ln: l.(*net.UnixListener)}
	}()
	// Sent while the old server holds or has handed over: it waits.
	waited := make(chan *cnievent.Response, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		resp, err := cnievent.Send(ctx, path, validAdd())
		if err != nil {
			resp = &cnievent.Response{Outcome: cnievent.Failed, Message: err.Error()}
		}
		waited <- resp
	}()
	close(oldH.block)
	if err := <-inFlight; err != nil {
		t.Fatalf("the request in flight at the hold: %v", err)
	}
	h := <-holdDone
	if h.err != nil {
		t.Fatal(h.err)
	}
	old.Retire()

	newH := &handler{outcome: cnievent.NotEnrolled}
	successor, err := cniserver.New(cniserver.Config{SocketPath: path, Handler: newH})
	if err != nil {
		t.Fatal(err)
	}
	if err := successor.Adopt(h.ln); err != nil {
		t.Fatal(err)
	}
	testkit.Serve(t, successor)
	// Accepted by the old server just before its hold, or waiting in the
	// backlog for the successor: answered either way.
	if resp := <-waited; resp.Outcome == cnievent.Failed {
		t.Fatalf("the request sent during the switch failed: %+v", resp)
	}
	if resp, err := send(t, path, validAdd()); err != nil || resp.Outcome != cnievent.NotEnrolled {
		t.Fatalf("after the switch: %+v %v", resp, err)
	}
	if oldH.count()+newH.count() != 3 {
		t.Fatalf("the handlers saw %d+%d requests, want 3 in all", oldH.count(), newH.count())
	}
}

type outcomeError struct{ resp *cnievent.Response }

func (e *outcomeError) Error() string {
	return "outcome " + string(e.resp.Outcome) + ": " + e.resp.Message
}
