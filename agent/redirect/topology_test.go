package redirect_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/inpod-dev/inpod/agent/redirect"
	"github.com/inpod-dev/inpod/netns"
	"github.com/inpod-dev/inpod/netns/netnstest"
	ztunnel "github.com/inpod-dev/inpod/zds/zdstest"
)

// Addresses of the test's own namespaces: documentation and ULA ranges, so
// nothing here can reach or resemble a real network.
const (
	nodeIP4    = "198.51.100.1"
	podIP4     = "198.51.100.2"
	outsideIP4 = "203.0.113.10"
	nodeIP6    = "fd42:51::1"
	podIP6     = "fd42:51::2"
	outsideIP6 = "fd42:99::10"
	appPort    = 8080
)

// topology is a pod netns joined to a "node" netns by a veth pair, with an
// "outside" address on the node, an application in the pod on appPort,
// listeners on ztunnel's ports in the pod, and a server on the outside
// address. Deleting the namespaces at cleanup takes every device with them.
type topology struct {
	node, pod         *netnstest.NetNS
	nodeFile, podFile *os.File
}

func newTopology(t *testing.T) *topology {
	t.Helper()
	tp := &topology{node: netnstest.New(t), pod: netnstest.New(t)}
	tp.nodeFile, tp.podFile = tp.node.Open(t), tp.pod.Open(t)
	n, p := tp.node, tp.pod
	n.Exec(t, "ip", "link", "add", "veth0", "type", "veth", "peer", "name", "eth0", "netns", p.Name)
	n.Exec(t, "ip", "addr", "add", nodeIP4+"/24", "dev", "veth0")
	n.Exec(t, "ip", "-6", "addr", "add", nodeIP6+"/64", "dev", "veth0", "nodad")
	n.Exec(t, "ip", "link", "set", "veth0", "up")
	// The "outside" server's address sits on the node's loopback (this
	// kernel has no dummy interfaces); from the pod it is a routed address.
	n.Exec(t, "ip", "addr", "add", outsideIP4+"/32", "dev", "lo")
	n.Exec(t, "ip", "-6", "addr", "add", outsideIP6+"/128", "dev", "lo", "nodad")
	p.Exec(t, "ip", "addr", "add", podIP4+"/24", "dev", "eth0")
	p.Exec(t, "ip", "-6", "addr", "add", podIP6+"/64", "dev", "eth0", "nodad")
	p.Exec(t, "ip", "link", "set", "eth0", "up")
	p.Exec(t, "ip", "route", "add", "default", "via", nodeIP4)
	p.Exec(t, "ip", "-6", "route", "add", "default", "via", nodeIP6)

	serve(t, tp.nodeFile, "tcp4", net.JoinHostPort(outsideIP4, fmt.Sprint(appPort)), "outside", 0)
	serve(t, tp.nodeFile, "tcp6", net.JoinHostPort(outsideIP6, fmt.Sprint(appPort)), "outside", 0)
	serve(t, tp.podFile, "tcp4", fmt.Sprintf("0.0.0.0:%d", appPort), "app", 0)
	serve(t, tp.podFile, "tcp6", fmt.Sprintf("[::]:%d", appPort), "app", 0)
	for _, port := range []int{redirect.PortOutbound, redirect.PortInbound, redirect.PortHBONE} {
		serve(t, tp.podFile, "tcp4", fmt.Sprintf("0.0.0.0:%d", port), fmt.Sprintf("ztunnel-%d", port), redirect.ZtunnelMark)
		serve(t, tp.podFile, "tcp6", fmt.Sprintf("[::]:%d", port), fmt.Sprintf("ztunnel-%d", port), redirect.ZtunnelMark)
	}
	return tp
}

func markControl(mark int) func(string, string, syscall.RawConn) error {
	return func(network, _ string, rc syscall.RawConn) error {
		var err error
		cerr := rc.Control(func(fd uintptr) {
			if mark != 0 {
				err = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_MARK, mark)
			}
			if err == nil && network == "tcp6" {
				err = unix.SetsockoptInt(int(fd), unix.IPPROTO_IPV6, unix.IPV6_V6ONLY, 1)
			}
		})
		return errors.Join(cerr, err)
	}
}

// serve answers each connection with "<label> orig=<original dst>
// peer=<remote>" and closes it.
func serve(t *testing.T, ns *os.File, network, addr, label string, mark int) {
	t.Helper()
	var ln net.Listener
	err := netns.Do(ns, func() error {
		var err error
		lc := net.ListenConfig{Control: markControl(mark)}
		ln, err = lc.Listen(context.Background(), network, addr)
		return err
	})
	if err != nil {
		t.Fatalf("listen %s %s: %v", network, addr, err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			fmt.Fprintf(c, "%s orig=%s peer=%s", label, ztunnel.OriginalDst(c.(*net.TCPConn)), c.RemoteAddr())
			c.Close()
		}
	}()
}

// reply connects from inside ns (with SO_MARK mark when non-zero) and
// returns the server's line.
func reply(t *testing.T, ns *os.File, addr string, mark int) string {
	t.Helper()
	var out string
	err := netns.Do(ns, func() error {
		d := net.Dialer{Timeout: 3 * time.Second, Control: func(network, a string, rc syscall.RawConn) error {
			return markControl(mark)("", a, rc)
		}}
		c, err := d.Dial("tcp", addr)
		if err != nil {
			return err
		}
		defer c.Close()
		c.SetReadDeadline(time.Now().Add(3 * time.Second))
		b, err := io.ReadAll(c)
		out = string(b)
		return err
	})
	if err != nil {
		t.Fatalf("connect to %s: %v", addr, err)
	}
	return out
}

func hostPort(ip string, port int) string { return net.JoinHostPort(ip, fmt.Sprint(port)) }

// expectLanding asserts which server answered a connection and, when orig
// is set, the original destination it saw.
func expectLanding(t *testing.T, what, got, label, orig string) {
	t.Helper()
	if !strings.HasPrefix(got, label+" ") {
		t.Errorf("%s: answered by %q, want %s", what, got, label)
		return
	}
	if orig != "" && !strings.Contains(got, "orig="+orig+" ") {
		t.Errorf("%s: %q, want original destination %s", what, got, orig)
	}
}

// netState is everything the engine may touch in a netns, as the kernel
// shows it: netfilter (nf_tables, which includes iptables-nft), policy
// rules and the routing table it uses. (Other routes are left out: the
// kernel adds IPv6 link-local routes on its own time after link up.)
func netState(t *testing.T, ns *netnstest.NetNS) string {
	t.Helper()
	return strings.Join([]string{
		ns.Exec(t, "nft", "list", "ruleset"),
		ns.Exec(t, "ip", "rule"),
		ns.Exec(t, "ip", "-6", "rule"),
		routesOfTable(ns.Exec(t, "ip", "route", "show", "table", "all")),
		routesOfTable(ns.Exec(t, "ip", "-6", "route", "show", "table", "all")),
	}, "\n")
}

func routesOfTable(routes string) string {
	var keep []string
	for _, l := range strings.Split(routes, "\n") {
		if strings.Contains(l, fmt.Sprintf("table %d ", redirect.RouteTable)) {
			keep = append(keep, l)
		}
	}
	return strings.Join(keep, "\n")
}
