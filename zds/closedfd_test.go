package zds_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"runtime/debug"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/inpod-dev/inpod/internal/testkit"
	"github.com/inpod-dev/inpod/netns"
	"github.com/inpod-dev/inpod/netns/netnstest"
	"github.com/inpod-dev/inpod/zds"
	"github.com/inpod-dev/inpod/zds/zdspb"
	ztunnel "github.com/inpod-dev/inpod/zds/zdstest"
)

// A pod unenrolled while a snapshot is being sent closes its netns file
// between two sends. That entry is left out; the connection, and with it
// readiness and every other pod, stays.
func TestSnapshotEntryClosedMidSendIsLeftOutAndConnectionSurvives(t *testing.T) {
	pods := []*netnstest.NetNS{netnstest.New(t), netnstest.New(t), netnstest.New(t)}
	src := &source{}
	src.set(podWorkload("uid-1", pods[0].Open(t)), podWorkload("uid-2", pods[1].Open(t)), podWorkload("uid-3", pods[2].Open(t)))
	var mu sync.Mutex
	var sent []zds.Workload
	src.handedOut = func(ws []zds.Workload) {
		mu.Lock()
		defer mu.Unlock()
		if sent == nil { // the first snapshot only
			sent = ws
		}
	}
	srv, path := startServer(t, src, nil)
	// The stand-in calls Reject on receiving an Add, before acking it: the
	// server is then between sending uid-1 and sending uid-2, which is
	// where an unenroll racing the snapshot closes uid-2's file.
	var once sync.Once
	z := startStandin(t, path, func(c *ztunnel.Config) {
		c.Reject = func(uid string) string {
			if uid == "uid-1" {
				once.Do(func() {
					mu.Lock()
					defer mu.Unlock()
					sent[1].NetNS.Close()
				})
			}
			return ""
		}
	})
	waitState(t, srv, zds.State{Connections: 1, Ready: true})

	ws := z.Workloads()
	if _, ok := ws["uid-2"]; ok {
		t.Error("the stand-in runs uid-2, whose file was closed before it was sent")
	}
	for _, uid := range []string{"uid-1", "uid-3"} {
		if _, ok := ws[uid]; !ok {
			t.Errorf("the stand-in lacks %s: one closed entry cost the others (runs %v)", uid, ws)
		}
	}
	// The connection that sent the snapshot is the one still serving.
	if n := z.Connects(); n != 1 {
		t.Fatalf("the stand-in connected %d times: the closed entry dropped the connection", n)
	}
	if err := srv.Add(context.Background(), podWorkload("uid-4", pods[1].Open(t))); err != nil {
		t.Fatalf("Add after the snapshot: %v", err)
	}
	if st, n := srv.State(), z.Connects(); st != (zds.State{Connections: 1, Ready: true}) || n != 1 {
		t.Fatalf("state %+v after %d connects, want one ready connection throughout", st, n)
	}
}

// An Add whose file is closed before the send fails alone: nothing was
// written, so the connection keeps its pairing and serves the next Add.
func TestAddWithClosedNetNSFailsAloneAndConnectionSurvives(t *testing.T) {
	pod := netnstest.New(t)
	nsFile := pod.Open(t)
	srv, path := startServer(t, &source{}, nil)
	z := startStandin(t, path, func(c *ztunnel.Config) {
		c.Reject = func(uid string) string {
			if uid == "uid-bad" {
				return "boom"
			}
			return ""
		}
	})
	waitState(t, srv, zds.State{Connections: 1, Ready: true})

	closed := pod.Open(t)
	closed.Close()
	err := srv.Add(context.Background(), podWorkload("uid-closed", closed))
	if !errors.Is(err, zds.ErrNetNSClosed) || !strings.Contains(err.Error(), "uid-closed") || !strings.Contains(err.Error(), closed.Name()) {
		t.Fatalf("Add with a closed netns = %v, want ErrNetNSClosed naming the pod and %s", err, closed.Name())
	}
	// Were an Add's Ack left over, these two would be answered off by one:
	// the error Ack must come back for uid-bad and success for uid-good.
	var ackErr *zds.AckError
	if err := srv.Add(context.Background(), podWorkload("uid-bad", nsFile)); !errors.As(err, &ackErr) || ackErr.UID != "uid-bad" {
		t.Fatalf("Add of uid-bad after the closed one = %v, want its own error Ack", err)
	}
	if err := srv.Add(context.Background(), podWorkload("uid-good", nsFile)); err != nil {
		t.Fatalf("Add of uid-good after the closed one: %v", err)
	}
	ws := z.Workloads()
	if _, ok := ws["uid-good"]; !ok {
		t.Errorf("stand-in runs %v, want uid-good", ws)
	}
	if _, ok := ws["uid-closed"]; ok {
		t.Error("stand-in runs uid-closed")
	}
	if n := z.Connects(); n != 1 {
		t.Fatalf("the stand-in connected %d times: a closed netns dropped the connection", n)
	}
}

// The server owns a snapshot's files: every one is closed, whether the
// snapshot completes or the peer hangs up halfway.
func TestSnapshotOfAThousandPodsLeaksNoFD(t *testing.T) {
	// A leaked *os.File is closed by its finalizer at some GC; without GC
	// a leak stays visible.
	defer debug.SetGCPercent(debug.SetGCPercent(-1))
	const pods = 1000
	pod := netnstest.New(t)
	nsFile := pod.Open(t)
	ws := make([]zds.Workload, pods)
	for i := range ws {
		ws[i] = podWorkload(fmt.Sprintf("uid-%04d", i), nsFile)
	}
	src := &source{}
	src.set(ws...)
	srv, path := startServer(t, src, nil)
	// Counting only the fds of this pod's netns leaves out whatever other
	// tests' files do meanwhile.
	id, err := netns.IdentityOf(int(nsFile.Fd()))
	if err != nil {
		t.Fatal(err)
	}

	t.Run("acknowledged", func(t *testing.T) {
		p := dialRaw(t, path)
		p.hello(zdspb.Version_V1)
		for range pods {
			p.expect(t, "add") // closes the fd it received
			p.ack("")
		}
		p.expect(t, "snapshot_sent")
		p.ack("")
		waitState(t, srv, zds.State{Connections: 1, Ready: true})
		waitFDs(t, id, 1) // the source's own
		p.uc.Close()
		waitState(t, srv, zds.State{})
	})
	t.Run("peer hangs up midway", func(t *testing.T) {
		p := dialRaw(t, path)
		p.hello(zdspb.Version_V1)
		for range 10 {
			p.expect(t, "add")
			p.ack("")
		}
		p.expect(t, "add")
		p.uc.Close()
		waitState(t, srv, zds.State{})
		waitFDs(t, id, 1)
	})
}

// waitFDs waits until exactly want of the process's fds refer to the
// namespace id.
func waitFDs(t *testing.T, id netns.Identity, want int) {
	t.Helper()
	var got int
	if err := testkit.Poll(10*time.Second, "open fds", func() (bool, error) {
		ents, err := os.ReadDir("/proc/self/fd")
		if err != nil {
			return false, err
		}
		got = 0
		for _, e := range ents {
			var st unix.Stat_t
			if unix.Stat("/proc/self/fd/"+e.Name(), &st) == nil && st.Ino == id.Ino && st.Dev == id.Dev {
				got++
			}
		}
		return got == want, nil
	}); err != nil {
		t.Fatalf("%d fds of netns %v open, want %d: %v", got, id, want, err)
	}
}
