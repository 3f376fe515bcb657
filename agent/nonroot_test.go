package agent_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/inpod-dev/inpod/agent/cniserver"
	"github.com/inpod-dev/inpod/cnievent"
	"github.com/inpod-dev/inpod/internal/testkit"
	"github.com/inpod-dev/inpod/zds"
	ztunnel "github.com/inpod-dev/inpod/zds/zdstest"
)

// The agent's two sockets take root only. A local process running as
// another user (here uid/gid 65534, a real child process) is stopped twice
// over: the socket's 0700 directory refuses its connect (EACCES), and even
// with the file permissions loosened (an operator's chmod, a hostPath
// mounted with other modes) the server's SO_PEERCRED check closes its
// connection unanswered. Meanwhile root keeps being served.

const nonRootEnv = "INPOD_TEST_NONROOT_DIAL"

const nobodyID = 65534

func TestMain(m *testing.M) {
	if v := os.Getenv(nonRootEnv); v != "" {
		fmt.Print(nonRootDial(v))
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// nonRootDial runs in the child: it talks to the socket like the plugin
// (network "unix") or ztunnel ("unixpacket") would and prints one verdict:
// not-unprivileged, denied: <errno>, closed-unanswered, answered: <bytes>,
// or error: <text>.
func nonRootDial(arg string) string {
	if os.Geteuid() == 0 || os.Getuid() == 0 {
		return "not-unprivileged"
	}
	network, path, _ := strings.Cut(arg, " ")
	c, err := net.DialTimeout(network, path, 5*time.Second)
	if err != nil {
		if errors.Is(err, syscall.EACCES) || errors.Is(err, syscall.EPERM) {
			return "denied: " + err.Error()
		}
		return "error: " + err.Error()
	}
	defer c.Close()
	uc := c.(*net.UnixConn)
	uc.SetDeadline(time.Now().Add(5 * time.Second))
	var payload []byte
	if network == "unixpacket" {
		payload = []byte{0x08, 0x01} // ZdsHello{version: V1}
	} else {
		payload, _ = json.Marshal(&cnievent.Request{Command: cnievent.Add, PodNamespace: "default", PodName: "web-1",
			ContainerID: "abc", Netns: "/var/run/netns/cni-1", IfName: "eth0"})
	}
	if _, err := uc.Write(payload); err != nil {
		if errors.Is(err, syscall.EPIPE) || errors.Is(err, syscall.ECONNRESET) {
			return "closed-unanswered"
		}
		return "error: write: " + err.Error()
	}
	if network == "unix" {
		uc.CloseWrite()
	}
	buf := make([]byte, 4096)
	n, err := uc.Read(buf)
	switch {
	case n > 0:
		return "answered: " + string(buf[:n])
	case err == nil, errors.Is(err, io.EOF), errors.Is(err, syscall.ECONNRESET):
		return "closed-unanswered"
	}
	return "error: read: " + err.Error()
}

// dialAsNobody runs the test binary as uid/gid 65534 against the socket.
func dialAsNobody(t *testing.T, bin, network, path string) string {
	t.Helper()
	cmd := exec.Command(bin, "-test.run=^$")
	cmd.Env = append(os.Environ(), nonRootEnv+"="+network+" "+path)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: nobodyID, Gid: nobodyID, Groups: []uint32{}}, Pdeathsig: syscall.SIGKILL}
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("child as uid %d: %v\n%s", nobodyID, err, stderr.String())
	}
	v := string(out)
	if v == "not-unprivileged" || strings.HasPrefix(v, "error:") {
		t.Fatalf("child as uid %d: %s", nobodyID, v)
	}
	return v
}

// nobodyCanRun copies the test binary where uid 65534 may execute it (the
// go build dir is root's alone) and returns a dir that uid may traverse,
// so that only the socket's own dir and mode stand in its way.
func nobodyCanRun(t *testing.T) (bin, openDir string) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: runs a child process as uid 65534")
	}
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	openDir = testkit.ShortTempDir(t, "inpod-nonroot-")
	if err := os.Chmod(openDir, 0o755); err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile(self)
	if err != nil {
		t.Fatal(err)
	}
	bin = filepath.Join(openDir, "agent.test")
	if err := os.WriteFile(bin, data, 0o755); err != nil {
		t.Fatal(err)
	}
	return bin, openDir
}

// loosen opens the socket and its dir to everybody, so the connect gets
// through to the server's own peer check.
func loosen(t *testing.T, path string) {
	t.Helper()
	if err := os.Chmod(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(path, 0o666); err != nil {
		t.Fatal(err)
	}
}

type countingHandler struct{ n atomic.Int32 }

func (h *countingHandler) Add(context.Context, *cnievent.Request) (cnievent.Outcome, error) {
	h.n.Add(1)
	return cnievent.NotEnrolled, nil
}
func (h *countingHandler) Del(context.Context, *cnievent.Request) (cnievent.Outcome, error) {
	h.n.Add(1)
	return cnievent.NotEnrolled, nil
}
func (h *countingHandler) Check(context.Context, *cnievent.Request) (cnievent.Outcome, error) {
	h.n.Add(1)
	return cnievent.NotEnrolled, nil
}

func TestNonRootProcessCannotUseTheCNIEventSocket(t *testing.T) {
	bin, dir := nobodyCanRun(t)
	path := filepath.Join(dir, "inpod", "cni.sock")
	h := &countingHandler{}
	srv, err := cniserver.New(cniserver.Config{SocketPath: path, Handler: h, ReadTimeout: time.Second,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	testkit.Serve(t, srv)
	rootAsks := func(when string) {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		before := h.n.Load()
		resp, err := cnievent.Send(ctx, path, &cnievent.Request{Command: cnievent.Add, PodNamespace: "default", PodName: "web-1",
			ContainerID: "abc", Netns: "/var/run/netns/cni-1", IfName: "eth0"})
		if err != nil || resp.Outcome != cnievent.NotEnrolled || h.n.Load() != before+1 {
			t.Fatalf("root %s: %+v, %v", when, resp, err)
		}
	}
	rootAsks("before")

	if v := dialAsNobody(t, bin, "unix", path); !strings.HasPrefix(v, "denied:") || !strings.Contains(v, "permission denied") {
		t.Fatalf("uid %d connecting to the 0600 socket in its 0700 dir: %s; want permission denied", nobodyID, v)
	}
	loosen(t, path)
	if v := dialAsNobody(t, bin, "unix", path); v != "closed-unanswered" {
		t.Fatalf("uid %d with the socket opened to all: %s; want the connection closed by the peer check", nobodyID, v)
	}
	if n := h.n.Load(); n != 1 {
		t.Fatalf("the handler saw %d requests; only root's should have reached it", n)
	}
	rootAsks("after")
}

type emptySource struct{}

func (emptySource) Snapshot(context.Context) ([]zds.Workload, error) { return nil, nil }

func TestNonRootProcessCannotUseTheZDSSocket(t *testing.T) {
	bin, dir := nobodyCanRun(t)
	path := filepath.Join(dir, "ztunnel", "ztunnel.sock")
	srv, err := zds.NewServer(zds.Config{SocketPath: path, Source: emptySource{},
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	testkit.Serve(t, srv)

	if v := dialAsNobody(t, bin, "unixpacket", path); !strings.HasPrefix(v, "denied:") || !strings.Contains(v, "permission denied") {
		t.Fatalf("uid %d connecting to the ZDS socket: %s; want permission denied", nobodyID, v)
	}
	loosen(t, path)
	if v := dialAsNobody(t, bin, "unixpacket", path); v != "closed-unanswered" {
		t.Fatalf("uid %d with the ZDS socket opened to all: %s; want the connection closed by the peer check", nobodyID, v)
	}
	if st := srv.State(); st.Connections != 0 || st.Ready {
		t.Fatalf("state %+v after a non-root peer", st)
	}
	// Root (a ztunnel) is still served: connected, snapshot acked.
	z, stop := ztunnel.Start(t, ztunnel.Config{SocketPath: path, MinBackoff: 10 * time.Millisecond, MaxBackoff: 50 * time.Millisecond,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	defer stop()
	testkit.Eventually(t, 10*time.Second, "root's ztunnel served", func() bool { return z.SnapshotDone() && srv.State().Ready })
}
