package zds_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/inpod-dev/inpod/internal/testkit"
	"github.com/inpod-dev/inpod/netns/netnstest"
	"github.com/inpod-dev/inpod/zds"
	"github.com/inpod-dev/inpod/zds/zdspb"
	ztunnel "github.com/inpod-dev/inpod/zds/zdstest"
)

func wantAcked(t *testing.T, srv *zds.Server, uid string, want bool, when string) {
	t.Helper()
	if got := srv.Acked(uid); got != want {
		t.Fatalf("%s: Acked(%s) = %v, want %v", when, uid, got, want)
	}
}

// A snapshot's Add counts once acknowledged, before the snapshot's end is;
// its Keep never does (ztunnel got no netns with it). Each step is checked
// when the server has sent the next request, which it does only after the
// read loop has recorded the previous Ack: no polling needed.
func TestAckedAfterSnapshotAddButNotKeep(t *testing.T) {
	nsFile := netnstest.New(t).Open(t)
	src := &source{}
	src.set(podWorkload("uid-held", nsFile), zds.Workload{UID: "uid-kept"})
	srv, path := startServer(t, src, nil)

	peer := dialRaw(t, path)
	wantAcked(t, srv, "uid-held", false, "before any connection")
	peer.hello(zdspb.Version_V1)
	peer.expect(t, "add")
	wantAcked(t, srv, "uid-held", false, "snapshot Add sent, not acknowledged")
	peer.ack("")
	peer.expect(t, "keep")
	wantAcked(t, srv, "uid-held", true, "snapshot Add acknowledged, SnapshotSent not yet")
	peer.ack("")
	peer.expect(t, "snapshot_sent")
	wantAcked(t, srv, "uid-kept", false, "Keep acknowledged")
	peer.ack("")
	waitState(t, srv, zds.State{Connections: 1, Ready: true})
	wantAcked(t, srv, "uid-held", true, "snapshot acknowledged")
	wantAcked(t, srv, "uid-kept", false, "snapshot acknowledged")
	wantAcked(t, srv, "uid-never", false, "a pod never sent")
}

func TestAckedAfterAddAndNotAfterDel(t *testing.T) {
	nsFile := netnstest.New(t).Open(t)
	srv, path := startServer(t, &source{}, nil)
	z := startStandin(t, path, nil)
	waitState(t, srv, zds.State{Connections: 1, Ready: true})
	ctx := context.Background()

	wantAcked(t, srv, "uid-1", false, "before its Add")
	if err := srv.Add(ctx, podWorkload("uid-1", nsFile)); err != nil {
		t.Fatal(err)
	}
	// Recorded as the Ack is paired, before Add hears of it.
	wantAcked(t, srv, "uid-1", true, "Add returned")
	if err := srv.Del(ctx, "uid-1"); err != nil {
		t.Fatal(err)
	}
	wantAcked(t, srv, "uid-1", false, "Del returned")
	if _, ok := z.Workloads()["uid-1"]; ok {
		t.Fatal("the stand-in still runs uid-1")
	}
	if err := srv.Add(ctx, podWorkload("uid-1", nsFile)); err != nil {
		t.Fatal(err)
	}
	wantAcked(t, srv, "uid-1", true, "added again")
}

// An error Ack is no proof, and it ends what an earlier Ack of the uid
// proved: ztunnel may have dropped the old proxy for the one it failed to
// start.
func TestAckedNotForARejectedAdd(t *testing.T) {
	nsFile := netnstest.New(t).Open(t)
	srv, path := startServer(t, &source{}, nil)
	var refuseFlip atomic.Bool
	startStandin(t, path, func(c *ztunnel.Config) {
		c.Reject = func(uid string) string {
			if uid == "uid-bad" || (uid == "uid-flip" && refuseFlip.Load()) {
				return "failed to start proxy"
			}
			return ""
		}
	})
	waitState(t, srv, zds.State{Connections: 1, Ready: true})
	ctx := context.Background()

	var ackErr *zds.AckError
	if err := srv.Add(ctx, podWorkload("uid-bad", nsFile)); !errors.As(err, &ackErr) {
		t.Fatalf("Add = %v, want an AckError", err)
	}
	wantAcked(t, srv, "uid-bad", false, "Add rejected")

	if err := srv.Add(ctx, podWorkload("uid-flip", nsFile)); err != nil {
		t.Fatal(err)
	}
	wantAcked(t, srv, "uid-flip", true, "Add accepted")
	refuseFlip.Store(true)
	if err := srv.Add(ctx, podWorkload("uid-flip", nsFile)); !errors.As(err, &ackErr) {
		t.Fatalf("second Add = %v, want an AckError", err)
	}
	wantAcked(t, srv, "uid-flip", false, "a later Add of it rejected")
}

// Only the connection Add talks to counts: during a ztunnel upgrade the old
// one still runs the pod, the new one does not until it is told.
func TestAckedAsksTheNewestConnection(t *testing.T) {
	nsFile := netnstest.New(t).Open(t)
	srv, path := startServer(t, &source{}, nil)
	ctx := context.Background()
	if srv.Settled() {
		t.Fatal("settled with no connection")
	}

	old := startStandin(t, path, nil)
	waitState(t, srv, zds.State{Connections: 1, Ready: true})
	if err := srv.Add(ctx, podWorkload("uid-1", nsFile)); err != nil {
		t.Fatal(err)
	}
	wantAcked(t, srv, "uid-1", true, "added on the only connection")
	if !srv.Settled() {
		t.Fatal("the only connection acknowledged its snapshot, yet the server is not settled")
	}

	newer, stopNewer := ztunnel.Start(t, ztunnel.Config{SocketPath: path})
	testkit.Eventually(t, 10*time.Second, "the newer stand-in's snapshot", func() bool {
		return newer.SnapshotDone() && srv.State().Connections == 2
	})
	if _, ok := old.Workloads()["uid-1"]; !ok {
		t.Fatal("the old stand-in lost uid-1")
	}
	wantAcked(t, srv, "uid-1", false, "a newer connection that was never told")
	// The stand-in counts its snapshot done when it sends the ack; the
	// server settles once it has read it, a moment later.
	testkit.Eventually(t, 10*time.Second, "the server settled on the newer connection's ack", srv.Settled)

	if err := srv.Add(ctx, podWorkload("uid-1", nsFile)); err != nil {
		t.Fatal(err)
	}
	wantAcked(t, srv, "uid-1", true, "added on the newer connection")

	// The newer one goes: the old one is the newest again, and it still
	// holds what it acknowledged.
	stopNewer()
	waitState(t, srv, zds.State{Connections: 1, Ready: true})
	wantAcked(t, srv, "uid-1", true, "back to the old connection")
	if err := srv.Del(ctx, "uid-1"); err != nil {
		t.Fatal(err)
	}
	wantAcked(t, srv, "uid-1", false, "deleted")
}

// A connection that ends takes what it acknowledged with it; the next one
// holds a pod once it has acknowledged it itself.
func TestAckedNotOnANewConnectionUntilItAcksThePod(t *testing.T) {
	nsFile := netnstest.New(t).Open(t)
	src := &source{}
	srv, path := startServer(t, src, nil)
	ctx := context.Background()

	first := dialRaw(t, path)
	first.hello(zdspb.Version_V1)
	first.expect(t, "snapshot_sent")
	first.ack("")
	waitState(t, srv, zds.State{Connections: 1, Ready: true})
	addErr := make(chan error, 1)
	go func() { addErr <- srv.Add(ctx, podWorkload("uid-1", nsFile)) }()
	first.expect(t, "add")
	first.ack("")
	if err := <-addErr; err != nil {
		t.Fatal(err)
	}
	wantAcked(t, srv, "uid-1", true, "added")

	first.uc.Close()
	testkit.Eventually(t, 10*time.Second, "the ended connection to hold nothing", func() bool { return !srv.Acked("uid-1") })
	waitState(t, srv, zds.State{})

	src.set(podWorkload("uid-1", nsFile))
	second := dialRaw(t, path)
	second.hello(zdspb.Version_V1)
	second.expect(t, "add")
	wantAcked(t, srv, "uid-1", false, "the new connection's snapshot Add not acknowledged")
	second.ack("")
	second.expect(t, "snapshot_sent")
	wantAcked(t, srv, "uid-1", true, "the new connection acknowledged it")
	second.ack("")
	waitState(t, srv, zds.State{Connections: 1, Ready: true})
}

// A Del ends Acked when it is called, sent or not: one whose context ends
// while an Add of the same pod is on the wire voids that Add's coming Ack,
// and one never sent at all still counts.
func TestAckedEndsWithADelThatWasNeverSent(t *testing.T) {
	nsFile := netnstest.New(t).Open(t)
	srv, path := startServer(t, &source{}, nil)
	peer := dialRaw(t, path)
	peer.hello(zdspb.Version_V1)
	peer.expect(t, "snapshot_sent")
	peer.ack("")
	waitState(t, srv, zds.State{Connections: 1, Ready: true})

	gone, cancel := context.WithCancel(context.Background())
	cancel()
	addErr := make(chan error, 1)
	go func() { addErr <- srv.Add(context.Background(), podWorkload("uid-1", nsFile)) }()
	peer.expect(t, "add")
	// The Del can only wait for the turn the Add holds, and gives up.
	if err := srv.Del(gone, "uid-1"); !errors.Is(err, context.Canceled) {
		t.Fatalf("Del = %v, want its context's end", err)
	}
	peer.ack("")
	if err := <-addErr; err != nil {
		t.Fatal(err)
	}
	wantAcked(t, srv, "uid-1", false, "a Del was asked for while its Add was on the wire")

	go func() { addErr <- srv.Add(context.Background(), podWorkload("uid-2", nsFile)) }()
	peer.expect(t, "add")
	peer.ack("")
	if err := <-addErr; err != nil {
		t.Fatal(err)
	}
	wantAcked(t, srv, "uid-2", true, "added")
	if err := srv.Del(gone, "uid-2"); !errors.Is(err, context.Canceled) {
		t.Fatalf("Del = %v, want its context's end", err)
	}
	wantAcked(t, srv, "uid-2", false, "a Del that never went out")
	// Nothing went out for either Del: the next request is the peer's to see.
	go func() { addErr <- srv.Add(context.Background(), podWorkload("uid-3", nsFile)) }()
	peer.expect(t, "add")
	peer.ack("")
	if err := <-addErr; err != nil {
		t.Fatal(err)
	}
	wantAcked(t, srv, "uid-3", true, "added after the abandoned Dels")
}

// Acked is read by a verifier while Adds and Dels run; under -race this
// proves the state has one owner.
func TestAckedAlongsideAddsAndDels(t *testing.T) {
	nsFile := netnstest.New(t).Open(t)
	srv, path := startServer(t, &source{}, nil)
	startStandin(t, path, nil)
	waitState(t, srv, zds.State{Connections: 1, Ready: true})
	ctx := context.Background()
	uids := []string{"uid-a", "uid-b", "uid-c", "uid-d"}

	stop := make(chan struct{})
	var readers sync.WaitGroup
	for range 2 {
		readers.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				for _, uid := range uids {
					srv.Acked(uid)
				}
			}
		})
	}
	var writers sync.WaitGroup
	for _, uid := range uids {
		writers.Go(func() {
			for range 20 {
				if err := srv.Add(ctx, podWorkload(uid, nsFile)); err != nil {
					t.Errorf("Add %s: %v", uid, err)
					return
				}
				if !srv.Acked(uid) {
					t.Errorf("Acked(%s) false after its Add (no Del of it runs meanwhile)", uid)
				}
				if err := srv.Del(ctx, uid); err != nil {
					t.Errorf("Del %s: %v", uid, err)
					return
				}
				if srv.Acked(uid) {
					t.Errorf("Acked(%s) true after its Del", uid)
				}
			}
		})
	}
	writers.Wait()
	close(stop)
	readers.Wait()
}
