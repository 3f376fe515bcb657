package handover

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/inpod-dev/inpod/internal/testkit"
	"github.com/inpod-dev/inpod/internal/unixsock"
)

// agentSide plays an agent's served socket: a unix stream listener (as the
// CNI event socket) whose connections are answered with the agent's name,
// so a test sees which agent accepted a connection.
type agentSide struct {
	t    *testing.T
	name string
	ln   *net.UnixListener

	mu       sync.Mutex
	stop     chan struct{}
	done     chan struct{}
	paused   int
	resumed  int
	retired  bool
	pauseErr error
	hold     chan struct{} // when set, Pause waits for it to close
	file     *os.File      // the socket's copy Pause gave, the Source's to close
}

func (a *agentSide) closeFile() {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.file != nil {
		a.file.Close()
		a.file = nil
	}
}

func newAgentSide(t *testing.T, name string, ln *net.UnixListener) *agentSide {
	a := &agentSide{t: t, name: name, ln: ln}
	a.serve()
	t.Cleanup(func() { a.halt(); a.ln.Close() })
	return a
}

func (a *agentSide) serve() {
	a.stop, a.done = make(chan struct{}), make(chan struct{})
	stop, done := a.stop, a.done
	go func() {
		defer close(done)
		for {
			select {
			case <-stop:
				return
			default:
			}
			// The deadline only lets the loop see stop: a connection
			// accepted is always answered.
			a.ln.SetDeadline(time.Now().Add(20 * time.Millisecond))
			if c, err := a.ln.Accept(); err == nil {
				c.Write([]byte(a.name))
				c.Close()
			}
		}
	}()
}

// halt stops accepting; a connection dialed meanwhile stays in the backlog.
func (a *agentSide) halt() {
	if a.stop == nil {
		return
	}
	close(a.stop)
	<-a.done
	a.stop = nil
}

func (a *agentSide) Pause(context.Context) (map[string]*os.File, error) {
	a.mu.Lock()
	a.paused++
	hold, err := a.hold, a.pauseErr
	a.mu.Unlock()
	if hold != nil {
		<-hold
	}
	a.halt()
	if err != nil {
		return nil, err
	}
	f, err := a.ln.File()
	if err != nil {
		return nil, err
	}
	a.mu.Lock()
	a.file = f
	a.mu.Unlock()
	return map[string]*os.File{"cni": f}, nil
}

func (a *agentSide) Resume() {
	a.mu.Lock()
	a.resumed++
	a.mu.Unlock()
	a.closeFile()
	a.serve()
}

func (a *agentSide) Retire() {
	a.mu.Lock()
	a.retired = true
	a.mu.Unlock()
	a.ln.SetUnlinkOnClose(false) // the successor serves the same path
	a.ln.Close()
	a.closeFile()
}

func (a *agentSide) counts() (paused, resumed int, retired bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.paused, a.resumed, a.retired
}

// node is one node's socket directory with a first agent serving it.
type node struct {
	dir, cniPath, handoverPath string
}

func newNode(t *testing.T) node {
	dir := t.TempDir()
	return node{dir: dir, cniPath: filepath.Join(dir, "cni.sock"), handoverPath: filepath.Join(dir, "handover.sock")}
}

// firstAgent binds the node's sockets and serves hand-overs at rank.
func (n node) firstAgent(t *testing.T, name string, rank int64) (*agentSide, <-chan bool) {
	cni, err := unixsock.Listen("unix", n.cniPath)
	if err != nil {
		t.Fatal(err)
	}
	hln, err := unixsock.Listen("unixpacket", n.handoverPath)
	if err != nil {
		t.Fatal(err)
	}
	return serveHandover(t, newAgentSide(t, name, cni), hln, rank)
}

func serveHandover(t *testing.T, a *agentSide, hln *net.UnixListener, rank int64) (*agentSide, <-chan bool) {
	ctx, cancel := context.WithCancel(context.Background())
	taken := make(chan bool, 1)
	ended := make(chan struct{})
	t.Cleanup(func() { cancel(); <-ended })
	go func() {
		defer close(ended)
		ok, err := Serve(ctx, hln, slog.New(slog.DiscardHandler), rank, a)
		if err != nil {
			t.Errorf("%s: Serve: %v", a.name, err)
		}
		if ok {
			hln.SetUnlinkOnClose(false)
		}
		hln.Close()
		taken <- ok
	}()
	return a, taken
}

// successor builds an agent from the sockets Take returned, serving the
// next hand-over at rank.
func successor(t *testing.T, name string, files map[string]*os.File, rank int64) (*agentSide, <-chan bool) {
	t.Helper()
	if len(files) != 2 || files["cni"] == nil || files[HandoverSocket] == nil {
		t.Fatalf("%s got sockets %v, want cni and %s", name, files, HandoverSocket)
	}
	cni, err := Listener(files["cni"])
	if err != nil {
		t.Fatal(err)
	}
	hln, err := Listener(files[HandoverSocket])
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range files {
		f.Close()
	}
	return serveHandover(t, newAgentSide(t, name, cni), hln, rank)
}

// whoAnswers dials the node's CNI socket and returns the answering
// agent's name.
func whoAnswers(t *testing.T, path string) string {
	t.Helper()
	c, err := net.DialTimeout("unix", path, time.Second)
	if err != nil {
		t.Fatalf("dial %s: %v", path, err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	b, err := io.ReadAll(c)
	if err != nil {
		t.Fatalf("read %s: %v", path, err)
	}
	return string(b)
}

func TestTheSuccessorServesTheSocketsItTook(t *testing.T) {
	n := newNode(t)
	old, oldTaken := n.firstAgent(t, "old", 1)
	if got := whoAnswers(t, n.cniPath); got != "old" {
		t.Fatalf("before the hand-over %q answered, want old", got)
	}
	files, err := Take(context.Background(), n.handoverPath, 2)
	if err != nil {
		t.Fatal(err)
	}
	if !<-oldTaken {
		t.Fatal("the running agent's Serve did not report the hand-over")
	}
	if paused, resumed, retired := old.counts(); paused != 1 || resumed != 0 || !retired {
		t.Fatalf("the running agent paused %d, resumed %d, retired %v; want 1, 0, true", paused, resumed, retired)
	}
	// A connection made between the hand-over and the successor's first
	// accept waits in the backlog: it is not refused.
	early, err := net.DialTimeout("unix", n.cniPath, time.Second)
	if err != nil {
		t.Fatalf("dial during the switch: %v", err)
	}
	defer early.Close()
	successor(t, "new", files, 2)
	early.SetDeadline(time.Now().Add(10 * time.Second))
	if b, err := io.ReadAll(early); err != nil || string(b) != "new" {
		t.Fatalf("the connection made during the switch got %q, %v; want new", b, err)
	}
	if got := whoAnswers(t, n.cniPath); got != "new" {
		t.Fatalf("after the hand-over %q answered, want new", got)
	}
}

func TestNoAgentToTakeFrom(t *testing.T) {
	n := newNode(t)
	if _, err := Take(context.Background(), n.handoverPath, 1); !errors.Is(err, ErrNoAgent) {
		t.Fatalf("no socket: %v, want ErrNoAgent", err)
	}
	// The socket file of an agent that died: nobody listens.
	ln, err := unixsock.Listen("unixpacket", n.handoverPath)
	if err != nil {
		t.Fatal(err)
	}
	ln.SetUnlinkOnClose(false)
	ln.Close()
	if _, err := Take(context.Background(), n.handoverPath, 1); !errors.Is(err, ErrNoAgent) {
		t.Fatalf("a dead agent's socket: %v, want ErrNoAgent", err)
	}
}

func TestAnOlderSuccessorIsRefused(t *testing.T) {
	n := newNode(t)
	old, _ := n.firstAgent(t, "old", 5)
	_, err := Take(context.Background(), n.handoverPath, 4)
	var refused *Refused
	if !errors.As(err, &refused) {
		t.Fatalf("Take with an older rank: %v, want a refusal", err)
	}
	if paused, _, retired := old.counts(); paused != 0 || retired {
		t.Fatalf("the running agent paused %d times, retired %v for an older successor", paused, retired)
	}
	if got := whoAnswers(t, n.cniPath); got != "old" {
		t.Fatalf("%q answered, want old", got)
	}
}

func TestAFailedPauseLeavesTheAgentServing(t *testing.T) {
	n := newNode(t)
	old, _ := n.firstAgent(t, "old", 1)
	old.mu.Lock()
	old.pauseErr = errors.New("in-flight work did not finish")
	old.mu.Unlock()
	var refused *Refused
	if _, err := Take(context.Background(), n.handoverPath, 2); !errors.As(err, &refused) {
		t.Fatalf("Take from an agent that cannot pause: %v, want a refusal", err)
	}
	if _, resumed, retired := old.counts(); resumed != 1 || retired {
		t.Fatalf("resumed %d, retired %v; want 1, false", resumed, retired)
	}
	if got := whoAnswers(t, n.cniPath); got != "old" {
		t.Fatalf("%q answered, want old", got)
	}
}

// rawTake sends a take and reads the answer, receiving the sockets, then
// returns the connection without confirming: a successor that dies or
// misbehaves mid-exchange.
func rawTake(t *testing.T, path, request string) *net.UnixConn {
	t.Helper()
	c, err := net.Dial("unixpacket", path)
	if err != nil {
		t.Fatal(err)
	}
	uc := c.(*net.UnixConn)
	if _, err := uc.Write([]byte(request)); err != nil {
		t.Fatal(err)
	}
	uc.SetDeadline(time.Now().Add(10 * time.Second))
	buf, oob := make([]byte, maxMessage), make([]byte, unix.CmsgSpace(16*4))
	_, oobn, _, _, err := uc.ReadMsgUnix(buf, oob)
	if err != nil {
		if errors.Is(err, io.EOF) {
			return uc
		}
		t.Fatal(err)
	}
	fds, _ := rights(oob[:oobn])
	for _, fd := range fds {
		unix.Close(fd)
	}
	return uc
}

func TestASuccessorThatDiesBeforeConfirmingLeavesTheAgentServing(t *testing.T) {
	for name, last := range map[string]string{"dies": "", "answers something else": "gone"} {
		t.Run(name, func(t *testing.T) {
			n := newNode(t)
			old, oldTaken := n.firstAgent(t, "old", 1)
			uc := rawTake(t, n.handoverPath, "take "+protocol+" 2")
			if last != "" {
				uc.Write([]byte(last))
			}
			uc.Close()
			testkit.Eventually(t, 10*time.Second, "the running agent resumed", func() bool {
				_, resumed, _ := old.counts()
				return resumed == 1
			})
			select {
			case <-oldTaken:
				t.Fatal("Serve reported a hand-over that was not confirmed")
			default:
			}
			if got := whoAnswers(t, n.cniPath); got != "old" {
				t.Fatalf("%q answered, want old", got)
			}
			// The next successor still takes over.
			files, err := Take(context.Background(), n.handoverPath, 3)
			if err != nil {
				t.Fatal(err)
			}
			successor(t, "new", files, 3)
			if got := whoAnswers(t, n.cniPath); got != "new" {
				t.Fatalf("%q answered, want new", got)
			}
		})
	}
}

func TestARequestInAnotherProtocolIsRefused(t *testing.T) {
	n := newNode(t)
	old, _ := n.firstAgent(t, "old", 1)
	uc := rawTake(t, n.handoverPath, "take inpod-handover/9 2")
	uc.Close()
	if paused, _, _ := old.counts(); paused != 0 {
		t.Fatalf("paused for a request in another protocol")
	}
	if got := whoAnswers(t, n.cniPath); got != "old" {
		t.Fatalf("%q answered, want old", got)
	}
}

// Two successors at once (a surge pod and a restarted one): the running
// agent answers one; the other's request waits in the hand-over socket's
// backlog, which now belongs to the first successor, and takes from it.
// One agent serves at every step, the newest at the end.
func TestTwoSuccessorsTakeOneAfterTheOther(t *testing.T) {
	n := newNode(t)
	old, oldTaken := n.firstAgent(t, "old", 1)
	hold := make(chan struct{})
	old.mu.Lock()
	old.hold = hold
	old.mu.Unlock()
	type result struct {
		files map[string]*os.File
		err   error
	}
	first := make(chan result, 1)
	go func() { f, err := Take(context.Background(), n.handoverPath, 2); first <- result{f, err} }()
	testkit.Eventually(t, 10*time.Second, "the running agent pausing for the first successor", func() bool {
		paused, _, _ := old.counts()
		return paused == 1
	})
	// The second successor's connection is made before the first
	// exchange ends: it waits in the backlog of the socket being passed.
	c, err := net.Dial("unixpacket", n.handoverPath)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	second := make(chan result, 1)
	go func() { f, err := takeOver(context.Background(), c.(*net.UnixConn), 3); second <- result{f, err} }()
	close(hold)
	r1 := <-first
	if r1.err != nil {
		t.Fatal(r1.err)
	}
	if !<-oldTaken {
		t.Fatal("the running agent did not retire")
	}
	mid, midTaken := successor(t, "mid", r1.files, 2)
	r2 := <-second
	if r2.err != nil {
		t.Fatal(r2.err)
	}
	if !<-midTaken {
		t.Fatal("the first successor did not hand over to the second")
	}
	if _, _, retired := mid.counts(); !retired {
		t.Fatal("the first successor did not retire")
	}
	successor(t, "new", r2.files, 3)
	if got := whoAnswers(t, n.cniPath); got != "new" {
		t.Fatalf("%q answered, want new", got)
	}
}

func TestAnEqualRankIsRefused(t *testing.T) {
	n := newNode(t)
	old, _ := n.firstAgent(t, "old", 5)
	var refused *Refused
	if _, err := Take(context.Background(), n.handoverPath, 5); !errors.As(err, &refused) {
		t.Fatalf("Take with the running agent's own rank: %v, want a refusal", err)
	}
	if paused, _, _ := old.counts(); paused != 0 {
		t.Fatal("paused for an equal rank")
	}
}

// A successor that confirms after the running agent's bound is told to
// resume and serves nothing: never two agents accepting.
func TestALateConfirmationIsAnsweredResume(t *testing.T) {
	defer func(d time.Duration) { confirmTimeout = d }(confirmTimeout)
	confirmTimeout = 100 * time.Millisecond
	n := newNode(t)
	old, oldTaken := n.firstAgent(t, "old", 1)
	uc := rawTake(t, n.handoverPath, "take "+protocol+" 2")
	defer uc.Close()
	testkit.Eventually(t, 10*time.Second, "the running agent resumed", func() bool {
		_, resumed, _ := old.counts()
		return resumed == 1
	})
	uc.Write([]byte("got"))
	buf := make([]byte, maxMessage)
	n2, err := uc.Read(buf)
	if err != nil || string(buf[:n2]) != "resume" {
		t.Fatalf("a late \"got\" was answered %q, %v; want resume", buf[:n2], err)
	}
	select {
	case <-oldTaken:
		t.Fatal("Serve reported a hand-over after a late confirmation")
	default:
	}
	if got := whoAnswers(t, n.cniPath); got != "old" {
		t.Fatalf("%q answered, want old", got)
	}
}

// fakeRunningAgent accepts one hand-over request on a fresh socket and
// then does what act says, in place of a real running agent that dies.
func fakeRunningAgent(t *testing.T, path string, act func(*net.UnixConn)) {
	ln, err := unixsock.Listen("unixpacket", path)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	t.Cleanup(func() { ln.Close(); <-done })
	go func() {
		defer close(done)
		uc, err := ln.AcceptUnix()
		if err != nil {
			return
		}
		defer uc.Close()
		buf := make([]byte, maxMessage)
		if _, err := uc.Read(buf); err == nil {
			act(uc)
		}
	}()
}

func TestARunningAgentThatDiesBeforeAnsweringInterrupts(t *testing.T) {
	n := newNode(t)
	fakeRunningAgent(t, n.handoverPath, func(*net.UnixConn) {})
	if _, err := Take(context.Background(), n.handoverPath, 2); !errors.Is(err, ErrInterrupted) {
		t.Fatalf("Take from an agent that died mid-exchange: %v, want ErrInterrupted", err)
	}
}

// A running agent that dies after sending its sockets: only the
// successor's copies keep them, so it serves them.
func TestARunningAgentThatDiesAfterSendingLeavesTheSocketsToTheSuccessor(t *testing.T) {
	n := newNode(t)
	cni, err := unixsock.Listen("unix", n.cniPath)
	if err != nil {
		t.Fatal(err)
	}
	cni.SetUnlinkOnClose(false)
	fakeRunningAgent(t, n.handoverPath, func(uc *net.UnixConn) {
		hf, err := cni.File() // stands in for the hand-over socket too
		if err != nil {
			t.Error(err)
			return
		}
		defer hf.Close()
		cf, err := cni.File()
		if err != nil {
			t.Error(err)
			return
		}
		defer cf.Close()
		hfd, _ := rawFD(hf)
		cfd, _ := rawFD(cf)
		uc.WriteMsgUnix([]byte("sockets "+HandoverSocket+" cni"), unix.UnixRights(hfd, cfd), nil)
		cni.Close() // dies: its copies go
	})
	files, err := Take(context.Background(), n.handoverPath, 2)
	if err != nil {
		t.Fatalf("Take from an agent that died after sending: %v, want its sockets", err)
	}
	ln, err := Listener(files["cni"])
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range files {
		f.Close()
	}
	newAgentSide(t, "new", ln)
	if got := whoAnswers(t, n.cniPath); got != "new" {
		t.Fatalf("%q answered, want new", got)
	}
}

// openFDs counts this process's open descriptors.
func openFDs(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(ents)
}

// Neither side keeps a descriptor from an exchange that did not happen.
func TestFailedExchangesLeakNoDescriptors(t *testing.T) {
	n := newNode(t)
	old, _ := n.firstAgent(t, "old", 5)
	before := openFDs(t)
	var refused *Refused
	for range 3 {
		if _, err := Take(context.Background(), n.handoverPath, 4); !errors.As(err, &refused) {
			t.Fatalf("older rank: %v", err)
		}
		uc := rawTake(t, n.handoverPath, "take "+protocol+" 6")
		uc.Close()
	}
	testkit.Eventually(t, 10*time.Second, "the running agent resumed three times", func() bool {
		_, resumed, _ := old.counts()
		return resumed == 3
	})
	testkit.Eventually(t, 10*time.Second, "as many descriptors open as before", func() bool {
		return openFDs(t) <= before
	})
}

// A successor that gives up while the running agent pauses leaves it
// serving: the running agent finds it gone and resumes.
func TestASuccessorThatGivesUpMidPauseLeavesTheAgentServing(t *testing.T) {
	n := newNode(t)
	old, oldTaken := n.firstAgent(t, "old", 1)
	hold := make(chan struct{})
	old.mu.Lock()
	old.hold = hold
	old.mu.Unlock()
	ctx, cancel := context.WithCancel(context.Background())
	took := make(chan error, 1)
	go func() { _, err := Take(ctx, n.handoverPath, 2); took <- err }()
	testkit.Eventually(t, 10*time.Second, "the running agent pausing", func() bool {
		paused, _, _ := old.counts()
		return paused == 1
	})
	cancel()
	if err := <-took; err == nil {
		t.Fatal("a cancelled Take returned sockets")
	}
	close(hold)
	testkit.Eventually(t, 10*time.Second, "the running agent resumed", func() bool {
		_, resumed, _ := old.counts()
		return resumed == 1
	})
	select {
	case <-oldTaken:
		t.Fatal("Serve reported a hand-over to a successor that gave up")
	default:
	}
	if got := whoAnswers(t, n.cniPath); got != "old" {
		t.Fatalf("%q answered, want old", got)
	}
}

// Serving tells a served hand-over socket from none and from a dead
// agent's, and its probe is no request: the agent neither pauses nor
// refuses, and a Take after it works.
func TestServingProbesWithoutAsking(t *testing.T) {
	n := newNode(t)
	if Serving(n.handoverPath) {
		t.Fatal("Serving with no socket")
	}
	old, _ := n.firstAgent(t, "old", 1)
	if !Serving(n.handoverPath) {
		t.Fatal("not Serving while an agent serves")
	}
	if paused, resumed, retired := old.counts(); paused != 0 || resumed != 0 || retired {
		t.Fatalf("a probe made the agent pause %d, resume %d, retire %v", paused, resumed, retired)
	}
	files, err := Take(context.Background(), n.handoverPath, 2)
	if err != nil {
		t.Fatalf("Take after a probe: %v", err)
	}
	for _, f := range files {
		f.Close()
	}
}
