package zds_test

import (
	"context"
	"net"
	"testing"

	"github.com/inpod-dev/inpod/internal/testkit"
	"github.com/inpod-dev/inpod/netns/netnstest"
	"github.com/inpod-dev/inpod/zds"
)

// Hold closes ztunnel's connection and keeps its reconnection waiting; a
// second server adopting the socket after Retire is what ztunnel reconnects
// to, and its snapshot is what ztunnel holds. The retired server keeps no
// connection.
func TestHoldThenRetireHandsZtunnelToTheAdopter(t *testing.T) {
	nsFile := netnstest.New(t).Open(t)
	old, path := startServer(t, &source{}, nil)
	z := startStandin(t, path, nil)
	waitState(t, old, zds.State{Connections: 1, Ready: true})
	connects := z.Connects()

	f, err := old.Hold(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	waitState(t, old, zds.State{})
	old.Retire()

	l, err := net.FileListener(f)
	if err != nil {
		t.Fatal(err)
	}
	successor, err := zds.NewServer(zds.Config{SocketPath: path, Logger: testLogger(t),
		Source: &source{workloads: []zds.Workload{podWorkload("uid-1", nsFile)}}})
	if err != nil {
		t.Fatal(err)
	}
	if err := successor.Adopt(l.(*net.UnixListener)); err != nil {
		t.Fatal(err)
	}
	testkit.Serve(t, successor)
	waitState(t, successor, zds.State{Connections: 1, Ready: true})
	if _, ok := z.Workloads()["uid-1"]; !ok {
		t.Fatal("ztunnel reconnected without the successor's snapshot")
	}
	if got := z.Connects(); got <= connects {
		t.Fatalf("ztunnel connected %d times, want more than %d", got, connects)
	}
	if st := old.State(); st.Connections != 0 {
		t.Fatalf("the retired server holds %d connections", st.Connections)
	}
}

// A Release after Hold serves ztunnel again from the same server.
func TestHoldThenReleaseReconnectsZtunnelHere(t *testing.T) {
	srv, path := startServer(t, &source{}, nil)
	z := startStandin(t, path, nil)
	waitState(t, srv, zds.State{Connections: 1, Ready: true})
	connects := z.Connects()
	f, err := srv.Hold(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	f.Close()
	waitState(t, srv, zds.State{})
	srv.Release()
	waitState(t, srv, zds.State{Connections: 1, Ready: true})
	if got := z.Connects(); got <= connects {
		t.Fatalf("ztunnel connected %d times, want more than %d", got, connects)
	}
}
