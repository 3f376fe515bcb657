package waitready_test

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/inpod-dev/inpod/agent/redirect"
	"github.com/inpod-dev/inpod/internal/testkit"
	"github.com/inpod-dev/inpod/netns"
	"github.com/inpod-dev/inpod/netns/netnstest"
	"github.com/inpod-dev/inpod/waitready"
	"github.com/inpod-dev/inpod/zds"
	ztunnel "github.com/inpod-dev/inpod/zds/zdstest"
)

// childEnv makes the test binary run the check instead of the tests (as the
// unprivileged child): its value is the check's timeout.
const childEnv = "INPOD_WAITREADY_TEST_CHILD"

// probeEnv, when set, is the child's one probe address.
const probeEnv = "INPOD_WAITREADY_TEST_PROBE"

// nobody is the uid and gid the check runs as.
const nobody = 65534

func TestMain(m *testing.M) {
	if v := os.Getenv(childEnv); v != "" {
		os.Exit(child(v))
	}
	os.Exit(m.Run())
}

// child runs the check as the init container would, after making sure it
// really has no privilege.
func child(timeout string) int {
	status, err := os.ReadFile("/proc/self/status")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 3
	}
	if os.Geteuid() == 0 || !strings.Contains(string(status), "CapEff:\t0000000000000000") {
		fmt.Fprintf(os.Stderr, "child is privileged: euid %d\n%s", os.Geteuid(), status)
		return 3
	}
	d, err := time.ParseDuration(timeout)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 3
	}
	var probes []string
	if p := os.Getenv(probeEnv); p != "" {
		probes = []string{p}
	}
	c, err := waitready.New(waitready.Config{Timeout: d, Probes: probes, DialTimeout: 500 * time.Millisecond, MaxBackoff: 200 * time.Millisecond,
		Progress: func(msg string) { fmt.Fprintln(os.Stderr, "waiting:", msg) }})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 3
	}
	proof, err := c.Run(context.Background())
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	fmt.Println(proof)
	return 0
}

// Addresses of the test's namespaces: documentation and ULA ranges.
const (
	nodeIP4 = "198.51.100.1"
	podIP4  = "198.51.100.2"
	nodeIP6 = "fd42:51::1"
	podIP6  = "fd42:51::2"
)

// pod is a pod netns joined to a "node" netns by a veth pair, default routes
// (both families) via the node, a real ZDS server and the ztunnel stand-in
// connected to it.
type pod struct {
	ns      *os.File
	zds     *zds.Server
	standin *ztunnel.Standin
	stop    func()
}

type emptySource struct{}

func (emptySource) Snapshot(context.Context) ([]zds.Workload, error) { return nil, nil }

// routes is the shape of the pod's default routes, as CNIs make them.
type routes int

const (
	// viaNode: default via the node's address on the link (bridge CNIs).
	viaNode routes = iota
	// linkLocalGateway: Calico's, default via 169.254.1.1 (onlink) and
	// fe80::ecee:eeff:feee:eeee, the node side's link-local address.
	linkLocalGateway
	// noGateway: default dev eth0, no next hop (ipvlan L3, ptp CNIs).
	noGateway
)

const calicoGateway6 = "fe80::ecee:eeff:feee:eeee"

func newPod(t *testing.T) *pod { return newPodWith(t, viaNode) }

func newPodWith(t *testing.T, r routes) *pod {
	t.Helper()
	node, p := netnstest.New(t), netnstest.New(t)
	node.Exec(t, "ip", "link", "add", "veth0", "type", "veth", "peer", "name", "eth0", "netns", p.Name)
	node.Exec(t, "ip", "addr", "add", nodeIP4+"/24", "dev", "veth0")
	node.Exec(t, "ip", "-6", "addr", "add", nodeIP6+"/64", "dev", "veth0", "nodad")
	node.Exec(t, "ip", "link", "set", "veth0", "up")
	p.Exec(t, "ip", "addr", "add", podIP4+"/24", "dev", "eth0")
	p.Exec(t, "ip", "-6", "addr", "add", podIP6+"/64", "dev", "eth0", "nodad")
	p.Exec(t, "ip", "link", "set", "eth0", "up")
	switch r {
	case viaNode:
		p.Exec(t, "ip", "route", "add", "default", "via", nodeIP4)
		p.Exec(t, "ip", "-6", "route", "add", "default", "via", nodeIP6)
	case linkLocalGateway:
		node.Exec(t, "ip", "addr", "add", "169.254.1.1/32", "dev", "veth0")
		node.Exec(t, "ip", "-6", "addr", "add", calicoGateway6+"/64", "dev", "veth0", "nodad")
		p.Exec(t, "ip", "route", "add", "default", "via", "169.254.1.1", "dev", "eth0", "onlink")
		p.Exec(t, "ip", "-6", "route", "add", "default", "via", calicoGateway6, "dev", "eth0")
	case noGateway:
		p.Exec(t, "ip", "route", "add", "default", "dev", "eth0")
		p.Exec(t, "ip", "-6", "route", "add", "default", "dev", "eth0")
	}

	sock := filepath.Join(testkit.ShortTempDir(t, "waitready-"), "ztunnel.sock")
	srv, err := zds.NewServer(zds.Config{SocketPath: sock, Source: emptySource{}, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	if err := srv.Listen(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { srv.Serve(ctx); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	z, stop := ztunnel.Start(t, ztunnel.Config{SocketPath: sock})
	testkit.Eventually(t, 10*time.Second, "the stand-in connected", func() bool { return srv.State().Ready })
	return &pod{ns: p.Open(t), zds: srv, standin: z, stop: stop}
}

// addToZtunnel hands the pod to the stand-in, which binds its listeners in
// the pod's netns before it acks.
func (p *pod) addToZtunnel(t *testing.T) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := p.zds.Add(ctx, zds.Workload{UID: "uid-1", Name: "app", Namespace: "mesh", NetNS: p.ns}); err != nil {
		t.Fatal(err)
	}
}

// applyRules installs the agent's own rule set (nftables backend).
func (p *pod) applyRules(t *testing.T) {
	t.Helper()
	engine := redirect.NewEngine(redirect.NewNFTables())
	if _, err := engine.Apply(p.ns, redirect.Options{}); err != nil {
		t.Fatal(err)
	}
}

// childBinary is a copy of the test binary that uid nobody can run (the
// build directory is private to root).
func childBinary(t *testing.T) string {
	t.Helper()
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	dir := testkit.ShortTempDir(t, "waitready-bin-")
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	in, err := os.Open(self)
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	bin := filepath.Join(dir, "waitready.test")
	out, err := os.OpenFile(bin, os.O_CREATE|os.O_WRONLY, 0o755)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.Copy(out, in); err != nil {
		t.Fatal(err)
	}
	if err := out.Close(); err != nil {
		t.Fatal(err)
	}
	return bin
}

type result struct {
	exit           int
	stdout, stderr string
}

// startCheck starts the check as uid nobody, with no capabilities, inside
// the pod's netns: the process forks from a thread that is in it. wait
// returns its result.
func startCheck(t *testing.T, p *pod, timeout time.Duration, env ...string) (wait func() result) {
	t.Helper()
	wait, _ = startCheckLive(t, p, timeout, env...)
	return wait
}

// startCheckLive is startCheck that also gives the child's stderr as it
// is written.
func startCheckLive(t *testing.T, p *pod, timeout time.Duration, env ...string) (wait func() result, stderr *testkit.Buffer) {
	t.Helper()
	cmd := exec.Command(childBinary(t), "-test.run=^$")
	cmd.Env = append(append(os.Environ(), childEnv+"="+timeout.String()), env...)
	var stdout bytes.Buffer
	stderr = &testkit.Buffer{}
	cmd.Stdout, cmd.Stderr = &stdout, stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: nobody, Gid: nobody}, Pdeathsig: syscall.SIGKILL}
	if err := netns.Do(p.ns, cmd.Start); err != nil {
		t.Fatal(err)
	}
	var res *result
	wait = func() result {
		if res == nil {
			err := cmd.Wait()
			res = &result{exit: cmd.ProcessState.ExitCode(), stdout: stdout.String(), stderr: stderr.String()}
			if err != nil && res.exit < 0 {
				t.Fatalf("check: %v", err)
			}
			if res.exit == 3 {
				t.Fatalf("the check's child could not run as wanted: %s", res.stderr)
			}
		}
		return *res
	}
	t.Cleanup(func() {
		if res == nil {
			cmd.Process.Kill()
			cmd.Wait()
		}
	})
	return wait, stderr
}

func expectFail(t *testing.T, res result, wants ...string) {
	t.Helper()
	if res.exit != 1 {
		t.Fatalf("check exited %d, want 1 (stdout %q, stderr %q)", res.exit, res.stdout, res.stderr)
	}
	t.Logf("the check's message:\n%s", res.stderr)
	for _, w := range wants {
		if !strings.Contains(res.stderr, w) {
			t.Errorf("the check's message lacks %q:\n%s", w, res.stderr)
		}
	}
}

func TestPassesWithListenersAndRules(t *testing.T) {
	p := newPod(t)
	p.applyRules(t)
	p.addToZtunnel(t)
	res := startCheck(t, p, 10*time.Second)()
	if res.exit != 0 {
		t.Fatalf("check exited %d: %s", res.exit, res.stderr)
	}
	expectPass(t, p, res)
}

// expectPass checks that both families were probed at the default
// addresses and that the stand-in's outbound listener took the probes with
// their original destinations.
func expectPass(t *testing.T, p *pod, res result) {
	t.Helper()
	if res.exit != 0 {
		t.Fatalf("check exited %d: %s", res.exit, res.stderr)
	}
	for _, want := range []string{"192.0.2.1:9", "[2001:db8::1]:9", "delivered to its 15001"} {
		if !strings.Contains(res.stdout, want) {
			t.Errorf("the check's proof lacks %q: %s", want, res.stdout)
		}
	}
	got := map[string]bool{}
	for _, a := range p.standin.AcceptedConns() {
		if a.Port == ztunnel.PortOutbound {
			got[a.OrigDst] = true
		}
	}
	if !got["192.0.2.1:9"] || !got["[2001:db8::1]:9"] {
		t.Errorf("the stand-in's outbound listener accepted %v, want both probes", p.standin.AcceptedConns())
	}
}

// Whatever the default route's shape, a redirected pod passes and an
// unredirected one fails: the probe addresses do not depend on a next hop.
// (Probing the next hop failed both: a connection redirected from a
// link-local destination is never answered, and a route without a next hop
// gave nothing to probe.)
func TestDefaultRouteShapes(t *testing.T) {
	for _, c := range []struct {
		name string
		r    routes
	}{{"link-local gateway", linkLocalGateway}, {"no gateway", noGateway}} {
		t.Run(c.name, func(t *testing.T) {
			p := newPodWith(t, c.r)
			p.addToZtunnel(t)
			expectFail(t, startCheck(t, p, time.Second)(), "the redirection rules are missing",
				"an outbound connection to 192.0.2.1:9 failed")
			p.applyRules(t)
			expectPass(t, p, startCheck(t, p, 10*time.Second)())
		})
	}
}

// A pod with no route off the pod has nothing to probe: the check fails,
// naming that, rather than passing on the listeners alone.
func TestFailsWithoutAnyRoute(t *testing.T) {
	p := newPod(t)
	p.applyRules(t)
	p.addToZtunnel(t)
	if err := netns.Do(p.ns, func() error {
		for _, args := range [][]string{{"ip", "route", "del", "default"}, {"ip", "-6", "route", "del", "default"}} {
			if out, err := exec.Command(args[0], args[1:]...).CombinedOutput(); err != nil {
				return fmt.Errorf("%v: %v: %s", args, err, out)
			}
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	expectFail(t, startCheck(t, p, time.Second)(), "has no route off the pod (neither 192.0.2.1 nor 2001:db8::1 is routable)")
}

func TestWaitsUntilRedirectionAppears(t *testing.T) {
	p := newPod(t)
	wait, stderr := startCheckLive(t, p, 30*time.Second)
	// The agent enrolls the running sandbox later (inpod installed after
	// the pod started): the check keeps polling meanwhile.
	testkit.Eventually(t, 10*time.Second, "the check reporting what it waits for", func() bool {
		return strings.Contains(stderr.String(), "waiting:")
	})
	p.applyRules(t)
	p.addToZtunnel(t)
	res := wait()
	if res.exit != 0 {
		t.Fatalf("check exited %d: %s", res.exit, res.stderr)
	}
	if !strings.Contains(res.stderr, "waiting: ztunnel's listeners on port 15001, 15006, 15008 are not bound") {
		t.Errorf("the check did not log what it waited for: %q", res.stderr)
	}
}

func TestFailsWithoutRules(t *testing.T) {
	p := newPod(t)
	p.addToZtunnel(t)
	expectFail(t, startCheck(t, p, time.Second)(),
		"redirection is not in place after",
		"the redirection rules are missing",
		"an outbound connection to 192.0.2.1:9 failed",
		"instead of reaching ztunnel's 15001")
}

func TestFailsWithoutListeners(t *testing.T) {
	p := newPod(t)
	p.applyRules(t)
	res := startCheck(t, p, time.Second)()
	expectFail(t, res, "ztunnel's listeners on port 15001, 15006, 15008 are not bound in this pod's network namespace")
	if strings.Contains(res.stderr, "rules are missing") {
		t.Errorf("blames the rules, which are there: %s", res.stderr)
	}
}

func TestFailsWhenZtunnelIsGone(t *testing.T) {
	p := newPod(t)
	p.applyRules(t)
	p.addToZtunnel(t)
	if res := startCheck(t, p, 10*time.Second)(); res.exit != 0 {
		t.Fatalf("before ztunnel left: check exited %d: %s", res.exit, res.stderr)
	}
	p.stop() // ztunnel exits: its listeners close, the rules stay
	res := startCheck(t, p, time.Second)()
	expectFail(t, res, "not bound in this pod's network namespace (ztunnel has not started this pod's proxy, or is gone)",
		"an outbound connection to 192.0.2.1:9 did not reach ztunnel: connect: connection refused")
	if strings.Contains(res.stderr, "rules are missing") {
		t.Errorf("blames the rules, which are there: %s", res.stderr)
	}
}

// A probe of the pod's own address leaves through lo, unredirected, and
// lands on the pod's own socket: the check must not take that for ztunnel.
func TestProbeOfThePodsOwnAddressDoesNotPass(t *testing.T) {
	p := newPod(t)
	p.applyRules(t)
	p.addToZtunnel(t)
	var ln net.Listener
	if err := netns.Do(p.ns, func() (err error) {
		ln, err = net.Listen("tcp4", podIP4+":8080")
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	expectFail(t, startCheck(t, p, time.Second, probeEnv+"="+podIP4+":8080")(),
		"an outbound connection to "+podIP4+":8080 landed on port 8080 in this pod, not on ztunnel's 15001")
}
