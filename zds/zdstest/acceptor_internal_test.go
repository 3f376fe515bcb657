package zdstest

import (
	"bufio"
	"fmt"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/inpod-dev/inpod/internal/testkit"
	"github.com/inpod-dev/inpod/netns"
	"github.com/inpod-dev/inpod/netns/netnstest"
)

type answered struct {
	mu   sync.Mutex
	seen []string // uid/port
}

func (a *answered) answer(z *Standin) func(uid string, port, fd int) {
	return func(uid string, port, fd int) {
		a.mu.Lock()
		a.seen = append(a.seen, fmt.Sprintf("%s/%d", uid, port))
		a.mu.Unlock()
		z.answer(uid, port, fd)
	}
}

// bindInPod binds a dual-stack listener on port in the pod's netns, as an
// Add does.
func bindInPod(t *testing.T, pod *netnstest.NetNS, port int) []*boundSocket {
	t.Helper()
	sw, err := newNSSwitch()
	if err != nil {
		t.Fatal(err)
	}
	defer sw.close()
	var socks []*boundSocket
	err = sw.in(pod.Open(t), func() error {
		b, err := newSocket(port, true, true)
		if err != nil {
			return err
		}
		socks = append(socks, b)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		for _, b := range socks {
			b.Close()
		}
	})
	return socks
}

// ask connects from inside the pod and returns the stand-in's answer line.
func ask(pod *netnstest.NetNS, network, addr string) (string, error) {
	var line string
	err := netns.DoPath(pod.Path, func() error {
		c, err := net.DialTimeout(network, addr, 2*time.Second)
		if err != nil {
			return err
		}
		defer c.Close()
		c.SetReadDeadline(time.Now().Add(5 * time.Second))
		line, err = bufio.NewReader(c).ReadString('\n')
		return err
	})
	return strings.TrimSpace(line), err
}

func TestAcceptorAnswersEachFamilyWithThePeerAndOriginalDestination(t *testing.T) {
	pod := netnstest.New(t)
	z := New(Config{})
	var got answered
	acc, err := newAcceptor(got.answer(z))
	if err != nil {
		t.Fatal(err)
	}
	defer acc.stop()
	socks := bindInPod(t, pod, PortHBONE)
	for _, b := range socks {
		if err := acc.serve("u", b); err != nil {
			t.Fatal(err)
		}
	}
	for _, tc := range []struct{ network, addr, want string }{
		{"tcp4", "127.0.0.1:15008", "ztunnel-standin port=15008 orig=127.0.0.1:15008 peer=127.0.0.1:"},
		{"tcp6", "[::1]:15008", "ztunnel-standin port=15008 orig=[::1]:15008 peer=[::1]:"},
	} {
		// Several at once: one epoll event may carry a backlog of them.
		var wg sync.WaitGroup
		for range 5 {
			wg.Go(func() {
				line, err := ask(pod, tc.network, tc.addr)
				if err != nil || !strings.HasPrefix(line, tc.want) {
					t.Errorf("%s: answer %q, %v; want prefix %q", tc.network, line, err, tc.want)
				}
			})
		}
		wg.Wait()
	}
	conns := z.AcceptedConns()
	if len(conns) != 10 {
		t.Fatalf("recorded %d connections, want 10: %v", len(conns), conns)
	}
	for _, c := range conns {
		if c.UID != "u" || c.Port != PortHBONE {
			t.Errorf("recorded %+v, want uid u on %d", c, PortHBONE)
		}
	}
}

func TestAcceptorForgetsAClosedListener(t *testing.T) {
	pod := netnstest.New(t)
	z := New(Config{})
	acc, err := newAcceptor(z.answer)
	if err != nil {
		t.Fatal(err)
	}
	defer acc.stop()
	socks := append(bindInPod(t, pod, PortInbound), bindInPod(t, pod, PortOutbound)...)
	// One closed before it is served (a Del racing the Ack's aftermath).
	socks[1].Close()
	for _, b := range socks {
		if err := acc.serve("u", b); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := ask(pod, "tcp4", "127.0.0.1:15006"); err != nil {
		t.Fatal(err)
	}
	socks[0].Close()
	acc.mu.Lock()
	left := len(acc.socks)
	acc.mu.Unlock()
	if left != 0 {
		t.Errorf("the acceptor still holds %d listeners after both closed", left)
	}
	if line, err := ask(pod, "tcp4", "127.0.0.1:15006"); err == nil {
		t.Errorf("a closed listener answered %q", line)
	}
}

func TestAcceptorStopEndsItsLoopAndRefusesMore(t *testing.T) {
	pod := netnstest.New(t)
	acc, err := newAcceptor(New(Config{}).answer)
	if err != nil {
		t.Fatal(err)
	}
	socks := bindInPod(t, pod, PortOutbound)
	stopped := make(chan struct{})
	go func() { acc.stop(); close(stopped) }()
	testkit.Eventually(t, 10*time.Second, "stop to return", func() bool {
		select {
		case <-stopped:
			return true
		default:
			return false
		}
	})
	if err := acc.serve("u", socks[0]); err == nil {
		t.Error("a stopped acceptor took a listener")
	}
}

// testapp serves on a dual-stack socket: IPv4 arrives v4-mapped there, and
// OriginalDst must still read the IPv4 conntrack entry and print IPv4.
func TestOriginalDstOnADualStackListener(t *testing.T) {
	pod := netnstest.New(t)
	for _, tc := range []struct{ dial, want string }{
		{"127.0.0.1", "127.0.0.1:"},
		{"::1", "[::1]:"},
	} {
		var got string
		err := netns.DoPath(pod.Path, func() error {
			ln, err := net.Listen("tcp", ":0")
			if err != nil {
				return err
			}
			defer ln.Close()
			port := ln.Addr().(*net.TCPAddr).Port
			c, err := net.Dial("tcp", net.JoinHostPort(tc.dial, fmt.Sprint(port)))
			if err != nil {
				return err
			}
			defer c.Close()
			s, err := ln.Accept()
			if err != nil {
				return err
			}
			defer s.Close()
			got = OriginalDst(s.(*net.TCPConn))
			tc.want += fmt.Sprint(port)
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		if got != tc.want {
			t.Errorf("a connection to %s: OriginalDst %q, want %q", tc.dial, got, tc.want)
		}
	}
}
