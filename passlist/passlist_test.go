package passlist_test

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/inpod-dev/inpod/passlist"
)

type view struct {
	mu   sync.Mutex
	pods map[string]struct {
		uid         string
		notEnrolled bool
	}
}

func (v *view) set(key, uid string, notEnrolled bool) {
	v.mu.Lock()
	defer v.mu.Unlock()
	v.pods[key] = struct {
		uid         string
		notEnrolled bool
	}{uid, notEnrolled}
}

func (v *view) decide(namespace, name string) (string, bool, bool) {
	v.mu.Lock()
	defer v.mu.Unlock()
	p, ok := v.pods[namespace+"/"+name]
	return p.uid, p.notEnrolled, ok
}

// open starts a list with its heartbeat and waits for the first beat.
func open(t *testing.T, dir string, v *view) *passlist.List {
	t.Helper()
	l, err := passlist.Open(dir, v.decide, slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { l.Run(ctx); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		if _, err := os.Stat(filepath.Join(dir, ".alive")); err == nil {
			return l
		}
		if time.Now().After(deadline) {
			t.Fatal("no heartbeat")
		}
	}
}

func TestListFollowsTheAgentsView(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "pass")
	v := &view{pods: map[string]struct {
		uid         string
		notEnrolled bool
	}{}}
	l := open(t, dir, v)
	if fi, err := os.Stat(dir); err != nil || fi.Mode().Perm() != 0o700 {
		t.Fatalf("list dir: %v %v", fi.Mode(), err)
	}

	v.set("plain/app", "u1", true)
	l.Refresh("plain", "app")
	if !passlist.Passes(dir, "plain", "app", "u1") || !passlist.Passes(dir, "plain", "app", "") {
		t.Fatal("a pod known not enrolled does not pass")
	}
	if passlist.Passes(dir, "plain", "app", "u2") {
		t.Fatal("another pod of the same name passes")
	}
	if passlist.Passes(dir, "plain", "unknown", "") {
		t.Fatal("a pod the agent has not classified passes")
	}

	// Enrolled now (say its namespace was labelled): asked about again.
	v.set("plain/app", "u1", false)
	l.Refresh("plain", "app")
	if passlist.Passes(dir, "plain", "app", "u1") {
		t.Fatal("an enrolled pod still passes")
	}
	// Recreated under the same name, not enrolled, then deleted.
	v.set("plain/app", "u3", true)
	l.Refresh("plain", "app")
	if !passlist.Passes(dir, "plain", "app", "u3") || passlist.Passes(dir, "plain", "app", "u1") {
		t.Fatal("the entry does not follow the new pod")
	}
	delete(v.pods, "plain/app")
	l.Refresh("plain", "app")
	if passlist.Passes(dir, "plain", "app", "u3") {
		t.Fatal("a deleted pod still passes")
	}

	// Names that would escape the directory or collide never pass.
	for _, bad := range [][2]string{{"a.b", "c"}, {"ns", "../x"}, {"", "x"}, {"ns", ""}, {"ns", ".."}} {
		v.set(bad[0]+"/"+bad[1], "u", true)
		l.Refresh(bad[0], bad[1])
		if passlist.Passes(dir, bad[0], bad[1], "u") {
			t.Errorf("%q/%q passes", bad[0], bad[1])
		}
	}
}

func TestListIsTrustedOnlyWhileTheAgentBeats(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "pass")
	v := &view{pods: map[string]struct {
		uid         string
		notEnrolled bool
	}{"plain/app": {"u1", true}}}
	l, err := passlist.Open(dir, v.decide, slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	l.Refresh("plain", "app")
	if passlist.Passes(dir, "plain", "app", "u1") {
		t.Fatal("passes before the first heartbeat")
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { l.Run(ctx); close(done) }()
	alive := filepath.Join(dir, ".alive")
	for deadline := time.Now().Add(5 * time.Second); !passlist.Passes(dir, "plain", "app", "u1"); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("does not pass with a live heartbeat")
		}
	}
	// A wedged agent: the heartbeat ages past MaxAge.
	old := time.Now().Add(-passlist.MaxAge - time.Second)
	os.Chtimes(alive, old, old)
	if passlist.Passes(dir, "plain", "app", "u1") {
		t.Fatal("passes on an old heartbeat")
	}
	future := time.Now().Add(passlist.MaxAge + time.Minute)
	os.Chtimes(alive, future, future)
	if passlist.Passes(dir, "plain", "app", "u1") {
		t.Fatal("passes on a heartbeat from the future (clock set back)")
	}
	now := time.Now()
	os.Chtimes(alive, now, now)
	if !passlist.Passes(dir, "plain", "app", "u1") {
		t.Fatal("does not pass after the heartbeat is renewed")
	}
	// A stopped agent withdraws the heartbeat.
	cancel()
	<-done
	if passlist.Passes(dir, "plain", "app", "u1") {
		t.Fatal("passes after the agent stopped")
	}
	// The next agent starts from an empty list.
	if _, err := passlist.Open(dir, v.decide, slog.Default()); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(dir, "plain.app")); !os.IsNotExist(err) {
		t.Fatalf("a previous agent's entry survived Open: %v", err)
	}
}
