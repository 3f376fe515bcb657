// Package waitready is the check of inpod's init container (gate value
// initcontainer, cmd/inpod-waitready): run first among a pod's init
// containers, it returns only once redirection to ztunnel is in place in
// the pod's own network namespace, so the application containers, which
// the kubelet starts only after every init container succeeded, never run
// unredirected, even on a node whose scheduling was not gated.
//
// # What it checks, without privilege
//
// Each attempt, from inside the pod's netns, as any uid, with no
// capabilities, changing nothing:
//
//  1. ztunnel's in-pod listeners 15001 (outbound), 15006 (inbound) and 15008
//     (HBONE) are in LISTEN state in this netns: /proc/thread-self/net/tcp
//     and tcp6, which list the sockets of the reader's own netns to anyone.
//     ztunnel binds them when the agent hands it the pod (ZDS Add) and the
//     agent's CNI ADD waits for that.
//  2. A TCP connection to an address outside the pod is delivered to a
//     socket in this netns listening on 15001: after the handshake, the
//     socket table holds a socket on local port 15001 whose peer is the
//     probe's own local address. Only a nat redirect in this netns can put
//     the far end of a connection to an off-pod address inside the pod.
//     By default the address is fixed per family, 192.0.2.1 and 2001:db8::1
//     (documentation ranges, RFC 5737 and 3849), port 9, probed in each
//     family the pod has a route to it in (its default route): the
//     redirect happens in nat OUTPUT, after the route lookup and before the
//     packet leaves, so the address need not exist, and it works whatever
//     the default route looks like — a link-local next hop (Calico's
//     fe80::ecee:eeff:feee:eeee, which a redirected connection could not
//     be answered from) or no next hop at all (default dev eth0: ipvlan L3,
//     point-to-point CNIs). Unredirected, the probe leaves the pod towards
//     an address nobody holds and fails (refused, unreachable or timed out):
//     it cannot pass without the rules.
//
// The check reads nothing ztunnel sends: Istio's ztunnel answers a
// connection to an unknown destination by proxying it (it does not report
// the original destination as the test stand-in does), so the proof comes
// from the kernel's socket table alone and works the same with both.
//
// # What a success proves
//
// At that moment, in this pod's netns: listeners on ztunnel's three ports
// exist, and new outbound TCP of an ordinary process of the pod (no socket
// mark: the rules pass ztunnel's mark 0x539) to that address is redirected
// to the outbound listener, for each address family the pod has a route off
// the pod in (a family whose only source address would be link-local
// cannot reach a global destination at all, and is not probed). Being the first init container, nothing of the pod but its
// sandbox ran before it, so the listeners are not the pod's own.
//
// # What it cannot prove
//
//   - Inbound capture (PREROUTING to 15006): traffic the pod sends itself
//     never passes PREROUTING as remote traffic does; only the listener is
//     seen.
//   - That the listeners belong to ztunnel rather than another privileged
//     process that entered the netns, or that ztunnel can proxy (certificates,
//     upstream reachability).
//   - DNS capture (UDP 53 to 15053), and destinations other than the
//     probed one (the rules are per family, not per destination, so one
//     probe per family stands for the rest).
//   - That redirection stays: the agent's reconcile keeps it; an
//     application with CAP_NET_ADMIN can always mark its traffic past it.
//
// It runs after the CNI ADD: where the plugin is chained, an enrolled pod
// whose redirection failed never gets here (the ADD failed closed). It
// catches the pods that started without the plugin (a node the gates did
// not hold, inpod installed after the pod was scheduled): they wait here
// until the agent enrolls their running sandbox, or fail at the timeout with
// a message naming what is missing; the kubelet then restarts the init
// container, and the application still does not start.
package waitready

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"time"
)

// ztunnel's in-pod ports (see ../agent/redirect).
const (
	PortOutbound = 15001
	PortInbound  = 15006
	PortHBONE    = 15008
)

// Defaults of Config.
const (
	DefaultTimeout   = 5 * time.Minute
	DefaultProbePort = 9
	// A redirected probe ends on a listener in this netns: the kernel
	// completes it at once, so half a second is ample even for a check
	// throttled at its CPU limit (50m: 5 ms in every 100), and a probe
	// that left the pod costs a waiting pod no more than that.
	DefaultDialTimeout = 500 * time.Millisecond
	// The pod waits at most MaxBackoff (plus an attempt) after redirection
	// is in place; an attempt reads procfs and dials once or twice.
	DefaultMinBackoff = 50 * time.Millisecond
	DefaultMaxBackoff = time.Second
	// DefaultProcNet is the procfs view of the calling thread's netns (the
	// thread's, not the process's, so a test can run the check on a thread
	// inside another netns).
	DefaultProcNet = "/proc/thread-self/net"
)

// The default probe addresses, one per family: documentation ranges, which
// no network answers for (RFC 5737, RFC 3849), and which the in-pod rules
// redirect like any other off-pod destination.
var (
	DefaultProbeV4 = netip.MustParseAddr("192.0.2.1")
	DefaultProbeV6 = netip.MustParseAddr("2001:db8::1")
)

// Config configures a Check. Zero values take the defaults.
type Config struct {
	// Timeout bounds the whole wait; Run fails once it has passed (the
	// attempt under way then finishes first: up to DialTimeout per probe).
	Timeout time.Duration
	// Probes are ip:port addresses outside the pod the outbound check
	// connects to. Empty: DefaultProbeV4 and DefaultProbeV6 at ProbePort,
	// each if the netns routes it.
	Probes    []string
	ProbePort int
	// DialTimeout bounds one probe connection.
	DialTimeout time.Duration
	// MinBackoff and MaxBackoff pace the attempts (doubling).
	MinBackoff, MaxBackoff time.Duration
	// ProcNet is the procfs directory of the netns checked.
	ProcNet string
	// Progress, when set, is told each new reason the check still fails
	// (the init container's log while it waits).
	Progress func(string)
}

// Check waits for redirection in the calling thread's netns.
type Check struct {
	cfg Config
}

// New checks cfg and fills its defaults.
func New(cfg Config) (*Check, error) {
	if cfg.Timeout == 0 {
		cfg.Timeout = DefaultTimeout
	}
	if cfg.ProbePort == 0 {
		cfg.ProbePort = DefaultProbePort
	}
	if cfg.DialTimeout == 0 {
		cfg.DialTimeout = DefaultDialTimeout
	}
	if cfg.MinBackoff == 0 {
		cfg.MinBackoff = DefaultMinBackoff
	}
	if cfg.MaxBackoff == 0 {
		cfg.MaxBackoff = DefaultMaxBackoff
	}
	if cfg.ProcNet == "" {
		cfg.ProcNet = DefaultProcNet
	}
	if cfg.Timeout < 0 || cfg.DialTimeout < 0 || cfg.MinBackoff < 0 || cfg.MaxBackoff < cfg.MinBackoff {
		return nil, fmt.Errorf("waitready: timeouts must be positive and the maximum backoff at least the minimum")
	}
	if cfg.ProbePort < 1 || cfg.ProbePort > 65535 {
		return nil, fmt.Errorf("waitready: probe port %d out of range", cfg.ProbePort)
	}
	ports := []uint16{uint16(cfg.ProbePort)}
	for _, p := range cfg.Probes {
		ap, err := netip.ParseAddrPort(p)
		if err != nil {
			return nil, fmt.Errorf("waitready: probe %q: want ip:port ([ip]:port for IPv6): %v", p, err)
		}
		if ap.Addr().IsLoopback() {
			// Loopback is never redirected: a probe there proves nothing.
			return nil, fmt.Errorf("waitready: probe %q is a loopback address; it must be outside the pod", p)
		}
		ports = append(ports, ap.Port())
	}
	for _, p := range ports {
		// A probe of the pod's own address is not redirected (it leaves
		// through lo) and lands on the port it names: on 15001 it would
		// pass without any rule.
		if p == PortOutbound || p == PortInbound || p == PortHBONE {
			return nil, fmt.Errorf("waitready: probe port %d is one of ztunnel's; pick another", p)
		}
	}
	return &Check{cfg: cfg}, nil
}

// NotReady is why one attempt failed.
type NotReady struct {
	// MissingListeners are ztunnel's ports with no listener in the netns.
	MissingListeners []int
	// Probes says, per probed address, how an outbound connection failed
	// to reach ztunnel (empty when every probe did).
	Probes []string
	// RulesMissing: a probe was not redirected although ztunnel's outbound
	// listener is bound, so the redirection rules are what is missing.
	RulesMissing bool
}

func (e *NotReady) Error() string {
	var parts []string
	if e.RulesMissing {
		parts = append(parts, "the redirection rules are missing in this pod's network namespace (ztunnel's listeners are bound, but outbound traffic does not reach them)")
	}
	if len(e.MissingListeners) > 0 {
		ports := make([]string, len(e.MissingListeners))
		for i, p := range e.MissingListeners {
			ports[i] = strconv.Itoa(p)
		}
		parts = append(parts, fmt.Sprintf("ztunnel's listeners on port %s are not bound in this pod's network namespace (ztunnel has not started this pod's proxy, or is gone)", strings.Join(ports, ", ")))
	}
	parts = append(parts, e.Probes...)
	return strings.Join(parts, "; ")
}

// Run polls with backoff until redirection is in place (it returns what it
// saw) or the timeout passes (an error naming what is still missing). A
// cancelled ctx ends it early with the same kind of error.
func (c *Check) Run(ctx context.Context) (string, error) {
	start := time.Now()
	ctx, cancel := context.WithTimeout(ctx, c.cfg.Timeout)
	defer cancel()
	backoff := c.cfg.MinBackoff
	last := ""
	for {
		proof, err := c.Once(ctx)
		if err == nil {
			return proof, nil
		}
		if msg := err.Error(); msg != last && c.cfg.Progress != nil {
			c.cfg.Progress(msg)
			last = msg
		}
		t := time.NewTimer(backoff)
		select {
		case <-ctx.Done():
			t.Stop()
			return "", fmt.Errorf("redirection is not in place after %s: %w", time.Since(start).Round(time.Millisecond), err)
		case <-t.C:
		}
		backoff = min(2*backoff, c.cfg.MaxBackoff)
	}
}

// Once is one attempt: nil (with what it saw) when the listeners are bound
// and every probe was delivered to ztunnel's outbound listener in this
// netns, else a *NotReady (or an error reading procfs).
func (c *Check) Once(ctx context.Context) (string, error) {
	socks, err := readSockets(c.cfg.ProcNet)
	if err != nil {
		return "", fmt.Errorf("read the sockets of this network namespace: %w", err)
	}
	nr := &NotReady{MissingListeners: missingListeners(socks)}
	outboundBound := !slices.Contains(nr.MissingListeners, PortOutbound)
	targets := c.targets()
	if len(targets) == 0 {
		// No route off the pod in any family: nothing to prove outbound
		// redirection with, and such a pod is not what the gate is for.
		nr.Probes = append(nr.Probes, fmt.Sprintf("this pod's network namespace has no route off the pod (neither %s nor %s is routable), so outbound redirection cannot be tested", DefaultProbeV4, DefaultProbeV6))
	}
	var delivered []string
	for _, t := range targets {
		landed, err := c.probe(ctx, t)
		switch {
		case err != nil && outboundBound:
			// A redirected connection ends on the bound local listener:
			// refused, unreachable or unanswered, it left the pod.
			nr.RulesMissing = true
			nr.Probes = append(nr.Probes, fmt.Sprintf("an outbound connection to %s failed (%v) instead of reaching ztunnel's %d", t, err, PortOutbound))
		case err != nil:
			nr.Probes = append(nr.Probes, fmt.Sprintf("an outbound connection to %s did not reach ztunnel: %v", t, err))
		case landed == 0:
			nr.RulesMissing = nr.RulesMissing || outboundBound
			nr.Probes = append(nr.Probes, fmt.Sprintf("an outbound connection to %s left the pod unredirected", t))
		case landed != PortOutbound:
			nr.Probes = append(nr.Probes, fmt.Sprintf("an outbound connection to %s landed on port %d in this pod, not on ztunnel's %d", t, landed, PortOutbound))
		default:
			delivered = append(delivered, t)
		}
	}
	if len(nr.MissingListeners) > 0 || len(nr.Probes) > 0 {
		return "", nr
	}
	return fmt.Sprintf("redirection in place: ztunnel's listeners %d, %d, %d are bound in this pod's network namespace, and outbound connections to %s were delivered to its %d",
		PortOutbound, PortInbound, PortHBONE, strings.Join(delivered, ", "), PortOutbound), nil
}

func missingListeners(socks []socket) []int {
	var missing []int
	for _, port := range []int{PortOutbound, PortInbound, PortHBONE} {
		if !slices.ContainsFunc(socks, func(s socket) bool { return s.state == tcpStateListen && int(s.local.Port()) == port }) {
			missing = append(missing, port)
		}
	}
	return missing
}

// targets are the probe addresses, ip:port: the configured ones, or the
// default address of each family the netns routes.
func (c *Check) targets() []string {
	if len(c.cfg.Probes) > 0 {
		return c.cfg.Probes
	}
	var out []string
	for _, a := range []netip.Addr{DefaultProbeV4, DefaultProbeV6} {
		t := netip.AddrPortFrom(a, uint16(c.cfg.ProbePort)).String()
		if routed(t) {
			out = append(out, t)
		}
	}
	return out
}

// routed says whether the netns has a route to target, by the kernel's own
// route lookup (connecting a UDP socket sends nothing): the default route
// of any shape, or any other route covering it. A family disabled or
// without a route fails here. A link-local source address means the family
// has no address that can reach beyond the link (an IPv6 stack with no
// global address but a default route): not routed.
func routed(target string) bool {
	conn, err := net.Dial("udp", target)
	if err != nil {
		return false
	}
	defer conn.Close()
	me, err := netip.ParseAddrPort(conn.LocalAddr().String())
	return err == nil && !me.Addr().IsLinkLocalUnicast()
}

// peerWait bounds the wait for the accepted end of a probe to show in the
// socket table: on loopback the handshake's last ACK may be processed just
// after connect returns.
const peerWait = 500 * time.Millisecond

// probe connects to target and returns the local port of the socket in this
// netns that holds the connection's far end, or 0 when none does (the
// connection left the pod).
func (c *Check) probe(ctx context.Context, target string) (int, error) {
	// The dial gets its own bound so that the run's deadline does not turn
	// the last attempt's reason into "context deadline exceeded".
	dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), c.cfg.DialTimeout)
	defer cancel()
	var d net.Dialer
	conn, err := d.DialContext(dctx, "tcp", target)
	if err != nil {
		var oe *net.OpError
		if errors.As(err, &oe) && oe.Err != nil {
			err = oe.Err
		}
		return 0, err
	}
	defer conn.Close()
	me, err := netip.ParseAddrPort(conn.LocalAddr().String())
	if err != nil {
		return 0, err
	}
	me = netip.AddrPortFrom(me.Addr().Unmap().WithZone(""), me.Port())
	deadline := time.Now().Add(peerWait)
	for {
		socks, err := readSockets(c.cfg.ProcNet)
		if err != nil {
			return 0, err
		}
		for _, s := range socks {
			if s.remote == me && s.state != tcpStateListen {
				return int(s.local.Port()), nil
			}
		}
		if time.Now().After(deadline) {
			return 0, nil
		}
		time.Sleep(10 * time.Millisecond)
	}
}
