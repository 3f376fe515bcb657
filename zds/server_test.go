package zds_test

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/inpod-dev/inpod/internal/testkit"
	"github.com/inpod-dev/inpod/netns"
	"github.com/inpod-dev/inpod/netns/netnstest"
	"github.com/inpod-dev/inpod/zds"
	"github.com/inpod-dev/inpod/zds/zdspb"
	ztunnel "github.com/inpod-dev/inpod/zds/zdstest"
)

// Re-executed as a separate ztunnel process for the tests that kill it.
const standinSocketEnv = "INPOD_TEST_STANDIN_SOCKET"

func TestMain(m *testing.M) {
	if path := os.Getenv(standinSocketEnv); path != "" {
		// Acks of Adds never come; the parent kills this process.
		z := ztunnel.New(ztunnel.Config{SocketPath: path, AckDelay: time.Hour})
		z.Run(context.Background())
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// source is a PodSource the test edits. Like the agent's table, it keeps its
// own files and hands the server duplicates, which the server closes.
type source struct {
	mu        sync.Mutex
	workloads []zds.Workload
	// handedOut, when set, sees each snapshot as it goes to the server.
	handedOut func([]zds.Workload)
}

func (s *source) Snapshot(context.Context) ([]zds.Workload, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]zds.Workload, 0, len(s.workloads))
	for _, w := range s.workloads {
		d, err := w.Dup()
		if err != nil {
			for _, o := range out {
				o.NetNS.Close()
			}
			return nil, err
		}
		out = append(out, d)
	}
	if s.handedOut != nil {
		s.handedOut(out)
	}
	return out, nil
}

func (s *source) set(ws ...zds.Workload) {
	s.mu.Lock()
	s.workloads = ws
	s.mu.Unlock()
}

func testLogger(t testing.TB) *slog.Logger {
	return slog.New(slog.NewTextHandler(tlogWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

type tlogWriter struct{ t testing.TB }

func (w tlogWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimSpace(string(p)))
	return len(p), nil
}

// startServer serves ZDS on a socket in a temp dir until the test ends.
func startServer(t *testing.T, src zds.PodSource, mod func(*zds.Config)) (*zds.Server, string) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "zt", "ztunnel.sock")
	cfg := zds.Config{SocketPath: path, Source: src, Logger: testLogger(t)}
	if mod != nil {
		mod(&cfg)
	}
	srv, err := zds.NewServer(cfg)
	if err != nil {
		t.Fatal(err)
	}
	testkit.Serve(t, srv)
	return srv, path
}

// startStandin runs a ztunnel stand-in until the test ends.
func startStandin(t *testing.T, path string, mod func(*ztunnel.Config)) *ztunnel.Standin {
	t.Helper()
	cfg := ztunnel.Config{SocketPath: path, Logger: testLogger(t), MinBackoff: 10 * time.Millisecond, MaxBackoff: 50 * time.Millisecond}
	if mod != nil {
		mod(&cfg)
	}
	z, _ := ztunnel.Start(t, cfg)
	return z
}

func waitState(t *testing.T, srv *zds.Server, want zds.State) {
	t.Helper()
	testkit.Eventually(t, 10*time.Second, fmt.Sprintf("server state %+v", want), func() bool { return srv.State() == want })
}

func podWorkload(uid string, ns *os.File) zds.Workload {
	return zds.Workload{UID: uid, Name: "pod-" + uid, Namespace: "default", ServiceAccount: "default", NetNS: ns}
}

// dialInNetNS connects to 127.0.0.1:port from inside the namespace and reads
// the stand-in's reply line.
func dialInNetNS(ns *os.File, port int) (string, error) {
	var reply string
	err := netns.Do(ns, func() error {
		c, err := net.DialTimeout("tcp4", fmt.Sprintf("127.0.0.1:%d", port), 2*time.Second)
		if err != nil {
			return err
		}
		defer c.Close()
		c.SetReadDeadline(time.Now().Add(2 * time.Second))
		b, err := io.ReadAll(c)
		reply = string(b)
		return err
	})
	return reply, err
}

func TestSnapshotSendsAddWithNetNSAndKeep(t *testing.T) {
	pod := netnstest.New(t)
	nsFile := pod.Open(t)
	src := &source{}
	src.set(podWorkload("uid-held", nsFile), zds.Workload{UID: "uid-kept"})
	srv, path := startServer(t, src, nil)

	z := startStandin(t, path, nil)
	waitState(t, srv, zds.State{Connections: 1, Ready: true})
	if !z.SnapshotDone() {
		t.Fatal("server ready before the stand-in saw SnapshotSent")
	}

	ws := z.Workloads()
	got, ok := ws["uid-held"]
	if !ok {
		t.Fatalf("stand-in runs %v, want uid-held", ws)
	}
	wantID, err := netns.IdentityOf(int(nsFile.Fd()))
	if err != nil {
		t.Fatal(err)
	}
	if got.NetNS != wantID || got.Name != "pod-uid-held" || got.Namespace != "default" || got.ServiceAccount != "default" {
		t.Errorf("workload = %+v, want netns %v and the pod's names", got, wantID)
	}
	if _, ok := ws["uid-kept"]; ok {
		t.Error("Keep made the stand-in start a workload it never had")
	}
	// The Ack meant the listeners exist inside the pod.
	reply, err := dialInNetNS(nsFile, ztunnel.PortInbound)
	if err != nil || !strings.Contains(reply, "port=15006") {
		t.Fatalf("connect to 15006 in the pod netns: reply %q, err %v", reply, err)
	}
}

func TestIncrementalAddAndDel(t *testing.T) {
	pod := netnstest.New(t)
	nsFile := pod.Open(t)
	srv, path := startServer(t, &source{}, nil)
	z := startStandin(t, path, nil)
	waitState(t, srv, zds.State{Connections: 1, Ready: true})

	ctx := context.Background()
	if err := srv.Add(ctx, podWorkload("uid-1", nsFile)); err != nil {
		t.Fatalf("Add: %v", err)
	}
	if _, ok := z.Workloads()["uid-1"]; !ok {
		t.Fatal("Add returned before the stand-in ran the workload")
	}
	for _, port := range []int{ztunnel.PortOutbound, ztunnel.PortInbound, ztunnel.PortHBONE} {
		if _, err := dialInNetNS(nsFile, port); err != nil {
			t.Errorf("after Add, port %d in the pod netns: %v", port, err)
		}
	}
	// Repeating an Add with the same netns is idempotent on ztunnel's side.
	if err := srv.Add(ctx, podWorkload("uid-1", nsFile)); err != nil {
		t.Fatalf("repeated Add: %v", err)
	}

	if err := srv.Del(ctx, "uid-1"); err != nil {
		t.Fatalf("Del: %v", err)
	}
	if _, ok := z.Workloads()["uid-1"]; ok {
		t.Fatal("Del returned before the stand-in dropped the workload")
	}
	if _, err := dialInNetNS(nsFile, ztunnel.PortInbound); !errors.Is(err, syscall.ECONNREFUSED) {
		t.Fatalf("after Del, connect to 15006 = %v, want ECONNREFUSED", err)
	}
}

func TestAddWithoutConnectionFails(t *testing.T) {
	pod := netnstest.New(t)
	srv, _ := startServer(t, &source{}, nil)
	err := srv.Add(context.Background(), podWorkload("uid-1", pod.Open(t)))
	if !errors.Is(err, zds.ErrNoConnection) {
		t.Fatalf("Add with no ztunnel = %v, want ErrNoConnection", err)
	}
	if err := srv.Del(context.Background(), "uid-1"); err != nil {
		t.Fatalf("Del with no ztunnel = %v, want nil", err)
	}
}

func TestAckErrorIsReturnedAndConnectionSurvives(t *testing.T) {
	pod := netnstest.New(t)
	nsFile := pod.Open(t)
	srv, path := startServer(t, &source{}, nil)
	startStandin(t, path, func(c *ztunnel.Config) {
		c.Reject = func(uid string) string {
			if uid == "uid-bad" {
				return "failed to start proxy: boom"
			}
			return ""
		}
	})
	waitState(t, srv, zds.State{Connections: 1, Ready: true})

	err := srv.Add(context.Background(), podWorkload("uid-bad", nsFile))
	var ackErr *zds.AckError
	if !errors.As(err, &ackErr) || ackErr.UID != "uid-bad" || !strings.Contains(ackErr.Msg, "boom") {
		t.Fatalf("Add = %v, want an AckError carrying ztunnel's message", err)
	}
	if err := srv.Add(context.Background(), podWorkload("uid-good", nsFile)); err != nil {
		t.Fatalf("Add after an error ack: %v", err)
	}
	if st := srv.State(); st.Connections != 1 {
		t.Fatalf("state %+v: an error Ack must not drop the connection", st)
	}
}

func TestAddWithoutNetNSOrTooLongNamesFailsWithoutSending(t *testing.T) {
	pod := netnstest.New(t)
	nsFile := pod.Open(t)
	srv, path := startServer(t, &source{}, nil)
	z := startStandin(t, path, nil)
	waitState(t, srv, zds.State{Connections: 1, Ready: true})

	if err := srv.Add(context.Background(), zds.Workload{UID: "uid-1"}); err == nil {
		t.Error("Add without a netns succeeded")
	}
	long := podWorkload("uid-2", nsFile)
	long.Name = strings.Repeat("n", 254)
	err := srv.Add(context.Background(), long)
	if !errors.Is(err, zds.ErrMessageTooLarge) || !strings.Contains(err.Error(), "name is 254 bytes") {
		t.Fatalf("Add with a 254-byte name = %v, want ErrMessageTooLarge naming the field", err)
	}
	// The longest names Kubernetes allows still fit in one datagram.
	max := podWorkload(strings.Repeat("u", 128), nsFile)
	max.Name, max.Namespace, max.ServiceAccount = strings.Repeat("n", 253), strings.Repeat("s", 63), strings.Repeat("a", 253)
	if err := srv.Add(context.Background(), max); err != nil {
		t.Fatalf("Add with maximal names: %v", err)
	}
	if z.Connects() != 1 {
		t.Fatalf("stand-in reconnected %d times: a rejected Add disturbed the connection", z.Connects()-1)
	}
}

func TestAckTimeoutClosesConnectionAndReconnectGetsFreshSnapshot(t *testing.T) {
	pod := netnstest.New(t)
	nsFile := pod.Open(t)
	src := &source{}
	srv, path := startServer(t, src, func(c *zds.Config) { c.AckTimeout = 200 * time.Millisecond })

	peer := dialRaw(t, path)
	peer.hello(zdspb.Version_V1)
	peer.expect(t, "snapshot_sent")
	peer.ack("")
	waitState(t, srv, zds.State{Connections: 1, Ready: true})

	addErr := make(chan error, 1)
	go func() { addErr <- srv.Add(context.Background(), podWorkload("uid-1", nsFile)) }()
	peer.expect(t, "add")
	// Never ack: the server must give up and close, not keep the
	// connection where a late ack would be credited to the next request.
	select {
	case err := <-addErr:
		if !errors.Is(err, zds.ErrAckTimeout) {
			t.Fatalf("Add = %v, want ErrAckTimeout", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Add did not time out")
	}
	peer.expectClosed(t)
	waitState(t, srv, zds.State{})

	// A new connection starts over with a full snapshot.
	src.set(podWorkload("uid-1", nsFile))
	z := startStandin(t, path, nil)
	waitState(t, srv, zds.State{Connections: 1, Ready: true})
	if _, ok := z.Workloads()["uid-1"]; !ok {
		t.Fatal("reconnected ztunnel did not get uid-1 in its snapshot")
	}
}

func TestAddGoesToNewestConnectionDelToAll(t *testing.T) {
	podA, podB := netnstest.New(t), netnstest.New(t)
	nsA, nsB := podA.Open(t), podB.Open(t)
	src := &source{}
	src.set(podWorkload("uid-a", nsA))
	srv, path := startServer(t, src, nil)

	old := startStandin(t, path, nil)
	waitState(t, srv, zds.State{Connections: 1, Ready: true})
	newer := startStandin(t, path, nil)
	testkit.Eventually(t, 10*time.Second, "second stand-in snapshot", func() bool { return newer.SnapshotDone() && srv.State().Connections == 2 })

	if err := srv.Add(context.Background(), podWorkload("uid-b", nsB)); err != nil {
		t.Fatal(err)
	}
	if _, ok := newer.Workloads()["uid-b"]; !ok {
		t.Error("Add did not reach the newest connection")
	}
	if _, ok := old.Workloads()["uid-b"]; ok {
		t.Error("Add reached the older connection too")
	}
	for name, z := range map[string]*ztunnel.Standin{"old": old, "newer": newer} {
		if _, ok := z.Workloads()["uid-a"]; !ok {
			t.Fatalf("%s stand-in lacks uid-a from its snapshot", name)
		}
	}
	if err := srv.Del(context.Background(), "uid-a"); err != nil {
		t.Fatal(err)
	}
	for name, z := range map[string]*ztunnel.Standin{"old": old, "newer": newer} {
		if _, ok := z.Workloads()["uid-a"]; ok {
			t.Errorf("Del did not reach the %s connection", name)
		}
	}
}

func TestPeerKilledMidRequest(t *testing.T) {
	pod := netnstest.New(t)
	nsFile := pod.Open(t)
	srv, path := startServer(t, &source{}, func(c *zds.Config) { c.AckTimeout = time.Minute })

	// A real separate process whose acks never come, killed mid-request.
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), standinSocketEnv+"="+path)
	logs, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	waitState(t, srv, zds.State{Connections: 1, Ready: true})

	addErr := make(chan error, 1)
	go func() { addErr <- srv.Add(context.Background(), podWorkload("uid-1", nsFile)) }()
	// Kill it once it has the Add, while the server waits for the Ack.
	lines := bufio.NewScanner(logs)
	for lines.Scan() && !strings.Contains(lines.Text(), "add received") {
	}
	cmd.Process.Signal(syscall.SIGKILL)
	select {
	case err := <-addErr:
		if !errors.Is(err, zds.ErrConnectionClosed) {
			t.Fatalf("Add = %v, want ErrConnectionClosed", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Add still waiting after its peer was killed")
	}
	waitState(t, srv, zds.State{})
}

func TestBadPeersAreDroppedAndServerKeepsServing(t *testing.T) {
	srv, path := startServer(t, &source{}, func(c *zds.Config) { c.HelloTimeout = 300 * time.Millisecond })
	helloV1, _ := proto.Marshal(&zdspb.ZdsHello{Version: zdspb.Version_V1})
	cases := map[string]func(p *rawPeer){
		"garbage hello":   func(p *rawPeer) { p.send([]byte{0xff, 0xff, 0xff}) },
		"unknown version": func(p *rawPeer) { p.hello(zdspb.Version(7)) },
		"oversized":       func(p *rawPeer) { p.send(append(helloV1, make([]byte, 2000)...)) },
		"silent":          func(p *rawPeer) {},
		"garbage after snapshot": func(p *rawPeer) {
			p.hello(zdspb.Version_V1)
			p.expect(p.t, "snapshot_sent")
			p.send([]byte{0x0a, 0x05, 0x01})
		},
		"unsolicited ack": func(p *rawPeer) {
			p.hello(zdspb.Version_V1)
			p.expect(p.t, "snapshot_sent")
			p.ack("")
			p.ack("")
		},
		"fd in a response": func(p *rawPeer) {
			p.hello(zdspb.Version_V1)
			p.expect(p.t, "snapshot_sent")
			f, _ := os.Open("/dev/null")
			defer f.Close()
			resp, _ := proto.Marshal(&zdspb.WorkloadResponse{Payload: &zdspb.WorkloadResponse_Ack{Ack: &zdspb.Ack{}}})
			p.uc.WriteMsgUnix(resp, syscallRights(int(f.Fd())), nil)
		},
	}
	for name, misbehave := range cases {
		t.Run(name, func(t *testing.T) {
			p := dialRaw(t, path)
			misbehave(p)
			p.expectClosed(t)
			waitState(t, srv, zds.State{})
		})
	}
	// After all that, a well-behaved ztunnel is served normally.
	startStandin(t, path, nil)
	waitState(t, srv, zds.State{Connections: 1, Ready: true})
}

func TestPeerWithDisallowedUIDIsRejected(t *testing.T) {
	// The test runs as root, so allow some other uid to see root refused.
	srv, path := startServer(t, &source{}, func(c *zds.Config) { c.AllowedPeerUIDs = []uint32{4242} })
	p := dialRaw(t, path)
	p.hello(zdspb.Version_V1)
	p.expectClosed(t)
	if st := srv.State(); st.Connections != 0 {
		t.Fatalf("state %+v after a refused peer", st)
	}
}

func TestSubscribeFollowsConnectAndDisconnect(t *testing.T) {
	srv, path := startServer(t, &source{}, nil)
	states, cancel := srv.Subscribe()
	defer cancel()
	next := func(want zds.State) {
		t.Helper()
		deadline := time.After(10 * time.Second)
		for {
			select {
			case st := <-states:
				if st == want {
					return
				}
			case <-deadline:
				t.Fatalf("no state %+v published", want)
			}
		}
	}
	next(zds.State{})
	p := dialRaw(t, path)
	p.hello(zdspb.Version_V1)
	p.expect(t, "snapshot_sent")
	p.ack("")
	next(zds.State{Connections: 1, Ready: true})
	p.uc.Close()
	next(zds.State{})
}

func TestListenSocketModesAndStaleSocket(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "zt")
	path := filepath.Join(dir, "ztunnel.sock")
	// A socket left by a dead agent: bound, then its listener gone.
	os.MkdirAll(dir, 0o755)
	testkit.StaleUnixSocket(t, "unixpacket", path)

	srv, err := zds.NewServer(zds.Config{SocketPath: path, Source: &source{}, Logger: testLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	if err := srv.Listen(); err != nil {
		t.Fatalf("Listen over a stale socket: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ctx) }()
	defer func() { cancel(); <-done }()

	for p, want := range map[string]os.FileMode{dir: 0o700, path: 0o600} {
		fi, err := os.Stat(p)
		if err != nil {
			t.Fatal(err)
		}
		if fi.Mode().Perm() != want {
			t.Errorf("%s mode %v, want %v", p, fi.Mode().Perm(), want)
		}
	}

	// A second agent must not steal a live socket.
	other, _ := zds.NewServer(zds.Config{SocketPath: path, Source: &source{}, Logger: testLogger(t)})
	if err := other.Listen(); err == nil || !strings.Contains(err.Error(), "already serving") {
		t.Fatalf("second Listen = %v, want refusal", err)
	}
	notSock := filepath.Join(dir, "file")
	os.WriteFile(notSock, nil, 0o600)
	third, _ := zds.NewServer(zds.Config{SocketPath: notSock, Source: &source{}, Logger: testLogger(t)})
	if err := third.Listen(); err == nil || !strings.Contains(err.Error(), "not a socket") {
		t.Fatalf("Listen over a regular file = %v, want refusal", err)
	}
}

func TestSnapshotSkipsEntriesZtunnelRejects(t *testing.T) {
	podA, podB := netnstest.New(t), netnstest.New(t)
	nsA, nsB := podA.Open(t), podB.Open(t)
	src := &source{}
	src.set(podWorkload("uid-bad", nsA), podWorkload("uid-good", nsB))
	srv, path := startServer(t, src, nil)
	z := startStandin(t, path, func(c *ztunnel.Config) {
		c.Reject = func(uid string) string {
			if uid == "uid-bad" {
				return "nope"
			}
			return ""
		}
	})
	waitState(t, srv, zds.State{Connections: 1, Ready: true})
	if _, ok := z.Workloads()["uid-good"]; !ok {
		t.Fatal("one rejected snapshot entry kept the others from ztunnel")
	}
}

// A caller that gives up while its Add is on the wire must not let the next
// request go out before that Add's Ack: the Ack would be credited to it.
func TestCallerLeavingMidRequestKeepsAcksPaired(t *testing.T) {
	pod := netnstest.New(t)
	nsFile := pod.Open(t)
	srv, path := startServer(t, &source{}, nil)
	startStandin(t, path, func(c *ztunnel.Config) {
		c.AckDelay = 300 * time.Millisecond
		c.Reject = func(uid string) string {
			if uid == "uid-second" {
				return "refused"
			}
			return ""
		}
	})
	waitState(t, srv, zds.State{Connections: 1, Ready: true})

	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if err := srv.Add(ctx, podWorkload("uid-first", nsFile)); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("first Add = %v, want its context's deadline", err)
	}
	// The first Add's (successful) Ack is still to come; the second must
	// get its own, an error.
	err := srv.Add(context.Background(), podWorkload("uid-second", nsFile))
	var ackErr *zds.AckError
	if !errors.As(err, &ackErr) || ackErr.UID != "uid-second" {
		t.Fatalf("second Add = %v, want the AckError ztunnel sent for it", err)
	}
	if st := srv.State(); st.Connections != 1 {
		t.Fatalf("state %+v: the connection should have survived", st)
	}
}

// A caller that left mid-request keeps the turn; when the connection then
// dies before that request's Ack, a caller queued behind it gets an error,
// never a success, and the turn is not wedged: a new connection serves Adds.
func TestConnectionDyingBehindADepartedCallerFailsTheQueuedOne(t *testing.T) {
	pod := netnstest.New(t)
	nsFile := pod.Open(t)
	srv, path := startServer(t, &source{}, func(c *zds.Config) { c.AckTimeout = time.Minute })
	peer := dialRaw(t, path)
	peer.hello(zdspb.Version_V1)
	peer.expect(t, "snapshot_sent")
	peer.ack("")
	waitState(t, srv, zds.State{Connections: 1, Ready: true})

	ctx, cancel := context.WithCancel(context.Background())
	first := make(chan error, 1)
	go func() { first <- srv.Add(ctx, podWorkload("uid-first", nsFile)) }()
	peer.expect(t, "add")
	cancel()
	if err := <-first; !errors.Is(err, context.Canceled) {
		t.Fatalf("first Add = %v, want its cancellation", err)
	}
	second := make(chan error, 1)
	go func() { second <- srv.Add(context.Background(), podWorkload("uid-second", nsFile)) }()
	// The second must not go out while the first's Ack is owed.
	peer.uc.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
	if d, err := zds.ReadDatagram(peer.uc); err == nil {
		d.CloseFDs()
		t.Fatal("a second request went out while the departed caller's Ack was still owed")
	}
	peer.uc.Close() // ztunnel dies without acking
	select {
	case err := <-second:
		if !errors.Is(err, zds.ErrConnectionClosed) {
			t.Fatalf("queued Add = %v, want ErrConnectionClosed", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the queued Add is still waiting after its connection died")
	}
	waitState(t, srv, zds.State{})

	z := startStandin(t, path, nil)
	waitState(t, srv, zds.State{Connections: 1, Ready: true})
	if err := srv.Add(context.Background(), podWorkload("uid-third", nsFile)); err != nil {
		t.Fatalf("Add on a new connection = %v", err)
	}
	if _, ok := z.Workloads()["uid-third"]; !ok {
		t.Fatal("the new connection's ztunnel does not run uid-third")
	}
}

func TestNotReadyReasonNamesTheConnectionsOnlyWhenNotReady(t *testing.T) {
	if r := (zds.State{Ready: true, Connections: 1}).NotReadyReason(); r != "" {
		t.Errorf("ready: reason %q", r)
	}
	if r := (zds.State{Connections: 2}).NotReadyReason(); !strings.Contains(r, "2 connections") {
		t.Errorf("not ready: reason %q does not count the connections", r)
	}
}
