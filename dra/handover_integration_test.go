//go:build integration

package dra

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/inpod-dev/inpod/internal/testkit"
	"github.com/inpod-dev/inpod/readiness"
)

// A rollout's hand-over between two agents' gates (RollingUpdate): the
// successor registers beside the running plugin only once the node is
// ready under it; the retired gate no longer follows readiness (it answers
// as it last did) and no longer writes the slice, so it cannot undo the
// successor's taint; it deregisters once the kubelet uses the successor's
// plugin, not merely once its socket serves, and leaves the slice; a claim
// prepared through one plugin is unprepared through the other (the record
// is read from the shared file each call).
func TestIntegrationDRAHandOver(t *testing.T) {
	defer func(g time.Duration) { siblingGrace = g }(siblingGrace)
	siblingGrace = time.Hour // only the kubelet's use of the successor ends the linger
	w := newWorld(t)
	setReady(w.ready)
	oldSaw := &counter{}
	old := w.driver(Config{RollingUpdateUID: "0ld-agent-pod", StartupGrace: -1, Observer: oldSaw})
	_, oldReturned := w.run(old, w.ready)
	w.waitSlice()
	testkit.Eventually(t, 10*time.Second, "the running plugin's sockets", func() bool {
		_, reg := os.Stat(old.RegistrationSocket())
		_, plugin := os.Stat(old.PluginSocket())
		return reg == nil && plugin == nil
	})
	claim := w.claim("a")
	testkit.Eventually(t, 5*time.Second, "the running gate ready", func() bool { old.mu.Lock(); defer old.mu.Unlock(); return old.ready })
	if r := prepare(t, dial(t, old), claim)[string(claim.UID)]; r == nil || r.Error != "" {
		t.Fatalf("prepare through the running plugin: %+v", r)
	}

	successorReady := notReady()
	successor := w.driver(Config{RollingUpdateUID: "new-agent-pod", StartupGrace: -1})
	successor.TakeOver(time.Minute)
	_, _ = w.run(successor, successorReady)
	old.Retire(time.Minute)
	// The retired gate follows its agent's readiness no more: its plugin
	// still prepares after the readiness it was started on turns False.
	w.ready.Set(readiness.ZtunnelConnected, false, "the hand-over closed ztunnel's connections")
	b := w.claim("b")
	if r := prepare(t, dial(t, old), b)[string(b.UID)]; r == nil || r.Error != "" {
		t.Fatalf("prepare through the retired plugin, the successor not registered yet: %+v, want prepared as before", r)
	}
	if _, err := os.Stat(successor.RegistrationSocket()); err == nil {
		t.Fatal("the successor registered before the node is ready under it: the kubelet would ask it, and it would refuse")
	}

	setReady(successorReady)
	testkit.Eventually(t, 10*time.Second, "the successor's registration socket", func() bool { _, err := os.Stat(successor.RegistrationSocket()); return err == nil })
	if _, err := os.Stat(old.RegistrationSocket()); err != nil {
		t.Fatalf("the retired plugin left before the kubelet used the successor's: %v", err)
	}
	// The kubelet, having registered the successor's plugin, asks it.
	c := w.claim("c")
	if r := prepare(t, dial(t, successor), c)[string(c.UID)]; r == nil || r.Error != "" {
		t.Fatalf("prepare through the successor: %+v", r)
	}
	select {
	case <-oldReturned:
	case <-time.After(30 * time.Second):
		t.Fatal("the retired gate still serves 30 s after the kubelet used the successor's plugin")
	}
	for _, sock := range []string{old.RegistrationSocket(), old.PluginSocket()} {
		if _, err := os.Stat(sock); err == nil {
			t.Errorf("the retired plugin left %s", sock)
		}
	}
	if regs, _ := filepath.Glob(filepath.Join(w.regDir, "*")); len(regs) != 1 || regs[0] != successor.RegistrationSocket() {
		t.Fatalf("registration sockets %v, want the successor's alone", regs)
	}
	w.waitSlice() // left in place, untainted
	oldSaw.mu.Lock()
	tainted := oldSaw.tainted
	oldSaw.mu.Unlock()
	if tainted != 0 {
		t.Fatalf("the slice was tainted %d times while the retired gate ran: it followed its agent's readiness", tainted)
	}

	// The successor owns the slice: its taint stands.
	successorReady.Set(readiness.ZtunnelConnected, false, "ztunnel left")
	w.waitSlice(TaintKeyPrefix + "ztunnel-not-connected")
	setReady(successorReady)
	w.waitSlice()

	// The claim the retired plugin prepared is unprepared through the
	// successor's: the shared record forgets it.
	unprepare(t, dial(t, successor), claim)
	if got := successor.Prepared(); slices.ContainsFunc(got, func(c string) bool { return strings.HasSuffix(c, "/a") }) {
		t.Fatalf("recorded after unprepare through the successor: %v", got)
	}
	if b, err := os.ReadFile(successor.checkpointPath()); err != nil || strings.Contains(string(b), string(claim.UID)) {
		t.Fatalf("the shared record after unprepare: %s %v", b, err)
	}
}

// A plugin socket that nobody serves (an agent killed without its clean
// stop) is removed when the next gate starts; a served one stays.
func TestIntegrationDRARemovesStaleSockets(t *testing.T) {
	w := newWorld(t)
	if err := os.MkdirAll(w.regDir, 0o750); err != nil {
		t.Fatal(err)
	}
	running := w.driver(Config{RollingUpdateUID: "running-pod", StartupGrace: -1})
	w.run(running, w.ready)
	testkit.Eventually(t, 10*time.Second, "the running plugin's socket", func() bool { _, err := os.Stat(running.RegistrationSocket()); return err == nil })
	stale := filepath.Join(w.regDir, DefaultDriverName+"-killed-pod-reg.sock")
	testkit.StaleUnixSocket(t, "unix", stale)

	next := w.driver(Config{RollingUpdateUID: "next-pod", StartupGrace: -1})
	w.run(next, w.ready)
	testkit.Eventually(t, 10*time.Second, "the stale socket removed", func() bool { _, err := os.Stat(stale); return err != nil })
	if _, err := os.Stat(running.RegistrationSocket()); err != nil {
		t.Fatalf("a served socket was removed: %v", err)
	}
}

// A gate handed over before it ever registered (another agent took the
// node over while this one waited to be ready) never registers.
func TestIntegrationDRARetiredBeforeRegisteringNeverRegisters(t *testing.T) {
	w := newWorld(t)
	d := w.driver(Config{RollingUpdateUID: "short-lived-pod", StartupGrace: -1})
	d.TakeOver(time.Minute)
	_, returned := w.run(d, w.ready) // never ready
	d.Retire(time.Minute)
	select {
	case <-returned:
	case <-time.After(30 * time.Second):
		t.Fatal("a gate retired while waiting to register still runs")
	}
	if _, err := os.Stat(d.RegistrationSocket()); err == nil {
		t.Fatal("a gate retired before registering registered")
	}
}
