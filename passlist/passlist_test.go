package passlist_test

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/inpod-dev/inpod/internal/testkit"
	"github.com/inpod-dev/inpod/passlist"
)

// agentEnv makes the test binary play an agent process that keeps a pass
// list in the directory it names, listing the pods given as
// "namespace/name=uid" arguments, until it is killed.
const agentEnv = "INPOD_PASSLIST_TEST_AGENT"

func TestMain(m *testing.M) {
	if dir := os.Getenv(agentEnv); dir != "" {
		runAgent(dir, os.Args[len(os.Args)-1])
		return
	}
	os.Exit(m.Run())
}

func runAgent(dir, pods string) {
	v := &view{pods: map[string]pod{}}
	for p := range strings.SplitSeq(pods, ",") {
		key, uid, _ := strings.Cut(p, "=")
		v.set(key, uid, true)
	}
	l, err := passlist.Open(dir, v.decide, slog.Default())
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	for key := range v.pods {
		ns, name, _ := strings.Cut(key, "/")
		if err := l.Refresh(ns, name); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
	}
	if err := l.Run(context.Background()); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}

// startAgentProcess runs the test binary as an agent listing pods (see
// agentEnv) and waits until the list it keeps is live.
func startAgentProcess(t *testing.T, dir, pods string, live func() bool) *exec.Cmd {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$", pods)
	cmd.Env = append(os.Environ(), agentEnv+"="+dir)
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	testkit.Eventually(t, 10*time.Second, "the agent process's list to be live", live)
	return cmd
}

type pod struct {
	uid         string
	notEnrolled bool
}

type view struct {
	mu   sync.Mutex
	pods map[string]pod
}

func newView() *view { return &view{pods: map[string]pod{}} }

func (v *view) set(key, uid string, notEnrolled bool) {
	v.mu.Lock()
	defer v.mu.Unlock()
	v.pods[key] = pod{uid, notEnrolled}
}

func (v *view) decide(namespace, name string) (string, bool, bool) {
	v.mu.Lock()
	defer v.mu.Unlock()
	p, ok := v.pods[namespace+"/"+name]
	return p.uid, p.notEnrolled, ok
}

// open starts a list with its heartbeat and waits until it is current;
// stop ends it.
func open(t *testing.T, dir string, v *view) (l *passlist.List, stop func()) {
	t.Helper()
	l, err := passlist.Open(dir, v.decide, slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { l.Run(ctx); close(done) }()
	stop = sync.OnceFunc(func() { cancel(); <-done })
	t.Cleanup(stop)
	testkit.Eventually(t, 5*time.Second, "the list to become current", func() bool {
		gen, err := os.Readlink(filepath.Join(dir, "current"))
		return err == nil && strings.Contains(l.String(), gen)
	})
	return l, stop
}

func TestListFollowsTheAgentsView(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "pass")
	v := newView()
	l, _ := open(t, dir, v)
	if fi, err := os.Stat(dir); err != nil || fi.Mode().Perm() != 0o700 {
		t.Fatalf("list dir: %v %v", fi.Mode(), err)
	}

	v.set("plain/app", "u1", true)
	l.Refresh("plain", "app")
	if !passlist.Passes(dir, "plain", "app", "u1") {
		t.Fatal("a pod known not enrolled does not pass")
	}
	if passlist.Passes(dir, "plain", "app", "u2") {
		t.Fatal("another pod of the same name passes")
	}
	// Without a UID the sandbox may be another pod's of that name, one
	// that replaced it and is enrolled while the agent's watch lags.
	if passlist.Passes(dir, "plain", "app", "") {
		t.Fatal("a sandbox whose runtime named no UID passes")
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
	v := newView()
	v.set("plain/app", "u1", true)
	l, err := passlist.Open(dir, v.decide, slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	l.Refresh("plain", "app")
	if passlist.Passes(dir, "plain", "app", "u1") {
		t.Fatal("passes before Run (the agent's watches have not synced)")
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { l.Run(ctx); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	testkit.Eventually(t, 5*time.Second, "the list to pass a listed pod", func() bool { return passlist.Passes(dir, "plain", "app", "u1") })

	// A stopped or wedged agent keeps its lock: the heartbeat ages.
	lock := filepath.Join(dir, "current", ".lock")
	old := time.Now().Add(-passlist.MaxAge - time.Second)
	os.Chtimes(lock, old, old)
	if passlist.Passes(dir, "plain", "app", "u1") {
		t.Fatal("passes on an old heartbeat")
	}
	// A heartbeat from the future (the clock was set back) proves
	// nothing, however little ahead it is.
	future := time.Now().Add(time.Second)
	os.Chtimes(lock, future, future)
	if passlist.Passes(dir, "plain", "app", "u1") {
		t.Fatal("passes on a heartbeat from the future")
	}
	now := time.Now()
	os.Chtimes(lock, now, now)
	if !passlist.Passes(dir, "plain", "app", "u1") {
		t.Fatal("does not pass after the heartbeat is renewed")
	}
	// A stopped agent withdraws its list.
	cancel()
	<-done
	if passlist.Passes(dir, "plain", "app", "u1") {
		t.Fatal("passes after the agent stopped")
	}
	if err := l.Refresh("plain", "app"); err != nil {
		t.Fatalf("Refresh after the list stopped: %v", err)
	}
	if ents, _ := filepath.Glob(filepath.Join(dir, "gen-*")); len(ents) != 0 {
		t.Fatalf("a stopped agent left its list behind: %v", ents)
	}
}

// The agent killed outright (SIGKILL, an OOM kill) runs no cleanup: its
// list must be distrusted from the moment it is dead, not once a heartbeat
// has aged, since a namespace labelled meanwhile would let a listed pod
// start unredirected.
func TestKilledAgentsListIsDistrustedAtOnce(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "pass")
	agent := startAgentProcess(t, dir, "plain/app=u1", func() bool { return passlist.Passes(dir, "plain", "app", "u1") })
	if err := agent.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	agent.Wait()
	if passlist.Passes(dir, "plain", "app", "u1") {
		t.Fatal("a killed agent's pass list is still trusted")
	}
}

// During a rolling update two agents run on a node; after a crash the next
// agent starts beside the dead one's leftovers. The plugin only ever trusts
// the entries of the agent that made its list current, while it lives.
func TestAnotherAgentsEntriesAreNeverTrusted(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "pass")
	old := startAgentProcess(t, dir, "plain/old=u1", func() bool { return passlist.Passes(dir, "plain", "old", "u1") })

	// A new agent starts while the old one still runs: it neither removes
	// the old one's list nor takes over its entries while rebuilding.
	v := newView()
	v.set("plain/new", "u2", true)
	l, err := passlist.Open(dir, v.decide, slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	l.Refresh("plain", "new")
	if !passlist.Passes(dir, "plain", "old", "u1") || passlist.Passes(dir, "plain", "new", "u2") {
		t.Fatal("the new agent's list is read before its watches have synced")
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { l.Run(ctx); close(done) }()
	defer func() { cancel(); <-done }()
	testkit.Eventually(t, 5*time.Second, "the new agent's list to be current", func() bool { return passlist.Passes(dir, "plain", "new", "u2") })
	if passlist.Passes(dir, "plain", "old", "u1") {
		t.Fatal("the old agent's entry passes once the new agent's list is current")
	}
	gens, _ := filepath.Glob(filepath.Join(dir, "gen-*"))
	if len(gens) != 2 {
		t.Fatalf("want both agents' lists while both live, have %v", gens)
	}

	// The old agent is killed; its leftovers go at the next agent's start.
	old.Process.Kill()
	old.Wait()
	next, err := passlist.Open(dir, newView().decide, slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	nctx, ncancel := context.WithCancel(context.Background())
	ncancel()
	next.Run(nctx) // stops at once, removing its own generation
	if gens, _ := filepath.Glob(filepath.Join(dir, "gen-*")); len(gens) != 1 || !strings.Contains(l.String(), filepath.Base(gens[0])) {
		t.Fatalf("after the old agent died and another started, want only the live agent's list, have %v", gens)
	}
	if passlist.Passes(dir, "plain", "new", "u2") {
		t.Fatal("the list of an agent that has stopped (the last to make its list current) passes")
	}
}
