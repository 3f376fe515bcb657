package zdstest_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"

	"github.com/inpod-dev/inpod/internal/testkit"
	"github.com/inpod-dev/inpod/netns"
	"github.com/inpod-dev/inpod/netns/netnstest"
	"github.com/inpod-dev/inpod/zds"
	"github.com/inpod-dev/inpod/zds/zdspb"
	ztunnel "github.com/inpod-dev/inpod/zds/zdstest"
)

// fakeAgent is a hand-driven ZDS server that can send what inpod's server
// never would, to check the stand-in polices the protocol like ztunnel.
type fakeAgent struct {
	t  *testing.T
	ln *net.UnixListener
}

func newFakeAgent(t *testing.T) (*fakeAgent, string) {
	path := filepath.Join(t.TempDir(), "ztunnel.sock")
	ln, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: path, Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	return &fakeAgent{t: t, ln: ln}, path
}

type agentConn struct {
	t  *testing.T
	uc *net.UnixConn
}

// accept takes the stand-in's next connection and checks its hello.
func (a *fakeAgent) accept() *agentConn {
	a.t.Helper()
	a.ln.SetDeadline(time.Now().Add(10 * time.Second))
	uc, err := a.ln.AcceptUnix()
	if err != nil {
		a.t.Fatal(err)
	}
	a.t.Cleanup(func() { uc.Close() })
	uc.SetReadDeadline(time.Now().Add(10 * time.Second))
	d, err := zds.ReadDatagram(uc)
	if err != nil {
		a.t.Fatal(err)
	}
	if err := zds.DecodeHello(d.Payload); err != nil {
		a.t.Fatalf("stand-in hello: %v", err)
	}
	return &agentConn{t: a.t, uc: uc}
}

// request sends req with fds and returns the Ack's error text, or ok=false
// when the stand-in closed the connection instead of acking.
func (c *agentConn) request(req *zdspb.WorkloadRequest, fds ...int) (ackErr string, ok bool) {
	c.t.Helper()
	b, err := proto.Marshal(req)
	if err != nil {
		c.t.Fatal(err)
	}
	return c.requestRaw(b, fds...)
}

func (c *agentConn) requestRaw(b []byte, fds ...int) (ackErr string, ok bool) {
	c.t.Helper()
	var oob []byte
	if len(fds) > 0 {
		oob = unix.UnixRights(fds...)
	}
	if _, _, err := c.uc.WriteMsgUnix(b, oob, nil); err != nil {
		return "", false
	}
	c.uc.SetReadDeadline(time.Now().Add(10 * time.Second))
	d, err := zds.ReadDatagram(c.uc)
	if err != nil {
		return "", false
	}
	ack, err := zds.DecodeResponse(d.Payload)
	if err != nil {
		c.t.Fatalf("stand-in sent a non-ack: %v", err)
	}
	return ack.GetError(), true
}

func add(uid string) *zdspb.WorkloadRequest {
	return &zdspb.WorkloadRequest{Payload: &zdspb.WorkloadRequest_Add{Add: &zdspb.AddWorkload{
		Uid: uid, WorkloadInfo: &zdspb.WorkloadInfo{Name: "p-" + uid, Namespace: "ns", ServiceAccount: "sa"},
	}}}
}

func keep(uid string) *zdspb.WorkloadRequest {
	return &zdspb.WorkloadRequest{Payload: &zdspb.WorkloadRequest_Keep{Keep: &zdspb.KeepWorkload{Uid: uid}}}
}

func del(uid string) *zdspb.WorkloadRequest {
	return &zdspb.WorkloadRequest{Payload: &zdspb.WorkloadRequest_Del{Del: &zdspb.DelWorkload{Uid: uid}}}
}

var snapshotSent = &zdspb.WorkloadRequest{Payload: &zdspb.WorkloadRequest_SnapshotSent{SnapshotSent: &zdspb.SnapshotSent{}}}

func runStandin(t *testing.T, path string, mod func(*ztunnel.Config)) *ztunnel.Standin {
	cfg := ztunnel.Config{SocketPath: path, MinBackoff: 5 * time.Millisecond, MaxBackoff: 20 * time.Millisecond}
	if mod != nil {
		mod(&cfg)
	}
	z := ztunnel.New(cfg)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { z.Run(ctx); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	return z
}

func openFD(t *testing.T, path string) int {
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	return int(f.Fd())
}

func TestStandinRejectsProtocolViolations(t *testing.T) {
	pod := netnstest.New(t)
	podFD := openFD(t, pod.Path)
	cases := []struct {
		name    string
		drive   func(c *agentConn) bool // false once the stand-in hung up
		wantErr string
	}{
		{"keep after SnapshotSent", func(c *agentConn) bool {
			c.request(snapshotSent)
			_, ok := c.request(keep("u"))
			return ok
		}, "keep of u after SnapshotSent"},
		{"second SnapshotSent", func(c *agentConn) bool {
			c.request(snapshotSent)
			_, ok := c.request(snapshotSent)
			return ok
		}, "second SnapshotSent"},
		{"fd on Keep", func(c *agentConn) bool {
			_, ok := c.request(keep("u"), podFD)
			return ok
		}, "only Add may carry one"},
		{"fd on Del", func(c *agentConn) bool {
			_, ok := c.request(del("u"), podFD)
			return ok
		}, "only Add may carry one"},
		{"Add without fd", func(c *agentConn) bool {
			_, ok := c.request(add("u"))
			return ok
		}, "carried 0 fds"},
		{"Add with two fds", func(c *agentConn) bool {
			_, ok := c.request(add("u"), podFD, podFD)
			return ok
		}, "carried 2 fds"},
		{"Add with a plain file", func(c *agentConn) bool {
			_, ok := c.request(add("u"), openFD(t, "/dev/null"))
			return ok
		}, "not a network namespace"},
		{"Add with a mount namespace", func(c *agentConn) bool {
			_, ok := c.request(add("u"), openFD(t, "/proc/self/ns/mnt"))
			return ok
		}, "not a network namespace"},
		{"request with only an unknown field (number 4)", func(c *agentConn) bool {
			_, ok := c.requestRaw([]byte{0x22, 0x00})
			return ok
		}, "no known payload"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			agent, path := newFakeAgent(t)
			z := runStandin(t, path, nil)
			c := agent.accept()
			if tc.drive(c) {
				t.Fatal("stand-in acked a protocol violation instead of hanging up")
			}
			errs := z.ProtocolErrors()
			if len(errs) != 1 || !strings.Contains(errs[0].Error(), tc.wantErr) {
				t.Fatalf("protocol errors %v, want one containing %q", errs, tc.wantErr)
			}
			// Like ztunnel, it comes back and expects a fresh snapshot.
			agent.accept()
		})
	}
}

func TestStandinAddWithoutWorkloadInfoIsAnErrorAck(t *testing.T) {
	pod := netnstest.New(t)
	agent, path := newFakeAgent(t)
	z := runStandin(t, path, nil)
	c := agent.accept()
	req := &zdspb.WorkloadRequest{Payload: &zdspb.WorkloadRequest_Add{Add: &zdspb.AddWorkload{Uid: "u"}}}
	msg, ok := c.request(req, openFD(t, pod.Path))
	if !ok || !strings.Contains(msg, "workload_info") {
		t.Fatalf("ack %q (connected %v), want an error ack naming workload_info", msg, ok)
	}
	if len(z.Workloads()) != 0 || len(z.ProtocolErrors()) != 0 {
		t.Fatalf("workloads %v, protocol errors %v", z.Workloads(), z.ProtocolErrors())
	}
}

func TestStandinSnapshotDropsUnnamedWorkloads(t *testing.T) {
	podA, podB := netnstest.New(t), netnstest.New(t)
	agent, path := newFakeAgent(t)
	z := runStandin(t, path, nil)

	c := agent.accept()
	for uid, p := range map[string]*netnstest.NetNS{"a": podA, "b": podB} {
		if msg, ok := c.request(add(uid), openFD(t, p.Path)); !ok || msg != "" {
			t.Fatalf("add %s: %q %v", uid, msg, ok)
		}
	}
	c.request(snapshotSent)
	c.uc.Close() // the agent restarts

	c = agent.accept()
	if msg, ok := c.request(keep("a")); !ok || msg != "" {
		t.Fatalf("keep: %q %v", msg, ok)
	}
	c.request(snapshotSent)
	ws := z.Workloads()
	if _, ok := ws["a"]; !ok || len(ws) != 1 {
		t.Fatalf("workloads after snapshot naming only a: %v", ws)
	}
	if err := dial(podB.Path, ztunnel.PortInbound); err == nil {
		t.Fatal("dropped workload's listener still accepts")
	}
	if err := dial(podA.Path, ztunnel.PortInbound); err != nil {
		t.Fatalf("kept workload's listener: %v", err)
	}
}

func TestStandinRecreatedSandboxMovesListeners(t *testing.T) {
	oldNS, newNS := netnstest.New(t), netnstest.New(t)
	agent, path := newFakeAgent(t)
	z := runStandin(t, path, nil)
	c := agent.accept()
	c.request(snapshotSent)
	c.request(add("u"), openFD(t, oldNS.Path))
	c.request(add("u"), openFD(t, newNS.Path))

	want, _ := netns.IdentityOfPath(newNS.Path)
	if got := z.Workloads()["u"].NetNS; got != want {
		t.Fatalf("workload netns %v, want the new sandbox's %v", got, want)
	}
	if err := dial(newNS.Path, ztunnel.PortOutbound); err != nil {
		t.Fatalf("new sandbox: %v", err)
	}
	if err := dial(oldNS.Path, ztunnel.PortOutbound); err == nil {
		t.Fatal("old sandbox still has the proxy's listener")
	}
}

func TestStandinListenersAreMarkedAndReportOriginalDst(t *testing.T) {
	pod := netnstest.New(t)
	agent, path := newFakeAgent(t)
	z := runStandin(t, path, func(c *ztunnel.Config) { c.DNS = true })
	c := agent.accept()
	c.request(snapshotSent)
	if msg, ok := c.request(add("u"), openFD(t, pod.Path)); !ok || msg != "" {
		t.Fatalf("add: %q %v", msg, ok)
	}
	// ss shows the mark on each listening socket inside the pod netns.
	out := pod.Exec(t, "ss", "-ltnH", "-e", "-O")
	for _, port := range []int{15001, 15006, 15008, 15053} {
		found := false
		for _, line := range strings.Split(out, "\n") {
			if strings.Contains(line, fmt.Sprintf(":%d ", port)) && strings.Contains(line, "fwmark:0x539") {
				found = true
			}
		}
		if !found {
			t.Errorf("no listener on %d marked 0x539 in:\n%s", port, out)
		}
	}
	if err := dial(pod.Path, ztunnel.PortHBONE); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, 10*time.Second, "the stand-in to record the HBONE connection with its original destination", func() bool {
		for _, a := range z.AcceptedConns() {
			if a.UID == "u" && a.Port == ztunnel.PortHBONE && a.OrigDst == "127.0.0.1:15008" {
				return true
			}
		}
		return false
	})
}

func dial(nsPath string, port int) error {
	return netns.DoPath(nsPath, func() error {
		c, err := net.DialTimeout("tcp4", fmt.Sprintf("127.0.0.1:%d", port), 2*time.Second)
		if err != nil {
			return err
		}
		return c.Close()
	})
}

// recordEvents reads a stand-in's Record, one line per event.
func recordEvents(b *testkit.Buffer) []string {
	var out []string
	for _, line := range strings.Split(strings.TrimSpace(b.String()), "\n") {
		var e ztunnel.RecordEntry
		if err := json.Unmarshal([]byte(line), &e); err != nil {
			return []string{"bad line " + line}
		}
		out = append(out, strings.TrimSpace(e.Event+" "+e.UID+" "+e.Pod+" "+e.NetNS))
	}
	return out
}

// The record is what a test outside the stand-in's process judges it by:
// every acknowledged Add with its netns, and every workload it let go.
func TestStandinRecordsAcksAndRemovals(t *testing.T) {
	podA, podB := netnstest.New(t), netnstest.New(t)
	idA, err := netns.IdentityOfPath(podA.Path)
	if err != nil {
		t.Fatal(err)
	}
	idB, err := netns.IdentityOfPath(podB.Path)
	if err != nil {
		t.Fatal(err)
	}
	agent, path := newFakeAgent(t)
	rec := &testkit.Buffer{}
	runStandin(t, path, func(c *ztunnel.Config) {
		c.Record = rec
		c.Reject = func(uid string) string {
			if uid == "refused" {
				return "no"
			}
			return ""
		}
	})
	c := agent.accept()
	for uid, p := range map[string]*netnstest.NetNS{"a": podA, "b": podB, "refused": podB} {
		c.request(add(uid), openFD(t, p.Path))
	}
	c.request(snapshotSent)
	c.uc.Close()
	c = agent.accept()
	c.request(keep("a"))
	c.request(snapshotSent)
	c.request(del("a"))
	want := []string{"start", "ack a ns/p-a " + idA.String(), "ack b ns/p-b " + idB.String(), "del b", "del a"}
	testkit.Eventually(t, 5*time.Second, "the record", func() bool {
		got := recordEvents(rec)
		if len(got) != len(want) {
			return false
		}
		slices.Sort(got[1:3]) // the adds went out in map order
		return slices.Equal(got, want)
	})
}

// A stand-in that stops (its pod deleted, as an upgrade deletes the old
// ztunnel's) says so in its record: its listeners go with it, which a judge
// must be able to tell from a stand-in that dropped a workload while it ran.
func TestStandinRecordsItsStop(t *testing.T) {
	pod := netnstest.New(t)
	agent, path := newFakeAgent(t)
	rec := &testkit.Buffer{}
	z := ztunnel.New(ztunnel.Config{SocketPath: path, Record: rec, MinBackoff: 5 * time.Millisecond, MaxBackoff: 20 * time.Millisecond})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { z.Run(ctx); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	c := agent.accept()
	c.request(add("a"), openFD(t, pod.Path))
	c.request(snapshotSent)
	cancel()
	<-done
	got := recordEvents(rec)
	if len(got) != 3 || got[0] != "start" || !strings.HasPrefix(got[1], "ack a ") || got[2] != "stop" {
		t.Fatalf("record %q, want start, the ack of a, stop", got)
	}
}
