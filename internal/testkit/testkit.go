// Package testkit holds the helpers inpod's tests share: polling with a
// deadline instead of sleeping, the repository root, and temporary
// directories short enough for unix socket paths. Tests only; nothing in a
// binary imports it.
package testkit

import (
	"context"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"
)

// pollInterval is short: the conditions polled are cheap reads, and a long
// interval would hide how fast the thing under test really is.
const pollInterval = 5 * time.Millisecond

// Eventually polls cond until it holds and returns how long that took, or
// fails the test naming what it waited for once timeout has passed.
func Eventually(t testing.TB, timeout time.Duration, what string, cond func() bool) time.Duration {
	t.Helper()
	start := time.Now()
	for !cond() {
		if time.Since(start) > timeout {
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		time.Sleep(pollInterval)
	}
	return time.Since(start)
}

// Poll is Eventually for code that is not a test (harnesses, benchmarks'
// set-up): it returns an error instead of failing a test. cond's error ends
// the wait at once.
func Poll(timeout time.Duration, what string, cond func() (bool, error)) error {
	deadline := time.Now().Add(timeout)
	for {
		ok, err := cond()
		if err != nil {
			return err
		}
		if ok {
			return nil
		}
		if time.Now().After(deadline) {
			return &TimeoutError{What: what, After: timeout}
		}
		time.Sleep(pollInterval)
	}
}

// TimeoutError says what Poll waited for.
type TimeoutError struct {
	What  string
	After time.Duration
}

func (e *TimeoutError) Error() string {
	return "timed out after " + e.After.String() + " waiting for " + e.What
}

// RepoDir is the root of the inpod module the test runs in.
func RepoDir(t testing.TB) string {
	t.Helper()
	out, err := exec.Command("go", "env", "GOMOD").Output()
	if err != nil {
		t.Fatalf("go env GOMOD: %v", err)
	}
	return filepath.Dir(strings.TrimSpace(string(out)))
}

// ShortTempDir is a temporary directory under /tmp, removed when the test
// ends. t.TempDir() nests the test's name and can exceed the 108 bytes a
// unix socket path may have.
func ShortTempDir(t testing.TB, prefix string) string {
	t.Helper()
	dir, err := os.MkdirTemp("", prefix)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

// Server is a socket server with inpod's two-step start: Listen binds (so
// a test can dial as soon as it returns), Serve runs until its context
// ends.
type Server interface {
	Listen() error
	Serve(ctx context.Context) error
}

// Serve listens and serves srv until the test ends; Serve's error fails
// the test.
func Serve(t testing.TB, srv Server) {
	t.Helper()
	if err := srv.Listen(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Serve: %v", err)
		}
	})
}

// RequireNoFDLeak runs cycle once, then n times, and fails the test if the
// process holds more file descriptors after than before the n.
func RequireNoFDLeak(t *testing.T, n int, what string, cycle func()) {
	t.Helper()
	// The first cycle may open what the process keeps for good (the
	// runtime's poller, for one).
	cycle()
	// Files an earlier test dropped without closing are closed by their
	// finalizers when the collector runs: let that happen before counting,
	// not in the middle. (A count that drops is no leak; one that grows
	// is.)
	runtime.GC()
	before := openFDs(t)
	for range n {
		cycle()
	}
	// A descriptor the process holds for a moment as it is counted (CI
	// once saw one more, once) is not a leak: one that stays is.
	after := openFDs(t)
	for deadline := time.Now().Add(5 * time.Second); after > before && time.Now().Before(deadline); after = openFDs(t) {
		time.Sleep(50 * time.Millisecond)
	}
	if after > before {
		t.Errorf("%d file descriptors open after %d %s, %d before", after, n, what, before)
	}
}

// openFDs counts this process's open file descriptors.
func openFDs(t *testing.T) int {
	t.Helper()
	entries, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(entries)
}

// StaleUnixSocket leaves a socket file at path that nobody serves, as a
// process killed without its clean stop does: connecting is refused.
func StaleUnixSocket(t testing.TB, network, path string) {
	t.Helper()
	ln, err := net.ListenUnix(network, &net.UnixAddr{Name: path, Net: network})
	if err != nil {
		t.Fatal(err)
	}
	ln.SetUnlinkOnClose(false)
	ln.Close()
	t.Cleanup(func() { os.Remove(path) })
}
